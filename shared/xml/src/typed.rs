//! The check of a record against a definition's typed fields (see
//! `quire_messages::fields`): one check, run by the producer API before it
//! publishes an array and by the worker before it renders a record, so a
//! document holds only what its schema allows.
//!
//! Prepared once per definition ([`TypedCheck::new`] compiles the
//! patterns); checking a record walks the record once, with a lookup per
//! declared field.

use quire_messages::Definition;
use quire_messages::fields::{Field, FieldKind, Undeclared};
use regex::{Regex, RegexBuilder};
use serde_json::{Map, Value};

/// Why a record does not fit its definition's fields.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field {path:?}: expected {expected}, found {found}")]
pub struct TypeError {
    /// The field, dotted through objects, with `[i]` for an item (`lines[2].sku`).
    pub path: String,
    /// What the definition asks for (`decimal with at most 2 digits after the point`).
    pub expected: String,
    /// What the record holds (`a string`, `1.234`, `nothing`).
    pub found: String,
}

/// A definition's typed fields, ready to check records.
#[derive(Debug, Clone)]
pub struct TypedCheck {
    fields: Vec<CheckedField>,
    undeclared: Undeclared,
}

#[derive(Debug, Clone)]
struct CheckedField {
    field: Field,
    pattern: Option<Regex>,
    fields: Vec<CheckedField>,
}

impl TypedCheck {
    /// `None` for a definition without typed fields. A pattern that does
    /// not compile (a definition that skipped the check) matches nothing,
    /// so its records are refused rather than let through unchecked.
    pub fn new(definition: &Definition) -> Option<Self> {
        definition.is_typed().then(|| TypedCheck {
            fields: prepare(&definition.fields),
            undeclared: definition.undeclared,
        })
    }

    /// Checks `record` (a JSON object) against the declared fields.
    ///
    /// # Errors
    ///
    /// The first field that does not fit, in declaration order (then the
    /// first undeclared field, when the definition refuses them).
    pub fn check(&self, record: &Value) -> Result<(), TypeError> {
        let Value::Object(object) = record else {
            return Err(TypeError {
                path: String::new(),
                expected: "an object".into(),
                found: found(record),
            });
        };
        check_object(&self.fields, self.undeclared, object, &mut String::new())
    }
}

fn prepare(fields: &[Field]) -> Vec<CheckedField> {
    fields
        .iter()
        .map(|field| CheckedField {
            pattern: field.pattern.as_deref().map(|pattern| {
                RegexBuilder::new(&format!("^(?:{pattern})$"))
                    // XML Schema's `.` matches neither CR nor LF.
                    .crlf(true)
                    .build()
                    .unwrap_or_else(|_| Regex::new("[^\\s\\S]").expect("matches nothing"))
            }),
            fields: prepare(&field.fields),
            field: field.clone(),
        })
        .collect()
}

fn check_object(
    fields: &[CheckedField],
    undeclared: Undeclared,
    object: &Map<String, Value>,
    path: &mut String,
) -> Result<(), TypeError> {
    let length = path.len();
    for checked in fields {
        let field = &checked.field;
        push_name(path, &field.name);
        match object.get(&field.name) {
            None | Some(Value::Null) if field.required => {
                return Err(error(path, "a value (the field is required)", "nothing"));
            }
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) if field.repeated => {
                if field.required && items.is_empty() {
                    return Err(error(
                        path,
                        "at least one item (the field is required)",
                        "[]",
                    ));
                }
                let item_path = path.len();
                for (index, item) in items.iter().enumerate() {
                    path.push_str(&format!("[{index}]"));
                    if item.is_null() {
                        if field.required {
                            return Err(error(path, &expected(field), "null"));
                        }
                    } else {
                        check_value(checked, undeclared, item, path)?;
                    }
                    path.truncate(item_path);
                }
            }
            Some(value) if field.repeated => {
                return Err(error(
                    path,
                    &format!("an array of {}", expected(field)),
                    &found(value),
                ));
            }
            Some(value) => check_value(checked, undeclared, value, path)?,
        }
        path.truncate(length);
    }
    if undeclared == Undeclared::Refuse
        && let Some(key) = object
            .keys()
            .find(|key| !fields.iter().any(|checked| &checked.field.name == *key))
    {
        push_name(path, key);
        return Err(error(
            path,
            "no such field (the definition refuses undeclared fields)",
            "a value",
        ));
    }
    Ok(())
}

fn check_value(
    checked: &CheckedField,
    undeclared: Undeclared,
    value: &Value,
    path: &mut String,
) -> Result<(), TypeError> {
    let field = &checked.field;
    let fits = match (field.kind, value) {
        (FieldKind::String, Value::String(text)) => {
            let too_long = field
                .max_length
                .is_some_and(|limit| text.chars().count() > limit as usize);
            let unmatched = checked
                .pattern
                .as_ref()
                .is_some_and(|pattern| !pattern.is_match(text));
            !too_long && !unmatched
        }
        (FieldKind::Integer, Value::Number(number)) => {
            is_integer_text(number.as_str()) && digit_count(number.as_str()) <= MAX_DIGITS
        }
        (FieldKind::Decimal, Value::Number(number)) => {
            digit_count(number.as_str()) <= MAX_DIGITS
                && decimal_scale(number.as_str())
                    .is_some_and(|scale| field.scale.is_none_or(|limit| scale <= limit))
        }
        (FieldKind::Boolean, Value::Bool(_)) => true,
        (FieldKind::Date, Value::String(text)) => is_date(text),
        (FieldKind::Datetime, Value::String(text)) => is_date_time(text),
        (FieldKind::Object, Value::Object(object)) => {
            return check_object(&checked.fields, undeclared, object, path);
        }
        _ => false,
    };
    if fits {
        Ok(())
    } else {
        Err(error(path, &expected(field), &found(value)))
    }
}

fn push_name(path: &mut String, name: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(name);
}

fn error(path: &str, expected: &str, found: &str) -> TypeError {
    TypeError {
        path: path.to_owned(),
        expected: expected.to_owned(),
        found: found.to_owned(),
    }
}

/// What a field takes, in words.
fn expected(field: &Field) -> String {
    let mut words = match field.kind {
        FieldKind::String => "a string".to_owned(),
        FieldKind::Integer => {
            format!(
                "an integer (a number without fraction or exponent, at most {MAX_DIGITS} digits)"
            )
        }
        FieldKind::Decimal => {
            format!("a decimal (a number without exponent, at most {MAX_DIGITS} digits)")
        }
        FieldKind::Boolean => "true or false".to_owned(),
        FieldKind::Date => "a date YYYY-MM-DD".to_owned(),
        FieldKind::Datetime => {
            "an RFC 3339 date-time with its offset (2026-12-06T10:00:00+01:00)".to_owned()
        }
        FieldKind::Object => "an object".to_owned(),
    };
    if let Some(limit) = field.max_length {
        words.push_str(&format!(" of at most {limit} characters"));
    }
    if let Some(pattern) = &field.pattern {
        words.push_str(&format!(" matching {pattern:?}"));
    }
    if let Some(scale) = field.scale {
        words.push_str(&format!(" with at most {scale} digits after the point"));
    }
    words
}

/// What a value is, in words, with a short scalar's text.
fn found(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(flag) => flag.to_string(),
        Value::Number(number) => {
            let text = number.as_str();
            if text.len() <= 40 {
                text.to_owned()
            } else {
                format!("a number of {} characters", text.len())
            }
        }
        Value::String(text) if text.chars().count() <= 40 => format!("{text:?}"),
        Value::String(text) => format!("a string of {} characters", text.chars().count()),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// The most digits a typed integer or decimal holds: what XML Schema 1.0
/// requires every processor to support (`totalDigits` 18; libxml2 stops at
/// 24), so every receiver's validator reads every value. A larger number
/// is a string field, or an undeclared one.
pub const MAX_DIGITS: usize = 18;

fn digit_count(text: &str) -> usize {
    text.bytes().filter(u8::is_ascii_digit).count()
}

/// `-?[0-9]+`: JSON already forbids leading zeros and `+`.
fn is_integer_text(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|byte| byte.is_ascii_digit())
}

/// The digits after the point of a JSON number without exponent; `None`
/// for one with an exponent.
fn decimal_scale(text: &str) -> Option<u32> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let all_digits = |part: &str| part.bytes().all(|byte| byte.is_ascii_digit());
    (!whole.is_empty() && all_digits(whole) && all_digits(fraction))
        .then(|| u32::try_from(fraction.len()).unwrap_or(u32::MAX))
}

/// `YYYY-MM-DD`, a real day of years 0001-9999.
fn is_date(text: &str) -> bool {
    let bytes = text.as_bytes();
    let shaped = bytes.len() == 10
        && bytes[4] == b'-'
        && bytes[7] == b'-'
        && bytes
            .iter()
            .enumerate()
            .all(|(index, byte)| index == 4 || index == 7 || byte.is_ascii_digit());
    shaped && &text[..4] != "0000" && text.parse::<jiff::civil::Date>().is_ok()
}

/// `YYYY-MM-DDThh:mm:ss[.f+](Z|±hh:mm)`: RFC 3339 as XML Schema's dateTime
/// reads it (an offset of at most 14 hours, no leap second), a real instant.
fn is_date_time(text: &str) -> bool {
    let Some((date, time)) = text.split_once('T') else {
        return false;
    };
    if !is_date(date) {
        return false;
    }
    let (clock, offset) = if let Some(clock) = time.strip_suffix('Z') {
        (clock, None)
    } else if time.len() > 6 && matches!(time.as_bytes()[time.len() - 6], b'+' | b'-') {
        let (clock, offset) = time.split_at(time.len() - 6);
        (clock, Some(&offset[1..]))
    } else {
        return false;
    };
    let two_digits = |text: &str, limit: u32| {
        text.len() == 2
            && text.bytes().all(|byte| byte.is_ascii_digit())
            && text.parse::<u32>().is_ok_and(|value| value <= limit)
    };
    let (hms, fraction) = clock.split_once('.').unwrap_or((clock, "0"));
    let parts: Vec<&str> = hms.split(':').collect();
    let clock_fits = matches!(parts.as_slice(), [hours, minutes, seconds]
        if two_digits(hours, 23) && two_digits(minutes, 59) && two_digits(seconds, 59))
        && !fraction.is_empty()
        && fraction.bytes().all(|byte| byte.is_ascii_digit());
    let offset_fits = offset.is_none_or(|offset| match offset.split_once(':') {
        Some((hours, minutes)) => {
            two_digits(hours, 14) && two_digits(minutes, 59) && (hours != "14" || minutes == "00")
        }
        None => false,
    });
    clock_fits && offset_fits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_with(fields: &str, undeclared: Undeclared) -> TypedCheck {
        let definition = Definition {
            fields: serde_json::from_str(fields).unwrap(),
            undeclared,
            ..Definition::default()
        };
        definition.validate().unwrap();
        TypedCheck::new(&definition).unwrap()
    }

    fn record(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    const ORDERS: &str = r#"[
        {"name": "id", "type": "string", "required": true, "max_length": 8, "pattern": "[A-Z]{2}[0-9]+"},
        {"name": "amount", "type": "decimal", "required": true, "scale": 2},
        {"name": "count", "type": "integer"},
        {"name": "paid", "type": "boolean"},
        {"name": "day", "type": "date"},
        {"name": "at", "type": "datetime"},
        {"name": "lines", "type": "object", "repeated": true,
         "fields": [{"name": "sku", "type": "string", "required": true}]}]"#;

    #[test]
    fn records_that_fit_pass() {
        let check = check_with(ORDERS, Undeclared::Refuse);
        for fitting in [
            r#"{"id": "AB12", "amount": 10.50}"#,
            r#"{"amount": -0.5, "id": "ZZ0", "count": 123456789012345678, "paid": false}"#,
            r#"{"id": "AB1", "amount": 1, "day": "2024-02-29", "at": "2026-03-29T02:30:00.125+14:00"}"#,
            r#"{"id": "AB1", "amount": 1, "at": "2026-10-25T02:30:00Z", "lines": [{"sku": "x"}, {"sku": "y"}]}"#,
            r#"{"id": "AB1", "amount": 1, "count": null, "lines": []}"#,
        ] {
            check
                .check(&record(fitting))
                .unwrap_or_else(|error| panic!("{fitting}: {error}"));
        }
    }

    #[test]
    fn every_misfit_is_named_with_its_field_and_what_was_expected() {
        let check = check_with(ORDERS, Undeclared::Refuse);
        for (misfit, path, expected) in [
            (r#"{"amount": 1}"#, "id", "required"),
            (
                r#"{"id": "AB1234567", "amount": 1}"#,
                "id",
                "at most 8 characters",
            ),
            (r#"{"id": "ab1", "amount": 1}"#, "id", "matching"),
            (
                r#"{"id": "AB1", "amount": 1.234}"#,
                "amount",
                "at most 2 digits",
            ),
            (
                r#"{"id": "AB1", "amount": 1e5}"#,
                "amount",
                "without exponent",
            ),
            (r#"{"id": "AB1", "amount": "1.00"}"#, "amount", "a decimal"),
            (
                r#"{"id": "AB1", "amount": 1, "count": 1.0}"#,
                "count",
                "an integer",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "paid": "yes"}"#,
                "paid",
                "true or false",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "day": "2023-02-29"}"#,
                "day",
                "a date",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "day": "2023-2-28"}"#,
                "day",
                "a date",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "at": "2026-01-01T10:00:00"}"#,
                "at",
                "offset",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "at": "2026-01-01 10:00:00Z"}"#,
                "at",
                "offset",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "at": "2026-01-01T10:00:60Z"}"#,
                "at",
                "offset",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "at": "2026-01-01T10:00:00+15:00"}"#,
                "at",
                "offset",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "lines": {"sku": "x"}}"#,
                "lines",
                "an array of an object",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "lines": [{"sku": "x"}, {}]}"#,
                "lines[1].sku",
                "required",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "lines": [{"sku": "x", "qty": 2}]}"#,
                "lines[0].qty",
                "undeclared",
            ),
            (
                r#"{"id": "AB1", "amount": 1, "note": "hi"}"#,
                "note",
                "undeclared",
            ),
        ] {
            let error = check.check(&record(misfit)).unwrap_err();
            assert_eq!(error.path, path, "{misfit}: {error}");
            assert!(error.expected.contains(expected), "{misfit}: {error}");
        }
    }

    #[test]
    fn undeclared_fields_pass_when_kept() {
        let check = check_with(ORDERS, Undeclared::Keep);
        check
            .check(&record(
                r#"{"id": "AB1", "amount": 1, "note": {"deep": [1, 2]}}"#,
            ))
            .unwrap();
    }

    #[test]
    fn a_pattern_matches_the_whole_value_and_dot_stops_at_line_ends() {
        let check = check_with(
            r#"[{"name": "code", "type": "string", "pattern": "a.c"}]"#,
            Undeclared::Keep,
        );
        check.check(&record(r#"{"code": "abc"}"#)).unwrap();
        for misfit in [
            r#"{"code": "xabc"}"#,
            r#"{"code": "abcx"}"#,
            r#"{"code": "a\rc"}"#,
            r#"{"code": "a\nc"}"#,
        ] {
            assert!(check.check(&record(misfit)).is_err(), "{misfit}");
        }
    }
}

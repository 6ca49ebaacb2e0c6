//! Typed fields of a definition: what each record must hold, so that a
//! report is a document its receiver can validate against a schema.
//!
//! A definition that declares `fields` says, per field, its type, whether
//! it is required and whether it repeats (a JSON array of that type), and
//! with `undeclared` what happens to the fields it does not name (kept or
//! refused). `totals` names numeric fields whose count, exact sum, minimum
//! and maximum close each document.
//!
//! ```json
//! {"fields": [
//!    {"name": "id", "type": "string", "required": true, "max_length": 36},
//!    {"name": "amount", "type": "decimal", "required": true, "scale": 2},
//!    {"name": "booked", "type": "datetime"},
//!    {"name": "lines", "type": "object", "repeated": true,
//!     "fields": [{"name": "sku", "type": "string", "pattern": "[A-Z]{3}-[0-9]+"}]}],
//!  "undeclared": "refuse",
//!  "totals": ["amount"]}
//! ```
//!
//! Everything here is checked by [`check_fields`] when a definition is
//! validated: names, facets that fit their type, patterns written in the
//! subset both Rust's `regex` and XML Schema read alike, nesting and size
//! limits, and totals that name a top-level numeric field.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::definition::is_xml_name;

/// The most fields a definition may declare, nested ones included.
pub const MAX_DECLARED_FIELDS: usize = 256;
/// The deepest nesting of declared objects (a top-level field is depth 1).
pub const MAX_FIELD_DEPTH: usize = 8;
/// The longest pattern a string field may have, in bytes.
pub const MAX_PATTERN_BYTES: usize = 256;
/// The most digits after the point a decimal's `scale` may allow.
pub const MAX_SCALE: u32 = 64;
/// The element that holds a typed record's undeclared fields when the
/// definition keeps them: they follow the declared ones inside it, so the
/// schema can say "anything" there without blurring what is declared.
pub const UNDECLARED_ELEMENT: &str = "extra";

/// One declared field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Field {
    /// The JSON key, and (unless renamed) the element's name: an XML NCName.
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FieldKind,
    /// Present and not null in every record (every item, when repeated).
    #[serde(default, skip_serializing_if = "is_false")]
    pub required: bool,
    /// A JSON array of values of this type, written as one element per item.
    #[serde(default, skip_serializing_if = "is_false")]
    pub repeated: bool,
    /// `string`: the most characters (Unicode scalar values) a value has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<u32>,
    /// `string`: a regular expression the whole value matches (see
    /// [`check_pattern`] for the syntax both sides read alike).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// `decimal`: the most digits after the decimal point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<u32>,
    /// `object`: its own declared fields.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<Field>,
}

/// A field's type, and the JSON it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FieldKind {
    /// A JSON string.
    String,
    /// A JSON number without fraction or exponent, of any size.
    Integer,
    /// A JSON number without exponent, its digits kept exactly.
    Decimal,
    /// `true` or `false`.
    Boolean,
    /// A JSON string `YYYY-MM-DD` naming a real day.
    Date,
    /// A JSON string in RFC 3339 with its offset (`Z` or `+hh:mm`),
    /// `T` between date and time. `dateTime`, XML Schema's spelling, is
    /// read too.
    #[serde(alias = "dateTime")]
    Datetime,
    /// A JSON object with its own declared fields.
    Object,
}

impl FieldKind {
    /// Its name as a definition writes it.
    pub fn name(self) -> &'static str {
        match self {
            FieldKind::String => "string",
            FieldKind::Integer => "integer",
            FieldKind::Decimal => "decimal",
            FieldKind::Boolean => "boolean",
            FieldKind::Date => "date",
            FieldKind::Datetime => "datetime",
            FieldKind::Object => "object",
        }
    }

    /// Integers and decimals: what totals can add up.
    pub fn is_numeric(self) -> bool {
        matches!(self, FieldKind::Integer | FieldKind::Decimal)
    }
}

/// What a typed definition does with a record's fields it does not declare.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Undeclared {
    /// Written after the declared fields, inside [`UNDECLARED_ELEMENT`].
    #[default]
    Keep,
    /// The record is refused, naming the field.
    Refuse,
}

impl Undeclared {
    pub fn is_keep(&self) -> bool {
        matches!(self, Undeclared::Keep)
    }
}

fn is_false(flag: &bool) -> bool {
    !*flag
}

/// What is wrong with a definition's fields or totals; `path` names the
/// field (`lines.sku`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldsError {
    #[error("field {path:?}: {name:?} is not a valid XML element name")]
    InvalidName { path: String, name: String },
    #[error("field {path:?} is declared twice")]
    Duplicate { path: String },
    #[error("field {path:?}: {facet} applies to {applies_to} fields, not to {kind}")]
    FacetMisplaced {
        path: String,
        facet: &'static str,
        applies_to: &'static str,
        kind: &'static str,
    },
    #[error("field {path:?}: {reason}")]
    InvalidFacet { path: String, reason: String },
    #[error("field {path:?}: an object field declares its fields (at least one)")]
    EmptyObject { path: String },
    #[error("fields nest deeper than {MAX_FIELD_DEPTH} levels at {path:?}")]
    TooDeep { path: String },
    #[error("a definition declares at most {MAX_DECLARED_FIELDS} fields")]
    TooManyFields,
    #[error(
        "field {path:?} would be confused with the element of undeclared fields, {UNDECLARED_ELEMENT:?}; rename it or refuse undeclared fields"
    )]
    ReservedName { path: String },
    #[error("totals: {name:?} {reason}")]
    InvalidTotal { name: String, reason: String },
    #[error("totals and undeclared need declared fields")]
    NothingDeclared,
}

/// Checks declared fields, the undeclared policy and totals together.
pub fn check_fields(
    fields: &[Field],
    undeclared: Undeclared,
    totals: &[String],
) -> Result<(), FieldsError> {
    if fields.is_empty() {
        if !totals.is_empty() || !undeclared.is_keep() {
            return Err(FieldsError::NothingDeclared);
        }
        return Ok(());
    }
    let mut count = 0;
    check_level(fields, undeclared, "", 1, &mut count)?;
    let mut seen = BTreeSet::new();
    for name in totals {
        let field = fields.iter().find(|field| &field.name == name);
        let reason = match field {
            None => Some("is not a declared top-level field"),
            Some(field) if !field.kind.is_numeric() => Some("is not an integer or decimal field"),
            Some(field) if field.repeated => Some("repeats; totals add one value per record"),
            Some(_) if !seen.insert(name) => Some("is named twice"),
            Some(_) => None,
        };
        if let Some(reason) = reason {
            return Err(FieldsError::InvalidTotal {
                name: name.clone(),
                reason: reason.to_owned(),
            });
        }
    }
    Ok(())
}

fn check_level(
    fields: &[Field],
    undeclared: Undeclared,
    parent: &str,
    depth: usize,
    count: &mut usize,
) -> Result<(), FieldsError> {
    let mut names = BTreeSet::new();
    for field in fields {
        *count += 1;
        if *count > MAX_DECLARED_FIELDS {
            return Err(FieldsError::TooManyFields);
        }
        let path = if parent.is_empty() {
            field.name.clone()
        } else {
            format!("{parent}.{}", field.name)
        };
        if depth > MAX_FIELD_DEPTH {
            return Err(FieldsError::TooDeep { path });
        }
        let reserved = field
            .name
            .get(..3)
            .is_some_and(|head| head.eq_ignore_ascii_case("xml"));
        if !is_xml_name(&field.name) || reserved {
            return Err(FieldsError::InvalidName {
                name: field.name.clone(),
                path,
            });
        }
        if undeclared.is_keep() && field.name == UNDECLARED_ELEMENT {
            return Err(FieldsError::ReservedName { path });
        }
        if !names.insert(field.name.as_str()) {
            return Err(FieldsError::Duplicate { path });
        }
        check_facets(field, &path)?;
        if field.kind == FieldKind::Object {
            if field.fields.is_empty() {
                return Err(FieldsError::EmptyObject { path });
            }
            check_level(&field.fields, undeclared, &path, depth + 1, count)?;
        }
    }
    Ok(())
}

fn check_facets(field: &Field, path: &str) -> Result<(), FieldsError> {
    let kind = field.kind.name();
    let misplaced = |facet, applies_to| FieldsError::FacetMisplaced {
        path: path.to_owned(),
        facet,
        applies_to,
        kind,
    };
    if field.kind != FieldKind::String && field.max_length.is_some() {
        return Err(misplaced("max_length", "string"));
    }
    if field.kind != FieldKind::String && field.pattern.is_some() {
        return Err(misplaced("pattern", "string"));
    }
    if field.kind != FieldKind::Decimal && field.scale.is_some() {
        return Err(misplaced("scale", "decimal"));
    }
    if field.kind != FieldKind::Object && !field.fields.is_empty() {
        return Err(misplaced("fields", "object"));
    }
    let invalid = |reason: String| FieldsError::InvalidFacet {
        path: path.to_owned(),
        reason,
    };
    if field.max_length == Some(0) {
        return Err(invalid(
            "max_length 0 allows only the empty string; leave it out or raise it".into(),
        ));
    }
    if let Some(scale) = field.scale
        && scale > MAX_SCALE
    {
        return Err(invalid(format!("scale {scale} is above {MAX_SCALE}")));
    }
    if let Some(pattern) = &field.pattern {
        check_pattern(pattern)
            .map_err(|reason| invalid(format!("pattern {pattern:?}: {reason}")))?;
    }
    Ok(())
}

/// Checks that `pattern` is in the syntax that Rust's `regex` (anchored at
/// both ends) and XML Schema's regular expressions read the same way:
/// literal characters, `.`, `\d`, escaped metacharacters (`\. \\ \- \( \)
/// \[ \] \{ \} \| \? \* \+ \^ \$`), character classes `[a-z0-9_]` and
/// `[^...]` of literals, ranges and `\d`, groups `( )`, alternation `|`, and
/// the quantifiers `? * + {n} {n,} {n,m}` (no lazy `?` after them).
/// Everything else is refused: `^` and `$` outside a class (anchors in one,
/// literals in the other), `\w`, `\s`, `\b`, `(?...)`, and class
/// subtraction `-[`.
pub fn check_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("is empty".into());
    }
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(format!("is longer than {MAX_PATTERN_BYTES} bytes"));
    }
    let characters: Vec<char> = pattern.chars().collect();
    let mut index = 0;
    let mut depth = 0usize;
    // Whether a quantifier may follow (an atom was just closed).
    let mut quantifiable = false;
    while index < characters.len() {
        let character = characters[index];
        match character {
            '\\' => {
                index += 1;
                let escaped = characters.get(index).ok_or("ends with a lone backslash")?;
                if !is_shared_escape(*escaped) {
                    return Err(format!(
                        "the escape \\{escaped} is read differently by XML Schema and Rust; write the characters out"
                    ));
                }
                quantifiable = true;
            }
            '[' => {
                index = check_class(&characters, index)?;
                quantifiable = true;
            }
            '(' => {
                if characters.get(index + 1) == Some(&'?') {
                    return Err("(?...) groups are not XML Schema syntax".into());
                }
                depth += 1;
                quantifiable = false;
            }
            ')' => {
                depth = depth.checked_sub(1).ok_or("has an unopened ')'")?;
                quantifiable = true;
            }
            '|' => quantifiable = false,
            '?' | '*' | '+' => {
                if !quantifiable {
                    return Err(format!("{character:?} follows nothing it can repeat"));
                }
                quantifiable = false;
            }
            '{' => {
                if !quantifiable {
                    return Err("'{' follows nothing it can repeat".into());
                }
                index = check_repetition(&characters, index)?;
                quantifiable = false;
            }
            '^' | '$' => {
                return Err(format!(
                    "{character:?} is an anchor in Rust and a literal in XML Schema; the whole value always matches, so leave it out (or escape it)"
                ));
            }
            '}' | ']' => return Err(format!("has an unopened {character:?}")),
            character if character.is_control() => {
                return Err("holds a control character".into());
            }
            _ => quantifiable = true,
        }
        index += 1;
    }
    if depth > 0 {
        return Err("has an unclosed '('".into());
    }
    Ok(())
}

fn is_shared_escape(character: char) -> bool {
    matches!(
        character,
        'd' | '.'
            | '\\'
            | '-'
            | '('
            | ')'
            | '['
            | ']'
            | '{'
            | '}'
            | '|'
            | '?'
            | '*'
            | '+'
            | '^'
            | '$'
    )
}

/// A class from its `[` at `start`: returns the index of its `]`.
fn check_class(characters: &[char], start: usize) -> Result<usize, String> {
    let mut index = start + 1;
    if characters.get(index) == Some(&'^') {
        index += 1;
    }
    let mut empty = true;
    loop {
        let character = *characters.get(index).ok_or("has an unclosed '['")?;
        match character {
            ']' if !empty => return Ok(index),
            ']' => return Err("has an empty class '[]'".into()),
            '[' => return Err("nested classes and class subtraction are not shared syntax".into()),
            '\\' => {
                index += 1;
                let escaped = characters.get(index).ok_or("ends with a lone backslash")?;
                if !is_shared_escape(*escaped) {
                    return Err(format!(
                        "the escape \\{escaped} is read differently by XML Schema and Rust; write the characters out"
                    ));
                }
            }
            '-' if characters.get(index + 1) == Some(&'[') => {
                return Err("class subtraction is XML Schema only".into());
            }
            '&' | '~' if characters.get(index + 1) == Some(&character) => {
                return Err(format!(
                    "{character}{character} in a class is a Rust set operation"
                ));
            }
            character if character.is_control() => {
                return Err("holds a control character".into());
            }
            _ => {}
        }
        empty = false;
        index += 1;
    }
}

/// A repetition from its `{` at `start`: returns the index of its `}`.
fn check_repetition(characters: &[char], start: usize) -> Result<usize, String> {
    let end = characters[start..]
        .iter()
        .position(|&character| character == '}')
        .map(|offset| start + offset)
        .ok_or("has an unclosed '{'")?;
    let inside: String = characters[start + 1..end].iter().collect();
    let bounds: Vec<&str> = inside.split(',').collect();
    let number = |text: &str| text.parse::<u32>().ok().filter(|&value| value <= 1000);
    let valid = match bounds.as_slice() {
        [exact] => number(exact).is_some(),
        [low, ""] => number(low).is_some(),
        [low, high] => {
            matches!((number(low), number(high)), (Some(low), Some(high)) if low <= high)
        }
        _ => false,
    };
    if valid {
        Ok(end)
    } else {
        Err(format!(
            "{{{inside}}} is not a repetition {{n}}, {{n,}} or {{n,m}} with n <= m <= 1000"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str, kind: FieldKind) -> Field {
        Field {
            name: name.into(),
            kind,
            required: false,
            repeated: false,
            max_length: None,
            pattern: None,
            scale: None,
            fields: Vec::new(),
        }
    }

    #[test]
    fn a_definition_of_fields_parses_as_its_documentation_shows() {
        let parsed: Vec<Field> = serde_json::from_str(
            r#"[{"name": "id", "type": "string", "required": true, "max_length": 36},
                {"name": "amount", "type": "decimal", "required": true, "scale": 2},
                {"name": "booked", "type": "datetime"},
                {"name": "lines", "type": "object", "repeated": true,
                 "fields": [{"name": "sku", "type": "string", "pattern": "[A-Z]{3}-[0-9]+"}]}]"#,
        )
        .unwrap();
        assert_eq!(parsed[1].kind, FieldKind::Decimal);
        assert!(parsed[3].repeated);
        check_fields(&parsed, Undeclared::Refuse, &["amount".into()]).unwrap();
        assert!(serde_json::from_str::<Field>(r#"{"name":"a","type":"text"}"#).is_err());
        assert!(serde_json::from_str::<Field>(r#"{"name":"a","type":"string","size":3}"#).is_err());
    }

    #[test]
    fn facets_must_fit_their_type_and_names_must_be_distinct() {
        let mut amount = field("amount", FieldKind::Integer);
        amount.scale = Some(2);
        let error = check_fields(&[amount], Undeclared::Keep, &[]).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("scale applies to decimal fields"),
            "{error}"
        );
        let error = check_fields(
            &[field("a", FieldKind::Date), field("a", FieldKind::Date)],
            Undeclared::Keep,
            &[],
        )
        .unwrap_err();
        assert_eq!(error, FieldsError::Duplicate { path: "a".into() });
        let error =
            check_fields(&[field("1a", FieldKind::Date)], Undeclared::Keep, &[]).unwrap_err();
        assert!(matches!(error, FieldsError::InvalidName { .. }));
        let error =
            check_fields(&[field("extra", FieldKind::Date)], Undeclared::Keep, &[]).unwrap_err();
        assert!(matches!(error, FieldsError::ReservedName { .. }));
        check_fields(&[field("extra", FieldKind::Date)], Undeclared::Refuse, &[]).unwrap();
        let error =
            check_fields(&[field("lines", FieldKind::Object)], Undeclared::Keep, &[]).unwrap_err();
        assert!(matches!(error, FieldsError::EmptyObject { .. }));
    }

    #[test]
    fn totals_name_top_level_numeric_fields_once() {
        let fields = [
            field("amount", FieldKind::Decimal),
            field("note", FieldKind::String),
        ];
        check_fields(&fields, Undeclared::Keep, &["amount".into()]).unwrap();
        for (totals, expected) in [
            (vec!["note"], "is not an integer or decimal"),
            (vec!["missing"], "is not a declared"),
            (vec!["amount", "amount"], "is named twice"),
        ] {
            let totals: Vec<String> = totals.into_iter().map(String::from).collect();
            let error = check_fields(&fields, Undeclared::Keep, &totals).unwrap_err();
            assert!(error.to_string().contains(expected), "{error}");
        }
        assert_eq!(
            check_fields(&[], Undeclared::Keep, &["amount".into()]),
            Err(FieldsError::NothingDeclared)
        );
    }

    #[test]
    fn nesting_is_bounded() {
        let mut nested = field("leaf", FieldKind::String);
        for level in 0..MAX_FIELD_DEPTH {
            let mut parent = field(&format!("level{level}"), FieldKind::Object);
            parent.fields = vec![nested];
            nested = parent;
        }
        let error = check_fields(&[nested], Undeclared::Keep, &[]).unwrap_err();
        assert!(matches!(error, FieldsError::TooDeep { .. }), "{error}");
    }

    #[test]
    fn patterns_are_held_to_the_syntax_both_engines_share() {
        for accepted in [
            "[A-Z]{3}-[0-9]+",
            "\\d{4}(\\.\\d+)?",
            "(EUR|USD|CHF)",
            "[^<>]*",
            "a.b{2,}c{1,3}",
            "\\^\\$",
        ] {
            check_pattern(accepted).unwrap_or_else(|error| panic!("{accepted}: {error}"));
        }
        for (refused, reason) in [
            ("^abc$", "anchor"),
            ("\\w+", "escape \\w"),
            ("(?i)abc", "(?...)"),
            ("[a-z-[aeiou]]", "subtraction"),
            ("a{3,1}", "repetition"),
            ("(abc", "unclosed"),
            ("*a", "follows nothing"),
            ("", "empty"),
        ] {
            let error = check_pattern(refused).unwrap_err();
            assert!(error.contains(reason), "{refused}: {error}");
        }
    }
}

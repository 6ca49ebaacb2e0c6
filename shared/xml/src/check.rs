//! Which records can be rendered, decided in one place.
//!
//! The producer API runs [`check_record`] on every record before it accepts
//! it (a 4xx that names the field), and the renderer runs the very same
//! function before it writes a byte, so the two can never disagree: what the
//! API accepted, the worker renders.

use std::fmt::{self, Write as _};

use serde_json::{Map, Value};

/// The deepest nesting of objects and arrays a record may have, counting the
/// record itself. serde_json's parser stops at 128 levels, so every record
/// that arrived as JSON text is within it; the limit only turns a value built
/// in code, deep enough to exhaust the stack, into an error instead.
pub const MAX_NESTING_DEPTH: usize = 128;

/// Why a record cannot be rendered; the caller refuses it (API) or
/// dead-letters it (worker).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("a record must be a JSON object, not {found}")]
    NotAnObject { found: &'static str },
    #[error(transparent)]
    ForbiddenCharacter(#[from] ForbiddenCharacter),
    #[error("field `{path}` is nested more than {MAX_NESTING_DEPTH} levels deep")]
    TooDeeplyNested { path: String },
    /// It does not fit its definition's typed fields.
    #[error(transparent)]
    Type(#[from] crate::TypeError),
}

/// A character XML 1.0 cannot carry (not even as a character reference),
/// found in a field name or a string value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{place} `{path}` contains U+{code_point:04X}, a character XML 1.0 does not allow; remove or replace it",
    code_point = u32::from(*.character)
)]
pub struct ForbiddenCharacter {
    /// Where it is, e.g. `items[2].name`; keys that are not plain
    /// identifiers are written as JSON strings in brackets (`["a b"]`).
    pub path: String,
    pub character: char,
    pub place: FieldPart,
}

/// Whether the forbidden character is in the field's name or in its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldPart {
    Name,
    Value,
}

impl fmt::Display for FieldPart {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            FieldPart::Name => "the name of field",
            FieldPart::Value => "field",
        })
    }
}

/// Whether `record` can be rendered: a JSON object whose keys and strings,
/// at every depth, hold only characters XML 1.0 allows (everything but
/// U+0000-U+0008, U+000B, U+000C, U+000E-U+001F, U+FFFE and U+FFFF; lone
/// surrogates cannot occur in a Rust string), nested at most
/// [`MAX_NESTING_DEPTH`] levels. [`crate::DocumentRenderer::record`] fails
/// exactly when this does, with the same error.
///
/// # Errors
///
/// [`RenderError::NotAnObject`], or the first problem in field order:
/// [`RenderError::ForbiddenCharacter`] naming the field path and the
/// character, or [`RenderError::TooDeeplyNested`].
pub fn check_record(record: &Value) -> Result<(), RenderError> {
    record_fields(record).map(|_| ())
}

/// The record's fields, once [`check_record`]'s checks have passed.
pub(crate) fn record_fields(record: &Value) -> Result<&Map<String, Value>, RenderError> {
    let Value::Object(fields) = record else {
        return Err(RenderError::NotAnObject {
            found: json_kind(record),
        });
    };
    check_object(fields, 1).map_err(Problem::into_render_error)?;
    Ok(fields)
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Whether XML 1.0 forbids the character everywhere (the `Char` production,
/// less the surrogates a `char` cannot hold).
pub(crate) fn is_forbidden_character(character: char) -> bool {
    matches!(character, '\u{0}'..='\u{8}' | '\u{B}' | '\u{C}' | '\u{E}'..='\u{1F}' | '\u{FFFE}' | '\u{FFFF}')
}

/// The first character XML 1.0 forbids in `text`, if any. Works on bytes:
/// every forbidden character is either a single byte below 0x20 or the
/// three-byte U+FFFE / U+FFFF (`EF BF BE` / `EF BF BF`).
pub(crate) fn first_forbidden_character(text: &str) -> Option<char> {
    let bytes = text.as_bytes();
    // Branch-free over the whole string so it vectorizes: nearly every
    // string is clean and short, and this is the whole cost for those.
    let may_hold_forbidden = bytes
        .iter()
        .fold(false, |seen, &byte| seen | (byte < 0x20) | (byte == 0xEF));
    if !may_hold_forbidden {
        return None;
    }
    let mut search_from = 0;
    while let Some(offset) = bytes[search_from..]
        .iter()
        .position(|&byte| byte < 0x20 || byte == 0xEF)
    {
        let position = search_from + offset;
        let byte = bytes[position];
        if byte < 0x20 {
            if !matches!(byte, b'\t' | b'\n' | b'\r') {
                return Some(char::from(byte));
            }
        } else if bytes.get(position + 1) == Some(&0xBF)
            && matches!(bytes.get(position + 2), Some(0xBE | 0xBF))
        {
            return text[position..].chars().next();
        }
        search_from = position + 1;
    }
    None
}

/// A step from a record down to one of its values.
pub(crate) enum PathSegment<'record> {
    Key(&'record str),
    Index(usize),
}

/// What was found, with the path collected on the way back up (innermost
/// first), so that a clean record costs no path bookkeeping at all.
struct Problem<'record> {
    kind: ProblemKind,
    reversed_path: Vec<PathSegment<'record>>,
}

enum ProblemKind {
    Forbidden { character: char, place: FieldPart },
    TooDeep,
}

impl<'record> Problem<'record> {
    fn within(mut self, segment: PathSegment<'record>) -> Self {
        self.reversed_path.push(segment);
        self
    }

    fn into_render_error(self) -> RenderError {
        let path = format_path(&self.reversed_path);
        match self.kind {
            ProblemKind::Forbidden { character, place } => {
                RenderError::ForbiddenCharacter(ForbiddenCharacter {
                    path,
                    character,
                    place,
                })
            }
            ProblemKind::TooDeep => RenderError::TooDeeplyNested { path },
        }
    }
}

fn check_object(fields: &Map<String, Value>, depth: usize) -> Result<(), Problem<'_>> {
    for (key, value) in fields {
        if let Some(character) = first_forbidden_character(key) {
            return Err(Problem {
                kind: ProblemKind::Forbidden {
                    character,
                    place: FieldPart::Name,
                },
                reversed_path: vec![PathSegment::Key(key)],
            });
        }
        check_value(value, depth).map_err(|problem| problem.within(PathSegment::Key(key)))?;
    }
    Ok(())
}

/// Checks a value that sits at `depth` levels of containers below the top.
fn check_value(value: &Value, depth: usize) -> Result<(), Problem<'_>> {
    let is_container = matches!(value, Value::Array(_) | Value::Object(_));
    if is_container && depth >= MAX_NESTING_DEPTH {
        return Err(Problem {
            kind: ProblemKind::TooDeep,
            reversed_path: Vec::new(),
        });
    }
    match value {
        Value::String(text) => match first_forbidden_character(text) {
            Some(character) => Err(Problem {
                kind: ProblemKind::Forbidden {
                    character,
                    place: FieldPart::Value,
                },
                reversed_path: Vec::new(),
            }),
            None => Ok(()),
        },
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                check_value(item, depth + 1)
                    .map_err(|problem| problem.within(PathSegment::Index(index)))?;
            }
            Ok(())
        }
        Value::Object(fields) => check_object(fields, depth + 1),
        Value::Null | Value::Bool(_) | Value::Number(_) => Ok(()),
    }
}

/// `items[2].name`, with keys that would be ambiguous in that notation
/// written as JSON strings in brackets: `items[2]["first name"]`.
pub(crate) fn format_path(reversed_path: &[PathSegment<'_>]) -> String {
    let mut path = String::new();
    for segment in reversed_path.iter().rev() {
        match segment {
            PathSegment::Key(key) if is_plain_path_key(key) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
            }
            PathSegment::Key(key) => {
                path.push('[');
                push_quoted_key(&mut path, key);
                path.push(']');
            }
            PathSegment::Index(index) => {
                let _infallible = write!(path, "[{index}]");
            }
        }
    }
    path
}

/// The key as a JSON string whose control and XML-forbidden characters are
/// all `\uXXXX` escapes, so the offending character is visible in a message.
fn push_quoted_key(path: &mut String, key: &str) {
    path.push('"');
    for character in key.chars() {
        match character {
            '"' => path.push_str("\\\""),
            '\\' => path.push_str("\\\\"),
            _ if character.is_control()
                || first_forbidden_character(character.encode_utf8(&mut [0; 4])).is_some() =>
            {
                let _infallible = write!(path, "\\u{:04x}", u32::from(character));
            }
            _ => path.push(character),
        }
    }
    path.push('"');
}

fn is_plain_path_key(key: &str) -> bool {
    let mut characters = key.chars();
    characters
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic() || first == '_')
        && characters
            .all(|character| character.is_ascii_alphanumeric() || matches!(character, '_' | '-'))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn forbidden(record: &Value) -> ForbiddenCharacter {
        match check_record(record) {
            Err(RenderError::ForbiddenCharacter(found)) => found,
            other => panic!("expected a forbidden character, got {other:?}"),
        }
    }

    #[test]
    fn allowed_characters_pass() {
        let record =
            json!({"text": "tab\t newline\n cr\r é 😀 \u{7F} \u{85} \u{FFFD} \u{10FFFF} \u{E000}"});
        assert_eq!(check_record(&record), Ok(()));
    }

    #[test]
    fn forbidden_characters_are_found_at_their_path() {
        let found = forbidden(&json!({"items": [{"name": "ok"}, {}, {"name": "bad\u{0}"}]}));
        assert_eq!(found.path, "items[2].name");
        assert_eq!(found.character, '\u{0}');
        assert_eq!(found.place, FieldPart::Value);
        assert_eq!(
            found.to_string(),
            "field `items[2].name` contains U+0000, a character XML 1.0 does not allow; remove or replace it"
        );

        let found = forbidden(&json!({"a": {"b c": ["x", "\u{1}"]}}));
        assert_eq!(found.path, r#"a["b c"][1]"#);
        assert_eq!(found.character, '\u{1}');

        let found = forbidden(&json!({"text": "end\u{FFFE}"}));
        assert_eq!(found.character, '\u{FFFE}');
        let found = forbidden(&json!({"text": "\u{FFFF}"}));
        assert_eq!(found.character, '\u{FFFF}');
        for character in ['\u{8}', '\u{B}', '\u{C}', '\u{E}', '\u{1F}'] {
            assert_eq!(
                forbidden(&json!({"t": character.to_string()})).character,
                character
            );
        }
    }

    #[test]
    fn the_byte_scan_agrees_with_the_character_rule() {
        let samples = ('\u{0}'..='\u{300}')
            .chain('\u{D700}'..='\u{D7FF}')
            .chain('\u{E000}'..='\u{E0FF}')
            .chain('\u{FF00}'..='\u{10100}')
            .chain(['\u{10FFFF}', '\u{EFFFF}', '\u{FFFFF}']);
        for character in samples {
            let found = first_forbidden_character(&format!("a{character}b"));
            assert_eq!(
                found.is_some(),
                is_forbidden_character(character),
                "{character:?}"
            );
        }
    }

    #[test]
    fn forbidden_characters_in_names_are_found() {
        let found = forbidden(&json!({"outer": {"in\u{1}ner": 1}}));
        assert_eq!(found.path, r#"outer["in\u0001ner"]"#);
        assert_eq!(found.place, FieldPart::Name);
        assert!(
            found.to_string().starts_with("the name of field `outer"),
            "{found}"
        );
    }

    #[test]
    fn only_objects_are_records() {
        assert_eq!(
            check_record(&json!([1])),
            Err(RenderError::NotAnObject { found: "an array" })
        );
        assert_eq!(
            check_record(&json!("x")).unwrap_err().to_string(),
            "a record must be a JSON object, not a string"
        );
    }

    #[test]
    fn every_record_serde_json_can_parse_is_shallow_enough() {
        // The deepest record serde_json parses: find it, then check it passes.
        let nested_text =
            |levels: usize| format!("{}1{}", "[".repeat(levels - 1), "]".repeat(levels - 1));
        let record_text = |levels: usize| format!("{{\"a\":{}}}", nested_text(levels));
        let deepest = (2..1000)
            .take_while(|&levels| serde_json::from_str::<Value>(&record_text(levels)).is_ok())
            .last()
            .expect("shallow records parse");
        let record: Value = serde_json::from_str(&record_text(deepest)).expect("parses");
        assert_eq!(check_record(&record), Ok(()));

        let mut too_deep = json!(1);
        for _ in 0..MAX_NESTING_DEPTH {
            too_deep = json!([too_deep]);
        }
        let error = check_record(&json!({ "a": too_deep })).unwrap_err();
        assert!(
            matches!(error, RenderError::TooDeeplyNested { .. }),
            "{error:?}"
        );
    }
}

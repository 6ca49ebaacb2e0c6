//! Reading and checking a request's records, before anything is published.
//!
//! A body is a JSON array of objects (`application/json`) or one object per
//! line (`application/x-ndjson`). Each record is kept as the exact text the
//! producer sent ([`RawValue`], borrowed from the body: numbers are never
//! re-formatted, field order is kept), and is checked: its size, that it is
//! an object, that it parses, and that XML 1.0 can carry every character of
//! its field names and strings. The first bad record refuses the whole body.

use std::fmt;

use axum::http::HeaderMap;
use axum::http::header::CONTENT_ENCODING;
use quire_xml::{RenderError, TypedCheck};
use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::errors::ApiError;

/// The limits of one request, from `api.*`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_record_bytes: usize,
    pub max_records_per_request: usize,
    /// How long a body may take to arrive whole.
    pub body_read_timeout: std::time::Duration,
}

/// How the records of a body are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `[{...}, {...}]`
    JsonArray,
    /// `{...}\n{...}\n`
    Ndjson,
}

impl BodyFormat {
    /// From the request's Content-Type (parameters such as `charset` ignored;
    /// JSON is UTF-8 anyway). Compressed bodies are refused by name.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, ApiError> {
        if let Some(encoding) = headers.get(CONTENT_ENCODING) {
            let encoding = String::from_utf8_lossy(encoding.as_bytes());
            if !encoding.trim().eq_ignore_ascii_case("identity") {
                return Err(ApiError::UnsupportedMediaType {
                    found: format!("with Content-Encoding {encoding} (send the body uncompressed)"),
                });
            }
        }
        let Some((content_type, media_type)) = crate::body::media_type(headers) else {
            return Err(ApiError::UnsupportedMediaType {
                found: "(none)".to_owned(),
            });
        };
        match media_type.as_str() {
            "application/json" => Ok(BodyFormat::JsonArray),
            "application/x-ndjson" | "application/ndjson" | "application/jsonl" => {
                Ok(BodyFormat::Ndjson)
            }
            _ => Err(ApiError::UnsupportedMediaType {
                found: content_type,
            }),
        }
    }
}

/// Parses and checks every record of `body`; on success, the records' exact
/// texts in order.
pub fn parse_records<'body>(
    body: &'body [u8],
    format: BodyFormat,
    limits: &Limits,
) -> Result<Vec<&'body RawValue>, ApiError> {
    let records = match format {
        BodyFormat::JsonArray => split_json_array(body, limits.max_records_per_request)?,
        BodyFormat::Ndjson => split_ndjson(body, limits.max_records_per_request)?,
    };
    for (index, record) in records.iter().enumerate() {
        check_record(index, record, limits)?;
    }
    Ok(records)
}

/// Every record against the typed fields of the stream's definition in
/// force (`records` passed [`parse_records`] already): the first that does
/// not fit refuses the whole body, naming the record, the field and what
/// the definition expects. The same check the worker runs before it renders.
pub fn check_types(records: &[&RawValue], check: &TypedCheck) -> Result<(), ApiError> {
    for (index, record) in records.iter().enumerate() {
        let value: serde_json::Value =
            serde_json::from_str(record.get()).map_err(|error| ApiError::InvalidRecord {
                index,
                message: without_position(&error),
            })?;
        check
            .check(&value)
            .map_err(|error| ApiError::WrongType { index, error })?;
    }
    Ok(())
}

/// One record: size, object, parse, XML characters.
fn check_record(index: usize, record: &RawValue, limits: &Limits) -> Result<(), ApiError> {
    let text = record.get();
    if text.len() > limits.max_record_bytes {
        return Err(ApiError::RecordTooLarge {
            index,
            bytes: text.len(),
            limit: limits.max_record_bytes,
        });
    }
    if !text.starts_with('{') {
        return Err(ApiError::NotAnObject {
            index,
            found: json_type_of(text),
        });
    }
    // Nearly every record is clean: one pass that borrows from the body
    // proves it. Only a record it cannot vouch for takes the checks below,
    // which say what is wrong (the same errors as ever).
    if quire_xml::is_clean_record(text) {
        return Ok(());
    }
    // The raw text is well-formed JSON already; parsing it decodes escapes,
    // which may still hold something no string can (a lone surrogate).
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|error| ApiError::InvalidRecord {
            index,
            message: without_position(&error),
        })?;
    // serde_json keeps the last of two values of one key; the text
    // published holds both, and other readers may take the first.
    if let Some(path) = quire_xml::first_duplicate_key(text) {
        return Err(ApiError::DuplicateKey { index, path });
    }
    // The very check the renderer runs before it writes a record: what the
    // API accepts, the worker can render.
    quire_xml::check_record(&value).map_err(|problem| match problem {
        RenderError::ForbiddenCharacter(forbidden) => {
            ApiError::ForbiddenCharacter { index, forbidden }
        }
        RenderError::NotAnObject { found } => ApiError::NotAnObject { index, found },
        RenderError::Type(error) => ApiError::WrongType { index, error },
        RenderError::TooDeeplyNested { .. } => ApiError::InvalidRecord {
            index,
            message: problem.to_string(),
        },
    })
}

/// The elements of a JSON array, as borrowed raw texts, refusing more than
/// `max_records` without collecting them.
fn split_json_array(body: &[u8], max_records: usize) -> Result<Vec<&RawValue>, ApiError> {
    let first = body.iter().find(|byte| !byte.is_ascii_whitespace());
    if first != Some(&b'[') {
        return Err(ApiError::NotAnArray);
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let parsed = deserializer
        .deserialize_seq(BoundedArray { max_records })
        .and_then(|array| deserializer.end().map(|()| array))
        .map_err(|error| ApiError::InvalidJson {
            message: without_position(&error),
            line: error.line(),
            column: error.column(),
        })?;
    if parsed.count > max_records {
        return Err(ApiError::TooManyRecords {
            count: parsed.count,
            limit: max_records,
        });
    }
    Ok(parsed.records)
}

/// Collects at most `max_records` elements and only counts the rest, so a
/// body of a million tiny records costs no million-element vector.
struct BoundedArray {
    max_records: usize,
}

struct ParsedArray<'body> {
    records: Vec<&'body RawValue>,
    count: usize,
}

impl<'de> Visitor<'de> for BoundedArray {
    type Value = ParsedArray<'de>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("an array of records")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut sequence: A) -> Result<Self::Value, A::Error> {
        let capacity = sequence.size_hint().unwrap_or(0).min(self.max_records);
        let mut records = Vec::with_capacity(capacity);
        let mut count = 0;
        while count < self.max_records {
            match sequence.next_element::<&'de RawValue>()? {
                Some(record) => records.push(record),
                None => return Ok(ParsedArray { records, count }),
            }
            count += 1;
        }
        while sequence.next_element::<IgnoredAny>()?.is_some() {
            count += 1;
        }
        Ok(ParsedArray { records, count })
    }
}

/// One record per non-blank line; `\r\n` line ends are accepted.
fn split_ndjson(body: &[u8], max_records: usize) -> Result<Vec<&RawValue>, ApiError> {
    let mut records = Vec::new();
    let mut count = 0;
    for (line_index, line) in body.split(|byte| *byte == b'\n').enumerate() {
        let line = line.trim_ascii();
        if line.is_empty() {
            continue;
        }
        count += 1;
        if count > max_records {
            // Only counted, to say how many there were.
            continue;
        }
        let record: &RawValue =
            serde_json::from_slice(line).map_err(|error| ApiError::InvalidNdjsonLine {
                index: records.len(),
                line: line_index + 1,
                message: without_position(&error),
            })?;
        records.push(record);
    }
    if count > max_records {
        return Err(ApiError::TooManyRecords {
            count,
            limit: max_records,
        });
    }
    Ok(records)
}

/// What a JSON text is, from its first character (worded as quire-xml's
/// `RenderError::NotAnObject` words it).
fn json_type_of(text: &str) -> &'static str {
    match text.as_bytes().first() {
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// serde_json's message without its " at line L column C" tail (reported
/// separately, or meaningless within one record).
pub fn without_position(error: &serde_json::Error) -> String {
    let message = error.to_string();
    match message.rfind(" at line ") {
        Some(position) => message[..position].to_owned(),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use axum::http::header::CONTENT_TYPE;
    use quire_xml::FieldPart;

    use super::*;

    const LIMITS: Limits = Limits {
        max_body_bytes: 1 << 20,
        max_record_bytes: 80,
        max_records_per_request: 3,
        body_read_timeout: std::time::Duration::from_secs(30),
    };

    fn texts(records: &[&RawValue]) -> Vec<String> {
        records
            .iter()
            .map(|record| record.get().to_owned())
            .collect()
    }

    #[test]
    fn records_keep_their_exact_text() {
        let body = br#" [ {"price": 1.50, "big": 123456789012345678901234567890, "e": 1E+2},
            {"b":1,"a":2} ] "#;
        let records = parse_records(body, BodyFormat::JsonArray, &LIMITS).unwrap();
        assert_eq!(
            texts(&records),
            [
                r#"{"price": 1.50, "big": 123456789012345678901234567890, "e": 1E+2}"#,
                r#"{"b":1,"a":2}"#
            ]
        );
    }

    #[test]
    fn ndjson_is_one_record_per_line_and_blank_lines_are_skipped() {
        let body = b"{\"a\":1}\r\n\n  {\"a\": 2.0}\n";
        let records = parse_records(body, BodyFormat::Ndjson, &LIMITS).unwrap();
        assert_eq!(texts(&records), [r#"{"a":1}"#, r#"{"a": 2.0}"#]);
        assert!(
            parse_records(b"", BodyFormat::Ndjson, &LIMITS)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn an_empty_array_is_no_records() {
        assert!(
            parse_records(b"[]", BodyFormat::JsonArray, &LIMITS)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_body_that_is_not_an_array_is_refused() {
        for body in [&b"{\"a\":1}"[..], b"", b"  ", b"\"x\""] {
            assert!(matches!(
                parse_records(body, BodyFormat::JsonArray, &LIMITS),
                Err(ApiError::NotAnArray)
            ));
        }
    }

    #[test]
    fn broken_json_names_line_and_column() {
        let error =
            parse_records(b"[{\"a\":1},\n {\"a\": }]", BodyFormat::JsonArray, &LIMITS).unwrap_err();
        let ApiError::InvalidJson { line, column, .. } = error else {
            panic!("{error:?}")
        };
        assert_eq!((line, column), (2, 8));
        assert!(matches!(
            parse_records(b"[{}] x", BodyFormat::JsonArray, &LIMITS),
            Err(ApiError::InvalidJson { .. })
        ));
        let error = parse_records(b"{}\n{}\n{\"a\" 1}\n", BodyFormat::Ndjson, &LIMITS).unwrap_err();
        assert!(
            matches!(
                error,
                ApiError::InvalidNdjsonLine {
                    index: 2,
                    line: 3,
                    ..
                }
            ),
            "{error:?}"
        );
        // Two values on one line are not one record.
        assert!(matches!(
            parse_records(b"{} {}\n", BodyFormat::Ndjson, &LIMITS),
            Err(ApiError::InvalidNdjsonLine { .. })
        ));
    }

    #[test]
    fn too_many_records_are_counted_and_refused() {
        let error = parse_records(b"[{},{},{},{},{}]", BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(error, ApiError::TooManyRecords { count: 5, limit: 3 }),
            "{error:?}"
        );
        let error = parse_records(b"{}\n{}\n{}\n{}\n", BodyFormat::Ndjson, &LIMITS).unwrap_err();
        assert!(
            matches!(error, ApiError::TooManyRecords { count: 4, limit: 3 }),
            "{error:?}"
        );
        parse_records(b"[{},{},{}]", BodyFormat::JsonArray, &LIMITS).unwrap();
    }

    #[test]
    fn a_record_too_large_is_named() {
        let big = format!(r#"[{{}}, {{"a":"{}"}}]"#, "x".repeat(80));
        let error = parse_records(big.as_bytes(), BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(
                error,
                ApiError::RecordTooLarge {
                    index: 1,
                    bytes: 88,
                    limit: 80
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_record_that_is_not_an_object_is_named_with_its_type() {
        for (body, found) in [
            (&b"[{}, [1]]"[..], "an array"),
            (b"[{}, 1.5]", "a number"),
            (b"[{}, null]", "null"),
            (b"[{}, \"s\"]", "a string"),
            (b"[{}, true]", "a boolean"),
        ] {
            let error = parse_records(body, BodyFormat::JsonArray, &LIMITS).unwrap_err();
            assert!(
                matches!(error, ApiError::NotAnObject { index: 1, found: f } if f == found),
                "{error:?}"
            );
        }
    }

    #[test]
    fn a_forbidden_character_names_record_and_field() {
        let body = br#"[{"ok":"fine"}, {"order":{"note":"a\u0000b"}}]"#;
        let error = parse_records(body, BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(&error, ApiError::ForbiddenCharacter { index: 1, forbidden } if forbidden.path == "order.note" && forbidden.character == '\0' && forbidden.place == FieldPart::Value),
            "{error:?}"
        );
        let body = br#"[{"bad\u0001name": 1}]"#;
        let error = parse_records(body, BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(
                &error,
                ApiError::ForbiddenCharacter { index: 0, forbidden }
                    if forbidden.character == '\u{1}' && forbidden.place == FieldPart::Name
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_key_named_twice_is_refused_even_when_its_last_value_is_clean() {
        // Validated on its last value, the first (a NUL) would be published.
        let body = br#"[{"ok":1}, {"a":"\u0000","a":"ok"}]"#;
        let error = parse_records(body, BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(&error, ApiError::DuplicateKey { index: 1, path } if path == "a"),
            "{error:?}"
        );
        let body = b"{\"o\":{\"k\":1,\"k\":2}}\n";
        let error = parse_records(body, BodyFormat::Ndjson, &LIMITS).unwrap_err();
        assert!(
            matches!(&error, ApiError::DuplicateKey { index: 0, path } if path == "o.k"),
            "{error:?}"
        );
    }

    #[test]
    fn the_characters_xml_forbids_are_refused_and_the_rest_pass() {
        for forbidden in [
            r"\u0000", r"\u0008", r"\b", r"\f", r"\u001f", r"\ufffe", r"\uffff",
        ] {
            let body = format!(r#"[{{"a":"x{forbidden}y"}}]"#);
            assert!(
                matches!(
                    parse_records(body.as_bytes(), BodyFormat::JsonArray, &LIMITS),
                    Err(ApiError::ForbiddenCharacter { .. })
                ),
                "{forbidden} accepted"
            );
        }
        let body = r#"[{"a":"tab\t nl\n cr\r \ud7ff \ue000 \ufffd \ud83d\ude00 é"}]"#;
        parse_records(body.as_bytes(), BodyFormat::JsonArray, &LIMITS).unwrap();
    }

    #[test]
    fn a_lone_surrogate_is_an_invalid_record() {
        let error =
            parse_records(br#"[{"a":"\ud800"}]"#, BodyFormat::JsonArray, &LIMITS).unwrap_err();
        assert!(
            matches!(error, ApiError::InvalidRecord { index: 0, .. }),
            "{error:?}"
        );
    }

    #[test]
    fn content_types_choose_the_format() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
            BodyFormat::from_headers(&headers)
        };
        assert_eq!(with("application/json").unwrap(), BodyFormat::JsonArray);
        assert_eq!(
            with("Application/JSON; charset=utf-8").unwrap(),
            BodyFormat::JsonArray
        );
        assert_eq!(with("application/x-ndjson").unwrap(), BodyFormat::Ndjson);
        assert!(matches!(
            with("text/plain"),
            Err(ApiError::UnsupportedMediaType { .. })
        ));
        assert!(matches!(
            BodyFormat::from_headers(&HeaderMap::new()),
            Err(ApiError::UnsupportedMediaType { .. })
        ));
        let mut gzipped = HeaderMap::new();
        gzipped.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        gzipped.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(matches!(
            BodyFormat::from_headers(&gzipped),
            Err(ApiError::UnsupportedMediaType { .. })
        ));
    }
}

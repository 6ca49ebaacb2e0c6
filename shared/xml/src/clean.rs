//! One pass over a record's text that proves it clean, for the producer
//! API's hot path.
//!
//! Accepting a record takes three checks: it parses into a value (escapes
//! decode: no lone surrogate), no object names a key twice
//! ([`crate::first_duplicate_key`]) and [`crate::check_record`] passes on
//! the parsed value (XML characters, depth). Run as written they parse the
//! text twice more and build a `serde_json::Value` tree, with an allocation
//! per key and per string, only to throw it away. [`is_clean_record`] walks
//! the text once, borrowing keys and strings where they hold no escape,
//! and answers one question: does every check certainly pass? `false` is
//! not a verdict: the caller runs the checks as written, which find the
//! problem and name it, or pass after all (the walk is conservative near
//! the depth limit). So the errors, and what is accepted, stay exactly as
//! before; only the cost of a clean record changes.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::check::{MAX_NESTING_DEPTH, first_forbidden_character};
use crate::keys::{Key, KeySet};

/// Whether the JSON text `text` is an object that passes, for certain,
/// every check a record must pass: it parses, holds no repeated key and no
/// character XML 1.0 forbids, and nests within [`MAX_NESTING_DEPTH`].
/// `false` means "run the full checks", not "refuse".
pub fn is_clean_record(text: &str) -> bool {
    if !text.trim_start().starts_with('{') {
        return false;
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    matches!(Clean { depth: 1 }.deserialize(&mut deserializer), Ok(true))
        && deserializer.end().is_ok()
}

/// Visits a value `depth` containers deep (the record itself is 1);
/// yields whether everything in it is clean.
#[derive(Clone, Copy)]
struct Clean {
    depth: usize,
}

impl Clean {
    /// The walker for what a container at this depth holds, or `None` when
    /// that would come near the depth limit (conservative: every container
    /// counts, even the map serde_json's `arbitrary_precision` makes of a
    /// number).
    fn below(self) -> Option<Clean> {
        (self.depth + 2 < MAX_NESTING_DEPTH).then_some(Clean {
            depth: self.depth + 1,
        })
    }
}

impl<'de> DeserializeSeed<'de> for Clean {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Clean {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
        Ok(true)
    }
    fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
        Ok(true)
    }
    fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
        Ok(true)
    }
    fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
        Ok(true)
    }
    fn visit_unit<E>(self) -> Result<bool, E> {
        Ok(true)
    }
    fn visit_str<E>(self, text: &str) -> Result<bool, E> {
        Ok(first_forbidden_character(text).is_none())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<bool, A::Error> {
        let Some(below) = self.below() else {
            return Ok(false);
        };
        while let Some(clean) = items.next_element_seed(below)? {
            if !clean {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<bool, A::Error> {
        let Some(below) = self.below() else {
            return Ok(false);
        };
        let mut keys = KeySet::default();
        while let Some(key) = fields.next_key_seed(Key)? {
            if first_forbidden_character(&key).is_some() {
                return Ok(false);
            }
            if keys.repeats(key) || !fields.next_value_seed(below)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the producer API ran before this pass: all three checks.
    fn passes_every_check(text: &str) -> bool {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
            return false;
        };
        crate::first_duplicate_key(text).is_none() && crate::check_record(&value).is_ok()
    }

    fn nested(depth: usize, open: &str, close: &str, inner: &str) -> String {
        let mut text = String::from("{\"a\":");
        text.push_str(&open.repeat(depth));
        text.push_str(inner);
        text.push_str(&close.repeat(depth));
        text.push('}');
        text
    }

    #[test]
    fn clean_means_every_check_passes_and_dirty_means_one_fails_or_it_was_near_the_limit() {
        let mut texts: Vec<String> = [
            r#"{}"#,
            r#"{"a":1,"b":"two","c":[true,false,null],"d":{"e":1.50}}"#,
            r#"{"n":1.10,"m":123456789012345678901234567890,"e":1E400,"z":-0}"#,
            r#"{"text":"tab\there, line\nthere, \"quoted\", \u00e9, \ud83d\ude00"}"#,
            r#"{"a":"\u0000"}"#,
            r#"{"a":"\u0008"}"#,
            "{\"a\":\"\u{FFFE}\"}",
            r#"{"a":"\uFFFF"}"#,
            r#"{"\u0001":1}"#,
            r#"{"a":"\ud800"}"#,
            r#"{"a":"\udc00x"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"a":{"b":1,"b":2}}"#,
            r#"{"a":[{"b":1},{"b":2,"b":3}]}"#,
            r#"{"a":[],"b":{},"c":[[[]]]}"#,
            r#"[1,2]"#,
            r#""string""#,
            r#"12"#,
            r#"{"a":1} trailing"#,
            r#"{"a":"x\u001fy"}"#,
            r#"{"a":"\r\n\t"}"#,
        ]
        .iter()
        .map(|text| (*text).to_owned())
        .collect();
        let many: String = (0..40)
            .map(|index| format!("\"k{index}\":{index}"))
            .collect::<Vec<_>>()
            .join(",");
        texts.push(format!("{{{many}}}"));
        texts.push(format!("{{{many},\"k33\":0}}"));
        for depth in [1, 100, 124, 125, 126, 127, 128, 129, 200] {
            texts.push(nested(depth, "[", "]", "1"));
            texts.push(nested(depth, "[", "]", "{}"));
            texts.push(nested(depth, "{\"b\":", "}", "1"));
            texts.push(nested(depth, "{\"b\":", "}", "[]"));
        }
        for text in &texts {
            let clean = is_clean_record(text);
            let passes = passes_every_check(text);
            assert!(
                !clean || passes,
                "called clean but a check fails: {text:.80}"
            );
        }
        // And it is the fast path for what producers send: every record
        // that passes and is not near the depth limit is clean.
        for text in texts.iter().filter(|text| text.len() < 200) {
            if passes_every_check(text) {
                assert!(is_clean_record(text), "clean record not recognised: {text}");
            }
        }
    }
}

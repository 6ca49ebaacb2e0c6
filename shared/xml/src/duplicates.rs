//! Objects that name one key twice. JSON parsers disagree on them (serde_json
//! keeps the last value, others the first, some refuse), so a record that
//! holds one would be checked as one thing and read elsewhere as another:
//! `{"a":"\u0000","a":"ok"}` passes every check on its last value while the
//! raw text, NUL included, is what is published. The producer API refuses
//! them before anything is published.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::check::{PathSegment, format_path};

/// Objects with more keys than this are checked with a hash set; smaller
/// ones (nearly all) by a scan, which allocates less.
const SCAN_UP_TO: usize = 16;

/// The path of the first key that occurs twice in one object of the JSON
/// text `text` (e.g. `a`, `items[2].name`, `["first name"]`: the notation of
/// [`crate::ForbiddenCharacter`]'s paths), or `None`. Text that is not
/// well-formed JSON yields `None`: the parse that reads it says why.
pub fn first_duplicate_key(text: &str) -> Option<String> {
    let mut path = Vec::new();
    let mut found = None;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let _ = Walk {
        path: &mut path,
        found: &mut found,
    }
    .deserialize(&mut deserializer);
    found.map(|steps: Vec<Step>| {
        let reversed: Vec<PathSegment<'_>> = steps
            .iter()
            .rev()
            .map(|step| match step {
                Step::Key(key) => PathSegment::Key(key),
                Step::Index(index) => PathSegment::Index(*index),
            })
            .collect();
        format_path(&reversed)
    })
}

#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// Visits every value, keeping the path to it; stops at the first
/// duplicate key, which it records in `found`.
struct Walk<'a> {
    path: &'a mut Vec<Step>,
    found: &'a mut Option<Vec<Step>>,
}

impl Walk<'_> {
    fn below(&mut self) -> Walk<'_> {
        Walk {
            path: self.path,
            found: self.found,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut items: A) -> Result<(), A::Error> {
        let mut index = 0;
        loop {
            self.path.push(Step::Index(index));
            let item = items.next_element_seed(self.below())?;
            self.path.pop();
            if item.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }

    // Under serde_json's `arbitrary_precision` a number arrives as a map of
    // one private key: one key, so never a duplicate.
    fn visit_map<A: MapAccess<'de>>(mut self, mut fields: A) -> Result<(), A::Error> {
        let mut scanned: Vec<Cow<'de, str>> = Vec::new();
        let mut hashed: HashSet<Cow<'de, str>> = HashSet::new();
        while let Some(key) = fields.next_key::<Cow<'de, str>>()? {
            let repeated = if hashed.is_empty() && scanned.len() < SCAN_UP_TO {
                let repeated = scanned.contains(&key);
                scanned.push(key.clone());
                repeated
            } else {
                hashed.extend(scanned.drain(..));
                !hashed.insert(key.clone())
            };
            self.path.push(Step::Key(key.into_owned()));
            if repeated {
                *self.found = Some(self.path.clone());
                return Err(de::Error::custom("duplicate key"));
            }
            fields.next_value_seed(self.below())?;
            self.path.pop();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_named_twice_is_found_with_its_path() {
        assert_eq!(
            first_duplicate_key(r#"{"a":"\u0000","a":"ok"}"#).as_deref(),
            Some("a")
        );
        assert_eq!(
            first_duplicate_key(r#"{"items":[{"n":1},{"n":2,"m":3,"n":4}]}"#).as_deref(),
            Some("items[1].n")
        );
        assert_eq!(
            first_duplicate_key(r#"{"first name":{},"x":1,"first name":2}"#).as_deref(),
            Some(r#"["first name"]"#)
        );
        // The same key spelled two ways is the same key.
        assert_eq!(
            first_duplicate_key(r#"{"a":1,"\u0061":2}"#).as_deref(),
            Some("a")
        );
    }

    #[test]
    fn the_same_key_in_different_objects_is_not_a_duplicate() {
        for text in [
            r#"{"a":1,"b":{"a":2},"c":[{"a":3},{"a":4}]}"#,
            r#"{"n":1.10,"m":123456789012345678901234567890,"e":1E400}"#,
            r#"{}"#,
            r#"{"a":[[],[[]],{}],"b":null,"c":true}"#,
        ] {
            assert_eq!(first_duplicate_key(text), None, "{text}");
        }
    }

    #[test]
    fn many_keys_are_checked_past_the_scan() {
        let mut text: String = (0..200)
            .map(|index| format!("\"k{index}\":{index},"))
            .collect();
        text.insert(0, '{');
        text.push_str("\"k150\":0}");
        assert_eq!(first_duplicate_key(&text).as_deref(), Some("k150"));
        let unique: String = (0..200)
            .map(|index| format!("\"k{index}\":{index}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(first_duplicate_key(&format!("{{{unique}}}")), None);
    }
}

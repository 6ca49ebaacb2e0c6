//! What the one-pass walks over a record's text share: keys borrowed from
//! the text, and the set that finds a key named twice in one object.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Visitor};

/// Objects with more keys than this are checked for repeats with a hash
/// set; smaller ones (nearly all) by a scan, which allocates less.
const SCAN_UP_TO: usize = 16;

/// A key (or a number's text), borrowed from the text unless it holds an
/// escape (serde's own `Cow<str>` always copies).
pub(crate) struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a string")
    }

    fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(key))
    }
    fn visit_str<E>(self, key: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(key.to_owned()))
    }
    fn visit_string<E>(self, key: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(key))
    }
}

/// The keys of one object seen so far.
#[derive(Default)]
pub(crate) struct KeySet<'de> {
    scanned: Vec<Cow<'de, str>>,
    hashed: HashSet<Cow<'de, str>>,
}

impl<'de> KeySet<'de> {
    /// Adds `key`; whether the object named it before.
    pub(crate) fn repeats(&mut self, key: Cow<'de, str>) -> bool {
        if self.hashed.is_empty() && self.scanned.len() < SCAN_UP_TO {
            let repeated = self.scanned.contains(&key);
            self.scanned.push(key);
            repeated
        } else {
            self.hashed.extend(self.scanned.drain(..));
            !self.hashed.insert(key)
        }
    }
}

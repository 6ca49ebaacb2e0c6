//! Names that become S3 keys, Kafka keys and URL segments: validated here.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::LogTag;

/// A stream name: 1-128 characters of `A-Z a-z 0-9 . _ -`, starting with a
/// letter or digit. It becomes a Kafka key, an S3 key segment and a URL
/// segment, so nothing else is allowed (no `/`, no `..`, no spaces).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StreamName(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamNameError {
    #[error("stream name is empty")]
    Empty,
    #[error("stream name is {0} characters long; at most 128 are allowed")]
    TooLong(usize),
    #[error("stream name must start with a letter or a digit")]
    BadStart,
    #[error("stream name contains {0:?}; only letters, digits, '.', '_' and '-' are allowed")]
    BadCharacter(char),
}

impl StreamName {
    pub const MAX_LENGTH: usize = 128;

    pub fn new(name: &str) -> Result<Self, StreamNameError> {
        let first = name.chars().next().ok_or(StreamNameError::Empty)?;
        if name.len() > Self::MAX_LENGTH {
            return Err(StreamNameError::TooLong(name.chars().count()));
        }
        if !first.is_ascii_alphanumeric() {
            return Err(StreamNameError::BadStart);
        }
        if let Some(bad) = name.chars().find(|character| {
            !(character.is_ascii_alphanumeric() || matches!(character, '.' | '_' | '-'))
        }) {
            return Err(StreamNameError::BadCharacter(bad));
        }
        Ok(StreamName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StreamName {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl TryFrom<String> for StreamName {
    type Error = StreamNameError;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        StreamName::new(&name)
    }
}

impl From<StreamName> for String {
    fn from(name: StreamName) -> String {
        name.0
    }
}

/// A report's id: its stream and the partition and offset of the cut marker
/// that ended it, written `{stream}~{partition}-{offset}` (`~` never occurs
/// in a stream name and is URL-safe). Reading that one message of the log
/// tells whether the id was ever issued; the stream prefix lets a listing of
/// `manifests/{stream}~` find a stream's reports.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReportId {
    pub stream: StreamName,
    pub partition: i32,
    pub offset: i64,
    /// The log the report was cut from, when it is not the first log quire
    /// ran on under the records topic's name (see [`crate::log`]).
    pub log: Option<LogTag>,
}

impl ReportId {
    /// The id of the report whose cut is at `partition` and `offset` of
    /// the log tagged `log` (none: the first log).
    pub fn new(stream: StreamName, partition: i32, offset: i64, log: Option<LogTag>) -> Self {
        ReportId {
            stream,
            partition,
            offset,
            log,
        }
    }
}

impl fmt::Display for ReportId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{}~{}-{}",
            self.stream, self.partition, self.offset
        )?;
        match &self.log {
            Some(tag) => write!(formatter, "~{tag}"),
            None => Ok(()),
        }
    }
}

impl FromStr for ReportId {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || {
            format!("report id {text:?} is not of the form <stream>~<partition>-<offset>[~<log>]")
        };
        let (stream, rest) = text.split_once('~').ok_or_else(malformed)?;
        let (position, log) = match rest.split_once('~') {
            Some((position, tag)) => (
                position,
                Some(
                    tag.parse::<LogTag>()
                        .map_err(|error| format!("report id {text:?}: {error}"))?,
                ),
            ),
            None => (rest, None),
        };
        let stream =
            StreamName::new(stream).map_err(|error| format!("report id {text:?}: {error}"))?;
        let (partition, offset) = position.split_once('-').ok_or_else(malformed)?;
        let all_digits = |part: &str| {
            !part.is_empty() && part.len() <= 18 && part.bytes().all(|byte| byte.is_ascii_digit())
        };
        if !all_digits(partition) || !all_digits(offset) {
            return Err(malformed());
        }
        Ok(ReportId {
            stream,
            partition: partition.parse().map_err(|_| malformed())?,
            offset: offset.parse().map_err(|_| malformed())?,
            log,
        })
    }
}

impl Serialize for ReportId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ReportId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_names_that_could_escape_a_key_are_refused() {
        for bad in [
            "",
            "../etc",
            "a/b",
            "a b",
            ".hidden",
            "é",
            "a\0",
            &"x".repeat(129),
        ] {
            assert!(StreamName::new(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["orders", "eu-west.orders_2", "0", &"x".repeat(128)] {
            assert!(StreamName::new(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn report_ids_round_trip_and_reject_garbage() {
        let id = ReportId::new(StreamName::new("orders").unwrap(), 3, 1042, None);
        assert_eq!(id.to_string(), "orders~3-1042");
        assert_eq!("orders~3-1042".parse::<ReportId>(), Ok(id.clone()));
        let later = ReportId::new(
            StreamName::new("orders").unwrap(),
            3,
            1042,
            Some(LogTag::of("another log")),
        );
        let text = later.to_string();
        assert!(text.starts_with("orders~3-1042~") && text.len() == "orders~3-1042~".len() + 12);
        assert_eq!(text.parse::<ReportId>(), Ok(later));
        for bad in [
            "",
            "3-1",
            "orders~3",
            "orders~3-",
            "orders~-3",
            "orders~a-1",
            "orders~3-1-2",
            "../x~3-1",
            "orders~+3-1",
            "orders~99999999999999999999-1",
            "orders~3-1~",
            "orders~3-1~ABCDEF012345",
            "orders~3-1~0123456789ab~0123456789ab",
            "orders~3-1~../../etc/pa",
        ] {
            assert!(bad.parse::<ReportId>().is_err(), "{bad:?} parsed");
        }
    }
}

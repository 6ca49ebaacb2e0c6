use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A message to publish. The key decides the partition (murmur2, as the Java
/// client does) unless `partition` is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutMessage {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub partition: Option<i32>,
}

impl OutMessage {
    pub fn new(topic: impl Into<String>, key: Option<Vec<u8>>, payload: Vec<u8>) -> Self {
        OutMessage {
            topic: topic.into(),
            key,
            payload,
            headers: Vec::new(),
            partition: None,
        }
    }

    /// Every field at once (a message another crate built, topic-free).
    pub fn from_parts(
        topic: impl Into<String>,
        key: Option<Vec<u8>>,
        payload: Vec<u8>,
        headers: Vec<(String, Vec<u8>)>,
        partition: Option<i32>,
    ) -> Self {
        OutMessage {
            topic: topic.into(),
            key,
            payload,
            headers,
            partition,
        }
    }

    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn to_partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Bytes this message occupies in a batch, roughly: for group-commit limits.
    pub(crate) fn approximate_size(&self) -> usize {
        self.payload.len()
            + self.key.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }
}

/// Where a published message landed: the seed's message id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MessageId {
    pub partition: i32,
    pub offset: i64,
}

impl fmt::Display for MessageId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}-{}", self.partition, self.offset)
    }
}

/// A message read from Kafka, owned, so an array can leave the polling thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InMessage {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    /// Create time in milliseconds since the epoch, when the producer set one.
    pub timestamp_ms: Option<i64>,
}

impl InMessage {
    pub fn id(&self) -> MessageId {
        MessageId {
            partition: self.partition,
            offset: self.offset,
        }
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(header_name, _)| header_name == name)
            .map(|(_, value)| value.as_slice())
    }
}

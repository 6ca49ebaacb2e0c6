//! The records log's identity and its partition layout, as data.
//!
//! **Identity.** Kafka gives every topic an id at creation; a records topic
//! deleted and created again under the same name is a new log with a new
//! id. quire remembers the id of the first log it ran on in a small
//! registry object in the bucket ([`LogRegistry`], `logs/{topic}.json`).
//! That first log's report ids and keys look as they always did; every
//! later log's carry a [`LogTag`] (`orders~7-3~1a2b3c4d5e6f`,
//! `reports/orders/00007-…03~1a2b3c4d5e6f.xml`), so a new cut never has an
//! old report's id and no object of an old log is overwritten. Watermarks
//! and manifests carry the full topic id they were written for.
//!
//! **Layout.** Which partition a stream's messages go to is
//! `partition_for_key(stream, partitions)` (Kafka's murmur2), where
//! `partitions` is the count in the [`LogLayout`] quire recorded (on
//! partition 0 of the watermark topic, key `quire:layout`), not the topic's
//! live count: an operator's `--alter` alone moves nothing. Growing the
//! layout is a procedure: [`LogLayout::moving_to`] freezes intake of the
//! streams that move, a [`PartitionMove`] marker on every old partition
//! makes its worker complete their documents there and send each a
//! [`Handover`] (its definition and window progress) to its new partition,
//! and only then does the layout switch.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Definition, WindowProgress};

/// A short, stable name of one log (records topic incarnation): the first
/// 12 lowercase hex digits of the SHA-256 of its Kafka topic id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogTag(String);

impl LogTag {
    pub const LENGTH: usize = 12;

    /// The tag of the log whose Kafka topic id is `topic_id`.
    pub fn of(topic_id: &str) -> Self {
        let digest = Sha256::digest(topic_id.as_bytes());
        LogTag(hex::encode(digest)[..Self::LENGTH].to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tag to write into ids and keys of log `topic_id`, given the
    /// first log's id: none for the first log.
    pub fn for_log(topic_id: &str, first_log: &str) -> Option<Self> {
        (topic_id != first_log).then(|| LogTag::of(topic_id))
    }
}

impl fmt::Display for LogTag {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl FromStr for LogTag {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() == Self::LENGTH
            && text
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
        {
            Ok(LogTag(text.to_owned()))
        } else {
            Err(format!(
                "log tag {text:?} is not {} lowercase hex digits",
                Self::LENGTH
            ))
        }
    }
}

/// `logs/{records topic}.json` in the bucket: the id of the first log quire
/// ran on under that topic name. Written once, when absent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRegistry {
    pub v: u32,
    pub topic: String,
    pub first_log: String,
}

impl LogRegistry {
    pub fn new(topic: &str, first_log: &str) -> Self {
        LogRegistry {
            v: crate::CURRENT_VERSION,
            topic: topic.to_owned(),
            first_log: first_log.to_owned(),
        }
    }

    /// The tag of log `topic_id` (none for the first log).
    pub fn tag_of(&self, topic_id: &str) -> Option<LogTag> {
        LogTag::for_log(topic_id, &self.first_log)
    }
}

/// The partition layout of one log, on partition 0 of the watermark topic
/// under the key [`LAYOUT_KEY`](crate::watermarks::LAYOUT_KEY) (compacted: the latest
/// value is the layout).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLayout {
    pub v: u32,
    /// The Kafka topic id of the records topic this layout is of; a layout
    /// of another log does not apply.
    pub log: String,
    /// Streams are routed among this many partitions.
    pub partitions: i32,
    /// A growth under way: the streams whose partition differs under this
    /// count are frozen (the API answers 503 `partitions_moving`) until the
    /// layout switches to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving_to: Option<i32>,
    /// When the growth was started (ms since the epoch, the operator's clock;
    /// only shown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<i64>,
}

impl LogLayout {
    pub fn new(log: &str, partitions: i32) -> Self {
        LogLayout {
            v: crate::CURRENT_VERSION,
            log: log.to_owned(),
            partitions,
            moving_to: None,
            since_ms: None,
        }
    }

    /// Whether a stream routed to `now` under [`Self::partitions`] goes
    /// elsewhere under the growth under way: it is frozen until the switch.
    /// `partition_under` maps a partition count to the stream's partition.
    pub fn is_moving(&self, partition_under: impl Fn(i32) -> i32) -> bool {
        self.moving_to
            .is_some_and(|target| partition_under(target) != partition_under(self.partitions))
    }
}

/// A partition-wide marker of a growth (`quire-kind: move`, no key, one per
/// partition of the old layout): every stream that lives on this partition
/// under `from` partitions and on another under `to` moves there at this
/// marker. Streams whose state this partition keeps from an earlier layout
/// (they live elsewhere under `from`) are not its to move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMove {
    pub v: u32,
    /// The layout's partition count until the growth.
    pub from: i32,
    /// The layout's new partition count.
    pub to: i32,
}

impl PartitionMove {
    pub fn new(from: i32, to: i32) -> Self {
        PartitionMove {
            v: crate::CURRENT_VERSION,
            from,
            to,
        }
    }
}

/// What a worker records on watermark partition p (key `quire:moved`) in the
/// transaction that processes partition p's [`PartitionMove`]: the growth
/// procedure waits for it on every old partition before it switches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMoved {
    pub v: u32,
    /// The layout's new partition count.
    pub to: i32,
    /// The offset of the move marker processed.
    pub offset: i64,
}

/// What a stream brings to its new partition (`quire-kind: handover`, on
/// the stream's key, written by the worker of its old partition in the
/// transaction that moves past the [`PartitionMove`]): its definition and
/// window progress, which lived in its old partition's log and watermarks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handover {
    pub v: u32,
    pub from_partition: i32,
    /// The offset of the move marker on the old partition.
    pub from_offset: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<Definition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowProgress>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_stable_short_hex_and_absent_for_the_first_log() {
        let tag = LogTag::of("x6SyY6ZNQn2y1Z0VSxaqnw");
        assert_eq!(tag, LogTag::of("x6SyY6ZNQn2y1Z0VSxaqnw"));
        assert_ne!(tag, LogTag::of("AAAAAAAAAAAAAAAAAAAAAA"));
        assert_eq!(tag.as_str().len(), LogTag::LENGTH);
        assert_eq!(tag.as_str().parse::<LogTag>(), Ok(tag.clone()));
        let registry = LogRegistry::new("quire.records", "first");
        assert_eq!(registry.tag_of("first"), None);
        assert_eq!(registry.tag_of("second"), Some(LogTag::of("second")));
        for bad in [
            "",
            "ABCDEFABCDEF",
            "0123456789a",
            "0123456789abc",
            "../../../../",
        ] {
            assert!(bad.parse::<LogTag>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_stream_moves_only_when_its_partition_changes() {
        let mut layout = LogLayout::new("log", 12);
        // 7 under the old count and the new one alike.
        let to_7_then_7 = |_count: i32| 7;
        let to_7_then_13 = |count: i32| if count == 12 { 7 } else { 13 };
        assert!(!layout.is_moving(to_7_then_13), "no growth under way");
        layout.moving_to = Some(16);
        assert!(!layout.is_moving(to_7_then_7));
        assert!(layout.is_moving(to_7_then_13));
    }
}

//! Record ids as the API answers them, and the records a message of the
//! records topic carries, now that records travel in batch messages.
//!
//! A record's id is `{partition}-{offset}-{index}`: the batch message that
//! carries it and its place in that batch (0-based). Tests read ids through
//! [`RecordId::parse`] and records through [`records_in`] /
//! [`records_of`], never by splitting strings or parsing payloads as JSON
//! themselves. What follows from batches, for what tests expect:
//! - a report id is `{stream}~{partition}-{offset}` of its cut marker, and
//!   a report's first offset is a batch message's offset (a report never
//!   splits a batch): [`RecordId::message`];
//! - a dead letter of a record inside a batch names its `partition`,
//!   `offset` and `index`, and is keyed `{partition}:{offset}:{index}`:
//!   [`RecordId::dead_letter_key`].

use std::fmt;

use quire_messages::MessageKind;
use quire_messages::records::{self, RecordTexts};
use serde_json::Value;

use crate::Seen;

/// One record's id: its batch message's partition and offset, and its
/// place in that batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordId {
    pub partition: i32,
    pub offset: i64,
    pub index: usize,
}

impl RecordId {
    /// Reads `partition-offset-index`; panics, naming it, on anything else
    /// (a test that gets a malformed id has found a bug).
    pub fn parse(id: &str) -> RecordId {
        let parts: Vec<&str> = id.split('-').collect();
        let parsed = match parts[..] {
            [partition, offset, index] => partition
                .parse()
                .ok()
                .zip(offset.parse().ok())
                .zip(index.parse().ok())
                .map(|((partition, offset), index)| RecordId {
                    partition,
                    offset,
                    index,
                }),
            _ => None,
        };
        parsed.unwrap_or_else(|| panic!("{id:?} is not a record id (partition-offset-index)"))
    }

    /// The ids of an API answer's `ids`, in order.
    pub fn all_of(answer: &Value) -> Vec<RecordId> {
        answer["ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no ids in {answer}"))
            .iter()
            .map(|id| RecordId::parse(id.as_str().expect("an id is a string")))
            .collect()
    }

    /// `partition-offset` of the batch message: how report ids, report
    /// keys and first offsets name it.
    pub fn message(&self) -> String {
        format!("{}-{}", self.partition, self.offset)
    }

    /// The key of this record's dead letter: `{partition}:{offset}:{index}`.
    pub fn dead_letter_key(&self) -> String {
        format!("{}:{}:{}", self.partition, self.offset, self.index)
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{}-{}-{}",
            self.partition, self.offset, self.index
        )
    }
}

/// The records `message` (read from the records topic) carries, byte for
/// byte and in order: a batch's, a record message's one, none for any other
/// kind. Panics on a batch that ends inside a frame.
pub fn records_in(message: &Seen) -> Vec<Vec<u8>> {
    match records::read(message.key.as_deref(), &message.headers, &message.payload) {
        records::Incoming::Stream(_, records::StreamMessage::Records(Ok(texts))) => {
            collect(texts, message)
        }
        _ if records::kind_of(&message.headers) == Some(MessageKind::Batch) => {
            panic!(
                "an unreadable batch at {}-{}",
                message.partition, message.offset
            )
        }
        _ => Vec::new(),
    }
}

fn collect(texts: RecordTexts<'_>, message: &Seen) -> Vec<Vec<u8>> {
    texts
        .map(|text| {
            text.unwrap_or_else(|reason| {
                panic!(
                    "batch at {}-{}: {reason}",
                    message.partition, message.offset
                )
            })
            .to_vec()
        })
        .collect()
}

/// Every record of `messages` (read from the records topic), in their
/// order, as JSON with its id. Records that are not JSON objects are left
/// out (none of quire's are).
pub fn records_of(messages: &[Seen]) -> Vec<(RecordId, Value)> {
    messages
        .iter()
        .flat_map(|message| {
            records_in(message)
                .into_iter()
                .enumerate()
                .filter_map(move |(index, text)| {
                    let record = serde_json::from_slice::<Value>(&text).ok()?;
                    Some((
                        RecordId {
                            partition: message.partition,
                            offset: message.offset,
                            index,
                        },
                        record,
                    ))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_read_as_partition_offset_index_and_nothing_else() {
        let id = RecordId::parse("3-41-2");
        assert_eq!(
            id,
            RecordId {
                partition: 3,
                offset: 41,
                index: 2
            }
        );
        assert_eq!(id.to_string(), "3-41-2");
        assert_eq!(id.message(), "3-41");
        assert_eq!(id.dead_letter_key(), "3:41:2");
        for bad in ["3-41", "3-41-2-1", "a-1-2", "", "3--1"] {
            assert!(
                std::panic::catch_unwind(|| RecordId::parse(bad)).is_err(),
                "{bad:?} was read"
            );
        }
    }

    #[test]
    fn a_batch_yields_its_records_with_their_ids() {
        let stream = quire_messages::StreamName::new("orders").unwrap();
        let texts = [r#"{"seq":0}"#, r#"{"seq":1}"#, r#"{"seq":2}"#];
        let batches = records::batches(&stream, texts.iter().map(|text| text.as_bytes()), 30);
        let seen: Vec<Seen> = batches
            .into_iter()
            .enumerate()
            .map(|(offset, message)| Seen {
                partition: 4,
                offset: 10 + offset as i64,
                key: message.key,
                headers: message.headers,
                payload: message.payload,
                timestamp_ms: None,
            })
            .collect();
        let read = records_of(&seen);
        let ids: Vec<String> = read.iter().map(|(id, _)| id.to_string()).collect();
        assert_eq!(ids, ["4-10-0", "4-10-1", "4-11-0"]);
        let seqs: Vec<u64> = read
            .iter()
            .map(|(_, record)| record["seq"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, [0, 1, 2]);
    }
}

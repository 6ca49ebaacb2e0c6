//! The report events topic's and the dead-letter topic's formats, in one
//! place: how each message is built (key and payload) and read back.
//! Topic-free: the worker puts these on its topics.
//!
//! | topic | key | payload |
//! | --- | --- | --- |
//! | report events | the stream | a [`ReportEvent`] |
//! | dead letters | `{partition}:{offset}` ([`DeadLetter::key`]) | a [`DeadLetter`] |

use crate::records::LogMessage;
use crate::{DeadLetter, DecodeError, Manifest, ReportEvent};

/// The `report.completed` event of the report `manifest` describes, keyed by
/// its stream.
pub fn report_completed(manifest: &Manifest) -> LogMessage {
    LogMessage {
        key: Some(manifest.stream.as_str().as_bytes().to_vec()),
        headers: Vec::new(),
        payload: crate::encode(&ReportEvent::completed(manifest)),
        partition: None,
    }
}

/// The dead letter of the records topic's message at `partition` and
/// `offset`, or of its record at `index` when it is a batch (its key `key`,
/// the stream's when it has one, and the record's or message's `body`),
/// with the reason it cannot be used.
pub fn dead_letter(
    partition: i32,
    offset: i64,
    index: Option<u32>,
    key: Option<&[u8]>,
    reason: &str,
    body: &[u8],
) -> LogMessage {
    let stream = key
        .map(|key| String::from_utf8_lossy(key).into_owned())
        .unwrap_or_default();
    let letter = DeadLetter::new(stream, partition, offset, index, reason.to_owned(), body);
    LogMessage {
        key: Some(DeadLetter::key(partition, offset, index).into_bytes()),
        headers: Vec::new(),
        payload: crate::encode(&letter),
        partition: None,
    }
}

/// A report event's payload.
pub fn read_report_event(payload: &[u8]) -> Result<ReportEvent, DecodeError> {
    crate::decode("report event", payload)
}

/// A dead letter's payload.
pub fn read_dead_letter(payload: &[u8]) -> Result<DeadLetter, DecodeError> {
    crate::decode("dead letter", payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_is_keyed_by_its_position_and_reads_back() {
        let letter = dead_letter(3, 41, None, Some(b"orders"), "record is not JSON", b"{");
        assert_eq!(letter.key.as_deref(), Some(b"3:41".as_slice()));
        let read = read_dead_letter(&letter.payload).unwrap();
        assert_eq!(
            (
                read.stream.as_str(),
                read.partition,
                read.offset,
                read.reason.as_str()
            ),
            ("orders", 3, 41, "record is not JSON")
        );
        let keyless =
            read_dead_letter(&dead_letter(3, 42, None, None, "no key", b"").payload).unwrap();
        assert_eq!(keyless.stream, "");
        let in_batch = dead_letter(3, 43, Some(7), Some(b"orders"), "bad", b"{}");
        assert_eq!(in_batch.key.as_deref(), Some(b"3:43:7".as_slice()));
        let read = read_dead_letter(&in_batch.payload).unwrap();
        assert_eq!(
            (read.offset, read.index, read.payload.as_str()),
            (43, Some(7), "{}")
        );
    }
}

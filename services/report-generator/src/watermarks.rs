//! Loading a partition's watermarks when the worker takes the partition.
//!
//! `quire.watermarks` partition p belongs to record partition p. Before the
//! worker uses record partition p it reads watermark partition p to its end,
//! after waiting until no transaction is open there (its last stable offset
//! has reached its high watermark): a dead owner's transaction ends within
//! the transaction timeout, aborted, and must not be half-read.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_log::LogIdentity;
use quire_messages::watermarks::{self as format, WatermarkEntry};
use quire_messages::{StreamName, Watermark};
use quire_queue::{InMessage, PartitionReader, ReadError, ReaderOptions};

use crate::WorkerError;

/// What one watermark partition holds for its record partition.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The latest watermark of each stream.
    pub streams: HashMap<StreamName, Watermark>,
    /// The partition's dead-letter mark (key `quire:dead-letters`): its
    /// messages at or below it have their dead letters published.
    pub dead_letters_through: Option<i64>,
}

/// Reads watermark partitions `partitions` of `topic` together: for each, the
/// latest value per stream of the records log `log`, and its dead-letter
/// mark. Empty partitions are not read at all, and the others are read in
/// one assignment, so taking twelve partitions costs about what taking one
/// does. Watermarks and marks of another log (the records topic was deleted
/// and created again) are ignored, with a WARN per partition; their count
/// is returned.
pub fn load(
    settings: &KafkaSettings,
    topic: &str,
    partitions: &[i32],
    log: &LogIdentity,
) -> Result<(HashMap<i32, Loaded>, u64), WorkerError> {
    let timeout = settings.request_timeout;
    // A dead owner's transaction is aborted by the broker after the
    // transaction timeout; wait a little longer than that.
    let stable_limit = settings.transaction_timeout * 2 + Duration::from_secs(5);
    let reader =
        PartitionReader::new(settings, "quire-watermark-reader", ReaderOptions::default())?;
    let mut loaded: HashMap<i32, Loaded> = HashMap::new();
    for &partition in partitions {
        loaded.insert(partition, Loaded::default());
        // Everything written before the take-over is decided.
        let (_, high) = reader
            .watermarks(topic, partition, Instant::now() + timeout)
            .map_err(|error| unstable(error, partition))?;
        reader
            .wait_until_stable_past(topic, partition, high - 1, stable_limit)
            .map_err(|error| unstable(error, partition))?;
    }
    let mut unreadable = None;
    let mut stale: HashMap<i32, u64> = HashMap::new();
    reader
        .read_to_end(topic, partitions, timeout, |message| {
            if unreadable.is_none() {
                match apply(topic, &message, log, &mut loaded) {
                    Ok(Applied::Stale) => *stale.entry(message.partition).or_default() += 1,
                    Ok(Applied::Used) => {}
                    Err(error) => unreadable = Some(error),
                }
            }
        })
        .map_err(|error| unstable(error, -1))?;
    if let Some(error) = unreadable {
        return Err(error);
    }
    for (partition, count) in &stale {
        tracing::warn!(
            partition,
            watermarks = count,
            log = %log.records.id,
            "watermarks of another records log ignored (the records topic was deleted and created again): its streams start afresh on this log"
        );
    }
    Ok((loaded, stale.values().sum()))
}

/// What one watermark message did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Applied {
    Used,
    /// Of another log: ignored.
    Stale,
}

/// One message of the watermark log: the stream's latest watermark, or its
/// tombstone; or the partition's dead-letter mark; or another of quire's
/// own keys (a release, the layout, a move processed), skipped.
pub(crate) fn apply(
    topic: &str,
    message: &InMessage,
    log: &LogIdentity,
    loaded: &mut HashMap<i32, Loaded>,
) -> Result<Applied, WorkerError> {
    let partition = message.partition;
    let unreadable = |what: String, error: quire_messages::DecodeError| {
        WorkerError::Config(format!(
            "{what} at {topic}[{partition}]@{} is unreadable: {error}",
            message.offset
        ))
    };
    match format::read(
        message.key.as_deref(),
        &message.headers,
        message.payload.as_deref(),
    ) {
        WatermarkEntry::Release | WatermarkEntry::Reserved => {}
        WatermarkEntry::DeadLetterMark(mark) => {
            let mark = mark.map_err(|error| unreadable("dead-letter mark".into(), error))?;
            if let Some(mark) = &mark
                && !log.is_this_log(mark.log.as_deref())
            {
                return Ok(Applied::Stale);
            }
            loaded.entry(partition).or_default().dead_letters_through =
                mark.and_then(|mark| mark.dead_letters_through);
        }
        WatermarkEntry::InvalidKey => {
            tracing::warn!(
                partition,
                offset = message.offset,
                "watermark with an invalid key ignored"
            );
        }
        WatermarkEntry::Stream(stream, watermark) => {
            let watermark = watermark
                .map_err(|error| unreadable(format!("watermark of stream {stream}"), error))?;
            let watermarks = &mut loaded.entry(partition).or_default().streams;
            match watermark {
                Some(watermark) if !log.is_this_log(watermark.log.as_deref()) => {
                    return Ok(Applied::Stale);
                }
                Some(watermark) => {
                    watermarks.insert(stream, watermark);
                }
                // A tombstone (compaction) forgets the stream.
                None => {
                    watermarks.remove(&stream);
                }
            }
        }
    }
    Ok(Applied::Used)
}

/// A partition that stays unstable is the worker's own error (another worker
/// stuck); the rest are Kafka's.
fn unstable(error: ReadError, partition: i32) -> WorkerError {
    match error {
        ReadError::NotYetStable { waited, .. } => WorkerError::WatermarksUnstable {
            partition,
            waited_ms: waited.as_millis(),
        },
        ReadError::TimedOut {
            partition, waited, ..
        } => WorkerError::WatermarksUnstable {
            partition,
            waited_ms: waited.as_millis(),
        },
        other => WorkerError::Read(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn message(key: &[u8], payload: Option<Vec<u8>>) -> InMessage {
        InMessage {
            topic: Arc::from("watermarks"),
            partition: 2,
            offset: 9,
            key: Some(key.to_vec()),
            payload,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    fn first_log() -> LogIdentity {
        LogIdentity {
            records: quire_queue::TopicIdentity {
                name: "records".into(),
                id: "log".into(),
                partitions: 12,
            },
            first_log: "log".into(),
            tag: None,
        }
    }

    #[test]
    fn watermarks_and_marks_of_another_log_are_ignored_and_counted() {
        let mut loaded = HashMap::new();
        let log = first_log();
        let other = br#"{"v":1,"partition":2,"offset":12,"log":"gone"}"#.to_vec();
        assert_eq!(
            apply("t", &message(b"orders", Some(other)), &log, &mut loaded).unwrap(),
            Applied::Stale
        );
        let mark = format::dead_letter_mark(2, 40, "gone");
        assert_eq!(
            apply(
                "t",
                &message(&mark.key.unwrap(), Some(mark.payload)),
                &log,
                &mut loaded
            )
            .unwrap(),
            Applied::Stale
        );
        let layout = format::layout(&quire_messages::LogLayout::new("log", 12));
        assert_eq!(
            apply(
                "t",
                &message(&layout.key.unwrap(), Some(layout.payload)),
                &log,
                &mut loaded
            )
            .unwrap(),
            Applied::Used
        );
        assert!(
            loaded
                .get(&2)
                .is_none_or(|partition| partition.streams.is_empty()
                    && partition.dead_letters_through.is_none())
        );
    }

    #[test]
    fn the_reserved_key_loads_the_dead_letter_mark_beside_the_streams() {
        let mut loaded = HashMap::new();
        let log = first_log();
        let mark = format::dead_letter_mark(2, 40, "log");
        apply(
            "t",
            &message(&mark.key.unwrap(), Some(mark.payload)),
            &log,
            &mut loaded,
        )
        .unwrap();
        let old_watermark = br#"{"v":1,"partition":2,"offset":12}"#.to_vec();
        apply(
            "t",
            &message(b"orders", Some(old_watermark)),
            &log,
            &mut loaded,
        )
        .unwrap();
        let partition = &loaded[&2];
        assert_eq!(partition.dead_letters_through, Some(40));
        assert_eq!(partition.streams.len(), 1, "the mark is no stream");
        let orders = StreamName::new("orders").unwrap();
        assert_eq!(partition.streams[&orders].offset, Some(12));
        // A later mark replaces it; a tombstone forgets it.
        let later = format::dead_letter_mark(2, 55, "log");
        apply(
            "t",
            &message(&later.key.unwrap(), Some(later.payload)),
            &log,
            &mut loaded,
        )
        .unwrap();
        assert_eq!(loaded[&2].dead_letters_through, Some(55));
        apply(
            "t",
            &message(format::DEAD_LETTERS_KEY.as_bytes(), None),
            &log,
            &mut loaded,
        )
        .unwrap();
        assert_eq!(loaded[&2].dead_letters_through, None);
    }
}

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
use quire_messages::{HEADER_KIND, StreamName, Watermark, records};
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
/// latest value per stream, and its dead-letter mark. Empty partitions are
/// not read at all, and the others are read in one assignment, so taking
/// twelve partitions costs about what taking one does.
pub fn load(
    settings: &KafkaSettings,
    topic: &str,
    partitions: &[i32],
) -> Result<HashMap<i32, Loaded>, WorkerError> {
    let timeout = Duration::from_millis(settings.request_timeout_ms);
    // A dead owner's transaction is aborted by the broker after the
    // transaction timeout; wait a little longer than that.
    let stable_limit =
        Duration::from_millis(settings.transaction_timeout_ms * 2) + Duration::from_secs(5);
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
    reader
        .read_to_end(topic, partitions, timeout, |message| {
            if unreadable.is_none() {
                unreadable = apply(topic, &message, &mut loaded).err();
            }
        })
        .map_err(|error| unstable(error, -1))?;
    match unreadable {
        Some(error) => Err(error),
        None => Ok(loaded),
    }
}

/// One message of the watermark log: the stream's latest watermark, or its
/// tombstone; or the partition's dead-letter mark.
fn apply(
    topic: &str,
    message: &InMessage,
    loaded: &mut HashMap<i32, Loaded>,
) -> Result<(), WorkerError> {
    if is_release(message) {
        return Ok(());
    }
    let partition = message.partition;
    if records::is_dead_letter_mark(message.key.as_deref()) {
        let mark =
            match message.payload.as_deref() {
                Some(payload) => quire_messages::decode::<Watermark>("dead-letter mark", payload)
                    .map_err(|error| {
                        WorkerError::Config(format!(
                            "dead-letter mark at {topic}[{partition}]@{} is unreadable: {error}",
                            message.offset
                        ))
                    })?
                    .dead_letters_through,
                None => None,
            };
        loaded.entry(partition).or_default().dead_letters_through = mark;
        return Ok(());
    }
    let Some(stream) = message
        .key
        .as_deref()
        .and_then(|key| std::str::from_utf8(key).ok())
        .and_then(|key| StreamName::new(key).ok())
    else {
        tracing::warn!(
            partition,
            offset = message.offset,
            "watermark with an invalid key ignored"
        );
        return Ok(());
    };
    let watermarks = &mut loaded.entry(partition).or_default().streams;
    match message
        .payload
        .as_deref()
        .map(|payload| quire_messages::decode::<Watermark>("watermark", payload))
    {
        Some(Ok(watermark)) => {
            watermarks.insert(stream, watermark);
        }
        // A tombstone (compaction) forgets the stream.
        None => {
            watermarks.remove(&stream);
        }
        Some(Err(error)) => {
            return Err(WorkerError::Config(format!(
                "watermark of stream {stream} at {topic}[{partition}]@{} is unreadable: {error}",
                message.offset
            )));
        }
    }
    Ok(())
}

/// A worker producer's release message (see `worker::release_messages`).
fn is_release(message: &InMessage) -> bool {
    records::is_release(message.header(HEADER_KIND), message.key.as_deref())
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

    #[test]
    fn the_reserved_key_loads_the_dead_letter_mark_beside_the_streams() {
        let mut loaded = HashMap::new();
        let mark = records::dead_letter_mark(2, 40);
        apply(
            "t",
            &message(&mark.key.unwrap(), Some(mark.payload)),
            &mut loaded,
        )
        .unwrap();
        let old_watermark = br#"{"v":1,"partition":2,"offset":12}"#.to_vec();
        apply("t", &message(b"orders", Some(old_watermark)), &mut loaded).unwrap();
        let partition = &loaded[&2];
        assert_eq!(partition.dead_letters_through, Some(40));
        assert_eq!(partition.streams.len(), 1, "the mark is no stream");
        let orders = StreamName::new("orders").unwrap();
        assert_eq!(partition.streams[&orders].offset, Some(12));
        // A later mark replaces it; a tombstone forgets it.
        let later = records::dead_letter_mark(2, 55);
        apply(
            "t",
            &message(&later.key.unwrap(), Some(later.payload)),
            &mut loaded,
        )
        .unwrap();
        assert_eq!(loaded[&2].dead_letters_through, Some(55));
        apply(
            "t",
            &message(records::DEAD_LETTERS_KEY.as_bytes(), None),
            &mut loaded,
        )
        .unwrap();
        assert_eq!(loaded[&2].dead_letters_through, None);
    }
}

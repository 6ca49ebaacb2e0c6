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
use quire_messages::{HEADER_KIND, StreamName, Watermark, records};
use quire_queue::{InMessage, PartitionReader, ReadError, ReaderOptions};

use crate::WorkerError;

/// Watermarks per partition, then per stream.
pub type Loaded = HashMap<i32, HashMap<StreamName, Watermark>>;

/// Reads watermark partitions `partitions` of `topic` together: for each, the
/// latest value per stream of the records log `log`. Empty partitions are
/// not read at all, and the others are read in one assignment, so taking
/// twelve partitions costs about what taking one does. Watermarks of
/// another log (the records topic was deleted and created again) are
/// ignored, with a WARN per partition; their count is returned.
pub fn load(
    settings: &KafkaSettings,
    topic: &str,
    partitions: &[i32],
    log: &LogIdentity,
) -> Result<(Loaded, u64), WorkerError> {
    let timeout = Duration::from_millis(settings.request_timeout_ms);
    // A dead owner's transaction is aborted by the broker after the
    // transaction timeout; wait a little longer than that.
    let stable_limit =
        Duration::from_millis(settings.transaction_timeout_ms * 2) + Duration::from_secs(5);
    let reader =
        PartitionReader::new(settings, "quire-watermark-reader", ReaderOptions::default())?;
    let mut loaded: HashMap<i32, HashMap<StreamName, Watermark>> = HashMap::new();
    for &partition in partitions {
        loaded.insert(partition, HashMap::new());
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
enum Applied {
    Used,
    /// Of another log: ignored.
    Stale,
}

/// One message of the watermark log: the stream's latest watermark, or its
/// tombstone.
fn apply(
    topic: &str,
    message: &InMessage,
    log: &LogIdentity,
    loaded: &mut Loaded,
) -> Result<Applied, WorkerError> {
    // quire's own keys (a release, the layout, a partition moved).
    if is_release(message) || message.key.as_deref().is_some_and(records::is_reserved_key) {
        return Ok(Applied::Used);
    }
    let partition = message.partition;
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
        return Ok(Applied::Used);
    };
    let watermarks = loaded.entry(partition).or_default();
    match message
        .payload
        .as_deref()
        .map(|payload| quire_messages::decode::<Watermark>("watermark", payload))
    {
        Some(Ok(watermark)) if !log.is_this_log(watermark.log.as_deref()) => {
            return Ok(Applied::Stale);
        }
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
    Ok(Applied::Used)
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

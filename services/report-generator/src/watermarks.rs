//! Loading a partition's watermarks when the worker takes the partition.
//!
//! `quire.watermarks` partition p belongs to record partition p. Before the
//! worker uses record partition p it reads watermark partition p to its end,
//! after waiting until no transaction is open there (its last stable offset
//! has reached its high watermark): a dead owner's transaction ends within
//! the transaction timeout, aborted, and must not be half-read.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_messages::{StreamName, Watermark};
use rdkafka::consumer::ConsumerContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

use crate::WorkerError;

/// Reads watermark partitions `partitions` of `topic` together: for each, the
/// latest value per stream. Empty partitions are not read at all, and the
/// others are read in one assignment, so taking twelve partitions costs about
/// what taking one does.
pub fn load(
    settings: &KafkaSettings,
    topic: &str,
    partitions: &[i32],
) -> Result<HashMap<i32, HashMap<StreamName, Watermark>>, WorkerError> {
    let timeout = Duration::from_millis(settings.request_timeout_ms);
    let committed_reader = reader(settings, "read_committed")?;
    let uncommitted_reader = reader(settings, "read_uncommitted")?;
    let mut loaded: HashMap<i32, HashMap<StreamName, Watermark>> = HashMap::new();
    let mut assignment = TopicPartitionList::new();
    for &partition in partitions {
        loaded.insert(partition, HashMap::new());
        let (low, last_stable) = wait_until_stable(
            settings,
            &committed_reader,
            &uncommitted_reader,
            topic,
            partition,
        )?;
        if last_stable > low {
            assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
        }
    }
    let mut unread: BTreeSet<i32> = assignment
        .elements()
        .iter()
        .map(|element| element.partition())
        .collect();
    if unread.is_empty() {
        return Ok(loaded);
    }
    committed_reader.assign(&assignment)?;
    let deadline = Instant::now() + timeout;
    while !unread.is_empty() {
        if Instant::now() > deadline {
            return Err(WorkerError::WatermarksUnstable {
                partition: *unread.first().expect("not empty"),
                waited_ms: timeout.as_millis(),
            });
        }
        match committed_reader.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                unread.remove(&partition);
            }
            Some(Err(error)) => return Err(error.into()),
            Some(Ok(message)) => {
                let partition = message.partition();
                if is_release(&message) {
                    continue;
                }
                let Some(stream) = message
                    .key()
                    .and_then(|key| std::str::from_utf8(key).ok())
                    .and_then(|key| StreamName::new(key).ok())
                else {
                    tracing::warn!(
                        partition,
                        offset = message.offset(),
                        "watermark with an invalid key ignored"
                    );
                    continue;
                };
                let watermarks = loaded.entry(partition).or_default();
                match message
                    .payload()
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
                            message.offset()
                        )));
                    }
                }
            }
        }
    }
    Ok(loaded)
}

/// A worker producer's release message (see `worker::release_messages`).
fn is_release(message: &rdkafka::message::BorrowedMessage<'_>) -> bool {
    use rdkafka::message::Headers;
    message.headers().is_some_and(|headers| {
        headers.iter().any(|header| {
            header.key == quire_messages::HEADER_KIND
                && header
                    .value
                    .and_then(quire_messages::MessageKind::from_header)
                    == Some(quire_messages::MessageKind::Release)
        })
    }) || message.key() == Some(crate::worker::RELEASE_KEY.as_bytes())
}

/// Waits until the partition's last stable offset (what a read_committed
/// ListOffsets answers) reaches its high watermark (what a read_uncommitted
/// one answers): no transaction is open there.
fn wait_until_stable(
    settings: &KafkaSettings,
    committed_reader: &Reader,
    uncommitted_reader: &Reader,
    topic: &str,
    partition: i32,
) -> Result<(i64, i64), WorkerError> {
    let timeout = Duration::from_millis(settings.request_timeout_ms);
    // A dead owner's transaction is aborted by the broker after the
    // transaction timeout; wait a little longer than that.
    let limit = Duration::from_millis(settings.transaction_timeout_ms * 2) + Duration::from_secs(5);
    let started = Instant::now();
    loop {
        let (_, high_watermark) = uncommitted_reader.fetch_watermarks(topic, partition, timeout)?;
        let (low, last_stable) = committed_reader.fetch_watermarks(topic, partition, timeout)?;
        if last_stable >= high_watermark {
            return Ok((low, last_stable));
        }
        if started.elapsed() > limit {
            return Err(WorkerError::WatermarksUnstable {
                partition,
                waited_ms: started.elapsed().as_millis(),
            });
        }
        tracing::info!(
            partition,
            last_stable,
            high_watermark,
            "waiting for an open transaction on the watermarks to end"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The readers' context: reaching the end of the partition is how a load
/// ends, not an error worth a log line.
struct QuietAboutTheEnd;

impl ClientContext for QuietAboutTheEnd {
    fn error(&self, error: KafkaError, reason: &str) {
        if !matches!(
            error.rdkafka_error_code(),
            Some(rdkafka::error::RDKafkaErrorCode::PartitionEOF)
        ) {
            tracing::warn!(error = %error, reason, "watermark reader error");
        }
    }
}

impl ConsumerContext for QuietAboutTheEnd {}

type Reader = BaseConsumer<QuietAboutTheEnd>;

fn reader(settings: &KafkaSettings, isolation_level: &str) -> Result<Reader, WorkerError> {
    let mut config = ClientConfig::new();
    for (key, value) in settings.client_properties() {
        config.set(key, value);
    }
    config
        .set("bootstrap.servers", &settings.bootstrap_servers)
        // A group id is needed for the consumer queue; this reader never joins
        // the group (it assigns) and never commits.
        .set("group.id", "quire-watermark-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        // The end of a short partition is known at once, not after the
        // broker's default 500 ms wait for more data.
        .set("fetch.wait.max.ms", "10")
        .set("isolation.level", isolation_level);
    Ok(config.create_with_context(QuietAboutTheEnd)?)
}

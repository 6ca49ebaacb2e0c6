//! Was a report id ever issued? The log says, exactly.
//!
//! A report id names the cut marker that ends the report:
//! `{stream}~{partition}-{offset}`. The id was issued if and only if the
//! committed message at that partition and offset of the records topic is a
//! cut marker (`quire-kind: cut`) whose key is the stream. Reading that one
//! message answers it, with a plain consumer outside any group:
//!
//! 1. the partition must exist, and the offset must be below the high
//!    watermark (a read_uncommitted ListOffsets), else nothing was ever
//!    written there;
//! 2. wait until the last stable offset (a read_committed ListOffsets) passes
//!    the offset, so that the transaction that wrote it, and every earlier
//!    one, is decided (bounded by the transaction timeout);
//! 3. assign the partition at the offset, read_committed, and poll: the first
//!    message at or after the offset decides. A later offset, or the end of
//!    the partition, means the offset holds an aborted message or a
//!    transaction marker: never issued.
//!
//! Every librdkafka call here blocks, so look-ups run on tokio's blocking
//! pool, a bounded number at a time, each with a consumer of its own taken
//! from a small pool.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_messages::{HEADER_KIND, MessageKind, ReportId};
use quire_queue::MessageId;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::Semaphore;

/// Look-ups that may run at once (each holds a blocking thread and a consumer).
const CONCURRENT_LOOKUPS: usize = 4;
/// How often the last stable offset is asked again while it is behind.
const STABLE_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Longest single librdkafka call of a look-up.
const MAX_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// What reading the log can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LogError {
    #[error("the kafka client for report look-ups could not be created: {0}")]
    Client(KafkaError),
    #[error("reading {topic}[{partition}] from kafka failed: {source}")]
    Read {
        topic: String,
        partition: i32,
        source: KafkaError,
    },
    #[error(
        "kafka did not return the message at {topic}[{partition}] offset {offset} within {waited:?}"
    )]
    TimedOut {
        topic: String,
        partition: i32,
        offset: i64,
        waited: Duration,
    },
    #[error(
        "the message at {topic}[{partition}] offset {offset} is not readable yet: an earlier kafka transaction on that partition is still open (it ends within kafka.transaction_timeout_ms)"
    )]
    NotYetStable {
        topic: String,
        partition: i32,
        offset: i64,
    },
    #[error("a blocking kafka look-up ended without a result: {0}")]
    Join(String),
}

/// What the log says about a report id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutLookup {
    /// A committed cut marker of the id's stream is at the id's position.
    Issued,
    /// Never issued; the reason completes the sentence "report X was never issued".
    NotIssued(&'static str),
}

pub struct LogReader {
    topic: String,
    partitions: i32,
    settings: KafkaSettings,
    group_id: String,
    /// read_uncommitted, so its ListOffsets answers the high watermark; also
    /// the readiness probe's metadata client.
    watermarks: Arc<BaseConsumer>,
    /// read_committed consumers not in use; at most CONCURRENT_LOOKUPS exist.
    idle_readers: Arc<Mutex<Vec<BaseConsumer>>>,
    permits: Arc<Semaphore>,
    call_timeout: Duration,
    stable_wait: Duration,
}

impl LogReader {
    /// `partitions` is the records topic's partition count (checked at
    /// start-up). `group_id` only satisfies librdkafka, which wants one to
    /// assign partitions: the readers never join it and never commit.
    pub fn new(
        settings: &KafkaSettings,
        partitions: i32,
        group_id: &str,
    ) -> Result<Self, LogError> {
        let watermarks: BaseConsumer = reader_config(settings, group_id, "read_uncommitted")
            .create()
            .map_err(LogError::Client)?;
        // One reader now, so a bad configuration stops start-up.
        let first_reader = new_reader(settings, group_id)?;
        Ok(LogReader {
            topic: settings.topics.records.clone(),
            partitions,
            settings: settings.clone(),
            group_id: group_id.to_owned(),
            watermarks: Arc::new(watermarks),
            idle_readers: Arc::new(Mutex::new(vec![first_reader])),
            permits: Arc::new(Semaphore::new(CONCURRENT_LOOKUPS)),
            call_timeout: Duration::from_millis(settings.request_timeout_ms).min(MAX_CALL_TIMEOUT),
            // Past the transaction timeout, any transaction open before the
            // look-up started has ended.
            stable_wait: Duration::from_millis(settings.transaction_timeout_ms)
                + Duration::from_secs(2),
        })
    }

    /// Whether `id` names a committed cut marker of its stream.
    pub async fn find_cut(&self, id: &ReportId) -> Result<CutLookup, LogError> {
        if id.partition < 0 || id.partition >= self.partitions {
            return Ok(CutLookup::NotIssued(
                ": the records topic has no such partition",
            ));
        }
        self.look_up(
            id.partition,
            id.offset,
            id.stream.as_str().as_bytes().to_vec(),
            true,
        )
        .await
    }

    /// Settles a transaction whose commit outcome was unknown: whether the
    /// message written at `at` with `key` is committed (true) or its
    /// transaction aborted (false). Waits, up to the transaction timeout, for
    /// the transaction to end (the producer's replacement fences it, or the
    /// coordinator times it out).
    pub async fn settle(&self, key: &[u8], at: MessageId) -> Result<bool, LogError> {
        let lookup = self
            .look_up(at.partition, at.offset, key.to_vec(), false)
            .await?;
        Ok(lookup == CutLookup::Issued)
    }

    /// Whether a committed message with `key` (a cut marker, if `cut_only`)
    /// is at `offset` of `partition`.
    async fn look_up(
        &self,
        partition: i32,
        offset: i64,
        key: Vec<u8>,
        cut_only: bool,
    ) -> Result<CutLookup, LogError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|closed| LogError::Join(closed.to_string()))?;
        let reader = match self.idle_readers.lock().expect("reader pool").pop() {
            Some(reader) => reader,
            None => new_reader(&self.settings, &self.group_id)?,
        };
        let lookup = Lookup {
            topic: self.topic.clone(),
            partition,
            offset,
            stream_key: key,
            cut_only,
            call_timeout: self.call_timeout,
            stable_wait: self.stable_wait,
        };
        let watermarks = Arc::clone(&self.watermarks);
        let idle_readers = Arc::clone(&self.idle_readers);
        tokio::task::spawn_blocking(move || {
            let outcome = lookup.run(&watermarks, &reader);
            // Stop fetching before the reader goes back to the pool.
            if let Err(error) = reader.unassign() {
                tracing::warn!(error = %error, "report look-up reader could not unassign; dropping it");
            } else {
                idle_readers.lock().expect("reader pool").push(reader);
            }
            outcome
        })
        .await
        .map_err(|error| LogError::Join(error.to_string()))?
    }

    /// The readiness probe: metadata of the records topic within `timeout`.
    pub async fn check_reachable(&self, timeout: Duration) -> Result<(), LogError> {
        let watermarks = Arc::clone(&self.watermarks);
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            let metadata = watermarks
                .fetch_metadata(Some(&topic), timeout)
                .map_err(|source| LogError::Read {
                    topic: topic.clone(),
                    partition: -1,
                    source,
                })?;
            match metadata.topics().first().and_then(|found| found.error()) {
                None => Ok(()),
                Some(code) => Err(LogError::Read {
                    topic,
                    partition: -1,
                    source: KafkaError::MetadataFetch(code.into()),
                }),
            }
        })
        .await
        .map_err(|error| LogError::Join(error.to_string()))?
    }
}

/// One look-up, owned so it can move to a blocking thread.
struct Lookup {
    topic: String,
    partition: i32,
    offset: i64,
    stream_key: Vec<u8>,
    /// Only a cut marker counts (report ids); else any message of the key.
    cut_only: bool,
    call_timeout: Duration,
    stable_wait: Duration,
}

impl Lookup {
    fn run(&self, watermarks: &BaseConsumer, reader: &BaseConsumer) -> Result<CutLookup, LogError> {
        let (low, high) = self.fetch_watermarks(watermarks, Instant::now() + self.stable_wait)?;
        if self.offset >= high {
            return Ok(CutLookup::NotIssued(
                ": nothing was written at that offset of its partition",
            ));
        }
        if self.offset < low {
            return Ok(CutLookup::NotIssued(
                ", or its cut marker is older than the records topic's retention and its report never completed",
            ));
        }
        self.wait_until_stable(reader)?;
        self.read_at_offset(reader)
    }

    /// The partition's low and high watermarks (the last stable offset, for
    /// a read_committed `client`). A transient error (a connection still
    /// being re-established after a broker restart, a timed-out request) is
    /// asked again until `deadline`: the client's state from before the
    /// restart is not the broker's answer now.
    fn fetch_watermarks(
        &self,
        client: &BaseConsumer,
        deadline: Instant,
    ) -> Result<(i64, i64), LogError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match client.fetch_watermarks(
                &self.topic,
                self.partition,
                self.call_timeout
                    .min(remaining.max(Duration::from_millis(100))),
            ) {
                Ok(watermarks) => return Ok(watermarks),
                Err(source) if quire_queue::is_transient(&source) && !remaining.is_zero() => {
                    tracing::debug!(error = %source, "watermark request failed for now; asking again");
                    std::thread::sleep(STABLE_POLL_INTERVAL);
                }
                Err(source) => return Err(self.read_failed(source)),
            }
        }
    }

    /// Waits until the last stable offset is past our offset.
    fn wait_until_stable(&self, reader: &BaseConsumer) -> Result<(), LogError> {
        let deadline = Instant::now() + self.stable_wait;
        loop {
            let (_, last_stable) = self.fetch_watermarks(reader, deadline)?;
            if self.offset < last_stable {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LogError::NotYetStable {
                    topic: self.topic.clone(),
                    partition: self.partition,
                    offset: self.offset,
                });
            }
            std::thread::sleep(STABLE_POLL_INTERVAL);
        }
    }

    /// Reads the first committed message at or after our offset, which is
    /// below the last stable offset.
    fn read_at_offset(&self, reader: &BaseConsumer) -> Result<CutLookup, LogError> {
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&self.topic, self.partition, Offset::Offset(self.offset))
            .map_err(|source| self.read_failed(source))?;
        reader
            .assign(&assignment)
            .map_err(|source| self.read_failed(source))?;
        let deadline = Instant::now() + self.call_timeout;
        while let Some(remaining) = deadline.checked_duration_since(Instant::now()) {
            match reader.poll(remaining.min(Duration::from_millis(200))) {
                // Messages of an earlier look-up's assignment are skipped.
                Some(Ok(message))
                    if message.topic() != self.topic || message.partition() != self.partition =>
                {
                    continue;
                }
                Some(Ok(message)) if message.offset() < self.offset => continue,
                Some(Ok(message)) if message.offset() > self.offset => {
                    return Ok(CutLookup::NotIssued(
                        ": its offset holds no committed message (an aborted transaction or a transaction marker)",
                    ));
                }
                Some(Ok(message)) => {
                    let kind = message.headers().and_then(|headers| {
                        headers
                            .iter()
                            .find(|header| header.key == HEADER_KIND)
                            .and_then(|header| header.value)
                            .and_then(MessageKind::from_header)
                    });
                    let is_cut_of_stream = (kind == Some(MessageKind::Cut) || !self.cut_only)
                        && message.key() == Some(self.stream_key.as_slice());
                    return Ok(if is_cut_of_stream {
                        CutLookup::Issued
                    } else {
                        CutLookup::NotIssued(
                            ": the message at its offset is not a cut marker of that stream",
                        )
                    });
                }
                // The offset is below the last stable offset, so reaching the
                // end without a message at it means it holds none.
                Some(Err(KafkaError::PartitionEOF(partition))) if partition == self.partition => {
                    return Ok(CutLookup::NotIssued(
                        ": its offset holds no committed message (an aborted transaction or a transaction marker)",
                    ));
                }
                Some(Err(KafkaError::PartitionEOF(_))) | None => continue,
                // An error event queued while the brokers were away (a
                // pooled reader keeps them): stale once they answer, and the
                // call's deadline bounds how long they may stay away.
                Some(Err(source)) if quire_queue::is_transient(&source) => {
                    tracing::debug!(error = %source, "stale or transient error event on a look-up reader; polling on");
                    continue;
                }
                Some(Err(source)) => return Err(self.read_failed(source)),
            }
        }
        Err(LogError::TimedOut {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            waited: self.call_timeout,
        })
    }

    fn read_failed(&self, source: KafkaError) -> LogError {
        LogError::Read {
            topic: self.topic.clone(),
            partition: self.partition,
            source,
        }
    }
}

fn new_reader(settings: &KafkaSettings, group_id: &str) -> Result<BaseConsumer, LogError> {
    reader_config(settings, group_id, "read_committed")
        .create()
        .map_err(LogError::Client)
}

/// A consumer that only assigns partitions at explicit offsets: it never
/// subscribes (so never joins its group) and never commits. The user's
/// pass-through properties (TLS, SASL) apply; the properties quire owns were
/// already refused by the producers' start-up.
fn reader_config(settings: &KafkaSettings, group_id: &str, isolation_level: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    for (key, value) in settings.client_properties() {
        config.set(key, value);
    }
    config
        .set("bootstrap.servers", &settings.bootstrap_servers)
        .set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", isolation_level)
        .set("enable.partition.eof", "true")
        // One message is read per look-up: do not prefetch megabytes after it
        // (the broker still returns a whole batch that is larger).
        .set("max.partition.fetch.bytes", "65536")
        .set("queued.max.messages.kbytes", "1024")
        // A fetch left waiting at the end of the partition by the previous
        // look-up would delay the next one by up to this long.
        .set("fetch.wait.max.ms", "10");
    config
}

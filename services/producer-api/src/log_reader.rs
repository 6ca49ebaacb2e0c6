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
use quire_messages::{MessageKind, ReportId, records};
use quire_queue::{MessageId, PartitionReader, QueueError, ReadError, ReaderOptions};
use tokio::sync::Semaphore;

/// Look-ups that may run at once (each holds a blocking thread and a reader).
const CONCURRENT_LOOKUPS: usize = 4;

/// What reading the log can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LogError {
    #[error("the kafka client for report look-ups could not be created: {0}")]
    Client(QueueError),
    #[error(transparent)]
    Read(ReadError),
    #[error("a blocking kafka look-up ended without a result: {0}")]
    Join(String),
    #[error("the look-up in the records topic did not finish within {0:?}")]
    TimedOut(Duration),
}

impl LogError {
    /// An earlier transaction on the partition is still open.
    pub fn is_not_yet_stable(&self) -> bool {
        matches!(self, LogError::Read(ReadError::NotYetStable { .. }))
    }
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
    /// The records topic's live partition count (it may grow while the API
    /// runs: `crate::placement` keeps it current).
    partitions: std::sync::atomic::AtomicI32,
    settings: KafkaSettings,
    group_id: String,
    /// The readiness probe's reader.
    probe: Arc<PartitionReader>,
    /// Readers not in use; at most CONCURRENT_LOOKUPS exist.
    idle_readers: Arc<Mutex<Vec<PartitionReader>>>,
    permits: Arc<Semaphore>,
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
        // One reader now, so a bad configuration stops start-up.
        let first_reader = new_reader(settings, group_id)?;
        Ok(LogReader {
            topic: settings.topics.records.clone(),
            partitions: std::sync::atomic::AtomicI32::new(partitions),
            settings: settings.clone(),
            group_id: group_id.to_owned(),
            probe: Arc::new(new_reader(settings, group_id)?),
            idle_readers: Arc::new(Mutex::new(vec![first_reader])),
            permits: Arc::new(Semaphore::new(CONCURRENT_LOOKUPS)),
            // Past the transaction timeout, any transaction open before the
            // look-up started has ended.
            stable_wait: settings.transaction_timeout + Duration::from_secs(2),
        })
    }

    /// The records topic's partition count, once it changed.
    pub fn set_partitions(&self, partitions: i32) {
        self.partitions
            .store(partitions, std::sync::atomic::Ordering::Release);
    }

    /// Whether `id` names a committed cut marker of its stream.
    pub async fn find_cut(&self, id: &ReportId) -> Result<CutLookup, LogError> {
        let partitions = self.partitions.load(std::sync::atomic::Ordering::Acquire);
        if id.partition < 0 || id.partition >= partitions {
            return Ok(CutLookup::NotIssued(
                ": the records topic has no such partition",
            ));
        }
        self.look_up(
            id.partition,
            id.offset,
            id.stream.as_str().as_bytes().to_vec(),
            true,
            self.stable_wait,
        )
        .await
    }

    /// Settles a transaction whose commit outcome was unknown: whether the
    /// message written at `at` with `key` is committed (true) or its
    /// transaction aborted (false). Waits for the transaction to end (the
    /// producer's replacement fences it, or the coordinator times it out),
    /// at most `within` in all: a request waiting on it must be answered in
    /// bounded time, and [`transaction_wait`](Self::transaction_wait) is
    /// what it takes to be sure.
    pub async fn settle(
        &self,
        key: &[u8],
        at: MessageId,
        within: Duration,
    ) -> Result<bool, LogError> {
        let lookup = tokio::time::timeout(
            within,
            self.look_up(at.partition, at.offset, key.to_vec(), false, within),
        )
        .await
        .map_err(|_| LogError::TimedOut(within))??;
        Ok(lookup == CutLookup::Issued)
    }

    /// Past this, any transaction open when a look-up started has ended.
    pub fn transaction_wait(&self) -> Duration {
        self.stable_wait
    }

    /// Whether a committed message with `key` (a cut marker, if `cut_only`)
    /// is at `offset` of `partition`.
    async fn look_up(
        &self,
        partition: i32,
        offset: i64,
        key: Vec<u8>,
        cut_only: bool,
        stable_wait: Duration,
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
            stable_wait,
        };
        let idle_readers = Arc::clone(&self.idle_readers);
        tokio::task::spawn_blocking(move || {
            let outcome = lookup.run(&reader);
            idle_readers.lock().expect("reader pool").push(reader);
            outcome
        })
        .await
        .map_err(|error| LogError::Join(error.to_string()))?
    }

    /// The readiness probe: metadata of the records topic within `timeout`.
    pub async fn check_reachable(&self, timeout: Duration) -> Result<(), LogError> {
        let probe = Arc::clone(&self.probe);
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            probe
                .check_reachable(&topic, timeout)
                .map_err(LogError::Read)
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
    stable_wait: Duration,
}

impl Lookup {
    fn run(&self, reader: &PartitionReader) -> Result<CutLookup, LogError> {
        let deadline = Instant::now() + self.stable_wait;
        let (low, high) = reader
            .watermarks(&self.topic, self.partition, deadline)
            .map_err(LogError::Read)?;
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
        reader
            .wait_until_stable_past(
                &self.topic,
                self.partition,
                self.offset,
                deadline.saturating_duration_since(Instant::now()),
            )
            .map_err(LogError::Read)?;
        let Some(message) = reader
            .read_at(&self.topic, self.partition, self.offset)
            .map_err(LogError::Read)?
        else {
            return Ok(CutLookup::NotIssued(
                ": its offset holds no committed message (an aborted transaction or a transaction marker)",
            ));
        };
        let kind = records::kind_of(&message.headers);
        let is_cut_of_stream = (kind == Some(MessageKind::Cut) || !self.cut_only)
            && message.key.as_deref() == Some(self.stream_key.as_slice());
        Ok(if is_cut_of_stream {
            CutLookup::Issued
        } else {
            CutLookup::NotIssued(": the message at its offset is not a cut marker of that stream")
        })
    }
}

fn new_reader(settings: &KafkaSettings, group_id: &str) -> Result<PartitionReader, LogError> {
    PartitionReader::new(
        settings,
        group_id,
        ReaderOptions {
            small_fetches: true,
        },
    )
    .map_err(LogError::Client)
}

//! Reading a few partitions outside any consumer group: where the services
//! look something up in the log instead of consuming it.
//!
//! A [`PartitionReader`] only assigns partitions at explicit offsets: it
//! never subscribes (so never joins its group, whose id librdkafka merely
//! wants) and never commits. It holds two clients, a read_committed one
//! (whose ListOffsets answers the last stable offset, and which reads) and
//! a read_uncommitted one (whose ListOffsets answers the high watermark).
//! The end of a partition is how its reads end, not an error worth a log
//! line. Every call blocks: run it on tokio's blocking pool.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::client::reader_config;
use crate::consumer::owned;
use crate::{InMessage, QueueError, is_transient};

/// How often a watermark is asked again while it is not where it should be.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// What reading a partition can fail with, besides creating the reader.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
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
        "{topic}[{partition}] is not stable past offset {offset} after {waited:?}: a kafka transaction there is still open"
    )]
    NotYetStable {
        topic: String,
        partition: i32,
        offset: i64,
        waited: Duration,
    },
}

/// How a reader fetches.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReaderOptions {
    /// Look-ups of one message: fetch little after it (64 KiB per
    /// partition, 1 MiB queued) instead of librdkafka's megabytes.
    pub small_fetches: bool,
}

/// See the module documentation.
pub struct PartitionReader {
    committed: BaseConsumer<QuietAboutTheEnd>,
    uncommitted: BaseConsumer<QuietAboutTheEnd>,
    /// Longest single librdkafka call.
    call_timeout: Duration,
}

impl PartitionReader {
    /// `group_id` only satisfies librdkafka. The user's pass-through
    /// properties (TLS, SASL) apply; one that names a property quire owns is
    /// refused, as for every client.
    pub fn new(
        settings: &KafkaSettings,
        group_id: &str,
        options: ReaderOptions,
    ) -> Result<Self, QueueError> {
        let create = |isolation_level: &str| -> Result<BaseConsumer<QuietAboutTheEnd>, QueueError> {
            reader_config(settings, group_id, isolation_level, options.small_fetches)?
                .create_with_context(QuietAboutTheEnd)
                .map_err(QueueError::client)
        };
        Ok(PartitionReader {
            committed: create("read_committed")?,
            uncommitted: create("read_uncommitted")?,
            call_timeout: settings.request_timeout.min(Duration::from_secs(5)),
        })
    }

    /// The partition's low and high watermarks.
    pub fn watermarks(
        &self,
        topic: &str,
        partition: i32,
        deadline: Instant,
    ) -> Result<(i64, i64), ReadError> {
        self.ask(&self.uncommitted, topic, partition, deadline)
    }

    /// The partition's low watermark and last stable offset (below which
    /// every transaction has ended).
    pub fn stable_watermarks(
        &self,
        topic: &str,
        partition: i32,
        deadline: Instant,
    ) -> Result<(i64, i64), ReadError> {
        self.ask(&self.committed, topic, partition, deadline)
    }

    /// Waits, at most `limit`, until the last stable offset is past
    /// `offset`: the transaction that wrote it, and every earlier one on the
    /// partition, has ended. Returns the low watermark and the last stable
    /// offset.
    pub fn wait_until_stable_past(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        limit: Duration,
    ) -> Result<(i64, i64), ReadError> {
        let started = Instant::now();
        let deadline = started + limit;
        let mut logged = false;
        loop {
            let (low, last_stable) = self.stable_watermarks(topic, partition, deadline)?;
            if last_stable > offset {
                return Ok((low, last_stable));
            }
            if Instant::now() >= deadline {
                return Err(ReadError::NotYetStable {
                    topic: topic.to_owned(),
                    partition,
                    offset,
                    waited: started.elapsed(),
                });
            }
            if !logged && started.elapsed() > Duration::from_secs(1) {
                tracing::info!(
                    topic,
                    partition,
                    offset,
                    last_stable,
                    "waiting for an open transaction to end"
                );
                logged = true;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// The committed message at `offset`, or `None` when the offset holds
    /// none (an aborted message, a transaction marker). The offset must be
    /// below the last stable offset (see
    /// [`wait_until_stable_past`](Self::wait_until_stable_past)).
    pub fn read_at(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<Option<InMessage>, ReadError> {
        let failed = |source| ReadError::Read {
            topic: topic.to_owned(),
            partition,
            source,
        };
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(topic, partition, Offset::Offset(offset))
            .map_err(failed)?;
        self.committed.assign(&assignment).map_err(failed)?;
        let shared_topic: Arc<str> = Arc::from(topic);
        let outcome = (|| {
            let deadline = Instant::now() + self.call_timeout;
            while let Some(remaining) = deadline.checked_duration_since(Instant::now()) {
                match self
                    .committed
                    .poll(remaining.min(Duration::from_millis(200)))
                {
                    // Messages of an earlier assignment are skipped.
                    Some(Ok(message))
                        if message.topic() != topic || message.partition() != partition => {}
                    Some(Ok(message)) if message.offset() < offset => {}
                    Some(Ok(message)) if message.offset() > offset => return Ok(None),
                    Some(Ok(message)) => return Ok(Some(owned(&shared_topic, &message))),
                    // Below the last stable offset, the end means no message.
                    Some(Err(KafkaError::PartitionEOF(at))) if at == partition => return Ok(None),
                    Some(Err(KafkaError::PartitionEOF(_))) | None => {}
                    // An error event queued while the brokers were away (a
                    // pooled reader keeps them): stale once they answer.
                    Some(Err(source)) if is_transient(&source) => {
                        tracing::debug!(error = %source, "stale or transient error event on a reader; polling on");
                    }
                    Some(Err(source)) => return Err(failed(source)),
                }
            }
            Err(ReadError::TimedOut {
                topic: topic.to_owned(),
                partition,
                offset,
                waited: self.call_timeout,
            })
        })();
        // Stop fetching: the next read assigns afresh.
        if let Err(error) = self.committed.unassign() {
            tracing::warn!(error = %error, "reader could not unassign");
        }
        outcome
    }

    /// Reads `partitions` of `topic` from the beginning to their end (their
    /// last stable offset when the read starts), committed messages only,
    /// all in one assignment, handing each message to `each`; at most
    /// `limit` in all.
    pub fn read_to_end(
        &self,
        topic: &str,
        partitions: &[i32],
        limit: Duration,
        mut each: impl FnMut(InMessage),
    ) -> Result<(), ReadError> {
        let deadline = Instant::now() + limit;
        let mut assignment = TopicPartitionList::new();
        for &partition in partitions {
            let (low, last_stable) = self.stable_watermarks(topic, partition, deadline)?;
            if last_stable > low {
                assignment
                    .add_partition_offset(topic, partition, Offset::Beginning)
                    .map_err(|source| ReadError::Read {
                        topic: topic.to_owned(),
                        partition,
                        source,
                    })?;
            }
        }
        let mut unread: BTreeSet<i32> = assignment
            .elements()
            .iter()
            .map(|element| element.partition())
            .collect();
        if unread.is_empty() {
            return Ok(());
        }
        let first = *unread.first().expect("not empty");
        self.committed
            .assign(&assignment)
            .map_err(|source| ReadError::Read {
                topic: topic.to_owned(),
                partition: first,
                source,
            })?;
        let shared_topic: Arc<str> = Arc::from(topic);
        let outcome = (|| {
            while let Some(&waiting) = unread.first() {
                if Instant::now() > deadline {
                    return Err(ReadError::TimedOut {
                        topic: topic.to_owned(),
                        partition: waiting,
                        offset: -1,
                        waited: limit,
                    });
                }
                match self.committed.poll(Duration::from_millis(200)) {
                    None => {}
                    Some(Err(KafkaError::PartitionEOF(partition))) => {
                        unread.remove(&partition);
                    }
                    Some(Err(source)) if is_transient(&source) => {
                        tracing::debug!(error = %source, "transient error event on a reader; polling on");
                    }
                    Some(Err(source)) => {
                        return Err(ReadError::Read {
                            topic: topic.to_owned(),
                            partition: waiting,
                            source,
                        });
                    }
                    Some(Ok(message)) => each(owned(&shared_topic, &message)),
                }
            }
            Ok(())
        })();
        if let Err(error) = self.committed.unassign() {
            tracing::warn!(error = %error, "reader could not unassign");
        }
        outcome
    }

    /// Whether the brokers answer a metadata request for `topic` within
    /// `timeout` (a readiness probe).
    pub fn check_reachable(&self, topic: &str, timeout: Duration) -> Result<(), ReadError> {
        let failed = |source| ReadError::Read {
            topic: topic.to_owned(),
            partition: -1,
            source,
        };
        let metadata = self
            .uncommitted
            .fetch_metadata(Some(topic), timeout)
            .map_err(failed)?;
        match metadata.topics().first().and_then(|found| found.error()) {
            None => Ok(()),
            Some(code) => Err(failed(KafkaError::MetadataFetch(code.into()))),
        }
    }

    /// A ListOffsets through `client`, asked again after a transient error
    /// (a connection still being re-established after a broker restart, a
    /// leader moving) until `deadline`: the client's state from before is
    /// not the broker's answer.
    ///
    /// Before asking again it refreshes the topic's metadata. librdkafka
    /// sends the request to the leader its cached metadata names, even a
    /// broker that is down (its leader look-up takes a broker in any
    /// state), and a request queued for a dead broker waits its whole
    /// timeout; nothing else refreshes that cache when the controller moves
    /// the leadership. Without the refresh every attempt went to the dead
    /// broker until the deadline: a take-over's watermark load gave up after
    /// `kafka.request_timeout_ms` and the worker's session restarted
    /// (`tests/integration/three_brokers.rs`).
    fn ask(
        &self,
        client: &BaseConsumer<QuietAboutTheEnd>,
        topic: &str,
        partition: i32,
        deadline: Instant,
    ) -> Result<(i64, i64), ReadError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match client.fetch_watermarks(
                topic,
                partition,
                self.call_timeout
                    .min(remaining.max(Duration::from_millis(100))),
            ) {
                Ok(watermarks) => return Ok(watermarks),
                // The leader dead, moving or just moved: a transient error;
                // UnknownPartition, which librdkafka answers locally while
                // its cached metadata has no leader for the partition;
                // DestroyBroker, a request queued for a broker the brokers'
                // metadata no longer lists (a dead leader, fenced); or a new
                // leader not caught up yet (OffsetNotAvailable, a leader
                // epoch moving). The cache may be stale: ask for the topic's
                // metadata, then again.
                Err(source) if leader_moving(&source) && !remaining.is_zero() => {
                    tracing::debug!(error = %source, "watermark request failed for now; refreshing metadata and asking again");
                    if let Err(error) = client.fetch_metadata(
                        Some(topic),
                        self.call_timeout
                            .min(remaining.max(Duration::from_millis(100))),
                    ) {
                        tracing::debug!(error = %error, "metadata refresh failed; asking again");
                    }
                    std::thread::sleep(POLL_INTERVAL);
                }
                Err(source) => {
                    return Err(ReadError::Read {
                        topic: topic.to_owned(),
                        partition,
                        source,
                    });
                }
            }
        }
    }
}

/// Whether a watermark request failed because the partition's leader is
/// dead, moving or just moved: asked again (after a metadata refresh), it
/// will be answered.
fn leader_moving(error: &KafkaError) -> bool {
    is_transient(error)
        || matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::UnknownPartition
                    | RDKafkaErrorCode::DestroyBroker
                    | RDKafkaErrorCode::OffsetNotAvailable
                    | RDKafkaErrorCode::FencedLeaderEpoch
                    | RDKafkaErrorCode::UnknownLeaderEpoch
            )
        )
}

/// Reaching the end of a partition is how a read ends, not an error.
pub struct QuietAboutTheEnd;

impl ClientContext for QuietAboutTheEnd {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            tracing::warn!(error = %error, reason, "kafka reader error");
        }
    }
}

impl ConsumerContext for QuietAboutTheEnd {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moving_leader_is_asked_again_and_a_refusal_is_not() {
        for code in [
            RDKafkaErrorCode::OperationTimedOut,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::DestroyBroker,
            RDKafkaErrorCode::OffsetNotAvailable,
            RDKafkaErrorCode::UnknownPartition,
            RDKafkaErrorCode::FencedLeaderEpoch,
        ] {
            assert!(leader_moving(&KafkaError::MetadataFetch(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::UnknownTopicOrPartition,
        ] {
            assert!(!leader_moving(&KafkaError::MetadataFetch(code)), "{code:?}");
        }
    }
}

//! The consumer's context: rebalance handling and assignment bookkeeping.
//!
//! librdkafka runs these callbacks on the thread that polls, i.e. inside
//! `next_array`, so between two arrays the assignment cannot change under
//! the caller. Every assigned partition gets an epoch; an array remembers the
//! epochs it was read under, and a commit drops partitions whose epoch has
//! changed since (revoked, possibly given back).
//!
//! Each assigned partition also has a commit point: the offset the group
//! holds for it, as far as this consumer knows (its start at assignment,
//! then what this consumer committed). A transactional commit carries the
//! commit point of every owned partition, moved or not, so the broker checks
//! every transaction against the group's generation.
//!
//! While the caller works on an array, a keep-alive (`consumer.rs`,
//! [`KeepAlive`](crate::KeepAlive)) polls to stay in the group; a rebalance
//! callback it serves is not applied then but kept ([`DeferredRebalance`])
//! and applied by the next read, first thing. librdkafka waits for the
//! assign/unassign call (its WAIT_ASSIGN_CALL / WAIT_UNASSIGN_CALL states,
//! heartbeating meanwhile), so the assignment still changes only inside
//! `next_array`, as the commits rely on.
//!
//! With `statistics.interval.ms` set, librdkafka's statistics arrive here too
//! (on the same polling thread): each assigned partition's high watermark,
//! last stable offset and position are kept for the lag metrics, at no cost
//! to the polling loop beyond one small JSON parse per interval.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

/// What the caller learns about the group's decisions, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RebalanceEvent {
    /// These partitions are now ours, starting at the committed offset (or the
    /// beginning of the log for a partition the group never committed).
    Assigned(Vec<i32>),
    /// These partitions are no longer ours. `lost` is true when the group
    /// took them away without asking (session timeout): anything uncommitted
    /// on them belongs to the next owner.
    Revoked { partitions: Vec<i32>, lost: bool },
}

#[derive(Debug, Default)]
pub(crate) struct AssignmentState {
    /// Assigned partitions and the epoch each was assigned under.
    pub assigned: BTreeMap<i32, u64>,
    /// For each assigned partition, the offset the group holds for it as far
    /// as this consumer knows: the committed offset at assignment (the log's
    /// beginning for a partition the group never committed), then each
    /// offset this consumer commits. Absent while it could not be read.
    pub commit_points: BTreeMap<i32, i64>,
    next_epoch: u64,
    /// Events not yet handed to the caller.
    pub pending_events: Vec<RebalanceEvent>,
    /// True once the group gave this member its first assignment.
    pub joined: bool,
    /// Partitions whose read position has reached their end (last stable
    /// offset), according to librdkafka's partition-EOF events.
    pub at_end: BTreeSet<i32>,
    /// An error found inside a callback, surfaced by the next poll.
    pub callback_error: Option<KafkaError>,
    /// The offsets librdkafka last reported per partition of the topic.
    pub progress: BTreeMap<i32, PartitionProgress>,
    /// Whether the last statistics showed at least one broker connected;
    /// `None` before the first statistics.
    pub brokers_up: Option<bool>,
    /// The metadata committed beside each assigned partition's offset, read
    /// at assignment (absent: none).
    pub committed_metadata: BTreeMap<i32, String>,
    /// Assigned partitions the caller holds and cannot serve (paused, see
    /// `ArrayConsumer::hold`): they do not hold back `caught_up`, and a
    /// keep-alive neither pauses nor resumes them.
    pub unserved: BTreeSet<i32>,
    /// True while a keep-alive polls: rebalance callbacks are deferred.
    pub keeping_alive: bool,
    /// Rebalance callbacks a keep-alive poll served, in order, for the next
    /// read to apply.
    pub deferred: Vec<DeferredRebalance>,
    /// Partitions a keep-alive paused (resumed when it stops).
    pub paused: BTreeSet<i32>,
    /// Messages a keep-alive poll received (none is expected: it pauses
    /// every assigned partition first): the next read hands them out first.
    pub held: Vec<crate::InMessage>,
    /// An error a keep-alive poll received, surfaced by the next read.
    pub held_error: Option<KafkaError>,
}

/// A rebalance callback served by a keep-alive poll, applied by the next
/// read: what librdkafka asked, on which partitions, and whether the
/// assignment was lost (judged when the callback came).
#[derive(Debug)]
pub(crate) struct DeferredRebalance {
    kind: RDKafkaRespErr,
    partitions: TopicPartitionList,
    lost: bool,
}

/// Where one partition stands, from librdkafka's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionProgress {
    pub partition: i32,
    /// The offset after the last message in the log (committed or not,
    /// transaction markers included).
    pub high_watermark: i64,
    /// The offset below which every transaction has ended: what a
    /// read_committed consumer can read up to.
    pub last_stable_offset: i64,
    /// The consumer's position: the offset after the last message handed to
    /// the application or, once the partition's end was reached, that end
    /// (a read_committed consumer never receives transaction markers or
    /// aborted messages, so its last message can sit below the end).
    pub position: i64,
}

impl PartitionProgress {
    /// Messages in the log past the position: high watermark - position.
    pub fn lag(&self) -> i64 {
        (self.high_watermark - self.position).max(0)
    }

    /// Messages held back by open transactions: high watermark - last stable
    /// offset. Stays above zero while a transaction hangs.
    pub fn unstable(&self) -> i64 {
        (self.high_watermark - self.last_stable_offset).max(0)
    }

    /// From one partition of librdkafka's statistics; `None` while the broker
    /// has not reported the partition's offsets yet.
    pub(crate) fn from_statistics(partition: &rdkafka::statistics::Partition) -> Option<Self> {
        if partition.partition < 0 || partition.hi_offset < 0 {
            return None;
        }
        // librdkafka reports unknown offsets as negative logical values.
        let known = |offset: i64| (offset >= 0).then_some(offset);
        let last_stable_offset = known(partition.ls_offset).unwrap_or(partition.hi_offset);
        // Before the first message the consumer stands at its committed
        // offset (or at the beginning of the log).
        let position = [
            partition.app_offset,
            partition.eof_offset,
            partition.committed_offset,
        ]
        .into_iter()
        .filter_map(known)
        .max()
        .or_else(|| known(partition.lo_offset))
        .unwrap_or(0);
        Some(PartitionProgress {
            partition: partition.partition,
            high_watermark: partition.hi_offset,
            last_stable_offset,
            position,
        })
    }
}

impl AssignmentState {
    pub fn caught_up(&self) -> bool {
        self.joined
            && self.assigned.keys().all(|partition| {
                self.at_end.contains(partition) || self.unserved.contains(partition)
            })
    }
}

pub(crate) struct QueueContext {
    pub topic: String,
    pub state: Mutex<AssignmentState>,
    pub request_timeout: Duration,
}

impl QueueContext {
    pub fn new(topic: &str, request_timeout: Duration) -> Self {
        QueueContext {
            topic: topic.to_owned(),
            state: Mutex::new(AssignmentState::default()),
            request_timeout,
        }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, AssignmentState> {
        self.state.lock().expect("assignment state lock")
    }

    /// Sets each newly assigned partition's start: its committed offset, or
    /// the beginning of the log when the group never committed one. Returns
    /// each start as a number (the beginning read as the log's low
    /// watermark), the partitions' first commit points.
    fn set_start_offsets(
        &self,
        consumer: &BaseConsumer<Self>,
        assignment: &mut TopicPartitionList,
    ) -> (BTreeMap<i32, i64>, BTreeMap<i32, String>) {
        let mut starts = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        let committed = match consumer.committed_offsets(assignment.clone(), self.request_timeout) {
            Ok(committed) => committed,
            Err(error) => {
                // Without the committed offsets we cannot tell "new" from
                // "committed": assign anyway (librdkafka fetches them itself)
                // and let an out-of-range surface as an error.
                tracing::warn!(error = %error, "could not read committed offsets on assignment");
                return (starts, metadata);
            }
        };
        for element in committed.elements() {
            if !element.metadata().is_empty() {
                metadata.insert(element.partition(), element.metadata().to_owned());
            }
            let start = match element.offset() {
                Offset::Offset(offset) => {
                    starts.insert(element.partition(), offset);
                    Offset::Offset(offset)
                }
                _ => {
                    match consumer.fetch_watermarks(
                        element.topic(),
                        element.partition(),
                        self.request_timeout,
                    ) {
                        Ok((low, _)) => {
                            starts.insert(element.partition(), low);
                        }
                        // Its commit point stays unknown until it is read:
                        // the other partitions still carry the group check.
                        Err(error) => tracing::warn!(
                            error = %error,
                            partition = element.partition(),
                            "could not read where a new partition begins"
                        ),
                    }
                    Offset::Beginning
                }
            };
            if let Err(error) =
                assignment.set_partition_offset(element.topic(), element.partition(), start)
            {
                tracing::warn!(error = %error, partition = element.partition(), "could not set start offset");
            }
        }
        (starts, metadata)
    }
}

impl ClientContext for QueueContext {
    /// Keeps what the lag metrics need from the statistics (only the
    /// partitions of the topic; unassigned ones are filtered when read).
    fn stats(&self, statistics: Statistics) {
        let progress: BTreeMap<i32, PartitionProgress> = statistics
            .topics
            .get(&self.topic)
            .map(|topic| {
                topic
                    .partitions
                    .values()
                    .filter_map(PartitionProgress::from_statistics)
                    .map(|progress| (progress.partition, progress))
                    .collect()
            })
            .unwrap_or_default();
        // Bootstrap entries ("host:port/bootstrap") count too: before the
        // first metadata they are the only brokers known.
        let brokers_up = statistics
            .brokers
            .values()
            .filter(|broker| broker.source != "internal")
            .any(|broker| broker.state == "UP");
        let mut state = self.lock();
        state.progress = progress;
        state.brokers_up = Some(brokers_up);
    }

    /// librdkafka reports every error event here as well as to the poll that
    /// returns it; the poll decides what it means. Reaching the end of a
    /// partition is routine (drain mode waits for it), not an error.
    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(rdkafka::error::RDKafkaErrorCode::PartitionEOF)
        ) {
            tracing::trace!(reason, "partition end reached");
        } else {
            tracing::warn!(error = %error, reason, "kafka consumer error");
        }
    }
}

impl QueueContext {
    /// Applies the rebalance callbacks a keep-alive deferred, in order: what
    /// the callback would have done then. Called by a read, on the polling
    /// thread, before it polls.
    pub(crate) fn apply_deferred(&self, consumer: &BaseConsumer<Self>) {
        let deferred = std::mem::take(&mut self.lock().deferred);
        for mut rebalance in deferred {
            self.apply_rebalance(
                consumer,
                rebalance.kind,
                &mut rebalance.partitions,
                rebalance.lost,
            );
        }
    }

    fn apply_rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        error: RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
        lost: bool,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let numbers: Vec<i32> = partitions
            .elements()
            .iter()
            .filter(|element| element.topic() == self.topic)
            .map(|element| element.partition())
            .collect();
        match error {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let (starts, metadata) = self.set_start_offsets(consumer, partitions);
                let result = if cooperative {
                    consumer.incremental_assign(partitions)
                } else {
                    consumer.assign(partitions)
                };
                let mut state = self.lock();
                if let Err(error) = result {
                    tracing::error!(error = %error, "assign failed");
                    state.callback_error.get_or_insert(error);
                    return;
                }
                if !cooperative {
                    state.assigned.clear();
                    state.commit_points.clear();
                    state.unserved.clear();
                    state.committed_metadata.clear();
                }
                for &partition in &numbers {
                    state.next_epoch += 1;
                    let epoch = state.next_epoch;
                    state.assigned.insert(partition, epoch);
                    state.at_end.remove(&partition);
                    match starts.get(&partition) {
                        Some(&start) => state.commit_points.insert(partition, start),
                        None => state.commit_points.remove(&partition),
                    };
                    state.unserved.remove(&partition);
                    match metadata.get(&partition) {
                        Some(text) => state.committed_metadata.insert(partition, text.clone()),
                        None => state.committed_metadata.remove(&partition),
                    };
                }
                state.joined = true;
                tracing::info!(partitions = ?numbers, "partitions assigned");
                state.pending_events.push(RebalanceEvent::Assigned(numbers));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                {
                    let mut state = self.lock();
                    for partition in &numbers {
                        state.assigned.remove(partition);
                        state.commit_points.remove(partition);
                        state.at_end.remove(partition);
                        state.paused.remove(partition);
                        state.unserved.remove(partition);
                        state.committed_metadata.remove(partition);
                    }
                    state
                        .held
                        .retain(|message| !numbers.contains(&message.partition));
                    tracing::info!(partitions = ?numbers, lost, "partitions revoked");
                    state.pending_events.push(RebalanceEvent::Revoked {
                        partitions: numbers,
                        lost,
                    });
                }
                let result = if cooperative {
                    consumer.incremental_unassign(partitions)
                } else {
                    consumer.unassign()
                };
                if let Err(error) = result {
                    tracing::error!(error = %error, "unassign failed");
                    self.lock().callback_error.get_or_insert(error);
                }
            }
            other => {
                tracing::error!(error = ?other, "rebalance error");
                if !cooperative {
                    let _ = consumer.unassign();
                }
            }
        }
    }
}

impl ConsumerContext for QueueContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        error: RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
    ) {
        let lost = error == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS
            && consumer.assignment_lost();
        {
            let mut state = self.lock();
            if state.keeping_alive {
                tracing::info!(
                    kind = ?error,
                    partitions = partitions.count(),
                    lost,
                    "rebalance deferred until the array in hand is committed"
                );
                state.deferred.push(DeferredRebalance {
                    kind: error,
                    partitions: partitions.clone(),
                    lost,
                });
                return;
            }
        }
        self.apply_rebalance(consumer, error, partitions, lost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::statistics::Partition;

    /// librdkafka's "not known" offset.
    const UNKNOWN: i64 = -1001;

    /// Partition 3 as the statistics describe it before any fetch.
    fn partition() -> Partition {
        Partition {
            partition: 3,
            app_offset: UNKNOWN,
            committed_offset: UNKNOWN,
            eof_offset: UNKNOWN,
            hi_offset: UNKNOWN,
            ls_offset: UNKNOWN,
            ..Partition::default()
        }
    }

    #[test]
    fn offsets_unknown_to_the_broker_give_no_progress() {
        assert_eq!(PartitionProgress::from_statistics(&partition()), None);
    }

    #[test]
    fn a_consumer_at_the_end_has_no_lag_even_below_a_transaction_marker() {
        // The last record is at 41, its commit marker at 42: the application
        // got 41 (app_offset 42) and librdkafka signalled the end at 43.
        let progress = PartitionProgress::from_statistics(&Partition {
            hi_offset: 43,
            ls_offset: 43,
            app_offset: 42,
            eof_offset: 43,
            ..partition()
        })
        .unwrap();
        assert_eq!(progress.position, 43);
        assert_eq!(progress.lag(), 0);
        assert_eq!(progress.unstable(), 0);
    }

    #[test]
    fn lag_counts_from_the_committed_offset_before_the_first_message() {
        let progress = PartitionProgress::from_statistics(&Partition {
            hi_offset: 100,
            ls_offset: 90,
            committed_offset: 60,
            ..partition()
        })
        .unwrap();
        assert_eq!(progress.lag(), 40);
        assert_eq!(progress.unstable(), 10, "an open transaction holds 10 back");
    }
}

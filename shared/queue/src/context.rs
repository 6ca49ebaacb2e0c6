//! The consumer's context: rebalance handling and assignment bookkeeping.
//!
//! librdkafka runs these callbacks on the thread that polls, i.e. inside
//! `next_array`, so between two arrays the assignment cannot change under
//! the caller. Every assigned partition gets an epoch; an array remembers the
//! epochs it was read under, and a commit drops partitions whose epoch has
//! changed since (revoked, possibly given back).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
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
}

impl AssignmentState {
    pub fn caught_up(&self) -> bool {
        self.joined
            && self
                .assigned
                .keys()
                .all(|partition| self.at_end.contains(partition))
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
    /// the beginning of the log when the group never committed one.
    fn set_start_offsets(
        &self,
        consumer: &BaseConsumer<Self>,
        assignment: &mut TopicPartitionList,
    ) {
        let committed = match consumer.committed_offsets(assignment.clone(), self.request_timeout) {
            Ok(committed) => committed,
            Err(error) => {
                // Without the committed offsets we cannot tell "new" from
                // "committed": assign anyway (librdkafka fetches them itself)
                // and let an out-of-range surface as an error.
                tracing::warn!(error = %error, "could not read committed offsets on assignment");
                return;
            }
        };
        for element in committed.elements() {
            let start = match element.offset() {
                Offset::Offset(offset) => Offset::Offset(offset),
                _ => Offset::Beginning,
            };
            if let Err(error) =
                assignment.set_partition_offset(element.topic(), element.partition(), start)
            {
                tracing::warn!(error = %error, partition = element.partition(), "could not set start offset");
            }
        }
    }
}

impl ClientContext for QueueContext {
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

impl ConsumerContext for QueueContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        error: RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
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
                self.set_start_offsets(consumer, partitions);
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
                }
                for &partition in &numbers {
                    state.next_epoch += 1;
                    let epoch = state.next_epoch;
                    state.assigned.insert(partition, epoch);
                    state.at_end.remove(&partition);
                }
                state.joined = true;
                tracing::info!(partitions = ?numbers, "partitions assigned");
                state.pending_events.push(RebalanceEvent::Assigned(numbers));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let lost = consumer.assignment_lost();
                {
                    let mut state = self.lock();
                    for partition in &numbers {
                        state.assigned.remove(partition);
                        state.at_end.remove(partition);
                    }
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

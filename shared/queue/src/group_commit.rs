//! Group commit: arrays that arrive together share one transaction.
//!
//! A Kafka producer has one open transaction at a time. Rather than one
//! transaction round trip per request, a single task takes every array
//! waiting when the previous transaction ends, publishes them all in the next
//! one, and answers each caller when it commits. If it fails, every caller in
//! it gets the error and none of their arrays is visible.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tokio::sync::{mpsc, oneshot};

use crate::producer::Followers;
use crate::{MessageId, OutMessage, QueueError, TransactionalProducer};

/// Bounds on one group-commit transaction and on the waiting line.
#[derive(Debug, Clone, Copy)]
pub struct GroupCommitLimits {
    /// Stop adding arrays to a transaction past this many messages (an array
    /// larger than this still goes alone, whole).
    pub max_messages: usize,
    /// The same, in payload bytes.
    pub max_bytes: usize,
    /// Arrays that may wait for the next transaction; callers beyond that
    /// wait for room (the caller decides whether to time out).
    pub queue_depth: usize,
    /// An array that has waited longer than this for its transaction to
    /// begin is answered [`QueueError::TransactionAborted`] without being
    /// sent (nothing of it published): while Kafka is away each
    /// transaction takes its whole send timeout, a put-off abort or a
    /// release may come first, and a caller should not wait through
    /// several. The caller gives up by itself once this has passed and its
    /// array was not taken into a transaction, whatever the task is doing.
    /// `None`: no bound.
    pub max_wait: Option<Duration>,
}

impl Default for GroupCommitLimits {
    fn default() -> Self {
        GroupCommitLimits {
            max_messages: 50_000,
            max_bytes: 64 * 1024 * 1024,
            queue_depth: 1024,
            max_wait: None,
        }
    }
}

/// One group-commit transaction, as told to a [`TransactionObserver`].
#[derive(Debug, Clone, Copy)]
pub struct TransactionReport {
    pub arrays: usize,
    pub messages: usize,
    pub bytes: usize,
    /// From the transaction's start to its commit or abort.
    pub elapsed: Duration,
    /// `committed`, `aborted` (nothing visible) or `unknown` (the commit was
    /// asked for and did not finish).
    pub outcome: &'static str,
}

/// Called after every transaction (metrics).
pub type TransactionObserver = Arc<dyn Fn(&TransactionReport) + Send + Sync>;

struct Request {
    queued_at: Instant,
    messages: Vec<OutMessage>,
    followers: Option<Followers>,
    reply: oneshot::Sender<Result<Vec<MessageId>, QueueError>>,
    /// Who has the array: [`WAITING`] until the task takes it into a
    /// transaction ([`TAKEN`]) or the caller gives up on it ([`ABANDONED`]);
    /// whichever comes first decides.
    state: Arc<AtomicU8>,
}

const WAITING: u8 = 0;
const TAKEN: u8 = 1;
const ABANDONED: u8 = 2;

/// The front of a transactional producer for concurrent callers.
#[derive(Clone)]
pub struct ArrayEnqueuer {
    requests: mpsc::Sender<Request>,
    max_wait: Option<Duration>,
}

impl ArrayEnqueuer {
    /// Starts the group-commit task on the current runtime. It ends when every
    /// clone of the enqueuer is dropped.
    pub fn start(producer: TransactionalProducer, limits: GroupCommitLimits) -> Self {
        Self::start_observed(producer, limits, None)
    }

    /// [`start`](Self::start), calling `observer` after every transaction.
    pub fn start_observed(
        producer: TransactionalProducer,
        limits: GroupCommitLimits,
        observer: Option<TransactionObserver>,
    ) -> Self {
        let (requests, receiver) = mpsc::channel(limits.queue_depth.max(1));
        tokio::spawn(run_group_commit(producer, limits, receiver, observer));
        ArrayEnqueuer {
            requests,
            max_wait: limits.max_wait,
        }
    }

    /// ENQUEUE_ARRAY: publishes `messages` atomically (possibly in a
    /// transaction shared with other callers' arrays) and returns one id per
    /// message, in order.
    pub async fn enqueue_array(
        &self,
        messages: Vec<OutMessage>,
    ) -> Result<Vec<MessageId>, QueueError> {
        self.enqueue_array_then(messages, None).await
    }

    /// [`enqueue_array`](Self::enqueue_array) with `followers`, made from
    /// this array's ids and written in the same transaction (see
    /// [`TransactionalProducer::transact_then`]).
    pub async fn enqueue_array_then(
        &self,
        messages: Vec<OutMessage>,
        followers: Option<Followers>,
    ) -> Result<Vec<MessageId>, QueueError> {
        let (reply, mut answer) = oneshot::channel();
        let queued_at = Instant::now();
        let state = Arc::new(AtomicU8::new(WAITING));
        self.requests
            .send(Request {
                queued_at,
                messages,
                followers,
                reply,
                state: Arc::clone(&state),
            })
            .await
            .map_err(|_| QueueError::EnqueuerStopped)?;
        if let Some(max_wait) = self.max_wait {
            let deadline = tokio::time::Instant::from_std(queued_at + max_wait);
            if let Ok(answered) = tokio::time::timeout_at(deadline, &mut answer).await {
                return answered.map_err(|_| QueueError::EnqueuerStopped)?;
            }
            // Not answered in time: unless its transaction has begun, the
            // array is given up here (the task skips it) and nothing of it
            // is ever sent.
            if state
                .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Err(waited_too_long());
            }
        }
        answer.await.map_err(|_| QueueError::EnqueuerStopped)?
    }
}

/// The answer to an array that waited past `max_wait` for its transaction:
/// aborted, nothing of it sent.
fn waited_too_long() -> QueueError {
    QueueError::TransactionAborted(KafkaError::MessageProduction(
        RDKafkaErrorCode::MessageTimedOut,
    ))
}

async fn run_group_commit(
    producer: TransactionalProducer,
    limits: GroupCommitLimits,
    mut receiver: mpsc::Receiver<Request>,
    observer: Option<TransactionObserver>,
) {
    while let Some(first) = receiver.recv().await {
        if first.state.load(Ordering::Acquire) == ABANDONED {
            continue;
        }
        // The producer is readied before any array is taken: a put-off
        // abort and a release due (after the brokers were gone) can each
        // take seconds, and callers waiting through them give up on time
        // instead of being held by a transaction they are already in.
        let readied = producer.ready().await;
        let Some(first) = in_time(first, &limits) else {
            continue;
        };
        let mut group = vec![first];
        let mut messages = group[0].messages.len();
        let mut bytes = payload_bytes(&group[0].messages);
        while messages < limits.max_messages && bytes < limits.max_bytes {
            let Ok(next) = receiver.try_recv() else { break };
            let Some(next) = in_time(next, &limits) else {
                continue;
            };
            messages += next.messages.len();
            bytes += payload_bytes(&next.messages);
            group.push(next);
        }
        let sizes: Vec<usize> = group.iter().map(|request| request.messages.len()).collect();
        let mut replies = Vec::with_capacity(group.len());
        let mut all_messages = Vec::with_capacity(messages);
        let mut followers = Vec::new();
        for request in group {
            all_messages.extend(request.messages);
            replies.push(request.reply);
            followers.push(request.followers);
        }
        // Each array's followers are made from its own ids.
        let followers: Option<Followers> = followers.iter().any(Option::is_some).then(|| {
            let sizes = sizes.clone();
            Box::new(move |ids: &[MessageId]| {
                let mut rest = ids;
                let mut out = Vec::new();
                for (size, make) in sizes.into_iter().zip(followers) {
                    let (own, after) = rest.split_at(size.min(rest.len()));
                    rest = after;
                    if let Some(make) = make {
                        out.extend(make(own));
                    }
                }
                out
            }) as Followers
        });
        tracing::debug!(arrays = sizes.len(), messages, bytes, "group commit");
        let started = Instant::now();
        // A release that failed is still due: its error answers the group
        // rather than a second attempt inside the transaction.
        let outcome = match readied {
            Ok(()) => producer.transact_then(all_messages, followers).await,
            Err(error) => Err(error),
        };
        if let Some(observer) = &observer {
            observer(&TransactionReport {
                arrays: sizes.len(),
                messages,
                bytes,
                elapsed: started.elapsed(),
                outcome: match &outcome {
                    Ok(_) => "committed",
                    Err(QueueError::CommitOutcomeUnknown { .. }) => "unknown",
                    Err(_) => "aborted",
                },
            });
        }
        match outcome {
            Ok(ids) => {
                let mut ids = ids.into_iter();
                for (reply, size) in replies.into_iter().zip(sizes) {
                    let _caller_may_be_gone = reply.send(Ok(ids.by_ref().take(size).collect()));
                }
            }
            // Each caller gets its own messages' ids, to settle the outcome.
            Err(QueueError::CommitOutcomeUnknown { source, ids }) if ids.len() == messages => {
                let mut ids = ids.into_iter();
                for (reply, size) in replies.into_iter().zip(sizes) {
                    let _caller_may_be_gone = reply.send(Err(QueueError::CommitOutcomeUnknown {
                        source: source.clone(),
                        ids: ids.by_ref().take(size).collect(),
                    }));
                }
            }
            Err(error) => {
                for reply in replies {
                    let _caller_may_be_gone = reply.send(Err(error.clone()));
                }
            }
        }
        // Everyone is answered: now the failed transaction's abort, if
        // one was put off, before the next group begins.
        producer.finish_pending_abort().await;
    }
}

/// The request, taken into the next transaction, unless its caller gave up
/// on it or it waited past `limits.max_wait` for a transaction to begin:
/// then it is (or was) answered as aborted, nothing of it sent.
fn in_time(request: Request, limits: &GroupCommitLimits) -> Option<Request> {
    if request
        .state
        .compare_exchange(WAITING, TAKEN, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return None;
    }
    let waited = request.queued_at.elapsed();
    match limits.max_wait {
        Some(max_wait) if waited > max_wait => {
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                "array waited too long for a transaction"
            );
            let _caller_may_be_gone = request.reply.send(Err(waited_too_long()));
            None
        }
        _ => Some(request),
    }
}

fn payload_bytes(messages: &[OutMessage]) -> usize {
    messages.iter().map(OutMessage::approximate_size).sum()
}

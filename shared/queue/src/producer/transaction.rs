//! One transaction, from `begin` to its commit or abort, on the holder of
//! the transaction lock.

use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureRecord, Producer};

use super::state::{
    self, AfterCommitFailure, AfterRefusedAbort, CommitFailure, Ending, Event, State,
};
use super::{Followers, Locked, OffsetsInTransaction};
use crate::{MessageId, OutMessage, QueueError};

/// How long past its own timeout a call to librdkafka's
/// `send_offsets_to_transaction` is waited for (see `Locked::send_offsets`).
const SEND_OFFSETS_GRACE: Duration = Duration::from_secs(5);

/// How long one transaction may take: sending and flushing its messages,
/// then its commit (all attempts together when bounded).
#[derive(Clone, Copy)]
pub(super) struct Budget {
    pub send: Duration,
    pub commit: Option<Duration>,
    pub commit_attempts: usize,
}

impl Budget {
    /// A release's: `patience` to send, `patience` for the commit, retried
    /// as often as fits in it.
    pub fn patient(patience: Duration) -> Self {
        Budget {
            send: patience,
            commit: Some(patience),
            commit_attempts: usize::MAX,
        }
    }
}

/// The group coordinator's answers to offsets sent by a member whose
/// generation is no longer the group's: a rebalance moved on without it, or
/// it was fenced (same static id) or timed out (frozen). librdkafka makes the
/// transaction abortable, not fatal.
fn refused_by_the_group(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::IllegalGeneration
                | RDKafkaErrorCode::UnknownMemberId
                | RDKafkaErrorCode::FencedInstanceId
                | RDKafkaErrorCode::RebalanceInProgress
        )
    )
}

impl Locked<'_> {
    /// One transaction.
    pub(super) fn transact_locked(
        &mut self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
        followers: Option<Followers>,
        budget: Budget,
        defer_abort: bool,
    ) -> Result<Vec<MessageId>, QueueError> {
        if let Err(error) = self.producer().begin_transaction() {
            // begin is local: it fails only when the state is not what we
            // think (an earlier abort still running), so start afresh.
            self.mark_unusable("begin_transaction failed", &error);
            return Err(self.classify(error));
        }
        let deadline = Instant::now() + budget.send;
        let deliveries = match self.send_all(messages, offsets, deadline) {
            Ok(deliveries) => deliveries,
            Err(error) => {
                // The commit was never asked for: nothing of this transaction
                // can become visible, whatever the abort does.
                self.end_failed(&error, defer_abort);
                return Err(error);
            }
        };
        // Every delivery report has arrived: send_all flushed.
        let ids: Result<Vec<MessageId>, KafkaError> = deliveries
            .into_iter()
            .map(|delivery| match futures::executor::block_on(delivery) {
                Ok(Ok(delivered)) => Ok(MessageId {
                    partition: delivered.partition,
                    offset: delivered.offset,
                }),
                Ok(Err((error, _))) => Err(error),
                Err(_cancelled) => Err(KafkaError::Canceled),
            })
            .collect();
        if let Some(followers) = followers {
            // Still before the commit: a failure here aborts it all.
            let extra = match &ids {
                Ok(ids) => followers(ids),
                Err(error) => {
                    let error = QueueError::TransactionAborted(error.clone());
                    self.end_failed(&error, defer_abort);
                    return Err(error);
                }
            };
            let delivered = self
                .send_all(&extra, None, deadline)
                .and_then(|deliveries| {
                    for delivery in deliveries {
                        match futures::executor::block_on(delivery) {
                            Ok(Ok(_)) => {}
                            Ok(Err((error, _))) => {
                                return Err(QueueError::TransactionAborted(error));
                            }
                            Err(_cancelled) => {
                                return Err(QueueError::TransactionAborted(KafkaError::Canceled));
                            }
                        }
                    }
                    Ok(())
                });
            if let Err(error) = delivered {
                self.end_failed(&error, defer_abort);
                return Err(error);
            }
        }
        let committed = self.commit_with_retries(budget);
        match (committed, ids) {
            (Ok(()), Ok(ids)) => Ok(ids),
            // Cannot happen after a successful commit; if it does, the
            // transaction is committed all the same: never say "aborted".
            (Ok(()), Err(source)) => Err(QueueError::CommitOutcomeUnknown {
                source,
                ids: Vec::new(),
            }),
            // The caller can settle it by reading the log at these ids.
            (Err(QueueError::CommitOutcomeUnknown { source, .. }), Ok(ids)) => {
                Err(QueueError::CommitOutcomeUnknown { source, ids })
            }
            (Err(error), _) => Err(error),
        }
    }

    /// Ends a transaction whose commit was never asked for (see
    /// [`state::ending`]).
    fn end_failed(&mut self, error: &QueueError, defer: bool) {
        match state::ending(matches!(error, QueueError::ProducerFatal(_)), defer) {
            Ending::PutOff => self.apply(Event::AbortPutOff),
            Ending::AbortNow => self.abort(),
            Ending::LeftToTheReplacement => {}
        }
    }

    /// The abort put off by [`end_failed`](Self::end_failed), if any.
    pub(super) fn finish_pending_abort(&mut self) {
        if matches!(self.state(), State::AbortPutOff { .. }) {
            self.apply(Event::AbortTakenUp);
            self.abort();
        }
    }

    /// Aborts a transaction whose commit was never asked for. An abort that
    /// does not finish (Kafka away) leaves the producer in a state we no
    /// longer know: it is marked unusable, and its replacement's
    /// `init_transactions` ends the transaction (or the coordinator's
    /// transaction timeout does).
    fn abort(&mut self) {
        let Err(abort_error) = self.producer().abort_transaction(self.inner.send_timeout) else {
            return;
        };
        if self.renewed_after_a_refused_abort() {
            return;
        }
        tracing::warn!(
            transactional_id = %self.inner.transactional_id,
            error = %abort_error,
            "abort of a failed transaction did not finish; the producer will be recreated"
        );
        self.mark_unusable("abort did not finish", &abort_error);
    }

    /// Replaces the producer in place when librdkafka made an abort's
    /// INVALID_TXN_STATE answer fatal (see [`state::after_refused_abort`]):
    /// a fresh producer's `init_transactions` ends what the coordinator
    /// holds of the transaction, and a release is due as after any
    /// connect.
    fn renewed_after_a_refused_abort(&mut self) -> bool {
        let kept = self.producer().client().fatal_error();
        let code = kept.as_ref().map(|(code, _)| *code);
        if state::after_refused_abort(self.state(), code) != AfterRefusedAbort::RenewInPlace {
            return false;
        }
        let reason = kept.map(|(_, reason)| reason).unwrap_or_default();
        match self.renew() {
            Ok(()) => {
                tracing::warn!(
                    transactional_id = %self.inner.transactional_id,
                    reason,
                    "the abort was refused and made the producer fatal (librdkafka#4849); \
                     replaced it with a new one, nothing of the transaction visible"
                );
                true
            }
            Err(error) => {
                tracing::warn!(transactional_id = %self.inner.transactional_id, error = %error, "cannot replace a producer whose abort was refused");
                false
            }
        }
    }

    pub(super) fn mark_unusable(&mut self, why: &'static str, error: &KafkaError) {
        if self.state().is_usable() {
            tracing::warn!(transactional_id = %self.inner.transactional_id, error = %error, why, "producer marked unusable");
        }
        self.apply(Event::Lost);
    }

    /// Sends every message and the offsets, and waits for every delivery
    /// report, all before `deadline`.
    fn send_all(
        &mut self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
        deadline: Instant,
    ) -> Result<Vec<DeliveryFuture>, QueueError> {
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
            deliveries.push(self.send_one(message, deadline)?);
        }
        if let Some(offsets) = offsets {
            self.send_offsets(offsets)?;
        }
        self.flush_deliveries(deadline)?;
        Ok(deliveries)
    }

    /// Adds the consumer's offsets to the transaction, bounded.
    ///
    /// librdkafka's `send_offsets_to_transaction` waits for its result with
    /// no bound of its own (the timeout is left to the request it sends), and
    /// one of that request's reply paths (an outdated reply, seen after the
    /// group coordinator moved) returns without setting the result: the call
    /// then never returns, and the worker stood still with its consumer's
    /// poll lock held (a three-broker fault test caught it in a gdb dump).
    /// So the call runs on a thread of its own, waited for the timeout (at
    /// most the transaction timeout, which librdkafka caps the call at) plus
    /// [`SEND_OFFSETS_GRACE`]. Past that the producer is marked unusable:
    /// every later transactional call would conflict with the stuck one. The
    /// commit was never asked for, so nothing of the transaction can become
    /// visible: the error is [`QueueError::TransactionAborted`], and its owner
    /// starts a new producer with the same id, which fences this one and ends
    /// the transaction. The stuck thread keeps its clone of the client until
    /// the process exits.
    fn send_offsets(&mut self, offsets: OffsetsInTransaction) -> Result<(), QueueError> {
        // A plain handle: let go on the thread below, never on an async one.
        let producer = super::Client::clone(self.producer());
        let timeout = self.inner.timeout;
        let (done, answer) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("send-offsets".into())
            .spawn(move || {
                let sent = producer.send_offsets_to_transaction(
                    &offsets.offsets,
                    &offsets.group_metadata,
                    timeout,
                );
                let _caller_may_have_given_up = done.send(sent);
            })
            .map_err(|error| {
                // No thread, no call: nothing of the offsets was sent, and
                // the transaction is aborted like any that failed to send.
                tracing::error!(error = %error, "cannot start a thread to send the offsets");
                QueueError::TransactionAborted(KafkaError::MessageProduction(
                    RDKafkaErrorCode::Fail,
                ))
            })?;
        // librdkafka caps the call at what is left of the transaction
        // timeout: an answer that has not come by then never will.
        let patience = timeout.min(self.inner.transaction_timeout) + SEND_OFFSETS_GRACE;
        match answer.recv_timeout(patience) {
            Ok(sent) => sent.map_err(|error| match self.classify(error) {
                QueueError::TransactionAborted(error) if refused_by_the_group(&error) => {
                    QueueError::GroupRefused(error)
                }
                other => other,
            }),
            Err(_) => {
                let error = KafkaError::MessageProduction(RDKafkaErrorCode::OperationTimedOut);
                tracing::error!(
                    transactional_id = %self.inner.transactional_id,
                    waited_ms = patience.as_millis() as u64,
                    "librdkafka's send_offsets_to_transaction did not return; \
                     the producer is replaced (its transaction ends with the replacement)"
                );
                self.mark_unusable("send_offsets_to_transaction did not return", &error);
                // Not fenced: the caller's session restarts (a new producer)
                // as after any aborted transaction.
                Err(QueueError::TransactionAborted(error))
            }
        }
    }

    /// Queues one message, waiting while librdkafka's local queue is full.
    fn send_one(
        &mut self,
        message: &OutMessage,
        deadline: Instant,
    ) -> Result<DeliveryFuture, QueueError> {
        loop {
            match self.producer().send_result(future_record(message)) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                    if Instant::now() < deadline =>
                {
                    // The local queue drains as batches are acknowledged.
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err((error, _)) => return Err(self.classify(error)),
            }
        }
    }

    /// Sends everything queued at once (ignoring linger) and waits until every
    /// delivery report is in.
    ///
    /// rust-rdkafka's `commit_transaction` flushes by polling in 100 ms slices,
    /// and since FutureProducer's own thread takes the delivery events, each
    /// slice runs to its end: every commit would cost 100 ms, capping a
    /// producer at ten transactions a second. librdkafka's own flush waits on
    /// the message count and returns as soon as the last report is served, so
    /// we flush with it first and the commit's flush finds nothing to wait for.
    fn flush_deliveries(&mut self, deadline: Instant) -> Result<(), QueueError> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let timeout_ms = i32::try_from(remaining.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        // SAFETY: the pointer is the live client owned by the producer,
        // which the lock holder keeps for the whole call; rd_kafka_flush is
        // thread-safe.
        let code = unsafe {
            rdkafka::bindings::rd_kafka_flush(self.producer().client().native_ptr(), timeout_ms)
        };
        if code == rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR {
            Ok(())
        } else {
            Err(self.classify(KafkaError::Flush(code.into())))
        }
    }

    /// Asks for the commit. Only an error that librdkafka says requires an
    /// abort proves nothing was committed; a commit that keeps timing out, or
    /// a fatal error in the middle of it, leaves the outcome unknown (the
    /// coordinator may have written the commit): that is
    /// [`QueueError::CommitOutcomeUnknown`], never "aborted" (see
    /// [`state::after_commit_failure`]).
    fn commit_with_retries(&mut self, budget: Budget) -> Result<(), QueueError> {
        let deadline = budget.commit.map(|budget| Instant::now() + budget);
        let mut attempt = 1;
        loop {
            // With a budget, each attempt gets what is left of it (librdkafka
            // resumes the same commit on a retry), at least 100 ms.
            let timeout = deadline.map_or(self.inner.timeout, |deadline| {
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100))
            });
            let Err(error) = self.producer().commit_transaction(timeout) else {
                return Ok(());
            };
            let time_left = deadline.is_none_or(|deadline| Instant::now() < deadline);
            let failure = CommitFailure::of(&error);
            match state::after_commit_failure(failure, attempt, budget.commit_attempts, time_left) {
                AfterCommitFailure::Retry => {
                    tracing::warn!(attempt, error = %error, "transaction commit is retriable; retrying");
                    attempt += 1;
                }
                AfterCommitFailure::Aborted => {
                    self.abort();
                    return Err(QueueError::TransactionAborted(error));
                }
                AfterCommitFailure::OutcomeUnknown => {
                    // A fatal error is reported by its cause (a fencing, say).
                    let error = match self.classify(error.clone()) {
                        QueueError::ProducerFatal(cause) => cause,
                        _ => error,
                    };
                    self.mark_unusable("commit outcome unknown", &error);
                    tracing::error!(
                        transactional_id = %self.inner.transactional_id,
                        error = %error,
                        "transaction commit did not finish; it may or may not be committed"
                    );
                    return Err(QueueError::CommitOutcomeUnknown {
                        source: error,
                        ids: Vec::new(),
                    });
                }
            }
        }
    }

    /// Maps a librdkafka error to ours; a fatal one makes the producer
    /// unusable ([`Event::Lost`]) and is reported by its cause (see
    /// [`state::reported_cause`]).
    fn classify(&mut self, error: KafkaError) -> QueueError {
        if !state::is_fatal(&error) {
            return QueueError::TransactionAborted(error);
        }
        self.apply(Event::Lost);
        let cause = self.producer().client().fatal_error();
        let fenced = crate::is_fencing_error(&error)
            || cause.as_ref().is_some_and(|(code, _)| {
                crate::is_fencing_error(&KafkaError::MessageProduction(*code))
            });
        tracing::error!(
            transactional_id = %self.inner.transactional_id,
            error = %error,
            cause = ?cause,
            fenced,
            "producer hit a fatal error"
        );
        let kept = cause.map(|(code, _)| code);
        QueueError::ProducerFatal(state::reported_cause(error, kept))
    }

    /// What a call on a producer already unusable answers (see
    /// [`state::unusable_cause`]).
    pub(super) fn fatal_error(&self) -> QueueError {
        let kept = self.producer().client().fatal_error().map(|(code, _)| code);
        QueueError::ProducerFatal(state::unusable_cause(kept))
    }
}

/// `message` as librdkafka's record: topic, payload, key, the partition
/// when the caller chose one, headers.
pub(crate) fn future_record(message: &OutMessage) -> FutureRecord<'_, [u8], [u8]> {
    let mut record: FutureRecord<'_, [u8], [u8]> =
        FutureRecord::to(&message.topic).payload(message.payload.as_slice());
    if let Some(key) = &message.key {
        record = record.key(key.as_slice());
    }
    if let Some(partition) = message.partition {
        record = record.partition(partition);
    }
    if !message.headers.is_empty() {
        let headers = message
            .headers
            .iter()
            .fold(OwnedHeaders::new(), |headers, (name, value)| {
                headers.insert(Header {
                    key: name,
                    value: Some(value.as_slice()),
                })
            });
        record = record.headers(headers);
    }
    record
}

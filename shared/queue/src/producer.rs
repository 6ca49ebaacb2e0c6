//! A transactional producer: one array, one transaction.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientConfig, ClientContext, TopicPartitionList};

use crate::client::producer_config;
use crate::{MessageId, OutMessage, QueueError};

/// How often a commit that librdkafka calls retriable is tried again.
const COMMIT_ATTEMPTS: usize = 3;

/// The transaction timeout of the producer that commits a release after a
/// connect or a disconnection (see [`Release`]): long, so that neither the
/// coordinator nor our own patience ends it with an ABORT while a broker
/// that just came back is still slow. The brokers' default
/// `transaction.max.timeout.ms` (15 min) allows it.
pub const RELEASE_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// How long past its own timeout a call to librdkafka's
/// `send_offsets_to_transaction` is waited for (see `Inner::send_offsets`).
const SEND_OFFSETS_GRACE: Duration = Duration::from_secs(5);

/// Keeps the latest librdkafka statistics (when `statistics.interval.ms` is
/// set) and forwards librdkafka's logs to tracing.
#[derive(Default, Clone)]
pub struct ProducerStatistics {
    latest: Arc<Mutex<Option<Statistics>>>,
    /// Raised when librdkafka reports the brokers gone (all down, or a
    /// broker connection lost): once they answer again, the producer's
    /// partitions should be released (see [`Release`]).
    disconnected: Arc<AtomicBool>,
}

impl ProducerStatistics {
    /// The latest statistics librdkafka emitted, if any.
    pub fn latest(&self) -> Option<Statistics> {
        self.latest.lock().expect("statistics lock").clone()
    }
}

impl ClientContext for ProducerStatistics {
    fn stats(&self, statistics: Statistics) {
        *self.latest.lock().expect("statistics lock") = Some(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::BrokerTransportFailure)
        ) {
            self.disconnected.store(true, Ordering::Release);
        }
        tracing::warn!(target: "librdkafka", error = %error, reason, "kafka producer error");
    }
}

/// What a producer commits to release its partitions, and how long it may
/// wait for that.
///
/// A broker SIGKILLed right after a commit can come back with its
/// transaction coordinator having skipped a partition's COMMIT marker
/// (it found no leader for it at that moment) while marking the
/// transaction complete: a hanging transaction. Every read_committed
/// reader of that partition then stops at the committed records. Only a
/// marker of the same producer ends it, and whichever comes first decides
/// the records' fate: the next COMMIT keeps them, but an ABORT (any later
/// transaction of that producer that touched the partition and failed)
/// throws away records that were acknowledged. So a producer with a
/// release never runs another transaction after connecting, or after the
/// brokers were gone, before its release has committed: one message to
/// every partition it may have written, sent only once each of them has a
/// leader, with patience instead of the caller's short send timeout.
///
/// That patience must outlast a slow restart, and the producer's own
/// transaction timeout (seconds, so that a crashed producer holds readers
/// back only briefly) cannot: a release that overran it was ended by the
/// coordinator, or by our abort, with an ABORT marker, and about one crash
/// round in sixty lost its array that way. So a release after a connect or
/// a disconnection is committed by a twin: a producer with the same
/// transactional id and [`RELEASE_TRANSACTION_TIMEOUT`]. Its
/// `init_transactions` bumps the epoch (a marker of a later epoch still
/// ends the earlier epoch's hanging transaction), and a fresh producer with
/// the ordinary timeout takes over after it. A periodic release (nothing
/// seen, [`TransactionalProducer::request_release`]) runs in place.
#[derive(Clone, Default)]
pub struct Release {
    /// One message per partition the producer may have written; readers
    /// recognise and skip them.
    pub messages: Vec<OutMessage>,
    /// How long waiting for leaders, and then sending and committing a
    /// release, may each take (see [`Release::patience_for`]).
    pub patience: Duration,
    /// Called after each release that committed (a metric).
    pub on_release: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Release {
    /// The patience that fits `settings`: three quarters of the twin's
    /// transaction timeout (the longer of [`RELEASE_TRANSACTION_TIMEOUT`] and
    /// the producer's own), under which neither it nor the coordinator gives
    /// up on the release. A release in place gets at most three quarters of
    /// the producer's own timeout.
    pub fn patience_for(settings: &KafkaSettings) -> Duration {
        three_quarters(release_transaction_timeout(settings))
    }
}

/// Three quarters of a transaction timeout, at least one second: how long a
/// transaction may take before the coordinator's clock becomes a risk.
fn three_quarters(timeout: Duration) -> Duration {
    (timeout * 3 / 4).max(Duration::from_secs(1))
}

/// The twin's transaction timeout for `settings` (see [`Release`]).
fn release_transaction_timeout(settings: &KafkaSettings) -> Duration {
    RELEASE_TRANSACTION_TIMEOUT.max(Duration::from_millis(settings.transaction_timeout_ms))
}

/// How a [`TransactionalProducer`] is built.
#[derive(Clone, Default)]
pub struct ProducerOptions {
    /// Bound on sending one transaction's messages (and on aborting it);
    /// `None`: `kafka.request_timeout_ms`. When Kafka is away, a transaction
    /// fails (aborted, nothing visible) after it.
    pub send_timeout: Option<Duration>,
    /// Bound on a transaction's commit, all retries together; `None`:
    /// [`COMMIT_ATTEMPTS`] attempts of `kafka.request_timeout_ms` each. Past
    /// it the outcome is unknown ([`QueueError::CommitOutcomeUnknown`]): a
    /// caller that answers clients (the API) sets it to keep its answers
    /// bounded while a transaction coordinator moves.
    pub commit_timeout: Option<Duration>,
    /// Committed at connect and whenever the brokers were gone, before any
    /// other transaction (see [`Release`]).
    pub release: Option<Release>,
}

/// A transactional, idempotent (`acks=all`) producer. One call to
/// [`transact`](Self::transact) is one Kafka transaction.
///
/// Calls are serialised: a Kafka producer has one open transaction at a time.
/// Use [`crate::ArrayEnqueuer`] to let concurrent callers share transactions.
#[derive(Clone)]
pub struct TransactionalProducer {
    inner: Arc<Inner>,
}

struct Inner {
    /// Replaced after a release by a twin (see [`Release`]); only the holder
    /// of the transaction lock uses or replaces it.
    producer: RwLock<FutureProducer<ProducerStatistics>>,
    /// How the producer is made (again, after a release by a twin).
    config: ClientConfig,
    /// The ordinary producer's transaction timeout.
    transaction_timeout: Duration,
    /// The twin's (see [`Release`]).
    release_transaction_timeout: Duration,
    statistics: ProducerStatistics,
    transactional_id: String,
    /// How long a blocking call (init, commit, offsets) may take.
    timeout: Duration,
    /// How long sending and flushing one transaction's messages, and aborting
    /// it, may take before the commit is asked for; past it the transaction
    /// is aborted, nothing of it visible.
    send_timeout: Duration,
    /// Bound on a commit, retries included (see [`ProducerOptions`]).
    commit_timeout: Option<Duration>,
    /// One open transaction at a time.
    transaction_lock: Mutex<()>,
    /// Set once librdkafka reports a fatal error (fenced), or once the
    /// producer's transaction state is no longer known (an abort that did not
    /// finish, a commit whose outcome is unknown): the producer is dead and
    /// must be recreated (a new `init_transactions` with the same id fences it
    /// and ends its open transaction).
    fatal: AtomicBool,
    /// What this producer commits to release its partitions, if anything.
    release: Option<Release>,
    /// A release of the producer's partitions is due for cause: the
    /// producer connected, or a release failed (committed by a twin).
    release_pending: AtomicBool,
    /// A periodic release is due (committed in place).
    refresh_pending: AtomicBool,
    /// A transaction failed before its commit was asked for and its abort
    /// was put off until its callers had their answer (see
    /// [`TransactionalProducer::finish_pending_abort`]); whoever takes the
    /// transaction lock next aborts it first.
    abort_pending: AtomicBool,
}

/// Messages written in a transaction after its array's, made from where the
/// array's messages landed (see [`TransactionalProducer::transact_then`]).
pub type Followers = Box<dyn FnOnce(&[MessageId]) -> Vec<OutMessage> + Send>;

/// Consumer offsets to commit inside a transaction, with the consumer's group
/// metadata so the broker refuses them from a fenced or stale member.
pub(crate) struct OffsetsInTransaction {
    pub offsets: TopicPartitionList,
    pub group_metadata: ConsumerGroupMetadata,
}

impl TransactionalProducer {
    /// Creates the producer and initialises its transactions, which fences any
    /// older producer with the same `transactional_id` and aborts its open
    /// transaction.
    pub async fn connect(
        settings: &KafkaSettings,
        transactional_id: &str,
    ) -> Result<Self, QueueError> {
        Self::connect_with(settings, transactional_id, ProducerOptions::default()).await
    }

    /// [`connect`](Self::connect) with options; with a release, the
    /// producer has committed it once this returns.
    pub async fn connect_with(
        settings: &KafkaSettings,
        transactional_id: &str,
        options: ProducerOptions,
    ) -> Result<Self, QueueError> {
        let config = producer_config(settings, transactional_id)?;
        let statistics = ProducerStatistics::default();
        let timeout = Duration::from_millis(settings.request_timeout_ms);
        let producer = {
            let (config, statistics) = (config.clone(), statistics.clone());
            tokio::task::spawn_blocking(move || initialised(&config, statistics, timeout))
                .await?
                .map_err(QueueError::client)?
        };
        tracing::debug!(transactional_id, "transactional producer ready");
        let inner = Arc::new(Inner {
            producer: RwLock::new(producer),
            config,
            transaction_timeout: Duration::from_millis(settings.transaction_timeout_ms),
            release_transaction_timeout: release_transaction_timeout(settings),
            statistics,
            transactional_id: transactional_id.to_owned(),
            timeout,
            send_timeout: options.send_timeout.unwrap_or(timeout),
            commit_timeout: options.commit_timeout,
            transaction_lock: Mutex::new(()),
            fatal: AtomicBool::new(false),
            release_pending: AtomicBool::new(options.release.is_some()),
            refresh_pending: AtomicBool::new(false),
            abort_pending: AtomicBool::new(false),
            release: options.release,
        });
        let producer = TransactionalProducer { inner };
        if producer.release_is_due() {
            producer.release_if_due().await?;
        }
        Ok(producer)
    }

    /// Whether a release is due: the producer has one, and it has not
    /// committed since the producer connected or since librdkafka last
    /// reported the brokers gone. Its next transaction releases first.
    pub fn release_is_due(&self) -> bool {
        self.inner.release_is_due()
    }

    /// Commits the release now if one is due (see [`Release`]), after an
    /// abort put off by [`transact_then`](Self::transact_then); `Ok` when
    /// none is due. On failure the release stays due.
    pub async fn release_if_due(&self) -> Result<(), QueueError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let _one_transaction_at_a_time =
                inner.transaction_lock.lock().expect("transaction lock");
            inner.release_locked()
        })
        .await?
    }

    /// Readies the producer for its next transaction: finishes an abort
    /// put off by [`transact_then`](Self::transact_then) and commits a
    /// release that is due (what [`release_if_due`](Self::release_if_due)
    /// does, without a blocking task when neither is pending). Each can take
    /// seconds while Kafka is away, so a caller that answers others (the
    /// group commit) does this before it takes their arrays. On failure the
    /// release stays due.
    pub async fn ready(&self) -> Result<(), QueueError> {
        if !self.inner.abort_pending.load(Ordering::Acquire) && !self.release_is_due() {
            return Ok(());
        }
        self.release_if_due().await
    }

    /// Makes a periodic release due (for a disconnection librdkafka did not
    /// report); it is committed in place, not by a twin (see [`Release`]).
    pub fn request_release(&self) {
        if self.inner.release.is_some() {
            self.inner.refresh_pending.store(true, Ordering::Release);
        }
    }

    /// False once the producer is fenced, or its transaction state is no
    /// longer known: every further call fails with
    /// [`QueueError::ProducerFatal`]; create a new producer with the same id.
    pub fn is_usable(&self) -> bool {
        !self.inner.fatal.load(Ordering::Acquire)
    }

    /// librdkafka's statistics, refreshed every `statistics.interval.ms`.
    pub fn statistics(&self) -> &ProducerStatistics {
        &self.inner.statistics
    }

    /// Asks the brokers for `topic`'s metadata now, which librdkafka also
    /// keeps for its own routing (rather than at its next periodic refresh,
    /// five minutes by default): returns the partition count this producer
    /// knows, so a caller that chooses partitions itself never names one the
    /// client has not heard of.
    pub async fn refresh_partitions(&self, topic: &str) -> Result<i32, QueueError> {
        let producer = self.inner.producer();
        let (topic, timeout) = (topic.to_owned(), self.inner.timeout);
        tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(Some(&topic), timeout)
                .map_err(QueueError::client)?;
            Ok(metadata
                .topics()
                .iter()
                .find(|found| found.name() == topic && found.error().is_none())
                .map_or(0, |found| found.partitions().len() as i32))
        })
        .await?
    }

    /// Publishes `messages` in one transaction: all visible to read_committed
    /// consumers or none. Returns one id per message, in order.
    ///
    /// [`QueueError::TransactionAborted`] (and `ProducerFatal` before the
    /// commit was asked for) means nothing of it is visible, ever;
    /// [`QueueError::CommitOutcomeUnknown`] means the commit was asked for
    /// and may have happened: the caller must not say it failed.
    pub async fn transact(&self, messages: Vec<OutMessage>) -> Result<Vec<MessageId>, QueueError> {
        let outcome = self.transact_then(messages, None).await;
        self.finish_pending_abort().await;
        outcome
    }

    /// [`transact`](Self::transact), with `followers` written in the same
    /// transaction once every message of `messages` has landed: they are
    /// made from the ids (an answer that names where the array went), and
    /// are visible exactly when the array is. The ids returned are those
    /// of `messages` alone.
    ///
    /// A transaction that fails before its commit is asked for returns at
    /// once, its abort put off: nothing of it can become visible whatever
    /// the abort does, so its callers need not wait for an abort that may
    /// itself take the whole send timeout while Kafka is away. Call
    /// [`finish_pending_abort`](Self::finish_pending_abort) once they are
    /// answered; the next transaction does it first in any case.
    pub async fn transact_then(
        &self,
        messages: Vec<OutMessage>,
        followers: Option<Followers>,
    ) -> Result<Vec<MessageId>, QueueError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.transact_then_blocking(&messages, followers))
            .await?
    }

    /// Aborts the transaction [`transact_then`](Self::transact_then) left
    /// failed, if any (bounded by the send timeout; an abort that does not
    /// finish marks the producer unusable, as ever).
    pub async fn finish_pending_abort(&self) {
        if !self.inner.abort_pending.load(Ordering::Acquire) {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let _joined = tokio::task::spawn_blocking(move || {
            let _one_transaction_at_a_time =
                inner.transaction_lock.lock().expect("transaction lock");
            inner.finish_pending_abort();
        })
        .await;
    }

    /// The blocking form, for callers already on a blocking thread.
    pub(crate) fn transact_blocking(
        &self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
    ) -> Result<Vec<MessageId>, QueueError> {
        self.inner.transact_blocking(messages, offsets)
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

impl Inner {
    fn transact_blocking(
        &self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
    ) -> Result<Vec<MessageId>, QueueError> {
        let _one_transaction_at_a_time = self.transaction_lock.lock().expect("transaction lock");
        self.finish_pending_abort();
        if self.fatal.load(Ordering::Acquire) {
            return Err(self.fatal_error());
        }
        self.release_locked()?;
        self.transact_locked(messages, offsets, None, self.ordinary_budget(), false)
    }

    fn transact_then_blocking(
        &self,
        messages: &[OutMessage],
        followers: Option<Followers>,
    ) -> Result<Vec<MessageId>, QueueError> {
        let _one_transaction_at_a_time = self.transaction_lock.lock().expect("transaction lock");
        self.finish_pending_abort();
        if self.fatal.load(Ordering::Acquire) {
            return Err(self.fatal_error());
        }
        self.release_locked()?;
        self.transact_locked(messages, None, followers, self.ordinary_budget(), true)
    }

    /// The bounds of a transaction of the producer's callers.
    fn ordinary_budget(&self) -> Budget {
        Budget {
            send: self.send_timeout,
            commit: self.commit_timeout,
            commit_attempts: COMMIT_ATTEMPTS,
        }
    }

    /// The producer librdkafka calls go to (see [`Inner::producer`]).
    fn producer(&self) -> FutureProducer<ProducerStatistics> {
        self.producer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A release is due for cause: committed by a twin (see [`Release`]).
    fn release_for_cause(&self) -> bool {
        self.release_pending.load(Ordering::Acquire)
            || self.statistics.disconnected.load(Ordering::Acquire)
    }

    fn release_is_due(&self) -> bool {
        self.release.is_some()
            && (self.release_for_cause() || self.refresh_pending.load(Ordering::Acquire))
    }

    /// Commits the release if one is due; the caller holds the transaction
    /// lock. Nothing is sent until every partition to release has a leader:
    /// a release that failed would be aborted, and its ABORT marker would
    /// end a hanging transaction by throwing its records away.
    fn release_locked(&self) -> Result<(), QueueError> {
        // A release is a transaction too: a put-off abort goes first.
        self.finish_pending_abort();
        let Some(release) = &self.release else {
            return Ok(());
        };
        if !self.release_is_due() {
            return Ok(());
        }
        if self.fatal.load(Ordering::Acquire) {
            return Err(self.fatal_error());
        }
        let by_twin = self.release_for_cause();
        // Cleared before, so a disconnection during the release asks again.
        self.statistics.disconnected.store(false, Ordering::Release);
        self.refresh_pending.store(false, Ordering::Release);
        // Until it commits, the release stays due for cause: one that failed
        // may have left a partition's hanging transaction to a twin.
        self.release_pending.store(true, Ordering::Release);
        let started = Instant::now();
        self.wait_for_leaders(&release.messages, release.patience)?;
        let led = started.elapsed();
        if by_twin {
            self.release_by_twin(release)?;
        } else {
            let patience = release
                .patience
                .min(three_quarters(self.transaction_timeout));
            self.transact_locked(
                &release.messages,
                None,
                None,
                Budget::patient(patience),
                false,
            )?;
        }
        self.release_pending.store(false, Ordering::Release);
        if let Some(on_release) = &release.on_release {
            on_release();
        }
        tracing::info!(
            transactional_id = %self.transactional_id,
            partitions = release.messages.len(),
            by_twin,
            leaders_ms = led.as_millis() as u64,
            transaction_ms = (started.elapsed() - led).as_millis() as u64,
            "partitions released: no transaction of this producer stays open there"
        );
        Ok(())
    }

    /// Commits `release` with a twin (see [`Release`]): a producer with the
    /// same transactional id and the long release transaction timeout, whose
    /// `init_transactions` fences the current producer; then a fresh
    /// producer with the ordinary timeout replaces both, whatever the
    /// release's outcome. If that replacement cannot be made, the producer
    /// is unusable (its owner recreates it, and the release stays due).
    fn release_by_twin(&self, release: &Release) -> Result<(), QueueError> {
        let mut twin_config = self.config.clone();
        twin_config.set(
            "transaction.timeout.ms",
            self.release_transaction_timeout.as_millis().to_string(),
        );
        let released = initialised(&twin_config, self.statistics.clone(), self.timeout)
            // Nothing was sent: like any transaction that failed to send.
            .map_err(QueueError::TransactionAborted)
            .and_then(|twin| {
                // The twin's epoch fenced the producer: it has nothing left
                // to send.
                retire(self.replace_producer(twin));
                let budget = Budget::patient(release.patience);
                self.transact_locked(&release.messages, None, None, budget, false)
            });
        // Whether or not the twin got as far as its init, the current
        // producer may be fenced: replace it with an ordinary one.
        match self.renew() {
            Ok(()) => {
                self.fatal.store(false, Ordering::Release);
                self.abort_pending.store(false, Ordering::Release);
            }
            Err(error) => self.mark_unusable("no producer after a release by a twin", &error),
        }
        released.map(|_| ())
    }

    /// Puts a fresh producer with the ordinary timeout in place of the
    /// current one; its `init_transactions` ends whatever the coordinator
    /// still holds of the current one's transaction.
    fn renew(&self) -> Result<(), KafkaError> {
        let fresh = initialised(&self.config, self.statistics.clone(), self.timeout)?;
        retire(self.replace_producer(fresh));
        Ok(())
    }

    /// Puts `producer` in place of the current one, and returns that.
    fn replace_producer(
        &self,
        producer: FutureProducer<ProducerStatistics>,
    ) -> FutureProducer<ProducerStatistics> {
        std::mem::replace(
            &mut *self
                .producer
                .write()
                .unwrap_or_else(PoisonError::into_inner),
            producer,
        )
    }

    /// Waits until every partition `messages` go to has a leader in the
    /// brokers' metadata, at most `patience`.
    fn wait_for_leaders(
        &self,
        messages: &[OutMessage],
        patience: Duration,
    ) -> Result<(), QueueError> {
        let deadline = Instant::now() + patience;
        let mut wanted: std::collections::BTreeMap<&str, Vec<i32>> = Default::default();
        for message in messages {
            if let Some(partition) = message.partition {
                wanted
                    .entry(message.topic.as_str())
                    .or_default()
                    .push(partition);
            }
        }
        for (topic, partitions) in wanted {
            loop {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let led = self
                    .producer()
                    .client()
                    .fetch_metadata(Some(topic), remaining.max(Duration::from_millis(100)))
                    .map(|metadata| {
                        metadata.topics().iter().any(|found| {
                            found.name() == topic
                                && found.error().is_none()
                                && partitions.iter().all(|wanted| {
                                    found.partitions().iter().any(|partition| {
                                        partition.id() == *wanted && partition.leader() >= 0
                                    })
                                })
                        })
                    });
                match led {
                    Ok(true) => break,
                    Ok(false) | Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Ok(false) => {
                        return Err(QueueError::TransactionAborted(
                            KafkaError::MessageProduction(RDKafkaErrorCode::LeaderNotAvailable),
                        ));
                    }
                    Err(error) => return Err(QueueError::TransactionAborted(error)),
                }
            }
        }
        Ok(())
    }

    /// One transaction; the caller holds the transaction lock.
    fn transact_locked(
        &self,
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

    /// Ends a transaction whose commit was never asked for: now, or (when
    /// `defer`) by whoever next takes the transaction lock.
    fn end_failed(&self, error: &QueueError, defer: bool) {
        if defer && !matches!(error, QueueError::ProducerFatal(_)) {
            self.abort_pending.store(true, Ordering::Release);
        } else {
            self.abort_after(error);
        }
    }

    /// The abort put off by [`end_failed`](Self::end_failed), if any; the
    /// caller holds the transaction lock.
    fn finish_pending_abort(&self) {
        if self.abort_pending.swap(false, Ordering::AcqRel) {
            self.abort_after(&QueueError::TransactionAborted(KafkaError::Canceled));
        }
    }

    /// Ends a transaction whose commit was never asked for. An abort that does
    /// not finish (Kafka away) leaves the producer in a state we no longer
    /// know: it is marked unusable, and its replacement's `init_transactions`
    /// ends the transaction (or the coordinator's transaction timeout does).
    fn abort_after(&self, error: &QueueError) {
        if matches!(error, QueueError::ProducerFatal(_)) {
            return;
        }
        if let Err(abort_error) = self.producer().abort_transaction(self.send_timeout) {
            if self.renewed_after_a_refused_abort() {
                return;
            }
            tracing::warn!(
                transactional_id = %self.transactional_id,
                error = %abort_error,
                "abort of a failed transaction did not finish; the producer will be recreated"
            );
            self.mark_unusable("abort did not finish", &abort_error);
        }
    }

    /// Replaces the producer in place when librdkafka made an abort's
    /// INVALID_TXN_STATE answer fatal: an abort soon after a transaction
    /// began can meet it (confluentinc/librdkafka#4849, open upstream), and
    /// the producer is then dead though nobody fenced it. The commit was
    /// never asked for, so nothing of the transaction can become visible: a
    /// fresh producer's `init_transactions` ends what the coordinator holds
    /// of it, and a release is due as after any connect. Any other fatal
    /// error (fenced by a newer instance) is left to the owner: taking the
    /// id back would fence that instance in turn.
    fn renewed_after_a_refused_abort(&self) -> bool {
        let Some((code, reason)) = self.producer().client().fatal_error() else {
            return false;
        };
        if code != RDKafkaErrorCode::InvalidTransactionalState {
            return false;
        }
        match self.renew() {
            Ok(()) => {
                if self.release.is_some() {
                    self.release_pending.store(true, Ordering::Release);
                }
                tracing::warn!(
                    transactional_id = %self.transactional_id,
                    reason,
                    "the abort was refused and made the producer fatal (librdkafka#4849); \
                     replaced it with a new one, nothing of the transaction visible"
                );
                true
            }
            Err(error) => {
                tracing::warn!(transactional_id = %self.transactional_id, error = %error, "cannot replace a producer whose abort was refused");
                false
            }
        }
    }

    fn mark_unusable(&self, why: &'static str, error: &KafkaError) {
        if !self.fatal.swap(true, Ordering::AcqRel) {
            tracing::warn!(transactional_id = %self.transactional_id, error = %error, why, "producer marked unusable");
        }
    }

    /// Sends every message and the offsets, and waits for every delivery
    /// report, all before `deadline`.
    fn send_all(
        &self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
        deadline: std::time::Instant,
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
    fn send_offsets(&self, offsets: OffsetsInTransaction) -> Result<(), QueueError> {
        let producer = self.producer();
        let timeout = self.timeout;
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
        let patience = timeout.min(self.transaction_timeout) + SEND_OFFSETS_GRACE;
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
                    transactional_id = %self.transactional_id,
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
        &self,
        message: &OutMessage,
        deadline: std::time::Instant,
    ) -> Result<DeliveryFuture, QueueError> {
        loop {
            match self.producer().send_result(future_record(message)) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                    if std::time::Instant::now() < deadline =>
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
    fn flush_deliveries(&self, deadline: std::time::Instant) -> Result<(), QueueError> {
        let remaining = deadline.saturating_duration_since(std::time::Instant::now());
        let timeout_ms = i32::try_from(remaining.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let producer = self.producer();
        // SAFETY: the pointer is the live client owned by `producer`, which
        // outlives the call; rd_kafka_flush is thread-safe.
        let code = unsafe {
            rdkafka::bindings::rd_kafka_flush(producer.client().native_ptr(), timeout_ms)
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
    /// [`QueueError::CommitOutcomeUnknown`], never "aborted".
    fn commit_with_retries(&self, budget: Budget) -> Result<(), QueueError> {
        let deadline = budget.commit.map(|budget| Instant::now() + budget);
        let mut attempt = 1;
        loop {
            // With a budget, each attempt gets what is left of it (librdkafka
            // resumes the same commit on a retry), at least 100 ms.
            let timeout = deadline.map_or(self.timeout, |deadline| {
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100))
            });
            match self.producer().commit_transaction(timeout) {
                Ok(()) => return Ok(()),
                Err(KafkaError::Transaction(error))
                    if error.is_retriable()
                        && attempt < budget.commit_attempts
                        && deadline.is_none_or(|deadline| Instant::now() < deadline) =>
                {
                    tracing::warn!(attempt, error = %error, "transaction commit is retriable; retrying");
                    attempt += 1;
                }
                Err(KafkaError::Transaction(error))
                    if error.txn_requires_abort() && !error.is_fatal() =>
                {
                    let error = QueueError::TransactionAborted(KafkaError::Transaction(error));
                    self.abort_after(&error);
                    return Err(error);
                }
                Err(error) => {
                    // A fatal error is reported by its cause (a fencing, say).
                    let error = match self.classify(error.clone()) {
                        QueueError::ProducerFatal(cause) => cause,
                        _ => error,
                    };
                    self.mark_unusable("commit outcome unknown", &error);
                    tracing::error!(
                        transactional_id = %self.transactional_id,
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

    /// Maps a librdkafka error to ours, remembering fatal ones. librdkafka
    /// hands a fatal error to each call as its generic `_FATAL` code; the
    /// error that made the producer fatal (`_FENCED` for a fencing, or an
    /// authorization refused...) is kept by the client, and is what the
    /// caller gets, so that a fencing can be told from the rest
    /// ([`QueueError::is_fencing`]).
    fn classify(&self, error: KafkaError) -> QueueError {
        let fatal = match &error {
            KafkaError::Transaction(transaction_error) => transaction_error.is_fatal(),
            other => other.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal),
        };
        if !fatal {
            return QueueError::TransactionAborted(error);
        }
        self.fatal.store(true, Ordering::Release);
        let cause = self.producer().client().fatal_error();
        let fenced = crate::is_fencing_error(&error)
            || cause.as_ref().is_some_and(|(code, _)| {
                crate::is_fencing_error(&KafkaError::MessageProduction(*code))
            });
        tracing::error!(
            transactional_id = %self.transactional_id,
            error = %error,
            cause = ?cause,
            fenced,
            "producer hit a fatal error"
        );
        match cause {
            Some((code, _)) if error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) => {
                QueueError::ProducerFatal(KafkaError::MessageProduction(code))
            }
            _ => QueueError::ProducerFatal(error),
        }
    }

    /// What a call on a producer already fatal answers: the error librdkafka
    /// keeps as the cause (see [`classify`](Self::classify)), or the generic
    /// `_FATAL` when quire marked it unusable itself (an abort that did not
    /// finish), which no fencing caused.
    fn fatal_error(&self) -> QueueError {
        let code = self
            .producer()
            .client()
            .fatal_error()
            .map_or(RDKafkaErrorCode::Fatal, |(code, _)| code);
        QueueError::ProducerFatal(KafkaError::MessageProduction(code))
    }
}

/// How long one transaction may take: sending and flushing its messages,
/// then its commit (all attempts together when bounded).
#[derive(Clone, Copy)]
struct Budget {
    send: Duration,
    commit: Option<Duration>,
    commit_attempts: usize,
}

impl Budget {
    /// A release's: `patience` to send, `patience` for the commit, retried
    /// as often as fits in it.
    fn patient(patience: Duration) -> Self {
        Budget {
            send: patience,
            commit: Some(patience),
            commit_attempts: usize::MAX,
        }
    }
}

/// A producer made from `config`, its transactions initialised (which
/// fences any other producer with the same transactional id and ends its
/// open transaction).
fn initialised(
    config: &ClientConfig,
    statistics: ProducerStatistics,
    timeout: Duration,
) -> Result<FutureProducer<ProducerStatistics>, KafkaError> {
    let producer: FutureProducer<ProducerStatistics> = config.create_with_context(statistics)?;
    producer.init_transactions(timeout)?;
    Ok(producer)
}

/// Lets a replaced producer go on a thread of its own: destroying a
/// librdkafka client waits for its threads, which must not hold up the
/// transaction lock.
fn retire(producer: FutureProducer<ProducerStatistics>) {
    let spawned = std::thread::Builder::new()
        .name("producer-retire".into())
        .spawn(move || drop(producer));
    if let Err(error) = spawned {
        tracing::warn!(error = %error, "cannot start a thread to close a replaced producer");
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

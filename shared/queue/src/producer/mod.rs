//! A transactional producer: one array, one transaction.
//!
//! - this module: [`TransactionalProducer`]'s public face, and the
//!   transaction lock ([`Locked`]) that holds the producer's one [`State`]
//!   with the librdkafka producer it describes;
//! - [`state`]: the state machine and the other decisions, sans I/O;
//! - [`transaction`]: one transaction, from `begin` to commit or abort;
//! - [`twin`]: the release of the producer's partitions (in place, or by a
//!   twin that takes its transactional id over);
//! - [`retiring`]: producers destroyed off the caller's thread.

mod retiring;
mod state;
mod transaction;
mod twin;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use quire_config::KafkaSettings;
use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientConfig, ClientContext, TopicPartitionList};

use crate::client::producer_config;
use crate::{MessageId, OutMessage, QueueError};

use retiring::Retiring;
use state::{Event, NotNow, Owed, State};
pub(crate) use transaction::future_record;
pub use twin::Release;

/// How often a commit that librdkafka calls retriable is tried again.
const COMMIT_ATTEMPTS: usize = 3;

/// Keeps the latest librdkafka statistics (when `statistics.interval.ms` is
/// set) and forwards librdkafka's logs to tracing.
#[derive(Default, Clone)]
pub struct ProducerStatistics {
    latest: Arc<Mutex<Option<Statistics>>>,
    /// Raised when librdkafka reports the brokers gone (all down, or a
    /// broker connection lost): once they answer again, the producer's
    /// partitions should be released (see [`Release`]). An event for the
    /// producer's state ([`Event::BrokersGone`]), raised on librdkafka's
    /// thread, which must never wait for the transaction lock.
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

/// How a [`TransactionalProducer`] is built.
#[derive(Clone, Default)]
pub struct ProducerOptions {
    /// Bound on sending one transaction's messages (and on aborting it);
    /// `None`: `kafka.request_timeout_ms`. When Kafka is away, a transaction
    /// fails (aborted, nothing visible) after it.
    pub send_timeout: Option<Duration>,
    /// Bound on a transaction's commit, all retries together; `None`:
    /// `COMMIT_ATTEMPTS` attempts of `kafka.request_timeout_ms` each. Past
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

/// The librdkafka producer quire drives.
type Client = FutureProducer<ProducerStatistics>;

struct Inner {
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
    /// What this producer commits to release its partitions, if anything.
    release: Option<Release>,
    /// A periodic release was asked for ([`Event::ReleaseAsked`]), from
    /// outside the transaction lock.
    release_asked: AtomicBool,
    /// The transaction lock: one open transaction at a time. Only its
    /// holder reads or changes the state, and uses or replaces the producer.
    session: Mutex<Session>,
    /// The holder's last word, for the calls that must not wait for a
    /// transaction to end: written by [`Locked`] alone, whenever the state
    /// or the producer changes.
    published: RwLock<Session>,
}

/// The producer's state, and the librdkafka producer it describes.
#[derive(Clone)]
struct Session {
    state: State,
    producer: Retiring<Client>,
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
        let timeout = settings.request_timeout;
        let producer = {
            let (config, statistics) = (config.clone(), statistics.clone());
            tokio::task::spawn_blocking(move || initialised(&config, statistics, timeout))
                .await?
                .map_err(QueueError::client)?
        };
        tracing::debug!(transactional_id, "transactional producer ready");
        let session = Session {
            state: State::connected(options.release.is_some()),
            producer,
        };
        let inner = Arc::new(Inner {
            config,
            transaction_timeout: settings.transaction_timeout,
            release_transaction_timeout: twin::release_transaction_timeout(settings),
            statistics,
            transactional_id: transactional_id.to_owned(),
            timeout,
            send_timeout: options.send_timeout.unwrap_or(timeout),
            commit_timeout: options.commit_timeout,
            release: options.release,
            release_asked: AtomicBool::new(false),
            published: RwLock::new(session.clone()),
            session: Mutex::new(session),
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
        tokio::task::spawn_blocking(move || inner.lock().release_if_due()).await?
    }

    /// Readies the producer for its next transaction: finishes an abort
    /// put off by [`transact_then`](Self::transact_then) and commits a
    /// release that is due (what [`release_if_due`](Self::release_if_due)
    /// does, without a blocking task when neither is pending). Each can take
    /// seconds while Kafka is away, so a caller that answers others (the
    /// group commit) does this before it takes their arrays. On failure the
    /// release stays due.
    pub async fn ready(&self) -> Result<(), QueueError> {
        if !self.inner.abort_put_off() && !self.release_is_due() {
            return Ok(());
        }
        self.release_if_due().await
    }

    /// Makes a periodic release due (for a disconnection librdkafka did not
    /// report); it is committed in place, not by a twin (see [`Release`]).
    pub fn request_release(&self) {
        if self.inner.release.is_some() {
            self.inner.release_asked.store(true, Ordering::Release);
        }
    }

    /// False once the producer is fenced, or its transaction state is no
    /// longer known: every further call fails with
    /// [`QueueError::ProducerFatal`]; create a new producer with the same id.
    pub fn is_usable(&self) -> bool {
        self.inner.published_state().is_usable()
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
        let inner = Arc::clone(&self.inner);
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            // Taken and let go on this blocking thread: never the last
            // handle on an async one.
            let producer = inner.published_producer();
            let metadata = producer
                .client()
                .fetch_metadata(Some(&topic), inner.timeout)
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
        tokio::task::spawn_blocking(move || {
            inner
                .lock()
                .transact_for_callers(&messages, None, followers, true)
        })
        .await?
    }

    /// Aborts the transaction [`transact_then`](Self::transact_then) left
    /// failed, if any (bounded by the send timeout; an abort that does not
    /// finish marks the producer unusable, as ever).
    pub async fn finish_pending_abort(&self) {
        if !self.inner.abort_put_off() {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let _joined =
            tokio::task::spawn_blocking(move || inner.lock().finish_pending_abort()).await;
    }

    /// The blocking form, for callers already on a blocking thread.
    pub(crate) fn transact_blocking(
        &self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
    ) -> Result<Vec<MessageId>, QueueError> {
        self.inner
            .lock()
            .transact_for_callers(messages, offsets, None, false)
    }
}

impl Inner {
    /// Takes the transaction lock (blocking: only on a blocking thread).
    fn lock(&self) -> Locked<'_> {
        Locked {
            inner: self,
            session: self.session.lock().expect("transaction lock"),
        }
    }

    fn published_state(&self) -> State {
        self.published
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .state
    }

    /// A handle on the current producer, for a call that must not wait for
    /// the transaction lock. Let it go on a blocking thread.
    fn published_producer(&self) -> Client {
        Client::clone(
            &self
                .published
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .producer,
        )
    }

    fn abort_put_off(&self) -> bool {
        matches!(self.published_state(), State::AbortPutOff { .. })
    }

    /// Whether a release is owed, or asked for by an event the lock's
    /// holder has not applied yet.
    fn release_is_due(&self) -> bool {
        self.release.is_some()
            && (self.published_state().owed() != Owed::Nothing
                || self.statistics.disconnected.load(Ordering::Acquire)
                || self.release_asked.load(Ordering::Acquire))
    }
}

/// The transaction lock, held: the producer's state and the librdkafka
/// producer are this holder's alone until it is dropped.
struct Locked<'a> {
    inner: &'a Inner,
    session: MutexGuard<'a, Session>,
}

impl Locked<'_> {
    fn state(&self) -> State {
        self.session.state
    }

    /// The librdkafka producer the calls go to.
    fn producer(&self) -> &Client {
        &self.session.producer
    }

    /// Moves the state on by `event` (see [`State::next`]) and publishes it.
    fn apply(&mut self, event: Event) {
        let from = self.session.state;
        let next = from.next(event, self.inner.release.is_some());
        if next == from {
            return;
        }
        tracing::trace!(transactional_id = %self.inner.transactional_id, ?event, ?from, to = ?next, "producer state");
        self.session.state = next;
        self.published().state = next;
    }

    /// Applies the events raised outside the lock since it was last taken.
    fn apply_events_from_outside(&mut self) {
        if self
            .inner
            .statistics
            .disconnected
            .swap(false, Ordering::AcqRel)
        {
            self.apply(Event::BrokersGone);
        }
        if self.inner.release_asked.swap(false, Ordering::AcqRel) {
            self.apply(Event::ReleaseAsked);
        }
    }

    /// Puts `fresh` in place of the current producer. The current one, and
    /// the handle published for it, are destroyed on threads of their own
    /// (see [`retiring`]), never here under the lock.
    fn replace_producer(&mut self, fresh: Retiring<Client>) {
        retiring::replace(&mut self.session.producer, fresh);
        let published = self.session.producer.clone();
        retiring::replace(&mut self.published().producer, published);
    }

    fn published(&self) -> std::sync::RwLockWriteGuard<'_, Session> {
        self.inner
            .published
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One transaction of the producer's callers: a put-off abort and a
    /// release due go first. `defer_abort`: see [`TransactionalProducer::transact_then`].
    fn transact_for_callers(
        &mut self,
        messages: &[OutMessage],
        offsets: Option<OffsetsInTransaction>,
        followers: Option<Followers>,
        defer_abort: bool,
    ) -> Result<Vec<MessageId>, QueueError> {
        self.finish_pending_abort();
        if self.state().may_begin() == Err(NotNow::Unusable) {
            return Err(self.fatal_error());
        }
        // Whatever else stands in the way goes first.
        self.release_if_due()?;
        let budget = transaction::Budget {
            send: self.inner.send_timeout,
            commit: self.inner.commit_timeout,
            commit_attempts: COMMIT_ATTEMPTS,
        };
        self.transact_locked(messages, offsets, followers, budget, defer_abort)
    }
}

/// A producer made from `config`, its transactions initialised (which
/// fences any other producer with the same transactional id and ends its
/// open transaction). One whose init failed is retired like any other.
fn initialised(
    config: &ClientConfig,
    statistics: ProducerStatistics,
    timeout: Duration,
) -> Result<Retiring<Client>, KafkaError> {
    let producer: Retiring<Client> = Retiring::new(config.create_with_context(statistics)?);
    producer.init_transactions(timeout)?;
    Ok(producer)
}

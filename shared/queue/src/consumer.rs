//! Array dequeue and one commit per array.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::client::consumer_config;
use crate::context::{PartitionProgress, QueueContext, RebalanceEvent};
use crate::producer::OffsetsInTransaction;
use crate::{InMessage, MessageId, OutMessage, QueueError, TransactionalProducer};

/// Who this consumer is in its group.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    pub group_id: String,
    /// One topic per consumer: partitions are then named by number alone,
    /// which is what librdkafka's partition-EOF events carry.
    pub topic: String,
    /// Static membership: a restart within the session timeout keeps the
    /// partitions instead of rebalancing the whole group.
    pub group_instance_id: Option<String>,
    /// Cooperative-sticky assignment: a rebalance moves only what must move.
    pub cooperative: bool,
    /// How often librdkafka reports each partition's offsets (for
    /// [`ArrayConsumer::progress`]); `None` leaves statistics off unless the
    /// user's Kafka properties turn them on.
    pub statistics_interval: Option<Duration>,
    /// `session.timeout.ms`: how long a silent member (a static one included)
    /// keeps its partitions; `None` leaves librdkafka's default (45 s).
    pub session_timeout: Option<Duration>,
    /// Written with every offset this consumer commits (Kafka keeps a
    /// metadata string beside each committed offset) and read back when a
    /// partition is assigned ([`ArrayConsumer::committed_metadata`]): what
    /// the committer wants its successor to check (the worker: the
    /// watermark topic its offsets were committed with).
    pub commit_metadata: Option<String>,
    /// `max.poll.interval.ms`: how long a member may go without polling
    /// before librdkafka leaves the group for it; `None` leaves the user's
    /// property or librdkafka's default (300 s). A
    /// [`KeepAlive`](crate::KeepAlive) polls within it while the caller
    /// works on an array.
    pub max_poll_interval: Option<Duration>,
}

impl ConsumerOptions {
    pub fn new(group_id: impl Into<String>, topic: impl Into<String>) -> Self {
        ConsumerOptions {
            group_id: group_id.into(),
            topic: topic.into(),
            group_instance_id: None,
            cooperative: false,
            statistics_interval: None,
            session_timeout: None,
            commit_metadata: None,
            max_poll_interval: None,
        }
    }
}

/// Why `next_array` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrayEnd {
    /// It holds `max` messages.
    Full,
    /// `max_wait` passed first (the array may be empty).
    Timeout,
}

/// One dequeued array and the assignment it was read under.
#[derive(Debug, Clone)]
pub struct Array {
    pub messages: Vec<InMessage>,
    /// Assignments and revocations that happened while this array was read,
    /// in order. Messages of a partition revoked during the read are not in
    /// `messages`: they belong to the next owner.
    pub rebalances: Vec<RebalanceEvent>,
    pub end: ArrayEnd,
    /// Whether every assigned partition had been read to its end (last stable
    /// offset) when the array was returned, with an assignment held.
    pub caught_up: bool,
    pub waited: Duration,
    /// Assigned partitions and their epochs when the array was returned.
    assignment: BTreeMap<i32, u64>,
}

impl Array {
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The partitions this array was read under.
    pub fn assigned_partitions(&self) -> impl Iterator<Item = i32> + '_ {
        self.assignment.keys().copied()
    }

    /// For every partition the array touched, the offset after its last message.
    pub fn next_offsets(&self) -> BTreeMap<i32, i64> {
        let mut offsets = BTreeMap::new();
        for message in &self.messages {
            let next = offsets
                .entry(message.partition)
                .or_insert(message.offset + 1);
            *next = (*next).max(message.offset + 1);
        }
        offsets
    }
}

/// What a commit did: the offsets committed, and the partitions dropped from
/// it because they were revoked since the array was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitOutcome {
    pub committed: BTreeMap<i32, i64>,
    pub dropped: Vec<i32>,
}

/// A transactional commit: the offsets and the ids of the messages produced
/// in the same transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransactionOutcome {
    pub commit: CommitOutcome,
    pub ids: Vec<MessageId>,
}

/// Why a drain loop stopped: the seed's two exit scenarios, once caught up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainExit {
    /// An array shorter than `max` (scenario one).
    ShortArray,
    /// A wait that returned nothing (scenario two).
    EmptyWait,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainSummary {
    pub arrays: usize,
    pub messages: usize,
    pub exit: DrainExit,
}

/// A group consumer that dequeues arrays: read_committed, no auto commit.
pub struct ArrayConsumer {
    pub(crate) consumer: Arc<BaseConsumer<QueueContext>>,
    /// Held while polling and while checking-and-committing, so a rebalance
    /// callback cannot run between the check of a partition and its commit.
    pub(crate) poll_lock: Arc<Mutex<()>>,
    pub(crate) topic: String,
    timeout: Duration,
    commit_metadata: Option<Arc<str>>,
    /// How long an array's work may go on before a
    /// [`KeepAlive`](crate::KeepAlive) polls, and then how often it polls: a
    /// fifth of `max.poll.interval.ms`.
    pub(crate) keep_alive_every: Duration,
}

/// librdkafka's default `max.poll.interval.ms`.
const DEFAULT_MAX_POLL_INTERVAL: Duration = Duration::from_secs(300);

impl ArrayConsumer {
    /// Creates the consumer and subscribes; the group assigns partitions
    /// during the first `next_array`.
    pub fn new(settings: &KafkaSettings, options: &ConsumerOptions) -> Result<Self, QueueError> {
        let config = consumer_config(
            settings,
            &options.group_id,
            options.group_instance_id.as_deref(),
            options.cooperative,
            options.statistics_interval,
            options.session_timeout,
            options.max_poll_interval,
        )?;
        // The interval in force, whoever set it: the keep-alive is derived
        // from it.
        let max_poll_interval = config
            .get("max.poll.interval.ms")
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map_or(DEFAULT_MAX_POLL_INTERVAL, Duration::from_millis);
        let timeout = settings.request_timeout;
        let context = QueueContext::new(&options.topic, timeout);
        let consumer: BaseConsumer<QueueContext> = config
            .create_with_context(context)
            .map_err(QueueError::client)?;
        consumer
            .subscribe(&[&options.topic])
            .map_err(QueueError::client)?;
        Ok(ArrayConsumer {
            consumer: Arc::new(consumer),
            poll_lock: Arc::new(Mutex::new(())),
            topic: options.topic.clone(),
            timeout,
            commit_metadata: options.commit_metadata.as_deref().map(Arc::from),
            keep_alive_every: (max_poll_interval / 5).max(Duration::from_millis(100)),
        })
    }

    /// The metadata committed with `partition`'s offset, as read when it was
    /// assigned (none: never committed, or committed without any).
    pub fn committed_metadata(&self, partition: i32) -> Option<String> {
        self.consumer
            .context()
            .lock()
            .committed_metadata
            .get(&partition)
            .cloned()
    }

    /// Starts fetching paused `partitions` again from their commit points
    /// (what the group holds for them: the caller served nothing of them,
    /// and messages of theirs an earlier read returned were skipped).
    pub fn resume_from_commit_points(&self, partitions: &[i32]) -> Result<(), QueueError> {
        let _no_rebalance = self.poll_lock.lock().expect("poll lock");
        let points = {
            let state = self.consumer.context().lock();
            partitions
                .iter()
                .map(|partition| (*partition, state.commit_points.get(partition).copied()))
                .collect::<Vec<_>>()
        };
        let mut seek = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        for (partition, point) in points {
            resume.add_partition(&self.topic, partition);
            let offset = point.map_or(Offset::Beginning, Offset::Offset);
            seek.add_partition_offset(&self.topic, partition, offset)
                .map_err(QueueError::Consume)?;
        }
        self.consumer
            .seek_partitions(seek, self.timeout)
            .map_err(QueueError::Consume)?;
        self.consumer.resume(&resume).map_err(QueueError::Consume)?;
        let mut state = self.consumer.context().lock();
        for partition in partitions {
            state.unserved.remove(partition);
            state.at_end.remove(partition);
        }
        Ok(())
    }

    /// Stops fetching `partitions` (assigned ones) until they are revoked,
    /// resumed ([`resume_from_commit_points`](Self::resume_from_commit_points))
    /// or the consumer is closed: partitions the caller holds but cannot
    /// serve. They do not hold back [`Array::caught_up`], and a keep-alive
    /// leaves them paused.
    pub fn hold(&self, partitions: &[i32]) -> Result<(), QueueError> {
        let mut list = TopicPartitionList::new();
        for &partition in partitions {
            list.add_partition(&self.topic, partition);
        }
        let _no_rebalance = self.poll_lock.lock().expect("poll lock");
        self.consumer.pause(&list).map_err(QueueError::Consume)?;
        self.consumer
            .context()
            .lock()
            .unserved
            .extend(partitions.iter().copied());
        Ok(())
    }

    /// The partitions assigned now.
    pub fn assignment(&self) -> Vec<i32> {
        self.consumer
            .context()
            .lock()
            .assigned
            .keys()
            .copied()
            .collect()
    }

    /// Where each assigned partition stands (high watermark, last stable
    /// offset, position) as of librdkafka's latest statistics. Empty until
    /// statistics are on (`ConsumerOptions::statistics_interval`) and the
    /// first ones arrived. Reads a snapshot: no call to the broker.
    pub fn progress(&self) -> Vec<PartitionProgress> {
        let state = self.consumer.context().lock();
        state
            .progress
            .values()
            .filter(|progress| state.assigned.contains_key(&progress.partition))
            .copied()
            .collect()
    }

    /// Whether the latest statistics showed a broker connection up; `None`
    /// before the first statistics.
    pub fn brokers_up(&self) -> Option<bool> {
        self.consumer.context().lock().brokers_up
    }

    /// Returns as soon as `max` messages are held, or when `max_wait` has
    /// passed (possibly with none), across all assigned partitions.
    pub async fn next_array(&self, max: usize, max_wait: Duration) -> Result<Array, QueueError> {
        self.next_array_within(ArrayBounds::messages(max, max_wait))
            .await
    }

    /// Returns as soon as the messages held reach `bounds` (in records, as
    /// `bounds.weigh` counts them, or in payload bytes), or when its wait
    /// has passed (possibly with none), across all assigned partitions. The
    /// message that reaches a bound is kept: an array passes it by at most
    /// one message.
    pub async fn next_array_within(&self, bounds: ArrayBounds) -> Result<Array, QueueError> {
        let consumer = Arc::clone(&self.consumer);
        let poll_lock = Arc::clone(&self.poll_lock);
        let topic: Arc<str> = Arc::from(self.topic.as_str());
        tokio::task::spawn_blocking(move || {
            let _polling = poll_lock.lock().expect("poll lock");
            read_array(&consumer, &topic, bounds)
        })
        .await?
    }

    /// The simple commit: for every partition the array touched, the offset
    /// after its last message.
    pub async fn commit(&self, array: &Array) -> Result<CommitOutcome, QueueError> {
        self.commit_offsets(array, array.next_offsets()).await
    }

    /// The general commit: explicit next offsets per partition. Partitions
    /// revoked since `array` was read are dropped and reported.
    pub async fn commit_offsets(
        &self,
        array: &Array,
        offsets: BTreeMap<i32, i64>,
    ) -> Result<CommitOutcome, QueueError> {
        let consumer = Arc::clone(&self.consumer);
        let poll_lock = Arc::clone(&self.poll_lock);
        let topic = self.topic.clone();
        let metadata = self.commit_metadata.clone();
        let assignment = array.assignment.clone();
        tokio::task::spawn_blocking(move || {
            let _no_rebalance = poll_lock.lock().expect("poll lock");
            let outcome = still_owned(&consumer, &assignment, offsets);
            if outcome.committed.is_empty() {
                return Ok(outcome);
            }
            let list = offset_list(&topic, &outcome.committed, metadata.as_deref())?;
            consumer
                .commit(&list, CommitMode::Sync)
                .map_err(commit_error)?;
            Ok(outcome)
        })
        .await?
    }

    /// The transactional commit: `messages` and the offsets go out in one
    /// producer transaction, with this consumer's group metadata. The offsets
    /// are those of *every* partition still owned since `array` was read:
    /// `offsets` where given (the simple form by default), the partition's
    /// commit point otherwise (its start, or what this consumer last
    /// committed). So every transaction, even one where no offset moved, is
    /// checked by the group coordinator: a fenced, stale or frozen-and-thawed
    /// member's transaction is refused ([`QueueError::GroupRefused`]) and
    /// nothing of it becomes visible. All of it is visible, or none.
    pub async fn commit_in_transaction(
        &self,
        array: &Array,
        offsets: Option<BTreeMap<i32, i64>>,
        producer: &TransactionalProducer,
        messages: Vec<OutMessage>,
    ) -> Result<TransactionOutcome, QueueError> {
        self.commit_shared_in_transaction(array, offsets, producer, Arc::new(messages))
            .await
    }

    /// [`commit_in_transaction`](Self::commit_in_transaction) with messages
    /// the caller keeps: once it returns, the caller's `Arc` is the only one
    /// left, so a caller that tries again later (a refused transaction)
    /// takes them back without a copy.
    pub async fn commit_shared_in_transaction(
        &self,
        array: &Array,
        offsets: Option<BTreeMap<i32, i64>>,
        producer: &TransactionalProducer,
        messages: Arc<Vec<OutMessage>>,
    ) -> Result<TransactionOutcome, QueueError> {
        let consumer = Arc::clone(&self.consumer);
        let poll_lock = Arc::clone(&self.poll_lock);
        let topic = self.topic.clone();
        let metadata = self.commit_metadata.clone();
        let assignment = array.assignment.clone();
        let offsets = offsets.unwrap_or_else(|| array.next_offsets());
        let producer = producer.clone();
        tokio::task::spawn_blocking(move || {
            let _no_rebalance = poll_lock.lock().expect("poll lock");
            let commit = every_owned_partition(&consumer, &assignment, offsets);
            let group_metadata = consumer.group_metadata().ok_or_else(|| {
                QueueError::Commit(KafkaError::ConsumerCommit(RDKafkaErrorCode::InvalidGroupId))
            })?;
            let list = offset_list(&topic, &commit.committed, metadata.as_deref())?;
            let in_transaction = (!commit.committed.is_empty()).then_some(OffsetsInTransaction {
                offsets: list,
                group_metadata,
            });
            let ids = producer.transact_blocking(&messages, in_transaction);
            drop(messages);
            let ids = ids?;
            let mut state = consumer.context().lock();
            for (&partition, &offset) in &commit.committed {
                if state.assigned.contains_key(&partition) {
                    state.commit_points.insert(partition, offset);
                }
            }
            Ok(TransactionOutcome { commit, ids })
        })
        .await?
    }

    /// The committed offsets of the assigned partitions, read from the group
    /// coordinator.
    pub async fn committed_offsets(&self) -> Result<BTreeMap<i32, i64>, QueueError> {
        let consumer = Arc::clone(&self.consumer);
        let timeout = self.timeout;
        tokio::task::spawn_blocking(move || {
            let committed = consumer.committed(timeout).map_err(QueueError::Consume)?;
            Ok(committed
                .elements()
                .iter()
                .filter_map(|element| match element.offset() {
                    Offset::Offset(offset) => Some((element.partition(), offset)),
                    _ => None,
                })
                .collect())
        })
        .await?
    }

    /// Commits `pending` arrays in order (simple form), stopping at the
    /// first the group refuses ([`QueueError::CommitRefused`]): that one and
    /// those after it stay in `pending`, to be committed after the next
    /// read, so no commit ever lands before an earlier array's. Returns the
    /// arrays committed and what each commit did. Any other error is
    /// returned, the failed array still first in `pending`.
    pub async fn commit_in_order(
        &self,
        pending: &mut Vec<Array>,
    ) -> Result<Vec<(Array, CommitOutcome)>, QueueError> {
        let mut committed = Vec::with_capacity(pending.len());
        while let Some(array) = pending.first() {
            match self.commit(array).await {
                Ok(outcome) => committed.push((pending.remove(0), outcome)),
                Err(QueueError::CommitRefused(error)) => {
                    tracing::info!(error = %error, arrays = pending.len(), "commit refused by the group (rebalancing); committing again after the next read");
                    break;
                }
                Err(error) => return Err(error),
            }
        }
        Ok(committed)
    }

    /// The seed's dequeue loop: arrays of at most `max`, each handed to
    /// `process` and then committed (simple form), until the consumer is
    /// caught up and an array comes back short (scenario one) or empty
    /// (scenario two). The loop ends after that last array is committed.
    pub async fn drain<F>(
        &self,
        max: usize,
        max_wait: Duration,
        mut process: F,
    ) -> Result<DrainSummary, QueueError>
    where
        F: FnMut(&Array),
    {
        let mut arrays = 0;
        let mut messages = 0;
        let mut pending = Vec::new();
        loop {
            let array = self.next_array(max, max_wait).await?;
            process(&array);
            let (len, caught_up) = (array.len(), array.caught_up);
            if len > 0 {
                arrays += 1;
                messages += len;
                pending.push(array);
            }
            self.commit_in_order(&mut pending).await?;
            if !pending.is_empty() || !caught_up || len >= max {
                continue;
            }
            let exit = if len == 0 {
                DrainExit::EmptyWait
            } else {
                DrainExit::ShortArray
            };
            return Ok(DrainSummary {
                arrays,
                messages,
                exit,
            });
        }
    }
}

/// What ends an array (see [`ArrayConsumer::next_array_within`]).
#[derive(Debug, Clone, Copy)]
pub struct ArrayBounds {
    /// Records held, each message weighing what `weigh` says.
    pub records: usize,
    /// Bytes of payload held.
    pub bytes: usize,
    pub wait: Duration,
    /// How many records a message carries (a batch message, many).
    pub weigh: fn(&InMessage) -> usize,
}

impl ArrayBounds {
    /// At most `max` messages, each one record, bytes unbounded.
    pub fn messages(max: usize, wait: Duration) -> Self {
        ArrayBounds {
            records: max,
            bytes: usize::MAX,
            wait,
            weigh: |_| 1,
        }
    }
}

/// The records and payload bytes `messages` hold.
fn held(messages: &[InMessage], weigh: fn(&InMessage) -> usize) -> (usize, usize) {
    messages.iter().fold((0, 0), |(records, bytes), message| {
        (
            records + weigh(message),
            bytes + message.payload.as_ref().map_or(0, Vec::len),
        )
    })
}

/// The polling loop behind `next_array`; runs on a blocking thread.
fn read_array(
    consumer: &BaseConsumer<QueueContext>,
    topic: &Arc<str>,
    bounds: ArrayBounds,
) -> Result<Array, QueueError> {
    let started = Instant::now();
    let deadline = started + bounds.wait;
    let mut messages: Vec<InMessage> = Vec::with_capacity(bounds.records.min(65_536));
    let mut rebalances = Vec::new();
    // What a keep-alive left: its deferred callbacks, then what it held.
    consumer.context().apply_deferred(consumer);
    {
        let mut state = consumer.context().lock();
        if let Some(error) = state.held_error.take() {
            return Err(QueueError::Consume(error));
        }
        messages.append(&mut state.held);
    }
    take_rebalance_events(consumer, &mut messages, &mut rebalances)?;
    let (mut records, mut bytes) = held(&messages, bounds.weigh);
    let end = loop {
        if records >= bounds.records || bytes >= bounds.bytes {
            break ArrayEnd::Full;
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break ArrayEnd::Timeout;
        }
        let polled = consumer.poll(remaining);
        let before = messages.len();
        take_rebalance_events(consumer, &mut messages, &mut rebalances)?;
        if messages.len() != before {
            // A revocation dropped messages: count again (rare).
            (records, bytes) = held(&messages, bounds.weigh);
        }
        match polled {
            None => {}
            Some(Ok(message)) => {
                consumer
                    .context()
                    .lock()
                    .at_end
                    .remove(&message.partition());
                let message = owned(topic, &message);
                records += (bounds.weigh)(&message);
                bytes += message.payload.as_ref().map_or(0, Vec::len);
                messages.push(message);
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                consumer.context().lock().at_end.insert(partition);
            }
            Some(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::AutoOffsetReset))) => {
                return Err(QueueError::OffsetOutOfRange {
                    topic: topic.to_string(),
                    partition: out_of_range_partition(consumer),
                });
            }
            Some(Err(error)) if crate::is_transient(&error) => {
                tracing::warn!(error = %error, "transient consumer error");
            }
            Some(Err(error)) => return Err(QueueError::Consume(error)),
        }
    };
    let state = consumer.context().lock();
    Ok(Array {
        messages,
        rebalances,
        end,
        caught_up: state.caught_up(),
        waited: started.elapsed(),
        assignment: state.assigned.clone(),
    })
}

/// Moves the rebalance events seen during a poll into the array, dropping the
/// messages of partitions revoked meanwhile.
fn take_rebalance_events(
    consumer: &BaseConsumer<QueueContext>,
    messages: &mut Vec<InMessage>,
    rebalances: &mut Vec<RebalanceEvent>,
) -> Result<(), QueueError> {
    let mut state = consumer.context().lock();
    if let Some(error) = state.callback_error.take() {
        return Err(QueueError::Consume(error));
    }
    for event in state.pending_events.drain(..) {
        if let RebalanceEvent::Revoked { partitions, .. } = &event {
            messages.retain(|message| !partitions.contains(&message.partition));
        }
        rebalances.push(event);
    }
    Ok(())
}

/// A refusal by the group (its generation moved on while the array was
/// held) is [`QueueError::CommitRefused`]: the consumer rejoins on its next
/// poll and keeps the partitions that stay its own (cooperative), so the
/// caller can commit the same array again after reading the next one, as
/// with the Java client's `RebalanceInProgressException`.
fn commit_error(error: KafkaError) -> QueueError {
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::IllegalGeneration
            | RDKafkaErrorCode::RebalanceInProgress
            | RDKafkaErrorCode::UnknownMemberId
            | RDKafkaErrorCode::FencedInstanceId,
        ) => QueueError::CommitRefused(error),
        _ => QueueError::Commit(error),
    }
}

/// Keeps the partitions still assigned under the same epoch as when the array
/// was read; reports the others.
fn still_owned(
    consumer: &BaseConsumer<QueueContext>,
    read_under: &BTreeMap<i32, u64>,
    offsets: BTreeMap<i32, i64>,
) -> CommitOutcome {
    let state = consumer.context().lock();
    let mut outcome = CommitOutcome::default();
    for (partition, offset) in offsets {
        let owned_then = read_under.get(&partition);
        if owned_then.is_some() && owned_then == state.assigned.get(&partition) {
            outcome.committed.insert(partition, offset);
        } else {
            outcome.dropped.push(partition);
        }
    }
    if !outcome.dropped.is_empty() {
        tracing::info!(partitions = ?outcome.dropped, "dropped revoked partitions from a commit");
    }
    outcome
}

/// [`still_owned`], completed with the commit point of every partition
/// owned since the array was read that `offsets` leaves out.
fn every_owned_partition(
    consumer: &BaseConsumer<QueueContext>,
    read_under: &BTreeMap<i32, u64>,
    offsets: BTreeMap<i32, i64>,
) -> CommitOutcome {
    let mut outcome = still_owned(consumer, read_under, offsets);
    let state = consumer.context().lock();
    for (partition, epoch) in read_under {
        if state.assigned.get(partition) != Some(epoch) {
            continue;
        }
        if let Some(&point) = state.commit_points.get(partition) {
            outcome.committed.entry(*partition).or_insert(point);
        }
    }
    outcome
}

fn offset_list(
    topic: &str,
    offsets: &BTreeMap<i32, i64>,
    metadata: Option<&str>,
) -> Result<TopicPartitionList, QueueError> {
    let mut list = TopicPartitionList::with_capacity(offsets.len());
    for (&partition, &offset) in offsets {
        list.add_partition_offset(topic, partition, Offset::Offset(offset))
            .map_err(QueueError::Commit)?;
        if let Some(metadata) = metadata
            && let Some(mut element) = list.find_partition(topic, partition)
        {
            element.set_metadata(metadata);
        }
    }
    Ok(list)
}

/// A message's headers as owned `(name, value)` pairs (an absent value as
/// empty), in order.
pub fn owned_headers<M: Message>(message: &M) -> Vec<(String, Vec<u8>)> {
    use rdkafka::message::Headers;
    message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|header| {
                    (
                        header.key.to_owned(),
                        header.value.map(<[u8]>::to_vec).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn owned(
    topic: &Arc<str>,
    message: &rdkafka::message::BorrowedMessage<'_>,
) -> InMessage {
    let headers = owned_headers(message);
    InMessage {
        topic: Arc::clone(topic),
        partition: message.partition(),
        offset: message.offset(),
        key: message.key().map(<[u8]>::to_vec),
        payload: message.payload().map(<[u8]>::to_vec),
        headers,
        timestamp_ms: message.timestamp().to_millis(),
    }
}

/// librdkafka reports the partition of an offset reset only in its text; the
/// assignment tells which partitions have no valid position.
fn out_of_range_partition(consumer: &BaseConsumer<QueueContext>) -> i32 {
    consumer
        .position()
        .ok()
        .and_then(|positions| {
            positions
                .elements()
                .iter()
                .find(|element| !matches!(element.offset(), Offset::Offset(_)))
                .map(|element| element.partition())
        })
        .unwrap_or(-1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_the_group_refused_can_be_tried_again_and_others_cannot() {
        for code in [
            RDKafkaErrorCode::IllegalGeneration,
            RDKafkaErrorCode::RebalanceInProgress,
            RDKafkaErrorCode::UnknownMemberId,
            RDKafkaErrorCode::FencedInstanceId,
        ] {
            let error = commit_error(KafkaError::ConsumerCommit(code));
            assert!(
                matches!(error, QueueError::CommitRefused(_)),
                "{code:?}: {error}"
            );
            assert!(error.to_string().contains("commit this one again"));
        }
        for code in [
            RDKafkaErrorCode::InvalidGroupId,
            RDKafkaErrorCode::OffsetOutOfRange,
            RDKafkaErrorCode::BrokerTransportFailure,
        ] {
            let error = commit_error(KafkaError::ConsumerCommit(code));
            assert!(matches!(error, QueueError::Commit(_)), "{code:?}: {error}");
        }
    }
}

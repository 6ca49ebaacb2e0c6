//! Publishing to the records topic: a few transactional producers, each
//! behind an [`ArrayEnqueuer`] (group commit), requests spread over them.
//!
//! One request's messages always go through one `enqueue_array` call: one
//! transaction, possibly shared with other requests' arrays, all visible or
//! none. Concurrent requests share transactions, so throughput does not
//! collapse to one transaction round trip per request.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use backon::{ConstantBuilder, Retryable};
use quire_config::{ApiSettings, KafkaSettings};
use quire_messages::{MessageKind, StreamName, records};
use quire_queue::{
    ArrayEnqueuer, Followers, GroupCommitLimits, MessageId, OutMessage, ProducerOptions,
    QueueError, Release, TransactionObserver, TransactionalProducer,
};
use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;

use crate::log_reader::LogReader;
use crate::metrics::Metrics;

/// The longest a producer goes without releasing its partitions (a
/// disconnection librdkafka did not report).
const RELEASE_EVERY: Duration = Duration::from_secs(30);

/// Pause between two attempts to recreate an unusable producer (Kafka may
/// be away for long: the attempts go on until it lets one through, or the
/// API stops).
const RECREATE_PAUSE: Duration = Duration::from_secs(1);

/// One attempt in this many is logged while a producer cannot be recreated.
const RECREATE_LOG_EVERY: u32 = 30;

/// One transactional producer and its group commit.
#[derive(Clone)]
struct Connected {
    producer: TransactionalProducer,
    enqueuer: ArrayEnqueuer,
}

struct Slot {
    transactional_id: String,
    current: RwLock<Connected>,
    /// Set while a task recreates the producer.
    recreating: AtomicBool,
}

/// How producers are created (again).
struct Factory {
    kafka: KafkaSettings,
    send_timeout: Duration,
    release: Release,
    limits: GroupCommitLimits,
    observer: TransactionObserver,
    metrics: Arc<Metrics>,
}

pub struct Publisher {
    slots: Arc<Vec<Slot>>,
    next: AtomicUsize,
    factory: Arc<Factory>,
    /// How long a request waits for an unknown commit outcome to be settled
    /// from the log (`api.publish_timeout_ms`); past it, the answer is the
    /// 500 and a keyed request's outcome is settled in the background.
    settle_within: Duration,
    /// The fewest records partitions any producer's metadata held at the
    /// last refresh: no message is routed past it.
    partitions_known: AtomicI32,
    /// Stops the tasks that recreate producers (the API is stopping).
    stop: CancellationToken,
}

/// Builds the messages of the records topic.
#[derive(Debug, Clone)]
pub struct RecordsTopic {
    topic: String,
    /// `api.batch_max_bytes`: the most bytes of framed records in one batch.
    batch_max_bytes: usize,
}

/// One request's records as the batch messages that carry them.
#[derive(Debug)]
pub struct Batches {
    /// The batch messages, in the records' order.
    pub messages: Vec<OutMessage>,
    /// How many records each message carries, in the same order.
    pub counts: Vec<usize>,
}

/// `{transactional_id_prefix}-{replica_id}-{n}`: stable per replica, so a
/// restarted replica fences its predecessor's producers.
pub fn transactional_ids(api: &ApiSettings) -> Vec<String> {
    (0..api.producers.get())
        .map(|index| format!("{}-{}-{index}", api.transactional_id_prefix, api.replica_id))
        .collect()
}

impl Factory {
    async fn connect(&self, transactional_id: &str) -> Result<Connected, QueueError> {
        let producer = TransactionalProducer::connect_with(
            &self.kafka,
            transactional_id,
            ProducerOptions {
                send_timeout: Some(self.send_timeout),
                // A request in a transaction is answered within the send
                // timeout plus this: "outcome unknown", settled from the log,
                // rather than a wait through three 30 s commit attempts
                // while the transaction coordinator moves.
                commit_timeout: Some(self.send_timeout),
                release: Some(self.release.clone()),
            },
        )
        .await?;
        let enqueuer = ArrayEnqueuer::start_observed(
            producer.clone(),
            self.limits,
            Some(Arc::clone(&self.observer)),
        );
        Ok(Connected { producer, enqueuer })
    }
}

impl Publisher {
    /// Connects the producers (initialising their transactions fences any
    /// older instance with the same ids), has each commit `release` (one
    /// message to each records partition, see [`Release`]), and starts their
    /// group commit. A producer commits `release` again before its next
    /// array whenever librdkafka saw the brokers gone. The producers it
    /// recreates later stop trying once `stop` is cancelled.
    pub async fn connect(
        kafka: &KafkaSettings,
        api: &ApiSettings,
        metrics: Arc<Metrics>,
        release_messages: Vec<OutMessage>,
        stop: CancellationToken,
    ) -> Result<Self, QueueError> {
        let limits = GroupCommitLimits {
            // A request's array always goes whole; let a group hold several.
            max_messages: GroupCommitLimits::default()
                .max_messages
                .max(api.max_records_per_request.get()),
            max_bytes: GroupCommitLimits::default()
                .max_bytes
                .max(api.max_body_bytes.get()),
            // No request waits through more than one failing transaction:
            // past the publish timeout it is answered 503 unsent.
            max_wait: Some(api.publish_timeout.max(Duration::from_millis(1))),
            ..GroupCommitLimits::default()
        };
        let observed = Arc::clone(&metrics);
        let released = Arc::clone(&metrics);
        let factory = Arc::new(Factory {
            kafka: kafka.clone(),
            send_timeout: api.publish_timeout.max(Duration::from_millis(1)),
            release: Release {
                messages: release_messages,
                patience: Release::patience_for(kafka),
                on_release: Some(Arc::new(move || released.partitions_released())),
            },
            limits,
            observer: Arc::new(move |report| {
                observed.transaction_ended(report.outcome, report.elapsed);
            }),
            metrics,
        });
        let ids = transactional_ids(api);
        let connected = futures::future::try_join_all(
            ids.iter()
                .map(|transactional_id| factory.connect(transactional_id)),
        )
        .await?;
        let slots = connected
            .into_iter()
            .zip(ids)
            .map(|(connected, transactional_id)| Slot {
                transactional_id,
                current: RwLock::new(connected),
                recreating: AtomicBool::new(false),
            })
            .collect();
        Ok(Publisher {
            slots: Arc::new(slots),
            next: AtomicUsize::new(0),
            factory,
            settle_within: api.publish_timeout.max(Duration::from_millis(1)),
            partitions_known: AtomicI32::new(0),
            stop,
        })
    }

    /// The records partitions every producer knows, as of the last
    /// [`refresh_partitions`](Self::refresh_partitions).
    pub fn known_partitions(&self) -> i32 {
        self.partitions_known.load(Ordering::Acquire)
    }

    /// Has every producer ask the brokers for `topic`'s metadata now (a
    /// grown topic is known at once, not at librdkafka's next periodic
    /// refresh); returns the fewest partitions any of them knows.
    pub async fn refresh_partitions(&self, topic: &str) -> Result<i32, QueueError> {
        let producers: Vec<TransactionalProducer> = self
            .slots
            .iter()
            .map(|slot| {
                slot.current
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .producer
                    .clone()
            })
            .collect();
        let mut fewest = i32::MAX;
        for producer in producers {
            fewest = fewest.min(producer.refresh_partitions(topic).await?);
        }
        let fewest = if fewest == i32::MAX { 0 } else { fewest };
        self.partitions_known.store(fewest, Ordering::Release);
        Ok(fewest)
    }

    /// Publishes `messages` atomically; one id per message, in order.
    ///
    /// A producer that became unusable (fenced, or its transaction state
    /// unknown after Kafka went away) is recreated in the background with
    /// the same transactional id, until Kafka lets it: the API recovers
    /// without a restart.
    pub async fn publish(
        &self,
        messages: Vec<OutMessage>,
        followers: Option<Followers>,
    ) -> Result<Vec<MessageId>, QueueError> {
        self.repair();
        let index = self.pick();
        let connected = self.slots[index]
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let outcome = connected
            .enqueuer
            .enqueue_array_then(messages, followers)
            .await;
        if !connected.producer.is_usable() {
            self.recreate(index);
        }
        outcome
    }

    /// [`publish`](Self::publish), with a commit whose outcome is unknown
    /// (Kafka failed in the middle of it) settled by reading the log where
    /// the messages were written, once the transaction has ended:
    /// committed is answered as committed, aborted as aborted (503: nothing
    /// was published, retry); only what cannot be settled within
    /// `api.publish_timeout_ms` stays "outcome unknown" (500).
    pub async fn publish_settled(
        &self,
        log: &LogReader,
        messages: Vec<OutMessage>,
        followers: Option<Followers>,
    ) -> Result<Vec<MessageId>, QueueError> {
        let key = messages.first().and_then(|message| message.key.clone());
        match self.publish(messages, followers).await {
            Err(QueueError::CommitOutcomeUnknown { source, ids }) => {
                let (Some(key), Some(&first)) = (key, ids.first()) else {
                    return Err(QueueError::CommitOutcomeUnknown { source, ids });
                };
                match log.settle(&key, first, self.settle_within).await {
                    Ok(true) => {
                        tracing::info!(
                            partition = first.partition,
                            offset = first.offset,
                            "commit outcome settled from the log: committed"
                        );
                        Ok(ids)
                    }
                    Ok(false) => {
                        tracing::info!(
                            partition = first.partition,
                            offset = first.offset,
                            "commit outcome settled from the log: aborted"
                        );
                        Err(QueueError::TransactionAborted(source))
                    }
                    Err(error) => {
                        tracing::warn!(error = %error, "commit outcome could not be settled from the log");
                        Err(QueueError::CommitOutcomeUnknown { source, ids })
                    }
                }
            }
            outcome => outcome,
        }
    }

    /// Round robin over the usable producers (any, if none is).
    fn pick(&self) -> usize {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let count = self.slots.len();
        (0..count)
            .map(|step| (start + step) % count)
            .find(|&index| self.slots[index].is_usable())
            .unwrap_or(start % count)
    }

    /// Starts recreating every unusable producer (those not under way).
    fn repair(&self) {
        for index in 0..self.slots.len() {
            if !self.slots[index].is_usable() {
                self.recreate(index);
            }
        }
    }

    /// Starts recreating producer `index`, unless that is under way: one
    /// attempt every [`RECREATE_PAUSE`] until Kafka lets one through, or
    /// the API stops.
    fn recreate(&self, index: usize) {
        if self.slots[index].recreating.swap(true, Ordering::AcqRel) {
            return;
        }
        let slots = Arc::clone(&self.slots);
        let factory = Arc::clone(&self.factory);
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let slot = &slots[index];
            tracing::warn!(transactional_id = %slot.transactional_id, "recreating an unusable producer");
            let mut failures = 0u32;
            let retried = (|| factory.connect(&slot.transactional_id))
                .retry(
                    ConstantBuilder::default()
                        .with_delay(RECREATE_PAUSE)
                        .without_max_times(),
                )
                .sleep(tokio::time::sleep)
                .notify(|error, _pause| {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(RECREATE_LOG_EVERY) {
                        tracing::warn!(transactional_id = %slot.transactional_id, attempts = failures, error = %error, "cannot recreate the producer yet; retrying");
                    }
                });
            let connected = tokio::select! {
                () = stop.cancelled() => {
                    slot.recreating.store(false, Ordering::Release);
                    return;
                }
                connected = retried => connected,
            };
            match connected {
                Ok(connected) => {
                    // The old producer and its group-commit task end when
                    // the last request holding them is answered.
                    *slot.current.write().unwrap_or_else(PoisonError::into_inner) = connected;
                    slot.recreating.store(false, Ordering::Release);
                    factory.metrics.producer_recreated();
                    tracing::info!(transactional_id = %slot.transactional_id, attempts = failures + 1, "producer recreated");
                }
                Err(error) => {
                    // Unreachable without a limit on the attempts; the next
                    // upkeep round starts again.
                    slot.recreating.store(false, Ordering::Release);
                    tracing::warn!(transactional_id = %slot.transactional_id, error = %error, "cannot recreate the producer");
                }
            }
        });
    }

    /// Keeps the producers fit while no request uses them, every
    /// `interval` until `stop`:
    /// - starts recreating the unusable ones (a request does so too, before
    ///   it publishes; `/readyz` only reports them);
    /// - while `kafka_available()`, commits the releases that are due on
    ///   the usable ones (see [`Release`]; a producer with traffic releases
    ///   before its next array anyway): the brokers were gone, or
    ///   `RELEASE_EVERY` has passed. A failed release stays due.
    pub async fn run_upkeep(
        self: Arc<Self>,
        kafka_available: impl Fn() -> bool + Send + 'static,
        interval: Duration,
        stop: CancellationToken,
    ) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_release = std::time::Instant::now();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            self.repair();
            if !kafka_available() {
                continue;
            }
            let periodic = last_release.elapsed() >= RELEASE_EVERY;
            if periodic {
                last_release = std::time::Instant::now();
            }
            for slot in self.slots.iter() {
                let connected = slot
                    .current
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if !connected.producer.is_usable() {
                    continue;
                }
                if periodic {
                    connected.producer.request_release();
                }
                if !connected.producer.release_is_due() {
                    continue;
                }
                let released = tokio::select! {
                    () = stop.cancelled() => return,
                    released = connected.producer.release_if_due() => released,
                };
                if let Err(error) = released {
                    tracing::warn!(
                        transactional_id = %slot.transactional_id,
                        error = %error,
                        "releasing the producer's partitions failed; trying again"
                    );
                }
            }
        }
    }

    /// Transactional ids of producers that are unusable (being recreated).
    pub fn unusable_producers(&self) -> Vec<&str> {
        self.slots
            .iter()
            .filter(|slot| !slot.is_usable())
            .map(|slot| slot.transactional_id.as_str())
            .collect()
    }
}

impl Slot {
    fn is_usable(&self) -> bool {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .producer
            .is_usable()
    }
}

impl RecordsTopic {
    /// The records topic `topic`, its batches bounded by `batch_max_bytes`.
    pub fn new(topic: &str, batch_max_bytes: usize) -> Self {
        RecordsTopic {
            topic: topic.to_owned(),
            batch_max_bytes,
        }
    }

    /// A request's records of `stream`, in order, as few batch messages as
    /// the bound allows (see [`records::batches`]): each record's exact
    /// JSON text framed, keyed by the stream, on the stream's partition
    /// (`crate::placement`). A record past the bound goes alone in its
    /// batch (start-up checked that one fits the topic).
    pub fn batch_messages(
        &self,
        stream: &StreamName,
        partition: i32,
        texts: &[&RawValue],
    ) -> Batches {
        let batches = records::batches(
            stream,
            texts.iter().map(|text| text.get().as_bytes()),
            self.batch_max_bytes,
        );
        let counts = batches
            .iter()
            .map(|batch| records::record_count(&batch.headers, &batch.payload))
            .collect();
        let messages = batches
            .into_iter()
            .map(|batch| self.on_topic(batch).to_partition(partition))
            .collect();
        Batches { messages, counts }
    }

    /// A control message (cut marker, definition) on the stream's key and
    /// partition, so it lands in order with the stream's records.
    pub fn control_message(
        &self,
        kind: MessageKind,
        stream: &StreamName,
        partition: i32,
        body: Vec<u8>,
    ) -> OutMessage {
        debug_assert!(!matches!(kind, MessageKind::Record | MessageKind::Batch));
        self.on_topic(records::control(kind, stream, body))
            .to_partition(partition)
    }

    /// One release message for each of `partitions` (see [`Release`]): no
    /// key, no stream, skipped by workers.
    pub fn release_messages(&self, partitions: i32) -> Vec<OutMessage> {
        (0..partitions)
            .map(|partition| self.on_topic(records::release(partition)))
            .collect()
    }

    fn on_topic(&self, message: records::LogMessage) -> OutMessage {
        OutMessage::from_parts(
            &self.topic,
            message.key,
            message.payload,
            message.headers,
            message.partition,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_go_in_order_in_as_few_bounded_batches_keyed_by_stream() {
        let texts: Vec<String> = (0..40)
            .map(|seq| format!("{{\"seq\": {seq},\n \"pad\": \"{}\"}}", "x".repeat(seq)))
            .collect();
        let raw: Vec<&RawValue> = texts
            .iter()
            .map(|text| serde_json::from_str(text).unwrap())
            .collect();
        let topic = RecordsTopic::new("quire.records", 300);
        let stream = StreamName::new("orders").unwrap();
        let batches = topic.batch_messages(&stream, 7, &raw);
        assert_eq!(batches.messages.len(), batches.counts.len());
        assert!(batches.messages.len() > 1, "300 bytes split them");
        assert_eq!(batches.counts.iter().sum::<usize>(), texts.len());
        let mut read_back = Vec::new();
        for (message, &count) in batches.messages.iter().zip(&batches.counts) {
            assert_eq!(message.topic, "quire.records");
            assert_eq!(message.key.as_deref(), Some(&b"orders"[..]));
            assert_eq!(message.partition, Some(7), "the API chooses the partition");
            assert_eq!(
                message.headers,
                [
                    ("quire-kind".to_owned(), b"batch".to_vec()),
                    ("quire-v".to_owned(), b"1".to_vec())
                ]
            );
            assert!(message.payload.len() <= 300, "{}", message.payload.len());
            let inside: Vec<&[u8]> = quire_messages::batch::records(&message.payload)
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(inside.len(), count);
            read_back.extend(inside.iter().map(|text| text.to_vec()));
        }
        // Byte for byte, in order, and no batch could have taken the next
        // batch's first record: as few batches as the bound allows.
        let sent: Vec<Vec<u8>> = texts.iter().map(|text| text.clone().into_bytes()).collect();
        assert_eq!(read_back, sent);
        for pair in batches.messages.windows(2) {
            let next_first = quire_messages::batch::records(&pair[1].payload)
                .next()
                .unwrap()
                .unwrap();
            assert!(
                pair[0].payload.len() + quire_messages::batch::FRAME_OVERHEAD + next_first.len()
                    > 300
            );
        }
        let one = topic.batch_messages(&stream, 7, &raw[..1]);
        assert_eq!(one.counts, [1]);
        let cut = topic.control_message(MessageKind::Cut, &stream, 7, b"{}".to_vec());
        assert_eq!(cut.headers[0], ("quire-kind".to_owned(), b"cut".to_vec()));
        assert_eq!(cut.key.as_deref(), Some(&b"orders"[..]));
    }

    #[test]
    fn a_record_past_the_bound_goes_alone_in_its_batch() {
        let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(500));
        let texts = [r#"{"a":1}"#, big.as_str(), r#"{"b":2}"#, r#"{"c":3}"#];
        let raw: Vec<&RawValue> = texts
            .iter()
            .map(|text| serde_json::from_str(text).unwrap())
            .collect();
        let topic = RecordsTopic::new("quire.records", 100);
        let batches = topic.batch_messages(&StreamName::new("orders").unwrap(), 0, &raw);
        assert_eq!(batches.counts, [1, 1, 2]);
        assert_eq!(
            batches.messages[1].payload.len(),
            big.len() + quire_messages::batch::FRAME_OVERHEAD
        );
    }

    #[test]
    fn transactional_ids_are_prefix_replica_and_index() {
        let mut api = quire_config::defaults().api;
        api.transactional_id_prefix = "quire-api".into();
        api.replica_id = "api-2".into();
        api.producers = std::num::NonZero::new(3).unwrap();
        assert_eq!(
            transactional_ids(&api),
            [
                "quire-api-api-2-0",
                "quire-api-api-2-1",
                "quire-api-api-2-2"
            ]
        );
        api.producers = std::num::NonZero::new(1).unwrap();
        assert_eq!(transactional_ids(&api), ["quire-api-api-2-0"]);
    }
}

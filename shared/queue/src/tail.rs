//! Following a whole topic as it grows, outside any consumer group: where a
//! service keeps a copy of a small topic in memory (the API's
//! `Idempotency-Key` answers) and must know how far the copy goes.
//!
//! A [`TopicTail`] is one read_committed client assigned every partition of
//! its topic from the low watermark, polled by a thread of its own that
//! hands each committed message to the caller, for the life of the tail.
//! Per partition it publishes how far it has *covered*: every committed
//! message below that offset has been handed over. librdkafka moves a
//! partition's position past transaction markers and aborted batches too,
//! so the covered offset reaches the high watermark once every transaction
//! below it has ended and been read; a transaction still open holds it
//! back, as it holds back every read_committed reader.
//!
//! [`TopicTail::catch_up`] is the question a caller asks: "has everything
//! written to this partition before now been handed to me?". It asks the
//! partition's high watermark (a read_uncommitted ListOffsets, so it counts
//! transactions still open) and waits until the covered offset reaches it,
//! within a bound. Leader moves and broker restarts are the client's
//! business: it refetches on its own, and a watermark request that fails
//! for a transient reason is asked again until the bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::client::reader_config;
use crate::consumer::owned;
use crate::reader::QuietAboutTheEnd;
use crate::{InMessage, PartitionReader, QueueError, ReadError, ReaderOptions, is_transient};

/// How long one poll of the tail's client waits; also how often the
/// covered offsets are refreshed when nothing arrives.
const POLL: Duration = Duration::from_millis(50);

/// See the module documentation.
pub struct TopicTail {
    topic: String,
    /// Per partition, every committed message below it has been handed over.
    covered: watch::Receiver<Vec<i64>>,
    /// Asks high watermarks.
    watermarks: Arc<PartitionReader>,
    stop: Arc<AtomicBool>,
}

impl TopicTail {
    /// Starts following `partitions` partitions of `topic` from their low
    /// watermarks, handing every committed message to `each` on the tail's
    /// own thread. `group_id` only satisfies librdkafka (nothing joins or
    /// commits). Blocks for the low watermarks: call it from the blocking
    /// pool or at start-up.
    pub fn start(
        settings: &KafkaSettings,
        group_id: &str,
        topic: &str,
        partitions: i32,
        each: impl FnMut(InMessage) + Send + 'static,
    ) -> Result<Self, QueueError> {
        Self::start_with(
            settings,
            group_id,
            topic,
            partitions,
            "read_committed",
            each,
        )
    }

    /// [`start`](Self::start), reading every message as it is written
    /// (`read_uncommitted`): for a partition whose messages that matter are
    /// written outside transactions (quire-queue's `send_acknowledged`), so
    /// that another producer's open transaction there never holds the tail
    /// back. Messages of transactions still open or aborted are handed
    /// over too; the caller ignores what is not its own.
    pub fn start_uncommitted(
        settings: &KafkaSettings,
        group_id: &str,
        topic: &str,
        partitions: i32,
        each: impl FnMut(InMessage) + Send + 'static,
    ) -> Result<Self, QueueError> {
        Self::start_with(
            settings,
            group_id,
            topic,
            partitions,
            "read_uncommitted",
            each,
        )
    }

    fn start_with(
        settings: &KafkaSettings,
        group_id: &str,
        topic: &str,
        partitions: i32,
        isolation_level: &str,
        each: impl FnMut(InMessage) + Send + 'static,
    ) -> Result<Self, QueueError> {
        let watermarks = Arc::new(PartitionReader::new(
            settings,
            group_id,
            ReaderOptions::default(),
        )?);
        let mut config = reader_config(settings, group_id, isolation_level, false)?;
        // A tail waits at the end for what comes next: the broker answers a
        // waiting fetch as soon as the last stable offset moves.
        config.set("fetch.wait.max.ms", "100");
        let client: BaseConsumer<QuietAboutTheEnd> = config
            .create_with_context(QuietAboutTheEnd)
            .map_err(QueueError::client)?;

        let deadline = Instant::now() + settings.request_timeout;
        let mut assignment = TopicPartitionList::new();
        let mut covered = Vec::with_capacity(partitions.max(0) as usize);
        for partition in 0..partitions {
            let (low, _high) = watermarks.watermarks(topic, partition, deadline)?;
            covered.push(low);
            assignment
                .add_partition_offset(topic, partition, Offset::Offset(low))
                .map_err(QueueError::client)?;
        }
        client.assign(&assignment).map_err(QueueError::client)?;

        let (publish, covered) = watch::channel(covered);
        let stop = Arc::new(AtomicBool::new(false));
        let follow = Following {
            client,
            topic: Arc::from(topic),
            publish,
            stop: Arc::clone(&stop),
        };
        std::thread::Builder::new()
            .name(format!("tail-{topic}"))
            .spawn(move || follow.run(each))
            .map_err(|error| QueueError::Thread(error.to_string()))?;
        Ok(TopicTail {
            topic: topic.to_owned(),
            covered,
            watermarks,
            stop,
        })
    }

    /// How far the tail has covered `partition`.
    pub fn covered(&self, partition: i32) -> i64 {
        self.covered
            .borrow()
            .get(partition as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Waits, at most `limit`, until every message written to `partition`
    /// before this call has been handed over (the transactions that wrote
    /// them have ended and been read). Fails when the partition's high
    /// watermark cannot be asked or the tail does not get there in time.
    pub async fn catch_up(&self, partition: i32, limit: Duration) -> Result<(), ReadError> {
        let started = Instant::now();
        let deadline = started + limit;
        let high = {
            let watermarks = Arc::clone(&self.watermarks);
            let topic = self.topic.clone();
            tokio::task::spawn_blocking(move || watermarks.watermarks(&topic, partition, deadline))
                .await
                .unwrap_or_else(|_cancelled| {
                    Err(ReadError::TimedOut {
                        topic: self.topic.clone(),
                        partition,
                        offset: -1,
                        waited: started.elapsed(),
                    })
                })?
                .1
        };
        let mut covered = self.covered.clone();
        let reached = covered.wait_for(|offsets| {
            offsets
                .get(partition as usize)
                .is_some_and(|&offset| offset >= high)
        });
        match tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), reached)
            .await
        {
            Ok(Ok(_)) => Ok(()),
            // The tail's thread has ended (the tail was dropped).
            Ok(Err(_)) | Err(_) => Err(ReadError::NotYetStable {
                topic: self.topic.clone(),
                partition,
                offset: high - 1,
                waited: started.elapsed(),
            }),
        }
    }

    /// [`catch_up`](Self::catch_up) on every partition, one after another,
    /// within `limit` in all.
    pub async fn catch_up_all(&self, partitions: i32, limit: Duration) -> Result<(), ReadError> {
        let deadline = Instant::now() + limit;
        for partition in 0..partitions {
            self.catch_up(
                partition,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await?;
        }
        Ok(())
    }
}

impl Drop for TopicTail {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// The tail's thread.
struct Following {
    client: BaseConsumer<QuietAboutTheEnd>,
    topic: Arc<str>,
    publish: watch::Sender<Vec<i64>>,
    stop: Arc<AtomicBool>,
}

impl Following {
    fn run(self, mut each: impl FnMut(InMessage)) {
        let mut since_refresh = 0usize;
        while !self.stop.load(Ordering::Acquire) {
            match self.client.poll(POLL) {
                Some(Ok(message)) => {
                    let (partition, next) = (
                        rdkafka::Message::partition(&message),
                        rdkafka::Message::offset(&message) + 1,
                    );
                    each(owned(&self.topic, &message));
                    // Handed over: covered now.
                    self.advance(partition, next);
                    since_refresh += 1;
                    if since_refresh >= 1000 {
                        self.refresh();
                        since_refresh = 0;
                    }
                }
                // The end, or nothing for a while: markers and aborted
                // batches may have moved the position without a message.
                Some(Err(KafkaError::PartitionEOF(_))) | None => {
                    self.refresh();
                    since_refresh = 0;
                }
                Some(Err(error)) if is_transient(&error) => {
                    tracing::debug!(topic = %self.topic, error = %error, "transient error on a topic tail; polling on");
                }
                Some(Err(error)) => {
                    tracing::warn!(topic = %self.topic, error = %error, "error on a topic tail; polling on");
                    std::thread::sleep(POLL);
                }
            }
        }
    }

    fn advance(&self, partition: i32, next: i64) {
        self.publish
            .send_if_modified(|covered| match covered.get_mut(partition as usize) {
                Some(slot) if *slot < next => {
                    *slot = next;
                    true
                }
                _ => false,
            });
    }

    /// Takes the client's positions: they also move past transaction
    /// markers and aborted batches, which hand nothing over. Every message
    /// below a position was returned by an earlier poll of this thread, so
    /// it has been handed over already.
    fn refresh(&self) {
        let Ok(positions) = self.client.position() else {
            return;
        };
        for element in positions.elements() {
            if let Offset::Offset(next) = element.offset() {
                self.advance(element.partition(), next);
            }
        }
    }
}

//! Keeping a group member in its group while it works on an array between
//! two reads (the worker's S3 uploads, which a brownout can slow past
//! `max.poll.interval.ms`).
//!
//! librdkafka resets that timer only when the application polls, and a
//! member past it leaves the group: its partitions go to a new owner, which
//! starts the same work again. A [`KeepAlive`] polls for the caller, under
//! the consumer's poll lock, once the work has taken a fifth of the
//! interval, after pausing every assigned partition. What such a poll
//! serves never changes what the caller relies on (see `context.rs`): a
//! rebalance callback is deferred to the next read, a message (none is
//! expected once paused) is held for it.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;

use crate::ArrayConsumer;
use crate::consumer::owned;
use crate::context::QueueContext;

/// Polls one keep-alive tick makes at most: enough to serve what librdkafka
/// queued meanwhile (statistics, errors, a rebalance to defer).
const KEEP_ALIVE_POLLS: usize = 32;

impl ArrayConsumer {
    /// Keeps this member in its group while the caller works on the array
    /// it read (S3 uploads a brownout slows can outlast
    /// `max.poll.interval.ms`, past which librdkafka leaves the group and
    /// the partitions go to a new owner that starts the same uploads again).
    /// Once the work has taken a fifth of that interval, the keep-alive
    /// pauses every assigned partition and polls every fifth of it, which
    /// is what resets librdkafka's timer. Stop it with
    /// [`KeepAlive::stop`] before the commit; dropping it stops it too,
    /// in the background.
    ///
    /// It changes nothing the caller relies on: a rebalance callback it
    /// serves is deferred to the next read (see `context.rs`), so the
    /// assignment still changes only inside `next_array`. Pausing drops
    /// what librdkafka fetched and did not hand out (librdkafka 2.12:
    /// `rd_kafka_toppar_op_pause_resume` raises the partition's version
    /// barrier at once, so queued messages of the old version are filtered
    /// out, and the next fetch starts at the application's position, the
    /// offset after the last message handed out), so after the resume the
    /// next read gets exactly the messages after this array, fetched
    /// again. A message a keep-alive poll still receives is held and handed
    /// out first by the next read.
    pub fn keep_alive(&self) -> KeepAlive {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = Arc::clone(&self.consumer);
        let poll_lock = Arc::clone(&self.poll_lock);
        let topic: Arc<str> = Arc::from(self.topic.as_str());
        let every = self.keep_alive_every;
        let task = tokio::spawn(async move {
            tokio::select! {
                _ = &mut stopped => return,
                () = tokio::time::sleep(every) => {}
            }
            loop {
                let (consumer, poll_lock, topic) = (
                    Arc::clone(&consumer),
                    Arc::clone(&poll_lock),
                    Arc::clone(&topic),
                );
                let polled = tokio::task::spawn_blocking(move || {
                    let _polling = poll_lock.lock().expect("poll lock");
                    keep_alive_poll(&consumer, &topic);
                })
                .await;
                if let Err(error) = polled {
                    tracing::warn!(error = %error, "keep-alive poll failed");
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(every) => {}
                }
            }
            let ended = tokio::task::spawn_blocking(move || {
                let _polling = poll_lock.lock().expect("poll lock");
                end_keep_alive(&consumer, &topic);
            })
            .await;
            if let Err(error) = ended {
                tracing::warn!(error = %error, "ending the keep-alive failed");
            }
        });
        KeepAlive {
            stop: Some(stop),
            task: Some(task),
        }
    }
}

/// What [`ArrayConsumer::keep_alive`] returns: stop it before committing.
pub struct KeepAlive {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl KeepAlive {
    /// Stops polling and resumes what it paused; once this returns, nothing
    /// polls until the next read.
    pub async fn stop(mut self) {
        drop(self.stop.take());
        if let Some(task) = self.task.take()
            && let Err(error) = task.await
        {
            tracing::warn!(error = %error, "keep-alive task failed");
        }
    }
}

impl Drop for KeepAlive {
    /// Dropped without `stop` (an error ended the caller's work): the task
    /// sees the sender gone, resumes and ends by itself.
    fn drop(&mut self) {
        drop(self.stop.take());
    }
}

/// One keep-alive tick, under the poll lock: pauses the assigned
/// partitions not paused yet, then polls without waiting. Rebalance
/// callbacks are deferred (`keeping_alive`), messages and errors held for
/// the next read.
fn keep_alive_poll(consumer: &BaseConsumer<QueueContext>, topic: &Arc<str>) {
    let to_pause: Vec<i32> = {
        let mut state = consumer.context().lock();
        state.keeping_alive = true;
        state
            .assigned
            .keys()
            .filter(|partition| {
                !state.paused.contains(partition) && !state.unserved.contains(partition)
            })
            .copied()
            .collect()
    };
    if !to_pause.is_empty() {
        let mut list = TopicPartitionList::with_capacity(to_pause.len());
        for &partition in &to_pause {
            list.add_partition(topic, partition);
        }
        match consumer.pause(&list) {
            Ok(()) => {
                tracing::info!(partitions = ?to_pause, "array work is long: partitions paused, polling to stay in the group");
                consumer.context().lock().paused.extend(to_pause);
            }
            Err(error) => tracing::warn!(error = %error, "could not pause partitions"),
        }
    }
    let mut empty_in_a_row = 0;
    for _ in 0..KEEP_ALIVE_POLLS {
        // None is also what a served callback returns: two in a row is empty.
        let polled = consumer.poll(Duration::ZERO);
        let mut state = consumer.context().lock();
        match polled {
            None => {
                empty_in_a_row += 1;
                if empty_in_a_row == 2 {
                    break;
                }
                continue;
            }
            Some(Ok(message)) => {
                state.at_end.remove(&message.partition());
                state.held.push(owned(topic, &message));
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                state.at_end.insert(partition);
            }
            Some(Err(error)) if crate::is_transient(&error) => {
                tracing::warn!(error = %error, "transient consumer error");
            }
            Some(Err(error)) => {
                state.held_error.get_or_insert(error);
            }
        }
        empty_in_a_row = 0;
    }
}

/// Ends a keep-alive, under the poll lock: callbacks are applied again (the
/// deferred ones by the next read) and the paused partitions resumed.
fn end_keep_alive(consumer: &BaseConsumer<QueueContext>, topic: &Arc<str>) {
    let paused = {
        let mut state = consumer.context().lock();
        state.keeping_alive = false;
        std::mem::take(&mut state.paused)
    };
    if paused.is_empty() {
        return;
    }
    let mut list = TopicPartitionList::with_capacity(paused.len());
    for &partition in &paused {
        list.add_partition(topic, partition);
    }
    match consumer.resume(&list) {
        Ok(()) => tracing::info!(partitions = ?paused, "array work done: partitions resumed"),
        Err(error) => {
            tracing::warn!(error = %error, partitions = ?paused, "could not resume partitions")
        }
    }
}

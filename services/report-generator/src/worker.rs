//! The worker loop of DESIGN.md: pull an array, append each record to the
//! open document of its stream, complete documents at their cut markers, then
//! publish events, watermarks, this worker's own markers and the consumer
//! offsets in ONE Kafka transaction, with the group metadata.
//!
//! A `Worker` is one session: its Kafka clients, its S3 handle and a
//! pipeline per partition it holds (`pipeline.rs`). An error ends the
//! session; the supervisor (`supervisor.rs`) decides whether to build a new
//! one. This module is the loop, read -> apply -> commit; `session.rs`
//! builds and ends a session and applies rebalances, `timed.rs` makes the
//! decisions of the clock (age, memory, idle windows), `outbox.rs` holds
//! what a transaction publishes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_config::WorkerSettings;
use quire_messages::records;
use quire_queue::{Array, ArrayBounds, ArrayConsumer, QueueError, TransactionalProducer};
use tokio_util::sync::CancellationToken;

use crate::WorkerError;
use crate::document::S3Documents;
use crate::metrics::{ArrayCommitted, OpenDocuments};
use crate::monitoring::Monitor;
use crate::pipeline::{Context, PartitionPipeline};
use crate::stuck::StuckWatch;
use crate::topics::TopicWatch;
use outbox::{Outbox, Refused, on_topic};

pub(crate) mod outbox;
mod session;
mod timed;

/// Serve until stopped, or drain what is queued and exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Run until the stop flag is raised (SIGTERM), then finish the array in
    /// hand, commit, abort open documents (the next owner renders them again).
    Serve,
    /// Once caught up, cut every open document, read up to those markers,
    /// complete the reports, commit and return.
    Drain,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub arrays: u64,
    pub records: u64,
    pub reports: u64,
    pub dead_letters: u64,
}

impl RunSummary {
    /// Adds what another session did.
    pub fn add(&mut self, other: &RunSummary) {
        self.arrays += other.arrays;
        self.records += other.records;
        self.reports += other.reports;
        self.dead_letters += other.dead_letters;
    }
}

/// One session of the worker.
pub struct Worker {
    settings: WorkerSettings,
    context: Context<S3Documents>,
    kafka: quire_config::KafkaSettings,
    consumer: ArrayConsumer,
    producer: TransactionalProducer,
    partitions: BTreeMap<i32, PartitionPipeline<S3Documents>>,
    monitor: Monitor,
    summary: RunSummary,
    /// The last transaction, if the group refused it.
    refused: Option<Refused>,
    /// Partitions held back by a hanging transaction.
    stuck: StuckWatch,
    /// Ends the session when a topic is recreated or the watermark topic grows.
    topic_watch: TopicWatch,
    /// The watermark topic: its id (committed beside every offset) and its
    /// partition count (record partitions past it are held, paused).
    watermarks: quire_queue::TopicIdentity,
    /// Assigned partitions this session cannot serve (no watermark
    /// partition of theirs yet): paused, never committed past.
    unserved: std::collections::BTreeSet<i32>,
}

impl Worker {
    /// The documents open now, over every partition held.
    pub fn open_documents(&self) -> usize {
        self.partitions
            .values()
            .map(|pipeline| pipeline.documents().count())
            .sum()
    }

    /// What this session did so far (committed arrays only).
    pub fn summary(&self) -> &RunSummary {
        &self.summary
    }

    /// Runs the loop. In serve mode it returns once `stop` is raised; in
    /// drain mode once everything queued before it was caught up is reported
    /// (or `stop` is raised). On an error the session is over: call
    /// [`shut_down`](Self::shut_down) either way.
    pub async fn run(&mut self, mode: Mode, stop: &CancellationToken) -> Result<(), WorkerError> {
        let settings = self.settings.clone();
        let max_wait = settings.max_wait;
        let mut draining = false;
        while !stop.is_cancelled() {
            self.monitor.health.turned();
            self.apply_topic_changes().await?;
            let array = self
                .consumer
                .next_array_within(array_bounds(&settings, max_wait))
                .await?;
            self.monitor.metrics.array_read(array.len(), array.waited);
            // S3 work slowed down can outlast max.poll.interval.ms: polled
            // until the commit, so the group keeps this member.
            let keep_alive = self.consumer.keep_alive();
            self.handle_rebalances(&array.rebalances).await?;
            let (mut outbox, refused_since) = match self.refused.take() {
                Some(refused) => (refused.outbox, Some(refused.since)),
                None => (Outbox::default(), None),
            };
            for message in &array.messages {
                let Some(pipeline) = self.partitions.get_mut(&message.partition) else {
                    // Cannot happen: arrays hold only assigned partitions' messages.
                    tracing::warn!(
                        partition = message.partition,
                        "message of a partition not held; skipped"
                    );
                    continue;
                };
                pipeline
                    .process(&self.context, message, &mut outbox)
                    .await?;
                outbox.tag_new(message.partition);
            }
            self.decide_timed_rollovers(&mut outbox);
            self.publish_window_markers(&mut outbox);
            outbox.tag_new_by_target();
            if mode == Mode::Drain && array.caught_up && array.len() < settings.max_records.get() {
                // The seed's exits (a short array or an empty wait) mean
                // "caught up" only with every assigned partition at its end.
                draining = true;
            }
            if draining {
                self.cut_everything_open(&mut outbox);
                outbox.tag_new_by_target();
            }
            let records = outbox.records;
            let dead_letters = outbox.dead_letters;
            let released = outbox.released;
            let window_markers = outbox.window_markers;
            let moves = outbox.moves;
            // The failpoint in commit looks at the reports: keep them there.
            let reports = outbox.reports.clone();
            keep_alive.stop().await;
            let transaction = match self.commit(&array, &mut outbox).await {
                Ok(transaction) => transaction,
                Err(WorkerError::Queue(QueueError::GroupRefused(error))) => {
                    let session_timeout = settings.session_timeout;
                    self.refused = Some(Refused::carry(
                        outbox,
                        refused_since,
                        session_timeout,
                        error,
                    )?);
                    continue;
                }
                Err(error) => return Err(error),
            };
            self.summary.records += records;
            self.summary.reports += reports.len() as u64;
            self.summary.dead_letters += dead_letters;
            self.summary.arrays += 1;
            self.monitor.metrics.array_committed(&ArrayCommitted {
                records,
                dead_letters,
                released,
                window_markers,
                moves,
                reports: &reports,
                transaction,
            });
            self.report_state();
            if draining && array.caught_up && self.nothing_open() {
                tracing::info!(summary = ?self.summary, "drained: everything queued is reported");
                return Ok(());
            }
        }
        tracing::info!(summary = ?self.summary, "stopped");
        Ok(())
    }

    /// The gauges and the readiness state, once per array: a few atomics and
    /// one walk over the open documents, no call to Kafka or S3.
    fn report_state(&mut self) {
        let mut open = OpenDocuments::default();
        let mut oldest: Option<Instant> = None;
        for document in self
            .partitions
            .values()
            .flat_map(|pipeline| pipeline.documents())
        {
            open.count += 1;
            open.buffered_bytes += document.buffered_bytes();
            oldest = Some(oldest.map_or(document.opened_at, |at| at.min(document.opened_at)));
        }
        open.oldest_age = oldest.map(|at| at.elapsed());
        let metrics = &self.monitor.metrics;
        metrics.open_documents(open);
        let assigned = self.consumer.assignment().len();
        let progress = self.consumer.progress();
        metrics.partitions(assigned, &progress);
        let stuck = self
            .stuck
            .observe(&self.context.topics.records, &progress, Instant::now());
        metrics.stuck(&stuck);
        self.monitor.health.set_stuck(stuck);
        self.monitor
            .health
            .set_assignment(assigned, self.consumer.brokers_up());
    }

    fn nothing_open(&self) -> bool {
        self.partitions
            .values()
            .all(|pipeline| pipeline.documents().next().is_none())
    }

    /// ONE transaction: events, dead letters, markers, watermarks and the
    /// offsets (never past an open document), with the group metadata.
    /// Returns how long the transaction took, if there was one. The outbox
    /// is left whole when the transaction fails.
    async fn commit(
        &mut self,
        array: &Array,
        outbox: &mut Outbox,
    ) -> Result<Option<Duration>, WorkerError> {
        // The offsets of every owned partition go with every transaction,
        // moved or not (the queue adds the commit points of partitions not
        // read yet), so the group checks every transaction against its
        // generation: a worker that froze while its partitions moved gets
        // its events and watermarks refused with its offsets.
        let mut offsets = BTreeMap::new();
        let mut moved = false;
        for (&partition, pipeline) in &mut self.partitions {
            let Some(point) = pipeline.commit_point() else {
                continue;
            };
            moved |= point.moved;
            offsets.insert(partition, point.offset);
            outbox.messages.extend(
                point
                    .watermarks
                    .into_iter()
                    .map(|message| on_topic(&self.context.topics.watermarks, message)),
            );
        }
        outbox.tag_new_by_target();
        if !moved && outbox.messages.is_empty() {
            return Ok(None);
        }
        if !outbox.reports.is_empty() {
            failpoint_before_commit();
        }
        let started = Instant::now();
        let messages = Arc::new(std::mem::take(&mut outbox.messages));
        let outcome = self
            .consumer
            .commit_shared_in_transaction(
                array,
                Some(offsets),
                &self.producer,
                Arc::clone(&messages),
            )
            .await;
        // The transaction's task has ended: the messages are ours alone again.
        outbox.messages = Arc::try_unwrap(messages).unwrap_or_else(|shared| (*shared).clone());
        let outcome = outcome?;
        let took = started.elapsed();
        for (partition, offset) in &outcome.commit.committed {
            if let Some(pipeline) = self.partitions.get_mut(partition) {
                pipeline.committed(*offset);
            }
        }
        if !outcome.commit.dropped.is_empty() {
            tracing::warn!(partitions = ?outcome.commit.dropped, "partitions revoked before the commit were left out");
        }
        tracing::debug!(
            records = outbox.records,
            reports = outbox.reports.len(),
            offsets = ?outcome.commit.committed,
            "array committed"
        );
        Ok(Some(took))
    }
}

/// `QUIRE_WORKER_FAILPOINT`, for the end-to-end tests only, at a transaction
/// that announces reports whose objects are already completed in S3:
/// - `crash-before-commit`: the process aborts (a crash in between);
/// - `pause-before-commit`: the first time, the process stops itself
///   (SIGSTOP, as a frozen VM or a long pause would) and commits when it is
///   thawed (SIGCONT): a zombie that wakes up after its partitions moved.
fn failpoint_before_commit() {
    static PAUSED_ONCE: AtomicBool = AtomicBool::new(false);
    match std::env::var("QUIRE_WORKER_FAILPOINT").as_deref() {
        Ok("crash-before-commit") => {
            tracing::error!("failpoint crash-before-commit: aborting the process");
            std::process::abort();
        }
        Ok("pause-before-commit") if !PAUSED_ONCE.swap(true, Ordering::AcqRel) => {
            tracing::warn!("failpoint pause-before-commit: stopping the process until SIGCONT");
            // kill(1) rather than a libc binding: SIGSTOP stops every thread
            // of this process; the command's status is collected once thawed.
            let stopped = std::process::Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
            tracing::warn!(
                ?stopped,
                "failpoint pause-before-commit: thawed, committing"
            );
        }
        _ => {}
    }
}

/// What ends an array: `max_records` records (a batch message counts its
/// records), a quarter of the memory budget in payload bytes (the array is
/// held whole while its documents, which the budget bounds, are written), or
/// `max_wait`.
fn array_bounds(settings: &WorkerSettings, max_wait: Duration) -> ArrayBounds {
    ArrayBounds {
        records: settings.max_records.get(),
        bytes: usize::try_from(settings.memory_budget_bytes / 4).unwrap_or(usize::MAX),
        wait: max_wait,
        weigh: |message| {
            records::record_count(
                &message.headers,
                message.payload.as_deref().unwrap_or_default(),
            )
        },
    }
}

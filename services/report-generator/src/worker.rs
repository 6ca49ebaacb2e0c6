//! The worker loop of DESIGN.md: pull an array, append each record to the
//! open document of its stream, complete documents at their cut markers, then
//! publish events, watermarks, this worker's own markers and the consumer
//! offsets in ONE Kafka transaction, with the group metadata.
//!
//! A `Worker` is one session: its Kafka clients, its S3 handle and what it
//! holds of its partitions. An error ends the session; the supervisor
//! (`supervisor.rs`) decides whether to build a new one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_config::{Settings, TopicNames, WorkerSettings};
use quire_messages::{
    CutMarker, DeadLetter, Definition, HEADER_KIND, HEADER_VERSION, MessageKind, ReportEvent,
    StreamName, Trigger,
};
use quire_messages::{layout, records};
use quire_queue::{
    Array, ArrayConsumer, ConsumerOptions, InMessage, OutMessage, ProducerOptions, QueueError,
    RebalanceEvent, Release, TopicSpec, TransactionalProducer,
};
use quire_s3::{S3Bucket, UploadPolicy};
use tokio_util::sync::CancellationToken;

use crate::WorkerError;
use crate::document::{Appended, DocumentWindow, OpenDocument, RecordInput};
use crate::metrics::{ArrayCommitted, OpenDocuments};
use crate::monitoring::Monitor;
use crate::partition::{DeadLetterMark, PartitionState};
use crate::stuck::StuckWatch;
use crate::topics::{TopicChange, TopicWatch};

mod moves;

/// How long a session's shutdown may spend aborting open documents and
/// closing its Kafka clients before it leaves the rest to the background:
/// the next session's take-over sweep aborts any upload left pending, and
/// its producer fences this one.
const SHUTDOWN_STEP_LIMIT: Duration = Duration::from_secs(30);

/// Room above `rollover_bytes` in a document's declared maximum for the one
/// record that reaches the rollover. A record renders to a few times its
/// JSON at most (escapes, encoded names), and the API bounds records at
/// `api.max_record_bytes` (900,000 by default).
const ONE_RECORD_ROOM: u64 = 16 * 1024 * 1024;

/// Room kept for what ends a document after its last record: the closing
/// summary element, and under gzip what the compressor still holds and its
/// trailer.
const CLOSING_ROOM: u64 = 1024 * 1024;

/// The most window markers one array's transaction publishes: a stream idle
/// for many windows gets its empty reports over several arrays.
const WINDOW_MARKERS_PER_ARRAY: usize = 200;

/// The worker's clock, in ms since the epoch: only for deciding when to
/// publish a window's marker, never written into a report.
fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

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

/// Everything the per-message code needs besides the partition's state.
struct Context {
    settings: WorkerSettings,
    topics: TopicNames,
    bucket: S3Bucket,
    policy: UploadPolicy,
    /// The most a document may hold before its closing summary: a record
    /// whose rendering would pass it starts the next document.
    record_limit: u64,
    /// The records log this session reads: its topic id (stamped on
    /// watermarks and manifests) and its tag (in report ids and keys).
    log: quire_log::LogIdentity,
}

/// The messages one array's transaction publishes.
#[derive(Default)]
struct Outbox {
    messages: Vec<OutMessage>,
    /// The trigger of each report completed in this array.
    reports: Vec<Trigger>,
    records: u64,
    dead_letters: u64,
    /// Release messages skipped (producers' control messages, no stream).
    released: u64,
    /// Window markers published.
    window_markers: u64,
    /// Move markers processed (a growth of the partition layout).
    moves: u64,
    /// The record partition each message (then each report) came from, in
    /// order: a transaction the group refused is carried to the next array
    /// without the partitions revoked meanwhile.
    sources: Sources,
    /// Where each record's fields are rendered from its text
    /// (`quire_xml::render_fields`), reused from record to record.
    fields: Vec<u8>,
    /// The dead-letter mark of the partition of the message being processed
    /// (`PartitionState::dead_letters`): a message at or below it had its
    /// dead letter published by an earlier read, so it gets none again.
    dead_letter_mark: DeadLetterMark,
    /// Whether the message being processed got a dead letter.
    dead_lettered: bool,
}

#[derive(Default)]
struct Sources {
    messages: Vec<i32>,
    reports: Vec<i32>,
}

impl Outbox {
    /// The messages and reports added since the last tag came from `partition`.
    fn tag_new(&mut self, partition: i32) {
        let untagged = self.messages.len() - self.sources.messages.len();
        self.sources
            .messages
            .extend(std::iter::repeat_n(partition, untagged));
        let untagged = self.reports.len() - self.sources.reports.len();
        self.sources
            .reports
            .extend(std::iter::repeat_n(partition, untagged));
    }

    /// The messages added since the last tag are the worker's markers (or
    /// watermarks): each comes from the record partition it is written to.
    fn tag_new_by_target(&mut self) {
        for message in &self.messages[self.sources.messages.len()..] {
            self.sources.messages.push(message.partition.unwrap_or(-1));
        }
    }

    /// Forgets what came from `partition`; how many messages that was.
    fn drop_partition(&mut self, partition: i32) -> usize {
        debug_assert_eq!(self.messages.len(), self.sources.messages.len());
        let before = self.messages.len();
        let mut sources = self.sources.messages.iter();
        self.messages.retain(|_| sources.next() != Some(&partition));
        self.sources.messages.retain(|source| *source != partition);
        let mut sources = self.sources.reports.iter();
        self.reports.retain(|_| sources.next() != Some(&partition));
        self.sources.reports.retain(|source| *source != partition);
        before - self.messages.len()
    }
}

/// A transaction the group refused, kept for the next array's.
struct Refused {
    outbox: Outbox,
    /// When the first of the refusals in a row happened.
    since: Instant,
}

/// Refused transactions are carried over for at least this long (and at
/// least `worker.session_timeout_ms`) before the session is restarted.
const REFUSED_CARRY_MIN: Duration = Duration::from_secs(10);

/// One session of the worker.
pub struct Worker {
    context: Context,
    kafka: quire_config::KafkaSettings,
    consumer: ArrayConsumer,
    producer: TransactionalProducer,
    partitions: BTreeMap<i32, PartitionState>,
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

/// What the worker's producer commits to release its partitions (see
/// [`Release`]): one message to every partition of the two topics whose
/// readers the worker itself depends on, the records topic (its cut
/// markers) and the watermarks (read to their end, once stable, when a
/// worker takes a partition). Both kinds are recognised by `quire-kind:
/// release` and skipped; the watermark one has a key no stream can have,
/// because a compacted topic refuses messages without a key.
fn release_messages(topics: &TopicNames, specs: &[TopicSpec]) -> Vec<OutMessage> {
    let partitions = |topic: &str| {
        specs
            .iter()
            .find(|spec| spec.name == topic)
            .map_or(0, |spec| spec.partitions)
    };
    (0..partitions(&topics.records))
        .map(|partition| on_topic(&topics.records, records::release(partition)))
        .chain(
            (0..partitions(&topics.watermarks))
                .map(|partition| on_topic(&topics.watermarks, records::keyed_release(partition))),
        )
        .collect()
}

/// A message of quire's format (`quire_messages::records`) on `topic`.
fn on_topic(topic: &str, message: records::LogMessage) -> OutMessage {
    OutMessage::from_parts(
        topic,
        message.key,
        message.payload,
        message.headers,
        message.partition,
    )
}

impl Worker {
    /// Checks the topics, connects the transactional producer (fencing an
    /// older instance of this replica, or this process's previous session)
    /// and joins the group.
    pub async fn build(settings: &Settings, monitor: &Monitor) -> Result<Self, WorkerError> {
        let worker = &settings.worker;
        if worker.replica_id.is_empty() {
            return Err(WorkerError::Config(
                "worker.replica_id must not be empty".into(),
            ));
        }
        if worker.max_poll_interval_ms < worker.session_timeout_ms {
            return Err(WorkerError::Config(format!(
                "worker.max_poll_interval_ms ({}) must be at least worker.session_timeout_ms ({})",
                worker.max_poll_interval_ms, worker.session_timeout_ms
            )));
        }
        let topics = settings.kafka.topics.clone();
        let specs = quire_queue::design_topics(&topics, 1, settings.kafka.partitions);
        quire_queue::check_topics(&settings.kafka, &specs).await?;
        let bucket = S3Bucket::new(
            quire_s3::build_client(&settings.s3).await,
            &settings.s3.bucket,
        )
        .with_counters(std::sync::Arc::clone(monitor.metrics.s3_counters()));
        let log = quire_log::identify(&settings.kafka, bucket.client(), bucket.name()).await?;
        let watermarks = quire_queue::describe_topic(&settings.kafka, &topics.watermarks).await?;
        let recorded = quire_log::read_layout(&settings.kafka, &topics.watermarks).await?;
        let layout = quire_log::resolve_layout(
            recorded,
            &log.records,
            watermarks.partitions,
            settings.kafka.partitions,
        )?;
        if layout.unrecorded {
            quire_log::record_layout(&settings.kafka, &topics.watermarks, &layout.layout).await?;
        }
        if log.records.partitions > watermarks.partitions {
            tracing::warn!(
                records = log.records.partitions,
                watermarks = watermarks.partitions,
                layout = layout.layout.partitions,
                "the records topic has more partitions than the watermark topic (an --alter?): the partitions past the watermark topic's are held, not served, until `report-generator partitions grow` grows both"
            );
        }
        let transactional_id = format!("{}-{}", worker.transactional_id_prefix, worker.replica_id);
        let released = std::sync::Arc::clone(&monitor.metrics);
        let producer = TransactionalProducer::connect_with(
            &settings.kafka,
            &transactional_id,
            ProducerOptions {
                send_timeout: None,
                commit_timeout: None,
                release: Some(Release {
                    messages: release_messages(&topics, &specs),
                    patience: Release::patience_for(&settings.kafka),
                    on_release: Some(std::sync::Arc::new(move || released.partitions_released())),
                }),
            },
        )
        .await?;
        let mut options = ConsumerOptions::new(&worker.group_id, &topics.records);
        options.group_instance_id = Some(worker.replica_id.clone());
        options.cooperative = true;
        options.statistics_interval = Some(Duration::from_millis(worker.statistics_interval_ms));
        options.session_timeout = Some(Duration::from_millis(worker.session_timeout_ms));
        options.commit_metadata = Some(quire_log::commit_metadata(&watermarks.id));
        options.max_poll_interval = Some(Duration::from_millis(worker.max_poll_interval_ms));
        let consumer = ArrayConsumer::new(&settings.kafka, &options)?;
        // Count and byte rollovers are decided inline, so a document ends at
        // the record that reaches rollover_bytes: the declared maximum is
        // that plus room for one record; a record that would not fit ends
        // the document before it (see `append_record`).
        let declared_maximum = worker
            .rollover_bytes
            .saturating_add(ONE_RECORD_ROOM)
            .min(quire_s3::MAXIMUM_OBJECT_SIZE);
        let record_limit = declared_maximum.saturating_sub(CLOSING_ROOM);
        let mut policy = UploadPolicy::for_max_object_size(declared_maximum);
        policy.max_in_flight = worker.parts_in_flight.max(1);
        let memory = crate::document::memory_pool(worker, &policy, monitor.metrics.s3_counters())?;
        tracing::info!(
            replica = %worker.replica_id,
            transactional_id,
            group = %worker.group_id,
            part_size = policy.part_size(),
            log = %log.records.id,
            records_partitions = log.records.partitions,
            log_tag = ?log.tag,
            layout_partitions = layout.layout.partitions,
            "report generator ready"
        );
        monitor.metrics.records_partitions(log.records.partitions);
        let topic_watch = TopicWatch::start(
            &settings.kafka,
            log.records.clone(),
            watermarks.clone(),
            Duration::from_millis(worker.topic_check_interval_ms),
        );
        Ok(Worker {
            context: Context {
                settings: worker.clone(),
                topics,
                bucket: bucket.with_memory(memory),
                policy,
                record_limit,
                log,
            },
            kafka: settings.kafka.clone(),
            consumer,
            producer,
            partitions: BTreeMap::new(),
            monitor: monitor.clone(),
            summary: RunSummary::default(),
            refused: None,
            stuck: StuckWatch::new(Duration::from_millis(settings.kafka.transaction_timeout_ms)),
            topic_watch,
            watermarks,
            unserved: std::collections::BTreeSet::new(),
        })
    }

    /// The documents open now, over every partition held.
    pub fn open_documents(&self) -> usize {
        self.partitions.values().map(|state| state.open.len()).sum()
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
        let settings = self.context.settings.clone();
        let max_wait = Duration::from_millis(settings.max_wait_ms);
        let mut draining = false;
        while !stop.is_cancelled() {
            self.monitor.health.turned();
            self.apply_topic_changes().await?;
            let array = self
                .consumer
                .next_array(settings.max_records, max_wait)
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
                self.process(message, &mut outbox).await?;
                outbox.tag_new(message.partition);
            }
            self.decide_timed_rollovers(&mut outbox);
            self.publish_window_markers(&mut outbox);
            outbox.tag_new_by_target();
            if mode == Mode::Drain && array.caught_up && array.len() < settings.max_records {
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
                    self.carry_refused(outbox, refused_since, error)?;
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
            .flat_map(|state| state.open.values())
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

    /// Ends the session: aborts the open documents (the next owner, or the
    /// next session, renders them again from the last committed offsets) and
    /// closes the Kafka clients on the blocking pool, each step bounded so a
    /// broker or S3 server that is away cannot hold the worker.
    pub async fn shut_down(mut self) {
        let open: Vec<OpenDocument> = std::mem::take(&mut self.partitions)
            .into_values()
            .flat_map(|state| state.open.into_values())
            .collect();
        if !open.is_empty() {
            let count = open.len();
            let aborts = futures::future::join_all(open.into_iter().map(OpenDocument::abort));
            if tokio::time::timeout(SHUTDOWN_STEP_LIMIT, aborts)
                .await
                .is_err()
            {
                tracing::warn!(
                    documents = count,
                    "aborting open documents took too long; the take-over sweep will finish it"
                );
            }
        }
        self.monitor.metrics.no_partitions();
        let Worker {
            consumer, producer, ..
        } = self;
        // Closing a consumer waits for the group; dropping a producer purges
        // and flushes: both block, so neither runs on an async worker thread.
        let close = tokio::task::spawn_blocking(move || {
            drop(consumer);
            drop(producer);
        });
        match tokio::time::timeout(SHUTDOWN_STEP_LIMIT, close).await {
            Ok(Ok(())) => tracing::debug!("kafka clients closed"),
            Ok(Err(error)) => tracing::warn!(error = %error, "closing the kafka clients failed"),
            Err(_) => tracing::warn!(
                limit_ms = SHUTDOWN_STEP_LIMIT.as_millis() as u64,
                "closing the kafka clients takes too long; left to finish in the background"
            ),
        }
    }

    fn nothing_open(&self) -> bool {
        self.partitions.values().all(|state| state.open.is_empty())
    }

    /// Applies a read's rebalance events in order, then takes over the
    /// partitions still assigned once all of them are applied: a partition
    /// assigned and revoked again within one read is not swept (its pending
    /// uploads belong to its live owner by then).
    async fn handle_rebalances(&mut self, events: &[RebalanceEvent]) -> Result<(), WorkerError> {
        for event in events {
            self.monitor
                .metrics
                .rebalanced(matches!(event, RebalanceEvent::Assigned(_)));
            let RebalanceEvent::Revoked { partitions, lost } = event else {
                continue;
            };
            for partition in partitions {
                if let Some(refused) = &mut self.refused {
                    let dropped = refused.outbox.drop_partition(*partition);
                    if dropped > 0 {
                        tracing::info!(
                            partition,
                            messages = dropped,
                            "partition revoked: its messages leave the refused transaction"
                        );
                    }
                }
                self.unserved.remove(partition);
                if let Some(state) = self.partitions.remove(partition) {
                    tracing::info!(
                        partition,
                        lost,
                        open = state.open.len(),
                        "partition revoked: aborting its open documents"
                    );
                    for (_, document) in state.open {
                        document.abort().await;
                    }
                }
            }
        }
        self.take_partitions(&still_assigned_after(events)).await
    }

    /// What the topic watch saw: a recreated topic ends the session; a grown
    /// watermark topic lets the held record partitions be served, from
    /// their commit points; a grown records topic is said.
    async fn apply_topic_changes(&mut self) -> Result<(), WorkerError> {
        for change in self.topic_watch.take_changes() {
            match change {
                TopicChange::Recreated(why) => return Err(WorkerError::LogChanged(why)),
                TopicChange::RecordsGrew(partitions) => {
                    self.monitor.metrics.records_partitions(partitions);
                    tracing::warn!(
                        partitions,
                        watermark_partitions = self.watermarks.partitions,
                        "the records topic grew; the partitions past the watermark topic's are held, not served, and nothing is routed to them until `report-generator partitions grow` switches the layout"
                    );
                }
                TopicChange::WatermarksGrew(partitions) => {
                    self.watermarks.partitions = partitions;
                    let servable: Vec<i32> = self
                        .unserved
                        .iter()
                        .copied()
                        .filter(|&partition| partition < partitions)
                        .collect();
                    tracing::info!(
                        partitions,
                        serving = ?servable,
                        "the watermark topic grew: the held record partitions it now covers are served"
                    );
                    if servable.is_empty() {
                        continue;
                    }
                    self.consumer.resume_from_commit_points(&servable)?;
                    for partition in &servable {
                        self.unserved.remove(partition);
                    }
                    self.take_partitions(&servable).await?;
                }
            }
        }
        Ok(())
    }

    /// A new owner: load the partitions' watermarks (after any open
    /// transaction there ended), then abort the uploads a dead owner left on
    /// their keys. All the partitions of one assignment together.
    async fn take_partitions(&mut self, partitions: &[i32]) -> Result<(), WorkerError> {
        // A record partition without its watermark partition (the records
        // topic grown alone) cannot be served: held, paused, never
        // committed past, until the watermark topic grows (which ends the
        // session) or the partition goes to another member.
        let (partitions, unservable): (Vec<i32>, Vec<i32>) = partitions
            .iter()
            .partition(|&&partition| partition < self.watermarks.partitions);
        if !unservable.is_empty() {
            self.consumer.hold(&unservable)?;
            self.unserved.extend(unservable.iter().copied());
            tracing::warn!(
                partitions = ?unservable,
                watermark_partitions = self.watermarks.partitions,
                "assigned record partitions without a watermark partition are held, not served (the records topic was grown alone; `report-generator partitions grow` grows both)"
            );
        }
        self.monitor
            .metrics
            .unserved_partitions(self.unserved.len());
        let partitions = partitions.as_slice();
        if partitions.is_empty() {
            return Ok(());
        }
        for &partition in partitions {
            let committed_with = self.consumer.committed_metadata(partition);
            if let Some(watermarks) = committed_with
                .as_deref()
                .and_then(quire_log::committed_watermarks)
                && watermarks != self.watermarks.id
            {
                self.monitor.metrics.watermarks_lost();
                tracing::warn!(
                    partition,
                    committed_with = watermarks,
                    now = %self.watermarks.id,
                    "the watermark topic was deleted and created again since this partition was last committed: its watermarks are lost, so every report completed after the committed offset is rendered again (same keys, same bytes) and its report.completed event published again; consumers de-duplicate events by report_id"
                );
            }
        }
        let kafka = self.kafka.clone();
        let topic = self.context.topics.watermarks.clone();
        let wanted = partitions.to_vec();
        let log = self.context.log.clone();
        let (mut watermarks, stale) = tokio::task::spawn_blocking(move || {
            crate::watermarks::load(&kafka, &topic, &wanted, &log)
        })
        .await??;
        if stale > 0 {
            self.monitor.metrics.stale_watermarks(stale);
        }
        let aborted = self
            .context
            .bucket
            .abort_pending_uploads_where(layout::REPORTS_PREFIX, |key| {
                partitions
                    .iter()
                    .any(|&partition| layout::report_key_belongs_to(key, partition))
            })
            .await?;
        for &partition in partitions {
            let loaded = watermarks.remove(&partition).unwrap_or_default();
            tracing::debug!(partition, streams = loaded.streams.len(), "partition taken");
            self.partitions.insert(
                partition,
                PartitionState::from_watermarks(
                    partition,
                    loaded.streams,
                    Arc::from(self.context.log.records.id.as_str()),
                )
                .with_dead_letters_through(loaded.dead_letters_through),
            );
        }
        tracing::info!(partitions = ?partitions, orphaned_uploads_aborted = aborted, "assignment taken");
        Ok(())
    }

    async fn process(
        &mut self,
        message: &InMessage,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let Some(state) = self.partitions.get_mut(&message.partition) else {
            // Cannot happen: arrays hold only assigned partitions' messages.
            tracing::warn!(
                partition = message.partition,
                "message of a partition not held; skipped"
            );
            return Ok(());
        };
        state.observe_time(message.timestamp_ms);
        outbox.dead_letter_mark = state.dead_letters;
        outbox.dead_lettered = false;
        let result = match close_ended_windows(&self.context, state, outbox).await {
            Ok(()) => process_message(&self.context, state, message, outbox).await,
            Err(error) => Err(error),
        };
        if outbox.dead_lettered {
            state.dead_letters.published(message.offset);
        }
        state.mark_read(message.offset);
        result
    }

    /// Age rollover (on a timer: every array, even an empty one) and the
    /// memory budget for all open documents together. The budget itself is
    /// kept by the writers' pool (buffers grow within it and spill past
    /// it); these cuts bound what is held, memory and spill together, so the
    /// spill drains once the markers land. Gzip documents past
    /// `worker.max_gzip_documents` are cut the same way.
    fn decide_timed_rollovers(&mut self, outbox: &mut Outbox) {
        let settings = &self.context.settings;
        // Gzip compressors past worker.max_gzip_documents (they cannot spill).
        let open = self
            .partitions
            .values()
            .flat_map(|state| state.open.values());
        for (partition, stream) in
            crate::document::gzip_documents_to_cut(open, settings.max_gzip_documents)
        {
            if let Some(document) = self
                .partitions
                .get_mut(&partition)
                .and_then(|state| state.open.get_mut(&stream))
            {
                tracing::info!(partition, %stream, max_gzip_documents = settings.max_gzip_documents, "gzip documents past their bound: cutting");
                request_cut(&self.context.topics, document, Trigger::Memory, outbox);
            }
        }
        let max_age = Duration::from_millis(settings.rollover_age_ms);
        let mut buffered: Vec<(u64, i32, StreamName)> = Vec::new();
        for state in self.partitions.values_mut() {
            for document in state.open.values_mut() {
                if document.opened_at.elapsed() >= max_age {
                    request_cut(&self.context.topics, document, Trigger::Age, outbox);
                }
                if document.cut_requested.is_none() {
                    buffered.push((
                        document.buffered_bytes(),
                        document.partition,
                        document.stream.clone(),
                    ));
                }
            }
        }
        let mut total: u64 = self
            .partitions
            .values()
            .flat_map(|state| state.open.values())
            .map(|document| document.buffered_bytes())
            .sum();
        if total <= settings.memory_budget_bytes {
            return;
        }
        // Cut the largest documents until the rest fits in half the budget,
        // so the worker does not cut again at the next array.
        buffered.sort_by_key(|(bytes, _, _)| std::cmp::Reverse(*bytes));
        for (bytes, partition, stream) in buffered {
            if total <= settings.memory_budget_bytes / 2 {
                break;
            }
            if let Some(document) = self
                .partitions
                .get_mut(&partition)
                .and_then(|state| state.open.get_mut(&stream))
            {
                tracing::info!(partition, %stream, bytes, "memory budget reached: cutting");
                request_cut(&self.context.topics, document, Trigger::Memory, outbox);
                total = total.saturating_sub(bytes);
            }
        }
    }

    /// Publishes the markers of windows that a worker's clock says ended
    /// more than their grace ago and that no message of the log closed:
    /// the open document's window, and (unless the definition skips empty
    /// windows) each window of the stream without documents, so an idle
    /// stream is still reported. Each marker once, until read back; at most
    /// [`WINDOW_MARKERS_PER_ARRAY`] in one transaction.
    fn publish_window_markers(&mut self, outbox: &mut Outbox) {
        let now = wall_clock_ms();
        let mut budget = WINDOW_MARKERS_PER_ARRAY;
        for state in self.partitions.values_mut() {
            let partition = state.partition;
            for (stream, stream_state) in &mut state.streams {
                let Some(progress) = &mut stream_state.window else {
                    continue;
                };
                let grace = progress.schedule.grace_ms();
                let open = state
                    .open
                    .get(stream)
                    .and_then(|document| document.window.as_ref())
                    .map(|window| window.window);
                let mut due = Vec::new();
                if let Some(window) = open
                    && window.end_ms.saturating_add(grace) <= now
                {
                    due.push(window);
                }
                if !progress.schedule.skip_empty() {
                    let mut window = progress.schedule.window_of(progress.progress.next_ms);
                    let mut looked = 0;
                    while window.end_ms.saturating_add(grace) <= now
                        && looked < WINDOW_MARKERS_PER_ARRAY
                    {
                        if Some(window) != open && !progress.reported(window) {
                            due.push(window);
                        }
                        window = progress.schedule.next(window);
                        looked += 1;
                    }
                }
                for window in due {
                    if budget == 0 {
                        return;
                    }
                    if !progress.requested.insert(window.start_ms) {
                        continue;
                    }
                    budget -= 1;
                    outbox.window_markers += 1;
                    let marker = records::cut(stream, &CutMarker::window(window));
                    outbox.messages.push(
                        on_topic(&self.context.topics.records, marker).to_partition(partition),
                    );
                }
            }
        }
    }

    fn cut_everything_open(&mut self, outbox: &mut Outbox) {
        for state in self.partitions.values_mut() {
            for document in state.open.values_mut() {
                request_cut(&self.context.topics, document, Trigger::Drain, outbox);
            }
        }
    }

    /// A transaction the group refused because its generation moved (a
    /// rebalance completed without this member, or it was timed out or
    /// fenced): nothing of it is visible. Instead of ending the session and
    /// rendering every open document of every partition again, its messages
    /// are kept for the next array's transaction, which applies the
    /// rebalance first: what came from revoked partitions is dropped with
    /// them, the rest is committed with the next array, under the new
    /// generation. Bounded: refused for longer than the session timeout (the
    /// group's own bound on an unresponsive member), the session ends.
    fn carry_refused(
        &mut self,
        outbox: Outbox,
        refused_since: Option<Instant>,
        error: quire_queue::KafkaError,
    ) -> Result<(), WorkerError> {
        let since = refused_since.unwrap_or_else(Instant::now);
        let limit =
            Duration::from_millis(self.context.settings.session_timeout_ms).max(REFUSED_CARRY_MIN);
        if since.elapsed() > limit {
            tracing::warn!(
                refused_for_ms = since.elapsed().as_millis() as u64,
                "transactions refused by the group for too long; restarting the session"
            );
            return Err(WorkerError::Queue(QueueError::GroupRefused(error)));
        }
        tracing::warn!(
            error = %error,
            messages = outbox.messages.len(),
            "transaction refused by the group; committing what is still owned with the next array"
        );
        self.refused = Some(Refused { outbox, since });
        Ok(())
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
        for (&partition, state) in &mut self.partitions {
            let Some(safe) = state.safe_offset() else {
                continue;
            };
            moved |= state.committed != Some(safe);
            offsets.insert(partition, safe);
            if let Some(moved) = state.take_moved() {
                outbox.messages.push(on_topic(
                    &self.context.topics.watermarks,
                    records::moved(partition, &moved),
                ));
            }
            for (stream, watermark) in state.watermarks_to_write(safe) {
                outbox.messages.push(
                    OutMessage::new(
                        &self.context.topics.watermarks,
                        Some(stream.as_str().as_bytes().to_vec()),
                        quire_messages::encode(&watermark),
                    )
                    .to_partition(partition),
                );
            }
            if let Some(through) = state.dead_letters.take_unwritten() {
                let mark = records::dead_letter_mark(partition, through, state.log());
                outbox
                    .messages
                    .push(on_topic(&self.context.topics.watermarks, mark));
            }
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
            if let Some(state) = self.partitions.get_mut(partition) {
                state.committed = Some(*offset);
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

/// One message of `quire.records`: a record, a cut marker or a definition.
async fn process_message(
    context: &Context,
    state: &mut PartitionState,
    message: &InMessage,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let kind = records::kind_of(message.header(HEADER_KIND));
    let stream = message
        .key
        .as_deref()
        .and_then(|key| std::str::from_utf8(key).ok())
        .map(StreamName::new);
    let stream = match (kind, stream) {
        // A producer releasing its partitions after a broker crash: no
        // stream, nothing to render.
        (Some(MessageKind::Release), _) => {
            outbox.released += 1;
            return Ok(());
        }
        // A growth of the partition layout: partition-wide, no stream.
        (Some(MessageKind::Move), _) => {
            return moves::partition_move(context, state, message, outbox).await;
        }
        (None, _) => {
            return dead_letter(
                context,
                message,
                "missing or unknown quire-kind header",
                outbox,
            );
        }
        (Some(_), None) => {
            return dead_letter(
                context,
                message,
                "message has no UTF-8 key (stream name)",
                outbox,
            );
        }
        (Some(_), Some(Err(error))) => {
            return dead_letter(
                context,
                message,
                &format!("invalid stream name: {error}"),
                outbox,
            );
        }
        (Some(_), Some(Ok(stream))) => stream,
    };
    let payload = message.payload.as_deref().unwrap_or_default();
    match kind.expect("checked above") {
        MessageKind::Release | MessageKind::Move => unreachable!("handled above"),
        MessageKind::Handover => {
            return moves::handover(context, state, &stream, message, outbox);
        }
        MessageKind::Definition => {
            match quire_messages::decode::<Definition>("definition", payload)
                .map_err(|error| error.to_string())
                .and_then(|definition| {
                    definition
                        .validate()
                        .map(|()| definition)
                        .map_err(|error| error.to_string())
                }) {
                // Definitions apply even below the watermark: they shape the
                // documents that open after it.
                Ok(definition) => state.change_definition(&stream, message.offset, definition),
                Err(reason) => {
                    return dead_letter(
                        context,
                        message,
                        &format!("invalid definition: {reason}"),
                        outbox,
                    );
                }
            }
        }
        MessageKind::Record => {
            if state.already_reported(&stream, message.offset) {
                return Ok(());
            }
            if let Some(reason) = records::unreadable_version(message.header(HEADER_VERSION)) {
                // Refused by name, never misread as the version we know.
                return dead_letter(context, message, &reason, outbox);
            }
            // Nearly every record renders straight from its text; the rest
            // are parsed first, which renders them or says why not.
            let mut fields = std::mem::take(&mut outbox.fields);
            fields.clear();
            let appended = if quire_xml::render_fields(&mut fields, payload) {
                let record = RecordInput::Rendered {
                    text: payload,
                    fields: &fields,
                };
                append_record(context, state, &stream, message, record, outbox).await
            } else {
                let record: serde_json::Value = match serde_json::from_slice(payload) {
                    Ok(record) => record,
                    Err(error) => {
                        outbox.fields = fields;
                        return dead_letter(
                            context,
                            message,
                            &format!("record is not JSON: {error}"),
                            outbox,
                        );
                    }
                };
                let record = RecordInput::Parsed(&record);
                append_record(context, state, &stream, message, record, outbox).await
            };
            outbox.fields = fields;
            appended?;
        }
        MessageKind::Cut => {
            if state.already_reported(&stream, message.offset) {
                return Ok(());
            }
            let marker = match quire_messages::decode::<CutMarker>("cut marker", payload) {
                Ok(marker) => marker,
                Err(error) => {
                    return dead_letter(
                        context,
                        message,
                        &format!("invalid cut marker: {error}"),
                        outbox,
                    );
                }
            };
            if let Some(window) = marker.window {
                return window_marker(context, state, &stream, message, window, outbox).await;
            }
            let open_first_offset = state
                .open
                .get(&stream)
                .map(|document| document.first_offset);
            if let Some(named) = marker.document
                && open_first_offset != Some(named)
            {
                // A rollover marker for a document that was already cut (by
                // another marker, or another owner's same decision).
                tracing::debug!(%stream, offset = message.offset, named, "stale rollover marker ignored");
                return Ok(());
            }
            let document = match state.open.remove(&stream) {
                Some(document) => document,
                // A cut with nothing new: an empty report, keyed by the marker.
                None => {
                    open_document(
                        context,
                        state,
                        &stream,
                        message.offset,
                        message.timestamp_ms,
                    )
                    .await?
                }
            };
            complete_document(
                context,
                state,
                document,
                message.offset,
                message.timestamp_ms,
                marker.trigger,
                outbox,
            )
            .await?;
        }
    }
    Ok(())
}

/// Appends a record to its stream's document (opening one if none is open)
/// and applies the inline limits, which depend only on the log's content:
///
/// - a record whose rendering would take the document past the writer's
///   declared maximum ends the document *before* it (at the stream's
///   previous record) and opens the next one with it;
/// - the record that brings the document to `rollover_records` or
///   `rollover_bytes` ends it *at* that record, with no marker.
///
/// Replays see the same records, under the same definition, from the same
/// first offset, so they cut at the same records. A document whose marker
/// (age, memory, drain) is still in flight obeys the same limits; the marker
/// then names a document that is no longer open and is ignored.
async fn append_record(
    context: &Context,
    state: &mut PartitionState,
    stream: &StreamName,
    message: &InMessage,
    record: RecordInput<'_>,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let limit = context.record_limit;
    loop {
        if !state.open.contains_key(stream) {
            let document =
                open_document(context, state, stream, message.offset, message.timestamp_ms).await?;
            if let Some(window) = &document.window {
                state
                    .window_ends
                    .insert((window.window.end_ms, stream.clone()));
            }
            state.open.insert(stream.clone(), document);
        }
        let document = state.open.get_mut(stream).expect("opened above");
        match document
            .append(record, message.offset, message.timestamp_ms, limit)
            .await?
        {
            Appended::Done => break,
            Appended::Unrenderable(error) => {
                return dead_letter(
                    context,
                    message,
                    &format!("record cannot be rendered: {error}"),
                    outbox,
                );
            }
            Appended::TooLarge { rendered } if document.records == 0 => {
                // Even alone in a document it would pass the maximum.
                if let Some(document) = state.open.remove(stream) {
                    document.abort().await;
                }
                return dead_letter(
                    context,
                    message,
                    &format!(
                        "record renders to {rendered} bytes, more than a report may hold ({limit} bytes)"
                    ),
                    outbox,
                );
            }
            Appended::TooLarge { .. } => {
                let last = document
                    .last_record_offset
                    .expect("a document that was not opened for this record holds records");
                let document = state.open.remove(stream).expect("open");
                complete_inline(context, state, document, last, Trigger::Bytes, outbox).await?;
            }
        }
    }
    outbox.records += 1;
    let document = state.open.get(stream).expect("appended above");
    let trigger = if document.records >= context.settings.rollover_records {
        Some(Trigger::Records)
    } else if document.bytes() >= context.settings.rollover_bytes {
        Some(Trigger::Bytes)
    } else {
        None
    };
    if let Some(trigger) = trigger {
        let document = state.open.remove(stream).expect("open");
        complete_inline(context, state, document, message.offset, trigger, outbox).await?;
    }
    Ok(())
}

/// Ends `document` at its record at `last_offset` (a rollover decided from
/// the log, no marker): the report's id names that record.
async fn complete_inline(
    context: &Context,
    state: &mut PartitionState,
    document: OpenDocument,
    last_offset: i64,
    trigger: Trigger,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let cut_time_ms = document.last_record_time_ms;
    complete_document(
        context,
        state,
        document,
        last_offset,
        cut_time_ms,
        trigger,
        outbox,
    )
    .await
}

/// Completes `document` as the report ending at `last_offset` (its marker,
/// or its last record for an inline rollover), queues its event, and moves
/// the stream's watermark there.
async fn complete_document(
    context: &Context,
    state: &mut PartitionState,
    document: OpenDocument,
    last_offset: i64,
    cut_time_ms: Option<i64>,
    trigger: Trigger,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let stream = document.stream.clone();
    let window = document.window.as_ref().map(|window| window.window);
    let report_id = context
        .log
        .report_id(stream.clone(), state.partition, last_offset);
    let manifest = document
        .complete(
            &context.bucket,
            &report_id,
            cut_time_ms,
            trigger,
            &context.log.records.id,
        )
        .await?;
    tracing::info!(report = %report_id, records = manifest.records, bytes = manifest.bytes, trigger = ?trigger, "report completed");
    let event = ReportEvent::completed(&manifest);
    outbox.messages.push(OutMessage::new(
        &context.topics.report_events,
        Some(stream.as_str().as_bytes().to_vec()),
        quire_messages::encode(&event),
    ));
    outbox.reports.push(trigger);
    state.report_completed(&stream, last_offset);
    if let Some(window) = window {
        state.window_document_completed(&stream, window);
        state.settle_windows(&stream);
    }
    Ok(())
}

/// Opens `stream`'s document at `first_offset` with the definition in force
/// now: its key and its rendering are fixed from here on.
///
/// A windowed stream's document belongs to the window of its first
/// message's log time (never one before the windows already done or
/// started), and is its window's next document in sequence. Its key, under a
/// key template, takes its date and hour from the window's start in the
/// window's zone, or from the first message's log time in UTC.
async fn open_document(
    context: &Context,
    state: &mut PartitionState,
    stream: &StreamName,
    first_offset: i64,
    time_ms: Option<i64>,
) -> Result<OpenDocument, WorkerError> {
    let definition = state.stream(stream).definition.clone();
    let time_ms = time_ms.unwrap_or_default();
    let mut hour = quire_messages::window::utc_civil_hour(time_ms);
    let mut window = None;
    if let Some(spec) = &definition.window {
        let (schedule, floor, documents) = match state.window_progress(stream, &definition, time_ms)
        {
            Some(progress) => {
                let floor = progress.floor_ms();
                let window = progress.schedule.window_of(time_ms.max(floor));
                (
                    Arc::clone(&progress.schedule),
                    floor,
                    progress.documents_in(window),
                )
            }
            // A message from before a definition change, read again by a
            // replay: its own schedule, outside the progress kept.
            None => match spec.schedule() {
                Ok(schedule) => (Arc::new(schedule), i64::MIN, 0),
                Err(error) => {
                    return Err(WorkerError::Config(format!(
                        "stream {stream}: a definition in the log has an invalid window: {error}"
                    )));
                }
            },
        };
        let of = schedule.window_of(time_ms.max(floor));
        hour = schedule.civil_hour(of.start_ms);
        window = Some(DocumentWindow {
            window: of,
            sequence: documents + 1,
            start: schedule.format(of.start_ms),
            end: schedule.format(of.end_ms),
        });
    }
    let key = layout::document_key(
        stream,
        state.partition,
        first_offset,
        &definition,
        hour,
        context.log.tag.as_ref(),
    );
    OpenDocument::open(
        &context.bucket,
        &context.policy,
        stream,
        state.partition,
        first_offset,
        &definition,
        key,
        window,
    )
    .await
}

/// Completes, at their last record, the windowed documents of the partition
/// whose window ended by the partition's log time: a document ends at the
/// first message of its partition at or past its window's end, whatever
/// stream that message is of. Decided from the log alone, so every replay
/// cuts at the same record.
async fn close_ended_windows(
    context: &Context,
    state: &mut PartitionState,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    let Some(now) = state.time_ms else {
        return Ok(());
    };
    while let Some((end, _)) = state.window_ends.first()
        && *end <= now
    {
        let (end, stream) = state.window_ends.pop_first().expect("first exists");
        let ended = state
            .open
            .get(&stream)
            .and_then(|document| document.window.as_ref())
            .is_some_and(|window| window.window.end_ms == end);
        if !ended {
            continue;
        }
        let document = state.open.remove(&stream).expect("checked above");
        // A document opened by a record that went to the dead letters holds
        // none: it ends where it began.
        let last = document.last_record_offset.unwrap_or(document.first_offset);
        complete_inline(context, state, document, last, Trigger::Window, outbox).await?;
    }
    Ok(())
}

/// A marker closing `window` of `stream` (published by a worker once its
/// clock passed the window's end plus grace). Every document whose window
/// ended is already completed by then (the marker's log time is past the
/// end); what is left is a window without documents: it gets its empty
/// report here, keyed by the marker, unless the definition skips empty
/// windows. A marker for a window already done or reported (another
/// owner's, or a replay's) is ignored.
async fn window_marker(
    context: &Context,
    state: &mut PartitionState,
    stream: &StreamName,
    message: &InMessage,
    window: quire_messages::window::Window,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    state.settle_windows(stream);
    let time_ms = message.timestamp_ms.unwrap_or_default();
    let Some(progress) = state.stream(stream).window.as_mut() else {
        tracing::debug!(%stream, offset = message.offset, "window marker of a stream without windows ignored");
        return Ok(());
    };
    progress.requested.remove(&window.start_ms);
    if progress.schedule.window_of(window.start_ms) != window {
        tracing::debug!(%stream, offset = message.offset, "window marker of another schedule ignored");
        return Ok(());
    }
    if progress.reported(window) || progress.schedule.skip_empty() {
        return Ok(());
    }
    if time_ms < window.end_ms {
        // The broker's clock is behind the worker's by more than the
        // grace: records of the window may still come after this marker.
        tracing::warn!(
            %stream,
            offset = message.offset,
            window_end_ms = window.end_ms,
            log_time_ms = time_ms,
            "window marker landed before its window ended by log time; ignored (another is published later)"
        );
        return Ok(());
    }
    let schedule = Arc::clone(&progress.schedule);
    let documents = progress.documents_in(window);
    let definition = state.stream(stream).definition.clone();
    let key = layout::document_key(
        stream,
        state.partition,
        message.offset,
        &definition,
        schedule.civil_hour(window.start_ms),
        context.log.tag.as_ref(),
    );
    let document = OpenDocument::open(
        &context.bucket,
        &context.policy,
        stream,
        state.partition,
        message.offset,
        &definition,
        key,
        Some(DocumentWindow {
            window,
            sequence: documents + 1,
            start: schedule.format(window.start_ms),
            end: schedule.format(window.end_ms),
        }),
    )
    .await?;
    complete_document(
        context,
        state,
        document,
        message.offset,
        message.timestamp_ms,
        Trigger::Window,
        outbox,
    )
    .await
}

/// The partitions assigned by `events` (in order) that no later event of
/// them revoked: the ones a read leaves this worker to take over.
fn still_assigned_after(events: &[RebalanceEvent]) -> Vec<i32> {
    let mut assigned = std::collections::BTreeSet::new();
    for event in events {
        match event {
            RebalanceEvent::Assigned(partitions) => assigned.extend(partitions.iter().copied()),
            RebalanceEvent::Revoked { partitions, .. } => {
                for partition in partitions {
                    assigned.remove(partition);
                }
            }
        }
    }
    assigned.into_iter().collect()
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

/// Publishes, in this array's transaction, a marker that cuts `document`
/// where it lands (once per document).
fn request_cut(
    topics: &TopicNames,
    document: &mut OpenDocument,
    trigger: Trigger,
    outbox: &mut Outbox,
) {
    if document.cut_requested.is_some() {
        return;
    }
    document.cut_requested = Some(trigger);
    let marker = records::cut(
        &document.stream,
        &CutMarker::rollover(trigger, document.first_offset),
    );
    outbox
        .messages
        .push(on_topic(&topics.records, marker).to_partition(document.partition));
}

/// Publishes, in this array's transaction, the dead letter of a message
/// that cannot be rendered, unless an earlier read of the partition
/// published it already (the partition's dead-letter mark covers it): one
/// dead letter per (partition, offset), whatever the restarts.
fn dead_letter(
    context: &Context,
    message: &InMessage,
    reason: &str,
    outbox: &mut Outbox,
) -> Result<(), WorkerError> {
    if outbox.dead_letter_mark.covers(message.offset) {
        tracing::debug!(
            partition = message.partition,
            offset = message.offset,
            "dead letter already published by an earlier read; not again"
        );
        return Ok(());
    }
    tracing::warn!(
        partition = message.partition,
        offset = message.offset,
        reason,
        "record sent to the dead-letter topic"
    );
    let stream = message
        .key
        .as_deref()
        .map(|key| String::from_utf8_lossy(key).into_owned())
        .unwrap_or_default();
    let letter = DeadLetter::new(
        stream,
        message.partition,
        message.offset,
        reason.to_owned(),
        message.payload.as_deref().unwrap_or_default(),
    );
    outbox.messages.push(OutMessage::new(
        &context.topics.dead_letters,
        Some(DeadLetter::key(message.partition, message.offset).into_bytes()),
        quire_messages::encode(&letter),
    ));
    outbox.dead_letters += 1;
    outbox.dead_lettered = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_outbox_forgets_what_a_revoked_partition_put_in_it() {
        let message = |partition: Option<i32>| {
            let message = OutMessage::new("t", None, b"m".to_vec());
            match partition {
                Some(partition) => message.to_partition(partition),
                None => message,
            }
        };
        let mut outbox = Outbox::default();
        // An event and a report from partition 1, one from partition 2.
        outbox.messages.push(message(None));
        outbox.reports.push(Trigger::Records);
        outbox.tag_new(1);
        outbox.messages.push(message(None));
        outbox.reports.push(Trigger::Age);
        outbox.tag_new(2);
        // A worker's marker and a watermark, written to the partition they
        // come from.
        outbox.messages.push(message(Some(2)));
        outbox.messages.push(message(Some(1)));
        outbox.tag_new_by_target();
        assert_eq!(outbox.drop_partition(1), 2);
        assert_eq!(outbox.messages.len(), 2);
        assert_eq!(outbox.reports, [Trigger::Age]);
        assert_eq!(outbox.sources.messages, [2, 2]);
        assert_eq!(
            outbox.drop_partition(3),
            0,
            "nothing of an unknown partition"
        );
    }

    #[test]
    fn only_partitions_still_assigned_after_every_event_of_a_read_are_taken() {
        let assigned = |partitions: &[i32]| RebalanceEvent::Assigned(partitions.to_vec());
        let revoked = |partitions: &[i32]| RebalanceEvent::Revoked {
            partitions: partitions.to_vec(),
            lost: false,
        };
        assert_eq!(still_assigned_after(&[assigned(&[1, 2])]), [1, 2]);
        assert_eq!(
            still_assigned_after(&[assigned(&[1, 2]), revoked(&[1])]),
            [2],
            "assigned then revoked in one read: not swept"
        );
        assert_eq!(
            still_assigned_after(&[revoked(&[3]), assigned(&[3])]),
            [3],
            "revoked then given back: taken again"
        );
        assert!(still_assigned_after(&[revoked(&[4])]).is_empty());
    }
}

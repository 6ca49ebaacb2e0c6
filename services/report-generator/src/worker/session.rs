//! A session's life outside the loop: building its clients, taking and
//! giving back partitions (rebalances, a grown watermark topic), and ending.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use quire_config::{Settings, TopicNames};
use quire_messages::{layout, records, watermarks};
use quire_queue::{
    ArrayConsumer, ConsumerOptions, OutMessage, ProducerOptions, RebalanceEvent, Release,
    TopicSpec, TransactionalProducer,
};
use quire_s3::{S3Bucket, UploadPolicy};

use super::outbox::on_topic;
use super::{RunSummary, Worker};
use crate::WorkerError;
use crate::decide::CutLimits;
use crate::document::{OpenDocument, S3Documents};
use crate::monitoring::Monitor;
use crate::pipeline::{Context, PartitionPipeline};
use crate::stuck::StuckWatch;
use crate::topics::{TopicChange, TopicWatch};

/// How long a session's shutdown may spend aborting open documents and
/// closing its Kafka clients before it leaves the rest to the background:
/// the next session's take-over sweep aborts any upload left pending, and
/// its producer fences this one.
const SHUTDOWN_STEP_LIMIT: Duration = Duration::from_secs(30);

/// Room above `rollover_bytes` in a document's declared maximum for the one
/// message (a record, or a batch of them: a document never ends inside a
/// batch) that reaches the rollover. A record renders to a few times its
/// JSON (escapes, names repeated for each element of an array), and the API
/// bounds batches at `api.batch_max_bytes` (at most 4 MiB, 256 KiB by
/// default) and records at `api.max_record_bytes`. The room costs nothing
/// below the largest objects: it only sizes the parts of a document whose
/// declared maximum passes 10,000 minimum parts (about 48 GiB).
const ONE_BATCH_ROOM: u64 = 64 * 1024 * 1024;

/// Room kept for what ends a document after its last record: the closing
/// summary element, and under gzip what the compressor still holds and its
/// trailer.
const CLOSING_ROOM: u64 = 1024 * 1024;

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
            (0..partitions(&topics.watermarks)).map(|partition| {
                on_topic(&topics.watermarks, watermarks::keyed_release(partition))
            }),
        )
        .collect()
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
        if worker.max_poll_interval < worker.session_timeout {
            return Err(WorkerError::Config(format!(
                "worker.max_poll_interval_ms ({}) must be at least worker.session_timeout_ms ({})",
                worker.max_poll_interval.as_millis(),
                worker.session_timeout.as_millis()
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
        options.statistics_interval = Some(worker.statistics_interval);
        options.session_timeout = Some(worker.session_timeout);
        options.commit_metadata = Some(quire_log::commit_metadata(&watermarks.id));
        options.max_poll_interval = Some(worker.max_poll_interval);
        let consumer = ArrayConsumer::new(&settings.kafka, &options)?;
        // Count and byte rollovers are decided inline, so a document ends at
        // the message that reaches rollover_bytes: the declared maximum is
        // that plus room for one batch; a batch that would not fit ends the
        // document before it (see `decide::fit`).
        let declared_maximum = worker
            .rollover_bytes
            .get()
            .saturating_add(ONE_BATCH_ROOM)
            .min(quire_s3::MAXIMUM_OBJECT_SIZE);
        let record_limit = declared_maximum.saturating_sub(CLOSING_ROOM);
        let mut policy = UploadPolicy::for_max_object_size(declared_maximum);
        policy.max_in_flight = worker.parts_in_flight.get();
        policy.checksum = settings.s3.checksum;
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
            worker.topic_check_interval,
        );
        Ok(Worker {
            settings: worker.clone(),
            context: Context {
                topics,
                store: S3Documents {
                    bucket: bucket.with_memory(memory),
                    policy,
                    tag_reports: settings.s3.tag_reports,
                },
                limits: CutLimits {
                    rollover_records: worker.rollover_records.get(),
                    rollover_bytes: worker.rollover_bytes.get(),
                    record_limit,
                },
                log,
            },
            kafka: settings.kafka.clone(),
            consumer,
            producer,
            partitions: BTreeMap::new(),
            monitor: monitor.clone(),
            summary: RunSummary::default(),
            refused: None,
            stuck: StuckWatch::new(settings.kafka.transaction_timeout),
            topic_watch,
            watermarks,
            unserved: std::collections::BTreeSet::new(),
        })
    }

    /// Ends the session: aborts the open documents (the next owner, or the
    /// next session, renders them again from the last committed offsets) and
    /// closes the Kafka clients on the blocking pool, each step bounded so a
    /// broker or S3 server that is away cannot hold the worker.
    pub async fn shut_down(mut self) {
        let open: Vec<OpenDocument> = std::mem::take(&mut self.partitions)
            .into_values()
            .flat_map(PartitionPipeline::into_documents)
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

    /// Applies a read's rebalance events in order, then takes over the
    /// partitions still assigned once all of them are applied: a partition
    /// assigned and revoked again within one read is not swept (its pending
    /// uploads belong to its live owner by then).
    pub(super) async fn handle_rebalances(
        &mut self,
        events: &[RebalanceEvent],
    ) -> Result<(), WorkerError> {
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
                if let Some(pipeline) = self.partitions.remove(partition) {
                    let open: Vec<OpenDocument> = pipeline.into_documents().collect();
                    tracing::info!(
                        partition,
                        lost,
                        open = open.len(),
                        "partition revoked: aborting its open documents"
                    );
                    for document in open {
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
    pub(super) async fn apply_topic_changes(&mut self) -> Result<(), WorkerError> {
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
            .store
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
                PartitionPipeline::take(
                    partition,
                    loaded,
                    Arc::from(self.context.log.records.id.as_str()),
                ),
            );
        }
        tracing::info!(partitions = ?partitions, orphaned_uploads_aborted = aborted, "assignment taken");
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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

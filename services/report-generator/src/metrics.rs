//! The worker's Prometheus metrics (`quire_worker_*`), kept across sessions
//! (a restart rebuilds the clients, not the metrics).
//!
//! The loop records what it did once per array, after the array's
//! transaction committed, so a replayed array is counted once; the S3
//! writers' counters are read when `/metrics` is scraped. Nothing here
//! calls Kafka or S3: lag comes from librdkafka's periodic statistics.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use quire_messages::Trigger;
use quire_queue::PartitionProgress;
use quire_s3::WriterCounters;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    partition: i32,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RebalanceLabels {
    /// `assigned` or `revoked`.
    kind: &'static str,
}

/// What one committed array did, for the counters.
#[derive(Debug, Default)]
pub struct ArrayCommitted<'a> {
    pub records: u64,
    pub dead_letters: u64,
    /// Producers' release messages skipped (they carry no stream).
    pub released: u64,
    /// Window markers this worker published in the array's transaction.
    pub window_markers: u64,
    /// Move markers (a growth of the partition layout) processed.
    pub moves: u64,
    /// The trigger of each report the array completed.
    pub reports: &'a [Trigger],
    /// How long the transaction took, when there was one.
    pub transaction: Option<Duration>,
}

/// The open documents at the end of an array.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpenDocuments {
    pub count: usize,
    pub buffered_bytes: u64,
    pub oldest_age: Option<Duration>,
}

/// Every metric the worker exports.
pub struct WorkerMetrics {
    registry: Registry,
    array_records: Histogram,
    array_wait_seconds: Histogram,
    records: Counter,
    reports: Family<TriggerLabels, Counter>,
    dead_letters: Counter,
    release_messages: Counter,
    window_markers: Counter,
    partition_moves: Counter,
    unserved_partitions: Gauge,
    records_partitions: Gauge,
    watermarks_lost: Counter,
    stale_watermarks: Counter,
    release_transactions: Counter,
    consumer_lag: Family<PartitionLabels, Gauge>,
    last_stable_offset_lag: Family<PartitionLabels, Gauge>,
    stuck_seconds: Family<PartitionLabels, Gauge>,
    assigned_partitions: Gauge,
    open_documents: Gauge,
    open_document_buffered_bytes: Gauge,
    oldest_open_document_age_seconds: Gauge<f64, AtomicU64>,
    commit_seconds: Histogram,
    commits: Counter,
    restarts: Counter,
    rebalances: Family<RebalanceLabels, Counter>,
    /// The partitions the lag gauges have a series for, so the series of a
    /// partition no longer held are removed instead of frozen.
    lag_series: Mutex<BTreeSet<i32>>,
    s3: Arc<WriterCounters>,
}

/// 1 ms .. about 16 s.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

impl WorkerMetrics {
    /// The metrics, with the S3 writers' counters `s3` (share it with every
    /// bucket handle the worker builds, so totals survive a restart).
    pub fn new(s3: Arc<WriterCounters>) -> Self {
        let mut registry = Registry::with_prefix("quire_worker");
        let array_records = Histogram::new(exponential_buckets(1.0, 4.0, 10));
        registry.register(
            "array_records",
            "Records and control messages per array read from Kafka",
            array_records.clone(),
        );
        let array_wait_seconds = seconds_histogram();
        registry.register(
            "array_wait_seconds",
            "Time spent waiting for an array (in next_array)",
            array_wait_seconds.clone(),
        );
        let records = Counter::default();
        registry.register(
            "records",
            "Records appended to documents, counted once their array committed",
            records.clone(),
        );
        let reports = Family::<TriggerLabels, Counter>::default();
        registry.register(
            "reports",
            "Reports completed and announced, by what cut them",
            reports.clone(),
        );
        let dead_letters = Counter::default();
        registry.register(
            "dead_letters",
            "Messages sent to the dead-letter topic",
            dead_letters.clone(),
        );
        let release_messages = Counter::default();
        registry.register(
            "release_messages",
            "Release messages skipped: control messages a producer commits to its partitions after a broker comes back, so no transaction of its stays open there",
            release_messages.clone(),
        );
        let window_markers = Counter::default();
        registry.register(
            "window_markers",
            "Window markers published: windows whose end plus grace passed by this worker's clock with nothing in the log closing them (idle streams, empty windows)",
            window_markers.clone(),
        );
        let partition_moves = Counter::default();
        registry.register(
            "partition_moves",
            "Move markers processed: a growth of the partition layout reached one of this worker's partitions (its moving streams were completed there and handed over)",
            partition_moves.clone(),
        );
        let unserved_partitions = Gauge::default();
        registry.register(
            "unserved_partitions",
            "Assigned record partitions held but not served because the watermark topic has no partition of theirs (the records topic was grown alone); nothing is routed there",
            unserved_partitions.clone(),
        );
        let records_partitions = Gauge::default();
        registry.register(
            "records_topic_partitions",
            "The records topic's live partition count, as the worker last saw it (it asks every worker.topic_check_interval_ms)",
            records_partitions.clone(),
        );
        let watermarks_lost = Counter::default();
        registry.register(
            "watermarks_lost",
            "Partitions taken whose committed offset was written with another watermark topic (it was deleted and created again): reports after that offset are rendered again and their events published again",
            watermarks_lost.clone(),
        );
        let stale_watermarks = Counter::default();
        registry.register(
            "stale_watermarks",
            "Watermarks ignored at take-over because they belong to another records log (the records topic was deleted and created again)",
            stale_watermarks.clone(),
        );
        let release_transactions = Counter::default();
        registry.register(
            "release_transactions",
            "Releases committed by the worker's producer: one message to each records and watermarks partition, at start and after the brokers were gone, so that no transaction of its stays open there",
            release_transactions.clone(),
        );
        let consumer_lag = Family::<PartitionLabels, Gauge>::default();
        registry.register(
            "consumer_lag",
            "Messages past the worker's position, per assigned partition (high watermark - position)",
            consumer_lag.clone(),
        );
        let stuck_seconds = Family::<PartitionLabels, Gauge>::default();
        registry.register(
            "partition_stuck_seconds",
            "How long the partition's last stable offset has stayed behind its high watermark without moving, once that is longer than the transaction timeout (a hanging transaction; see the WARN that names the offset); no series while it moves",
            stuck_seconds.clone(),
        );
        let last_stable_offset_lag = Family::<PartitionLabels, Gauge>::default();
        registry.register(
            "last_stable_offset_lag",
            "Messages held back by open transactions, per assigned partition (high watermark - last stable offset); a value that stays up is a hanging transaction",
            last_stable_offset_lag.clone(),
        );
        let assigned_partitions = Gauge::default();
        registry.register(
            "assigned_partitions",
            "Partitions of the records topic this worker holds",
            assigned_partitions.clone(),
        );
        let open_documents = Gauge::default();
        registry.register(
            "open_documents",
            "Documents open (being written)",
            open_documents.clone(),
        );
        let open_document_buffered_bytes = Gauge::default();
        registry.register(
            "open_document_buffered_bytes",
            "Bytes the open documents hold in memory (buffers and parts in flight)",
            open_document_buffered_bytes.clone(),
        );
        let oldest_open_document_age_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "oldest_open_document_age_seconds",
            "Age of the oldest open document (0 when none is open)",
            oldest_open_document_age_seconds.clone(),
        );
        let commit_seconds = seconds_histogram();
        registry.register(
            "commit_duration_seconds",
            "Time of an array's Kafka transaction (events, markers, watermarks and offsets)",
            commit_seconds.clone(),
        );
        let commits = Counter::default();
        registry.register("commits", "Array transactions committed", commits.clone());
        let restarts = Counter::default();
        registry.register(
            "restarts",
            "Sessions ended by a Kafka or S3 failure and rebuilt",
            restarts.clone(),
        );
        let rebalances = Family::<RebalanceLabels, Counter>::default();
        registry.register(
            "rebalances",
            "Rebalance events (partitions assigned or revoked)",
            rebalances.clone(),
        );
        registry.register_collector(Box::new(UploadCounters(Arc::clone(&s3))));
        WorkerMetrics {
            registry,
            array_records,
            array_wait_seconds,
            records,
            reports,
            dead_letters,
            release_messages,
            window_markers,
            partition_moves,
            unserved_partitions,
            records_partitions,
            watermarks_lost,
            stale_watermarks,
            release_transactions,
            consumer_lag,
            last_stable_offset_lag,
            stuck_seconds,
            assigned_partitions,
            open_documents,
            open_document_buffered_bytes,
            oldest_open_document_age_seconds,
            commit_seconds,
            commits,
            restarts,
            rebalances,
            lag_series: Mutex::new(BTreeSet::new()),
            s3,
        }
    }

    /// Assigned partitions held but not served now.
    pub fn unserved_partitions(&self, count: usize) {
        self.unserved_partitions.set(count as i64);
    }

    /// The records topic's live partition count.
    pub fn records_partitions(&self, count: i32) {
        self.records_partitions.set(i64::from(count));
    }

    /// A partition taken whose watermarks were lost.
    pub fn watermarks_lost(&self) {
        self.watermarks_lost.inc();
    }

    /// Watermarks of another log ignored at a take-over.
    pub fn stale_watermarks(&self, count: u64) {
        self.stale_watermarks.inc_by(count);
    }

    /// The counters every S3 writer of the worker adds to.
    /// The worker's producer committed a release.
    pub fn partitions_released(&self) {
        self.release_transactions.inc();
    }

    pub fn s3_counters(&self) -> &Arc<WriterCounters> {
        &self.s3
    }

    pub fn array_read(&self, messages: usize, waited: Duration) {
        self.array_records.observe(messages as f64);
        self.array_wait_seconds.observe(waited.as_secs_f64());
    }

    pub fn array_committed(&self, committed: &ArrayCommitted<'_>) {
        self.records.inc_by(committed.records);
        self.dead_letters.inc_by(committed.dead_letters);
        self.release_messages.inc_by(committed.released);
        self.window_markers.inc_by(committed.window_markers);
        self.partition_moves.inc_by(committed.moves);
        for trigger in committed.reports {
            self.reports
                .get_or_create(&TriggerLabels {
                    trigger: trigger_label(*trigger),
                })
                .inc();
        }
        if let Some(took) = committed.transaction {
            self.commits.inc();
            self.commit_seconds.observe(took.as_secs_f64());
        }
    }

    pub fn rebalanced(&self, assigned: bool) {
        let kind = if assigned { "assigned" } else { "revoked" };
        self.rebalances
            .get_or_create(&RebalanceLabels { kind })
            .inc();
    }

    pub fn restarted(&self) {
        self.restarts.inc();
    }

    pub fn open_documents(&self, open: OpenDocuments) {
        self.open_documents.set(gauge_value(open.count as u64));
        self.open_document_buffered_bytes
            .set(gauge_value(open.buffered_bytes));
        self.oldest_open_document_age_seconds
            .set(open.oldest_age.unwrap_or_default().as_secs_f64());
    }

    /// The partitions held and where each stands; series of partitions no
    /// longer held (or without statistics yet) are removed.
    pub fn partitions(&self, assigned: usize, progress: &[PartitionProgress]) {
        self.assigned_partitions.set(gauge_value(assigned as u64));
        let mut series = self.lag_series.lock().unwrap_or_else(|poisoned| {
            // A panic elsewhere cannot leave a set of numbers inconsistent.
            poisoned.into_inner()
        });
        let current: BTreeSet<i32> = progress.iter().map(|p| p.partition).collect();
        for gone in series.difference(&current) {
            let labels = PartitionLabels { partition: *gone };
            self.consumer_lag.remove(&labels);
            self.last_stable_offset_lag.remove(&labels);
        }
        for partition in progress {
            let labels = PartitionLabels {
                partition: partition.partition,
            };
            self.consumer_lag
                .get_or_create(&labels)
                .set(partition.lag());
            self.last_stable_offset_lag
                .get_or_create(&labels)
                .set(partition.unstable());
        }
        *series = current;
    }

    /// The partitions stuck behind a hanging transaction now (see `stuck.rs`).
    pub fn stuck(&self, stuck: &[crate::stuck::Stuck]) {
        self.stuck_seconds.clear();
        for partition in stuck {
            self.stuck_seconds
                .get_or_create(&PartitionLabels {
                    partition: partition.partition,
                })
                .set(gauge_value(partition.for_how_long.as_secs()));
        }
    }

    /// Forgets the partitions (a session ended: it holds none).
    pub fn no_partitions(&self) {
        self.partitions(0, &[]);
        self.stuck(&[]);
        self.open_documents(OpenDocuments::default());
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::with_capacity(8192);
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            // Writing to a String does not fail; a collector could.
            tracing::warn!(error = %error, "metrics exposition failed");
        }
        text
    }
}

fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The label of a trigger: its name in manifests and events.
fn trigger_label(trigger: Trigger) -> &'static str {
    match trigger {
        Trigger::Api => "api",
        Trigger::Records => "records",
        Trigger::Bytes => "bytes",
        Trigger::Age => "age",
        Trigger::Memory => "memory",
        Trigger::Drain => "drain",
        Trigger::Window => "window",
        Trigger::Move => "move",
    }
}

/// The S3 writers' counters, read at each scrape.
#[derive(Debug)]
struct UploadCounters(Arc<WriterCounters>);

impl Collector for UploadCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshot = self.0.snapshot();
        let counters = [
            (
                "bytes_uploaded",
                "Bytes S3 acknowledged (parts and single PutObjects)",
                snapshot.bytes_uploaded,
            ),
            (
                "parts_uploaded",
                "Multipart parts uploaded",
                snapshot.parts_uploaded,
            ),
            (
                "upload_retries",
                "S3 attempts that failed with a retryable error and were tried again",
                snapshot.retries,
            ),
            (
                "uploads_aborted",
                "Multipart uploads aborted (documents abandoned, failed parts, take-over sweeps)",
                snapshot.uploads_aborted,
            ),
            (
                "documents_stored",
                "Objects completed in S3, reports and their manifests (multipart or single PutObject)",
                snapshot.documents_completed,
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        let spill_failures = [
            ("disk_full", snapshot.spill_refused_disk_full),
            ("write_failed", snapshot.spill_write_failures),
        ];
        let mut family = encoder.encode_descriptor(
            "spill_failures",
            "Spills that did not happen, so their bytes stayed in memory past the budget: the spill filesystem had no room (disk_full) or a write failed (write_failed: ENOSPC, EMFILE, EIO, ...)",
            None,
            MetricType::Counter,
        )?;
        for (reason, value) in spill_failures {
            let counter = ConstCounter::new(value);
            counter.encode(family.encode_family(&[("reason", reason)])?)?;
        }
        let in_flight = ConstGauge::new(gauge_value(snapshot.parts_in_flight));
        let metric = encoder.encode_descriptor(
            "parts_in_flight",
            "Parts uploading right now",
            None,
            in_flight.metric_type(),
        )?;
        in_flight.encode(metric)?;
        let memory = [
            (
                "memory_held_bytes",
                "Memory held for open documents: buffer capacity, spare part buffers and parts in flight (what memory_budget_bytes bounds)",
                snapshot.memory_buffered_bytes + snapshot.memory_in_flight_bytes,
            ),
            (
                "memory_in_flight_bytes",
                "Bytes of parts and single-put documents uploading now",
                snapshot.memory_in_flight_bytes,
            ),
            (
                "spilled_bytes",
                "Bytes of open documents spilled to the local spill directory",
                snapshot.spilled_bytes,
            ),
            (
                "memory_over_budget_bytes",
                "Memory held past memory_budget_bytes because the spill was full or failing",
                snapshot.memory_over_budget_bytes,
            ),
        ];
        for (name, help, value) in memory {
            let gauge = ConstGauge::new(gauge_value(value));
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(partition: i32, high_watermark: i64, position: i64) -> PartitionProgress {
        PartitionProgress {
            partition,
            high_watermark,
            last_stable_offset: high_watermark - 1,
            position,
        }
    }

    #[test]
    fn the_exposition_holds_what_the_loop_recorded() {
        let metrics = WorkerMetrics::new(Arc::default());
        metrics.array_read(250, Duration::from_millis(12));
        metrics.array_committed(&ArrayCommitted {
            records: 248,
            dead_letters: 2,
            released: 1,
            window_markers: 4,
            moves: 1,
            reports: &[Trigger::Api, Trigger::Api, Trigger::Drain, Trigger::Window],
            transaction: Some(Duration::from_millis(9)),
        });
        metrics.rebalanced(true);
        metrics.restarted();
        metrics.open_documents(OpenDocuments {
            count: 3,
            buffered_bytes: 4096,
            oldest_age: Some(Duration::from_secs(90)),
        });
        metrics.partitions(2, &[progress(0, 10, 4), progress(7, 5, 5)]);
        let text = metrics.encode();
        for expected in [
            "quire_worker_records_total 248",
            "quire_worker_dead_letters_total 2",
            "quire_worker_release_messages_total 1",
            "quire_worker_window_markers_total 4",
            "quire_worker_partition_moves_total 1",
            "quire_worker_unserved_partitions 0",
            "quire_worker_watermarks_lost_total 0",
            "quire_worker_stale_watermarks_total 0",
            r#"quire_worker_reports_total{trigger="window"} 1"#,
            r#"quire_worker_reports_total{trigger="api"} 2"#,
            r#"quire_worker_reports_total{trigger="drain"} 1"#,
            "quire_worker_commits_total 1",
            "quire_worker_restarts_total 1",
            r#"quire_worker_rebalances_total{kind="assigned"} 1"#,
            "quire_worker_open_documents 3",
            "quire_worker_open_document_buffered_bytes 4096",
            "quire_worker_oldest_open_document_age_seconds 90.0",
            "quire_worker_assigned_partitions 2",
            r#"quire_worker_consumer_lag{partition="0"} 6"#,
            r#"quire_worker_consumer_lag{partition="7"} 0"#,
            r#"quire_worker_last_stable_offset_lag{partition="0"} 1"#,
            "quire_worker_array_records_count 1",
            "quire_worker_array_records_sum 250.0",
            "quire_worker_commit_duration_seconds_count 1",
            "quire_worker_bytes_uploaded_total 0",
            "quire_worker_upload_retries_total 0",
            "quire_worker_uploads_aborted_total 0",
            "quire_worker_parts_in_flight 0",
            "quire_worker_memory_held_bytes 0",
            "quire_worker_spilled_bytes 0",
            "quire_worker_memory_over_budget_bytes 0",
            r#"quire_worker_spill_failures_total{reason="disk_full"} 0"#,
            r#"quire_worker_spill_failures_total{reason="write_failed"} 0"#,
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_partition_no_longer_held_loses_its_lag_series() {
        let metrics = WorkerMetrics::new(Arc::default());
        metrics.partitions(2, &[progress(0, 10, 4), progress(7, 5, 5)]);
        metrics.partitions(1, &[progress(7, 6, 6)]);
        let text = metrics.encode();
        assert!(
            !text.contains(r#"partition="0""#),
            "partition 0 was revoked: {text}"
        );
        assert!(text.contains(r#"quire_worker_consumer_lag{partition="7"} 0"#));
        metrics.no_partitions();
        let text = metrics.encode();
        assert!(!text.contains(r#"partition="7""#), "{text}");
        assert!(text.contains("quire_worker_assigned_partitions 0"));
    }

    #[test]
    fn an_array_without_a_transaction_is_not_a_commit() {
        let metrics = WorkerMetrics::new(Arc::default());
        metrics.array_committed(&ArrayCommitted::default());
        assert!(metrics.encode().contains("quire_worker_commits_total 0"));
    }
}

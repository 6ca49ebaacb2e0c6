//! A stack of one's own for each test: unique topics with the design's
//! partition counts and settings (on the local stack's broker or a test's
//! private one), a unique bucket and group, and the typed [`Settings`]
//! every service of the stack starts with.

use quire_config::{KafkaSettings, Settings, TopicNames};
use serde_json::{Value, json};

use crate::kafka_process::{KafkaCluster, KafkaProcess};
use crate::s3::{TestBucket, s3_settings};
use crate::{kafka_settings, unique};

/// Topics with the design's partition counts and settings, but unique names,
/// deleted when dropped; and a bucket of its own.
pub struct TestStack {
    pub topics: TopicNames,
    pub bucket: TestBucket,
    pub group: String,
    /// The broker the topics are on and the services use.
    pub kafka: KafkaSettings,
    _topics: Vec<crate::TestTopic>,
}

impl TestStack {
    pub async fn create(prefix: &str) -> TestStack {
        Self::create_with_records_config(prefix, &[]).await
    }

    /// [`create`](Self::create), the records topic with `config` added to
    /// the design's (`max.message.bytes`, say).
    pub async fn create_with_records_config(prefix: &str, config: &[(&str, &str)]) -> TestStack {
        let topics = Self::topic_names(prefix);
        let mut guards = Vec::new();
        for mut spec in quire_queue::design_topics(&topics, 1, quire_queue::DEFAULT_PARTITIONS) {
            if spec.name == topics.records {
                spec.config.extend(
                    config
                        .iter()
                        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned())),
                );
            }
            guards.push(crate::TestTopic::adopt(spec).await);
        }
        TestStack {
            topics,
            bucket: TestBucket::create(prefix).await,
            group: unique(&format!("test.{prefix}.workers")),
            kafka: kafka_settings(),
            _topics: guards,
        }
    }

    /// The same, on a test's private broker instead of the stack's: the
    /// services of this stack use `broker`, and the topics go with it.
    pub async fn create_on(prefix: &str, broker: &KafkaProcess) -> TestStack {
        Self::create_on_private(prefix, &broker.bootstrap, 1).await
    }

    /// The same, on a test's private [`KafkaCluster`]: every topic with one
    /// replica per node.
    pub async fn create_on_cluster(prefix: &str, cluster: &KafkaCluster) -> TestStack {
        Self::create_on_private(prefix, &cluster.bootstrap, 3).await
    }

    /// Topics of `replication` replicas created through `bootstrap` (they go
    /// with the private brokers' data), and a bucket.
    async fn create_on_private(prefix: &str, bootstrap: &str, replication: i32) -> TestStack {
        let topics = Self::topic_names(prefix);
        crate::kafka_process::create_topics_on(
            bootstrap,
            &quire_queue::design_topics(&topics, replication, quire_queue::DEFAULT_PARTITIONS),
        )
        .await;
        TestStack {
            topics,
            bucket: TestBucket::create(prefix).await,
            group: unique(&format!("test.{prefix}.workers")),
            kafka: KafkaSettings::for_bootstrap(bootstrap),
            _topics: Vec::new(),
        }
    }

    fn topic_names(prefix: &str) -> TopicNames {
        TopicNames {
            records: unique(&format!("test.{prefix}.records")),
            report_events: unique(&format!("test.{prefix}.events")),
            watermarks: unique(&format!("test.{prefix}.watermarks")),
            dead_letters: unique(&format!("test.{prefix}.dead")),
            idempotency: unique(&format!("test.{prefix}.idempotency")),
        }
    }

    /// The settings every service of this stack starts with: its broker,
    /// topics, bucket and group, transactional ids of its own, and timings
    /// short enough for tests (a stopped static member's partitions move
    /// after 6 s; a worker's arrays wait at most 200 ms). Workers run side
    /// by side, so each serves its metrics on a free port.
    pub fn settings(&self) -> Settings {
        let mut settings = quire_config::defaults();
        settings.kafka = self.kafka.clone();
        settings.kafka.topics = self.topics.clone();
        settings.s3 = s3_settings();
        settings.s3.bucket = self.bucket.name.clone();
        settings.api.transactional_id_prefix = unique("test-api");
        let worker = &mut settings.worker;
        worker.group_id = self.group.clone();
        worker.transactional_id_prefix = unique("test-worker");
        worker.max_wait = std::time::Duration::from_millis(200);
        worker.session_timeout = std::time::Duration::from_millis(6000);
        worker.metrics_listen = "127.0.0.1:0".into();
        settings
    }

    /// The settings of this stack's report generator `replica`.
    pub fn worker_settings(&self, replica: &str) -> Settings {
        let mut settings = self.settings();
        settings.worker.replica_id = replica.to_owned();
        settings
    }
}

/// `count` records for `stream` numbered from `first`.
pub fn records(stream: &str, first: u64, count: u64) -> Vec<Value> {
    (first..first + count)
        .map(|seq| json!({"stream": stream, "seq": seq, "text": format!("record {seq} of {stream} <&> \"quoted\"")}))
        .collect()
}

/// Kafka's murmur2 partitioner (librdkafka's `murmur2_random` for non-empty
/// keys, the Java client's default): the partition of a stream.
pub fn partition_of(stream: &str, partitions: u32) -> u32 {
    let data = stream.as_bytes();
    let length = data.len();
    let seed: u32 = 0x9747_b28c;
    let m: u32 = 0x5bd1_e995;
    let mut hash: u32 = seed ^ length as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(m);
        k ^= k >> 24;
        k = k.wrapping_mul(m);
        hash = hash.wrapping_mul(m);
        hash ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        hash ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        hash ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        hash ^= u32::from(rest[0]);
        hash = hash.wrapping_mul(m);
    }
    hash ^= hash >> 13;
    hash = hash.wrapping_mul(m);
    hash ^= hash >> 15;
    (hash & 0x7fff_ffff) % partitions
}

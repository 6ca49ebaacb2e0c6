//! Helpers shared by the integration tests and the benchmarks, by job:
//! [`stack`] (unique topics, bucket and group, and the typed settings of
//! their services), [`services`] (starting the real binaries with those
//! settings), [`client`] (requests to a started API), [`observe`] (what a
//! run left in Kafka and S3, and the exactly-once checks), [`kafka_process`]
//! (private brokers a test may crash), [`record_ids`] (the API's record
//! ids, and the records a message of the records topic carries), [`s3`]
//! and [`tls`] (an HTTPS
//! endpoint in front of a started API); here, settings from the
//! running local stack, unique names, and topics that clean up after
//! themselves.
//!
//! Nothing here skips: a test that needs Kafka and cannot reach it fails,
//! with a message that says how to start the stack.

use std::time::Duration;

use quire_config::KafkaSettings;
use quire_queue::TopicSpec;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

/// Where the stack's Kafka is, from `eval "$(deploy/local/stack env)"`.
pub fn kafka_settings() -> KafkaSettings {
    let bootstrap = std::env::var("QUIRE_KAFKA__BOOTSTRAP_SERVERS").unwrap_or_else(|_| {
        panic!(
            "QUIRE_KAFKA__BOOTSTRAP_SERVERS is not set: start the stack with \
             `deploy/local/stack up` and `eval \"$(deploy/local/stack env)\"`, \
             or run the tests through `deploy/local/test`"
        )
    });
    KafkaSettings::for_bootstrap(&bootstrap)
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("address")
        .port()
}

/// `count` distinct loopback ports nobody listens on right now: all are
/// held until every one is chosen, so two calls of [`free_port`] cannot
/// hand out one port twice (a broker given one port for two listeners
/// refuses to start).
pub fn free_ports(count: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..count)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    held.iter()
        .map(|listener| listener.local_addr().expect("address").port())
        .collect()
}

/// `prefix` plus a random suffix: every test gets its own topics and groups.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// SHA-256 of `bytes`, lowercase hex, as manifests give it.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// A topic made for one test and deleted when dropped.
pub struct TestTopic {
    pub name: String,
    pub partitions: i32,
    settings: KafkaSettings,
}

impl TestTopic {
    pub async fn create(prefix: &str, partitions: i32) -> TestTopic {
        Self::create_with(prefix, partitions, &[]).await
    }

    pub async fn create_with(prefix: &str, partitions: i32, config: &[(&str, &str)]) -> TestTopic {
        Self::adopt(TopicSpec {
            name: unique(&format!("test.{prefix}")),
            partitions,
            replication: 1,
            config: config
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect(),
            growable: false,
        })
        .await
    }

    /// Creates the topic `spec` describes (its name made unique by the caller).
    pub async fn adopt(spec: TopicSpec) -> TestTopic {
        let settings = kafka_settings();
        let name = spec.name.clone();
        let partitions = spec.partitions;
        quire_queue::ensure_topics(&settings, &[spec])
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot create a test topic; is the stack up (deploy/local/stack up)? {error}"
                )
            });
        wait_for_leaders(&settings, &name, partitions);
        TestTopic {
            name,
            partitions,
            settings,
        }
    }
}

impl Drop for TestTopic {
    fn drop(&mut self) {
        let settings = self.settings.clone();
        let name = self.name.clone();
        // Drop cannot await; a short-lived runtime on its own thread can.
        let cleanup = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime")
                .block_on(quire_queue::delete_topics(&settings, &[&name]))
        });
        if let Ok(Err(error)) = cleanup.join() {
            eprintln!(
                "warning: could not delete test topic {}: {error}",
                self.name
            );
        }
    }
}

/// Topic creation returns before every partition has a leader; producing
/// before that fails. Waits (bounded) until metadata shows them all.
fn wait_for_leaders(settings: &KafkaSettings, topic: &str, partitions: i32) {
    let client: BaseConsumer = plain_config(settings).create().expect("metadata client");
    for _ in 0..100 {
        if let Ok(metadata) = client.fetch_metadata(Some(topic), Duration::from_secs(5)) {
            let ready = metadata.topics().iter().any(|found| {
                found.error().is_none()
                    && found.partitions().len() as i32 == partitions
                    && found
                        .partitions()
                        .iter()
                        .all(|partition| partition.leader() >= 0)
            });
            if ready {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("topic {topic} has no leaders after 10 s");
}

fn plain_config(settings: &KafkaSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &settings.bootstrap_servers);
    config
}

/// A partition's last stable offset (what read_committed readers may read
/// up to) and its high watermark, from the broker.
pub fn stable_and_high(settings: &KafkaSettings, topic: &str, partition: i32) -> (i64, i64) {
    let watermark = |isolation: &str| {
        let mut config = plain_config(settings);
        config
            .set("group.id", unique("watermarks"))
            .set("isolation.level", isolation);
        let consumer: BaseConsumer = config.create().expect("watermark reader");
        consumer
            .fetch_watermarks(topic, partition, Duration::from_secs(10))
            .map(|(_, high)| high)
            .unwrap_or(-1)
    };
    (watermark("read_committed"), watermark("read_uncommitted"))
}

/// A transactional producer of the raw client, for transactions the test
/// ends by hand (or leaves open).
pub fn raw_transactional_producer(
    settings: &KafkaSettings,
    id: &str,
) -> rdkafka::producer::FutureProducer {
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &settings.bootstrap_servers)
        .set("transactional.id", id)
        .set("transaction.timeout.ms", "60000")
        .create()
        .expect("producer");
    rdkafka::producer::Producer::init_transactions(&producer, Duration::from_secs(30))
        .expect("init_transactions");
    producer
}

/// Sends one record in an open transaction; where it was written.
pub async fn send_in_transaction(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: &str,
) -> quire_queue::MessageId {
    rdkafka::producer::Producer::begin_transaction(producer).expect("begin");
    let delivery = producer
        .send(
            rdkafka::producer::FutureRecord::to(topic)
                .key(key)
                .payload("{\"a\":1}"),
            Duration::from_secs(30),
        )
        .await
        .expect("delivered");
    quire_queue::MessageId {
        partition: delivery.partition,
        offset: delivery.offset,
    }
}

/// A message as an independent reader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    /// Its headers, in order (`quire-kind`, `quire-v` on the records topic).
    pub headers: Vec<(String, Vec<u8>)>,
    pub payload: Vec<u8>,
    /// The message's timestamp (the broker's append time on the records
    /// topic).
    pub timestamp_ms: Option<i64>,
}

/// Reads every partition of `topic` from the beginning to its end with a
/// plain consumer outside any group, at the given isolation level. This is
/// the "real second consumer" the tests check visibility with.
pub fn read_all(
    settings: &KafkaSettings,
    topic: &str,
    partitions: i32,
    read_committed: bool,
) -> Vec<Seen> {
    let mut config = plain_config(settings);
    config
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set(
            "isolation.level",
            if read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        );
    let consumer: BaseConsumer = config.create().expect("reader");
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("assignment");
    }
    consumer.assign(&assignment).expect("assign");
    let mut at_end = std::collections::BTreeSet::new();
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while (at_end.len() as i32) < partitions {
        assert!(
            std::time::Instant::now() < deadline,
            "reader did not reach the end of {topic}"
        );
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                at_end.remove(&message.partition());
                seen.push(Seen {
                    partition: message.partition(),
                    offset: message.offset(),
                    key: message.key().map(<[u8]>::to_vec),
                    headers: quire_queue::owned_headers(&message),
                    payload: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    timestamp_ms: message.timestamp().to_millis(),
                });
            }
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(partition))) => {
                at_end.insert(partition);
            }
            Some(Err(error)) => panic!("reader error: {error}"),
            None => {}
        }
    }
    seen
}

/// The committed offsets of `group` on `topic`, as the group coordinator has them.
pub fn committed_offsets(
    settings: &KafkaSettings,
    group: &str,
    topic: &str,
    partitions: i32,
) -> Vec<Option<i64>> {
    let mut config = plain_config(settings);
    config.set("group.id", group);
    let consumer: BaseConsumer = config.create().expect("offset reader");
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition(topic, partition);
    }
    let committed = consumer
        .committed_offsets(list, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(|partition| {
            match committed
                .find_partition(topic, partition)
                .map(|element| element.offset())
            {
                Some(Offset::Offset(offset)) => Some(offset),
                _ => None,
            }
        })
        .collect()
}

/// `count` payloads in the seed's shape: `(i)` and padding, about `size` bytes.
pub fn payloads(count: usize, size: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|index| {
            let mut payload = format!("({index})").into_bytes();
            payload.resize(size.max(payload.len()), b'.');
            payload
        })
        .collect()
}

/// Deletes the records of `topic[partition]` before `offset`, as retention
/// would, so tests can make a committed offset fall out of the log.
pub async fn delete_records_before(
    settings: &KafkaSettings,
    topic: &str,
    partition: i32,
    offset: i64,
) {
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        plain_config(settings).create().expect("admin client");
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, partition, Offset::Offset(offset))
        .expect("partition offset");
    let result = admin
        .delete_records(&list, &rdkafka::admin::AdminOptions::new())
        .await
        .expect("delete records");
    for element in result.elements() {
        element.error().expect("delete records of a partition");
    }
}
pub mod client;
pub mod kafka_process;
pub mod observe;
pub mod record_ids;
pub mod s3;
pub mod services;
pub mod stack;
pub mod tls;

pub use client::{Answer, ApiClient, Attempt, NoAnswer};
pub use observe::{Observed, Report, worker_metric};
pub use record_ids::{RecordId, records_in, records_of};
pub use services::{
    ApiProcess, InProcessApi, InProcessWorker, Launch, Service, WorkerProcess, environment_of,
    release_binary,
};
pub use stack::{TestStack, partition_of, records};

/// Prints a test's measured figures (one line, e.g. `soak: ...`) past the
/// test harness's capture, so they appear in the log of a passing run too:
/// libtest captures `println!`/`eprintln!`, not writes to the stderr handle.
pub fn figures(line: &str) {
    use std::io::Write;
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "{line}");
}

//! A private Kafka broker for the tests that stop and restart Kafka: one
//! KRaft node (broker and controller) started from the local stack's cached
//! jars, as a child process, on free loopback ports, with its data in a
//! directory of its own; or a private cluster of three such nodes
//! ([`KafkaCluster`]), replicated as production runs.
//!
//! The shared stack's broker is never touched: a test that needs Kafka to go
//! away starts one of these, points its services at [`KafkaProcess::bootstrap`],
//! and stops and starts it at will. `start` after `stop` or `kill` reuses the
//! same ports and the same data directory, so topics, committed offsets and
//! transaction state survive, as they would across a real broker restart.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_queue::TopicSpec;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::unique;

/// The Kafka version `deploy/local/stack` installs (its `KAFKA_VERSION`).
const KAFKA_VERSION: &str = "4.4.0";
/// Small: one test's topics, a few clients.
const HEAP: &str = "-Xmx384m";
/// How long a start may take before the test fails (a JVM start on two busy
/// cores takes 5-20 s).
const START_LIMIT: Duration = Duration::from_secs(120);
/// How long a controlled shutdown may take before it becomes a SIGKILL.
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// A one-node KRaft broker owned by one test (or one node of a
/// [`KafkaCluster`]); killed and deleted when dropped.
pub struct KafkaProcess {
    /// `127.0.0.1:<port>` of the PLAINTEXT listener.
    pub bootstrap: String,
    /// `node.id`.
    pub node_id: u32,
    /// `None` alone; the cluster's `controller.quorum.voters` otherwise.
    voters: Option<String>,
    /// Replication of the internal topics and the ISR they need.
    replication: u32,
    controller_port: u16,
    directory: PathBuf,
    libraries: PathBuf,
    log4j_configuration: PathBuf,
    child: Option<Child>,
}

impl KafkaProcess {
    /// Formats a fresh data directory and starts the broker on free ports;
    /// returns once a metadata request succeeds.
    pub fn start_new() -> KafkaProcess {
        let [broker_port, controller_port] = crate::free_ports(2)[..] else {
            unreachable!("two ports asked for")
        };
        let mut process = Self::prepare(1, broker_port, controller_port, None, 1);
        process.format_storage(&uuid_for_kafka());
        process.start();
        process
    }

    /// A node's directory and configuration, not started nor formatted.
    fn prepare(
        node_id: u32,
        broker_port: u16,
        controller_port: u16,
        voters: Option<String>,
        replication: u32,
    ) -> KafkaProcess {
        let repository = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the repository root above tests/")
            .to_path_buf();
        let libraries = repository
            .join(".stack/cache/kafka-libs")
            .join(KAFKA_VERSION);
        assert!(
            libraries.join(".complete").exists(),
            "Kafka {KAFKA_VERSION} jars are not in {}: run `deploy/local/stack up` once, \
             it downloads them into .stack/cache/",
            libraries.display()
        );
        let directory = std::env::temp_dir().join(unique("quire-test-kafka"));
        fs::create_dir_all(directory.join("data")).expect("create the broker's directory");
        let process = KafkaProcess {
            bootstrap: format!("127.0.0.1:{broker_port}"),
            node_id,
            voters,
            replication,
            controller_port,
            directory,
            libraries,
            log4j_configuration: repository.join("deploy/local/log4j2.properties"),
            child: None,
        };
        process.write_configuration(broker_port);
        process
    }

    /// Settings for clients of this broker.
    pub fn settings(&self) -> KafkaSettings {
        KafkaSettings::for_bootstrap(&self.bootstrap)
    }

    /// Starts the broker (again) on the same ports and data directory and
    /// waits until it answers a metadata request.
    pub fn start(&mut self) {
        self.spawn();
        self.wait_until_ready();
    }

    /// Starts the process without waiting for it.
    fn spawn(&mut self) {
        assert!(
            self.child.is_none(),
            "the private broker is already running"
        );
        let output = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.directory.join("kafka.out"))
            .expect("broker output file");
        let child = self
            .java()
            .arg(HEAP)
            .args([
                "-XX:+UseG1GC",
                "-XX:MaxGCPauseMillis=20",
                "-XX:+ExplicitGCInvokesConcurrent",
                "-Djava.awt.headless=true",
            ])
            .arg(format!(
                "-Dkafka.logs.dir={}",
                self.directory.to_string_lossy()
            ))
            .args(["kafka.Kafka", &self.configuration_path()])
            .stdout(output.try_clone().expect("broker output file"))
            .stderr(output)
            .spawn()
            .expect("start java (Kafka needs Java 17+ on the PATH)");
        self.child = Some(child);
    }

    /// SIGTERM (a controlled shutdown) and waits for the process to exit;
    /// SIGKILL if it takes longer than a minute.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + STOP_LIMIT;
        loop {
            if child.try_wait().expect("try_wait on the broker").is_some() {
                return;
            }
            if Instant::now() > deadline {
                eprintln!("private broker ignored SIGTERM for {STOP_LIMIT:?}; killing it");
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL: the broker dies without flushing or closing anything.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the broker process is running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => child.try_wait().expect("try_wait on the broker").is_none(),
            None => false,
        }
    }

    /// Creates topics on this broker and waits until every partition has a
    /// leader. They are not deleted one by one: they go with the broker's
    /// data directory.
    pub async fn create_topics(&self, specs: &[TopicSpec]) {
        create_topics_on(&self.bootstrap, specs).await;
    }

    /// The broker's own log, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = fs::read_to_string(self.directory.join("server.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The lines of the broker's own log that contain any of `needles`.
    pub fn log_lines_containing(&self, needles: &[&str]) -> String {
        let log = fs::read_to_string(self.directory.join("server.log")).unwrap_or_default();
        log.lines()
            .filter(|line| needles.iter().any(|needle| line.contains(needle)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn configuration_path(&self) -> String {
        self.directory
            .join("server.properties")
            .to_string_lossy()
            .into_owned()
    }

    /// `java` with the log4j2 configuration of the stack, logging into this
    /// broker's directory, and the cached jars on the class path.
    fn java(&self) -> Command {
        let mut command = Command::new("java");
        command
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.log4j_configuration.to_string_lossy()
            ))
            .arg(format!(
                "-Dquire.stack.log.file={}",
                self.directory.join("server.log").to_string_lossy()
            ))
            .arg("-cp")
            .arg(format!("{}/*", self.libraries.to_string_lossy()))
            .stdin(Stdio::null());
        command
    }

    /// As `deploy/local/stack` writes it, with test-friendly settings: no
    /// initial rebalance delay, internal topics of one replica.
    fn write_configuration(&self, broker_port: u16) {
        let controller_port = self.controller_port;
        let data = self.directory.join("data");
        let node_id = self.node_id;
        let quorum = match &self.voters {
            None => format!("controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}"),
            Some(voters) => format!("controller.quorum.voters={voters}"),
        };
        let replication = self.replication;
        let min_isr = if replication >= 3 { 2 } else { 1 };
        let configuration = format!(
            "# A private broker of one quire test (tests/kafka_process.rs).\n\
             process.roles=broker,controller\n\
             node.id={node_id}\n\
             {quorum}\n\
             listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}\n\
             controller.listener.names=CONTROLLER\n\
             inter.broker.listener.name=PLAINTEXT\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
             log.dirs={}\n\
             num.partitions=1\n\
             default.replication.factor={replication}\n\
             min.insync.replicas={min_isr}\n\
             offsets.topic.replication.factor={replication}\n\
             offsets.topic.num.partitions=3\n\
             transaction.state.log.replication.factor={replication}\n\
             transaction.state.log.min.isr={min_isr}\n\
             transaction.state.log.num.partitions=3\n\
             share.coordinator.state.topic.replication.factor={replication}\n\
             share.coordinator.state.topic.min.isr={min_isr}\n\
             group.initial.rebalance.delay.ms=0\n\
             auto.create.topics.enable=false\n",
            data.to_string_lossy()
        );
        fs::write(self.configuration_path(), configuration).expect("write server.properties");
    }

    fn format_storage(&self, cluster_id: &str) {
        let mut command = self.java();
        command.args(["kafka.tools.StorageTool", "format"]);
        if self.voters.is_none() {
            command.arg("--standalone");
        }
        let output = command
            .args(["-t", cluster_id, "-c", &self.configuration_path()])
            .output()
            .expect("run kafka.tools.StorageTool (Kafka needs Java 17+ on the PATH)");
        assert!(
            output.status.success(),
            "formatting the private broker's storage failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn wait_until_ready(&mut self) {
        let client: BaseConsumer = client_config(&self.bootstrap)
            .set("log_level", "0")
            .create()
            .expect("metadata client");
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if client
                .fetch_metadata(None, Duration::from_secs(2))
                .is_ok_and(|metadata| !metadata.brokers().is_empty())
            {
                return;
            }
            if !self.is_running() {
                panic!(
                    "the private broker exited during start-up:\n{}",
                    self.log_tail(40)
                );
            }
            if Instant::now() > deadline {
                let tail = self.log_tail(40);
                self.kill();
                panic!("the private broker did not answer within {START_LIMIT:?}:\n{tail}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for KafkaProcess {
    fn drop(&mut self) {
        self.kill();
        if let Err(error) = fs::remove_dir_all(&self.directory) {
            eprintln!(
                "warning: could not delete the private broker's directory {}: {error}",
                self.directory.display()
            );
        }
    }
}

/// Creates `specs` through `bootstrap` and waits until every partition has
/// a leader and as many in-sync replicas as the spec asks for.
pub(crate) async fn create_topics_on(bootstrap: &str, specs: &[TopicSpec]) {
    let settings = KafkaSettings::for_bootstrap(bootstrap);
    quire_queue::ensure_topics(&settings, specs)
        .await
        .unwrap_or_else(|error| {
            panic!("cannot create topics on the private broker(s) {bootstrap}: {error}")
        });
    let client: BaseConsumer = client_config(bootstrap).create().expect("metadata client");
    for spec in specs {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = client
                .fetch_metadata(Some(&spec.name), Duration::from_secs(5))
                .is_ok_and(|metadata| {
                    metadata.topics().iter().any(|topic| {
                        topic.error().is_none()
                            && topic.partitions().len() as i32 == spec.partitions
                            && topic.partitions().iter().all(|partition| {
                                partition.leader() >= 0
                                    && partition.isr().len() as i32 >= spec.replication
                            })
                    })
                });
            if ready {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "topic {} has no leaders (or too few in-sync replicas) on {bootstrap} after 30 s",
                spec.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A three-node KRaft cluster owned by one test: each node broker and
/// controller, a static quorum of the three, every internal topic with
/// three replicas and `min.insync.replicas=2`, as production runs. Nodes
/// are killed and started one by one; the cluster goes when dropped.
pub struct KafkaCluster {
    /// Every node's PLAINTEXT listener, comma-separated.
    pub bootstrap: String,
    nodes: Vec<KafkaProcess>,
}

impl KafkaCluster {
    /// Formats and starts `size` nodes; returns once each answers.
    pub fn start_new(size: u32) -> KafkaCluster {
        let ports: Vec<(u16, u16)> = crate::free_ports(2 * size as usize)
            .chunks(2)
            .map(|pair| (pair[0], pair[1]))
            .collect();
        let voters = ports
            .iter()
            .enumerate()
            .map(|(index, (_, controller))| format!("{}@127.0.0.1:{controller}", index + 1))
            .collect::<Vec<_>>()
            .join(",");
        let cluster_id = uuid_for_kafka();
        let mut nodes: Vec<KafkaProcess> = ports
            .iter()
            .enumerate()
            .map(|(index, &(broker, controller))| {
                let node = KafkaProcess::prepare(
                    index as u32 + 1,
                    broker,
                    controller,
                    Some(voters.clone()),
                    size,
                );
                node.format_storage(&cluster_id);
                node
            })
            .collect();
        // A quorum forms only once a majority runs: start all, then wait.
        for node in &mut nodes {
            node.spawn();
        }
        for node in &mut nodes {
            node.wait_until_ready();
        }
        KafkaCluster {
            bootstrap: nodes
                .iter()
                .map(|node| node.bootstrap.as_str())
                .collect::<Vec<_>>()
                .join(","),
            nodes,
        }
    }

    /// Settings for clients of the whole cluster.
    pub fn settings(&self) -> KafkaSettings {
        KafkaSettings::for_bootstrap(&self.bootstrap)
    }

    /// Creates topics and waits until each partition has its replicas in sync.
    pub async fn create_topics(&self, specs: &[TopicSpec]) {
        create_topics_on(&self.bootstrap, specs).await;
    }

    /// SIGKILLs node `node_id`.
    pub fn kill(&mut self, node_id: u32) {
        self.node(node_id).kill();
    }

    /// Starts node `node_id` again and waits until it answers.
    pub fn start(&mut self, node_id: u32) {
        self.node(node_id).start();
    }

    /// The node leading `topic`'s `partition` now (metadata from any node).
    pub fn leader_of(&self, topic: &str, partition: i32) -> u32 {
        let client: BaseConsumer = client_config(&self.bootstrap)
            .set("log_level", "0")
            .create()
            .expect("metadata client");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let leader = client
                .fetch_metadata(Some(topic), Duration::from_secs(5))
                .ok()
                .and_then(|metadata| {
                    metadata
                        .topics()
                        .iter()
                        .find(|found| found.name() == topic)
                        .and_then(|found| {
                            found
                                .partitions()
                                .iter()
                                .find(|found| found.id() == partition)
                                .map(|found| found.leader())
                        })
                })
                .filter(|leader| *leader > 0);
            if let Some(leader) = leader {
                return leader as u32;
            }
            assert!(
                Instant::now() < deadline,
                "{topic}[{partition}] has no leader after 30 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The broker log of node `node_id`, lines containing any of `needles`.
    pub fn log_lines_containing(&self, node_id: u32, needles: &[&str]) -> String {
        self.nodes[node_id as usize - 1].log_lines_containing(needles)
    }

    fn node(&mut self, node_id: u32) -> &mut KafkaProcess {
        let count = self.nodes.len();
        self.nodes
            .get_mut(node_id as usize - 1)
            .unwrap_or_else(|| panic!("node {node_id} of a {count}-node cluster"))
    }
}

/// The `__transaction_state` partition that coordinates `transactional_id`
/// among `partitions`: Kafka's `Utils.abs(id.hashCode()) % partitions`, with
/// Java's `String.hashCode`.
pub fn transaction_state_partition(transactional_id: &str, partitions: i32) -> i32 {
    let hash = transactional_id.encode_utf16().fold(0i32, |hash, unit| {
        hash.wrapping_mul(31).wrapping_add(i32::from(unit))
    });
    let abs = if hash == i32::MIN { 0 } else { hash.abs() };
    abs % partitions
}

fn client_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    config
}

/// A cluster id as Kafka's `random-uuid` prints it: 16 random bytes in
/// URL-safe base64 without padding (22 characters), never starting with `-`
/// (Kafka's `Uuid.randomUuid` draws again too: the command line would read
/// such an id as an option).
fn uuid_for_kafka() -> String {
    loop {
        let id = random_base64_id();
        if !id.starts_with('-') {
            return id;
        }
    }
}

fn random_base64_id() -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let mut bits: u32 = 0;
    let mut bit_count = 0;
    let mut text = String::with_capacity(22);
    for byte in bytes {
        bits = ((bits << 8) | u32::from(byte)) & 0xffff;
        bit_count += 8;
        while bit_count >= 6 {
            bit_count -= 6;
            text.push(ALPHABET[((bits >> bit_count) & 63) as usize] as char);
        }
    }
    if bit_count > 0 {
        text.push(ALPHABET[((bits << (6 - bit_count)) & 63) as usize] as char);
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_ids_are_22_url_safe_characters_never_starting_with_a_dash() {
        for _ in 0..2000 {
            let id = super::uuid_for_kafka();
            assert_eq!(id.len(), 22, "{id}");
            assert!(!id.starts_with('-'), "{id}");
            assert!(
                id.bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_'),
                "{id}"
            );
        }
    }

    #[test]
    fn the_coordinating_partition_follows_java_string_hash_code() {
        // "abc".hashCode() == 96354; "polygenelubricants".hashCode() == i32::MIN.
        assert_eq!(super::transaction_state_partition("abc", 50), 96354 % 50);
        assert_eq!(
            super::transaction_state_partition("polygenelubricants", 50),
            0
        );
    }
}

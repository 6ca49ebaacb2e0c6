//! A private Kafka broker for the tests that stop and restart Kafka: one
//! KRaft node (broker and controller) started from the local stack's cached
//! jars, as a child process, on free loopback ports, with its data in a
//! directory of its own.
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

/// A one-node KRaft broker owned by one test; killed and deleted when dropped.
pub struct KafkaProcess {
    /// `127.0.0.1:<port>` of the PLAINTEXT listener.
    pub bootstrap: String,
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
        let broker_port = crate::free_port();
        let controller_port = crate::free_port();
        let mut process = KafkaProcess {
            bootstrap: format!("127.0.0.1:{broker_port}"),
            controller_port,
            directory,
            libraries,
            log4j_configuration: repository.join("deploy/local/log4j2.properties"),
            child: None,
        };
        process.write_configuration(broker_port);
        process.format_storage();
        process.start();
        process
    }

    /// Settings for clients of this broker.
    pub fn settings(&self) -> KafkaSettings {
        KafkaSettings::for_bootstrap(&self.bootstrap)
    }

    /// Starts the broker (again) on the same ports and data directory and
    /// waits until it answers a metadata request.
    pub fn start(&mut self) {
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
        self.wait_until_ready();
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
        let settings = self.settings();
        quire_queue::ensure_topics(&settings, specs)
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot create topics on the private broker {}: {error}",
                    self.bootstrap
                )
            });
        let client: BaseConsumer = client_config(&self.bootstrap)
            .create()
            .expect("metadata client");
        for spec in specs {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let ready = client
                    .fetch_metadata(Some(&spec.name), Duration::from_secs(5))
                    .is_ok_and(|metadata| {
                        metadata.topics().iter().any(|topic| {
                            topic.error().is_none()
                                && topic.partitions().len() as i32 == spec.partitions
                                && topic
                                    .partitions()
                                    .iter()
                                    .all(|partition| partition.leader() >= 0)
                        })
                    });
                if ready {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "topic {} has no leaders on the private broker after 30 s",
                    spec.name
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The broker's own log, for a failure message.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = fs::read_to_string(self.directory.join("server.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
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
        let configuration = format!(
            "# A private broker of one quire test (tests/kafka_process.rs).\n\
             process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}\n\
             listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}\n\
             controller.listener.names=CONTROLLER\n\
             inter.broker.listener.name=PLAINTEXT\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
             log.dirs={}\n\
             num.partitions=1\n\
             default.replication.factor=1\n\
             min.insync.replicas=1\n\
             offsets.topic.replication.factor=1\n\
             offsets.topic.num.partitions=3\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             transaction.state.log.num.partitions=3\n\
             share.coordinator.state.topic.replication.factor=1\n\
             share.coordinator.state.topic.min.isr=1\n\
             group.initial.rebalance.delay.ms=0\n\
             auto.create.topics.enable=false\n",
            data.to_string_lossy()
        );
        fs::write(self.configuration_path(), configuration).expect("write server.properties");
    }

    fn format_storage(&self) {
        let cluster_id = uuid_for_kafka();
        let output = self
            .java()
            .args([
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                "-t",
                &cluster_id,
                "-c",
                &self.configuration_path(),
            ])
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
}

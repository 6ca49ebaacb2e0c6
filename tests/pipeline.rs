//! End-to-end harness: a stack of unique topics and a unique bucket per test,
//! the producer API and report generators started as child processes of the
//! real binaries, typed request helpers, and the exactly-once checks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quire_config::{KafkaSettings, Settings, TopicNames};
use report_generator::{Application, Mode, RunSummary, WorkerError};
use serde_json::{Value, json};

use crate::kafka_process::{KafkaCluster, KafkaProcess};
use crate::s3::{TestBucket, s3_settings};
use crate::{kafka_settings, read_all, unique};

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
        let topics = Self::topic_names(prefix);
        let mut guards = Vec::new();
        for spec in quire_queue::design_topics(&topics, 1) {
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
            &quire_queue::design_topics(&topics, replication),
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
        }
    }

    /// The environment a service of this stack runs with.
    pub fn environment(&self) -> Vec<(String, String)> {
        let s3 = s3_settings();
        vec![
            (
                "QUIRE_KAFKA__BOOTSTRAP_SERVERS".into(),
                self.kafka.bootstrap_servers.clone(),
            ),
            (
                "QUIRE_KAFKA__TOPICS__RECORDS".into(),
                self.topics.records.clone(),
            ),
            (
                "QUIRE_KAFKA__TOPICS__REPORT_EVENTS".into(),
                self.topics.report_events.clone(),
            ),
            (
                "QUIRE_KAFKA__TOPICS__WATERMARKS".into(),
                self.topics.watermarks.clone(),
            ),
            (
                "QUIRE_KAFKA__TOPICS__DEAD_LETTERS".into(),
                self.topics.dead_letters.clone(),
            ),
            // A stopped static member's partitions move after this long.
            ("QUIRE_WORKER__SESSION_TIMEOUT_MS".into(), "6000".into()),
            ("QUIRE_S3__ENDPOINT".into(), s3.endpoint),
            ("QUIRE_S3__REGION".into(), s3.region),
            ("QUIRE_S3__BUCKET".into(), self.bucket.name.clone()),
            ("QUIRE_WORKER__GROUP_ID".into(), self.group.clone()),
            ("QUIRE_WORKER__MAX_WAIT_MS".into(), "200".into()),
            (
                "QUIRE_API__TRANSACTIONAL_ID_PREFIX".into(),
                unique("test-api"),
            ),
            (
                "QUIRE_WORKER__TRANSACTIONAL_ID_PREFIX".into(),
                unique("test-worker"),
            ),
            // Workers run side by side: each serves its metrics on a free port.
            ("QUIRE_WORKER__METRICS_LISTEN".into(), "127.0.0.1:0".into()),
        ]
    }

    /// Typed settings of a report generator of this stack: what
    /// [`environment`](Self::environment) sets, as [`Settings`], for a
    /// worker started in this process.
    pub fn worker_settings(&self, replica: &str) -> Settings {
        let mut settings = quire_config::defaults();
        settings.kafka = self.kafka.clone();
        settings.kafka.topics = self.topics.clone();
        settings.s3 = s3_settings();
        settings.s3.bucket = self.bucket.name.clone();
        let worker = &mut settings.worker;
        worker.replica_id = replica.to_owned();
        worker.group_id = self.group.clone();
        worker.transactional_id_prefix = unique("test-worker");
        worker.max_wait_ms = 200;
        worker.session_timeout_ms = 6000;
        worker.metrics_listen = "127.0.0.1:0".into();
        settings
    }

    /// Starts a report generator in this process, as `main.rs` does
    /// (`Application::build`, then `run_until`); returns once its
    /// monitoring port is bound.
    pub async fn start_worker_in_process(&self, settings: Settings, mode: Mode) -> InProcessWorker {
        let application = Application::build(settings, mode)
            .await
            .expect("the report generator starts");
        let port = application.port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(application.run_until(async move {
            let _ = stopped.await;
        }));
        InProcessWorker {
            port,
            stop: Some(stop),
            run,
        }
    }

    /// Starts the producer API on a free port and waits until it is ready.
    pub async fn start_api(&self) -> ApiProcess {
        self.start_api_with(&[]).await
    }

    /// [`start_api`](Self::start_api) with extra settings (e.g. the
    /// transactional id prefix of an earlier API, to restart "the same"
    /// replica).
    pub async fn start_api_with(&self, extra: &[(&str, &str)]) -> ApiProcess {
        let port = crate::free_port();
        let mut command = service_command("producer-api", &self.environment());
        command.env("QUIRE_API__LISTEN", format!("127.0.0.1:{port}"));
        for (key, value) in extra {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .expect("start producer-api (is it built? deploy/local/test builds it)");
        let api = ApiProcess {
            child,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(response) = api.http.get(format!("{}/healthz", api.base)).send().await
                && response.status().is_success()
            {
                return api;
            }
            assert!(
                Instant::now() < deadline,
                "producer-api did not become healthy"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts a report generator as replica `replica`, with extra settings.
    pub fn spawn_worker(
        &self,
        replica: &str,
        extra: &[(&str, &str)],
        drain: bool,
    ) -> WorkerProcess {
        let mut command = service_command("report-generator", &self.environment());
        command.env("QUIRE_WORKER__REPLICA_ID", replica);
        for (key, value) in extra {
            command.env(key, value);
        }
        if drain {
            command.arg("--drain");
        }
        WorkerProcess {
            child: command
                .spawn()
                .expect("start report-generator (is it built?)"),
        }
    }

    /// Starts a report generator like [`spawn_worker`](Self::spawn_worker)
    /// and waits (bounded) until it logs where it serves `/metrics`,
    /// `/healthz` and `/readyz` (the `metrics_address` field; its metrics
    /// port is a free one). Returns it and that server's base URL. The
    /// worker logs JSON here; its lines still reach the test's stderr.
    pub fn spawn_monitored_worker(
        &self,
        replica: &str,
        extra: &[(&str, &str)],
        drain: bool,
    ) -> (WorkerProcess, String) {
        let mut command = service_command("report-generator", &self.environment());
        command
            .env("QUIRE_WORKER__REPLICA_ID", replica)
            .env("QUIRE_LOG__FORMAT", "json")
            .env(
                "RUST_LOG",
                format!(
                    "{},report_generator::monitoring=info",
                    std::env::var("QUIRE_TEST_SERVICE_LOG").unwrap_or_else(|_| "warn".into())
                ),
            )
            .stderr(Stdio::piped());
        for (key, value) in extra {
            command.env(key, value);
        }
        if drain {
            command.arg("--drain");
        }
        let mut child = command
            .spawn()
            .expect("start report-generator (is it built?)");
        let stderr = child.stderr.take().expect("piped stderr");
        let (address_sender, address) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                if let Some(found) = serde_json::from_str::<Value>(&line)
                    .ok()
                    .and_then(|entry| entry["metrics_address"].as_str().map(str::to_owned))
                {
                    let _ = address_sender.send(found);
                }
            }
        });
        let mut worker = WorkerProcess { child };
        let Ok(found) = address.recv_timeout(Duration::from_secs(30)) else {
            let exited = worker.exited();
            panic!("report-generator logged no metrics_address within 30 s (exited: {exited:?})");
        };
        (worker, format!("http://{found}"))
    }

    /// Everything the pipeline published and stored, read back independently.
    pub async fn observe(&self) -> Observed {
        let kafka = &self.kafka;
        let events: Vec<Value> = read_all(kafka, &self.topics.report_events, 3, true)
            .into_iter()
            .map(|message| serde_json::from_slice(&message.payload).expect("event JSON"))
            .collect();
        let dead_letters: Vec<Value> = read_all(kafka, &self.topics.dead_letters, 3, true)
            .into_iter()
            .map(|message| serde_json::from_slice(&message.payload).expect("dead letter JSON"))
            .collect();
        let mut reports = BTreeMap::new();
        for key in self.bucket.list("manifests/").await {
            let manifest: Value =
                serde_json::from_slice(&self.bucket.read(&key).await.expect("manifest"))
                    .expect("manifest JSON");
            let document_key = manifest["key"].as_str().expect("manifest key").to_owned();
            let document = self
                .bucket
                .read(&document_key)
                .await
                .expect("document of a manifest");
            reports.insert(
                manifest["report_id"].as_str().unwrap().to_owned(),
                Report { manifest, document },
            );
        }
        Observed {
            events,
            dead_letters,
            reports,
            pending_uploads: self.bucket.pending_uploads("").await.len(),
        }
    }

    /// Waits until `done` holds for what is observed and the observation is
    /// settled (every stored report's event is published: a report's objects
    /// are written before the transaction that announces it) (bounded).
    pub async fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        done: impl Fn(&Observed) -> bool,
    ) -> Observed {
        let deadline = Instant::now() + limit;
        loop {
            let observed = self.observe().await;
            if observed.settled() && done(&observed) {
                return observed;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {} events, {} reports, {} dead letters",
                observed.events.len(),
                observed.reports.len(),
                observed.dead_letters.len()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// A report as stored: its manifest and its document's bytes.
#[derive(Debug, Clone)]
pub struct Report {
    pub manifest: Value,
    pub document: Vec<u8>,
}

impl Report {
    /// The records of the document, each as (field name -> text) of its
    /// child elements, parsed by an independent XML parser.
    pub fn records(&self) -> Vec<BTreeMap<String, String>> {
        let text = std::str::from_utf8(&self.document).expect("UTF-8 document");
        let document = roxmltree::Document::parse(text).expect("well-formed XML");
        let root = document.root_element();
        root.children()
            .filter(|node| node.is_element() && node.tag_name().name() != "summary")
            .map(|record| {
                record
                    .children()
                    .filter(|node| node.is_element())
                    .map(|field| {
                        (
                            field.tag_name().name().to_owned(),
                            field.text().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .collect()
    }

    pub fn summary_records(&self) -> u64 {
        let text = std::str::from_utf8(&self.document).expect("UTF-8 document");
        let document = roxmltree::Document::parse(text).expect("well-formed XML");
        let summary = document
            .root_element()
            .children()
            .rev()
            .find(|node| node.is_element())
            .expect("a summary element");
        summary
            .attribute("records")
            .expect("records attribute")
            .parse()
            .unwrap()
    }

    pub fn stream(&self) -> &str {
        self.manifest["stream"].as_str().unwrap()
    }
}

/// What a test reads back after the pipeline ran.
#[derive(Debug, Clone)]
pub struct Observed {
    pub events: Vec<Value>,
    pub dead_letters: Vec<Value>,
    pub reports: BTreeMap<String, Report>,
    pub pending_uploads: usize,
}

impl Observed {
    /// Every stored report has its event (none is between its S3 write and
    /// its transaction).
    pub fn settled(&self) -> bool {
        self.reports.keys().all(|id| {
            self.events
                .iter()
                .any(|event| event["report_id"].as_str() == Some(id.as_str()))
        })
    }

    /// The `seq` values of every record in every report of `stream`, in
    /// report order (by partition and offset) then document order.
    pub fn sequence_numbers(&self, stream: &str) -> Vec<u64> {
        let mut reports: Vec<&Report> = self
            .reports
            .values()
            .filter(|report| report.stream() == stream)
            .collect();
        reports.sort_by_key(|report| {
            (
                report.manifest["partition"].as_i64(),
                report.manifest["first_offset"].as_i64(),
            )
        });
        reports
            .iter()
            .flat_map(|report| report.records())
            .map(|record| {
                record
                    .get("seq")
                    .expect("seq field")
                    .parse()
                    .expect("seq number")
            })
            .collect()
    }

    /// The exactly-once checks: every record sent (`sent[stream]` = its
    /// sequence numbers) is in exactly one completed report, every report's
    /// event was published exactly once, every document matches its
    /// manifest, and no multipart upload is pending.
    pub fn assert_exactly_once(&self, sent: &BTreeMap<String, Vec<u64>>) {
        for (stream, sequence) in sent {
            let reported = self.sequence_numbers(stream);
            let expected: Vec<u64> = sequence.clone();
            let mut reported_sorted = reported.clone();
            reported_sorted.sort_unstable();
            let mut expected_sorted = expected.clone();
            expected_sorted.sort_unstable();
            assert_eq!(
                reported_sorted.len(),
                expected_sorted.len(),
                "stream {stream}: records reported {} != sent {}",
                reported.len(),
                expected.len()
            );
            assert_eq!(
                reported_sorted, expected_sorted,
                "stream {stream}: a record is missing or doubled"
            );
        }
        let mut event_ids = BTreeSet::new();
        for event in &self.events {
            let id = event["report_id"]
                .as_str()
                .expect("event report id")
                .to_owned();
            assert!(
                event_ids.insert(id.clone()),
                "event of {id} published twice"
            );
            let report = self
                .reports
                .get(&id)
                .unwrap_or_else(|| panic!("event of {id} without a stored report"));
            assert_eq!(
                event["sha256"], report.manifest["sha256"],
                "event and manifest of {id} disagree"
            );
        }
        for (id, report) in &self.reports {
            assert!(
                event_ids.contains(id),
                "report {id} stored but its event was never published"
            );
            use sha2::Digest;
            let digest = sha2::Sha256::digest(&report.document);
            let hex = hex::encode(digest);
            assert_eq!(
                report.manifest["sha256"].as_str(),
                Some(hex.as_str()),
                "document {id} does not match its manifest"
            );
            assert_eq!(
                report.manifest["bytes"].as_u64(),
                Some(report.document.len() as u64)
            );
            assert_eq!(
                report.summary_records(),
                report.records().len() as u64,
                "summary of {id}"
            );
        }
        assert_eq!(self.pending_uploads, 0, "multipart uploads left pending");
    }
}

pub struct ApiProcess {
    child: Child,
    pub base: String,
    pub http: reqwest::Client,
}

impl ApiProcess {
    /// Sends records; returns the answer's status and body.
    pub async fn send(&self, stream: &str, records: &[Value]) -> (u16, Value) {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/records", self.base))
            .json(&records)
            .send()
            .await
            .expect("records request");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    /// Sends records and asserts they were accepted.
    pub async fn send_ok(&self, stream: &str, records: &[Value]) -> Vec<String> {
        let (status, body) = self.send(stream, records).await;
        assert_eq!(status, 200, "records refused: {body}");
        body["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|id| id.as_str().unwrap().to_owned())
            .collect()
    }

    /// One attempt at sending records under an `Idempotency-Key`, waiting
    /// at most `timeout`. `Err` when no answer came in time (or at all).
    pub async fn send_keyed(
        &self,
        stream: &str,
        records: &[Value],
        idempotency_key: &str,
        timeout: Duration,
    ) -> Result<Answer, reqwest::Error> {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/records", self.base))
            .header("idempotency-key", idempotency_key)
            .json(&records)
            .timeout(timeout)
            .send()
            .await?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        Ok(Answer {
            status,
            retry_after,
            body: response.json().await.unwrap_or(Value::Null),
        })
    }

    /// Sends one array under one fresh `Idempotency-Key` until it is
    /// accepted, as a careful producer would: after a 503 or a 429 it waits
    /// what `Retry-After` says (1 s without one), after no answer 1 s, then
    /// sends the same body with the same key again. Stops at the first other
    /// answer, or once `limit` has passed. Every attempt is returned, in order.
    pub async fn send_until_accepted(
        &self,
        stream: &str,
        records: &[Value],
        attempt_timeout: Duration,
        limit: Duration,
    ) -> Vec<Attempt> {
        let idempotency_key = uuid::Uuid::new_v4().to_string();
        let deadline = Instant::now() + limit;
        let mut attempts = Vec::new();
        loop {
            let sent_at = Instant::now();
            let outcome = self
                .send_keyed(stream, records, &idempotency_key, attempt_timeout)
                .await
                .map_err(|error| NoAnswer {
                    timed_out: error.is_timeout(),
                    message: error.to_string(),
                });
            let pause = match &outcome {
                // 409: the first request with this key is still being
                // handled (its client gave up waiting); its answer comes on a
                // retry.
                Ok(answer) if matches!(answer.status, 409 | 429 | 503) => answer
                    .retry_after
                    .unwrap_or(Duration::from_secs(1))
                    .max(Duration::from_millis(100)),
                Ok(_) => Duration::ZERO,
                Err(_) => Duration::from_secs(1),
            };
            let settled = outcome.is_ok() && pause.is_zero();
            attempts.push(Attempt {
                sent_at,
                answered_at: Instant::now(),
                outcome,
            });
            if settled || Instant::now() + pause > deadline {
                return attempts;
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Cuts the stream; returns the report id.
    pub async fn cut(&self, stream: &str) -> String {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/reports", self.base))
            .send()
            .await
            .expect("cut request");
        assert_eq!(response.status().as_u16(), 202);
        let body: Value = response.json().await.unwrap();
        body["report_id"].as_str().expect("report id").to_owned()
    }

    pub async fn put_definition(&self, stream: &str, definition: Value) {
        let response = self
            .http
            .put(format!("{}/v1/streams/{stream}/definition", self.base))
            .json(&definition)
            .send()
            .await
            .expect("definition request");
        assert_eq!(
            response.status().as_u16(),
            202,
            "{:?}",
            response.text().await
        );
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    pub async fn get_bytes(&self, path: &str) -> (u16, Vec<u8>) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        (
            response.status().as_u16(),
            response.bytes().await.expect("body").to_vec(),
        )
    }

    /// Waits until report `id` is completed; returns its status body.
    pub async fn wait_completed(&self, id: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let (status, body) = self.get(&format!("/v1/reports/{id}")).await;
            assert_eq!(status, 200, "status of {id}: {body}");
            if body["status"] == "completed" {
                return body;
            }
            assert!(Instant::now() < deadline, "report {id} still {body}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// One attempt of [`ApiProcess::send_until_accepted`].
#[derive(Debug, Clone)]
pub struct Attempt {
    pub sent_at: Instant,
    pub answered_at: Instant,
    pub outcome: Result<Answer, NoAnswer>,
}

impl Attempt {
    pub fn accepted(&self) -> bool {
        matches!(&self.outcome, Ok(answer) if answer.status == 200)
    }
}

/// A request that got no answer: the client's timeout, or no connection.
#[derive(Debug, Clone)]
pub struct NoAnswer {
    pub timed_out: bool,
    pub message: String,
}

/// An answer of the API: its status, its `Retry-After` (whole seconds, as
/// the API sends it) and its JSON body (`Null` if none).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<Duration>,
    pub body: Value,
}

impl Drop for ApiProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A report generator running in the test's process.
pub struct InProcessWorker {
    /// Where its `/metrics`, `/healthz` and `/readyz` answer.
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    run: tokio::task::JoinHandle<Result<RunSummary, WorkerError>>,
}

impl InProcessWorker {
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Resolves its shutdown future (what SIGTERM does to the binary) and
    /// waits (bounded) for it to finish: what it did, or why it failed.
    pub async fn stop(mut self, limit: Duration) -> Result<RunSummary, WorkerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(limit, &mut self.run)
            .await
            .unwrap_or_else(|_| panic!("the in-process worker did not stop within {limit:?}"))
            .expect("the worker task ended without a panic")
    }
}

impl Drop for InProcessWorker {
    fn drop(&mut self) {
        self.run.abort();
    }
}

pub struct WorkerProcess {
    child: Child,
}

impl WorkerProcess {
    /// The process id (for /proc/<pid>/status).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// `Some(exit status)` once the process has exited, `None` while it runs.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Sends SIGTERM and waits (bounded); returns the exit code and how long it took.
    pub fn terminate(&mut self, limit: Duration) -> (Option<i32>, Duration) {
        let started = Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        (self.wait(limit), started.elapsed())
    }

    /// Waits for the process to exit (bounded); its exit code.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("worker did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A release binary of the workspace (a service, the CLI), built beside the
/// test binary.
pub fn release_binary(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().expect("test binary path");
    // target/release/deps/integration-... -> target/release/<name>
    let binary: PathBuf = test_binary
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory")
        .join(name);
    assert!(
        binary.exists(),
        "{} is not built: run deploy/local/test (it builds every binary)",
        binary.display()
    );
    binary
}

/// The release binary of a service, with the test's environment.
fn service_command(name: &str, environment: &[(String, String)]) -> Command {
    let mut command = Command::new(release_binary(name));
    command
        .envs(
            environment
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_str())),
        )
        .env(
            "RUST_LOG",
            std::env::var("QUIRE_TEST_SERVICE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null());
    command
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

//! The services of a [`TestStack`] as the tests and benchmarks start them:
//! the real release binaries as child processes, or the libraries in this
//! process (zero2prod's `spawn_app`), configured through typed [`Settings`].
//! A test that kills or signals a service, or runs another build of it
//! (`QUIRE_TEST_BINARY_DIR`), needs the process; any other may start the
//! service in process, which is quicker and shares the test's runtime.
//!
//! A [`Launch`] is the one place a service's command is built: the typed
//! settings become the `QUIRE_<SECTION>__<KEY>` variables the service
//! reads back ([`environment_of`]), and the test's own configuration
//! variables are not inherited, so a test's broker or bucket is the one its
//! settings name, whatever the shell exported.

use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quire_config::{LogFormat, Settings};
use report_generator::{Application, Mode, RunSummary, WorkerError};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::client::ApiClient;
use crate::stack::TestStack;

/// The producer API or the report generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Api,
    Worker,
}

impl Service {
    fn binary(self) -> &'static str {
        match self {
            Service::Api => "producer-api",
            Service::Worker => "report-generator",
        }
    }
}

/// How to start one service: its typed settings, and what is not
/// configuration (a failpoint, a variable of the process, `--drain`).
#[derive(Debug, Clone)]
pub struct Launch {
    pub service: Service,
    pub settings: Settings,
    variables: Vec<(String, String)>,
    drain: bool,
    /// Where the log goes instead of stderr, and its filter.
    log: Option<(PathBuf, String)>,
    /// The `RUST_LOG` filter of a monitored worker, instead of
    /// `QUIRE_TEST_SERVICE_LOG` (`warn`).
    filter: Option<String>,
    /// Another build of the service to run instead of the workspace's
    /// release binary (a benchmark's baseline).
    binary: Option<PathBuf>,
}

impl TestStack {
    /// The producer API of this stack, to configure and start.
    pub fn api(&self) -> Launch {
        Launch::new(Service::Api, self.settings())
    }

    /// Report generator `replica` of this stack, to configure and start.
    pub fn worker(&self, replica: &str) -> Launch {
        Launch::new(Service::Worker, self.worker_settings(replica))
    }

    /// Starts the producer API with this stack's settings; see
    /// [`Launch::start_api`].
    pub async fn start_api(&self) -> ApiProcess {
        self.api().start_api().await
    }

    /// Starts the producer API with this stack's settings in this process;
    /// see [`Launch::start_api_in_process`].
    pub async fn start_api_in_process(&self) -> InProcessApi {
        self.api().start_api_in_process().await
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
}

impl Launch {
    pub fn new(service: Service, settings: Settings) -> Launch {
        Launch {
            service,
            settings,
            variables: Vec::new(),
            drain: false,
            log: None,
            filter: None,
            binary: None,
        }
    }

    /// Writes the service's log, at the `RUST_LOG` filter `filter`, to the
    /// file `path` instead of the test's stderr (to read what it logged).
    pub fn log_to(mut self, path: &std::path::Path, filter: &str) -> Launch {
        self.log = Some((path.to_owned(), filter.to_owned()));
        self
    }

    /// Logs the service at the `RUST_LOG` filter `filter` (still to the
    /// test's stderr), for a test whose failure needs its story.
    pub fn log_filter(mut self, filter: &str) -> Launch {
        self.filter = Some(filter.to_owned());
        self
    }

    /// Changes the typed settings.
    pub fn with(mut self, configure: impl FnOnce(&mut Settings)) -> Launch {
        configure(&mut self.settings);
        self
    }

    /// Sets a variable of the process that is not configuration (`TMPDIR`).
    pub fn variable(mut self, name: &str, value: &str) -> Launch {
        self.variables.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Arms a report generator's failpoint (`QUIRE_WORKER_FAILPOINT`, read
    /// by release builds too: see `report_generator::worker`).
    pub fn failpoint(self, name: &str) -> Launch {
        self.variable("QUIRE_WORKER_FAILPOINT", name)
    }

    /// Runs the service from the executable at `path` (another build of it,
    /// such as a benchmark's baseline) instead of the workspace's release
    /// binary; `None` keeps the release binary.
    pub fn binary(mut self, path: Option<&std::path::Path>) -> Launch {
        self.binary = path.map(ToOwned::to_owned);
        self
    }

    /// Runs a report generator with `--drain`: it exits once it has read
    /// its partitions to their end.
    pub fn drain(mut self) -> Launch {
        self.drain = true;
        self
    }

    /// The service's `RUST_LOG`: its [`log_filter`](Self::log_filter), else
    /// `QUIRE_TEST_SERVICE_LOG`, else `warn`.
    fn rust_log(&self) -> String {
        self.filter.clone().unwrap_or_else(|| {
            std::env::var("QUIRE_TEST_SERVICE_LOG").unwrap_or_else(|_| "warn".into())
        })
    }

    /// The service's command: its release binary, its settings as
    /// variables, logs at `QUIRE_TEST_SERVICE_LOG` (a `RUST_LOG` filter,
    /// `warn` by default) on the test's stderr, no stdin.
    pub fn command(&self) -> Command {
        let mut command = Command::new(
            self.binary
                .clone()
                .unwrap_or_else(|| release_binary(self.service.binary())),
        );
        for (name, _) in std::env::vars() {
            if quire_config::is_setting_variable(&name) || name == "QUIRE_CONFIG" {
                command.env_remove(name);
            }
        }
        command
            .envs(environment_of(&self.settings))
            .envs(self.variables.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("RUST_LOG", self.rust_log())
            .stdin(Stdio::null());
        if let Some((path, filter)) = &self.log {
            let file = std::fs::File::create(path).expect("create the service's log file");
            command.env("RUST_LOG", filter).stderr(file);
        }
        if self.drain {
            command.arg("--drain");
        }
        command
    }

    /// Starts the producer API on a free loopback port and waits until it
    /// is healthy, at most `limit`.
    pub async fn try_start_api(mut self, limit: Duration) -> Result<ApiProcess, String> {
        assert_eq!(self.service, Service::Api, "try_start_api of a worker");
        let port = crate::free_port();
        self.settings.api.listen = format!("127.0.0.1:{port}");
        let child = self
            .command()
            .spawn()
            .map_err(|error| format!("cannot start producer-api: {error}"))?;
        let mut api = ApiProcess {
            child,
            client: ApiClient::new(format!("http://127.0.0.1:{port}")),
        };
        let started = Instant::now();
        loop {
            if let Ok(response) = api.http.get(format!("{}/healthz", api.base)).send().await
                && response.status().is_success()
            {
                return Ok(api);
            }
            if let Ok(Some(status)) = api.child.try_wait() {
                return Err(format!(
                    "producer-api exited ({status}) before it was healthy"
                ));
            }
            if started.elapsed() > limit {
                return Err(format!("producer-api was not healthy within {limit:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// [`try_start_api`](Self::try_start_api) within 60 s, or the test fails.
    pub async fn start_api(self) -> ApiProcess {
        self.try_start_api(Duration::from_secs(60))
            .await
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// Starts the producer API in this process, as `main.rs` does
    /// (`Application::build`, then `run_until`), on a free loopback port;
    /// returns once it is bound and connected (it answers from then on).
    /// What only a process has (variables, a log file, another binary) is
    /// refused: such a test needs [`start_api`](Self::start_api).
    pub async fn start_api_in_process(mut self) -> InProcessApi {
        assert_eq!(
            self.service,
            Service::Api,
            "start_api_in_process of a worker"
        );
        assert!(
            self.variables.is_empty() && self.log.is_none() && self.binary.is_none(),
            "variables, a log file or another binary need the API's process (start_api)"
        );
        self.settings.api.listen = "127.0.0.1:0".into();
        let application = producer_api::Application::build(self.settings)
            .await
            .expect("the producer api starts");
        let client = ApiClient::new(format!("http://127.0.0.1:{}", application.port()));
        let stop = CancellationToken::new();
        let run = tokio::spawn(application.run_until(stop.clone().cancelled_owned()));
        InProcessApi {
            client,
            stop,
            run: Some(run),
        }
    }

    /// Starts a report generator.
    pub fn spawn(self) -> WorkerProcess {
        assert_eq!(self.service, Service::Worker, "spawn of an API");
        WorkerProcess {
            child: self
                .command()
                .spawn()
                .expect("start report-generator (is it built?)"),
        }
    }

    /// Starts a report generator like [`spawn`](Self::spawn) and waits
    /// (bounded) until it logs where it serves `/metrics`, `/healthz` and
    /// `/readyz` (the `metrics_address` field; its metrics port is a free
    /// one). Returns it and that server's base URL. The worker logs JSON
    /// here; its lines still reach the test's stderr.
    pub fn spawn_monitored(mut self) -> (WorkerProcess, String) {
        assert_eq!(self.service, Service::Worker, "spawn_monitored of an API");
        self.settings.log.format = LogFormat::Json;
        let mut command = self.command();
        command
            .env(
                "RUST_LOG",
                format!("{},report_generator::monitoring=info", self.rust_log()),
            )
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .expect("start report-generator (is it built?)");
        let stderr = child.stderr.take().expect("piped stderr");
        let (address_sender, address) = std::sync::mpsc::channel();
        // Reads to the end whatever arrives: a reader that stopped early
        // would let the pipe fill, and the worker would block on its next
        // log line (a stall of the test's making).
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).split(b'\n') {
                let Ok(line) = line else { break };
                let line = String::from_utf8_lossy(&line);
                eprintln!("{line}");
                if let Some(found) = line
                    .contains("metrics_address")
                    .then(|| serde_json::from_str::<Value>(&line).ok())
                    .flatten()
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
}

/// The `QUIRE_<SECTION>__<KEY>` variables that configure a service as
/// `settings` does (lists joined with `,`; a pass-through Kafka property's
/// dots as `_`, which `KafkaSettings::client_properties` turns back): only
/// those that differ from the compiled-in defaults, so a service of an
/// earlier build, which refuses keys it does not know, starts with what a
/// test sets of the keys it knows (`QUIRE_TEST_BINARY_DIR`).
pub fn environment_of(settings: &Settings) -> Vec<(String, String)> {
    let defaults = every_variable_of(&quire_config::defaults());
    every_variable_of(settings)
        .into_iter()
        .filter(|variable| !defaults.contains(variable))
        .collect()
}

/// Every `QUIRE_` variable of `settings`, defaults included.
fn every_variable_of(settings: &Settings) -> Vec<(String, String)> {
    fn flatten(prefix: &str, value: &Value, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(fields) => {
                for (key, field) in fields {
                    let name = key.replace('.', "_").to_uppercase();
                    flatten(&format!("{prefix}__{name}"), field, out);
                }
            }
            // An empty list is the default (and "" would read back as [""]).
            Value::Array(items) if items.is_empty() => {}
            Value::Array(items) => {
                let joined = items
                    .iter()
                    .map(|item| {
                        item.as_str()
                            .map_or_else(|| item.to_string(), str::to_owned)
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                out.push((prefix.to_owned(), joined));
            }
            Value::String(text) => out.push((prefix.to_owned(), text.clone())),
            Value::Null => {}
            other => out.push((prefix.to_owned(), other.to_string())),
        }
    }
    let value = serde_json::to_value(settings).expect("settings serialize");
    let mut out = Vec::new();
    let Value::Object(sections) = value else {
        unreachable!("settings are a table")
    };
    for (section, fields) in &sections {
        flatten(
            &format!("QUIRE_{}", section.to_uppercase()),
            fields,
            &mut out,
        );
    }
    out
}

/// A producer API child process, killed when dropped; its requests are
/// [`ApiClient`]'s, to which it dereferences.
pub struct ApiProcess {
    pub(crate) child: Child,
    client: ApiClient,
}

impl Deref for ApiProcess {
    type Target = ApiClient;

    fn deref(&self) -> &ApiClient {
        &self.client
    }
}

impl ApiProcess {
    /// The process id (benchmarks read its CPU time from `/proc`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(exit status)` once the process has exited, `None` while it runs.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }
}

impl Drop for ApiProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A producer API running in the test's process (its tasks on the test's
/// runtime: a test that blocks its thread needs a multi-threaded runtime).
/// Dropping it cancels its token: it stops taking connections and stops its
/// background loops. Its requests are [`ApiClient`]'s, to which it
/// dereferences.
pub struct InProcessApi {
    client: ApiClient,
    stop: CancellationToken,
    run: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Deref for InProcessApi {
    type Target = ApiClient;

    fn deref(&self) -> &ApiClient {
        &self.client
    }
}

impl InProcessApi {
    /// Cancels its token (what SIGTERM does to the binary) and waits
    /// (bounded) until it has stopped serving.
    pub async fn stop(mut self, limit: Duration) -> std::io::Result<()> {
        self.stop.cancel();
        let run = self.run.take().expect("stopped once");
        tokio::time::timeout(limit, run)
            .await
            .unwrap_or_else(|_| panic!("the in-process api did not stop within {limit:?}"))
            .expect("the api task ended without a panic")
    }
}

impl Drop for InProcessApi {
    fn drop(&mut self) {
        self.stop.cancel();
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
    /// The process id (for `/proc/<pid>/status`).
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
/// test binary (`target/release/deps/`) or the bench (`target/release/`);
/// or, with `QUIRE_TEST_BINARY_DIR` set, the one in that directory: how a
/// fault test is shown to fail against an earlier build's services.
pub fn release_binary(name: &str) -> PathBuf {
    let running = std::env::current_exe().expect("test binary path");
    let mut directory = running.parent().expect("binary directory").to_path_buf();
    if directory.ends_with("deps") {
        directory.pop();
    }
    if let Some(other) = std::env::var_os("QUIRE_TEST_BINARY_DIR") {
        directory = PathBuf::from(other);
    }
    let binary = directory.join(name);
    assert!(
        binary.exists(),
        "{} is not built: run deploy/local/test (it builds every binary)",
        binary.display()
    );
    binary
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a service reads back from [`environment_of`] is the settings
    /// it was given, for every key (each changed from its default).
    #[test]
    fn a_service_reads_back_the_settings_it_was_given() {
        let mut settings = quire_config::defaults();
        settings.log.format = LogFormat::Json;
        settings.kafka.bootstrap_servers = "127.0.0.1:1,127.0.0.1:2".into();
        settings.kafka.transaction_timeout = Duration::from_millis(12_345);
        settings
            .kafka
            .properties
            .insert("ssl_ca_location".into(), "/etc/ca.pem".into());
        settings.kafka.topics.records = "t.records".into();
        settings.s3.bucket = "a-bucket".into();
        settings.s3.report_retention_days = std::num::NonZeroU32::new(3);
        settings.api.tokens = ["one", "two"]
            .map(|name| crate::client::token_line(name, name, "read+write", "*"))
            .to_vec();
        settings.api.max_in_flight_bytes = std::num::NonZero::new(4096).unwrap();
        settings.worker.replica_id = "w9".into();
        settings.worker.rollover_records = std::num::NonZero::new(3).unwrap();
        settings.worker.spill_dir = Some("/tmp/spill dir".into());
        let read_back =
            quire_config::load_with(None, environment_of(&settings)).expect("the variables load");
        assert_eq!(
            serde_json::to_value(&read_back).unwrap(),
            serde_json::to_value(&settings).unwrap()
        );
        let defaults = quire_config::defaults();
        assert_ne!(
            serde_json::to_value(&defaults).unwrap(),
            serde_json::to_value(&settings).unwrap(),
            "the settings differ from the defaults, so the test shows something"
        );
    }
}

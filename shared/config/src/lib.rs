//! Configuration and telemetry shared by every quire service.
//!
//! Configuration is layered, and this module is the one place that lists the
//! layers: the built-in defaults (`defaults.toml`, compiled in), then an
//! optional file, then environment variables `QUIRE_<SECTION>__<KEY>` (two
//! underscores between levels, e.g. `QUIRE_KAFKA__BOOTSTRAP_SERVERS`).

mod telemetry;
mod tokens;

mod units;

use std::collections::BTreeMap;
use std::fmt;
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_with::{DurationMilliSeconds, NoneAsEmptyString, Same, serde_as};
use units::{DurationMinutes, OffWhenZero};

pub use telemetry::{LogFormat, init_telemetry};
pub use tokens::{ApiToken, Scope, Secret, TokenLineError, is_secret_property};

const DEFAULTS: &str = include_str!("defaults.toml");

/// Everything a quire service reads from its configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub log: LogSettings,
    pub kafka: KafkaSettings,
    pub s3: S3Settings,
    pub api: ApiSettings,
    pub worker: WorkerSettings,
}

/// The producer API (see defaults.toml for what each key means).
#[serde_as]
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSettings {
    pub listen: String,
    pub max_body_bytes: NonZeroUsize,
    pub max_record_bytes: NonZeroUsize,
    pub max_records_per_request: NonZeroUsize,
    /// The most bytes of records (framed) one batch message of the records
    /// topic carries; at most [`MAX_BATCH_BYTES`].
    pub batch_max_bytes: NonZeroUsize,
    /// Accepted bearer tokens, as digests with scopes (see [`ApiToken`]).
    #[serde(default)]
    pub tokens: Vec<ApiToken>,
    pub allow_unauthenticated: bool,
    pub producers: NonZeroUsize,
    pub transactional_id_prefix: String,
    pub replica_id: String,
    pub idempotency_max_keys: NonZeroUsize,
    pub idempotency_max_bytes: usize,
    #[serde(rename = "idempotency_ttl_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub idempotency_ttl: Duration,
    #[serde(rename = "idempotency_lookup_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub idempotency_lookup_timeout: Duration,
    pub max_in_flight_bytes: NonZeroUsize,
    #[serde(rename = "body_read_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub body_read_timeout: Duration,
    #[serde(rename = "publish_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub publish_timeout: Duration,
    #[serde(rename = "kafka_check_interval_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub kafka_check_interval: Duration,
    #[serde(rename = "header_read_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub header_read_timeout: Duration,
    #[serde(rename = "idle_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub idle_timeout: Duration,
    pub max_connections: NonZeroUsize,
    pub control_requests_per_minute_per_stream: NonZeroU32,
    pub control_requests_per_minute_per_principal: NonZeroU32,
    /// How long a download URL is valid; `None` (0 in the file): the API
    /// signs none.
    #[serde(rename = "download_url_expiry_ms")]
    #[serde_as(as = "OffWhenZero<DurationMilliSeconds<u64>>")]
    pub download_url_expiry: Option<Duration>,
    /// The endpoint download URLs are signed for; `None` (empty in the
    /// file): the S3 endpoint.
    #[serde_as(as = "NoneAsEmptyString")]
    pub download_url_endpoint: Option<String>,
    /// How long a replica trusts the definition it last read from the
    /// bucket before it reads it again (its own PUTs apply at once).
    #[serde(rename = "definition_refresh_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub definition_refresh: Duration,
}

/// The report generator (see defaults.toml for what each key means).
#[serde_as]
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    pub replica_id: String,
    pub group_id: String,
    pub transactional_id_prefix: String,
    pub max_records: NonZeroUsize,
    #[serde(rename = "max_wait_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub max_wait: Duration,
    pub rollover_records: NonZeroU64,
    pub rollover_bytes: NonZeroU64,
    #[serde(rename = "rollover_age_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub rollover_age: Duration,
    pub memory_budget_bytes: u64,
    pub parts_in_flight: NonZeroUsize,
    pub parts_in_flight_total: NonZeroUsize,
    /// Where documents past the memory budget spill; `None` (empty in the
    /// file): the system temp dir's `quire-spill`.
    #[serde_as(as = "NoneAsEmptyString")]
    pub spill_dir: Option<String>,
    pub spill_max_bytes: u64,
    pub max_gzip_documents: NonZeroUsize,
    #[serde(rename = "shutdown_grace_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub shutdown_grace: Duration,
    pub metrics_listen: String,
    #[serde(rename = "statistics_interval_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub statistics_interval: Duration,
    #[serde(rename = "session_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub session_timeout: Duration,
    #[serde(rename = "max_poll_interval_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub max_poll_interval: Duration,
    #[serde(rename = "wedged_after_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub wedged_after: Duration,
    #[serde(rename = "restart_backoff_initial_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub restart_backoff_initial: Duration,
    #[serde(rename = "restart_backoff_max_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub restart_backoff_max: Duration,
    /// How often the worker asks Kafka what its topics are (ids, partition
    /// counts): a recreated topic or a grown one is noticed within this.
    #[serde(rename = "topic_check_interval_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub topic_check_interval: Duration,
}

/// The largest `api.batch_max_bytes`: past a few hundred KiB a batch gains
/// no throughput, and a larger one only asks more of the topic's
/// `max.message.bytes` and of every reader's fetch buffers.
pub const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The longest `worker.replica_id`.
pub const MAX_REPLICA_ID_LEN: usize = 64;

impl WorkerSettings {
    /// Checks `worker.replica_id`, which becomes a path segment of the spill
    /// directory (emptied at start: `..` there would empty another one), the
    /// Kafka transactional id and the static group member id: 1 to
    /// [`MAX_REPLICA_ID_LEN`] characters of `A-Z a-z 0-9 . _ -`, not starting
    /// with `.` or `-` (so never `.` or `..`, nor a hidden or option-like name).
    pub fn check_replica_id(&self) -> Result<(), String> {
        let id = &self.replica_id;
        let problem = if id.is_empty() {
            Some("must not be empty".to_owned())
        } else if id.len() > MAX_REPLICA_ID_LEN {
            Some(format!(
                "is {} bytes long; at most {MAX_REPLICA_ID_LEN}",
                id.len()
            ))
        } else if let Some(bad) = id
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            Some(format!(
                "holds {bad:?}; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"
            ))
        } else if id.starts_with(['.', '-']) {
            Some("must not start with '.' or '-'".to_owned())
        } else {
            None
        };
        match problem {
            None => Ok(()),
            // Debug-quoted: the value may hold control characters.
            Some(problem) => Err(format!(
                "worker.replica_id {id:?} {problem} (it names the spill directory, the transactional id and the group member id)"
            )),
        }
    }

    /// This replica's spill directory: `{spill_dir}/{replica_id}` (the
    /// system temp dir's `quire-spill` when `spill_dir` is empty), so replicas
    /// sharing a machine never clean each other's files. The replica id is
    /// checked first ([`WorkerSettings::check_replica_id`]).
    pub fn replica_spill_dir(&self) -> std::path::PathBuf {
        let base = match &self.spill_dir {
            None => std::env::temp_dir().join("quire-spill"),
            Some(dir) => std::path::PathBuf::from(dir),
        };
        base.join(&self.replica_id)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    pub format: LogFormat,
}

/// How to reach Kafka and which topics quire uses. Its Debug output shows
/// secret properties (SASL and SSL passwords, keys) as `[redacted]`.
#[serde_as]
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSettings {
    pub bootstrap_servers: String,
    #[serde(rename = "transaction_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub transaction_timeout: Duration,
    #[serde(rename = "request_timeout_ms")]
    #[serde_as(as = "DurationMilliSeconds<u64>")]
    pub request_timeout: Duration,
    /// Partitions of the records and watermark topics when they are
    /// created; growing them later is `report-generator partitions grow`.
    pub partitions: i32,
    pub topics: TopicNames,
    /// librdkafka properties passed through as they are (TLS, SASL, tuning).
    /// Keys are normalised by [`KafkaSettings::client_properties`].
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TopicNames {
    pub records: String,
    pub report_events: String,
    pub watermarks: String,
    pub dead_letters: String,
    pub idempotency: String,
}

#[serde_as]
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct S3Settings {
    pub endpoint: String,
    pub region: String,
    pub bucket: String,
    /// Days reports and manifests are kept; `None` (0 in the file): kept
    /// forever.
    #[serde_as(as = "OffWhenZero<Same>")]
    pub report_retention_days: Option<NonZeroU32>,
    /// Time between two retention sweeps, where the server has no
    /// lifecycle rules (minutes in the file).
    #[serde(rename = "retention_sweep_minutes")]
    #[serde_as(as = "DurationMinutes")]
    pub retention_sweep: Duration,
    /// The additional checksum every part and object carries, which the
    /// server verifies before it stores them.
    pub checksum: ChecksumChoice,
    /// Whether each report's object is tagged (stream, report id, record
    /// count, offsets, window start) before the report is announced.
    pub tag_reports: bool,
}

/// The S3 additional checksum a report is stored with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChecksumChoice {
    /// CRC32C of each part, and of the whole object (a full-object
    /// checksum, combined from the parts'): cheap, and checkable by a
    /// reader from the object alone.
    #[default]
    Crc32c,
    /// SHA-256 of each part, and the object's composite checksum (the
    /// SHA-256 of the parts' digests, `-N` for N parts), for systems that
    /// accept only SHA-2.
    Sha256,
    /// No additional checksum: for a server that refuses them.
    None,
}

impl fmt::Debug for KafkaSettings {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("KafkaSettings")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("transaction_timeout", &self.transaction_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("partitions", &self.partitions)
            .field("topics", &self.topics)
            .field("properties", &RedactedProperties(&self.properties))
            .finish()
    }
}

static REDACTED: Secret = Secret::redacted();

/// Pass-through properties with the values of secret ones hidden.
pub struct RedactedProperties<'a>(pub &'a BTreeMap<String, String>);

impl fmt::Debug for RedactedProperties<'_> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_map()
            .entries(self.0.iter().map(|(key, value)| {
                let shown: &dyn fmt::Debug = if is_secret_property(key) {
                    &REDACTED
                } else {
                    value
                };
                (key, shown)
            }))
            .finish()
    }
}

impl KafkaSettings {
    /// Settings for a broker at `bootstrap_servers` with every other value
    /// at its default; handy for tools and tests.
    pub fn for_bootstrap(bootstrap_servers: &str) -> Self {
        let mut settings = defaults().kafka;
        settings.bootstrap_servers = bootstrap_servers.to_owned();
        settings
    }

    /// The pass-through librdkafka properties with dotted keys.
    ///
    /// Environment variable names cannot hold dots, so
    /// `QUIRE_KAFKA__PROPERTIES__SSL_CA_LOCATION` arrives as `ssl_ca_location`;
    /// librdkafka property names never contain `_`, so mapping `_` to `.` is
    /// exact.
    pub fn client_properties(&self) -> BTreeMap<String, String> {
        self.properties
            .iter()
            .map(|(key, value)| (key.replace('_', "."), value.clone()))
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration file {path} cannot be read: {source}")]
    File {
        path: String,
        source: config::ConfigError,
    },
    #[error("invalid configuration: {0}")]
    Invalid(#[from] config::ConfigError),
    #[error(
        "api.auth_tokens (plain-text tokens) was replaced by api.tokens, which holds each token's SHA-256 digest and scopes: `quire token new --name <name>` prints a token and its api.tokens line"
    )]
    PlainTokens,
    #[error(
        "environment variable {name} names no setting{hint} (settings are QUIRE_<SECTION>__<KEY>, two underscores between levels; docs/configuration.md lists them)"
    )]
    UnknownVariable { name: String, hint: String },
    #[error("{key} is {value}; it must be at most {max} ({why})")]
    AboveMaximum {
        key: &'static str,
        value: usize,
        max: usize,
        why: &'static str,
    },
}

/// The sections of [`Settings`], as they begin an environment variable.
const SECTIONS: [&str; 5] = ["LOG", "KAFKA", "S3", "API", "WORKER"];

/// `QUIRE_` variables that are not settings and that quire's own tools,
/// scripts and tests read: exact names, then prefixes.
const OTHER_VARIABLES: [&str; 11] = [
    "QUIRE_CONFIG",
    // The CLI's, often exported in the shell that starts a service too.
    "QUIRE_API_URL",
    "QUIRE_API_TOKEN",
    "QUIRE_API_CA_CERT",
    // docker-compose.yml's, read from .env on the host (never inside a
    // container), and exported with it by some shells.
    "QUIRE_API_TOKENS",
    "QUIRE_API_PORT",
    "QUIRE_API_BIND",
    "QUIRE_DOWNLOAD_URL_ENDPOINT",
    "QUIRE_DOWNLOAD_URL_EXPIRY_MS",
    "QUIRE_WORKER_FAILPOINT",
    "QUIRE_SOAK_SECONDS",
];
const OTHER_PREFIXES: [&str; 4] = [
    "QUIRE_STACK_",
    "QUIRE_DOCKER_",
    "QUIRE_TEST_",
    "QUIRE_S3_TEST_",
];

/// Refuses a `QUIRE_` variable that is neither a setting
/// (`QUIRE_<SECTION>__<KEY>`) nor one of quire's other variables, so a typo
/// such as `QUIRE_API_LISTEN` (one underscore) stops the service instead of
/// leaving the default in force. A variable that names a setting with a
/// wrong key is refused by the settings' own unknown-key check.
fn check_variable(name: &str) -> Result<(), ConfigError> {
    if !name.starts_with("QUIRE_")
        || is_setting_variable(name)
        || OTHER_VARIABLES.contains(&name)
        || OTHER_PREFIXES.iter().any(|prefix| name.starts_with(prefix))
    {
        return Ok(());
    }
    let rest = &name["QUIRE_".len()..];
    let hint = SECTIONS
        .iter()
        .find_map(|section| {
            let key = rest.strip_prefix(section)?.strip_prefix('_')?;
            (!key.is_empty()).then(|| format!("; did you mean QUIRE_{section}__{key}?"))
        })
        .unwrap_or_default();
    Err(ConfigError::UnknownVariable {
        name: name.to_owned(),
        hint,
    })
}

/// Loads the settings: defaults, then `file` if given, then `QUIRE_` environment
/// variables.
pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
    load_with(file, std::env::vars())
}

/// [`load`] with `variables` in place of the process's environment: what a
/// service started with them would read (tools and tests check the
/// variables they hand a child process this way).
pub fn load_with(
    file: Option<&Path>,
    variables: impl IntoIterator<Item = (String, String)>,
) -> Result<Settings, ConfigError> {
    // Only QUIRE_<SECTION>__<KEY> names are configuration; quire's other
    // QUIRE_ variables (QUIRE_CONFIG, the stack script's QUIRE_STACK_*) are
    // passed over, and any other QUIRE_ name is refused as a typo.
    let mut settings_variables = config::Map::new();
    for (name, value) in variables {
        check_variable(&name)?;
        if is_setting_variable(&name) {
            settings_variables.insert(name, value);
        }
    }
    load_from(
        file,
        Some(config::Environment::with_prefix("QUIRE").source(Some(settings_variables))),
    )
}

/// Whether the environment variable `name` is configuration
/// (`QUIRE_<SECTION>__<KEY>`), as [`load`] reads it.
pub fn is_setting_variable(name: &str) -> bool {
    name.starts_with("QUIRE_") && name.contains("__")
}

/// The built-in defaults alone, without file or environment.
pub fn defaults() -> Settings {
    load_from(None, None).expect("the built-in defaults are valid")
}

fn load_from(
    file: Option<&Path>,
    environment: Option<config::Environment>,
) -> Result<Settings, ConfigError> {
    let mut builder = config::Config::builder()
        .add_source(config::File::from_str(DEFAULTS, config::FileFormat::Toml));
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError::File {
                path: path.display().to_string(),
                source: config::ConfigError::Message("no such file".into()),
            });
        }
        builder = builder.add_source(config::File::from(path).required(true));
    }
    if let Some(environment) = environment {
        builder = builder.add_source(
            environment
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("api.tokens"),
        );
    }
    let settings: Settings = builder.build()?.try_deserialize().map_err(|error| {
        if error.to_string().contains("unknown field `auth_tokens`") {
            ConfigError::PlainTokens
        } else {
            ConfigError::Invalid(error)
        }
    })?;
    check_maxima(&settings)?;
    Ok(settings)
}

/// Refuses, naming it, a setting past the largest value quire takes (the
/// types refuse 0; this, the other end).
fn check_maxima(settings: &Settings) -> Result<(), ConfigError> {
    let batch = settings.api.batch_max_bytes.get();
    if batch > MAX_BATCH_BYTES {
        return Err(ConfigError::AboveMaximum {
            key: "api.batch_max_bytes",
            value: batch,
            max: MAX_BATCH_BYTES,
            why: "4 MiB; a larger batch gains nothing and needs a larger max.message.bytes on the records topic",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_TOKENS: &str = "a:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08:read:*,b:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a09:read+write:orders-";

    #[test]
    fn plain_text_tokens_are_refused_with_the_way_forward() {
        let environment = config::Environment::with_prefix("QUIRE").source(Some(
            [("QUIRE_API__AUTH_TOKENS".to_owned(), "hunter2".to_owned())]
                .into_iter()
                .collect(),
        ));
        let error = load_from(None, Some(environment)).unwrap_err().to_string();
        assert!(error.contains("quire token new"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn batch_max_bytes_defaults_to_256_kib_and_is_refused_past_4_mib_by_name() {
        assert_eq!(defaults().api.batch_max_bytes.get(), 262_144);
        let read = |value: &str| {
            load_with(
                None,
                [("QUIRE_API__BATCH_MAX_BYTES".to_owned(), value.to_owned())],
            )
        };
        assert_eq!(
            read("4194304").unwrap().api.batch_max_bytes.get(),
            MAX_BATCH_BYTES
        );
        let error = read("4194305").unwrap_err().to_string();
        assert!(
            error.contains("api.batch_max_bytes is 4194305") && error.contains("at most 4194304"),
            "{error}"
        );
        let error = read("0").unwrap_err().to_string();
        assert!(error.contains("batch_max_bytes"), "{error}");
    }

    #[test]
    fn defaults_name_the_design_topics() {
        let settings = defaults();
        assert_eq!(settings.kafka.topics.records, "quire.records");
        assert_eq!(settings.kafka.topics.watermarks, "quire.watermarks");
        assert_eq!(settings.kafka.transaction_timeout, Duration::from_secs(10));
        assert_eq!(settings.log.format, LogFormat::Human);
    }

    #[test]
    fn durations_zeroes_and_empty_values_read_as_their_types() {
        let read = |variables: &[(&str, &str)]| {
            load_with(
                None,
                variables
                    .iter()
                    .map(|(name, value)| ((*name).to_owned(), (*value).to_owned())),
            )
        };
        let settings = read(&[
            ("QUIRE_API__IDLE_TIMEOUT_MS", "1500"),
            ("QUIRE_API__DOWNLOAD_URL_EXPIRY_MS", "0"),
            ("QUIRE_API__DOWNLOAD_URL_ENDPOINT", ""),
            ("QUIRE_S3__REPORT_RETENTION_DAYS", "0"),
            ("QUIRE_S3__RETENTION_SWEEP_MINUTES", "5"),
            ("QUIRE_WORKER__SPILL_DIR", ""),
        ])
        .unwrap();
        assert_eq!(settings.api.idle_timeout, Duration::from_millis(1500));
        assert_eq!(settings.api.download_url_expiry, None, "0: off");
        assert_eq!(settings.api.download_url_endpoint, None, "empty: none");
        assert_eq!(settings.s3.report_retention_days, None, "0: forever");
        assert_eq!(settings.s3.retention_sweep, Duration::from_secs(300));
        assert_eq!(settings.worker.spill_dir, None);
        let settings = read(&[
            ("QUIRE_API__DOWNLOAD_URL_EXPIRY_MS", "60000"),
            ("QUIRE_S3__REPORT_RETENTION_DAYS", "30"),
            ("QUIRE_WORKER__SPILL_DIR", "/var/spill"),
        ])
        .unwrap();
        assert_eq!(
            settings.api.download_url_expiry,
            Some(Duration::from_secs(60))
        );
        assert_eq!(settings.s3.report_retention_days, NonZeroU32::new(30));
        assert_eq!(settings.worker.spill_dir.as_deref(), Some("/var/spill"));
        let error = read(&[("QUIRE_WORKER__SESSION_TIMEOUT_MS", "soon")])
            .unwrap_err()
            .to_string();
        assert!(error.contains("session_timeout_ms"), "{error}");
    }

    #[test]
    fn environment_overrides_defaults_and_nests_with_double_underscore() {
        let environment = config::Environment::with_prefix("QUIRE").source(Some(
            [
                ("QUIRE_KAFKA__BOOTSTRAP_SERVERS", "10.0.0.1:9092"),
                ("QUIRE_KAFKA__PROPERTIES__SSL_CA_LOCATION", "/etc/ca.pem"),
                ("QUIRE_S3__BUCKET", "other"),
                ("QUIRE_LOG__FORMAT", "json"),
                ("QUIRE_API__TOKENS", TWO_TOKENS),
                ("QUIRE_KAFKA__PROPERTIES__SASL_PASSWORD", "hunter2"),
            ]
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value.to_owned()))
            .collect(),
        ));
        let settings = load_from(None, Some(environment)).unwrap();
        assert_eq!(settings.kafka.bootstrap_servers, "10.0.0.1:9092");
        assert_eq!(settings.s3.bucket, "other");
        assert_eq!(settings.log.format, LogFormat::Json);
        let lines: Vec<String> = settings
            .api
            .tokens
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(lines.join(","), TWO_TOKENS);
        // The password reaches librdkafka, and no Debug output.
        assert_eq!(
            settings.kafka.client_properties().get("sasl.password"),
            Some(&"hunter2".to_owned())
        );
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("sasl_password"), "{printed}");
        assert_eq!(
            settings.kafka.client_properties().get("ssl.ca.location"),
            Some(&"/etc/ca.pem".to_owned())
        );
    }

    fn variables(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect()
    }

    // Tests hand their variables to load_with: setting the process's
    // environment while another test reads it is undefined behaviour.
    #[test]
    fn quires_other_variables_are_not_configuration() {
        let settings = load_with(
            None,
            variables(&[
                ("QUIRE_STACK_KAFKA_PORT", "1"),
                ("QUIRE_CONFIG", "/nowhere"),
                ("QUIRE_API_TOKEN", "not a setting"),
                ("QUIRE_TEST_BINARY_DIR", "/tmp"),
                ("QUIRE_WORKER__MAX_RECORDS", "7"),
                ("PATH", "/bin"),
            ]),
        )
        .expect("quire's other variables are passed over");
        assert_eq!(settings.worker.max_records.get(), 7);
    }

    #[test]
    fn a_quire_variable_that_names_no_setting_is_refused_with_the_setting_it_resembles() {
        let error = load_with(None, variables(&[("QUIRE_API_LISTEN", "0.0.0.0:80")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("QUIRE_API_LISTEN"), "{error}");
        assert!(error.contains("did you mean QUIRE_API__LISTEN?"), "{error}");
        assert!(
            !error.contains("0.0.0.0"),
            "the value is not echoed: {error}"
        );
        let error = load_with(None, variables(&[("QUIRE_LISTEN", "x")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("names no setting"), "{error}");
        assert!(!error.contains("did you mean"), "{error}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let environment = config::Environment::with_prefix("QUIRE").source(Some(
            [("QUIRE_KAFKA__BOOTSTRAP_SERVER".to_owned(), "x".to_owned())]
                .into_iter()
                .collect(),
        ));
        let error = load_from(None, Some(environment)).unwrap_err().to_string();
        assert!(error.contains("bootstrap_server"), "{error}");
    }

    #[test]
    fn a_replica_id_is_a_safe_path_segment_and_kafka_id() {
        let mut worker = defaults().worker;
        for good in [
            "worker-0",
            "w9",
            "3f2a9c81b0de",
            "api.worker_2",
            "a",
            &"x".repeat(64),
        ] {
            worker.replica_id = good.to_owned();
            worker
                .check_replica_id()
                .unwrap_or_else(|error| panic!("{good}: {error}"));
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "-rf",
            "a/b",
            "../other",
            "a b",
            "tab\there",
            "é",
            "worker\0",
            &"x".repeat(65),
        ] {
            worker.replica_id = bad.to_owned();
            let error = worker
                .check_replica_id()
                .expect_err(&format!("{bad:?} is refused"));
            assert!(error.starts_with("worker.replica_id "), "{error}");
        }
        worker.replica_id = "a/b".into();
        let error = worker.check_replica_id().unwrap_err();
        assert!(error.contains("'/'"), "names what is wrong: {error}");
    }

    #[test]
    fn a_missing_file_is_named() {
        let error = load(Some(Path::new("/nonexistent/quire.toml")))
            .unwrap_err()
            .to_string();
        assert!(error.contains("/nonexistent/quire.toml"), "{error}");
    }
}

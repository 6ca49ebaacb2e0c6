//! Building the application in three steps, each only once the one before
//! has passed: bind the listener and check every setting that needs no
//! connection (`checks`: a bad limit is refused at once); connect (the
//! topics, the producers, the readers of the log, S3, the partition layout,
//! the stored `Idempotency-Key` answers); spawn the background loops, each
//! with the application's [`CancellationToken`]. Then serve until shutdown,
//! which cancels them.

mod checks;

pub use checks::MESSAGE_ROOM;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use prometheus_client::metrics::gauge::Gauge;
use quire_config::Settings;
use quire_queue::{QueueError, TopicSpec, design_topics};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::Gate;
use crate::body::InFlightBytes;
use crate::idempotency::{IdempotencyStore, StoreLimits};
use crate::in_force::DefinitionsInForce;
use crate::kafka_health::{self, KafkaHealth};
use crate::key_log::KeyLog;
use crate::log_reader::{LogError, LogReader};
use crate::metrics::Metrics;
use crate::placement::{self, Placement, Sources as PlacementSources};
use crate::publish::{Publisher, RecordsTopic};
use crate::reported::Reported;
use crate::routes::router;
use crate::serve::{ConnectionLimits, serve};
use crate::state::{AppState, Publishing, ReadinessSources, Reports};
use crate::storage::{DownloadUrls, Storage};
use checks::Checked;

/// How long start-up waits to read the stored `Idempotency-Key` answers.
const KEY_LOG_LOAD_LIMIT: Duration = Duration::from_secs(120);

/// How long start-up waits for S3 before going on without it (report routes
/// fail, and /readyz says so, until it answers; ingest does not need it).
const STARTUP_S3_CHECK: Duration = Duration::from_secs(5);

/// Why the API would not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("cannot listen on {address} (api.listen): {source}")]
    Bind {
        address: String,
        source: std::io::Error,
    },
    #[error("api.{key} is 0; it must be at least 1")]
    ZeroLimit { key: &'static str },
    #[error(
        "api.tokens lists {first:?} and {second:?} with the same name or the same digest; each token needs a name and a token of its own"
    )]
    DuplicateToken { first: String, second: String },
    #[error(
        "refusing to listen on {address} without authentication: anyone who reaches it could publish and read every report; set api.tokens, listen on a loopback address, or set api.allow_unauthenticated = true on purpose"
    )]
    Unauthenticated { address: SocketAddr },
    #[error(
        "api.max_in_flight_bytes ({in_flight}) is less than api.max_body_bytes ({body}): a request of the largest size allowed could never be let in"
    )]
    InFlightBelowBody { in_flight: usize, body: usize },
    #[error(
        "api.download_url_expiry_ms is {0}; a presigned URL lives at most 604800000 ms (7 days), or 0 turns them off"
    )]
    DownloadUrlExpiry(u128),
    #[error(
        "api.download_url_endpoint {0:?} is not an http:// or https:// URL of an S3 endpoint (scheme, host, optional port, no path or query)"
    )]
    DownloadUrlEndpoint(String),
    #[error("the embedded OpenAPI document is not valid YAML: {0}")]
    OpenApi(String),
    #[error(
        "refusing to start: the kafka topics are not what quire needs ({0}); a changed partition count would move streams between partitions"
    )]
    Topics(QueueError),
    #[error(
        "api.idempotency_ttl_ms ({ttl_ms}) is longer than the idempotency topic {topic} keeps answers (retention.ms = {retention_ms}): a retry after the topic deleted its key's answer, but within the TTL, would be published twice (after a restart, or on another replica); lower api.idempotency_ttl_ms to at most {retention_ms}, or raise the topic's retention.ms"
    )]
    IdempotencyTtlBeyondRetention {
        ttl_ms: u64,
        retention_ms: i64,
        topic: String,
    },
    #[error(
        "refusing to start: api.{key} ({value}) plus {room} bytes of room for its frame, key, headers and Kafka's framing does not fit under {limit}; lower api.{key} or raise that limit"
    )]
    MessageRoom {
        key: &'static str,
        value: usize,
        room: usize,
        limit: String,
    },
    #[error(
        "refusing to start: the producers build record batches of up to {cap} bytes (the smaller of kafka.properties.batch.size and message.max.bytes), more than {limit} takes in one batch; lower kafka.properties.batch.size or raise that limit"
    )]
    RecordBatches { cap: usize, limit: String },
    #[error("{0}")]
    ProducerSizes(String),
    #[error("cannot start the transactional producers: {0}")]
    Producers(QueueError),
    #[error("refusing to start: {0}")]
    Layout(quire_log::LogError),
    #[error("cannot load the stored Idempotency-Key answers: {0}")]
    KeyLog(String),
    #[error("cannot start the report look-up reader: {0}")]
    LogReader(LogError),
    #[error("cannot follow the watermark topic (how far each stream is reported): {0}")]
    Watermarks(String),
}

/// The producer API, bound and connected, not yet serving.
pub struct Application {
    listener: TcpListener,
    address: SocketAddr,
    router: Router,
    connections: ConnectionLimits,
    /// `quire_api_open_connections`, kept by the server.
    open_connections: Gauge,
    /// Stops every background loop (cancelled when serving ends).
    stop: CancellationToken,
}

/// What start-up connected, before anything runs in the background.
struct Connected {
    records_topic: RecordsTopic,
    idempotency: Arc<IdempotencyStore>,
    key_log: Arc<KeyLog>,
    metrics: Arc<Metrics>,
    publisher: Arc<Publisher>,
    log: Arc<LogReader>,
    reported: Arc<Reported>,
    storage: Storage,
    downloads: Option<DownloadUrls>,
    placement: Arc<Placement>,
    placement_sources: PlacementSources,
}

impl Application {
    /// Binds `api.listen` (port 0 picks a free port) and checks the
    /// settings; then checks the topics and connects `api.producers`
    /// transactional producers, the log's readers and the S3 client; then
    /// starts the background loops.
    pub async fn build(settings: Settings) -> Result<Self, StartupError> {
        let bind_error = |source| StartupError::Bind {
            address: settings.api.listen.clone(),
            source,
        };
        let listener = TcpListener::bind(&settings.api.listen)
            .await
            .map_err(bind_error)?;
        let address = listener.local_addr().map_err(bind_error)?;
        let checked = checks::check(&settings, address)?;

        let stop = CancellationToken::new();
        let connected = connect(&settings, &checked, stop.clone()).await?;
        tracing::info!(
            %address,
            producers = settings.api.producers.get(),
            replica_id = %settings.api.replica_id,
            records_topic = %settings.kafka.topics.records,
            bucket = %settings.s3.bucket,
            authentication = checked.tokens.enabled(),
            max_in_flight_bytes = settings.api.max_in_flight_bytes,
            idempotency_max_keys = settings.api.idempotency_max_keys,
            "producer api ready"
        );
        let open_connections = connected.metrics.open_connections_gauge();
        let state = spawn(&settings, &checked, connected, &stop);
        Ok(Application {
            listener,
            address,
            router: router(state, checked.tokens),
            connections: checked.connections,
            open_connections,
            stop,
        })
    }

    /// The port the listener is bound to.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// Serves until SIGTERM or ctrl-c, then stops taking connections, lets
    /// requests in flight finish (their transactions included) and returns.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        self.run_until(shutdown_signal()).await
    }

    /// Serves until `shutdown` completes (tests stop it this way), then
    /// shuts down gracefully and stops the background loops.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let stop = self.stop.clone();
        let served = serve(
            self.listener,
            self.router,
            self.connections,
            self.open_connections,
            shutdown,
        )
        .await;
        stop.cancel();
        served?;
        tracing::info!("producer api stopped");
        Ok(())
    }
}

/// The partitions `design_topics` gives `topic`.
fn partitions_of(specs: &[TopicSpec], topic: &str) -> i32 {
    specs
        .iter()
        .find(|spec| spec.name == topic)
        .map(|spec| spec.partitions)
        .unwrap_or_else(|| panic!("design_topics lists {topic}"))
}

/// `{transactional_id_prefix}-{replica_id}-{what}`: the group id of one of
/// this replica's readers.
fn group_id(settings: &Settings, what: &str) -> String {
    format!(
        "{}-{}-{what}",
        settings.api.transactional_id_prefix, settings.api.replica_id
    )
}

/// Everything that needs Kafka or S3, in the order each needs the one
/// before; nothing runs in the background yet but the readers' own threads.
async fn connect(
    settings: &Settings,
    checked: &Checked,
    stop: CancellationToken,
) -> Result<Connected, StartupError> {
    let kafka = &settings.kafka;
    // check_topics compares partition counts and cleanup policies, not
    // the replication factor, so any value does here.
    let specs = design_topics(&kafka.topics, 1, kafka.partitions);
    quire_queue::check_topics(kafka, &specs)
        .await
        .map_err(StartupError::Topics)?;
    let idempotency_topic = &kafka.topics.idempotency;
    let idempotency_config = quire_queue::topic_config(kafka, idempotency_topic)
        .await
        .map_err(StartupError::Topics)?;
    checks::check_idempotency_ttl(
        u64::try_from(settings.api.idempotency_ttl.as_millis()).unwrap_or(u64::MAX),
        idempotency_topic,
        &idempotency_config,
    )?;
    // Every batch, and the largest record alone in its batch, must fit
    // what the broker takes on the records topic.
    let records_config = quire_queue::topic_config(kafka, &kafka.topics.records)
        .await
        .map_err(StartupError::Topics)?;
    match checks::topic_message_limit(&kafka.topics.records, &records_config) {
        Some(limit) => {
            checks::check_message_room(settings, &limit)?;
            let sizes = quire_queue::producer_sizes(kafka).map_err(StartupError::ProducerSizes)?;
            checks::check_record_batches(&limit, sizes)?;
        }
        None => tracing::warn!(
            topic = %kafka.topics.records,
            "the broker did not say the records topic's max.message.bytes; batches are not checked against it"
        ),
    }
    // The live count (the topic may have grown past kafka.partitions):
    // releases and look-ups cover every partition there is.
    let records_partitions = quire_queue::describe_topic(kafka, &kafka.topics.records)
        .await
        .map_err(StartupError::Topics)?
        .partitions;

    let idempotency = IdempotencyStore::new(StoreLimits {
        max_keys: settings.api.idempotency_max_keys.get(),
        max_bytes: settings.api.idempotency_max_bytes,
        ttl: settings.api.idempotency_ttl,
    });
    let key_log = {
        let (kafka, store) = (kafka.clone(), Arc::clone(&idempotency));
        let partitions = partitions_of(&specs, idempotency_topic);
        let group_id = group_id(settings, "idempotency");
        let ttl = settings.api.idempotency_ttl;
        let catch_up_limit = settings.api.idempotency_lookup_timeout;
        tokio::task::spawn_blocking(move || {
            KeyLog::start(&kafka, partitions, &group_id, ttl, catch_up_limit, store)
        })
        .await
        .map_err(|error| StartupError::KeyLog(error.to_string()))?
        .map(Arc::new)
        .map_err(|error| StartupError::KeyLog(error.to_string()))?
    };
    let metrics = Arc::new(Metrics::new());
    let records_topic =
        RecordsTopic::new(&kafka.topics.records, settings.api.batch_max_bytes.get());
    let publisher = Publisher::connect(
        kafka,
        &settings.api,
        Arc::clone(&metrics),
        records_topic
            .release_messages(records_partitions)
            .into_iter()
            .chain(key_log.release_messages())
            .collect(),
        stop,
    )
    .await
    .map(Arc::new)
    .map_err(StartupError::Producers)?;
    let log = Arc::new(
        LogReader::new(
            kafka,
            records_partitions,
            &group_id(settings, "report-lookups"),
        )
        .map_err(StartupError::LogReader)?,
    );
    let reported = {
        let kafka = kafka.clone();
        let partitions = partitions_of(&specs, &kafka.topics.watermarks);
        let group_id = group_id(settings, "watermarks");
        tokio::task::spawn_blocking(move || Reported::start(&kafka, partitions, &group_id))
            .await
            .map_err(|error| StartupError::Watermarks(error.to_string()))?
            .map(Arc::new)
            .map_err(|error| StartupError::Watermarks(error.to_string()))?
    };
    let s3_client = quire_s3::build_client(&settings.s3).await;
    let storage = Storage::new(s3_client.clone(), settings.s3.bucket.clone());
    // Where each stream goes, and which log a report id names: read
    // before the first request.
    let placement = Arc::new(Placement::new(checked.check_interval));
    let follower = {
        let kafka = kafka.clone();
        let group_id = group_id(settings, "layout");
        tokio::task::spawn_blocking(move || {
            quire_log::LayoutFollower::start(&kafka, &group_id, &kafka.topics.watermarks)
        })
        .await
        .map_err(|error| StartupError::Layout(error.into()))?
        .map_err(StartupError::Layout)?
    };
    let placement_sources = PlacementSources {
        kafka: kafka.clone(),
        follower,
        s3: s3_client,
        bucket: settings.s3.bucket.clone(),
        check_interval: checked.check_interval,
    };
    match placement.refresh(&placement_sources, &publisher).await {
        Ok(()) => {}
        Err(error @ quire_log::LogError::Layout(_)) => return Err(StartupError::Layout(error)),
        Err(error) => {
            tracing::warn!(error = %error, "the partition layout could not be read yet; publishing requests are answered 503 until it is");
        }
    }
    if let Err(error) = storage.check_bucket(STARTUP_S3_CHECK).await {
        tracing::warn!(error = %error, "s3 bucket not reachable; report and definition routes fail until it is");
    }
    let downloads = match (&checked.download_endpoint, settings.api.download_url_expiry) {
        (Some(endpoint), Some(expiry)) => {
            let mut signing = settings.s3.clone();
            signing.endpoint = endpoint.clone();
            Some(DownloadUrls::new(
                quire_s3::build_client(&signing).await,
                settings.s3.bucket.clone(),
                expiry,
            ))
        }
        _ => None,
    };

    let loading = std::time::Instant::now();
    let loaded = key_log
        .load(KEY_LOG_LOAD_LIMIT)
        .await
        .map_err(|error| StartupError::KeyLog(error.to_string()))?;
    tracing::info!(
        loaded,
        elapsed_ms = loading.elapsed().as_millis() as u64,
        topic = %kafka.topics.idempotency,
        "idempotency keys loaded"
    );
    Ok(Connected {
        records_topic,
        idempotency,
        key_log,
        metrics,
        publisher,
        log,
        reported,
        storage,
        downloads,
        placement,
        placement_sources,
    })
}

/// Starts the background loops, each until `stop`, and returns the
/// handlers' state:
/// - the Kafka check ([`kafka_health::run`]);
/// - the producers' upkeep: recreating the unusable ones, releasing what
///   idle producers' earlier transactions may have left open once the
///   brokers come back ([`Publisher::run_upkeep`]);
/// - the placement's refresh ([`placement::run`]).
///
/// Requests start more, bounded by the same token: a producer's
/// re-creation, the settling of an unknown commit outcome.
fn spawn(
    settings: &Settings,
    checked: &Checked,
    connected: Connected,
    stop: &CancellationToken,
) -> AppState {
    let Connected {
        records_topic,
        idempotency,
        key_log,
        metrics,
        publisher,
        log,
        reported,
        storage,
        downloads,
        placement,
        placement_sources,
    } = connected;
    let kafka_health = KafkaHealth::new();
    tokio::spawn(kafka_health::run(
        Arc::clone(&kafka_health),
        Arc::clone(&log),
        Arc::clone(&metrics),
        checked.check_interval,
        stop.clone(),
    ));
    tokio::spawn(Arc::clone(&publisher).run_upkeep(
        {
            let health = Arc::clone(&kafka_health);
            move || health.is_available()
        },
        checked.check_interval,
        stop.clone(),
    ));
    tokio::spawn(placement::run(
        Arc::clone(&placement),
        placement_sources,
        Arc::clone(&publisher),
        Arc::clone(&log),
        stop.clone(),
    ));
    let tokens_enabled = checked.tokens.enabled();
    AppState {
        publishing: Publishing {
            limits: checked.limits,
            records_topic,
            placement: Arc::clone(&placement),
            publisher: Arc::clone(&publisher),
            log: Arc::clone(&log),
            key_log: Arc::clone(&key_log),
            metrics: Arc::clone(&metrics),
            control_limits: Arc::clone(&checked.control_limits),
            definitions: Arc::new(DefinitionsInForce::new(
                storage.clone(),
                settings.api.definition_refresh,
            )),
            tokens_enabled,
        },
        reports: Reports {
            storage: storage.clone(),
            downloads,
            placement,
            log,
            reported,
            metrics: Arc::clone(&metrics),
        },
        readiness: ReadinessSources {
            storage,
            kafka_health: Arc::clone(&kafka_health),
            publisher,
            replica_id: settings.api.replica_id.as_str().into(),
        },
        gate: Gate {
            in_flight_bytes: InFlightBytes::new(
                settings.api.max_in_flight_bytes.get(),
                metrics.in_flight_bytes_gauge(),
            ),
            idempotency,
            kafka_health,
            metrics,
            max_body_bytes: checked.limits.max_body_bytes,
            body_read_timeout: checked.limits.body_read_timeout,
            tokens_enabled,
            key_log: Some(key_log),
            stop: stop.clone(),
        },
    }
}

/// SIGTERM (how orchestrators stop a process) or ctrl-c.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %error, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(error = %error, "cannot listen for sigterm");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = ctrl_c => tracing::info!("ctrl-c received; shutting down"),
        () = terminate => tracing::info!("sigterm received; shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad limit is refused before start-up reaches for Kafka: here no
    /// broker listens, and the answer comes at once, not after the topic
    /// checks' timeouts or the key log's load.
    #[tokio::test]
    async fn a_bad_limit_is_refused_before_anything_connects() {
        let mut settings = quire_config::defaults();
        settings.api.listen = "127.0.0.1:0".into();
        settings.kafka.bootstrap_servers = "127.0.0.1:1".into();
        settings.api.idle_timeout = Duration::ZERO;
        let started = std::time::Instant::now();
        let refused = tokio::time::timeout(Duration::from_secs(5), Application::build(settings))
            .await
            .expect("refused at once, without waiting for a broker");
        assert!(
            matches!(
                refused,
                Err(StartupError::ZeroLimit {
                    key: "idle_timeout_ms"
                })
            ),
            "{:?}",
            refused.err()
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

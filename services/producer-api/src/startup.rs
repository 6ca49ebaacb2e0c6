//! Building the application: listener first, then the checks and
//! connections, then the router; and running it until shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{Method, Uri};
use axum::middleware;
use quire_config::Settings;
use quire_queue::{QueueError, design_topics};
use tokio::net::TcpListener;

use crate::admission::{self, Admission};
use crate::auth::{self, BearerTokens};
use crate::body::InFlightBytes;
use crate::errors::ApiError;
use crate::idempotency::{IdempotencyStore, StoreLimits};
use crate::kafka_health::{self, KafkaHealth};
use crate::key_log::KeyLog;
use crate::log_reader::{LogError, LogReader};
use crate::metrics::{self, Metrics};
use crate::openapi;
use crate::placement::{Placement, Sources as PlacementSources};
use crate::publish::{Publisher, RecordsTopic};
use crate::rate::ControlLimits;
use crate::reported::Reported;
use crate::routes::{Access, ROUTES};
use crate::serve::{ConnectionLimits, serve};
use crate::state::{AppState, Services};
use crate::storage::{DownloadUrls, MAX_DOWNLOAD_URL_EXPIRY, Storage};
use crate::validation::Limits;

/// Why the API would not start.
/// How long start-up waits to read the stored `Idempotency-Key` answers.
const KEY_LOG_LOAD_LIMIT: Duration = Duration::from_secs(120);

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
    DownloadUrlExpiry(u64),
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
    /// Stops the background loops that follow the log (the placement).
    stop: tokio_util::sync::CancellationToken,
}

/// How long start-up waits for S3 before going on without it (report routes
/// fail, and /readyz says so, until it answers; ingest does not need it).
const STARTUP_S3_CHECK: Duration = Duration::from_secs(5);

impl Application {
    /// Binds `api.listen` (port 0 picks a free port), checks the topics,
    /// connects `api.producers` transactional producers and the S3 client.
    pub async fn build(settings: Settings) -> Result<Self, StartupError> {
        let listener = TcpListener::bind(&settings.api.listen)
            .await
            .map_err(|source| StartupError::Bind {
                address: settings.api.listen.clone(),
                source,
            })?;
        let address = listener.local_addr().map_err(|source| StartupError::Bind {
            address: settings.api.listen.clone(),
            source,
        })?;
        let limits = limits(&settings)?;
        let download_endpoint = download_endpoint(&settings)?;
        let tokens = authentication(&settings, address)?;
        openapi::check().map_err(StartupError::OpenApi)?;

        // check_topics compares partition counts and cleanup policies, not
        // the replication factor, so any value does here.
        let specs = design_topics(&settings.kafka.topics, 1, settings.kafka.partitions);
        quire_queue::check_topics(&settings.kafka, &specs)
            .await
            .map_err(StartupError::Topics)?;
        let idempotency_topic = &settings.kafka.topics.idempotency;
        let idempotency_config = quire_queue::topic_config(&settings.kafka, idempotency_topic)
            .await
            .map_err(StartupError::Topics)?;
        check_idempotency_ttl(
            settings.api.idempotency_ttl_ms,
            idempotency_topic,
            &idempotency_config,
        )?;
        // The live count (the topic may have grown past kafka.partitions):
        // releases and look-ups cover every partition there is.
        let records_partitions =
            quire_queue::describe_topic(&settings.kafka, &settings.kafka.topics.records)
                .await
                .map_err(StartupError::Topics)?
                .partitions;

        let key_log_partitions = specs
            .iter()
            .find(|spec| spec.name == settings.kafka.topics.idempotency)
            .map(|spec| spec.partitions)
            .expect("design_topics lists the idempotency topic");
        let idempotency = IdempotencyStore::new(StoreLimits {
            max_keys: settings.api.idempotency_max_keys,
            max_bytes: settings.api.idempotency_max_bytes,
            ttl: Duration::from_millis(settings.api.idempotency_ttl_ms),
        });
        let key_log = {
            let (kafka, store) = (settings.kafka.clone(), Arc::clone(&idempotency));
            let group_id = format!(
                "{}-{}-idempotency",
                settings.api.transactional_id_prefix, settings.api.replica_id
            );
            let ttl = Duration::from_millis(settings.api.idempotency_ttl_ms);
            let catch_up_limit = Duration::from_millis(settings.api.idempotency_lookup_timeout_ms);
            tokio::task::spawn_blocking(move || {
                KeyLog::start(
                    &kafka,
                    key_log_partitions,
                    &group_id,
                    ttl,
                    catch_up_limit,
                    store,
                )
            })
            .await
            .map_err(|error| StartupError::KeyLog(error.to_string()))?
            .map(Arc::new)
            .map_err(|error| StartupError::KeyLog(error.to_string()))?
        };
        let metrics = Arc::new(Metrics::new());
        let records_topic = RecordsTopic::new(&settings.kafka.topics.records);
        let publisher = Publisher::connect(
            &settings.kafka,
            &settings.api,
            Arc::clone(&metrics),
            records_topic
                .release_messages(records_partitions)
                .into_iter()
                .chain(key_log.release_messages())
                .collect(),
        )
        .await
        .map_err(StartupError::Producers)?;
        let lookup_group = format!(
            "{}-{}-report-lookups",
            settings.api.transactional_id_prefix, settings.api.replica_id
        );
        let log = Arc::new(
            LogReader::new(&settings.kafka, records_partitions, &lookup_group)
                .map_err(StartupError::LogReader)?,
        );
        let reported = {
            let kafka = settings.kafka.clone();
            let watermark_partitions = specs
                .iter()
                .find(|spec| spec.name == settings.kafka.topics.watermarks)
                .map(|spec| spec.partitions)
                .expect("design_topics lists the watermark topic");
            let group_id = format!(
                "{}-{}-watermarks",
                settings.api.transactional_id_prefix, settings.api.replica_id
            );
            tokio::task::spawn_blocking(move || {
                Reported::start(&kafka, watermark_partitions, &group_id)
            })
            .await
            .map_err(|error| StartupError::Watermarks(error.to_string()))?
            .map(Arc::new)
            .map_err(|error| StartupError::Watermarks(error.to_string()))?
        };
        let kafka_health = KafkaHealth::new();
        kafka_health::spawn_watcher(
            Arc::clone(&kafka_health),
            Arc::clone(&log),
            Arc::clone(&metrics),
            Duration::from_millis(settings.api.kafka_check_interval_ms.max(1)),
        );
        // Releases what idle producers' earlier transactions may have left
        // open once the brokers come back.
        publisher.spawn_releaser(
            {
                let health = Arc::clone(&kafka_health);
                move || health.is_available()
            },
            Duration::from_millis(settings.api.kafka_check_interval_ms.max(1)),
        );
        let s3_client = quire_s3::build_client(&settings.s3).await;
        let storage = Storage::new(s3_client.clone(), settings.s3.bucket.clone());
        // Where each stream goes, and which log a report id names: read
        // before the first request.
        let check_interval = Duration::from_millis(settings.api.kafka_check_interval_ms.max(1));
        let placement = Arc::new(Placement::new(check_interval));
        let follower = {
            let kafka = settings.kafka.clone();
            let group_id = format!(
                "{}-{}-layout",
                settings.api.transactional_id_prefix, settings.api.replica_id
            );
            tokio::task::spawn_blocking(move || {
                quire_log::LayoutFollower::start(&kafka, &group_id, &kafka.topics.watermarks)
            })
            .await
            .map_err(|error| StartupError::Layout(error.into()))?
            .map_err(StartupError::Layout)?
        };
        let placement_sources = PlacementSources {
            kafka: settings.kafka.clone(),
            follower,
            s3: s3_client,
            bucket: settings.s3.bucket.clone(),
            check_interval,
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
        let downloads = match download_endpoint {
            Some(endpoint) => {
                let mut signing = settings.s3.clone();
                signing.endpoint = endpoint;
                Some(DownloadUrls::new(
                    quire_s3::build_client(&signing).await,
                    settings.s3.bucket.clone(),
                    Duration::from_millis(settings.api.download_url_expiry_ms),
                ))
            }
            None => None,
        };

        let loading = std::time::Instant::now();
        let loaded = key_log
            .load(KEY_LOG_LOAD_LIMIT)
            .await
            .map_err(|error| StartupError::KeyLog(error.to_string()))?;
        tracing::info!(
            loaded,
            elapsed_ms = loading.elapsed().as_millis() as u64,
            topic = %settings.kafka.topics.idempotency,
            "idempotency keys loaded"
        );

        let services = Arc::new(Services {
            limits,
            records_topic,
            placement: Arc::clone(&placement),
            publisher,
            storage,
            downloads,
            log,
            reported,
            in_flight_bytes: InFlightBytes::new(
                settings.api.max_in_flight_bytes,
                metrics.in_flight_bytes_gauge(),
            ),
            idempotency,
            key_log,
            kafka_health,
            tokens_enabled: tokens.enabled(),
            control_limits: control_limits(&settings)?,
            metrics,
            replica_id: settings.api.replica_id.clone(),
        });
        tracing::info!(
            %address,
            producers = settings.api.producers.max(1),
            replica_id = %settings.api.replica_id,
            records_topic = %settings.kafka.topics.records,
            bucket = %settings.s3.bucket,
            authentication = tokens.enabled(),
            max_in_flight_bytes = settings.api.max_in_flight_bytes,
            idempotency_max_keys = settings.api.idempotency_max_keys,
            "producer api ready"
        );
        let stop = tokio_util::sync::CancellationToken::new();
        crate::placement::spawn_watcher(
            placement,
            placement_sources,
            Arc::clone(&services),
            stop.clone(),
        );
        Ok(Application {
            listener,
            address,
            router: router(services, tokens),
            connections: connection_limits(&settings)?,
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
    /// shuts down gracefully.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let stop = self.stop.clone();
        let served = serve(self.listener, self.router, self.connections, shutdown).await;
        stop.cancel();
        served?;
        tracing::info!("producer api stopped");
        Ok(())
    }
}

/// The bearer tokens. A listed token that is empty is a mistake, never
/// "authentication off"; and without tokens the API serves only loopback
/// unless `api.allow_unauthenticated` says otherwise.
fn authentication(settings: &Settings, address: SocketAddr) -> Result<BearerTokens, StartupError> {
    let api = &settings.api;
    for (index, token) in api.tokens.iter().enumerate() {
        for earlier in &api.tokens[..index] {
            if earlier.name == token.name || earlier.sha256 == token.sha256 {
                return Err(StartupError::DuplicateToken {
                    first: earlier.name.clone(),
                    second: token.name.clone(),
                });
            }
        }
    }
    let tokens = BearerTokens::new(&api.tokens);
    if !tokens.enabled() && !address.ip().is_loopback() && !api.allow_unauthenticated {
        return Err(StartupError::Unauthenticated { address });
    }
    if !tokens.enabled() && !address.ip().is_loopback() {
        tracing::warn!(%address, "authentication is off (api.allow_unauthenticated) on a non-loopback address");
    }
    Ok(tokens)
}

/// Refuses an `Idempotency-Key` lifetime longer than the idempotency topic
/// keeps the answers (`config`: the topic's live settings). Within the TTL a
/// retry must find its first answer; the answers outlive a restart and are
/// shared by replicas only through the topic, so the topic must keep them
/// at least that long. A topic that deletes nothing by time (retention.ms
/// -1, or a policy without `delete`) keeps them forever.
fn check_idempotency_ttl(
    ttl_ms: u64,
    topic: &str,
    config: &std::collections::BTreeMap<String, String>,
) -> Result<(), StartupError> {
    let deletes = config
        .get("cleanup.policy")
        .is_none_or(|policy| policy.split(',').any(|part| part.trim() == "delete"));
    let retention_ms = config
        .get("retention.ms")
        .and_then(|value| value.trim().parse::<i64>().ok());
    match retention_ms {
        Some(retention_ms) if deletes && retention_ms >= 0 && ttl_ms > retention_ms as u64 => {
            Err(StartupError::IdempotencyTtlBeyondRetention {
                ttl_ms,
                retention_ms,
                topic: topic.to_owned(),
            })
        }
        _ => Ok(()),
    }
}

/// The endpoint download URLs are signed for, or None when they are off.
fn download_endpoint(settings: &Settings) -> Result<Option<String>, StartupError> {
    let expiry = settings.api.download_url_expiry_ms;
    if expiry == 0 {
        return Ok(None);
    }
    if Duration::from_millis(expiry) > MAX_DOWNLOAD_URL_EXPIRY {
        return Err(StartupError::DownloadUrlExpiry(expiry));
    }
    let endpoint = settings.api.download_url_endpoint.trim();
    if endpoint.is_empty() {
        return Ok(Some(settings.s3.endpoint.clone()));
    }
    // Credentials in the URL are never echoed.
    let shown = if endpoint.contains('@') {
        "(an endpoint with credentials in it)".to_owned()
    } else {
        endpoint.to_owned()
    };
    let bad = || StartupError::DownloadUrlEndpoint(shown.clone());
    let uri: axum::http::Uri = endpoint.parse().map_err(|_| bad())?;
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let bare = matches!(uri.path(), "" | "/") && uri.query().is_none();
    let host_ok = uri
        .authority()
        .is_some_and(|authority| !authority.host().is_empty() && !authority.as_str().contains('@'));
    if !(scheme_ok && bare && host_ok) {
        return Err(bad());
    }
    Ok(Some(endpoint.trim_end_matches('/').to_owned()))
}

fn control_limits(settings: &Settings) -> Result<ControlLimits, StartupError> {
    let api = &settings.api;
    let at_least_one =
        |key, value: u32| NonZeroU32::new(value).ok_or(StartupError::ZeroLimit { key });
    Ok(ControlLimits::new(
        at_least_one(
            "control_requests_per_minute_per_stream",
            api.control_requests_per_minute_per_stream,
        )?,
        at_least_one(
            "control_requests_per_minute_per_principal",
            api.control_requests_per_minute_per_principal,
        )?,
    ))
}

fn connection_limits(settings: &Settings) -> Result<ConnectionLimits, StartupError> {
    let api = &settings.api;
    for (key, value) in [
        (
            "header_read_timeout_ms",
            api.header_read_timeout_ms as usize,
        ),
        ("idle_timeout_ms", api.idle_timeout_ms as usize),
        ("max_connections", api.max_connections),
    ] {
        if value == 0 {
            return Err(StartupError::ZeroLimit { key });
        }
    }
    Ok(ConnectionLimits {
        header_read_timeout: Duration::from_millis(api.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(api.idle_timeout_ms),
        max_connections: api.max_connections,
    })
}

fn limits(settings: &Settings) -> Result<Limits, StartupError> {
    let api = &settings.api;
    for (key, value) in [
        ("max_body_bytes", api.max_body_bytes),
        ("max_record_bytes", api.max_record_bytes),
        ("max_records_per_request", api.max_records_per_request),
        ("max_in_flight_bytes", api.max_in_flight_bytes),
        ("idempotency_max_keys", api.idempotency_max_keys),
    ] {
        if value == 0 {
            return Err(StartupError::ZeroLimit { key });
        }
    }
    if api.max_in_flight_bytes < api.max_body_bytes {
        return Err(StartupError::InFlightBelowBody {
            in_flight: api.max_in_flight_bytes,
            body: api.max_body_bytes,
        });
    }
    Ok(Limits {
        max_body_bytes: api.max_body_bytes,
        max_record_bytes: api.max_record_bytes,
        max_records_per_request: api.max_records_per_request,
        body_read_timeout: Duration::from_millis(api.body_read_timeout_ms),
    })
}

/// Every route of [`ROUTES`]. Token routes require a bearer token when
/// tokens are configured; open ones (`/healthz`, `/readyz`, `/metrics`, the
/// OpenAPI document) stay open. Routes that publish get their admission
/// ([`admission`]) inside the authentication. Every request is counted and
/// timed, unknown routes included.
pub fn router(services: AppState, tokens: BearerTokens) -> Router {
    let metrics = Arc::clone(&services.metrics);
    let mut protected = Router::new();
    let mut open = Router::new();
    for route in ROUTES {
        let handler = (route.handler)();
        let handler = match route.admission {
            Some(Admission::IdempotentPublish) => handler.route_layer(
                middleware::from_fn_with_state(Arc::clone(&services), admission::admit_publish),
            ),
            Some(Admission::Publish) => handler.route_layer(middleware::from_fn_with_state(
                Arc::clone(&services),
                admission::kafka_gate,
            )),
            None => handler,
        };
        // Routing one path twice merges its methods.
        match route.access {
            Access::Token(scope) => {
                let handler = handler.route_layer(middleware::from_fn_with_state(
                    (tokens.clone(), scope),
                    auth::require_scope,
                ));
                protected = protected.route(route.path, handler);
            }
            Access::Open => open = open.route(route.path, handler),
        }
    }
    protected
        .merge(open)
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(services)
        .layer(middleware::from_fn_with_state(
            metrics,
            metrics::track_requests,
        ))
}

async fn route_not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
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

    fn with_tokens(tokens: &[&str]) -> Settings {
        let mut settings = quire_config::defaults();
        settings.api.tokens = tokens
            .iter()
            .map(|name| {
                let digest = hex::encode(quire_config::ApiToken::digest_of(name));
                format!("{name}:{digest}:read+write:*").parse().unwrap()
            })
            .collect();
        settings
    }

    #[test]
    fn an_idempotency_ttl_past_the_topics_retention_is_refused() {
        let config = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect()
        };
        let two_days = config(&[("cleanup.policy", "delete"), ("retention.ms", "172800000")]);
        assert!(check_idempotency_ttl(172_800_000, "quire.idempotency", &two_days).is_ok());
        assert!(check_idempotency_ttl(86_400_000, "quire.idempotency", &two_days).is_ok());
        let error = check_idempotency_ttl(172_800_001, "quire.idempotency", &two_days)
            .err()
            .unwrap();
        let message = error.to_string();
        for needle in [
            "api.idempotency_ttl_ms (172800001)",
            "retention.ms = 172800000",
            "quire.idempotency",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        // Topics that delete nothing by time keep answers forever.
        for forever in [
            config(&[("cleanup.policy", "delete"), ("retention.ms", "-1")]),
            config(&[("cleanup.policy", "compact"), ("retention.ms", "1000")]),
            config(&[]),
        ] {
            assert!(
                check_idempotency_ttl(u64::MAX, "t", &forever).is_ok(),
                "{forever:?}"
            );
        }
        let both = config(&[
            ("cleanup.policy", "compact,delete"),
            ("retention.ms", "1000"),
        ]);
        assert!(check_idempotency_ttl(1001, "t", &both).is_err());
    }

    #[test]
    fn without_tokens_only_loopback_is_served_unless_said_on_purpose() {
        let everywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let error = authentication(&with_tokens(&[]), everywhere).err().unwrap();
        assert!(matches!(error, StartupError::Unauthenticated { .. }));
        assert!(
            error.to_string().contains("api.allow_unauthenticated"),
            "{error}"
        );
        assert!(
            !authentication(&with_tokens(&[]), loopback)
                .unwrap()
                .enabled()
        );
        assert!(
            authentication(&with_tokens(&["t"]), everywhere)
                .unwrap()
                .enabled()
        );
        let mut open_on_purpose = with_tokens(&[]);
        open_on_purpose.api.allow_unauthenticated = true;
        assert!(
            !authentication(&open_on_purpose, everywhere)
                .unwrap()
                .enabled()
        );
    }

    #[test]
    fn download_urls_are_off_at_0_and_bounded_to_7_days_on_a_bare_endpoint() {
        let mut settings = quire_config::defaults();
        assert_eq!(
            download_endpoint(&settings).unwrap().as_deref(),
            Some(settings.s3.endpoint.as_str()),
            "on by default, signed for s3.endpoint"
        );
        settings.api.download_url_expiry_ms = 0;
        assert!(download_endpoint(&settings).unwrap().is_none());
        settings.api.download_url_expiry_ms = 7 * 24 * 3600 * 1000;
        assert!(download_endpoint(&settings).unwrap().is_some());
        settings.api.download_url_expiry_ms += 1;
        let error = download_endpoint(&settings).err().unwrap();
        assert!(error.to_string().contains("7 days"), "{error}");

        settings.api.download_url_expiry_ms = 60_000;
        settings.api.download_url_endpoint = "https://s3.example.com:9000/".into();
        assert_eq!(
            download_endpoint(&settings).unwrap().as_deref(),
            Some("https://s3.example.com:9000")
        );
        for bad in [
            "s3.example.com",
            "ftp://s3.example.com",
            "https://s3.example.com/bucket",
            "https://s3.example.com/?x=1",
            "https://user:secret@s3.example.com",
            "not a url",
        ] {
            settings.api.download_url_endpoint = bad.into();
            let error = download_endpoint(&settings).err().unwrap();
            assert!(
                matches!(error, StartupError::DownloadUrlEndpoint(_)),
                "{bad}: {error}"
            );
            assert!(!error.to_string().contains("secret"), "{error}");
        }
    }

    #[test]
    fn two_tokens_with_one_name_or_one_digest_are_an_error() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let mut settings = with_tokens(&["a", "b"]);
        assert!(authentication(&settings, loopback).is_ok());
        settings.api.tokens[1].name = "a".into();
        let error = authentication(&settings, loopback).err().unwrap();
        assert!(
            matches!(error, StartupError::DuplicateToken { .. }),
            "{error}"
        );
        let mut settings = with_tokens(&["a", "b"]);
        settings.api.tokens[1].sha256 = settings.api.tokens[0].sha256;
        let error = authentication(&settings, loopback).err().unwrap();
        assert!(
            matches!(error, StartupError::DuplicateToken { .. }),
            "{error}"
        );
    }
}

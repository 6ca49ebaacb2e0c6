//! Building the application: listener first, then the checks and
//! connections, then the router; and running it until shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{Method, Uri};
use axum::middleware;
use axum::routing::{get, post};
use quire_config::Settings;
use quire_queue::{QueueError, design_topics};
use tokio::net::TcpListener;

use crate::auth::{self, BearerTokens};
use crate::errors::ApiError;
use crate::log_reader::{LogError, LogReader};
use crate::metrics::{self, Metrics};
use crate::publish::{Publisher, RecordsTopic};
use crate::routes::{definitions, health, records, reports};
use crate::state::{AppState, Services};
use crate::storage::Storage;
use crate::validation::Limits;

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
        "refusing to start: the kafka topics are not what quire needs ({0}); a changed partition count would move streams between partitions"
    )]
    Topics(QueueError),
    #[error("cannot start the transactional producers: {0}")]
    Producers(QueueError),
    #[error("cannot start the report look-up reader: {0}")]
    LogReader(LogError),
}

/// The producer API, bound and connected, not yet serving.
pub struct Application {
    listener: TcpListener,
    address: SocketAddr,
    router: Router,
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

        // check_topics compares partition counts and cleanup policies, not
        // the replication factor, so any value does here.
        let specs = design_topics(&settings.kafka.topics, 1);
        quire_queue::check_topics(&settings.kafka, &specs)
            .await
            .map_err(StartupError::Topics)?;
        let records_partitions = specs
            .iter()
            .find(|spec| spec.name == settings.kafka.topics.records)
            .map(|spec| spec.partitions)
            .expect("design_topics lists the records topic");

        let publisher = Publisher::connect(&settings.kafka, &settings.api)
            .await
            .map_err(StartupError::Producers)?;
        let lookup_group = format!(
            "{}-{}-report-lookups",
            settings.api.transactional_id_prefix, settings.api.replica_id
        );
        let log = LogReader::new(&settings.kafka, records_partitions, &lookup_group)
            .map_err(StartupError::LogReader)?;
        let storage = Storage::new(
            quire_s3::build_client(&settings.s3).await,
            settings.s3.bucket.clone(),
        );
        if let Err(error) = storage.check_bucket(STARTUP_S3_CHECK).await {
            tracing::warn!(error = %error, "s3 bucket not reachable; report and definition routes fail until it is");
        }

        let services = Arc::new(Services {
            limits,
            records_topic: RecordsTopic::new(&settings.kafka.topics.records),
            publisher,
            storage,
            log,
            metrics: Arc::new(Metrics::new()),
            replica_id: settings.api.replica_id.clone(),
        });
        let tokens = BearerTokens::new(&settings.api.auth_tokens);
        tracing::info!(
            %address,
            producers = settings.api.producers.max(1),
            replica_id = %settings.api.replica_id,
            records_topic = %settings.kafka.topics.records,
            bucket = %settings.s3.bucket,
            authentication = tokens.enabled(),
            "producer api ready"
        );
        Ok(Application {
            listener,
            address,
            router: router(services, tokens),
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
        axum::serve(self.listener, self.router)
            .with_graceful_shutdown(shutdown)
            .await?;
        tracing::info!("producer api stopped");
        Ok(())
    }
}

fn limits(settings: &Settings) -> Result<Limits, StartupError> {
    let api = &settings.api;
    for (key, value) in [
        ("max_body_bytes", api.max_body_bytes),
        ("max_record_bytes", api.max_record_bytes),
        ("max_records_per_request", api.max_records_per_request),
    ] {
        if value == 0 {
            return Err(StartupError::ZeroLimit { key });
        }
    }
    Ok(Limits {
        max_body_bytes: api.max_body_bytes,
        max_record_bytes: api.max_record_bytes,
        max_records_per_request: api.max_records_per_request,
    })
}

/// Every route. `/v1` requires a bearer token when tokens are configured;
/// `/healthz`, `/readyz` and `/metrics` stay open. Every request is counted
/// and timed, unknown routes included.
pub fn router(services: AppState, tokens: BearerTokens) -> Router {
    let metrics = Arc::clone(&services.metrics);
    let v1 = Router::new()
        .route("/v1/streams/{stream}/records", post(records::post_records))
        .route(
            "/v1/streams/{stream}/reports",
            post(reports::post_cut).get(reports::list_reports),
        )
        .route(
            "/v1/streams/{stream}/definition",
            get(definitions::get_definition).put(definitions::put_definition),
        )
        .route("/v1/reports/{id}", get(reports::get_report))
        .route("/v1/reports/{id}/content", get(reports::get_report_content))
        .route_layer(middleware::from_fn_with_state(
            tokens,
            auth::require_bearer_token,
        ));
    let open = Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::exposition));
    v1.merge(open)
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

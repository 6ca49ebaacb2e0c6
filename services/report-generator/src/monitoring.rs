//! What the worker tells the outside: `/metrics` (Prometheus), `/healthz`
//! (the process answers and its loop is turning) and `/readyz` (a session
//! holds an assignment and is not restarting), served with axum on
//! `worker.metrics_listen`.
//!
//! The handlers only read atomics and the metrics registry: a wedged Kafka
//! or S3 call cannot make them hang.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use quire_config::WorkerSettings;
use serde_json::json;

use crate::WorkerError;
use crate::metrics::WorkerMetrics;

/// The metrics and the liveness / readiness state, shared by the loop, the
/// supervisor and the HTTP handlers.
#[derive(Clone)]
pub struct Monitor {
    pub metrics: Arc<WorkerMetrics>,
    pub health: Arc<WorkerHealth>,
}

impl Monitor {
    pub fn new(settings: &WorkerSettings) -> Self {
        Monitor {
            metrics: Arc::new(WorkerMetrics::new(Arc::default())),
            health: Arc::new(WorkerHealth::new(settings.wedged_after)),
        }
    }

    /// Binds `listen` (port 0 picks a free port), logs the bound address as
    /// `metrics_address` and serves in the background. Returns the address.
    pub async fn serve(&self, listen: &str) -> Result<SocketAddr, WorkerError> {
        let listener = tokio::net::TcpListener::bind(listen).await.map_err(|error| {
            WorkerError::Config(format!(
                "worker.metrics_listen {listen} cannot be bound: {error} (port 0 picks a free port)"
            ))
        })?;
        let address = listener.local_addr().map_err(|error| {
            WorkerError::Config(format!(
                "worker.metrics_listen {listen}: no local address: {error}"
            ))
        })?;
        let app = self.router();
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(error = %error, "metrics server stopped");
            }
        });
        tracing::info!(metrics_address = %address, "serving /metrics, /healthz and /readyz");
        Ok(address)
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route("/metrics", get(exposition))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(self.clone())
    }
}

/// Where the supervisor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SessionState {
    /// Building clients (first start, or after a backoff).
    Starting = 0,
    /// The loop runs.
    Running = 1,
    /// A session failed; waiting before the next one.
    Restarting = 2,
    /// The worker is stopping (SIGTERM, drain done).
    Stopping = 3,
}

impl SessionState {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => SessionState::Running,
            2 => SessionState::Restarting,
            3 => SessionState::Stopping,
            _ => SessionState::Starting,
        }
    }

    fn name(self) -> &'static str {
        match self {
            SessionState::Starting => "starting",
            SessionState::Running => "running",
            SessionState::Restarting => "restarting",
            SessionState::Stopping => "stopping",
        }
    }
}

/// Liveness and readiness, as atomics the loop sets once per turn.
pub struct WorkerHealth {
    started: Instant,
    wedged_after: Duration,
    /// Milliseconds from `started` to the loop's (or the supervisor's) last turn.
    last_turn_ms: AtomicU64,
    state: AtomicU8,
    assigned_partitions: AtomicUsize,
    /// 0 unknown, 1 a broker connection is up, 2 none is.
    brokers: AtomicU8,
    /// Partitions held back by a hanging transaction.
    stuck: std::sync::Mutex<Vec<crate::stuck::Stuck>>,
}

impl WorkerHealth {
    pub fn new(wedged_after: Duration) -> Self {
        WorkerHealth {
            started: Instant::now(),
            wedged_after,
            last_turn_ms: AtomicU64::new(0),
            state: AtomicU8::new(SessionState::Starting as u8),
            assigned_partitions: AtomicUsize::new(0),
            brokers: AtomicU8::new(0),
            stuck: std::sync::Mutex::default(),
        }
    }

    pub fn set_stuck(&self, stuck: Vec<crate::stuck::Stuck>) {
        *self
            .stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = stuck;
    }

    /// The partitions held back by a hanging transaction, for `/readyz`.
    fn stuck_partitions(&self) -> Vec<serde_json::Value> {
        self.stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|stuck| {
                json!({
                    "partition": stuck.partition,
                    "last_stable_offset": stuck.last_stable_offset,
                    "high_watermark": stuck.high_watermark,
                    "stuck_seconds": stuck.for_how_long.as_secs(),
                })
            })
            .collect()
    }

    /// The loop (or the supervisor, while it waits) is making progress.
    pub fn turned(&self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_turn_ms.store(now, Ordering::Relaxed);
    }

    pub fn set_state(&self, state: SessionState) {
        self.state.store(state as u8, Ordering::Relaxed);
        if state != SessionState::Running {
            self.assigned_partitions.store(0, Ordering::Relaxed);
            self.brokers.store(0, Ordering::Relaxed);
        }
        self.turned();
    }

    pub fn state(&self) -> SessionState {
        SessionState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_assignment(&self, partitions: usize, brokers_up: Option<bool>) {
        self.assigned_partitions
            .store(partitions, Ordering::Relaxed);
        let brokers = match brokers_up {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        };
        self.brokers.store(brokers, Ordering::Relaxed);
    }

    /// How long since the last turn.
    fn since_last_turn(&self) -> Duration {
        let last = Duration::from_millis(self.last_turn_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }

    /// `None` when alive, or why not.
    pub fn liveness_problem(&self) -> Option<String> {
        let since = self.since_last_turn();
        (since > self.wedged_after).then(|| {
            format!(
                "the worker loop has not turned for {} ms (limit {} ms)",
                since.as_millis(),
                self.wedged_after.as_millis()
            )
        })
    }

    /// `None` when ready, or why not.
    pub fn readiness_problem(&self) -> Option<String> {
        let state = self.state();
        if state != SessionState::Running {
            return Some(format!("the worker is {}", state.name()));
        }
        if self.brokers.load(Ordering::Relaxed) == 2 {
            return Some("no Kafka broker connection is up".to_owned());
        }
        if self.assigned_partitions.load(Ordering::Relaxed) == 0 {
            return Some("the worker holds no partition yet".to_owned());
        }
        None
    }
}

/// `GET /metrics`.
async fn exposition(State(monitor): State<Monitor>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        monitor.metrics.encode(),
    )
        .into_response()
}

/// `GET /healthz`: 200 while the loop turns, 503 once it is wedged.
async fn healthz(State(monitor): State<Monitor>) -> Response {
    match monitor.health.liveness_problem() {
        None => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Some(reason) => {
            tracing::warn!(reason, "not healthy");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"status": "wedged", "reason": reason})),
            )
                .into_response()
        }
    }
}

/// `GET /readyz`: 200 while a running session holds partitions, 503 naming
/// why not. Partitions held back by a hanging transaction are listed as
/// `stuck_partitions` (status `degraded`, still 200: the worker serves its
/// other partitions, and restarting it would not help).
async fn readyz(State(monitor): State<Monitor>) -> Response {
    let health = &monitor.health;
    let stuck = health.stuck_partitions();
    match health.readiness_problem() {
        None => (
            StatusCode::OK,
            axum::Json(json!({
                "status": if stuck.is_empty() { "ready" } else { "degraded" },
                "partitions": health.assigned_partitions.load(Ordering::Relaxed),
                "stuck_partitions": stuck,
            })),
        )
            .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "not_ready", "reason": reason, "stuck_partitions": stuck})),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;

    fn monitor(wedged_after: Duration) -> Monitor {
        Monitor {
            metrics: Arc::new(WorkerMetrics::new(Arc::default())),
            health: Arc::new(WorkerHealth::new(wedged_after)),
        }
    }

    async fn get(monitor: &Monitor, path: &str) -> (StatusCode, String) {
        let response = monitor
            .router()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics_text() {
        let monitor = monitor(Duration::from_secs(60));
        monitor.metrics.array_read(3, Duration::from_millis(1));
        let (status, body) = get(&monitor, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.contains("quire_worker_array_records_count 1"),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"));
    }

    #[tokio::test]
    async fn ready_only_while_running_with_partitions_and_a_broker() {
        let monitor = monitor(Duration::from_secs(60));
        let (status, body) = get(&monitor, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("starting"), "{body}");
        monitor.health.set_state(SessionState::Running);
        let (status, body) = get(&monitor, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("no partition"), "{body}");
        monitor.health.set_assignment(4, Some(true));
        let (status, body) = get(&monitor, "/readyz").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains(r#""partitions":4"#), "{body}");
        monitor.health.set_assignment(4, Some(false));
        assert_eq!(
            get(&monitor, "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        monitor.health.set_assignment(4, Some(true));
        monitor.health.set_state(SessionState::Restarting);
        let (status, body) = get(&monitor, "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("restarting"), "{body}");
    }

    #[tokio::test]
    async fn healthz_fails_once_the_loop_stops_turning() {
        let monitor = monitor(Duration::from_millis(50));
        monitor.health.turned();
        assert_eq!(get(&monitor, "/healthz").await.0, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(120)).await;
        let (status, body) = get(&monitor, "/healthz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("has not turned"), "{body}");
        monitor.health.turned();
        assert_eq!(get(&monitor, "/healthz").await.0, StatusCode::OK);
    }
}

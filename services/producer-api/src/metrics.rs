//! Prometheus metrics of the API, the middleware that counts every request,
//! and the `/metrics` exposition.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::errors::ErrorCode;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: String,
    /// The route's template (`/v1/streams/{stream}/records`), never the raw
    /// path, so stream names do not explode the label set.
    route: String,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    code: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every metric the API exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: HistogramFamily<RequestLabels>,
    errors: Family<ErrorLabels, Counter>,
    in_flight: Gauge,
    records_accepted: Counter,
    /// Batch messages of accepted arrays (records / this: records per message).
    batch_messages: Counter,
    arrays_accepted: Counter,
    array_records: Histogram,
    enqueue_seconds: Histogram,
    cuts: Counter,
    download_urls: Counter,
    definitions: Counter,
    in_flight_bytes: Gauge,
    idempotent_replays: Counter,
    kafka_available: Gauge,
    transaction_seconds: HistogramFamily<OutcomeLabels>,
    producers_recreated: Counter,
    partitions_released: Counter,
    open_connections: Gauge,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    /// `committed`, `aborted` or `unknown`.
    outcome: &'static str,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("quire_api");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by method, route and status",
            requests.clone(),
        );
        let request_seconds: HistogramFamily<RequestLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time to answer an HTTP request (until the response head), by method, route and status",
            request_seconds.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "http_errors",
            "Error answers, by error code",
            errors.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "http_requests_in_flight",
            "HTTP requests being handled",
            in_flight.clone(),
        );
        let records_accepted = Counter::default();
        registry.register(
            "records_accepted",
            "Records published (committed) to Kafka",
            records_accepted.clone(),
        );
        let batch_messages = Counter::default();
        registry.register(
            "batch_messages",
            "Batch messages published (committed) to Kafka, each carrying records of one array (at most api.batch_max_bytes of them, or one larger record)",
            batch_messages.clone(),
        );
        let arrays_accepted = Counter::default();
        registry.register(
            "arrays_accepted",
            "Record arrays (requests) published to Kafka",
            arrays_accepted.clone(),
        );
        let array_records = Histogram::new(exponential_buckets(1.0, 4.0, 10));
        registry.register(
            "array_records",
            "Records per accepted array",
            array_records.clone(),
        );
        let enqueue_seconds = latency_histogram();
        registry.register(
            "enqueue_duration_seconds",
            "Time an array waits for its (group-commit) Kafka transaction to commit",
            enqueue_seconds.clone(),
        );
        let cuts = Counter::default();
        registry.register("cuts", "Cut markers published", cuts.clone());
        let download_urls = Counter::default();
        registry.register(
            "download_urls",
            "Presigned S3 URLs of report documents handed out (GET /v1/reports/{id}/url and ?redirect=true)",
            download_urls.clone(),
        );
        let definitions = Counter::default();
        registry.register(
            "definitions",
            "Definition changes published",
            definitions.clone(),
        );
        let in_flight_bytes = Gauge::default();
        registry.register(
            "in_flight_bytes",
            "Bytes of request bodies held (being read, validated or waiting for their transaction), bounded by api.max_in_flight_bytes",
            in_flight_bytes.clone(),
        );
        let idempotent_replays = Counter::default();
        registry.register(
            "idempotent_replays",
            "Requests answered from the Idempotency-Key store (nothing published again)",
            idempotent_replays.clone(),
        );
        let kafka_available = Gauge::default();
        kafka_available.set(1);
        registry.register(
            "kafka_available",
            "1 while the Kafka check answers, 0 while publishing requests are refused with 503",
            kafka_available.clone(),
        );
        let transaction_seconds: HistogramFamily<OutcomeLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "transaction_duration_seconds",
            "Time of one group-commit Kafka transaction (begin to commit or abort), by outcome",
            transaction_seconds.clone(),
        );
        let producers_recreated = Counter::default();
        registry.register(
            "producers_recreated",
            "Transactional producers recreated after they became unusable",
            producers_recreated.clone(),
        );
        let partitions_released = Counter::default();
        registry.register(
            "release_transactions",
            "Release transactions committed: one message to every records partition, so no transaction a producer left open there (a COMMIT marker a crashed broker skipped) holds readers back",
            partitions_released.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "open_connections",
            "Client connections accepted and not yet closed, at most api.max_connections (past it new ones wait in the kernel's backlog, not counted here)",
            open_connections.clone(),
        );
        Metrics {
            partitions_released,
            open_connections,
            in_flight_bytes,
            idempotent_replays,
            kafka_available,
            transaction_seconds,
            producers_recreated,
            registry,
            requests,
            request_seconds,
            errors,
            in_flight,
            records_accepted,
            batch_messages,
            arrays_accepted,
            array_records,
            enqueue_seconds,
            cuts,
            download_urls,
            definitions,
        }
    }

    /// An array of `records` published in `batches` batch messages.
    pub fn array_accepted(&self, records: usize, batches: usize, enqueue_time: Duration) {
        self.records_accepted.inc_by(records as u64);
        self.batch_messages.inc_by(batches as u64);
        self.arrays_accepted.inc();
        self.array_records.observe(records as f64);
        self.enqueue_seconds.observe(enqueue_time.as_secs_f64());
    }

    pub fn cut_published(&self) {
        self.cuts.inc();
    }

    pub fn download_url_issued(&self) {
        self.download_urls.inc();
    }

    pub fn definition_published(&self) {
        self.definitions.inc();
    }

    /// The gauge the in-flight byte limit keeps up to date.
    pub fn in_flight_bytes_gauge(&self) -> Gauge {
        self.in_flight_bytes.clone()
    }

    /// The gauge the server keeps up to date as it accepts and closes
    /// connections ([`crate::serve::serve`]).
    pub fn open_connections_gauge(&self) -> Gauge {
        self.open_connections.clone()
    }

    pub fn idempotent_replay(&self) {
        self.idempotent_replays.inc();
    }

    pub fn set_kafka_available(&self, available: bool) {
        self.kafka_available.set(i64::from(available));
    }

    /// One transaction ended: `committed`, `aborted` or `unknown`.
    pub fn transaction_ended(&self, outcome: &'static str, elapsed: Duration) {
        self.transaction_seconds
            .get_or_create(&OutcomeLabels { outcome })
            .observe(elapsed.as_secs_f64());
    }

    pub fn producer_recreated(&self) {
        self.producers_recreated.inc();
    }

    pub fn partitions_released(&self) {
        self.partitions_released.inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::with_capacity(8192);
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }

    fn request_answered(
        &self,
        labels: RequestLabels,
        elapsed: Duration,
        code: Option<&'static str>,
    ) {
        self.request_seconds
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        self.requests.get_or_create(&labels).inc();
        if let Some(code) = code {
            self.errors.get_or_create(&ErrorLabels { code }).inc();
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Counts and times every request, and logs it (method, route, status,
/// latency; never headers or bodies).
pub async fn track_requests(
    State(metrics): State<Arc<Metrics>>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = method_label(request.method()).to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let in_flight = InFlight::enter(&metrics.in_flight);
    let response = next.run(request).await;
    drop(in_flight);
    let elapsed = started.elapsed();
    let status = response.status();
    let code = response.extensions().get::<ErrorCode>().map(|code| code.0);
    let latency_ms = elapsed.as_secs_f64() * 1000.0;
    if status.is_server_error() {
        tracing::warn!(%method, %route, status = status.as_u16(), code, latency_ms, "request failed");
    } else if status.is_client_error() {
        tracing::info!(%method, %route, status = status.as_u16(), code, latency_ms, "request refused");
    } else {
        tracing::debug!(%method, %route, status = status.as_u16(), latency_ms, "request");
    }
    metrics.request_answered(
        RequestLabels {
            method,
            route,
            status: status.as_u16(),
        },
        elapsed,
        code,
    );
    response
}

/// The `method` label of a request: one of the methods HTTP defines, or
/// `other`. hyper accepts any token as a method, so a label taken as sent
/// would let one client add a series per made-up method (each up to the
/// header size limit) to every scrape.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::OPTIONS,
        Method::PATCH,
        Method::TRACE,
        Method::CONNECT,
    ]
    .into_iter()
    .zip([
        "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT",
    ])
    .find_map(|(known, label)| (known == method).then_some(label))
    .unwrap_or("other")
}

/// Counts a request in flight until dropped, also when the client goes away
/// and the request's future is dropped mid-way.
struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    fn enter(gauge: &'a Gauge) -> Self {
        gauge.inc();
        InFlight(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What `/metrics` needs of the app's state: the metrics alone.
#[derive(Clone)]
pub struct MetricsOnly(pub Arc<Metrics>);

/// `GET /metrics`.
pub async fn exposition(State(MetricsOnly(metrics)): State<MetricsOnly>) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        metrics.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_routes_not_paths() {
        let metrics = Metrics::new();
        metrics.request_answered(
            RequestLabels {
                method: "POST".into(),
                route: "/v1/streams/{stream}/records".into(),
                status: 200,
            },
            Duration::from_millis(3),
            None,
        );
        metrics.request_answered(
            RequestLabels {
                method: "POST".into(),
                route: "/v1/streams/{stream}/records".into(),
                status: 422,
            },
            Duration::from_millis(1),
            Some("forbidden_character"),
        );
        metrics.array_accepted(250, 3, Duration::from_millis(2));
        metrics.idempotent_replay();
        metrics.transaction_ended("committed", Duration::from_millis(4));
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"quire_api_http_requests_total{method="POST",route="/v1/streams/{stream}/records",status="200"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"quire_api_http_errors_total{code="forbidden_character"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("quire_api_records_accepted_total 250")
                && text.contains("quire_api_batch_messages_total 3"),
            "{text}"
        );
        assert!(
            text.contains("quire_api_http_request_duration_seconds_bucket"),
            "{text}"
        );
        assert!(
            text.contains("quire_api_idempotent_replays_total 1"),
            "{text}"
        );
        assert!(
            text.contains(r#"quire_api_transaction_duration_seconds_count{outcome="committed"} 1"#),
            "{text}"
        );
        assert!(text.contains("quire_api_kafka_available 1"), "{text}");
        assert!(text.contains("quire_api_in_flight_bytes 0"), "{text}");
        assert!(text.contains("quire_api_open_connections 0"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn the_open_connections_gauge_is_the_one_exposed() {
        let metrics = Metrics::new();
        let gauge = metrics.open_connections_gauge();
        gauge.inc();
        gauge.inc();
        assert!(
            metrics.encode().contains("quire_api_open_connections 2"),
            "{}",
            metrics.encode()
        );
        gauge.dec();
        assert!(
            metrics.encode().contains("quire_api_open_connections 1"),
            "{}",
            metrics.encode()
        );
    }
}

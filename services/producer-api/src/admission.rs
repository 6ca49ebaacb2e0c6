//! What happens to a publishing request before its handler runs: the
//! in-flight byte limit, `Idempotency-Key`, and the Kafka gate. The
//! middlewares take only what they use ([`Gate`], from the app's state by
//! axum's `FromRef`), so they are tested without Kafka or S3.
//!
//! - **In-flight bytes** ([`crate::body`]): a request that cannot get its
//!   share of `api.max_in_flight_bytes` at once is answered 429 with
//!   `Retry-After`; nothing waits in a queue.
//! - **Idempotency-Key** ([`crate::idempotency`]): a replay is answered from
//!   the store (even while Kafka is away); a key in use for another body is
//!   422, one whose first request is still running, or whose commit's
//!   outcome is being settled, is 409 with `Retry-After`. A keyed request
//!   runs to its end in a task of its own, so a client that goes away cannot
//!   leave a published array unremembered; an answer that carries
//!   [`idempotency::Unsettled`] keeps its key until a background task has
//!   read the outcome from the log.
//! - **The Kafka gate** ([`crate::kafka_health`]): while Kafka does not
//!   answer, a request that would publish is answered 503 with
//!   `Retry-After` at once.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use backon::{ExponentialBuilder, Retryable};
use tokio_util::sync::CancellationToken;

use crate::auth;
use crate::body::{InFlightBytes, read_body_reserving};
use crate::errors::ApiError;
use crate::idempotency::{self, Begin, IdempotencyStore, ScopedKey, StoredResponse};
use crate::kafka_health::KafkaHealth;
use crate::key_log::KeyLog;
use crate::metrics::Metrics;

/// What admission uses, and nothing else.
#[derive(Clone)]
pub struct Gate {
    pub in_flight_bytes: Arc<InFlightBytes>,
    pub idempotency: Arc<IdempotencyStore>,
    pub kafka_health: Arc<KafkaHealth>,
    pub metrics: Arc<Metrics>,
    /// `api.max_body_bytes`.
    pub max_body_bytes: usize,
    /// `api.body_read_timeout_ms`.
    pub body_read_timeout: Duration,
    /// Whether bearer tokens are checked (keys are then scoped per token).
    pub tokens_enabled: bool,
    /// The answers of every replica in Kafka (none in unit tests).
    pub key_log: Option<Arc<KeyLog>>,
    /// Stops the background reads of unknown outcomes (the API is stopping).
    pub stop: CancellationToken,
}

/// Which admission a route gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Publishes and honours `Idempotency-Key` (records, cut): in-flight
    /// bytes, idempotency, Kafka gate.
    IdempotentPublish,
    /// Publishes (definitions): the Kafka gate only.
    Publish,
}

/// The Kafka gate alone.
pub async fn kafka_gate(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if let Some(reason) = gate.kafka_health.unavailable_because() {
        return ApiError::KafkaUnavailable(reason).into_response();
    }
    next.run(request).await
}

/// In-flight bytes, `Idempotency-Key` and the Kafka gate, in that order (a
/// replay needs neither Kafka nor a new transaction).
pub async fn admit_publish(State(state): State<Gate>, request: Request, next: Next) -> Response {
    match admit(state, request, next).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn admit(state: Gate, request: Request, next: Next) -> Result<Response, ApiError> {
    let key = request
        .headers()
        .get(idempotency::HEADER)
        .map(idempotency::parse_key)
        .transpose()?;
    if key.is_none()
        && let Some(reason) = state.kafka_health.unavailable_because()
    {
        // Nothing to replay: refuse before reading the body.
        return Err(ApiError::KafkaUnavailable(reason));
    }
    let (parts, body) = request.into_parts();
    let mut reservation = state.in_flight_bytes.reservation();
    let timeout = state.body_read_timeout;
    let body = tokio::time::timeout(
        timeout,
        read_body_reserving(body, &parts.headers, state.max_body_bytes, &mut reservation),
    )
    .await
    .map_err(|_elapsed| ApiError::BodyTimeout {
        limit_ms: timeout.as_millis() as u64,
    })??;

    let Some(key) = key else {
        let request = Request::from_parts(parts, Body::from(body));
        let response = next.run(request).await;
        drop(reservation);
        return Ok(response);
    };

    let path = canonical_path(parts.uri.path());
    let scoped = ScopedKey {
        principal: auth::principal(&parts.headers, state.tokens_enabled),
        method: parts.method.as_str().to_owned(),
        path: path.clone().into_owned(),
        key,
    };
    let fingerprint = idempotency::fingerprint(parts.method.as_str(), &path, &body);
    // A key unknown here may have been answered by another replica, or by
    // this one before a restart: wait until the tail has read what was
    // committed before now (at most api.idempotency_lookup_timeout_ms; failing, 503 and
    // nothing published). While Kafka is known to be away, no wait: the
    // gate below answers 503 at once.
    if let Some(key_log) = &state.key_log
        && !state.idempotency.contains(&scoped)
        && state.kafka_health.unavailable_because().is_none()
    {
        key_log
            .catch_up_for(&scoped)
            .await
            .map_err(|error| ApiError::KeyLogUnavailable(error.to_string()))?;
    }
    let keyed = idempotency::KeyedRequest {
        key: scoped.clone(),
        fingerprint,
    };
    let claim = match state.idempotency.begin(scoped, fingerprint) {
        Begin::Replay(stored) => {
            state.metrics.idempotent_replay();
            tracing::debug!(path = %parts.uri.path(), "idempotent replay");
            return Ok(replay(&stored));
        }
        Begin::Mismatch => return Err(ApiError::IdempotencyKeyReused),
        Begin::InProgress => return Err(ApiError::IdempotencyKeyInProgress),
        Begin::Proceed(claim) => claim,
    };
    if let Some(reason) = state.kafka_health.unavailable_because() {
        // The claim is dropped: nothing published, a retry may publish.
        return Err(ApiError::KafkaUnavailable(reason));
    }
    let method = parts.method.clone();
    let stop = state.stop.clone();
    let mut request = Request::from_parts(parts, Body::from(body));
    request.extensions_mut().insert(keyed);
    // The request runs to its end even if the client goes away, so an array
    // that gets published is always remembered under its key.
    let handled = tokio::spawn(async move {
        let response = next.run(request).await;
        drop(reservation);
        match response
            .extensions()
            .get::<idempotency::Unsettled>()
            .cloned()
        {
            Some(unsettled) => {
                // The key stays (409 to retries) until the log tells.
                claim.settling();
                tokio::spawn(settle_in_background(claim, unsettled, stop));
                response
            }
            None => remember(claim, response).await,
        }
    });
    handled
        .await
        .map_err(|error| ApiError::Internal(format!("the {method} request's task failed: {error}")))
}

/// Pause between two attempts to settle an unknown outcome, at first and
/// at most (Kafka may be away for a while).
const SETTLE_PAUSE: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// Reads the log until the outcome is known, then remembers the answer the
/// request would have had (committed), or forgets the key (aborted:
/// nothing was published, a retry may publish). Stops at `stop` (the key
/// is then forgotten with the process).
async fn settle_in_background(
    claim: idempotency::Claim,
    unsettled: idempotency::Unsettled,
    stop: CancellationToken,
) {
    /// The log could not tell yet.
    struct NotYet;
    let settled = (|| async { (unsettled.settle)().await.ok_or(NotYet) })
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(SETTLE_PAUSE.0)
                .with_max_delay(SETTLE_PAUSE.1)
                .without_max_times(),
        )
        .sleep(tokio::time::sleep);
    let answer = tokio::select! {
        () = stop.cancelled() => return,
        answer = settled => answer,
    };
    if let Ok(answer) = answer {
        tracing::info!(status = %answer.status(), "an unknown commit outcome was settled; its Idempotency-Key now answers it");
        remember(claim, answer).await;
    }
}

/// Stores a definite answer under the claim (and gives it back unchanged);
/// any other answer forgets the key.
async fn remember(claim: idempotency::Claim, response: Response) -> Response {
    let status = response.status();
    if !idempotency::is_definite(status) {
        return response;
    }
    let (parts, body) = response.into_parts();
    // The answers of these routes are small JSON documents.
    let body = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(body) => body,
        Err(error) => {
            return ApiError::Internal(format!("cannot buffer the answer: {error}"))
                .into_response();
        }
    };
    let headers = [header::CONTENT_TYPE, header::LOCATION]
        .into_iter()
        .filter_map(|name| {
            parts
                .headers
                .get(&name)
                .map(|value| (static_name(&name), value.clone()))
        })
        .collect();
    claim.complete(StoredResponse {
        status,
        headers,
        body: body.clone(),
    });
    Response::from_parts(parts, Body::from(body))
}

fn static_name(name: &header::HeaderName) -> &'static str {
    if name == header::LOCATION {
        "location"
    } else {
        "content-type"
    }
}

fn replay(stored: &StoredResponse) -> Response {
    let mut response = (stored.status, stored.body.clone()).into_response();
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        headers.insert(*name, value.clone());
    }
    headers.insert(
        idempotency::REPLAYED_HEADER,
        HeaderValue::from_static("true"),
    );
    response
}

/// The path as the router reads it, percent-decoded: `/v1/streams/%73/records`
/// and `/v1/streams/s/records` name one stream, so they share their keys
/// (else a retry through the other spelling would publish again). A path
/// that does not decode to UTF-8 stays as sent; the router refuses it.
fn canonical_path(path: &str) -> std::borrow::Cow<'_, str> {
    percent_encoding::percent_decode_str(path)
        .decode_utf8()
        .unwrap_or(std::borrow::Cow::Borrowed(path))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;
    use prometheus_client::metrics::gauge::Gauge;
    use tower::ServiceExt;

    use super::*;
    use crate::idempotency::StoreLimits;

    /// A gate of `in_flight` bytes in front of a handler that counts its
    /// calls and answers the body's length: no Kafka, no S3.
    fn gated(in_flight: usize) -> (Router, Gate, Arc<AtomicUsize>) {
        let gate = Gate {
            in_flight_bytes: InFlightBytes::new(in_flight, Gauge::default()),
            idempotency: IdempotencyStore::new(StoreLimits {
                max_keys: 100,
                max_bytes: 1 << 20,
                ttl: Duration::from_secs(60),
            }),
            kafka_health: KafkaHealth::new(),
            metrics: Arc::new(Metrics::new()),
            max_body_bytes: 1000,
            body_read_timeout: Duration::from_secs(5),
            tokens_enabled: false,
            key_log: None,
            stop: CancellationToken::new(),
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let router = Router::new()
            .route(
                "/streams/{stream}/records",
                post({
                    let counted = Arc::clone(&counted);
                    move || async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        StatusCode::OK
                    }
                }),
            )
            .route(
                "/records",
                post(move |body: axum::body::Bytes| async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::OK, format!("{{\"bytes\":{}}}", body.len()))
                }),
            )
            .route_layer(axum::middleware::from_fn_with_state(
                gate.clone(),
                admit_publish,
            ));
        (router, gate, calls)
    }

    async fn post_body(
        router: &Router,
        key: Option<&str>,
        body: &'static str,
    ) -> (StatusCode, HeaderMap, String) {
        let mut request = Request::post("/records").header(header::CONTENT_LENGTH, body.len());
        if let Some(key) = key {
            request = request.header(idempotency::HEADER, key);
        }
        let response = router
            .clone()
            .oneshot(request.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, headers, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_keyed_request_runs_once_and_is_replayed_after() {
        let (router, gate, calls) = gated(1000);
        let (status, headers, body) = post_body(&router, Some("k-1"), "[{}]").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"bytes":4}"#));
        assert!(headers.get(idempotency::REPLAYED_HEADER).is_none());
        let (status, headers, body) = post_body(&router, Some("k-1"), "[{}]").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, r#"{"bytes":4}"#));
        assert_eq!(headers.get(idempotency::REPLAYED_HEADER).unwrap(), "true");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "the replay ran the handler"
        );
        // The same key for another body is refused, and runs nothing.
        let (status, _, _) = post_body(&router, Some("k-1"), "[{},{}]").await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(gate.in_flight_bytes.held(), 0, "a request kept its bytes");
    }

    /// A retry through another spelling of the same stream is a replay.
    #[tokio::test]
    async fn a_key_is_scoped_by_the_stream_however_its_path_is_spelled() {
        let (router, _gate, calls) = gated(1000);
        let mut replayed = Vec::new();
        for path in ["/streams/%73/records", "/streams/s/records"] {
            let request = Request::post(path)
                .header(idempotency::HEADER, "one-key")
                .body(Body::from("[{}]"))
                .unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            replayed.push(
                response
                    .headers()
                    .contains_key(idempotency::REPLAYED_HEADER),
            );
        }
        assert_eq!(replayed, [false, true]);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "published once");
    }

    #[tokio::test]
    async fn while_kafka_is_away_new_requests_are_503_but_replays_answer() {
        let (router, gate, calls) = gated(1000);
        post_body(&router, Some("before"), "[{}]").await;
        gate.kafka_health
            .record(Err("all brokers down".into()), &gate.metrics);
        for key in [None, Some("new")] {
            let (status, headers, body) = post_body(&router, key, "[{}]").await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{key:?}: {body}");
            assert!(headers.contains_key(header::RETRY_AFTER), "{key:?}");
            assert!(body.contains("kafka is not reachable"), "{body}");
            // librdkafka's reason may name brokers: it is for the log only.
            assert!(!body.contains("all brokers down"), "{body}");
        }
        let (status, headers, _) = post_body(&router, Some("before"), "[{}]").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers.get(idempotency::REPLAYED_HEADER).unwrap(), "true");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // A refused key was not remembered: once Kafka is back it publishes.
        gate.kafka_health.record(Ok(()), &gate.metrics);
        let (status, headers, _) = post_body(&router, Some("new"), "[{}]").await;
        assert_eq!(status, StatusCode::OK);
        assert!(headers.get(idempotency::REPLAYED_HEADER).is_none());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_body_over_the_in_flight_bytes_is_429_and_holds_nothing_after() {
        let (router, gate, calls) = gated(8);
        let (status, headers, _) = post_body(&router, None, "[{},{},{}]").await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(headers.contains_key(header::RETRY_AFTER));
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert_eq!(gate.in_flight_bytes.held(), 0);
        let (status, _, _) = post_body(&router, None, "[{}]").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(gate.in_flight_bytes.held(), 0);
    }

    /// A route whose publish has an unknown outcome; `verdict` says what
    /// the log tells: 0 nothing yet, 1 committed, 2 aborted.
    fn unsettled(verdict: Arc<AtomicUsize>, calls: Arc<AtomicUsize>) -> Router {
        let gate = gated(1000).1;
        Router::new()
            .route(
                "/records",
                post(move || {
                    let (verdict, calls) = (Arc::clone(&verdict), Arc::clone(&calls));
                    async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        let mut response =
                            (StatusCode::INTERNAL_SERVER_ERROR, "unknown").into_response();
                        let settle =
                            move || -> futures::future::BoxFuture<'static, Option<Response>> {
                                let verdict = verdict.load(Ordering::SeqCst);
                                Box::pin(async move {
                                    match verdict {
                                        0 => None,
                                        1 => Some((StatusCode::OK, "committed").into_response()),
                                        _ => Some(
                                            (StatusCode::SERVICE_UNAVAILABLE, "aborted")
                                                .into_response(),
                                        ),
                                    }
                                })
                            };
                        response.extensions_mut().insert(idempotency::Unsettled {
                            settle: Arc::new(settle),
                        });
                        response
                    }
                }),
            )
            .route_layer(axum::middleware::from_fn_with_state(gate, admit_publish))
    }

    /// An unknown outcome keeps its key: a retry is 409 (never a second
    /// publish) until the log tells; then committed is replayed, and
    /// aborted lets a retry publish.
    #[tokio::test]
    async fn an_unknown_outcome_keeps_its_key_until_the_log_tells() {
        for (verdict_now, then_replayed) in [(1, true), (2, false)] {
            let verdict = Arc::new(AtomicUsize::new(0));
            let calls = Arc::new(AtomicUsize::new(0));
            let router = unsettled(Arc::clone(&verdict), Arc::clone(&calls));
            let (status, _, body) = post_body(&router, Some("k"), "[{}]").await;
            assert_eq!(
                (status, body.as_str()),
                (StatusCode::INTERNAL_SERVER_ERROR, "unknown")
            );
            // Past the first look at the log, which could not tell.
            tokio::time::sleep(SETTLE_PAUSE.0 + Duration::from_millis(100)).await;
            let (status, headers, _) = post_body(&router, Some("k"), "[{}]").await;
            assert_eq!(status, StatusCode::CONFLICT, "a retry while settling");
            assert!(headers.contains_key(header::RETRY_AFTER));
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "published again while unknown"
            );
            verdict.store(verdict_now, Ordering::SeqCst);
            // The next look (after a doubled pause) tells.
            tokio::time::sleep(SETTLE_PAUSE.0 * 3).await;
            let (status, headers, body) = post_body(&router, Some("k"), "[{}]").await;
            if then_replayed {
                assert_eq!((status, body.as_str()), (StatusCode::OK, "committed"));
                assert_eq!(headers.get(idempotency::REPLAYED_HEADER).unwrap(), "true");
                assert_eq!(calls.load(Ordering::SeqCst), 1);
            } else {
                // Aborted: nothing was published, so the retry ran.
                assert_eq!(calls.load(Ordering::SeqCst), 2);
            }
        }
    }
}

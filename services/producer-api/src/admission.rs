//! What happens to a publishing request before its handler runs: the
//! in-flight byte limit, `Idempotency-Key`, and the Kafka gate.
//!
//! - **In-flight bytes.** Request bodies held at once (being read,
//!   validated, or waiting for their transaction) stay under
//!   `api.max_in_flight_bytes`. A body's share is taken as it is read (its
//!   Content-Length at once when declared) and given back when the request
//!   is answered. A request that cannot get its share at once is answered
//!   429 with `Retry-After`; nothing waits in a queue.
//! - **Idempotency-Key** ([`crate::idempotency`]): a replay is answered from
//!   the store (even while Kafka is away); a key in use for another body is
//!   422, one whose first request is still running is 409 with
//!   `Retry-After`. A keyed request runs to its end in a task of its own,
//!   so a client that goes away cannot leave a published array unremembered.
//! - **The Kafka gate** ([`crate::kafka_health`]): while Kafka does not
//!   answer, a request that would publish is answered 503 with
//!   `Retry-After` at once.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::auth;
use crate::errors::ApiError;
use crate::idempotency::{self, Begin, ScopedKey, StoredResponse};
use crate::state::AppState;

/// The bytes every request in flight holds, bounded.
pub struct InFlightBytes {
    semaphore: Arc<Semaphore>,
    limit: usize,
    gauge: Gauge,
}

/// A request's share of the in-flight bytes, given back when dropped.
pub struct Reservation {
    permits: Option<OwnedSemaphorePermit>,
    owner: Arc<InFlightBytes>,
}

impl InFlightBytes {
    pub fn new(limit: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(InFlightBytes {
            semaphore: Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS))),
            limit,
            gauge,
        })
    }

    /// An empty share, to grow as the body arrives.
    pub fn reservation(self: &Arc<Self>) -> Reservation {
        Reservation {
            permits: None,
            owner: Arc::clone(self),
        }
    }

    pub fn held(&self) -> usize {
        self.limit.min(Semaphore::MAX_PERMITS) - self.semaphore.available_permits()
    }

    fn update_gauge(&self) {
        self.gauge.set(self.held() as i64);
    }
}

impl Reservation {
    /// Takes `bytes` more at once, or refuses (429).
    pub fn grow(&mut self, bytes: usize) -> Result<(), ApiError> {
        if bytes == 0 {
            return Ok(());
        }
        let busy = || ApiError::TooBusy {
            limit: self.owner.limit,
        };
        let count = u32::try_from(bytes).map_err(|_| busy())?;
        let permit = Arc::clone(&self.owner.semaphore)
            .try_acquire_many_owned(count)
            .map_err(|_| busy())?;
        match &mut self.permits {
            Some(held) => held.merge(permit),
            None => self.permits = Some(permit),
        }
        self.owner.update_gauge();
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        self.permits
            .as_ref()
            .map_or(0, |permit| permit.num_permits())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.permits.take().is_some() {
            self.owner.update_gauge();
        }
    }
}

/// Reads a whole body of at most `limit` bytes, holding a share of the
/// in-flight bytes for it: a declared Content-Length is taken at once,
/// otherwise each chunk as it arrives.
pub async fn read_body_reserving(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    reservation: &mut Reservation,
) -> Result<Bytes, ApiError> {
    let declared_length = crate::routes::declared_length_within(headers, limit)?;
    if let Some(length) = declared_length {
        reservation.grow(length as usize)?;
    }
    let mut buffer = BytesMut::with_capacity(declared_length.unwrap_or(0) as usize);
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|error| ApiError::BodyUnreadable(error.to_string()))?;
        if buffer.len() + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        let needed = (buffer.len() + chunk.len()).saturating_sub(reservation.bytes());
        reservation.grow(needed)?;
        buffer.extend_from_slice(&chunk);
    }
    Ok(buffer.freeze())
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
pub async fn kafka_gate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(reason) = state.kafka_health.unavailable_because() {
        return ApiError::KafkaUnavailable(reason).into_response();
    }
    next.run(request).await
}

/// In-flight bytes, `Idempotency-Key` and the Kafka gate, in that order (a
/// replay needs neither Kafka nor a new transaction).
pub async fn admit_publish(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    match admit(state, request, next).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn admit(state: AppState, request: Request, next: Next) -> Result<Response, ApiError> {
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
    let timeout = state.limits.body_read_timeout;
    let body = tokio::time::timeout(
        timeout,
        read_body_reserving(
            body,
            &parts.headers,
            state.limits.max_body_bytes,
            &mut reservation,
        ),
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

    let scoped = ScopedKey {
        principal: principal(&parts.headers, state.tokens_enabled),
        method: parts.method.as_str().to_owned(),
        path: parts.uri.path().to_owned(),
        key,
    };
    let fingerprint = idempotency::fingerprint(parts.method.as_str(), parts.uri.path(), &body);
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
    let request = Request::from_parts(parts, Body::from(body));
    // The request runs to its end even if the client goes away, so an array
    // that gets published is always remembered under its key.
    let handled = tokio::spawn(async move {
        let response = next.run(request).await;
        let response = remember(claim, response).await;
        drop(reservation);
        response
    });
    handled
        .await
        .map_err(|error| ApiError::Internal(format!("the {method} request's task failed: {error}")))
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

/// Whose key it is: the SHA-256 of the bearer token when authentication is
/// on (the middleware before this one has checked it).
fn principal(headers: &HeaderMap, tokens_enabled: bool) -> idempotency::Digest32 {
    if !tokens_enabled {
        return [0; 32];
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| auth::bearer_token(value.as_bytes()))
        .unwrap_or_default();
    auth::digest(token)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    #[test]
    fn shares_are_taken_at_once_or_refused_and_given_back() {
        let gauge = Gauge::default();
        let bytes = InFlightBytes::new(100, gauge.clone());
        let mut first = bytes.reservation();
        first.grow(60).unwrap();
        first.grow(10).unwrap();
        assert_eq!(first.bytes(), 70);
        assert_eq!(gauge.get(), 70);
        let mut second = bytes.reservation();
        let error = second.grow(31).unwrap_err();
        assert_eq!(error.status(), StatusCode::TOO_MANY_REQUESTS);
        second.grow(30).unwrap();
        drop(first);
        assert_eq!(gauge.get(), 30);
        assert_eq!(bytes.held(), 30);
        drop(second);
        assert_eq!(bytes.held(), 0);
        assert_eq!(gauge.get(), 0);
    }

    #[tokio::test]
    async fn a_body_holds_its_declared_length_while_read() {
        let bytes = InFlightBytes::new(10, Gauge::default());
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("8"));
        let mut reservation = bytes.reservation();
        let body = read_body_reserving(Body::from("[{},{}]\n"), &headers, 100, &mut reservation)
            .await
            .unwrap();
        assert_eq!(body, "[{},{}]\n");
        assert_eq!(bytes.held(), 8);
        let mut other = bytes.reservation();
        let error = read_body_reserving(Body::from("[{}]"), &headers, 100, &mut other)
            .await
            .unwrap_err();
        assert!(matches!(error, ApiError::TooBusy { limit: 10 }));
        // Without Content-Length, chunk by chunk.
        let error = read_body_reserving(Body::from("[{},{}]"), &HeaderMap::new(), 100, &mut other)
            .await
            .unwrap_err();
        assert!(matches!(error, ApiError::TooBusy { .. }));
        drop(reservation);
        let body = read_body_reserving(Body::from("[{},{}]"), &HeaderMap::new(), 100, &mut other)
            .await
            .unwrap();
        assert_eq!(body.len(), 7);
    }
}

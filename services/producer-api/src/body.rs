//! Reading request bodies, and the bytes they hold: a leaf module (it
//! knows only the errors), so admission and the handlers share it and it is
//! tested without a server.
//!
//! In-flight bytes: request bodies held at once (being read, validated, or
//! waiting for their transaction) stay under `api.max_in_flight_bytes`. A
//! body's share is taken as its bytes arrive, never on the strength of a
//! declared Content-Length (connections that declare 16 MiB and send
//! nothing would otherwise lock every other client out), and given back
//! when the request is answered; a request that cannot get its share at
//! once is refused (429), nothing waits in a queue.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::errors::ApiError;

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
/// in-flight bytes for what has arrived, chunk by chunk. A declared
/// Content-Length over `limit` is refused before anything is read; one
/// under it reserves nothing, and memory is given to it only up to
/// [`PREALLOCATE_UP_TO`] before its bytes come.
pub async fn read_body_reserving(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    reservation: &mut Reservation,
) -> Result<Bytes, ApiError> {
    let declared_length = declared_length_within(headers, limit)?;
    let mut buffer = BytesMut::with_capacity(
        declared_length.map_or(0, |length| (length as usize).min(PREALLOCATE_UP_TO)),
    );
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

/// Memory set aside for a body before its bytes arrive, at most.
pub const PREALLOCATE_UP_TO: usize = 64 * 1024;

/// The request's Content-Type as sent, and its media type (lowercase,
/// parameters such as `charset` dropped); `None` without the header.
pub fn media_type(headers: &HeaderMap) -> Option<(String, String)> {
    let sent = String::from_utf8_lossy(headers.get(header::CONTENT_TYPE)?.as_bytes()).into_owned();
    let media_type = sent
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    Some((sent, media_type))
}

/// The body's declared Content-Length, refused at once when over `limit`.
pub fn declared_length_within(headers: &HeaderMap, limit: usize) -> Result<Option<u64>, ApiError> {
    let declared_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared_length.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    Ok(declared_length)
}

/// Reads a whole body of at most `limit` bytes. A declared Content-Length
/// over the limit is refused before reading anything.
pub async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, ApiError> {
    let declared_length = declared_length_within(headers, limit)?;
    let mut chunks = body.into_data_stream();
    let Some(first) = chunks.next().await else {
        return Ok(Bytes::new());
    };
    let first = first.map_err(|error| ApiError::BodyUnreadable(error.to_string()))?;
    if first.len() > limit {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let Some(second) = chunks.next().await else {
        // The common case for small bodies: one chunk, no copy.
        return Ok(first);
    };
    let capacity = declared_length.map_or(first.len() * 2, |length| length as usize);
    let mut buffer = BytesMut::with_capacity(capacity.min(limit));
    buffer.extend_from_slice(&first);
    let mut next = Some(second);
    while let Some(chunk) = next {
        let chunk = chunk.map_err(|error| ApiError::BodyUnreadable(error.to_string()))?;
        if buffer.len() + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        buffer.extend_from_slice(&chunk);
        next = chunks.next().await;
    }
    Ok(buffer.freeze())
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderValue, StatusCode};

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

    #[test]
    fn media_types_drop_their_parameters_and_case() {
        let mut headers = HeaderMap::new();
        assert_eq!(media_type(&headers), None);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("Application/JSON ; charset=utf-8"),
        );
        assert_eq!(
            media_type(&headers),
            Some((
                "Application/JSON ; charset=utf-8".to_owned(),
                "application/json".to_owned()
            ))
        );
    }

    #[tokio::test]
    async fn a_body_holds_what_has_arrived_never_what_it_declares() {
        let bytes = InFlightBytes::new(10, Gauge::default());
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("8"));
        // Declared 8, nothing sent yet: nothing held, so another fits.
        let (mut sender, waiting) =
            futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
        let mut idle = bytes.reservation();
        let idle_headers = headers.clone();
        let idle_read = tokio::spawn(async move {
            let result =
                read_body_reserving(Body::from_stream(waiting), &idle_headers, 100, &mut idle)
                    .await;
            (result.map(|body| body.len()), idle)
        });
        tokio::task::yield_now().await;
        assert_eq!(bytes.held(), 0);
        let mut reservation = bytes.reservation();
        let body = read_body_reserving(Body::from("[{},{}]\n"), &headers, 100, &mut reservation)
            .await
            .unwrap();
        assert_eq!(body, "[{},{}]\n");
        assert_eq!(bytes.held(), 8);
        // What arrives is held: 8 + 4 do not fit in 10.
        sender.start_send(Ok(Bytes::from_static(b"[{},"))).unwrap();
        drop(sender);
        let (result, _idle) = idle_read.await.unwrap();
        assert!(
            matches!(result, Err(ApiError::TooBusy { limit: 10 })),
            "{result:?}"
        );
        drop(reservation);
        let mut other = bytes.reservation();
        let body = read_body_reserving(Body::from("[{},{}]"), &HeaderMap::new(), 100, &mut other)
            .await
            .unwrap();
        assert_eq!(body.len(), 7);
        assert_eq!(bytes.held(), 7);
    }

    fn chunked(chunks: &[&'static str]) -> Body {
        let stream = futures::stream::iter(
            chunks
                .iter()
                .map(|chunk| Ok::<_, std::io::Error>(Bytes::from_static(chunk.as_bytes())))
                .collect::<Vec<_>>(),
        );
        Body::from_stream(stream)
    }

    #[tokio::test]
    async fn bodies_are_read_whole_within_the_limit() {
        let body = read_body(chunked(&["[{", "}]"]), &HeaderMap::new(), 4)
            .await
            .unwrap();
        assert_eq!(body, "[{}]");
        let empty = read_body(Body::empty(), &HeaderMap::new(), 4)
            .await
            .unwrap();
        assert!(empty.is_empty());
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_413_even_without_content_length() {
        let error = read_body(chunked(&["[{", "}]", " "]), &HeaderMap::new(), 4)
            .await
            .unwrap_err();
        assert!(matches!(error, ApiError::BodyTooLarge { limit: 4 }));
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        let error = read_body(chunked(&["x"]), &headers, 4).await.unwrap_err();
        assert!(matches!(error, ApiError::BodyTooLarge { limit: 4 }));
    }
}

//! The HTTP routes, and what they share: the one list of routes
//! ([`ROUTES`], which builds the router and which the OpenAPI document is
//! checked against), path extractors that validate stream names and report
//! ids, and bounded body reading.

pub mod definitions;
pub mod health;
pub mod records;
pub mod reports;

use axum::body::Body;
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use axum::routing::{MethodRouter, get, post, put};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use quire_messages::{ReportId, StreamName};

use crate::admission::Admission;
use crate::errors::ApiError;
use crate::state::AppState;
use crate::{metrics, openapi};

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `Authorization: Bearer` when `api.auth_tokens` is not empty.
    Token,
    /// Always open (health, metrics, the API's description).
    Open,
}

/// One operation of the API.
pub struct Route {
    pub method: &'static str,
    /// axum's path template, the OpenAPI document's too (`{stream}`).
    pub path: &'static str,
    pub access: Access,
    /// What runs before the handler of a route that publishes.
    pub admission: Option<Admission>,
    pub handler: fn() -> MethodRouter<AppState>,
}

/// Every operation the API serves; [`crate::startup::router`] is built from
/// this list, and a test checks that `openapi.yaml` describes exactly these.
pub const ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/streams/{stream}/records",
        access: Access::Token,
        admission: Some(Admission::IdempotentPublish),
        handler: || post(records::post_records),
    },
    Route {
        method: "POST",
        path: "/v1/streams/{stream}/reports",
        access: Access::Token,
        admission: Some(Admission::IdempotentPublish),
        handler: || post(reports::post_cut),
    },
    Route {
        method: "GET",
        path: "/v1/streams/{stream}/reports",
        access: Access::Token,
        admission: None,
        handler: || get(reports::list_reports),
    },
    Route {
        method: "PUT",
        path: "/v1/streams/{stream}/definition",
        access: Access::Token,
        admission: Some(Admission::Publish),
        handler: || put(definitions::put_definition),
    },
    Route {
        method: "GET",
        path: "/v1/streams/{stream}/definition",
        access: Access::Token,
        admission: None,
        handler: || get(definitions::get_definition),
    },
    Route {
        method: "GET",
        path: "/v1/reports/{id}",
        access: Access::Token,
        admission: None,
        handler: || get(reports::get_report),
    },
    Route {
        method: "GET",
        path: "/v1/reports/{id}/content",
        access: Access::Token,
        admission: None,
        handler: || get(reports::get_report_content),
    },
    Route {
        method: "GET",
        path: "/healthz",
        access: Access::Open,
        admission: None,
        handler: || get(health::healthz),
    },
    Route {
        method: "GET",
        path: "/readyz",
        access: Access::Open,
        admission: None,
        handler: || get(health::readyz),
    },
    Route {
        method: "GET",
        path: "/metrics",
        access: Access::Open,
        admission: None,
        handler: || get(metrics::exposition),
    },
    Route {
        method: "GET",
        path: "/openapi.yaml",
        access: Access::Open,
        admission: None,
        handler: || get(openapi::yaml),
    },
    Route {
        method: "GET",
        path: "/openapi.json",
        access: Access::Open,
        admission: None,
        handler: || get(openapi::json),
    },
];

/// The `{stream}` of a route, validated.
pub struct StreamPath(pub StreamName);

impl<S: Send + Sync> FromRequestParts<S> for StreamPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(stream) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| ApiError::InvalidPath(rejection.body_text()))?;
        Ok(StreamPath(StreamName::new(&stream)?))
    }
}

/// The `{id}` of a report route, parsed.
pub struct ReportPath(pub ReportId);

impl<S: Send + Sync> FromRequestParts<S> for ReportPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| ApiError::InvalidPath(rejection.body_text()))?;
        id.parse::<ReportId>()
            .map(ReportPath)
            .map_err(ApiError::InvalidReportId)
    }
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
    use super::*;

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

//! The HTTP routes, and what they share: the one list of routes
//! ([`ROUTES`], which builds the router and which the OpenAPI document is
//! checked against), path extractors that validate stream names and report
//! ids, and bounded body reading.

pub mod definitions;
pub mod health;
pub mod records;
pub mod reports;

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::{Method, Uri};
use axum::middleware;
use axum::routing::{MethodRouter, get, post, put};
use quire_config::Scope;
use quire_messages::{ReportId, StreamName};

use crate::admission::{self, Admission};
use crate::auth::{self, BearerTokens};
use crate::errors::ApiError;
use crate::state::AppState;
use crate::{metrics, openapi};

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `Authorization: Bearer` with a token of this scope on the route's
    /// stream, when `api.tokens` is not empty.
    Token(Scope),
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

/// Every operation the API serves; [`router`] is built from
/// this list, and a test checks that `openapi.yaml` describes exactly these.
pub const ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/streams/{stream}/records",
        access: Access::Token(Scope::Write),
        admission: Some(Admission::IdempotentPublish),
        handler: || post(records::post_records),
    },
    Route {
        method: "GET",
        path: "/v1/limits",
        access: Access::Token(Scope::Write),
        admission: None,
        handler: || get(records::get_limits),
    },
    Route {
        method: "POST",
        path: "/v1/streams/{stream}/reports",
        access: Access::Token(Scope::Write),
        admission: Some(Admission::IdempotentPublish),
        handler: || post(reports::post_cut),
    },
    Route {
        method: "GET",
        path: "/v1/streams/{stream}/reports",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(reports::list_reports),
    },
    Route {
        method: "PUT",
        path: "/v1/streams/{stream}/definition",
        access: Access::Token(Scope::Write),
        admission: Some(Admission::Publish),
        handler: || put(definitions::put_definition),
    },
    Route {
        method: "GET",
        path: "/v1/streams/{stream}/definition",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(definitions::get_definition),
    },
    Route {
        method: "GET",
        path: "/v1/streams/{stream}/schemas/{file}",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(definitions::get_schema),
    },
    Route {
        method: "GET",
        path: "/v1/reports/{id}",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(reports::get_report),
    },
    Route {
        method: "GET",
        path: "/v1/reports/{id}/content",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(reports::get_report_content),
    },
    Route {
        method: "GET",
        path: "/v1/reports/{id}/url",
        access: Access::Token(Scope::Read),
        admission: None,
        handler: || get(reports::get_report_url),
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

/// Every route of [`ROUTES`]. Token routes require a bearer token when
/// tokens are configured; open ones (`/healthz`, `/readyz`, `/metrics`, the
/// OpenAPI document) stay open. Routes that publish get their admission
/// ([`admission`]) inside the authentication. Every request is counted and
/// timed, unknown routes included.
pub fn router(services: AppState, tokens: BearerTokens) -> Router {
    let metrics = Arc::clone(&services.publishing.metrics);
    let mut protected = Router::new();
    let mut open = Router::new();
    for route in ROUTES {
        let handler = (route.handler)();
        let handler = match route.admission {
            Some(Admission::IdempotentPublish) => handler.route_layer(
                middleware::from_fn_with_state(services.gate.clone(), admission::admit_publish),
            ),
            Some(Admission::Publish) => handler.route_layer(middleware::from_fn_with_state(
                services.gate.clone(),
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

/// The `{stream}` and `{file}` of a schema route: a stream name and a
/// schema file name as quire makes them (16 lowercase hex digits and
/// `.xsd`), so nothing else of the bucket can be named.
pub struct SchemaPath(pub StreamName, pub String);

impl<S: Send + Sync> FromRequestParts<S> for SchemaPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path((stream, file)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| ApiError::InvalidPath(rejection.body_text()))?;
        let stream = StreamName::new(&stream)?;
        if !quire_xml::is_schema_file_name(&file) {
            return Err(ApiError::InvalidPath(format!(
                "{file:?} is not a schema file name (16 lowercase hex digits and .xsd, as reports name them)"
            )));
        }
        Ok(SchemaPath(stream, file))
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

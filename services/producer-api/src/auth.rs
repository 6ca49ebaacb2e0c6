//! Bearer-token authentication and authorization of the `/v1` routes.
//!
//! On when `api.tokens` is not empty. The table holds each token's SHA-256
//! digest with its scopes and stream prefixes ([`quire_config::ApiToken`]);
//! a presented token's digest is compared with every one of them in
//! constant time, so neither the comparison's duration nor an early exit
//! tells how much of a guess was right, nor how long a token is. A token
//! that is known but lacks the route's scope, or does not reach the route's
//! stream, is 403 naming what is missing. Tokens are never logged: only
//! their names are.

use std::sync::Arc;

use axum::extract::{RawPathParams, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use quire_config::{ApiToken, Scope};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::errors::{ApiError, AuthFailure};

pub type TokenDigest = [u8; 32];

/// The accepted tokens, or none (authentication off).
#[derive(Clone, Default)]
pub struct BearerTokens {
    tokens: Arc<Vec<ApiToken>>,
}

impl BearerTokens {
    pub fn new(tokens: &[ApiToken]) -> Self {
        BearerTokens {
            tokens: Arc::new(tokens.to_vec()),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Which configured token an `Authorization` header value carries
    /// (`None` when authentication is off).
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
    ) -> Result<Option<&ApiToken>, AuthFailure> {
        if !self.enabled() {
            return Ok(None);
        }
        let token = authorization
            .and_then(bearer_token)
            .ok_or(AuthFailure::Missing)?;
        let presented = digest(token);
        // Compare with every token, without stopping at a match; digests
        // are unique (checked at start-up), so at most one matches.
        let mut found = None;
        for (index, accepted) in self.tokens.iter().enumerate() {
            let matched: bool = accepted.sha256.ct_eq(&presented).into();
            if matched {
                found = Some(index);
            }
        }
        found
            .map(|index| Some(&self.tokens[index]))
            .ok_or(AuthFailure::Rejected)
    }

    /// Authenticates, then checks that the token has `scope` on `stream`.
    pub fn authorize(
        &self,
        authorization: Option<&[u8]>,
        scope: Scope,
        stream: Option<&str>,
    ) -> Result<(), ApiError> {
        let Some(token) = self
            .authenticate(authorization)
            .map_err(ApiError::Unauthorized)?
        else {
            return Ok(());
        };
        let in_reach = stream.is_none_or(|stream| token.reaches(stream));
        if token.allows(scope) && in_reach {
            return Ok(());
        }
        Err(ApiError::Forbidden {
            token: token.name.clone(),
            scope,
            stream: stream.unwrap_or_default().to_owned(),
            has_scope: token.allows(scope),
            reaches: token.streams_text(),
        })
    }
}

/// Who sent a request, for what is kept or counted per client (idempotency
/// keys, rate limits): the SHA-256 of its bearer token when authentication
/// is on (checked before any handler runs), one anonymous principal when
/// it is off.
pub fn principal(headers: &axum::http::HeaderMap, tokens_enabled: bool) -> TokenDigest {
    if !tokens_enabled {
        return [0; 32];
    }
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| bearer_token(value.as_bytes()))
        .unwrap_or_default();
    digest(token)
}

pub(crate) fn digest(token: &[u8]) -> TokenDigest {
    Sha256::digest(token).into()
}

/// The token of `Bearer <token>` (the scheme is case-insensitive).
pub(crate) fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if value.len() <= SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = value[SCHEME.len()..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// The stream a route acts on, from its path: `{stream}`, or the stream
/// part of a report `{id}` (`<stream>~<partition>-<offset>`), decoded as
/// the router decodes it. A name the route will refuse (400) is checked as
/// it is: it reaches no stream a prefix names unless it starts with one.
fn stream_of(params: &RawPathParams) -> Option<String> {
    params.iter().find_map(|(name, value)| match name {
        "stream" => Some(value.to_owned()),
        "id" => Some(value.split('~').next().unwrap_or_default().to_owned()),
        _ => None,
    })
}

/// The middleware of a `/v1` route that needs `scope`.
pub async fn require_scope(
    State((tokens, scope)): State<(BearerTokens, Scope)>,
    params: Result<RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes());
    let stream = params.ok().as_ref().and_then(stream_of);
    match tokens.authorize(authorization, scope, stream.as_deref()) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::body::Body;
    use axum::http::{Request as HttpRequest, StatusCode};
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    fn line(name: &str, token: &str, scopes: &str, streams: &str) -> ApiToken {
        format!(
            "{name}:{}:{scopes}:{streams}",
            hex::encode(ApiToken::digest_of(token))
        )
        .parse()
        .unwrap()
    }

    fn tokens() -> BearerTokens {
        BearerTokens::new(&[
            line("alpha", "alpha-token", "read+write", "*"),
            line("beta", "beta-token", "read+write", "*"),
            line("reader", "reader-token", "read", "*"),
            line("orders", "orders-token", "write", "orders-+billing"),
        ])
    }

    fn guarded(tokens: BearerTokens) -> Router {
        Router::new()
            .route(
                "/v1/streams/{stream}/records",
                get(|| async { "ok" }).route_layer(axum::middleware::from_fn_with_state(
                    (tokens.clone(), Scope::Write),
                    require_scope,
                )),
            )
            .route(
                "/v1/reports/{id}",
                get(|| async { "ok" }).route_layer(axum::middleware::from_fn_with_state(
                    (tokens, Scope::Read),
                    require_scope,
                )),
            )
            .route("/healthz", get(|| async { "alive" }))
    }

    async fn answer_of(
        router: Router,
        path: &str,
        authorization: Option<&str>,
    ) -> (StatusCode, String) {
        let mut request = HttpRequest::builder().uri(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        let response = router
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn v1_routes_need_a_token_and_health_stays_open() {
        let router = guarded(tokens());
        let records = "/v1/streams/s/records";
        assert_eq!(
            answer_of(router.clone(), records, None).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            answer_of(router.clone(), records, Some("Bearer nope"))
                .await
                .0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            answer_of(router.clone(), records, Some("Bearer beta-token"))
                .await
                .0,
            StatusCode::OK
        );
        assert_eq!(answer_of(router, "/healthz", None).await.0, StatusCode::OK);
        let open = guarded(BearerTokens::new(&[]));
        assert_eq!(answer_of(open, records, None).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn a_token_acts_only_within_its_scopes_and_prefixes() {
        let router = guarded(tokens());
        let cases = [
            (
                "/v1/streams/s/records",
                "reader-token",
                StatusCode::FORBIDDEN,
                "write",
            ),
            ("/v1/reports/s~1-2", "reader-token", StatusCode::OK, ""),
            (
                "/v1/streams/orders-eu/records",
                "orders-token",
                StatusCode::OK,
                "",
            ),
            (
                "/v1/streams/billing/records",
                "orders-token",
                StatusCode::OK,
                "",
            ),
            // Percent-encoded, as a client could try to slip past a prefix.
            (
                "/v1/streams/%6Frders-eu/records",
                "orders-token",
                StatusCode::OK,
                "",
            ),
            (
                "/v1/streams/hr/records",
                "orders-token",
                StatusCode::FORBIDDEN,
                "hr",
            ),
            (
                "/v1/streams/%68r/records",
                "orders-token",
                StatusCode::FORBIDDEN,
                "hr",
            ),
            (
                "/v1/reports/orders-eu~1-2",
                "orders-token",
                StatusCode::FORBIDDEN,
                "read",
            ),
            ("/v1/reports/hr~1-2", "alpha-token", StatusCode::OK, ""),
        ];
        for (path, token, status, named) in cases {
            let (got, body) =
                answer_of(router.clone(), path, Some(&format!("Bearer {token}"))).await;
            assert_eq!(got, status, "{path} with {token}: {body}");
            if status == StatusCode::FORBIDDEN {
                assert!(body.contains("\"forbidden\""), "{body}");
                assert!(body.contains(named), "{path}: {body}");
                assert!(!body.contains(token), "the token itself was echoed: {body}");
            }
        }
    }

    #[test]
    fn each_token_is_recognised_by_its_digest() {
        let tokens = tokens();
        let name = |header: &[u8]| {
            tokens
                .authenticate(Some(header))
                .map(|found| found.map(|token| token.name.clone()))
        };
        assert_eq!(name(b"Bearer alpha-token"), Ok(Some("alpha".into())));
        assert_eq!(name(b"bearer beta-token"), Ok(Some("beta".into())));
        assert_eq!(name(b"BEARER  reader-token "), Ok(Some("reader".into())));
        let open = BearerTokens::new(&[]);
        assert!(!open.enabled());
        assert_eq!(
            open.authenticate(None).map(|found| found.is_none()),
            Ok(true)
        );
    }

    #[test]
    fn missing_malformed_and_wrong_tokens_are_refused() {
        let tokens = tokens();
        let failure = |header: Option<&[u8]>| tokens.authenticate(header).map(|_| ()).unwrap_err();
        assert_eq!(failure(None), AuthFailure::Missing);
        assert_eq!(failure(Some(b"alpha-token")), AuthFailure::Missing);
        assert_eq!(
            failure(Some(b"Basic YWxwaGE6dG9rZW4=")),
            AuthFailure::Missing
        );
        assert_eq!(failure(Some(b"Bearer ")), AuthFailure::Missing);
        assert_eq!(failure(Some(b"Bearer alpha-toke")), AuthFailure::Rejected);
        assert_eq!(
            failure(Some(b"Bearer alpha-token-and-more")),
            AuthFailure::Rejected
        );
    }
}

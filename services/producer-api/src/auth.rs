//! Bearer-token authentication of the `/v1` routes.
//!
//! On when `api.auth_tokens` is not empty. Tokens are kept only as SHA-256
//! digests, and a presented token's digest is compared with every one of
//! them in constant time, so neither the comparison's duration nor an early
//! exit tells how much of a guess was right, nor how long a token is.
//! Tokens are never logged.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::errors::{ApiError, AuthFailure};

pub type TokenDigest = [u8; 32];

/// The accepted tokens, or none (authentication off).
#[derive(Clone, Default)]
pub struct BearerTokens {
    digests: Arc<Vec<TokenDigest>>,
}

impl BearerTokens {
    pub fn new(tokens: &[String]) -> Self {
        let digests = tokens
            .iter()
            .filter(|token| !token.is_empty())
            .map(|token| digest(token.as_bytes()))
            .collect();
        BearerTokens {
            digests: Arc::new(digests),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Checks an `Authorization` header value.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), AuthFailure> {
        if !self.enabled() {
            return Ok(());
        }
        let token = authorization
            .and_then(bearer_token)
            .ok_or(AuthFailure::Missing)?;
        let presented = digest(token);
        // Compare with every token, without stopping at a match.
        let mut matched = subtle::Choice::from(0);
        for accepted in self.digests.iter() {
            matched |= accepted.ct_eq(&presented);
        }
        if bool::from(matched) {
            Ok(())
        } else {
            Err(AuthFailure::Rejected)
        }
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

/// The middleware of the `/v1` routes.
pub async fn require_bearer_token(
    State(tokens): State<BearerTokens>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes());
    match tokens.check(authorization) {
        Ok(()) => next.run(request).await,
        Err(failure) => ApiError::Unauthorized(failure).into_response(),
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

    fn guarded(tokens: BearerTokens) -> Router {
        Router::new()
            .route("/v1/thing", get(|| async { "ok" }))
            .route_layer(axum::middleware::from_fn_with_state(
                tokens,
                require_bearer_token,
            ))
            .route("/healthz", get(|| async { "alive" }))
    }

    async fn status_of(router: Router, path: &str, authorization: Option<&str>) -> StatusCode {
        let mut request = HttpRequest::builder().uri(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        let response = router
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        response.status()
    }

    #[tokio::test]
    async fn v1_routes_need_a_token_and_health_stays_open() {
        let router = guarded(tokens());
        assert_eq!(
            status_of(router.clone(), "/v1/thing", None).await,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            status_of(router.clone(), "/v1/thing", Some("Bearer nope")).await,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            status_of(router.clone(), "/v1/thing", Some("Bearer beta-token")).await,
            StatusCode::OK
        );
        assert_eq!(status_of(router, "/healthz", None).await, StatusCode::OK);
        let open = guarded(BearerTokens::new(&[]));
        assert_eq!(status_of(open, "/v1/thing", None).await, StatusCode::OK);
    }

    fn tokens() -> BearerTokens {
        BearerTokens::new(&["alpha-token".to_owned(), "beta-token".to_owned()])
    }

    #[test]
    fn no_tokens_means_open() {
        let open = BearerTokens::new(&[]);
        assert!(!open.enabled());
        assert_eq!(open.check(None), Ok(()));
        // An empty string in the list does not turn authentication on.
        assert!(!BearerTokens::new(&[String::new()]).enabled());
    }

    #[test]
    fn any_configured_token_is_accepted() {
        assert_eq!(tokens().check(Some(b"Bearer alpha-token")), Ok(()));
        assert_eq!(tokens().check(Some(b"bearer beta-token")), Ok(()));
        assert_eq!(tokens().check(Some(b"BEARER  beta-token ")), Ok(()));
    }

    #[test]
    fn missing_malformed_and_wrong_tokens_are_refused() {
        assert_eq!(tokens().check(None), Err(AuthFailure::Missing));
        assert_eq!(
            tokens().check(Some(b"alpha-token")),
            Err(AuthFailure::Missing)
        );
        assert_eq!(
            tokens().check(Some(b"Basic YWxwaGE6dG9rZW4=")),
            Err(AuthFailure::Missing)
        );
        assert_eq!(tokens().check(Some(b"Bearer ")), Err(AuthFailure::Missing));
        assert_eq!(
            tokens().check(Some(b"Bearer alpha-toke")),
            Err(AuthFailure::Rejected)
        );
        assert_eq!(
            tokens().check(Some(b"Bearer alpha-token-and-more")),
            Err(AuthFailure::Rejected)
        );
    }
}

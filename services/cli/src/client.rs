//! The producer API over HTTP: one method per route the CLI uses, and the
//! API's JSON errors turned into `CliError::Api`.

use std::time::Duration;

use reqwest::{Response, StatusCode, header};
use serde::Deserialize;
use serde_json::Value;

use crate::cli::GlobalOptions;
use crate::error::{ApiError, CliError};
use quire_config::Secret;

/// The request header of the IETF httpapi idempotency-key draft.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

pub struct ApiClient {
    http: reqwest::Client,
    base_url: String,
    token: Option<Secret>,
}

fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}

/// `POST /v1/streams/{stream}/records`'s answer.
#[derive(Debug, Deserialize)]
pub struct Accepted {
    pub count: u64,
    pub ids: Vec<String>,
}

/// The API's bounds on a records request (`GET /v1/limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct Limits {
    pub max_body_bytes: u64,
    pub max_records_per_request: u64,
}

/// `GET /v1/reports/{id}/url`'s answer.
#[derive(Debug, Clone, Deserialize)]
pub struct DownloadUrl {
    pub url: String,
    pub expires_at: String,
    pub bytes: u64,
    pub sha256: String,
    /// The S3 checksum the object is stored with, when it has one.
    #[serde(default)]
    pub checksum: Option<quire_messages::ObjectChecksum>,
}

impl DownloadUrl {
    /// The URL without its query (the signature, a credential): what
    /// messages show.
    pub fn redacted(&self) -> String {
        match reqwest::Url::parse(&self.url) {
            Ok(mut url) => {
                url.set_query(None);
                url.to_string()
            }
            Err(_) => "the presigned S3 URL".to_owned(),
        }
    }
}

/// One page of `GET /v1/streams/{stream}/reports`.
#[derive(Debug, Deserialize)]
pub struct ReportPage {
    pub reports: Vec<Value>,
    pub continuation: Option<String>,
}

impl ApiClient {
    /// A client of the API at `--api`, with `--token` and `--ca-cert`.
    /// Refuses to send a token in clear text beyond loopback unless
    /// `--allow-plain-http` says so.
    pub fn new(global: &GlobalOptions) -> Result<Self, CliError> {
        let base_url = global.api_url.as_str();
        let url = reqwest::Url::parse(base_url).map_err(|error| {
            CliError::Usage(format!("--api {base_url:?} is not a URL: {error}"))
        })?;
        let token = global.token.clone().filter(|token| !token.is_empty());
        match url.scheme() {
            "https" => {}
            "http" if token.is_none() || global.allow_plain_http || is_loopback(&url) => {}
            "http" => {
                return Err(CliError::Usage(format!(
                    "refusing to send the API token in clear text to {base_url}: use https:// (the API behind a TLS proxy), or --allow-plain-http if the network is trusted"
                )));
            }
            other => {
                return Err(CliError::Usage(format!(
                    "--api {base_url:?}: the scheme must be http or https, not {other}"
                )));
            }
        }
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // The API closes a connection left idle for its header timeout
            // (api.header_read_timeout_ms, 30 s by default); reusing one it
            // is closing would fail the request, so let go of them sooner.
            .pool_idle_timeout(Duration::from_secs(20))
            .user_agent(concat!("quire-cli/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = &global.ca_cert {
            let pem = std::fs::read(path).map_err(|source| CliError::Io {
                context: format!("cannot read --ca-cert {}", path.display()),
                source,
            })?;
            let certificates = reqwest::Certificate::from_pem_bundle(&pem).map_err(|error| {
                CliError::Usage(format!(
                    "--ca-cert {} holds no PEM certificate: {error}",
                    path.display()
                ))
            })?;
            if certificates.is_empty() {
                return Err(CliError::Usage(format!(
                    "--ca-cert {} holds no PEM certificate",
                    path.display()
                )));
            }
            for certificate in certificates {
                builder = builder.add_root_certificate(certificate);
            }
        }
        let http = builder.build().map_err(|source| CliError::Http {
            url: base_url.to_owned(),
            source,
        })?;
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            token,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, self.url(path));
        match &self.token {
            Some(token) => builder.bearer_auth(token.expose()),
            None => builder,
        }
    }

    async fn send(
        &self,
        builder: reqwest::RequestBuilder,
        path: &str,
    ) -> Result<Response, CliError> {
        let response = builder.send().await.map_err(|source| CliError::Http {
            url: self.url(path),
            source,
        })?;
        if response.status().is_success() {
            return Ok(response);
        }
        Err(api_error(response).await)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        builder: reqwest::RequestBuilder,
        path: &str,
    ) -> Result<T, CliError> {
        let response = self.send(builder, path).await?;
        response.json().await.map_err(|source| CliError::Http {
            url: self.url(path),
            source,
        })
    }

    /// Sends one array of NDJSON records under an `Idempotency-Key`: the
    /// same key and body sent again get the first answer, published once.
    pub async fn post_records(
        &self,
        stream: &str,
        ndjson_body: Vec<u8>,
        idempotency_key: &str,
    ) -> Result<Accepted, CliError> {
        let path = format!("/v1/streams/{}/records", encode_segment(stream));
        let builder = self
            .request(reqwest::Method::POST, &path)
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .header(IDEMPOTENCY_KEY, idempotency_key)
            .body(ndjson_body);
        self.json(builder, &path).await
    }

    /// Cuts a report under an `Idempotency-Key` (one cut per key).
    pub async fn cut(&self, stream: &str, idempotency_key: &str) -> Result<Value, CliError> {
        let path = format!("/v1/streams/{}/reports", encode_segment(stream));
        let builder = self
            .request(reqwest::Method::POST, &path)
            .header(IDEMPOTENCY_KEY, idempotency_key);
        self.json(builder, &path).await
    }

    /// `GET /v1/streams/{stream}/definition`: the stored definition.
    pub async fn definition(&self, stream: &str) -> Result<Value, CliError> {
        let path = format!("/v1/streams/{}/definition", encode_segment(stream));
        self.json(self.request(reqwest::Method::GET, &path), &path)
            .await
    }

    /// `PUT /v1/streams/{stream}/definition` of a JSON body.
    pub async fn put_definition(&self, stream: &str, body: Vec<u8>) -> Result<Value, CliError> {
        let path = format!("/v1/streams/{}/definition", encode_segment(stream));
        let builder = self
            .request(reqwest::Method::PUT, &path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        self.json(builder, &path).await
    }

    /// `GET /v1/limits`: what a records request may hold at most.
    pub async fn limits(&self) -> Result<Limits, CliError> {
        let path = "/v1/limits";
        self.json(self.request(reqwest::Method::GET, path), path)
            .await
    }

    pub async fn report(&self, report_id: &str) -> Result<Value, CliError> {
        let path = format!("/v1/reports/{}", encode_segment(report_id));
        self.json(self.request(reqwest::Method::GET, &path), &path)
            .await
    }

    /// The content response, status already checked; the caller streams the body.
    pub async fn report_content(&self, report_id: &str) -> Result<Response, CliError> {
        let path = format!("/v1/reports/{}/content", encode_segment(report_id));
        self.send(self.request(reqwest::Method::GET, &path), &path)
            .await
    }

    /// `GET /v1/reports/{id}/url`: a presigned S3 URL of the document, or
    /// None when this API hands out none (`download_urls_off`, or an API
    /// from before the route: its plain 404 `not_found`).
    pub async fn download_url(&self, report_id: &str) -> Result<Option<DownloadUrl>, CliError> {
        let path = format!("/v1/reports/{}/url", encode_segment(report_id));
        match self
            .json::<DownloadUrl>(self.request(reqwest::Method::GET, &path), &path)
            .await
        {
            Ok(url) => Ok(Some(url)),
            Err(CliError::Api(api))
                if api.status == StatusCode::NOT_FOUND
                    && matches!(api.code.as_str(), "download_urls_off" | "not_found") =>
            {
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    /// A GET of a presigned URL: no token (the signature is the
    /// credential, and S3 is not the API), status checked.
    pub async fn fetch_presigned(&self, url: &DownloadUrl) -> Result<Response, String> {
        let response = self
            .http
            .get(&url.url)
            .send()
            .await
            .map_err(|error| format!("{}: {error}", url.redacted()))?;
        if response.status().is_success() {
            return Ok(response);
        }
        Err(format!("{} answered {}", url.redacted(), response.status()))
    }

    pub async fn report_page(
        &self,
        stream: &str,
        limit: u32,
        continuation: Option<&str>,
        window_start: Option<&str>,
    ) -> Result<ReportPage, CliError> {
        let path = format!("/v1/streams/{}/reports", encode_segment(stream));
        let mut query = vec![("limit", limit.to_string())];
        if let Some(continuation) = continuation {
            query.push(("continuation", continuation.to_owned()));
        }
        if let Some(window_start) = window_start {
            query.push(("window_start", window_start.to_owned()));
        }
        let builder = self.request(reqwest::Method::GET, &path).query(&query);
        self.json(builder, &path).await
    }

    /// Every completed report of a stream (of one window, with
    /// `window_start`), following `continuation`.
    pub async fn all_reports(
        &self,
        stream: &str,
        page_size: u32,
        window_start: Option<&str>,
    ) -> Result<Vec<Value>, CliError> {
        let mut reports = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let page = self
                .report_page(stream, page_size, continuation.as_deref(), window_start)
                .await?;
            reports.extend(page.reports);
            match page.continuation {
                Some(next) => continuation = Some(next),
                None => return Ok(reports),
            }
        }
    }
}

/// Reads the API's `{"error": {"code", "message", ...}}`; a body that is not
/// one (a proxy's page, say) is shown as text.
async fn api_error(response: Response) -> CliError {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = response.text().await.unwrap_or_default();
    let error = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|document| document.get("error").cloned());
    let (code, message, details) = match error {
        Some(Value::Object(mut fields)) => {
            let code = fields
                .remove("code")
                .and_then(|code| code.as_str().map(str::to_owned))
                .unwrap_or_else(|| "unknown".to_owned());
            let message = fields
                .remove("message")
                .and_then(|message| message.as_str().map(str::to_owned))
                .unwrap_or_default();
            (code, message, fields)
        }
        _ => (
            "unexpected_response".to_owned(),
            body.chars().take(500).collect(),
            serde_json::Map::new(),
        ),
    };
    CliError::Api(Box::new(ApiError {
        status,
        code,
        message,
        details,
        retry_after,
    }))
}

/// Percent-encodes a path segment (stream names and report ids are plain in
/// practice, but a typo must not reach another route).
fn encode_segment(segment: &str) -> String {
    let mut encoded = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// Whether a request may be sent again with the same key:
/// - the API refused it and published nothing: 429 and 503, and 409
///   `idempotency_key_in_progress` (the first request with the key is still
///   being handled; its answer comes to the retry);
/// - it got no answer because the connection was refused, reset or closed,
///   or the answer did not come in time (an API restarting, a proxy
///   dropping connections). Whether such a request was published is
///   unknown, which is what its Idempotency-Key is for: the API answers a
///   retry of a published request with the first answer (the keys are kept
///   in Kafka, so a restarted or other replica does too);
/// - 500 `publish_outcome_unknown`: Kafka did not confirm the commit within
///   the API's time, so it may or may not be published; the API goes on
///   reading the log for the key, answers a retry 409 in progress until it
///   knows, then with the first answer (published) or by publishing it
///   (it was not).
///
/// Not retried: any other answer, a TLS or certificate failure, a bad URL.
pub fn is_retryable(error: &CliError) -> bool {
    match error {
        CliError::Api(api) => {
            api.status == StatusCode::SERVICE_UNAVAILABLE
                || api.status == StatusCode::TOO_MANY_REQUESTS
                || (api.status == StatusCode::CONFLICT && api.code == "idempotency_key_in_progress")
                || (api.status == StatusCode::INTERNAL_SERVER_ERROR
                    && api.code == "publish_outcome_unknown")
        }
        CliError::Http { source, .. } => is_transient_transport(source),
        _ => false,
    }
}

/// A connection that failed for a reason that passes: refused, reset,
/// aborted or closed before the answer, or timed out.
fn is_transient_transport(error: &reqwest::Error) -> bool {
    use std::io::ErrorKind;
    if error.is_timeout() {
        return true;
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
                    | ErrorKind::UnexpectedEof
                    | ErrorKind::TimedOut
                    | ErrorKind::NotConnected
            )
        {
            return true;
        }
        if let Some(hyper) = cause.downcast_ref::<hyper::Error>()
            && (hyper.is_incomplete_message() || hyper.is_closed() || hyper.is_canceled())
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The line a command prints before it retries: what went wrong, the API's
/// Retry-After when it answered, and the pause.
pub fn retry_line(error: &CliError, attempt: u32, retries: u32, pause: Duration) -> String {
    let announced = match error {
        CliError::Api(api) => match api.retry_after {
            Some(after) => format!("; Retry-After: {}s", after.as_secs()),
            None => "; no Retry-After".to_owned(),
        },
        _ => String::new(),
    };
    format!("{error}{announced}; retry {attempt} of {retries} in {pause:?} (same Idempotency-Key)")
}

/// Runs `request` until it succeeds, fails in a way [`is_retryable`] does
/// not cover, or `retries` retries were made; before each retry it prints
/// [`retry_line`] and waits [`retry_pause`]. The caller's request carries
/// its own Idempotency-Key (or only reads).
pub async fn with_retries<T, F, Fut>(retries: u32, mut request: F) -> Result<T, CliError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CliError>>,
{
    let mut attempt = 0u32;
    loop {
        match request().await {
            Err(error) if attempt < retries && is_retryable(&error) => {
                attempt += 1;
                let pause = retry_pause(&error, attempt);
                eprintln!("{}", retry_line(&error, attempt, retries, pause));
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// Longest pause between two attempts.
pub const MAX_RETRY_PAUSE: Duration = Duration::from_secs(30);

/// The pause before retry `attempt` (from 1): the API's `Retry-After` or a
/// doubling pause from one second, whichever is longer, at most
/// [`MAX_RETRY_PAUSE`].
pub fn retry_pause(error: &CliError, attempt: u32) -> Duration {
    let announced = match error {
        CliError::Api(api) => api.retry_after.unwrap_or_default(),
        _ => Duration::ZERO,
    };
    let backoff = Duration::from_millis(500 * 2u64.pow(attempt.clamp(1, 7)));
    announced.max(backoff).min(MAX_RETRY_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16, code: &str, retry_after: Option<u64>) -> CliError {
        CliError::Api(Box::new(ApiError {
            status: StatusCode::from_u16(status).unwrap(),
            code: code.to_owned(),
            message: String::new(),
            details: serde_json::Map::new(),
            retry_after: retry_after.map(Duration::from_secs),
        }))
    }

    #[test]
    fn answers_that_published_nothing_or_that_the_key_settles_are_retried() {
        assert!(is_retryable(&refused(503, "kafka_unavailable", Some(1))));
        assert!(is_retryable(&refused(429, "too_busy", Some(1))));
        assert!(is_retryable(&refused(
            409,
            "idempotency_key_in_progress",
            Some(1)
        )));
        assert!(!is_retryable(&refused(409, "report_pending", None)));
        assert!(!is_retryable(&refused(422, "idempotency_key_reused", None)));
        assert!(is_retryable(&refused(500, "publish_outcome_unknown", None)));
        assert!(!is_retryable(&refused(500, "internal", None)));
    }

    /// A POST to `url`, as the CLI sends it, and the error it must end in.
    async fn transport_error(url: String) -> CliError {
        let source = reqwest::Client::new()
            .post(&url)
            .body("[]")
            .send()
            .await
            .expect_err("the request must fail");
        CliError::Http { url, source }
    }

    #[tokio::test]
    async fn connections_refused_or_closed_mid_request_are_retried_tls_failures_are_not() {
        // Refused: a port that was free a moment ago.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let refused = transport_error(format!("http://127.0.0.1:{port}/v1")).await;
        assert!(is_retryable(&refused), "{refused}");

        // Closed after the request was read, before any answer (an API
        // killed mid-request): the request may have been published.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            drop(socket);
        });
        let closed = transport_error(format!("http://127.0.0.1:{port}/v1")).await;
        server.await.unwrap();
        assert!(is_retryable(&closed), "{closed}");

        // TLS to a server that speaks plain HTTP: retrying cannot help.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let (mut socket, _) = listener.accept().await.unwrap();
            let _ = socket
                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .await;
        });
        let tls = transport_error(format!("https://127.0.0.1:{port}/v1")).await;
        server.await.unwrap();
        assert!(!is_retryable(&tls), "{tls}");
    }

    #[test]
    fn the_retry_line_says_what_the_api_announced() {
        let pause = Duration::from_secs(2);
        let line = retry_line(&refused(503, "kafka_unavailable", Some(1)), 1, 8, pause);
        assert!(
            line.contains("503") && line.contains("; Retry-After: 1s; retry 1 of 8 in 2s"),
            "{line}"
        );
        let line = retry_line(&refused(429, "too_busy", None), 2, 8, pause);
        assert!(line.contains("; no Retry-After; retry 2 of 8"), "{line}");
    }

    #[test]
    fn pauses_follow_retry_after_grow_and_are_bounded() {
        let busy = refused(429, "too_busy", Some(1));
        assert_eq!(retry_pause(&busy, 1), Duration::from_secs(1));
        assert_eq!(retry_pause(&busy, 3), Duration::from_secs(4));
        assert_eq!(retry_pause(&busy, 50), MAX_RETRY_PAUSE);
        let slow = refused(503, "kafka_unavailable", Some(20));
        assert_eq!(retry_pause(&slow, 1), Duration::from_secs(20));
        let far = refused(503, "kafka_unavailable", Some(3600));
        assert_eq!(retry_pause(&far, 1), MAX_RETRY_PAUSE);
    }

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(encode_segment("orders~7-3"), "orders~7-3");
        assert_eq!(encode_segment("a/b c"), "a%2Fb%20c");
    }
}

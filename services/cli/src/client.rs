//! The producer API over HTTP: one method per route the CLI uses, and the
//! API's JSON errors turned into `CliError::Api`.

use std::time::Duration;

use reqwest::{Response, StatusCode, header};
use serde::Deserialize;
use serde_json::Value;

use crate::error::{ApiError, CliError};

pub struct ApiClient {
    http: reqwest::Client,
    base_url: String,
    token: Option<String>,
}

/// `POST /v1/streams/{stream}/records`'s answer.
#[derive(Debug, Deserialize)]
pub struct Accepted {
    pub count: u64,
    pub ids: Vec<String>,
}

/// One page of `GET /v1/streams/{stream}/reports`.
#[derive(Debug, Deserialize)]
pub struct ReportPage {
    pub reports: Vec<Value>,
    pub continuation: Option<String>,
}

impl ApiClient {
    pub fn new(base_url: &str, token: Option<String>) -> Result<Self, CliError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("quire-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|source| CliError::Http {
                url: base_url.to_owned(),
                source,
            })?;
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            token: token.filter(|token| !token.is_empty()),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, self.url(path));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
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

    /// Sends one array of NDJSON records.
    pub async fn post_records(
        &self,
        stream: &str,
        ndjson_body: Vec<u8>,
    ) -> Result<Accepted, CliError> {
        let path = format!("/v1/streams/{}/records", encode_segment(stream));
        let builder = self
            .request(reqwest::Method::POST, &path)
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .body(ndjson_body);
        self.json(builder, &path).await
    }

    pub async fn cut(&self, stream: &str) -> Result<Value, CliError> {
        let path = format!("/v1/streams/{}/reports", encode_segment(stream));
        self.json(self.request(reqwest::Method::POST, &path), &path)
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

    pub async fn report_page(
        &self,
        stream: &str,
        limit: u32,
        continuation: Option<&str>,
    ) -> Result<ReportPage, CliError> {
        let path = format!("/v1/streams/{}/reports", encode_segment(stream));
        let mut query = vec![("limit", limit.to_string())];
        if let Some(continuation) = continuation {
            query.push(("continuation", continuation.to_owned()));
        }
        let builder = self.request(reqwest::Method::GET, &path).query(&query);
        self.json(builder, &path).await
    }

    /// Every completed report of a stream, following `continuation`.
    pub async fn all_reports(&self, stream: &str, page_size: u32) -> Result<Vec<Value>, CliError> {
        let mut reports = Vec::new();
        let mut continuation: Option<String> = None;
        loop {
            let page = self
                .report_page(stream, page_size, continuation.as_deref())
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

/// Whether a refused request published nothing and may be sent again.
pub fn is_retryable(error: &CliError) -> bool {
    matches!(
        error,
        CliError::Api(api)
            if api.status == StatusCode::SERVICE_UNAVAILABLE || api.status == StatusCode::TOO_MANY_REQUESTS
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(encode_segment("orders~7-3"), "orders~7-3");
        assert_eq!(encode_segment("a/b c"), "a%2Fb%20c");
    }
}

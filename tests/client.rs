//! Typed requests to a producer API the test started: records (once, under
//! an `Idempotency-Key`, or until accepted as a careful producer retries),
//! cuts, definitions and look-ups.

use std::time::{Duration, Instant};

use serde_json::Value;

/// A producer API the test talks to, wherever it runs: a child process
/// ([`crate::ApiProcess`]) or this process ([`crate::InProcessApi`]), both
/// of which dereference to it.
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// `http://127.0.0.1:{port}`.
    pub base: String,
    pub http: reqwest::Client,
}

impl ApiClient {
    pub fn new(base: String) -> ApiClient {
        ApiClient {
            base,
            http: reqwest::Client::new(),
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.base
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .expect("a base URL with a port")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` (JSON) with an optional key; status, headers, body.
    pub async fn post(
        &self,
        path: &str,
        body: &Value,
        key: Option<&[u8]>,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let mut request = self.http.post(self.url(path)).json(body);
        if let Some(key) = key {
            request = request.header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).expect("header value"),
            );
        }
        let response = request.send().await.expect("POST");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        (
            status,
            headers,
            response.json().await.unwrap_or(Value::Null),
        )
    }

    /// The value of an unlabelled metric of `/metrics`, if it is there.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = self
            .http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name} ")))
            .and_then(|value| value.trim().parse().ok())
    }

    /// Sends records; returns the answer's status and body.
    pub async fn send(&self, stream: &str, records: &[Value]) -> (u16, Value) {
        let body = serde_json::to_string(records).expect("records as JSON");
        self.send_body(stream, body).await
    }

    /// Sends `body`, a JSON array as text (its records reach the log byte
    /// for byte), to the records route: the status and the JSON answer.
    pub async fn send_body(&self, stream: &str, body: String) -> (u16, Value) {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/records", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("records request");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    /// Sends records and asserts they were accepted.
    pub async fn send_ok(&self, stream: &str, records: &[Value]) -> Vec<String> {
        let (status, body) = self.send(stream, records).await;
        assert_eq!(status, 200, "records refused: {body}");
        body["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|id| id.as_str().unwrap().to_owned())
            .collect()
    }

    /// One attempt at sending records under an `Idempotency-Key`, waiting
    /// at most `timeout`. `Err` when no answer came in time (or at all).
    pub async fn send_keyed(
        &self,
        stream: &str,
        records: &[Value],
        idempotency_key: &str,
        timeout: Duration,
    ) -> Result<Answer, reqwest::Error> {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/records", self.base))
            .header("idempotency-key", idempotency_key)
            .json(&records)
            .timeout(timeout)
            .send()
            .await?;
        let status = response.status().as_u16();
        let retry_after = retry_after(&response);
        Ok(Answer {
            status,
            retry_after,
            body: response.json().await.unwrap_or(Value::Null),
        })
    }

    /// Sends one array under one fresh `Idempotency-Key` until it is
    /// accepted, as a careful producer would: after a 503 or a 429 it waits
    /// what `Retry-After` says (1 s without one), after no answer 1 s, then
    /// sends the same body with the same key again. Stops at the first other
    /// answer, or once `limit` has passed. Every attempt is returned, in order.
    pub async fn send_until_accepted(
        &self,
        stream: &str,
        records: &[Value],
        attempt_timeout: Duration,
        limit: Duration,
    ) -> Vec<Attempt> {
        let idempotency_key = uuid::Uuid::new_v4().to_string();
        let deadline = Instant::now() + limit;
        let mut attempts = Vec::new();
        loop {
            let sent_at = Instant::now();
            let outcome = self
                .send_keyed(stream, records, &idempotency_key, attempt_timeout)
                .await
                .map_err(|error| NoAnswer {
                    timed_out: error.is_timeout(),
                    message: error.to_string(),
                });
            let pause = match &outcome {
                // 409: the first request with this key is still being
                // handled (its client gave up waiting); its answer comes on a
                // retry.
                Ok(answer) if matches!(answer.status, 409 | 429 | 503) => answer
                    .retry_after
                    .unwrap_or(Duration::from_secs(1))
                    .max(Duration::from_millis(100)),
                // The commit's outcome is being settled from the log: the
                // key's retry is answered with it, as the error says.
                Ok(answer)
                    if answer.status == 500
                        && answer.body["error"]["code"] == "publish_outcome_unknown" =>
                {
                    Duration::from_secs(1)
                }
                Ok(_) => Duration::ZERO,
                Err(_) => Duration::from_secs(1),
            };
            let settled = outcome.is_ok() && pause.is_zero();
            attempts.push(Attempt {
                sent_at,
                answered_at: Instant::now(),
                outcome,
            });
            if settled || Instant::now() + pause > deadline {
                return attempts;
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Cuts the stream; returns the report id.
    pub async fn cut(&self, stream: &str) -> String {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/reports", self.base))
            .send()
            .await
            .expect("cut request");
        assert_eq!(response.status().as_u16(), 202);
        let body: Value = response.json().await.unwrap();
        body["report_id"].as_str().expect("report id").to_owned()
    }

    /// Cuts the stream as a careful client would: a 503 or 429 (nothing was
    /// published) is retried after `Retry-After` with the same
    /// `Idempotency-Key`, until `limit`. Returns the report id.
    pub async fn cut_until_accepted(&self, stream: &str, limit: Duration) -> String {
        let key = uuid::Uuid::new_v4().to_string();
        let deadline = Instant::now() + limit;
        loop {
            let response = self
                .http
                .post(format!("{}/v1/streams/{stream}/reports", self.base))
                .header("idempotency-key", &key)
                .send()
                .await
                .expect("cut request");
            let status = response.status().as_u16();
            let retry_after = retry_after(&response).unwrap_or(Duration::from_secs(1));
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if status == 202 {
                return body["report_id"].as_str().expect("report id").to_owned();
            }
            assert!(
                matches!(status, 409 | 429 | 503) && Instant::now() + retry_after < deadline,
                "cut of {stream} refused: {status} {body}"
            );
            tokio::time::sleep(retry_after).await;
        }
    }

    /// PUTs a definition; its status and body, whatever they are.
    pub async fn try_put_definition(&self, stream: &str, definition: Value) -> (u16, Value) {
        let response = self
            .http
            .put(format!("{}/v1/streams/{stream}/definition", self.base))
            .json(&definition)
            .send()
            .await
            .expect("definition request");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    pub async fn put_definition(&self, stream: &str, definition: Value) {
        let response = self
            .http
            .put(format!("{}/v1/streams/{stream}/definition", self.base))
            .json(&definition)
            .send()
            .await
            .expect("definition request");
        assert_eq!(
            response.status().as_u16(),
            202,
            "{:?}",
            response.text().await
        );
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    pub async fn get_bytes(&self, path: &str) -> (u16, Vec<u8>) {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        (
            response.status().as_u16(),
            response.bytes().await.expect("body").to_vec(),
        )
    }

    /// Waits until report `id` is completed; returns its status body.
    pub async fn wait_completed(&self, id: &str, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let (status, body) = self.get(&format!("/v1/reports/{id}")).await;
            assert_eq!(status, 200, "status of {id}: {body}");
            if body["status"] == "completed" {
                return body;
            }
            assert!(Instant::now() < deadline, "report {id} still {body}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// What an answer's `Retry-After` header says, in whole seconds.
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// One attempt of [`ApiClient::send_until_accepted`].
#[derive(Debug, Clone)]
pub struct Attempt {
    pub sent_at: Instant,
    pub answered_at: Instant,
    pub outcome: Result<Answer, NoAnswer>,
}

impl Attempt {
    pub fn accepted(&self) -> bool {
        matches!(&self.outcome, Ok(answer) if answer.status == 200)
    }
}

/// A request that got no answer: the client's timeout, or no connection.
#[derive(Debug, Clone)]
pub struct NoAnswer {
    pub timed_out: bool,
    pub message: String,
}

/// An answer of the API: its status, its `Retry-After` (whole seconds, as
/// the API sends it) and its JSON body (`Null` if none).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<Duration>,
    pub body: Value,
}

/// The `api.tokens` entry of the token `token`, named `name`.
pub fn token_line(name: &str, token: &str, scopes: &str, streams: &str) -> quire_config::ApiToken {
    let digest = hex::encode(quire_config::ApiToken::digest_of(token));
    format!("{name}:{digest}:{scopes}:{streams}")
        .parse()
        .expect("a valid token line")
}

//! The producer API under real use, against the real binaries, Kafka and
//! S3, one module per feature:
//! - `idempotency`: `Idempotency-Key` (replays publish nothing, a reused
//!   key is 422, an invalid one 400; answered by any replica, after a
//!   restart);
//! - `limits`: the in-flight byte limit (429, never a queue), body, header
//!   and idle timeouts, slow and silent clients, `api.max_connections`,
//!   the rate of cuts and definition changes;
//! - `openapi`: the OpenAPI document against the routes the API serves;
//! - `requests`: what odd requests get (made-up methods and paths, a key
//!   named twice);
//! - `cli`: the `quire` CLI end to end, a resumed send included;
//! - `kafka`: the API while Kafka is away, and unknown commit outcomes;
//! - `security`: tokens and their scopes, TLS, no secret in the log;
//! - `downloads`: presigned S3 URLs of report documents;
//! - `batches`: records as batch messages under `api.batch_max_bytes`, their
//!   ids, and the start-up check against the topic's `max.message.bytes`.
//!
//! The helpers they share are here.

mod batches;
mod cli;
mod downloads;
mod idempotency;
mod kafka;
mod limits;
mod openapi;
mod requests;
mod security;

use std::future::Future;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use quire_tests::{ApiProcess, TestStack, read_all, records, records_in, release_binary};
use serde_json::Value;

pub(super) const RECORDS_PARTITIONS: i32 = 12;

/// Every committed body of `stream` on the stack's records topic, as JSON,
/// in order: each record of a batch (or record) message, and the payload of
/// any other (cut markers, definitions).
pub(super) fn committed_bodies(stack: &TestStack, stream: &str) -> Vec<Value> {
    committed_messages(stack, stream)
        .iter()
        .flat_map(|message| {
            if quire_messages::records::record_count(&message.headers, &message.payload) > 0 {
                records_in(message)
            } else {
                vec![message.payload.clone()]
            }
        })
        .map(|body| serde_json::from_slice(&body).expect("JSON body"))
        .collect()
}

/// Every committed message of `stream` on the records topic, records and
/// markers alike.
pub(super) fn committed_messages(stack: &TestStack, stream: &str) -> Vec<quire_tests::Seen> {
    read_all(
        &stack.kafka,
        &stack.topics.records,
        RECORDS_PARTITIONS,
        true,
    )
    .into_iter()
    .filter(|message| message.key.as_deref() == Some(stream.as_bytes()))
    .collect()
}

pub(super) fn sequence_numbers(bodies: &[Value]) -> Vec<u64> {
    bodies
        .iter()
        .filter_map(|body| body["seq"].as_u64())
        .collect()
}

/// Runs the `quire` binary against `api`; its exit code, stdout and stderr.
pub(super) fn quire(api: &ApiProcess, arguments: &[&str]) -> (i32, String, String) {
    quire_at(&api.base, &[], arguments)
}

/// `quire` against the API at `base`, with extra global options first (the
/// caller's own QUIRE_API_TOKEN and QUIRE_API_CA_CERT are not passed on).
pub(super) fn quire_at(base: &str, options: &[&str], arguments: &[&str]) -> (i32, String, String) {
    let output = Command::new(release_binary("quire"))
        .arg("--api")
        .arg(base)
        .args(options)
        .args(arguments)
        .env_remove("QUIRE_API_TOKEN")
        .env_remove("QUIRE_API_CA_CERT")
        .stdin(Stdio::null())
        .output()
        .expect("run quire");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Records 0..count of `stream` as NDJSON, one line each.
pub(super) fn ndjson(stream: &str, count: u64) -> String {
    records(stream, 0, count)
        .iter()
        .map(|record| serde_json::to_string(record).unwrap() + "\n")
        .collect()
}

/// One HTTP/1.1 request written by hand (any method, as a hostile client
/// may send), and the status line of its answer.
pub(super) fn raw_request(port: u16, method: &str, path: &str) -> String {
    let answer = exchange(port, method, path).unwrap_or_else(|partial| partial);
    answer.lines().next().unwrap_or_default().to_owned()
}

/// Sends `method path` over a connection of its own that asks to be closed
/// after the answer, and reads the answer whole (`Err`: what arrived before
/// the read failed).
fn exchange(port: u16, method: &str, path: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut answer = String::new();
    match stream.read_to_string(&mut answer) {
        Ok(_) => Ok(answer),
        Err(_) => Err(answer),
    }
}

/// The value of the unlabelled metric `name` on the API's `/metrics`, read
/// over a connection of its own that the API closes after answering
/// (`Connection: close`): no pooled connection lingers to be counted
/// later. That connection is open while the API answers, so it counts one
/// in `quire_api_open_connections` (and in
/// `quire_api_http_requests_in_flight`).
pub(super) fn scrape_metric(port: u16, name: &str) -> Option<f64> {
    let answer = exchange(port, "GET", "/metrics").expect("metrics answer");
    answer
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .and_then(|value| value.trim().parse().ok())
}

/// Polls `condition` every 20 ms until it holds; panics saying what was
/// awaited if it still does not after `limit`.
pub(super) async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !condition().await {
        assert!(
            Instant::now() < deadline,
            "waited {limit:?} for {what}, in vain"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

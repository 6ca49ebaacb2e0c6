//! What one client can hold: the in-flight byte limit (429, never a
//! queue), body, header and idle timeouts against slow and silent clients,
//! `api.max_connections`, and the rate of cuts and definition changes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use quire_tests::{TestStack, records, unique};
use serde_json::{Value, json};

use super::{
    committed_bodies, committed_messages, raw_request, scrape_metric, sequence_numbers, wait_until,
};

/// A `POST .../records` of exactly `length` bytes.
fn body_of_length(stream: &str, seq: u64, length: usize) -> Vec<u8> {
    let empty = serde_json::to_vec(&json!([{"stream": stream, "seq": seq, "pad": ""}])).unwrap();
    assert!(empty.len() <= length);
    let pad = "x".repeat(length - empty.len());
    let body = serde_json::to_vec(&json!([{"stream": stream, "seq": seq, "pad": pad}])).unwrap();
    assert_eq!(body.len(), length);
    body
}

#[tokio::test]
async fn a_request_that_does_not_fit_in_flight_is_429_and_never_queued() {
    let stack = TestStack::create("api-busy").await;
    let api = stack
        .api()
        .with(|settings| {
            settings.api.max_in_flight_bytes = std::num::NonZero::new(4096).unwrap();
            settings.api.max_body_bytes = std::num::NonZero::new(4096).unwrap();
        })
        .start_api()
        .await;
    let stream = unique("busy");
    let path = format!("/v1/streams/{stream}/records");
    let slow_body = body_of_length(&stream, 0, 3500);

    // A client that has sent its headers and most of its body holds the
    // 3000 bytes that arrived (not its declared 3500) while the API waits
    // for the rest.
    let mut slow = TcpStream::connect(("127.0.0.1", api.port())).expect("connect");
    write!(
        slow,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 3500\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    slow.write_all(&slow_body[..3000]).unwrap();
    slow.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while api.metric("quire_api_in_flight_bytes").await != Some(3000.0) {
        assert!(Instant::now() < deadline, "the slow request holds no bytes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 2000 more do not fit in 4096: refused at once, not queued.
    let second = body_of_length(&stream, 1, 2000);
    let response = api
        .http
        .post(api.url(&path))
        .header("content-type", "application/json")
        .header("idempotency-key", "busy-1")
        .body(second.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let refused: Value = response.json().await.unwrap();
    assert_eq!(refused["error"]["code"], "too_busy");
    assert_eq!(refused["error"]["limit"], 4096);

    // The slow request completes and gives its bytes back.
    slow.write_all(&slow_body[3000..]).unwrap();
    let mut answer = String::new();
    slow.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(api.metric("quire_api_in_flight_bytes").await, Some(0.0));

    // The refused request, sent again with the same key, is let in: the 429
    // was not remembered.
    let response = api
        .http
        .post(api.url(&path))
        .header("content-type", "application/json")
        .header("idempotency-key", "busy-1")
        .body(second)
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 200);
    assert!(response.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        vec![0, 1]
    );
    let busy_answers = api
        .metric(
            r#"quire_api_http_requests_total{method="POST",route="/v1/streams/{stream}/records",status="429"}"#,
        )
        .await;
    assert_eq!(busy_answers, Some(1.0));
}

#[tokio::test]
async fn a_body_that_stops_arriving_is_408_and_gives_its_bytes_back() {
    let stack = TestStack::create("api-slow-body").await;
    let api = stack
        .api()
        .with(|settings| settings.api.body_read_timeout = std::time::Duration::from_millis(1000))
        .start_api()
        .await;
    let stream = unique("slow-body");
    let path = format!("/v1/streams/{stream}/records");
    let body = body_of_length(&stream, 0, 3000);

    // Headers and half the body, then nothing: the API stops waiting.
    let mut slow = TcpStream::connect(("127.0.0.1", api.port())).expect("connect");
    write!(
        slow,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 3000\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    slow.write_all(&body[..1500]).unwrap();
    slow.flush().unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answer = String::new();
    slow.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert_eq!(api.metric("quire_api_in_flight_bytes").await, Some(0.0));
    assert!(committed_bodies(&stack, &stream).is_empty());

    // A definition that stops arriving is bounded the same way.
    let mut slow = connect_and_write(
        api.port(),
        &format!(
            "PUT /v1/streams/{stream}/definition HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 40\r\nConnection: close\r\n\r\n{{\"root\":"
        ),
    );
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(committed_bodies(&stack, &stream).is_empty());
}

/// Opens a connection and writes `head` (and nothing after it).
fn connect_and_write(port: u16, head: &str) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.write_all(head.as_bytes()).expect("write");
    stream.flush().expect("flush");
    stream
}

/// How long until the API closes `stream` (read returns end of file or a
/// reset), waiting at most `limit`; `None` if it is still open then.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("read timeout");
    let mut buffer = [0u8; 4096];
    while started.elapsed() < limit {
        match stream.read(&mut buffer) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}

/// Clients that hold connections without sending hold nothing else:
/// bodies declared and never sent reserve no in-flight bytes (a normal
/// client still publishes), a head sent in part is cut off at
/// `api.header_read_timeout_ms`, a connection that sends nothing at all
/// too, and a body that stops at `api.idle_timeout_ms`.
#[tokio::test]
async fn idle_bodies_slow_heads_and_silent_connections_hold_nothing() {
    let stack = TestStack::create("api-slowloris").await;
    let api = stack
        .api()
        .with(|settings| {
            settings.api.max_body_bytes = std::num::NonZero::new(32 * 1024).unwrap();
            settings.api.max_in_flight_bytes = std::num::NonZero::new(64 * 1024).unwrap();
            settings.api.header_read_timeout = std::time::Duration::from_millis(1000);
            settings.api.idle_timeout = std::time::Duration::from_millis(2500);
        })
        .start_api()
        .await;
    let stream = unique("slowloris");
    let path = format!("/v1/streams/{stream}/records");
    // Ten bodies of 32 KiB declared against 64 KiB in flight, none sent.
    let mut idle_bodies: Vec<TcpStream> = (0..10)
        .map(|_| {
            connect_and_write(
                api.port(),
                &format!(
                    "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 32768\r\n\r\n"
                ),
            )
        })
        .collect();
    // Once the API has read their heads, each is a request in flight (its
    // handler waiting for the body); with the scrape's own, eleven.
    let port = api.port();
    wait_until(
        "the API to read the ten idle bodies' heads",
        Duration::from_secs(10),
        || async move { scrape_metric(port, "quire_api_http_requests_in_flight") == Some(11.0) },
    )
    .await;
    assert_eq!(api.metric("quire_api_in_flight_bytes").await, Some(0.0));
    api.send_ok(&stream, &records(&stream, 0, 3)).await;

    let mut partial_head = connect_and_write(api.port(), &format!("GET {path} HTTP/1.1\r\nHo"));
    let mut silent = TcpStream::connect(("127.0.0.1", api.port())).expect("connect");
    let cut_off = closed_within(&mut partial_head, Duration::from_secs(10));
    assert!(
        cut_off.is_some_and(|after| after < Duration::from_secs(5)),
        "a head sent in part held its connection: closed after {cut_off:?}"
    );
    let cut_off = closed_within(&mut silent, Duration::from_secs(10));
    assert!(
        cut_off.is_some_and(|after| after < Duration::from_secs(5)),
        "a silent connection was kept: closed after {cut_off:?}"
    );
    // The idle bodies are past their headers: the idle timeout ends them.
    for body in &mut idle_bodies {
        let closed = closed_within(body, Duration::from_secs(10));
        assert!(closed.is_some(), "an idle body kept its connection");
    }
    // The client's pooled connection was closed too (idle past the header
    // timeout): a new client publishes.
    let fresh = reqwest::Client::new();
    let response = fresh
        .post(api.url(&path))
        .json(&records(&stream, 3, 3))
        .send()
        .await
        .expect("records request");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        (0..6).collect::<Vec<u64>>()
    );
}

/// Past `api.max_connections`, a new connection waits (in the kernel's
/// backlog) until one of the others ends, then is served.
#[tokio::test]
async fn past_max_connections_a_new_one_waits_for_a_free_slot() {
    let stack = TestStack::create("api-conn-cap").await;
    let api = stack
        .api()
        .with(|settings| {
            settings.api.max_connections = std::num::NonZero::new(3).unwrap();
            settings.api.header_read_timeout = std::time::Duration::from_millis(2000);
        })
        .start_api()
        .await;
    // The start's health check left a kept-alive connection: idle, it is
    // closed at the header timeout. Until then the scrape's own connection
    // is not the only one open.
    let port = api.port();
    let open_connections = || async move { scrape_metric(port, "quire_api_open_connections") };
    wait_until(
        "the health check's kept-alive connection to be closed",
        Duration::from_secs(10),
        || async { open_connections().await == Some(1.0) },
    )
    .await;
    // Then three requests whose bodies never come (held until
    // api.body_read_timeout_ms) fill every slot: two, seen open (three
    // with the scrape's own)...
    let stream = unique("capped");
    let head = format!(
        "POST /v1/streams/{stream}/records HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    );
    let mut holders: Vec<TcpStream> = (0..2).map(|_| connect_and_write(port, &head)).collect();
    wait_until(
        "the API to accept two holders",
        Duration::from_secs(10),
        || async { open_connections().await == Some(3.0) },
    )
    .await;
    // ... and a third, in the slot the scrape gives back. Nothing can be
    // scraped from here on (every slot is held); none is needed: the third
    // is in the kernel's backlog before the fourth, and the backlog is
    // accepted first in, first out.
    holders.push(connect_and_write(port, &head));
    // Timed from before the observation below starts (not from inside the
    // thread, which may start a moment later and then measure less).
    let started = Instant::now();
    let waiting = std::thread::spawn(move || {
        let status = raw_request(port, "GET", "/healthz");
        (status, started.elapsed())
    });
    // This sleep is the observation, not a wait for a state: for 1.5 s the
    // fourth connection must get no answer (its wait is measured below).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!waiting.is_finished(), "a fourth connection was served");
    drop(holders.remove(0));
    let (status, waited) = waiting.join().expect("the waiting request");
    assert!(status.contains(" 200"), "{status:?}");
    assert!(waited >= Duration::from_millis(1500), "{waited:?}");
}

/// Cuts and definition changes are rate-limited per stream (and per
/// principal): past the rate, 429 with `Retry-After` and nothing
/// published; other streams go on, and a replay of an `Idempotency-Key`
/// is answered without being counted.
#[tokio::test]
async fn cuts_and_definition_changes_past_their_rate_are_429_and_publish_nothing() {
    let stack = TestStack::create("api-rate").await;
    let api = stack
        .api()
        .with(|settings| {
            settings.api.control_requests_per_minute_per_stream = std::num::NonZero::new(2).unwrap()
        })
        .start_api()
        .await;
    let stream = unique("rated");
    let path = format!("/v1/streams/{stream}/reports");
    let (first, _, _) = api.post(&path, &Value::Null, Some(b"cut-a")).await;
    let (second, _, _) = api.post(&path, &Value::Null, None).await;
    assert_eq!((first, second), (202, 202));
    let (status, headers, body) = api.post(&path, &Value::Null, None).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    let wait: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "Retry-After {wait}");
    let response = api
        .http
        .put(api.url(&format!("/v1/streams/{stream}/definition")))
        .json(&json!({"root": "r"}))
        .send()
        .await
        .expect("definition request");
    assert_eq!(response.status().as_u16(), 429);
    // A replay is answered from memory, whatever the rate.
    let (replayed, headers, _) = api.post(&path, &Value::Null, Some(b"cut-a")).await;
    assert_eq!(replayed, 202);
    assert_eq!(headers["idempotent-replayed"], "true");
    // Another stream is not held back.
    let other = unique("unrated");
    let (status, _, _) = api
        .post(&format!("/v1/streams/{other}/reports"), &Value::Null, None)
        .await;
    assert_eq!(status, 202);
    // Two markers of the limited stream were published, no more.
    let markers = committed_messages(&stack, &stream).len();
    assert_eq!(markers, 2);
}

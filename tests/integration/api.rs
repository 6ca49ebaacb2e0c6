//! The producer API under real use, against the real binaries, Kafka and
//! S3: `Idempotency-Key` (replays publish nothing, a reused key is 422, an
//! invalid one 400), the in-flight byte limit (429, never a queue), the
//! OpenAPI document against the routes the API serves, and the `quire` CLI
//! end to end, a resumed send included.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use quire_tests::{ApiProcess, Report, TestStack, records, release_binary};
use quire_tests::{read_all, sha256_hex, unique};
use serde_json::{Value, json};

const OPENAPI_YAML: &str = include_str!("../../services/producer-api/openapi.yaml");
const RECORDS_PARTITIONS: i32 = 12;

/// Every committed message on the stack's records topic, as JSON, keyed by
/// stream.
fn committed_bodies(stack: &TestStack, stream: &str) -> Vec<Value> {
    read_all(
        &stack.kafka,
        &stack.topics.records,
        RECORDS_PARTITIONS,
        true,
    )
    .into_iter()
    .filter(|message| message.key.as_deref() == Some(stream.as_bytes()))
    .map(|message| serde_json::from_slice(&message.payload).expect("JSON message"))
    .collect()
}

fn sequence_numbers(bodies: &[Value]) -> Vec<u64> {
    bodies
        .iter()
        .filter_map(|body| body["seq"].as_u64())
        .collect()
}

/// A retry of one array through another spelling of its stream's path
/// (`%69` for `i`) is the same request: answered from the first, published
/// once. The key used to be scoped by the raw path, and published again.
#[tokio::test]
async fn a_retry_through_an_encoded_stream_path_is_a_replay() {
    let stack = TestStack::create("api-idem-path").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("idem");
    let encoded = format!("%69{}", &stream[1..]);
    let array = json!(records(&stream, 0, 5));
    let (status, headers, first) = api
        .post(
            &format!("/v1/streams/{encoded}/records"),
            &array,
            Some(b"k"),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, again) = api
        .post(&format!("/v1/streams/{stream}/records"), &array, Some(b"k"))
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first);
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        (0..5).collect::<Vec<u64>>()
    );
}

#[tokio::test]
async fn a_retried_array_is_answered_once_and_published_once() {
    let stack = TestStack::create("api-idem").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("idem");
    let path = format!("/v1/streams/{stream}/records");
    let array = json!(records(&stream, 0, 25));

    let (status, headers, first) = api.post(&path, &array, Some(b"key-1")).await;
    assert_eq!(status, 200, "{first}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, again) = api.post(&path, &array, Some(b"key-1")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first, "a replay gets the first answer, ids included");

    // The same key for another body is refused, and publishes nothing.
    let other = json!(records(&stream, 100, 3));
    let (status, headers, refused) = api.post(&path, &other, Some(b"key-1")).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["code"], "idempotency_key_reused");
    assert!(headers.get("idempotent-replayed").is_none());
    // The same key on another stream is another key.
    let other_stream = unique("idem-other");
    let (status, headers, _) = api
        .post(
            &format!("/v1/streams/{other_stream}/records"),
            &json!(records(&other_stream, 0, 1)),
            Some(b"key-1"),
        )
        .await;
    assert_eq!(status, 200);
    assert!(headers.get("idempotent-replayed").is_none());

    let published = sequence_numbers(&committed_bodies(&stack, &stream));
    assert_eq!(published, (0..25).collect::<Vec<_>>(), "the array once");
    assert_eq!(
        api.metric("quire_api_idempotent_replays_total").await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_retried_cut_is_one_marker_with_one_report_id() {
    let stack = TestStack::create("api-cut").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("cut");
    let path = format!("/v1/streams/{stream}/reports");
    let (status, headers, first) = api.post(&path, &Value::Null, Some(b"cut-1")).await;
    assert_eq!(status, 202, "{first}");
    let location = headers["location"].clone();
    let (status, headers, again) = api.post(&path, &Value::Null, Some(b"cut-1")).await;
    assert_eq!(status, 202, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["location"], location);
    assert_eq!(again["report_id"], first["report_id"]);
    assert_eq!(committed_bodies(&stack, &stream).len(), 1, "one cut marker");

    // Without a key, every cut is a cut.
    let (status, _, second) = api.post(&path, &Value::Null, None).await;
    assert_eq!(status, 202);
    assert_ne!(second["report_id"], first["report_id"]);
    assert_eq!(committed_bodies(&stack, &stream).len(), 2);
}

#[tokio::test]
async fn invalid_idempotency_keys_are_400_and_publish_nothing() {
    let stack = TestStack::create("api-keys").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("keys");
    let path = format!("/v1/streams/{stream}/records");
    let array = json!(records(&stream, 0, 2));
    let too_long = vec![b'k'; 256];
    for key in [&b""[..], b"has space", "é".as_bytes(), &too_long] {
        let (status, _, body) = api.post(&path, &array, Some(key)).await;
        assert_eq!(status, 400, "{key:?}: {body}");
        assert_eq!(body["error"]["code"], "invalid_idempotency_key");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Idempotency-Key"),
            "{body}"
        );
    }
    let longest = vec![b'k'; 255];
    let (status, _, body) = api.post(&path, &array, Some(&longest)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        vec![0, 1]
    );
}

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

/// Every documented operation: (METHOD, path template) -> statuses listed.
fn documented_operations(document: &Value) -> BTreeMap<(String, String), BTreeSet<u16>> {
    let mut operations = BTreeMap::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            let statuses = operation["responses"]
                .as_object()
                .expect("responses")
                .keys()
                .map(|status| status.parse().expect("numeric status"))
                .collect();
            operations.insert((method.to_uppercase(), path.clone()), statuses);
        }
    }
    operations
}

#[tokio::test]
async fn the_openapi_document_is_served_and_matches_the_routes() {
    let stack = TestStack::create("api-openapi").await;
    let api = stack.start_api_in_process().await;

    let served_yaml = api
        .http
        .get(api.url("/openapi.yaml"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        served_yaml, OPENAPI_YAML,
        "the served document is the embedded one"
    );
    let document: Value = serde_norway::from_str(OPENAPI_YAML).expect("YAML");
    let served_json: Value = api
        .http
        .get(api.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(served_json, document);
    assert_eq!(document["openapi"], "3.1.0");

    let operations = documented_operations(&document);
    let stream = unique("doc");
    // A pending report id to look at.
    let (status, _, cut) = api
        .post(&format!("/v1/streams/{stream}/reports"), &Value::Null, None)
        .await;
    assert_eq!(status, 202);
    let report_id = cut["report_id"].as_str().unwrap().to_owned();

    // For each operation: a valid request and a deliberately invalid one
    // (a bad stream name or report id where the path has one).
    let mut exercised = BTreeSet::new();
    for ((method, template), statuses) in &operations {
        let mut attempts = vec![(
            template
                .replace("{stream}", &stream)
                .replace("{id}", &report_id),
            "valid",
        )];
        if template.contains('{') {
            attempts.push((
                template
                    .replace("{stream}", "-bad-name")
                    .replace("{id}", "not-a-report-id"),
                "invalid",
            ));
        }
        for (path, kind) in attempts {
            let url = api.url(&path);
            let request = match method.as_str() {
                "GET" => api.http.get(url),
                "POST" if template.ends_with("/records") => {
                    api.http.post(url).json(&records(&stream, 0, 2))
                }
                "POST" => api.http.post(url),
                "PUT" => api
                    .http
                    .put(url)
                    .json(&json!({"root": "doc", "gzip": true})),
                other => panic!("undocumented method {other} in the test"),
            };
            let response = request.send().await.expect("request");
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default();
            assert!(
                !body.contains("\"code\":\"not_found\"")
                    && !body.contains("\"code\":\"method_not_allowed\""),
                "{method} {template} is documented but not served: {body}"
            );
            assert!(
                statuses.contains(&status),
                "{method} {path} ({kind}) answered {status}, which the document does not list for it ({statuses:?}): {body}"
            );
        }
        exercised.insert((method.clone(), template.clone()));
    }
    assert_eq!(exercised.len(), operations.len());

    // Methods the document does not list on a documented path are not served.
    for template in operations
        .keys()
        .map(|(_, template)| template.clone())
        .collect::<BTreeSet<_>>()
    {
        let path = template
            .replace("{stream}", &stream)
            .replace("{id}", &report_id);
        for method in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            if operations.contains_key(&(method.to_owned(), template.clone())) {
                continue;
            }
            let response = api
                .http
                .request(method.parse().unwrap(), api.url(&path))
                .send()
                .await
                .expect("request");
            assert_eq!(
                response.status().as_u16(),
                405,
                "{method} {template} is served but not documented"
            );
        }
    }
}

/// Runs the `quire` binary against `api`; its exit code and stdout.
fn quire(api: &ApiProcess, arguments: &[&str]) -> (i32, String, String) {
    let output = Command::new(release_binary("quire"))
        .arg("--api")
        .arg(&api.base)
        .args(arguments)
        .env_remove("QUIRE_API_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("run quire");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Cuts with the CLI, waits for the report, downloads it with the CLI and
/// returns its records' sequence numbers, sorted.
async fn cut_and_fetch(api: &ApiProcess, stream: &str, directory: &std::path::Path) -> Vec<u64> {
    let (code, stdout, stderr) = quire(api, &["cut", "-s", stream, "--json"]);
    assert_eq!(code, 0, "quire cut: {stderr}");
    let cut: Value = serde_json::from_str(stdout.trim()).expect("cut JSON");
    let report_id = cut["report_id"].as_str().expect("report id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, stdout, stderr) = quire(api, &["status", &report_id, "--json"]);
        assert_eq!(code, 0, "quire status: {stderr}");
        let status: Value = serde_json::from_str(stdout.trim()).expect("status JSON");
        if status["status"] == "completed" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "report {report_id} still {status}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let output = directory.join(format!("{stream}.xml"));
    let (code, _, stderr) = quire(api, &["get", &report_id, "-o", output.to_str().unwrap()]);
    assert_eq!(code, 0, "quire get: {stderr}");
    let report = Report {
        manifest: json!({}),
        document: std::fs::read(&output).expect("downloaded report"),
    };
    let mut seqs: Vec<u64> = report
        .records()
        .iter()
        .map(|record| record["seq"].parse().expect("seq"))
        .collect();
    seqs.sort_unstable();
    seqs
}

#[tokio::test]
async fn the_cli_sends_cuts_and_gets_and_a_resumed_send_is_not_doubled() {
    let stack = TestStack::create("api-cli").await;
    let api = stack.start_api().await;
    let mut worker = stack.worker("cli-worker").spawn();
    let directory = std::env::temp_dir().join(unique("quire-cli-test"));
    std::fs::create_dir_all(&directory).unwrap();

    // A plain send: 250 records in arrays of 100.
    let stream = unique("cli");
    let file = directory.join("records.ndjson");
    let mut text = String::new();
    for record in records(&stream, 0, 250) {
        text.push_str(&serde_json::to_string(&record).unwrap());
        text.push('\n');
    }
    std::fs::write(&file, &text).unwrap();
    let (code, stdout, stderr) = quire(
        &api,
        &[
            "send",
            "-s",
            &stream,
            file.to_str().unwrap(),
            "--array",
            "100",
            "--json",
        ],
    );
    assert_eq!(code, 0, "quire send: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("send JSON");
    assert_eq!(summary["records"], 250);
    assert_eq!(summary["arrays"], 3);
    assert_eq!(
        cut_and_fetch(&api, &stream, &directory).await,
        (0..250).collect::<Vec<_>>()
    );

    // A send killed after the API accepted its first array but before the
    // progress file said so: the file says 0 records, the API has array 0
    // under the send's key. `--resume` sends array 0 again with that key.
    let resumed = unique("cli-resume");
    let resumed_file = directory.join("resumed.ndjson");
    let lines: Vec<String> = records(&resumed, 0, 250)
        .iter()
        .map(|record| serde_json::to_string(record).unwrap())
        .collect();
    std::fs::write(&resumed_file, lines.join("\n") + "\n").unwrap();
    let run_id = "0123456789abcdef0123456789abcdef";
    let progress_file = PathBuf::from(format!("{}.quire-progress", resumed_file.display()));
    std::fs::write(
        &progress_file,
        serde_json::to_vec(&json!({
            "v": 1,
            "stream": resumed,
            "file": resumed_file.to_str().unwrap(),
            "format": "ndjson",
            "records": 0,
            "offset": 0,
            "run_id": run_id,
            "array_size": 100,
            "max_request_bytes": 8 * 1024 * 1024,
        }))
        .unwrap(),
    )
    .unwrap();
    let first_array = lines[..100].join("\n") + "\n";
    let response = api
        .http
        .post(api.url(&format!("/v1/streams/{resumed}/records")))
        .header("content-type", "application/x-ndjson")
        .header("idempotency-key", format!("quire-send-{run_id}-0"))
        .body(first_array)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let (code, stdout, stderr) = quire(
        &api,
        &[
            "send",
            "-s",
            &resumed,
            resumed_file.to_str().unwrap(),
            "--resume",
            "--json",
        ],
    );
    assert_eq!(code, 0, "quire send --resume: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("send JSON");
    assert_eq!(summary["records_total"], 250);
    assert!(
        !progress_file.exists(),
        "the progress file is removed at the end"
    );
    assert_eq!(
        api.metric("quire_api_idempotent_replays_total").await,
        Some(1.0)
    );
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &resumed)),
        (0..250).collect::<Vec<_>>(),
        "every record once in the log"
    );
    assert_eq!(
        cut_and_fetch(&api, &resumed, &directory).await,
        (0..250).collect::<Vec<_>>(),
        "every record exactly once in the report"
    );

    worker.kill();
    let _ = std::fs::remove_dir_all(&directory);
}

/// Records 0..count of `stream` as NDJSON, one line each.
fn ndjson(stream: &str, count: u64) -> String {
    records(stream, 0, count)
        .iter()
        .map(|record| serde_json::to_string(record).unwrap() + "\n")
        .collect()
}

#[tokio::test]
async fn the_cli_fills_its_arrays_up_to_the_limits_the_api_gives() {
    let stack = TestStack::create("api-limits").await;
    let mut launch = stack.api();
    launch.settings.api.max_records_per_request = std::num::NonZero::new(120).unwrap();
    let api = launch.start_api().await;

    let response = api.http.get(api.url("/v1/limits")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let limits: Value = response.json().await.unwrap();
    assert_eq!(limits["max_records_per_request"], 120, "{limits}");
    assert_eq!(
        limits["max_body_bytes"],
        stack.settings().api.max_body_bytes.get(),
        "{limits}"
    );

    // No --array: arrays of the API's 120 records (250 = 120 + 120 + 10),
    // where a fixed default would have been refused or sent small arrays.
    let directory = std::env::temp_dir().join(unique("quire-limits-test"));
    std::fs::create_dir_all(&directory).unwrap();
    let stream = unique("limits");
    let file = directory.join("records.ndjson");
    let text = ndjson(&stream, 250);
    std::fs::write(&file, &text).unwrap();
    let (code, stdout, stderr) = quire(
        &api,
        &["send", "-s", &stream, file.to_str().unwrap(), "--json"],
    );
    assert_eq!(code, 0, "quire send: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("send JSON");
    assert_eq!(summary["records"], 250, "{summary}");
    assert_eq!(summary["arrays"], 3, "{summary}");

    // --max-request-bytes still bounds a request: three records' worth.
    let bytes = text
        .lines()
        .take(3)
        .map(|line| line.len() + 1)
        .sum::<usize>();
    let small = unique("limits-small");
    let small_file = directory.join("small.ndjson");
    std::fs::write(&small_file, ndjson(&small, 30)).unwrap();
    let (code, stdout, stderr) = quire(
        &api,
        &[
            "send",
            "-s",
            &small,
            small_file.to_str().unwrap(),
            "--max-request-bytes",
            &bytes.to_string(),
            "--json",
        ],
    );
    assert_eq!(code, 0, "quire send: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("send JSON");
    assert!(summary["arrays"].as_u64().unwrap() >= 10, "{summary}");
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        (0..250).collect::<Vec<_>>(),
        "every record once in the log"
    );
    std::fs::remove_dir_all(&directory).ok();
}

/// POSTs an array; status, `Retry-After`, error code.
async fn post_array(
    api: &ApiProcess,
    stream: &str,
    first: u64,
    key: &str,
) -> (u16, Option<String>, Value) {
    let response = api
        .http
        .post(api.url(&format!("/v1/streams/{stream}/records")))
        .header("idempotency-key", key)
        .json(&records(stream, first, 10))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("an answer");
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned());
    (
        status,
        retry_after,
        response.json().await.unwrap_or(Value::Null),
    )
}

/// The `seq` of every record on the stack's records topic, sorted.
async fn published_seqs(
    stack: &TestStack,
    broker: &quire_tests::kafka_process::KafkaProcess,
    read_committed: bool,
) -> Vec<u64> {
    let topic = stack.topics.records.clone();
    let settings = broker.settings();
    let mut seqs: Vec<u64> = tokio::task::spawn_blocking(move || {
        read_all(&settings, &topic, RECORDS_PARTITIONS, read_committed)
    })
    .await
    .unwrap()
    .into_iter()
    .filter_map(|message| serde_json::from_slice::<Value>(&message.payload).ok())
    .filter_map(|body| body["seq"].as_u64())
    .collect();
    seqs.sort_unstable();
    seqs
}

#[tokio::test]
async fn while_kafka_is_away_publishing_is_503_at_once_and_the_api_recovers_alone() {
    let mut broker =
        tokio::task::spawn_blocking(quire_tests::kafka_process::KafkaProcess::start_new)
            .await
            .unwrap();
    let stack = TestStack::create_on("api-away", &broker).await;
    let api = stack.start_api().await;
    let stream = unique("away");
    let (status, _, before) = post_array(&api, &stream, 0, "before").await;
    assert_eq!(status, 200, "{before}");
    // The broker dies once the array is readable: killed right at the 200,
    // the restarted coordinator may skip a COMMIT marker, which the
    // producer's release repairs (hanging.rs), but a later failed
    // transaction of the same producer can still abort it in rare rounds
    // (issue 10, open); what is tested here is the API's behaviour.
    let deadline = Instant::now() + Duration::from_secs(30);
    while published_seqs(&stack, &broker, true).await != (0..10).collect::<Vec<u64>>() {
        assert!(
            Instant::now() < deadline,
            "the first array never became readable"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    broker.kill();
    let killed = Instant::now();
    let refused = loop {
        let (status, retry_after, body) = post_array(&api, &stream, 100, "during").await;
        if status == 503 && body["error"]["code"] == "kafka_unavailable" {
            assert_eq!(retry_after.as_deref(), Some("1"));
            // Operators' facts stay in the log.
            assert!(!body.to_string().contains(&broker.bootstrap), "{body}");
            break killed.elapsed();
        }
        assert!(
            status == 503 || status == 200,
            "while kafka goes away: {status} {body}"
        );
        assert!(killed.elapsed() < Duration::from_secs(60), "never refused");
    };
    // Refused at once from then on, and the 503 was not remembered.
    let asked = Instant::now();
    let (status, _, body) = post_array(&api, &stream, 100, "during").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "a 503 must not wait for kafka"
    );
    // A replay needs no Kafka.
    let (status, _, replayed) = post_array(&api, &stream, 0, "before").await;
    assert_eq!(status, 200);
    assert_eq!(replayed, before);
    let (status, readiness) = {
        let response = api.http.get(api.url("/readyz")).send().await.unwrap();
        (
            response.status().as_u16(),
            response.json::<Value>().await.unwrap(),
        )
    };
    assert_eq!(status, 503);
    assert_eq!(readiness["checks"]["kafka"]["ok"], false, "{readiness}");
    assert!(
        !readiness.to_string().contains(&broker.bootstrap),
        "/readyz is open to anyone and names no broker: {readiness}"
    );
    assert_eq!(api.metric("quire_api_kafka_available").await, Some(0.0));

    let broker = tokio::task::spawn_blocking(move || {
        broker.start();
        broker
    })
    .await
    .unwrap();
    let restarted = Instant::now();
    let recovered = loop {
        let (status, _, body) = post_array(&api, &stream, 100, "during").await;
        if status == 200 {
            break restarted.elapsed();
        }
        assert_eq!(status, 503, "{body}");
        assert!(
            restarted.elapsed() < Duration::from_secs(120),
            "the API did not recover: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    quire_tests::figures(&format!(
        "api kafka outage: 503 {refused:?} after the broker died; accepted again {recovered:?} after it was back"
    ));
    // The refused arrays' transactions end (aborted) when the unusable
    // producer's replacement fences it, or at the transaction timeout; until
    // then read_committed readers wait at them.
    let expected: Vec<u64> = (0..10).chain(100..110).collect();
    let settled = Instant::now();
    loop {
        let published = published_seqs(&stack, &broker, true).await;
        eprintln!(
            "read {} records {:?} after recovery",
            published.len(),
            settled.elapsed()
        );
        if published.len() >= expected.len() || settled.elapsed() > Duration::from_secs(30) {
            assert_eq!(
                published,
                expected,
                "each accepted array once, nothing of the refused ones (read_uncommitted: {:?})",
                published_seqs(&stack, &broker, false).await
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(api);
    drop(broker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_commit_outcome_is_settled_by_reading_the_log_where_it_was_written() {
    let settings = quire_tests::kafka_settings();
    let topic = quire_tests::TestTopic::create("settle", 3).await;
    let mut reader_settings = settings.clone();
    reader_settings.topics.records = topic.name.clone();
    let log =
        producer_api::log_reader::LogReader::new(&reader_settings, 3, &unique("settle-reader"))
            .expect("log reader");
    let wait = log.transaction_wait();
    let key = "settled-stream";

    // Committed, and aborted: settled at once.
    let committed = quire_tests::raw_transactional_producer(&settings, &unique("settle-committed"));
    let at = quire_tests::send_in_transaction(&committed, &topic.name, key).await;
    rdkafka::producer::Producer::commit_transaction(&committed, Duration::from_secs(30))
        .expect("commit");
    assert!(log.settle(key.as_bytes(), at, wait).await.expect("settled"));
    // The same place under another key is not this request's message.
    assert!(
        !log.settle(b"another-stream", at, wait)
            .await
            .expect("settled")
    );

    let aborted = quire_tests::raw_transactional_producer(&settings, &unique("settle-aborted"));
    let at = quire_tests::send_in_transaction(&aborted, &topic.name, key).await;
    rdkafka::producer::Producer::abort_transaction(&aborted, Duration::from_secs(30))
        .expect("abort");
    assert!(!log.settle(key.as_bytes(), at, wait).await.expect("settled"));

    // Still open when the look-up starts: it waits for the end. Committed a
    // moment later...
    let late_commit =
        quire_tests::raw_transactional_producer(&settings, &unique("settle-late-commit"));
    let at = quire_tests::send_in_transaction(&late_commit, &topic.name, key).await;
    let committer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        rdkafka::producer::Producer::commit_transaction(&late_commit, Duration::from_secs(30))
            .expect("late commit");
    });
    assert!(log.settle(key.as_bytes(), at, wait).await.expect("settled"));
    committer.join().unwrap();

    // A request waits for the end at most its budget: an open transaction
    // past it is an error, in about that time, not a wait for the whole
    // transaction timeout; it is settled once it ends.
    let open = quire_tests::raw_transactional_producer(&settings, &unique("settle-open"));
    let at = quire_tests::send_in_transaction(&open, &topic.name, key).await;
    let asked = Instant::now();
    let outcome = log
        .settle(key.as_bytes(), at, Duration::from_millis(1500))
        .await;
    let waited = asked.elapsed();
    assert!(
        outcome.is_err(),
        "an open transaction is not settled: {outcome:?}"
    );
    assert!(
        waited < Duration::from_secs(3),
        "the budget of 1.5 s bounds the wait; it took {waited:?}"
    );
    rdkafka::producer::Producer::commit_transaction(&open, Duration::from_secs(30))
        .expect("commit");
    assert!(log.settle(key.as_bytes(), at, wait).await.expect("settled"));

    // ... or ended by fencing, as the API's replacement producer does.
    let id = unique("settle-fenced");
    let fenced = quire_tests::raw_transactional_producer(&settings, &id);
    let at = quire_tests::send_in_transaction(&fenced, &topic.name, key).await;
    let fencer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        quire_tests::raw_transactional_producer(&quire_tests::kafka_settings(), &id)
    });
    assert!(!log.settle(key.as_bytes(), at, wait).await.expect("settled"));
    drop(fencer.join().unwrap());
    drop(fenced);
}

/// One HTTP/1.1 request written by hand (any method, as a hostile client
/// may send), and the status line of its answer.
fn raw_request(port: u16, method: &str, path: &str) -> String {
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
    let _ = stream.read_to_string(&mut answer);
    answer.lines().next().unwrap_or_default().to_owned()
}

/// Every label of `/metrics` takes a bounded set of values: made-up
/// methods (each 2 KB here) are counted as `other`, and paths no route
/// matches as `unmatched`, so one client cannot grow every scrape.
#[tokio::test]
async fn made_up_methods_and_paths_do_not_grow_the_metrics() {
    let stack = TestStack::create("api-labels").await;
    let api = stack.start_api().await;
    let scrape = || async {
        api.http
            .get(api.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    };
    let before = scrape().await;
    for index in 0..100 {
        let method = format!("M{index}{}", "Q".repeat(2000));
        let status = raw_request(api.port(), &method, "/healthz");
        assert!(status.starts_with("HTTP/1.1 "), "an answer: {status:?}");
        let path = format!("/nowhere/{index}/{}", "p".repeat(2000));
        let status = raw_request(api.port(), "GET", &path);
        assert!(status.contains(" 404"), "{status:?}");
    }
    let after = scrape().await;
    assert!(!after.contains("QQQQ"), "a made-up method became a label");
    assert!(!after.contains("pppp"), "a raw path became a label");
    assert!(after.contains(r#"method="other""#), "{after}");
    assert!(after.contains(r#"route="unmatched""#), "{after}");
    assert!(
        after.len() < before.len() + 16 * 1024,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
}

/// A record naming one key twice is refused with 422 naming record and
/// key, and nothing of its array is published: the raw text would carry
/// the first value (a NUL here) past a check made on the last.
#[tokio::test]
async fn a_record_with_a_key_named_twice_is_refused_and_nothing_is_published() {
    let stack = TestStack::create("api-duplicates").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("dup");
    let response = api
        .http
        .post(api.url(&format!("/v1/streams/{stream}/records")))
        .header("content-type", "application/json")
        .body(r#"[{"seq":0}, {"a":"\u0000","a":"ok"}]"#)
        .send()
        .await
        .expect("records request");
    assert_eq!(response.status().as_u16(), 422);
    let body: Value = response.json().await.expect("error body");
    assert_eq!(body["error"]["code"], "duplicate_key", "{body}");
    assert_eq!(body["error"]["index"], 1, "{body}");
    assert_eq!(body["error"]["path"], "a", "{body}");
    // A later array of the same stream is published; the refused one is not.
    api.send_ok(&stream, &records(&stream, 1, 1)).await;
    let published = committed_bodies(&stack, &stream);
    assert_eq!(sequence_numbers(&published), [1], "{published:?}");
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
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    // closed at the header timeout. Then three requests whose bodies never
    // come (held until api.body_read_timeout_ms) fill every slot.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let stream = unique("capped");
    let head = format!(
        "POST /v1/streams/{stream}/records HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    );
    let mut holders: Vec<TcpStream> = (0..3)
        .map(|_| connect_and_write(api.port(), &head))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let port = api.port();
    let waiting = std::thread::spawn(move || {
        let started = Instant::now();
        let status = raw_request(port, "GET", "/healthz");
        (status, started.elapsed())
    });
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
        .with(|settings| settings.api.control_requests_per_minute_per_stream = std::num::NonZero::new(2).unwrap())
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
    let markers = read_all(
        &stack.kafka,
        &stack.topics.records,
        RECORDS_PARTITIONS,
        true,
    )
    .into_iter()
    .filter(|message| message.key.as_deref() == Some(stream.as_bytes()))
    .count();
    assert_eq!(markers, 2);
}

/// `quire` against the API at `base`, with extra global options first.
fn quire_at(base: &str, options: &[&str], arguments: &[&str]) -> (i32, String, String) {
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

/// Tokens with scopes on the running API: a write-only token on one prefix
/// publishes there and nowhere else, a read-only token reads and cannot
/// publish, an unknown token is 401; the CLI talks to the API through a
/// TLS endpoint (and refuses one it cannot verify, or a token in clear
/// text beyond loopback); and neither a token nor a Kafka SASL password
/// reaches the API's debug log. On the previous main every known token
/// could do everything on every stream, and tokens were configured in
/// plain text.
#[tokio::test]
async fn tokens_act_within_their_scopes_over_https_and_no_secret_is_logged() {
    use quire_tests::client::token_line;

    let stack = TestStack::create("api-scopes").await;
    let prefix = unique("scoped");
    let [writer, reader, admin] =
        ["writer", "reader", "admin"].map(|name| unique(&format!("{name}-secret")));
    let kafka_password = unique("sasl-password");
    let directory = std::env::temp_dir().join(unique("quire-scopes-test"));
    std::fs::create_dir_all(&directory).unwrap();
    let log = directory.join("api.log");
    let api = stack
        .api()
        .with(|settings| {
            settings.api.tokens = vec![
                token_line("writer", &writer, "write", &format!("{prefix}-")),
                token_line("reader", &reader, "read", "*"),
                token_line("admin", &admin, "read+write", "*"),
            ];
            settings
                .kafka
                .properties
                .insert("sasl_password".into(), kafka_password.clone());
        })
        .log_to(&log, "debug")
        .start_api()
        .await;

    let own = format!("{prefix}-a");
    let other = unique("elsewhere");
    let send = |stream: &str, token: Option<&str>| {
        let mut request = api
            .http
            .post(api.url(&format!("/v1/streams/{stream}/records")))
            .json(&json!(records(stream, 0, 3)));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.expect("POST");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, body) = send(&own, Some(&writer)).await;
    assert_eq!(status, 200, "the writer on its prefix: {body}");
    let (status, body) = send(&other, Some(&writer)).await;
    assert_eq!(status, 403, "the writer beyond its prefix: {body}");
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
    assert_eq!(body["error"]["stream"], other.as_str(), "{body}");
    let (status, body) = send(&own, Some(&reader)).await;
    assert_eq!(status, 403, "the reader writing: {body}");
    assert_eq!(body["error"]["missing_scope"], "write", "{body}");
    let (status, _) = send(&own, Some("not-a-token")).await;
    assert_eq!(status, 401);
    let (status, _) = send(&own, None).await;
    assert_eq!(status, 401);
    let list = |token: &str| {
        let request = api
            .http
            .get(api.url(&format!("/v1/streams/{own}/reports")))
            .bearer_auth(token);
        async move {
            let response = request.send().await.expect("GET");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, body) = list(&writer).await;
    assert_eq!(status, 403, "the writer reading: {body}");
    assert_eq!(body["error"]["missing_scope"], "read", "{body}");
    assert_eq!(list(&reader).await.0, 200);

    // The CLI through TLS, with the authority's certificate.
    let target = format!("127.0.0.1:{}", api.port()).parse().unwrap();
    let proxy = quire_tests::tls::TlsProxy::start(target);
    let ca = proxy.ca_pem.to_str().unwrap().to_owned();
    let file = directory.join("records.ndjson");
    let over_tls = format!("{prefix}-tls");
    let lines: Vec<String> = records(&over_tls, 0, 40)
        .iter()
        .map(Value::to_string)
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let (code, _, stderr) = quire_at(
        &proxy.base,
        &["--ca-cert", &ca, "--token", &admin],
        &["send", "-s", &over_tls, file.to_str().unwrap(), "--json"],
    );
    assert_eq!(code, 0, "quire send over https: {stderr}");
    assert!(proxy.handshakes.load(std::sync::atomic::Ordering::SeqCst) > 0);
    let (code, stdout, stderr) = quire_at(
        &proxy.base,
        &["--ca-cert", &ca, "--token", &reader],
        &["list", "-s", &over_tls, "--json"],
    );
    assert_eq!(code, 0, "quire list over https: {stderr} {stdout}");
    // Without the authority, the certificate is refused: nothing is sent.
    let (code, _, stderr) = quire_at(
        &proxy.base,
        &["--token", &admin],
        &[
            "send",
            "-s",
            &over_tls,
            file.to_str().unwrap(),
            "--state",
            directory.join("p2").to_str().unwrap(),
        ],
    );
    assert_eq!(
        code, 1,
        "an unverifiable certificate was accepted: {stderr}"
    );
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    // A token is not sent in clear text beyond loopback (nothing listens there).
    let (code, _, stderr) = quire_at(
        "http://192.0.2.1:9",
        &["--token", &admin],
        &["list", "-s", &over_tls],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("clear text"), "{stderr}");
    assert!(
        !stderr.contains(&admin),
        "the refusal echoed the token: {stderr}"
    );

    let published = |stream: &str| committed_bodies(&stack, stream).len();
    assert_eq!(published(&own), 3, "the writer's one array");
    assert_eq!(published(&other), 0, "a refused array was published");
    assert_eq!(published(&over_tls), 40, "the CLI's records over TLS");

    drop(api);
    let logged = std::fs::read_to_string(&log).expect("the API's log");
    assert!(
        logged.lines().count() > 5,
        "the debug log is nearly empty: {logged}"
    );
    for (what, secret) in [
        ("the writer's token", writer.as_str()),
        ("the reader's token", reader.as_str()),
        ("the admin's token", admin.as_str()),
        ("the SASL password", kafka_password.as_str()),
    ] {
        assert!(!logged.contains(secret), "{what} is in the API's log");
    }
    let _ = std::fs::remove_dir_all(&directory);
}

/// An `Idempotency-Key`'s answer lives in Kafka, written in the array's
/// own transaction: a retry that reaches another replica, or the same
/// replica after a restart, is answered from it and publishes nothing.
/// Before, keys lived in one process: the second replica and the
/// restarted one published the array again.
#[tokio::test]
async fn a_key_is_answered_by_another_replica_and_after_a_restart() {
    let stack = TestStack::create("api-key-log").await;
    let replica = |id: &'static str| {
        stack
            .api()
            .with(move |settings| settings.api.replica_id = id.into())
    };
    let first = replica("api-a").start_api().await;
    let second = replica("api-b").start_api().await;
    let stream = unique("shared-key");
    let records_path = format!("/v1/streams/{stream}/records");
    let cut_path = format!("/v1/streams/{stream}/reports");
    let array = json!(records(&stream, 0, 4));

    let (status, headers, answer) = first.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{answer}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, replayed) = second.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(
        headers
            .get("idempotent-replayed")
            .map(|value| value.to_str().unwrap()),
        Some("true"),
        "the other replica did not replay"
    );
    assert_eq!(replayed, answer, "the other replica's answer differs");
    // The key with another body, on the other replica: refused.
    let other = json!(records(&stream, 10, 1));
    let (status, _, refused) = second.post(&records_path, &other, Some(b"k-1")).await;
    assert_eq!(status, 422, "{refused}");
    let (status, _, cut) = second.post(&cut_path, &json!({}), Some(b"cut-1")).await;
    assert_eq!(status, 202, "{cut}");

    drop(first);
    drop(second);
    let restarted = replica("api-a").start_api().await;
    let (status, headers, again) = restarted.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{again}");
    assert!(
        headers.contains_key("idempotent-replayed"),
        "not replayed after a restart"
    );
    assert_eq!(again, answer);
    let (status, headers, cut_again) = restarted.post(&cut_path, &json!({}), Some(b"cut-1")).await;
    assert_eq!(status, 202, "{cut_again}");
    assert!(headers.contains_key("idempotent-replayed"));
    assert_eq!(cut_again, cut, "the cut's report id changed");
    assert_eq!(
        headers
            .get("location")
            .map(|value| value.to_str().unwrap().to_owned()),
        Some(format!(
            "/v1/reports/{}",
            cut["report_id"].as_str().unwrap()
        )),
    );

    let bodies = committed_bodies(&stack, &stream);
    assert_eq!(
        sequence_numbers(&bodies),
        [0, 1, 2, 3],
        "published more than once"
    );
}

/// Downloads that do not pass through the API (issue 15): `GET
/// /v1/reports/{id}/url` hands out a presigned S3 URL that plain HTTP, with
/// no token, reads the document's exact bytes from, under the report's own
/// download name; `?redirect=true` answers 307 to one; `quire get` uses it
/// and checks the SHA-256 (and `--through-api` does not); S3 refuses the URL
/// once it has expired. An API with them off says so and serves the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_presigned_url_downloads_the_document_straight_from_s3_until_it_expires() {
    let stack = TestStack::create("presign").await;
    let mut launch = stack.api();
    launch.settings.api.download_url_expiry = Some(std::time::Duration::from_millis(5000));
    let endpoint = launch.settings.s3.endpoint.clone();
    let api = launch.start_api().await;
    let _worker = stack.worker("presign-worker").spawn();
    let stream = unique("presign");
    api.send_ok(&stream, &records(&stream, 0, 250)).await;
    let id = api.cut(&stream).await;
    let status = api.wait_completed(&id, Duration::from_secs(60)).await;
    let key = status["manifest"]["key"].as_str().expect("key").to_owned();
    let stored = stack.bucket.read(&key).await.expect("the stored report");
    let digest = sha256_hex(&stored);
    assert_eq!(status["manifest"]["sha256"], digest.as_str());

    let (code, body) = api.get(&format!("/v1/reports/{id}/url")).await;
    assert_eq!(code, 200, "{body}");
    let url = body["url"].as_str().expect("url").to_owned();
    let signed_at = Instant::now();
    assert!(url.starts_with(&endpoint), "{url} is on {endpoint}");
    assert!(url.contains("X-Amz-Signature="), "{url}");
    assert_eq!(body["report_id"], id.as_str());
    assert_eq!(body["sha256"], digest.as_str());
    assert_eq!(body["bytes"], stored.len() as u64);
    assert_eq!(body["expires_in_s"], 5);
    assert!(
        body["expires_at"]
            .as_str()
            .is_some_and(|at| at.ends_with('Z')),
        "{body}"
    );

    // Plain HTTP, no token, no redirect following: the exact bytes.
    let plain = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = plain.get(&url).send().await.expect("GET the presigned URL");
    assert_eq!(response.status().as_u16(), 200);
    let header = |response: &reqwest::Response, name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(
        header(&response, "content-type").as_deref(),
        Some("application/xml")
    );
    assert_eq!(
        header(&response, "content-disposition"),
        Some(format!("attachment; filename=\"{id}.xml\""))
    );
    assert_eq!(response.bytes().await.unwrap().as_ref(), stored.as_slice());

    // ?redirect=true: a 307 to such a URL; an unknown parameter is a 400.
    let content = format!("{}/v1/reports/{id}/content", api.base);
    let response = plain
        .get(format!("{content}?redirect=true"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 307);
    assert_eq!(header(&response, "x-quire-sha256"), Some(digest.clone()));
    assert_eq!(
        header(&response, "cache-control").as_deref(),
        Some("no-store")
    );
    let location = header(&response, "location").expect("Location");
    assert!(location.starts_with(&endpoint), "{location}");
    let redirected = plain.get(&location).send().await.unwrap();
    assert_eq!(
        redirected.bytes().await.unwrap().as_ref(),
        stored.as_slice()
    );
    let response = plain
        .get(format!("{content}?redirect=yes"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let response = plain.get(format!("{content}?jump=1")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 400);

    // The CLI downloads from S3 by default, through the API when told.
    let directory = std::env::temp_dir().join(unique("quire-presign-test"));
    std::fs::create_dir_all(&directory).unwrap();
    for (options, source) in [(&[][..], "s3"), (&["--through-api"][..], "api")] {
        let output = directory.join(format!("{source}.xml"));
        let mut arguments = vec!["get", &id, "-o", output.to_str().unwrap(), "--json"];
        arguments.extend_from_slice(options);
        let (code, stdout, stderr) = quire(&api, &arguments);
        assert_eq!(code, 0, "quire get {options:?}: {stderr}");
        let summary: Value = serde_json::from_str(stdout.trim()).expect("get JSON");
        assert_eq!(summary["source"], source, "{summary}");
        assert_eq!(summary["verified"], true, "{summary}");
        assert_eq!(summary["sha256"], digest.as_str());
        assert_eq!(std::fs::read(&output).unwrap(), stored);
    }

    // Past its expiry, S3 refuses the URL.
    let expired = signed_at + Duration::from_secs(5) + Duration::from_secs(2);
    tokio::time::sleep(expired.saturating_duration_since(Instant::now())).await;
    let response = plain.get(&url).send().await.unwrap();
    assert_eq!(
        response.status().as_u16(),
        403,
        "an expired URL: {:?}",
        response.text().await
    );

    // An API with them off (another replica, so its producers are its own).
    let mut launch = stack.api();
    launch.settings.api.download_url_expiry = None;
    launch.settings.api.replica_id = "api-no-urls".into();
    let without = launch.start_api().await;
    let (code, body) = without.get(&format!("/v1/reports/{id}/url")).await;
    assert_eq!(code, 404);
    assert_eq!(body["error"]["code"], "download_urls_off");
    let response = plain
        .get(format!(
            "{}/v1/reports/{id}/content?redirect=true",
            without.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200, "served, not redirected");
    assert_eq!(response.bytes().await.unwrap().as_ref(), stored.as_slice());
    let output = directory.join("off.xml");
    let (code, stdout, stderr) = quire(
        &without,
        &["get", &id, "-o", output.to_str().unwrap(), "--json"],
    );
    assert_eq!(code, 0, "quire get: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("get JSON");
    assert_eq!(summary["source"], "api", "{summary}");
    assert_eq!(std::fs::read(&output).unwrap(), stored);
    let _ = std::fs::remove_dir_all(&directory);
}

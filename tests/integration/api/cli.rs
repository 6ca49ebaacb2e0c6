//! The `quire` CLI end to end: send (a resumed send is not doubled), cut,
//! status and get, and arrays filled up to the limits the API gives.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use quire_tests::{ApiProcess, Report, TestStack, records, unique};
use serde_json::{Value, json};

use super::{committed_bodies, ndjson, quire, sequence_numbers};

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

/// `quire define`: a bad file is refused here, naming its problem, and
/// nothing reaches the API; a good one is put and shown; the schema the CLI
/// prints for the file is, byte for byte, the one the worker stored beside
/// the stream's report and the API serves.
#[tokio::test]
async fn the_cli_checks_puts_shows_and_prints_the_schema_of_a_definition() {
    let stack = TestStack::create("api-cli-define").await;
    let api = stack.start_api().await;
    let mut worker = stack.worker("cli-define-worker").spawn();
    let directory = std::env::temp_dir().join(unique("quire-cli-define"));
    std::fs::create_dir_all(&directory).unwrap();
    let stream = unique("cli-define");

    // A total of a field that is not declared: refused before sending.
    let bad = directory.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"fields": [{"name": "seq", "type": "integer"}], "totals": ["amount"]}"#,
    )
    .unwrap();
    let (code, _, stderr) = quire(
        &api,
        &["define", "put", "-s", &stream, bad.to_str().unwrap()],
    );
    assert_eq!(code, 1, "a bad definition fails: {stderr}");
    assert!(
        stderr.contains("bad.json") && stderr.contains("amount"),
        "names the file and the problem: {stderr}"
    );
    let (status, _) = api.get(&format!("/v1/streams/{stream}/definition")).await;
    assert_eq!(status, 404, "nothing was put");
    let (code, _, stderr) = quire(&api, &["define", "show", "-s", &stream, "--json"]);
    assert_eq!(code, 1, "no definition to show: {stderr}");
    assert!(stderr.contains("definition_not_found"), "{stderr}");

    // A good one: checked only, then put, then shown.
    let good = directory.join("good.json");
    let definition = json!({
        "root": "entries", "record": "entry",
        "fields": [
            {"name": "stream", "type": "string", "required": true},
            {"name": "seq", "type": "integer", "required": true},
            {"name": "text", "type": "string", "max_length": 200}
        ],
        "undeclared": "refuse", "totals": ["seq"]
    });
    std::fs::write(&good, serde_json::to_vec(&definition).unwrap()).unwrap();
    let good_path = good.to_str().unwrap();
    let (code, stdout, stderr) = quire(
        &api,
        &[
            "define", "put", "-s", &stream, good_path, "--check", "--json",
        ],
    );
    assert_eq!(code, 0, "--check: {stderr}");
    let checked: Value = serde_json::from_str(stdout.trim()).expect("--check JSON");
    assert_eq!(checked["definition"]["v"], 4, "typed: version 4");
    let (status, _) = api.get(&format!("/v1/streams/{stream}/definition")).await;
    assert_eq!(status, 404, "--check sends nothing");
    let (code, stdout, stderr) =
        quire(&api, &["define", "put", "-s", &stream, good_path, "--json"]);
    assert_eq!(code, 0, "define put: {stderr}");
    let put: Value = serde_json::from_str(stdout.trim()).expect("put JSON");
    assert_eq!(put["definition"]["fields"], definition["fields"]);
    let (code, stdout, stderr) = quire(&api, &["define", "show", "-s", &stream]);
    assert_eq!(code, 0, "define show: {stderr}");
    let shown: Value = serde_json::from_str(&stdout).expect("show prints the definition");
    assert_eq!(shown, put["definition"]);

    // The schema, from the file and from the stream, is what the worker stores.
    let (code, from_file, stderr) = quire(&api, &["define", "schema", good_path]);
    assert_eq!(code, 0, "define schema FILE: {stderr}");
    let (code, from_stream, stderr) = quire(&api, &["define", "schema", "-s", &stream]);
    assert_eq!(code, 0, "define schema -s: {stderr}");
    assert_eq!(from_file, from_stream);
    let file = directory.join("records.ndjson");
    std::fs::write(&file, ndjson(&stream, 5)).unwrap();
    let (code, _, stderr) = quire(&api, &["send", "-s", &stream, file.to_str().unwrap()]);
    assert_eq!(code, 0, "quire send: {stderr}");
    assert_eq!(
        cut_and_fetch(&api, &stream, &directory).await,
        vec![0, 1, 2, 3, 4]
    );
    let report = std::fs::read_to_string(directory.join(format!("{stream}.xml"))).unwrap();
    let location = report
        .split("xsi:noNamespaceSchemaLocation=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("the report names its schema: {report}"));
    let name = location.rsplit('/').next().unwrap();
    let (status, served) = api
        .get_bytes(&format!("/v1/streams/{stream}/schemas/{name}"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        String::from_utf8(served).unwrap(),
        from_file,
        "the same bytes"
    );

    // An untyped definition has no schema.
    let untyped = directory.join("untyped.json");
    std::fs::write(&untyped, r#"{"root": "orders"}"#).unwrap();
    let (code, _, stderr) = quire(&api, &["define", "schema", untyped.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(stderr.contains("no schema"), "{stderr}");

    worker.kill();
    std::fs::remove_dir_all(&directory).unwrap();
}

//! Long faults and operator settings (issue 27, part 6), on the real broker
//! and S3 server: a report whose objects retention deleted answers 410, a
//! manifest left behind by a replay that cut elsewhere is never served, and
//! an `Idempotency-Key` lifetime longer than its topic keeps answers stops
//! the API at start-up.

use std::time::{Duration, Instant};

use quire_messages::layout::RETENTION_PREFIXES;
use quire_tests::{ApiProcess, RecordId, TestStack, records, sha256_hex, unique};
use serde_json::Value;

const LONG: Duration = Duration::from_secs(90);

/// `GET /v1/reports/{id}/content`: status and body.
async fn content(api: &ApiProcess, id: &str) -> (u16, Vec<u8>) {
    api.get_bytes(&format!("/v1/reports/{id}/content")).await
}

/// The error code of a JSON error body.
fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

/// Waits until report `id` answers completed; a report cut inline by a
/// rollover answers 404 until then (its id names a record, not a marker).
async fn wait_completed(api: &ApiProcess, id: &str) -> Value {
    let deadline = Instant::now() + LONG;
    loop {
        let (status, body) = api.get(&format!("/v1/reports/{id}")).await;
        if status == 200 && body["status"] == "completed" {
            return body;
        }
        assert!(
            matches!(status, 200 | 404) && Instant::now() < deadline,
            "report {id}: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The report ids a stream's list names.
async fn listed(api: &ApiProcess, stream: &str) -> Vec<String> {
    let (status, page) = api.get(&format!("/v1/streams/{stream}/reports")).await;
    assert_eq!(status, 200, "{page}");
    page["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .map(|report| report["report_id"].as_str().expect("report_id").to_owned())
        .collect()
}

/// On the code before this change the expired report answered 200
/// `"status": "pending"` and its content 409 `report_pending`, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_retention_deleted_answers_410_and_a_pending_one_stays_pending() {
    let stack = TestStack::create("expired").await;
    let api = stack.start_api().await;
    let stream = unique("expiring");
    api.send_ok(&stream, &records(&stream, 0, 5)).await;
    let expired = api.cut(&stream).await;
    let mut worker = stack.worker("w1").spawn();
    api.wait_completed(&expired, LONG).await;
    // Its event, and so its watermark, are committed (same transaction).
    stack
        .wait_for("the report's event", LONG, |observed| {
            observed.events.len() == 1
        })
        .await;
    let (code_before, _) = content(&api, &expired).await;
    assert_eq!(code_before, 200);

    // Retention: what the sweep deletes when the reports are older than
    // s3.report_retention_days (here: everything stored before now).
    let bucket = stack.bucket.handle();
    let deadline = Instant::now() + LONG;
    while !stack.bucket.list("manifests/").await.is_empty() {
        bucket
            .expire_older_than(&RETENTION_PREFIXES, Duration::ZERO)
            .await
            .expect("retention sweep");
        assert!(Instant::now() < deadline, "retention deleted nothing");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(stack.bucket.list("reports/").await.is_empty());

    let (status, body) = api.get(&format!("/v1/reports/{expired}")).await;
    assert_eq!(status, 410, "status of an expired report: {body}");
    assert_eq!(code(&body), "report_expired", "{body}");
    assert_eq!(body["error"]["report_id"], expired.as_str(), "{body}");
    let (status, bytes) = content(&api, &expired).await;
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    assert_eq!(status, 410, "content of an expired report: {body}");
    assert_eq!(code(&body), "report_expired", "{body}");

    // A report cut while no worker runs is pending, not expired.
    let (code_stop, _) = worker.terminate(Duration::from_secs(30));
    assert_eq!(code_stop, Some(0));
    api.send_ok(&stream, &records(&stream, 5, 5)).await;
    let pending = api.cut(&stream).await;
    let (status, body) = api.get(&format!("/v1/reports/{pending}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "pending", "{body}");
    let (status, bytes) = content(&api, &pending).await;
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    assert_eq!(status, 409, "{body}");
    assert_eq!(code(&body), "report_pending", "{body}");
}

/// A replay that cuts elsewhere: a worker with `rollover_records = 10`
/// stores a document of 10 records and its manifest, and dies before its
/// transaction; its successor, restarted with `rollover_records = 4`, cuts
/// the same log after 4 records and writes that document to the same key
/// (a document's key is fixed by its first offset). The first manifest
/// still names the key, with the 10-record document's size and SHA-256.
///
/// On the code before this change the API answered that manifest: 200
/// `completed` with 10 records, the content route served the 4-record
/// document under the 10-record one's `x-quire-sha256`, and the list named it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_left_by_a_replay_that_cut_elsewhere_is_never_served() {
    let stack = TestStack::create("stale-manifest").await;
    let api = stack.start_api().await;
    let stream = unique("recut");
    // One array per record, so each is a batch message of its own and the
    // replay may cut between any two (a report never splits a batch).
    let mut ids = Vec::new();
    for seq in 0..10 {
        let sent = api.send_ok(&stream, &records(&stream, seq, 1)).await;
        ids.push(RecordId::parse(&sent[0]));
    }
    let report_of = |index: usize| format!("{stream}~{}", ids[index].message());
    let (stale, first_four, next_four) = (report_of(9), report_of(3), report_of(7));

    let mut doomed = stack
        .worker("w1")
        .with(|settings| settings.worker.rollover_records = std::num::NonZero::new(10).unwrap())
        .failpoint("crash-before-commit")
        .spawn();
    assert_ne!(
        doomed.wait(LONG),
        Some(0),
        "the failpoint crashed the worker"
    );
    let (status, body) = api.get(&format!("/v1/reports/{stale}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["status"], "completed",
        "it describes its object: {body}"
    );
    assert_eq!(body["manifest"]["records"], 10, "{body}");
    let key = body["manifest"]["key"].as_str().expect("key").to_owned();

    let _successor = stack
        .worker("w1")
        .with(|settings| settings.worker.rollover_records = std::num::NonZero::new(4).unwrap())
        .spawn();
    let replayed = wait_completed(&api, &first_four).await;
    wait_completed(&api, &next_four).await;
    assert_eq!(
        replayed["manifest"]["key"].as_str(),
        Some(key.as_str()),
        "same key"
    );
    assert_eq!(replayed["manifest"]["records"], 4);
    let stored = stack
        .bucket
        .read(&key)
        .await
        .expect("the replayed document");
    assert_eq!(
        replayed["manifest"]["sha256"].as_str(),
        Some(sha256_hex(&stored).as_str())
    );
    assert!(
        stack
            .bucket
            .read(&format!("manifests/{stale}.json"))
            .await
            .is_some(),
        "the first manifest is still in the bucket"
    );

    let (status, body) = api.get(&format!("/v1/reports/{stale}")).await;
    assert_eq!(status, 410, "the stale manifest is not served: {body}");
    assert_eq!(code(&body), "report_superseded", "{body}");
    let (status, bytes) = content(&api, &stale).await;
    assert_eq!(
        status,
        410,
        "content under the stale manifest: {}",
        String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
    );
    let names = listed(&api, &stream).await;
    assert!(!names.contains(&stale), "the list names it: {names:?}");
    assert!(names.contains(&first_four), "{names:?}");

    // The replay's own report is served, byte for byte.
    let (status, bytes) = content(&api, &first_four).await;
    assert_eq!(status, 200);
    assert_eq!(bytes, stored);
}

/// On the code before this change the API started, and an
/// `Idempotency-Key` retried after the topic had deleted its answer (two
/// days) but within the TTL (here one millisecond more) published twice.
#[tokio::test]
async fn an_idempotency_ttl_longer_than_its_topics_retention_stops_the_api_at_start_up() {
    let stack = TestStack::create("idempotency-ttl").await;
    // The retention the stack's topic was created with (two days).
    let retention_ms: u64 =
        quire_queue::design_topics(&stack.topics, 1, quire_queue::DEFAULT_PARTITIONS)
            .into_iter()
            .find(|spec| spec.name == stack.topics.idempotency)
            .and_then(|spec| {
                spec.config
                    .into_iter()
                    .find_map(|(key, value)| (key == "retention.ms").then_some(value))
            })
            .expect("the idempotency topic has a retention.ms")
            .parse()
            .expect("a number");
    let mut settings = stack.settings();
    settings.api.listen = "127.0.0.1:0".into();
    settings.api.idempotency_ttl = Duration::from_millis(retention_ms + 1);
    let refused = match producer_api::Application::build(settings.clone()).await {
        Ok(_) => {
            panic!("the API started with api.idempotency_ttl_ms past the topic's retention.ms")
        }
        Err(error) => error.to_string(),
    };
    for needle in [
        "api.idempotency_ttl_ms".to_owned(),
        (retention_ms + 1).to_string(),
        format!("retention.ms = {retention_ms}"),
        stack.topics.idempotency.clone(),
    ] {
        assert!(refused.contains(&needle), "{needle:?} in: {refused}");
    }

    // As long as the topic keeps answers, it starts.
    settings.api.idempotency_ttl = Duration::from_millis(retention_ms);
    let started = producer_api::Application::build(settings).await;
    assert!(
        started.is_ok(),
        "{:?}",
        started.err().map(|error| error.to_string())
    );
}

//! A topic deleted and created again (issue 27, part 2): a recreated records
//! topic is a new log, never an old one; a recreated watermark topic is
//! noticed and said. Against the real broker and S3 server.

use std::time::{Duration, Instant};

use quire_tests::{TestStack, partition_of, records, sha256_hex, worker_metric};
use serde_json::Value;

const LONG: Duration = Duration::from_secs(120);

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Deletes `name` and creates it again as the design says, once Kafka has
/// forgotten it (deletion is asynchronous).
async fn recreate(stack: &TestStack, name: &str) {
    let spec = quire_queue::design_topics(&stack.topics, 1, quire_queue::DEFAULT_PARTITIONS)
        .into_iter()
        .find(|spec| spec.name == name)
        .expect("a design topic");
    let before = quire_queue::describe_topic(&stack.kafka, name)
        .await
        .expect("the topic exists")
        .id;
    quire_queue::delete_topics(&stack.kafka, &[name])
        .await
        .expect("delete the topic");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let created = quire_queue::ensure_topics(&stack.kafka, std::slice::from_ref(&spec)).await;
        if created.is_ok()
            && let Ok(now) = quire_queue::describe_topic(&stack.kafka, name).await
            && now.id != before
            && now.partitions == spec.partitions
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} was not created again: {created:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_records_topic_created_again_is_a_new_log_and_no_cut_is_answered_with_an_old_report() {
    let stack = TestStack::create("recreate-records").await;
    let api = stack.start_api().await;
    let mut worker = stack.worker("w1").spawn();
    let stream = stream_name("orders");
    api.send_ok(&stream, &records(&stream, 0, 40)).await;
    let old_id = api.cut(&stream).await;
    let old_status = api.wait_completed(&old_id, LONG).await;
    let old_key = old_status["manifest"]["key"].as_str().unwrap().to_owned();
    let (_, old_content) = api
        .get_bytes(&format!("/v1/reports/{old_id}/content"))
        .await;
    // A cut issued in the old log and never completed there.
    worker.terminate(Duration::from_secs(30));
    let never_completed = api.cut(&stream).await;
    drop(api);

    recreate(&stack, &stack.topics.records).await;

    let api = stack.start_api().await;
    let (mut worker, worker_metrics) = stack.worker("w1").spawn_monitored();
    // As many records as before, so the new log reaches the old offsets.
    api.send_ok(&stream, &records(&stream, 40, 40)).await;
    let new_id = api.cut(&stream).await;
    assert_ne!(
        new_id, old_id,
        "a new log's cut never has an old report's id"
    );
    assert_eq!(
        new_id.matches('~').count(),
        2,
        "a later log's report ids carry its tag: {new_id}"
    );
    let new_status = api.wait_completed(&new_id, LONG).await;
    let new_key = new_status["manifest"]["key"].as_str().unwrap().to_owned();
    assert_ne!(
        new_key, old_key,
        "no object of the old log is written again"
    );
    assert_eq!(
        new_status["manifest"]["records"].as_u64(),
        Some(40),
        "the new log's records are reported, not skipped by the old log's watermark"
    );
    let (code, new_content) = api
        .get_bytes(&format!("/v1/reports/{new_id}/content"))
        .await;
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&new_content);
    assert!(text.contains("<seq>40</seq>") && text.contains("<seq>79</seq>"));
    assert!(!text.contains("<seq>0</seq>"), "nothing of the old log");

    // The old report still answers with its own content, untouched.
    let (code, again) = api
        .get_bytes(&format!("/v1/reports/{old_id}/content"))
        .await;
    assert_eq!(code, 200);
    assert_eq!(sha256_hex(&again), sha256_hex(&old_content));
    // A cut of the old log that never completed is gone with its log.
    let (code, body) = api.get(&format!("/v1/reports/{never_completed}")).await;
    assert_eq!(code, 410, "{body}");
    assert_eq!(body["error"]["code"], "report_log_gone", "{body}");

    let stale = worker_metric(&worker_metrics, "quire_worker_stale_watermarks_total").await;
    assert!(
        stale.is_some_and(|count| count >= 1.0),
        "the old log's watermark was ignored, and counted: {stale:?}"
    );
    assert_eq!(worker.exited(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_topic_created_again_is_noticed_and_its_reports_announced_again_are_said() {
    let stack = TestStack::create("recreate-watermarks").await;
    let api = stack.start_api().await;
    let (mut worker, _) = stack.worker("w1").spawn_monitored();
    // Two streams on one partition: the open document of the first holds the
    // committed offset below the second's completed report.
    let open = stream_name("open");
    let target = partition_of(&open, 12);
    let cut = (0..)
        .map(|_| stream_name("cut"))
        .find(|candidate| partition_of(candidate, 12) == target)
        .unwrap();
    api.send_ok(&open, &records(&open, 0, 10)).await;
    api.send_ok(&cut, &records(&cut, 0, 10)).await;
    let cut_id = api.cut(&cut).await;
    let first = api.wait_completed(&cut_id, LONG).await;
    stack
        .wait_for("the report's event", LONG, |observed| {
            observed
                .events
                .iter()
                .any(|event| event["report_id"] == cut_id.as_str())
        })
        .await;
    worker.terminate(Duration::from_secs(30));

    recreate(&stack, &stack.topics.watermarks).await;

    let (mut worker, worker_metrics) = stack.worker("w1").spawn_monitored();
    let deadline = Instant::now() + LONG;
    loop {
        let lost = worker_metric(&worker_metrics, "quire_worker_watermarks_lost_total").await;
        if lost.is_some_and(|count| count >= 1.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lost watermarks were not noticed: {lost:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // As the docs say: the report after the committed offset is rendered
    // again, to the same key and bytes, and announced again.
    let open_id = api.cut(&open).await;
    api.wait_completed(&open_id, LONG).await;
    let observed = stack
        .wait_for("the report announced again", LONG, |observed| {
            observed
                .events
                .iter()
                .filter(|event| event["report_id"] == cut_id.as_str())
                .count()
                >= 2
        })
        .await;
    let announced: Vec<&Value> = observed
        .events
        .iter()
        .filter(|event| event["report_id"] == cut_id.as_str())
        .collect();
    assert_eq!(announced.len(), 2, "announced once again, not more");
    assert!(
        announced
            .iter()
            .all(|event| event["sha256"] == first["manifest"]["sha256"]),
        "the same bytes"
    );
    assert_eq!(
        observed.sequence_numbers(&open),
        (0..10).collect::<Vec<u64>>()
    );
    assert_eq!(
        observed.sequence_numbers(&cut),
        (0..10).collect::<Vec<u64>>()
    );
    assert_eq!(worker.exited(), None);
}

//! The pipeline end to end: the producer API and report generators as child
//! processes of the real binaries, against the real Kafka and S3 server.

use std::collections::BTreeMap;
use std::time::Duration;

use quire_config::Settings;
use quire_tests::s3::TestBucket;
use quire_tests::{Observed, RecordId, TestStack, partition_of, records};
use quire_tests::{TestTopic, unique};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// `count` reports of `stream` in what is observed.
fn reports_of(observed: &Observed, stream: &str) -> usize {
    observed
        .reports
        .values()
        .filter(|report| report.stream() == stream)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_arrays_then_a_cut_make_one_report_with_exactly_those_records() {
    let stack = TestStack::create("e2e-basic").await;
    let api = stack.start_api().await;
    let _worker = stack.worker("w1").spawn();
    let stream = stream_name("orders");
    let mut ids = Vec::new();
    for array in 0..3 {
        ids.extend(
            api.send_ok(&stream, &records(&stream, array * 50, 50))
                .await,
        );
    }
    assert_eq!(ids.len(), 150, "one id per record");
    let distinct: std::collections::BTreeSet<RecordId> =
        ids.iter().map(|id| RecordId::parse(id)).collect();
    assert_eq!(distinct.len(), 150, "each record an id of its own");
    let report_id = api.cut(&stream).await;
    let status = api.wait_completed(&report_id, LONG).await;
    let manifest = &status["manifest"];

    let (code, content) = api
        .get_bytes(&format!("/v1/reports/{report_id}/content"))
        .await;
    assert_eq!(code, 200);
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(&content));
    assert_eq!(
        manifest["sha256"].as_str(),
        Some(digest.as_str()),
        "manifest SHA-256 matches the content"
    );
    assert_eq!(manifest["bytes"].as_u64(), Some(content.len() as u64));
    assert_eq!(manifest["records"].as_u64(), Some(150));

    let observed = stack.wait_for("the report's event", LONG, |_| true).await;
    let sequence = observed.sequence_numbers(&stream);
    assert_eq!(
        sequence,
        (0..150).collect::<Vec<u64>>(),
        "exactly those records, in order"
    );
    let report = &observed.reports[&report_id];
    let first = &report.records()[0];
    assert_eq!(
        first["text"],
        format!("record 0 of {stream} <&> \"quoted\""),
        "text round-trips through XML escaping"
    );
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..150).collect())]));

    // An id that was never issued is 404 (a record's batch message is not
    // a marker), a malformed one 400.
    let batch = quire_tests::RecordId::parse(&ids[0]).message();
    let (code, _) = api.get(&format!("/v1/reports/{stream}~{batch}")).await;
    assert_eq!(code, 404);
    let (code, _) = api.get("/v1/reports/not-an-id").await;
    assert_eq!(code, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_with_one_bad_record_is_refused_and_none_of_it_is_reported() {
    let stack = TestStack::create("e2e-bad").await;
    let api = stack.start_api().await;
    let _worker = stack.worker("w1").spawn();
    let stream = stream_name("bad");
    let mut array = records(&stream, 0, 3);
    array[1] = json!({"stream": stream, "seq": 1, "text": "bell \u{0007} is not XML"});
    let (status, body) = api.send(&stream, &array).await;
    assert_eq!(status, 422, "{body}");
    let message = body.to_string();
    assert!(
        message.contains("U+0007"),
        "the error names the character: {message}"
    );

    let report_id = api.cut(&stream).await;
    let status = api.wait_completed(&report_id, LONG).await;
    assert_eq!(
        status["manifest"]["records"].as_u64(),
        Some(0),
        "none of the refused array was published"
    );
    let observed = stack.wait_for("the report's event", LONG, |_| true).await;
    assert!(observed.sequence_numbers(&stream).is_empty());
    assert!(observed.dead_letters.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streams_on_one_partition_cut_at_different_moments_keep_their_own_records() {
    let stack = TestStack::create("e2e-interleave").await;
    let api = stack.start_api().await;
    let _worker = stack.worker("w1").spawn();
    let first = stream_name("left");
    let target = partition_of(&first, 12);
    let second = (0..)
        .map(|_| stream_name("right"))
        .find(|candidate| partition_of(candidate, 12) == target)
        .unwrap();

    let mut sent: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for round in 0..4u64 {
        for stream in [&first, &second] {
            let ids = api.send_ok(stream, &records(stream, round * 10, 10)).await;
            assert!(
                ids.iter()
                    .all(|id| RecordId::parse(id).partition == target as i32),
                "both streams on partition {target}: {ids:?}"
            );
            sent.entry(stream.clone())
                .or_default()
                .extend(round * 10..round * 10 + 10);
        }
        if round == 1 {
            api.cut(&first).await;
        }
    }
    api.cut(&first).await;
    api.cut(&second).await;
    let observed = stack
        .wait_for("three reports", LONG, |observed| {
            reports_of(observed, &first) == 2 && reports_of(observed, &second) == 1
        })
        .await;
    for report in observed.reports.values() {
        let stream = report.stream();
        assert!(
            report
                .records()
                .iter()
                .all(|record| record["stream"] == stream),
            "a report holds another stream's record"
        );
    }
    assert_eq!(
        observed.sequence_numbers(&first),
        (0..40).collect::<Vec<u64>>()
    );
    assert_eq!(
        observed.sequence_numbers(&second),
        (0..40).collect::<Vec<u64>>()
    );
    observed.assert_exactly_once(&sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollover_by_records_and_by_age_without_a_cut_and_an_empty_cut() {
    let stack = TestStack::create("e2e-rollover").await;
    let api = stack.start_api().await;
    let _worker = stack
        .worker("w1")
        .with(|settings| {
            settings.worker.rollover_records = std::num::NonZero::new(10).unwrap();
            settings.worker.rollover_age = Duration::from_millis(3000);
        })
        .spawn();
    let stream = stream_name("roll");
    // Past the count: the document ends at the batch message that brings it
    // to 10 records without any cut request (decided inline: no marker, the
    // id names that message). A request is one batch here, and a document
    // never ends inside a batch: three requests put the count between the
    // second and the third.
    let first_batch = api.send_ok(&stream, &records(&stream, 0, 5)).await;
    let second_batch = api.send_ok(&stream, &records(&stream, 5, 5)).await;
    api.send_ok(&stream, &records(&stream, 10, 2)).await;
    let observed = stack
        .wait_for("a report by record count", LONG, |observed| {
            observed
                .reports
                .values()
                .any(|report| report.manifest["trigger"] == "records")
        })
        .await;
    let by_count = observed
        .reports
        .values()
        .find(|report| report.manifest["trigger"] == "records")
        .unwrap();
    assert_eq!(by_count.manifest["records"], 10);
    let seqs = |report: &quire_tests::Report| -> Vec<u64> {
        report
            .records()
            .iter()
            .map(|record| record["seq"].parse().unwrap())
            .collect()
    };
    assert_eq!(
        seqs(by_count),
        (0..10).collect::<Vec<u64>>(),
        "the first ten records"
    );
    // The rest stays open until its age ends it: a report seen beside the
    // first (a slow observer, 3 s later) holds just those two, cut by age.
    for report in observed.reports.values() {
        if report.manifest["trigger"] != "records" {
            assert_eq!(
                (report.manifest["trigger"].as_str(), seqs(report)),
                (Some("age"), vec![10, 11]),
                "the rest is reported by age alone"
            );
        }
    }
    let last = by_count.manifest["last_offset"].as_i64().unwrap();
    let first = by_count.manifest["first_offset"].as_i64().unwrap();
    assert_eq!(
        (first, last),
        (
            quire_tests::RecordId::parse(&first_batch[0]).offset,
            quire_tests::RecordId::parse(&second_batch[9 - 5]).offset
        ),
        "from the first batch to the one that reaches the count, no marker between"
    );
    // Under the count: the age cuts it.
    api.send_ok(&stream, &records(&stream, 12, 5)).await;
    let observed = stack
        .wait_for("a report by age", LONG, |observed| {
            observed.sequence_numbers(&stream).len() == 17
        })
        .await;
    let triggers: Vec<String> = observed
        .reports
        .values()
        .map(|report| report.manifest["trigger"].as_str().unwrap().to_owned())
        .collect();
    assert!(triggers.contains(&"age".to_owned()), "{triggers:?}");
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..17).collect())]));

    // Nothing new: a cut gives an empty report.
    let report_id = api.cut(&stream).await;
    let status = api.wait_completed(&report_id, LONG).await;
    assert_eq!(status["manifest"]["records"].as_u64(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_applies_from_the_next_document_and_a_replay_renders_the_same_bytes() {
    let stack = TestStack::create("e2e-definition").await;
    let api = stack.start_api().await;
    let worker = stack.worker("w1").spawn();
    let stream = stream_name("defs");
    api.send_ok(&stream, &records(&stream, 0, 5)).await;
    // Changed while the first document is open: it applies to the next one.
    api.put_definition(&stream, json!({"root": "orders", "record": "order", "attributes": ["seq"], "renames": {"text": "body"}}))
        .await;
    api.send_ok(&stream, &records(&stream, 5, 5)).await;
    let first_id = api.cut(&stream).await;
    api.send_ok(&stream, &records(&stream, 10, 5)).await;
    let second_id = api.cut(&stream).await;
    api.wait_completed(&second_id, LONG).await;
    let observed = stack.wait_for("both events", LONG, |_| true).await;
    let first = std::str::from_utf8(&observed.reports[&first_id].document)
        .unwrap()
        .to_owned();
    let second = std::str::from_utf8(&observed.reports[&second_id].document)
        .unwrap()
        .to_owned();
    assert!(
        first.contains("<report ") && first.contains("<record>") && first.contains("<text>"),
        "{first}"
    );
    assert!(
        second.contains("<orders ")
            && second.contains("<order seq=\"10\">")
            && second.contains("<body>"),
        "{second}"
    );
    drop(worker);

    // A replay by another group into another bucket, from the same log.
    let replay_bucket = TestBucket::create("e2e-replay").await;
    let watermark_settings: Vec<(&str, &str)> = std::iter::once(("cleanup.policy", "compact"))
        .chain(quire_queue::WATERMARK_COMPACTION.iter().copied())
        .collect();
    let replay_watermarks =
        TestTopic::create_with("replay-watermarks", 12, &watermark_settings).await;
    let replay_events = TestTopic::create("replay-events", 3).await;
    let replay_group = unique("replay");
    let _replayer = stack
        .worker("replayer")
        .with(|settings| {
            settings.s3.bucket = replay_bucket.name.clone();
            settings.kafka.topics.watermarks = replay_watermarks.name.clone();
            settings.kafka.topics.report_events = replay_events.name.clone();
            settings.worker.group_id = replay_group.clone();
        })
        .spawn();
    for (id, report) in [
        (&first_id, &observed.reports[&first_id]),
        (&second_id, &observed.reports[&second_id]),
    ] {
        let key = report.manifest["key"].as_str().unwrap();
        let deadline = std::time::Instant::now() + LONG;
        let replayed = loop {
            if let Some(bytes) = replay_bucket.read(&format!("manifests/{id}.json")).await {
                let _ = bytes;
                break replay_bucket.read(key).await.expect("replayed document");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "replay did not render {id}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        assert_eq!(
            replayed, report.document,
            "replay of {id} rendered other bytes"
        );
    }
}

/// Sends `rounds` arrays of `per_array` records to each stream, pausing
/// between rounds so workers see the stream arrive over time; records the
/// sequence numbers sent.
async fn send_rounds(
    api: &quire_tests::ApiProcess,
    streams: &[String],
    sent: &mut BTreeMap<String, Vec<u64>>,
    rounds: u64,
    per_array: u64,
) {
    for _ in 0..rounds {
        for stream in streams {
            let next = sent.get(stream).map_or(0, |sequence| sequence.len() as u64);
            api.send_ok(stream, &records(stream, next, per_array)).await;
            sent.entry(stream.clone())
                .or_default()
                .extend(next..next + per_array);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// Cuts every stream and waits until every record sent is reported.
async fn cut_all_and_settle(
    stack: &TestStack,
    api: &quire_tests::ApiProcess,
    sent: &BTreeMap<String, Vec<u64>>,
) -> Observed {
    for stream in sent.keys() {
        api.cut(stream).await;
    }
    stack
        .wait_for(
            "every record reported",
            Duration::from_secs(120),
            |observed| {
                sent.iter().all(|(stream, sequence)| {
                    observed.sequence_numbers(stream).len() >= sequence.len()
                })
            },
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_is_taken_over_exactly_once() {
    let stack = TestStack::create("e2e-crash").await;
    let api = stack.start_api().await;
    let streams: Vec<String> = (0..3).map(|_| stream_name("crash")).collect();
    let rollover = |settings: &mut Settings| {
        settings.worker.rollover_records = std::num::NonZero::new(40).unwrap()
    };
    let mut sent = BTreeMap::new();

    let mut worker = stack.worker("w1").with(rollover).spawn();
    send_rounds(&api, &streams, &mut sent, 6, 15).await;
    // Some reports are complete and documents are open when it dies.
    stack
        .wait_for("a first report", LONG, |observed| {
            !observed.reports.is_empty()
        })
        .await;
    send_rounds(&api, &streams, &mut sent, 2, 7).await;
    worker.kill();
    let before: BTreeMap<String, Vec<u8>> = stack
        .observe()
        .await
        .reports
        .into_iter()
        .map(|(id, report)| (id, report.document))
        .collect();

    send_rounds(&api, &streams, &mut sent, 3, 9).await;
    let _successor = stack.worker("w1").with(rollover).spawn();
    let observed = cut_all_and_settle(&stack, &api, &sent).await;
    observed.assert_exactly_once(&sent);
    for (id, document) in before {
        assert_eq!(
            observed.reports[&id].document, document,
            "report {id} changed its bytes"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_between_completing_an_object_and_committing_is_taken_over_exactly_once()
{
    let stack = TestStack::create("e2e-failpoint").await;
    let api = stack.start_api().await;
    let streams: Vec<String> = (0..2).map(|_| stream_name("fail")).collect();
    let mut sent = BTreeMap::new();
    send_rounds(&api, &streams, &mut sent, 3, 10).await;
    api.cut(&streams[0]).await;

    let mut doomed = stack.worker("w1").failpoint("crash-before-commit").spawn();
    // It completes the report's object and manifest, then aborts before the
    // transaction that would announce it.
    let code = doomed.wait(LONG);
    assert_ne!(code, Some(0), "the failpoint crashed the worker");
    let orphan = stack.observe().await;
    assert_eq!(
        orphan.reports.len(),
        1,
        "the object was completed before the crash"
    );
    assert!(orphan.events.is_empty(), "but its event was not committed");
    let (orphan_id, orphan_report) = orphan.reports.into_iter().next().unwrap();

    let _successor = stack.worker("w1").spawn();
    send_rounds(&api, &streams, &mut sent, 2, 5).await;
    let observed = cut_all_and_settle(&stack, &api, &sent).await;
    observed.assert_exactly_once(&sent);
    assert_eq!(
        observed.reports[&orphan_id].document, orphan_report.document,
        "the re-render changed the bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joining_and_one_leaving_mid_run_keep_exactly_once() {
    let stack = TestStack::create("e2e-scale").await;
    let api = stack.start_api().await;
    let streams: Vec<String> = (0..6).map(|_| stream_name("scale")).collect();
    let rollover = |settings: &mut Settings| {
        settings.worker.rollover_records = std::num::NonZero::new(30).unwrap()
    };
    let mut sent = BTreeMap::new();

    let mut first = stack.worker("w1").with(rollover).spawn();
    send_rounds(&api, &streams, &mut sent, 3, 8).await;
    let _second = stack.worker("w2").with(rollover).spawn();
    send_rounds(&api, &streams, &mut sent, 4, 8).await;
    let (code, _) = first.terminate(Duration::from_secs(30));
    assert_eq!(code, Some(0));
    send_rounds(&api, &streams, &mut sent, 3, 8).await;
    let observed = cut_all_and_settle(&stack, &api, &sent).await;
    observed.assert_exactly_once(&sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_within_the_grace_period_and_drain_reports_everything_queued() {
    let stack = TestStack::create("e2e-stop").await;
    let api = stack.start_api().await;
    let streams: Vec<String> = (0..3).map(|_| stream_name("stop")).collect();
    let mut sent = BTreeMap::new();
    let grace = Duration::from_secs(10);

    let mut serving = stack
        .worker("w1")
        .with(|settings| settings.worker.shutdown_grace = Duration::from_millis(10_000))
        .spawn();
    send_rounds(&api, &streams, &mut sent, 3, 10).await;
    api.cut(&streams[0]).await;
    stack
        .wait_for("the first report", LONG, |observed| {
            !observed.reports.is_empty()
        })
        .await;
    let (code, took) = serving.terminate(grace + Duration::from_secs(5));
    assert_eq!(code, Some(0), "SIGTERM exits 0");
    assert!(
        took < grace,
        "SIGTERM took {took:?}, longer than the grace period"
    );

    // Queued while no worker runs; --drain reports all of it and exits 0.
    send_rounds(&api, &streams, &mut sent, 2, 10).await;
    let mut drainer = stack.worker("w1").drain().spawn();
    assert_eq!(
        drainer.wait(Duration::from_secs(120)),
        Some(0),
        "--drain exits 0"
    );
    let observed = stack.wait_for("settled", LONG, |_| true).await;
    observed.assert_exactly_once(&sent);
}

//! Operator actions on the partitions (issue 27, part 1): an operator's bare
//! `kafka-topics --alter`, and quire's own growth procedure, while producers
//! send to many streams and cut them, against the real broker and S3.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quire_tests::{TestStack, partition_of, records};
use tokio_util::sync::CancellationToken;

const LONG: Duration = Duration::from_secs(180);

/// What the producers were told, per stream.
#[derive(Debug, Default)]
struct Sent {
    /// Sequence numbers answered 200.
    accepted: Vec<u64>,
    /// (partition, answered at) of each accepted array.
    arrays: Vec<(u32, Instant)>,
    /// (report id, records accepted before the cut was sent).
    cuts: Vec<(String, u64)>,
    /// Answers 503 `partitions_moving`.
    frozen: usize,
    /// Any other refusal (never expected).
    refused: Vec<String>,
}

type Ledger = Arc<Mutex<BTreeMap<String, Sent>>>;

/// Streams `prefix-N`, `count` of them.
fn streams(prefix: &str, count: usize) -> Vec<String> {
    let run = &uuid::Uuid::new_v4().simple().to_string()[..6];
    (0..count).map(|n| format!("{prefix}-{run}-{n}")).collect()
}

/// Sends arrays of 10 records to `stream` until `stop`, cutting every
/// `cut_every` arrays, as a careful producer would: a 503 or 429 is retried
/// with the same `Idempotency-Key` after `Retry-After`.
async fn produce(
    api: Arc<quire_tests::services::ApiProcess>,
    stream: String,
    ledger: Ledger,
    cut_every: u64,
    stop: CancellationToken,
) {
    let mut next = 0u64;
    let mut arrays = 0u64;
    while !stop.is_cancelled() {
        let array = records(&stream, next, 10);
        let attempts = api
            .send_until_accepted(&stream, &array, Duration::from_secs(15), LONG)
            .await;
        let frozen = attempts
            .iter()
            .filter(|attempt| {
                attempt.outcome.as_ref().is_ok_and(|answer| {
                    answer.status == 503 && answer.body["error"]["code"] == "partitions_moving"
                })
            })
            .count();
        let last = attempts.last().expect("one attempt at least");
        let accepted = {
            let mut entries = ledger.lock().unwrap();
            let sent = entries.entry(stream.clone()).or_default();
            sent.frozen += frozen;
            match &last.outcome {
                Ok(answer) if answer.status == 200 => {
                    let first_id = quire_tests::RecordId::all_of(&answer.body)[0];
                    let partition = u32::try_from(first_id.partition).expect("a partition");
                    sent.accepted.extend(next..next + 10);
                    sent.arrays.push((partition, last.answered_at));
                    true
                }
                other => {
                    sent.refused.push(format!("{other:?}"));
                    false
                }
            }
        };
        if !accepted {
            return;
        }
        next += 10;
        arrays += 1;
        if arrays.is_multiple_of(cut_every) {
            let id = api.cut_until_accepted(&stream, LONG).await;
            ledger
                .lock()
                .unwrap()
                .entry(stream.clone())
                .or_default()
                .cuts
                .push((id, next));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every record answered 200 is in exactly one report; every cut id
/// completes, and every record accepted before a cut is in that report or
/// an earlier one (by the log's append time of their cuts).
async fn assert_reported(
    stack: &TestStack,
    api: &quire_tests::services::ApiProcess,
    ledger: &Ledger,
) -> quire_tests::Observed {
    // Each cut: (stream, report id, records accepted before it was sent).
    type Cuts = Vec<(String, String, u64)>;
    let (expected, cuts): (BTreeMap<String, Vec<u64>>, Cuts) = {
        let ledger = ledger.lock().unwrap();
        let expected = ledger
            .iter()
            .map(|(stream, sent)| (stream.clone(), sent.accepted.clone()))
            .collect();
        let cuts = ledger
            .iter()
            .flat_map(|(stream, sent)| {
                sent.cuts
                    .iter()
                    .map(|(id, bound)| (stream.clone(), id.clone(), *bound))
            })
            .collect();
        (expected, cuts)
    };
    for (_, id, _) in &cuts {
        api.wait_completed(id, LONG).await;
    }
    let observed = stack
        .wait_for("every accepted record reported", LONG, |observed| {
            expected
                .iter()
                .all(|(stream, seqs)| observed.sequence_numbers(stream).len() >= seqs.len())
        })
        .await;
    observed.assert_exactly_once(&expected);
    // Where each record is, and when its report was cut (log time).
    let mut cut_time_of_record: BTreeMap<(String, u64), i64> = BTreeMap::new();
    for report in observed.reports.values() {
        let cut_time = report.manifest["cut_time_ms"].as_i64().unwrap_or(i64::MAX);
        for record in report.records() {
            let seq: u64 = record["seq"].parse().unwrap();
            cut_time_of_record.insert((report.stream().to_owned(), seq), cut_time);
        }
    }
    for (stream, id, bound) in &cuts {
        let cut = &observed.reports[id];
        let cut_time = cut.manifest["cut_time_ms"]
            .as_i64()
            .expect("a cut's log time");
        for seq in 0..*bound {
            let reported_at = cut_time_of_record[&(stream.clone(), seq)];
            assert!(
                reported_at <= cut_time,
                "record {seq} of {stream}, accepted before cut {id}, is in a report cut after it"
            );
        }
    }
    observed
}

/// Waits until the worker's `/metrics` has `line`.
async fn wait_for_metric(base: &str, line: &str, limit: Duration) {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + limit;
    loop {
        let text = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("worker metrics")
            .text()
            .await
            .unwrap();
        if text.lines().any(|found| found == line) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the worker's metrics have no {line:?}: {}",
            text.lines()
                .filter(|found| found.contains("partitions") && !found.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bare_alter_of_the_records_topic_moves_no_stream_and_stops_nothing() {
    let stack = TestStack::create("alter").await;
    let api = Arc::new(stack.start_api().await);
    let (mut worker, worker_metrics) = stack.worker("w1").spawn_monitored();
    let ledger: Ledger = Arc::default();
    let stop = CancellationToken::new();
    let names = streams("alter", 24);
    let producers: Vec<_> = names
        .iter()
        .map(|stream| {
            tokio::spawn(produce(
                Arc::clone(&api),
                stream.clone(),
                Arc::clone(&ledger),
                10,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The operator's --alter, while everything runs.
    let altered = Instant::now();
    quire_queue::grow_topic(&stack.kafka, &stack.topics.records, 16)
        .await
        .expect("alter the records topic");
    // The running worker sees it within seconds, is given the new
    // partitions by its group, and holds them without serving them.
    wait_for_metric(
        &worker_metrics,
        "quire_worker_records_topic_partitions 16",
        Duration::from_secs(20),
    )
    .await;
    wait_for_metric(
        &worker_metrics,
        "quire_worker_unserved_partitions 4",
        Duration::from_secs(30),
    )
    .await;
    eprintln!(
        "alter: held the 4 new partitions {:.1} s after the --alter",
        altered.elapsed().as_secs_f64()
    );
    // A rolling restart: an API and a worker started after the --alter
    // serve too.
    let api_after = Arc::new(
        stack
            .api()
            .try_start_api(Duration::from_secs(60))
            .await
            .expect("an API started after the --alter serves"),
    );
    worker.terminate(Duration::from_secs(30));
    let mut worker = stack.worker("w1").spawn();
    let late: Vec<_> = names
        .iter()
        .take(12)
        .map(|stream| {
            tokio::spawn(produce(
                Arc::clone(&api_after),
                format!("{stream}-late"),
                Arc::clone(&ledger),
                10,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.cancel();
    for producer in producers.into_iter().chain(late) {
        producer.await.expect("producer task");
    }
    assert_eq!(worker.exited(), None, "the worker keeps running");
    {
        let ledger = ledger.lock().unwrap();
        for (stream, sent) in ledger.iter() {
            assert!(sent.refused.is_empty(), "{stream}: {:?}", sent.refused);
            assert_eq!(
                sent.frozen, 0,
                "{stream}: nothing moves without the procedure"
            );
            let home = partition_of(stream, 12);
            assert!(
                sent.arrays.iter().all(|(partition, _)| *partition == home),
                "{stream} left partition {home}: {:?}",
                sent.arrays
            );
        }
    }
    let bounds: Vec<(String, u64)> = ledger
        .lock()
        .unwrap()
        .iter()
        .map(|(stream, sent)| (stream.clone(), sent.accepted.len() as u64))
        .collect();
    for (stream, bound) in bounds {
        let id = api_after.cut_until_accepted(&stream, LONG).await;
        ledger
            .lock()
            .unwrap()
            .get_mut(&stream)
            .unwrap()
            .cuts
            .push((id, bound));
    }
    assert_reported(&stack, &api_after, &ledger).await;
    assert_eq!(worker.exited(), None, "the worker keeps running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn growing_12_to_16_partitions_loses_and_splits_no_report_and_a_replay_agrees() {
    let stack = TestStack::create("grow").await;
    let api = Arc::new(stack.start_api().await);
    let mut worker_one = stack.worker("w1").spawn();
    let mut worker_two = stack.worker("w2").spawn();
    let ledger: Ledger = Arc::default();
    let stop = CancellationToken::new();
    let names = streams("grow", 32);
    let moving: BTreeSet<String> = names
        .iter()
        .filter(|stream| partition_of(stream, 12) != partition_of(stream, 16))
        .cloned()
        .collect();
    assert!(
        moving.len() >= 8 && moving.len() < names.len(),
        "both kinds of stream: {} of {} move",
        moving.len(),
        names.len()
    );
    // A windowed stream and a renamed one move too, with their definitions.
    let defined = moving.iter().next().unwrap().clone();
    api.put_definition(
        &defined,
        serde_json::json!({"root": "moved-orders", "record": "order"}),
    )
    .await;
    let producers: Vec<_> = names
        .iter()
        .map(|stream| {
            tokio::spawn(produce(
                Arc::clone(&api),
                stream.clone(),
                Arc::clone(&ledger),
                6,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(4)).await;

    let started = Instant::now();
    let grow = stack
        .worker("grow")
        .command()
        .args(["partitions", "grow", "--to", "16"])
        .output();
    let output = tokio::task::spawn_blocking(move || grow)
        .await
        .unwrap()
        .expect("run report-generator partitions grow");
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    eprintln!("{printed}{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "the growth failed: {printed}");
    let switched_at = Instant::now();
    eprintln!("growth: {:.1} s", started.elapsed().as_secs_f64());
    assert!(printed.contains("switched"), "{printed}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.cancel();
    for producer in producers {
        producer.await.expect("producer task");
    }
    assert_eq!(worker_one.exited(), None, "worker w1 keeps running");
    assert_eq!(worker_two.exited(), None, "worker w2 keeps running");

    {
        let ledger = ledger.lock().unwrap();
        for (stream, sent) in ledger.iter() {
            assert!(sent.refused.is_empty(), "{stream}: {:?}", sent.refused);
            let (old, new) = (partition_of(stream, 12), partition_of(stream, 16));
            if moving.contains(stream) {
                assert!(
                    sent.arrays
                        .iter()
                        .all(|(partition, _)| *partition == old || *partition == new),
                    "{stream}: {:?}",
                    sent.arrays
                );
                assert!(
                    sent.arrays
                        .iter()
                        .filter(|(_, at)| *at > switched_at)
                        .all(|(partition, _)| *partition == new),
                    "{stream} is on {new} after the switch"
                );
                // Once on its new partition, never back.
                let first_new = sent.arrays.iter().position(|(p, _)| *p == new);
                if let Some(first_new) = first_new {
                    assert!(
                        sent.arrays[first_new..].iter().all(|(p, _)| *p == new),
                        "{stream} went back: {:?}",
                        sent.arrays
                    );
                }
            } else {
                assert_eq!(sent.frozen, 0, "{stream} does not move and is never frozen");
                assert!(sent.arrays.iter().all(|(partition, _)| *partition == old));
            }
        }
        let frozen: usize = ledger.values().map(|sent| sent.frozen).sum();
        assert!(
            frozen > 0,
            "the moving streams were frozen during the growth"
        );
    }
    // A last cut of every stream, on its partition now.
    let bounds: Vec<(String, u64)> = ledger
        .lock()
        .unwrap()
        .iter()
        .map(|(stream, sent)| (stream.clone(), sent.accepted.len() as u64))
        .collect();
    for (stream, bound) in bounds {
        let id = api.cut_until_accepted(&stream, LONG).await;
        if moving.contains(&stream) {
            let partition = partition_of(&stream, 16);
            assert!(
                id.contains(&format!("~{partition}-")),
                "{stream}'s cut {id} is on its new partition {partition}"
            );
        }
        ledger
            .lock()
            .unwrap()
            .get_mut(&stream)
            .unwrap()
            .cuts
            .push((id, bound));
    }
    let observed = assert_reported(&stack, &api, &ledger).await;
    assert_eq!(observed.pending_uploads, 0, "no upload left pending");
    let moved_reports = observed
        .reports
        .values()
        .filter(|report| report.manifest["trigger"] == "move")
        .count();
    eprintln!(
        "growth: {} streams, {} moved, {} reports ({moved_reports} cut by the move), {} records",
        names.len(),
        moving.len(),
        observed.reports.len(),
        ledger
            .lock()
            .unwrap()
            .values()
            .map(|sent| sent.accepted.len())
            .sum::<usize>()
    );
    // The definition went with its stream.
    let after = observed
        .reports
        .values()
        .filter(|report| report.stream() == defined)
        .filter(|report| {
            report.manifest["partition"].as_u64() == Some(u64::from(partition_of(&defined, 16)))
        })
        .collect::<Vec<_>>();
    assert!(
        !after.is_empty(),
        "{defined} has reports on its new partition"
    );
    for report in after {
        let text = String::from_utf8_lossy(&report.document);
        let records = report.manifest["records"].as_u64().unwrap_or(0);
        assert!(
            text.contains("<moved-orders") && (records == 0 || text.contains("<order>")),
            "the definition moved with {defined}: {}",
            &text[..text.len().min(300)]
        );
    }
    assert!(
        observed
            .reports
            .values()
            .any(|report| report.stream() == defined
                && report.manifest["records"].as_u64() > Some(0)
                && report.manifest["partition"].as_u64()
                    == Some(u64::from(partition_of(&defined, 16)))),
        "{defined} has records on its new partition"
    );

    // A replay by another group, into another bucket, from the beginning of
    // the grown log: the same keys, the same bytes.
    worker_one.terminate(Duration::from_secs(30));
    worker_two.terminate(Duration::from_secs(30));
    stack
        .assert_replay_renders("grow", 16, &observed.reports, LONG)
        .await;
}

//! A backlog never stops the pipeline: count and byte rollovers are decided
//! from the log, inline, so a document ends at the record that reaches the
//! limit however much is queued behind it, and a replay cuts at the same
//! records.

use std::collections::BTreeMap;
use std::time::Duration;

use quire_config::Settings;
use quire_tests::{Observed, TestStack};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(240);

/// The figures of the issue that found it: 4 arrays of 18 records of
/// 800 KB (about 58 MB) queued, a 4 MiB byte rollover.
const ARRAYS: u64 = 4;
const PER_ARRAY: u64 = 18;
const PAD_BYTES: usize = 800_000;
const ROLLOVER_BYTES: u64 = 4 * 1024 * 1024;

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn large_records(stream: &str, first: u64, count: u64) -> Vec<Value> {
    let pad = "x".repeat(PAD_BYTES);
    (first..first + count)
        .map(|seq| json!({"stream": stream, "seq": seq, "pad": pad}))
        .collect()
}

/// Each report's document key and SHA-256.
fn stored(observed: &Observed) -> BTreeMap<String, String> {
    observed
        .reports
        .values()
        .map(|report| {
            (
                report.manifest["key"].as_str().unwrap().to_owned(),
                report.manifest["sha256"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_far_past_the_byte_rollover_is_cut_inline_and_replays_cut_the_same() {
    let stack = TestStack::create("backlog").await;
    let api = stack.start_api().await;
    let stream = stream_name("backlog");
    // Queued while no worker runs: the whole backlog is read before any
    // marker a worker would publish could come back.
    for array in 0..ARRAYS {
        api.send_ok(
            &stream,
            &large_records(&stream, array * PER_ARRAY, PER_ARRAY),
        )
        .await;
    }
    let total = ARRAYS * PER_ARRAY;
    let rollover = |settings: &mut Settings| {
        settings.worker.rollover_bytes = std::num::NonZero::new(ROLLOVER_BYTES).unwrap()
    };

    let mut worker = stack.worker("w1").with(rollover).drain().spawn();
    assert_eq!(
        worker.wait(LONG),
        Some(0),
        "the worker drains the backlog and exits 0 (it used to exit on ObjectTooLarge)"
    );
    let observed = stack
        .wait_for("every record reported", LONG, |observed| {
            observed.sequence_numbers(&stream).len() as u64 == total
        })
        .await;
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..total).collect())]));

    // No document exceeds rollover_bytes plus one record.
    let one_record = PAD_BYTES as u64 + 1024;
    let mut inline = 0;
    for (id, report) in &observed.reports {
        let bytes = report.manifest["bytes"].as_u64().unwrap();
        assert!(
            bytes <= ROLLOVER_BYTES + one_record,
            "report {id} holds {bytes} bytes, past {ROLLOVER_BYTES} plus one record"
        );
        if report.manifest["trigger"] == "bytes" {
            inline += 1;
            // Decided inline: the report ends at the record that reached
            // the limit (its id names that record), not at a marker.
            let last = report.manifest["last_offset"].as_i64().unwrap();
            assert!(id.ends_with(&format!("-{last}")), "{id} ends at {last}");
            assert!(
                bytes >= ROLLOVER_BYTES,
                "report {id} was cut at {bytes} bytes, before the limit"
            );
        }
    }
    // About 58 MB in documents of 4 MiB: a dozen cut at the byte limit, the
    // rest of the backlog by the drain.
    assert!(
        inline >= 10,
        "{inline} reports cut at the byte rollover: {:?}",
        observed.reports.keys()
    );

    // A replay by another group, from the same log, into another bucket:
    // the same cuts, so the same keys and the same bytes.
    let replay = TestStack::create("backlog-replay").await;
    let mut again = replay
        .worker("w2")
        .with(rollover)
        .with(|settings| settings.kafka.topics.records = stack.topics.records.clone())
        .drain()
        .spawn();
    assert_eq!(again.wait(LONG), Some(0), "the replay drains and exits 0");
    let replayed = replay
        .wait_for("every record reported again", LONG, |observed| {
            observed.sequence_numbers(&stream).len() as u64 == total
        })
        .await;
    replayed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..total).collect())]));
    // The first run's drain marker is in the log too, so the replay cuts
    // its last document there as well: every report is the same.
    assert_eq!(
        stored(&replayed),
        stored(&observed),
        "the replay cut elsewhere or stored other bytes"
    );
    drop(api);
}

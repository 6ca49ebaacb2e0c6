//! Each dead letter once (issue 27, part 5). A restart or a rebalance reads
//! an open document's messages again from the committed offset, which stays
//! at the document's first record; its poison messages must not be
//! dead-lettered again, whether they have a stream or not.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_messages::{HEADER_KIND, HEADER_VERSION};
use quire_queue::{MessageId, OutMessage, TransactionalProducer};
use quire_tests::{TestStack, WorkerProcess, partition_of, read_all, worker_metric};

use crate::faults::{dead_letters_by_key, good_record, records_message};

const LONG: Duration = Duration::from_secs(120);

/// Waits until the worker at `base` has committed at least `records`
/// records since it started (`quire_worker_records_total` counts committed
/// arrays only): it has read the open document's messages again, and the
/// transactions that carried their dead letters, if any, are committed.
pub(crate) async fn wait_for_committed_records(
    worker: &mut WorkerProcess,
    base: &str,
    records: f64,
) {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status})");
        }
        let committed = worker_metric(base, "quire_worker_records_total").await;
        if committed.is_some_and(|committed| committed >= records) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the worker committed {committed:?} records, not {records}, within {LONG:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_dead_letter_is_published_once_across_a_kill_and_a_graceful_restart() {
    let stack = TestStack::create("dead-once").await;
    let api = stack.start_api().await;
    let stream = &quire_tests::unique("once");
    let topic = stack.topics.records.clone();
    let partition = partition_of(stream, 12) as i32;
    let record_headers = [(HEADER_KIND, "record"), (HEADER_VERSION, "1")];
    // Poison messages of the stream, and two without a valid stream, all on
    // the stream's partition after its document's first record.
    let poisons: Vec<(&str, OutMessage)> = vec![
        (
            "invalid JSON",
            records_message(&topic, stream, br#"{"seq": 9000, "#, &record_headers),
        ),
        (
            "a JSON array",
            records_message(&topic, stream, b"[1, 2]", &record_headers),
        ),
        (
            "a character XML 1.0 forbids",
            records_message(
                &topic,
                stream,
                br#"{"seq": 9001, "text": "bell \u0007"}"#,
                &record_headers,
            ),
        ),
        (
            "a message of an unknown kind",
            records_message(
                &topic,
                stream,
                br#"{"seq": 9002}"#,
                &[(HEADER_KIND, "recipe"), (HEADER_VERSION, "1")],
            ),
        ),
        (
            "a message without a key",
            OutMessage::new(&topic, None, br#"{"seq": 9003}"#.to_vec())
                .with_header(HEADER_KIND, b"record")
                .with_header(HEADER_VERSION, b"1")
                .to_partition(partition),
        ),
        (
            "a message keyed by an invalid stream name",
            OutMessage::new(
                &topic,
                Some(b"not a stream!".to_vec()),
                br#"{"seq": 9004}"#.to_vec(),
            )
            .with_header(HEADER_KIND, b"record")
            .with_header(HEADER_VERSION, b"1")
            .to_partition(partition),
        ),
    ];
    let mut messages = Vec::new();
    let mut poison_at = Vec::new();
    let mut next_seq = 0;
    for (what, poison) in poisons {
        for _ in 0..5 {
            messages.push(good_record(&topic, stream, next_seq));
            next_seq += 1;
        }
        poison_at.push((what, messages.len()));
        messages.push(poison);
    }
    for _ in 0..5 {
        messages.push(good_record(&topic, stream, next_seq));
        next_seq += 1;
    }
    let good = next_seq as f64;
    let producer = TransactionalProducer::connect(&stack.kafka, &quire_tests::unique("test-once"))
        .await
        .expect("a producer for the poison messages");
    let ids = producer.transact(messages).await.expect("publish");
    let poisoned: Vec<(&str, MessageId)> = poison_at
        .iter()
        .map(|(what, position)| (*what, ids[*position]))
        .collect();
    assert!(
        poisoned.iter().all(|(_, id)| id.partition == partition),
        "every poison message on the stream's partition: {poisoned:?}"
    );

    // The first read: the dead letters go out, the document stays open.
    let (mut worker, base) = stack.worker("w1").spawn_monitored();
    wait_for_committed_records(&mut worker, &base, good).await;
    let letters_first = read_all(&stack.kafka, &stack.topics.dead_letters, 3, true).len();
    // A crash while the document is open: the next start reads it again.
    worker.kill();
    let (mut worker, base) = stack.worker("w1").spawn_monitored();
    wait_for_committed_records(&mut worker, &base, good).await;
    let letters_after_kill = read_all(&stack.kafka, &stack.topics.dead_letters, 3, true).len();
    // A graceful stop aborts the open document too: read again once more.
    let (code, _) = worker.terminate(Duration::from_secs(30));
    assert_eq!(code, Some(0), "a graceful stop exits 0");
    let (mut worker, base) = stack.worker("w1").spawn_monitored();
    wait_for_committed_records(&mut worker, &base, good).await;
    let letters_after_restart = read_all(&stack.kafka, &stack.topics.dead_letters, 3, true).len();

    let report = api.cut(stream).await;
    api.wait_completed(&report, LONG).await;
    let observed = stack.wait_for("the report", LONG, |_| true).await;
    quire_tests::figures(&format!(
        "dead letters once: {} poison messages; dead letters after the first read {letters_first}, \
         after a SIGKILL and a restart {letters_after_kill}, after a SIGTERM and a restart \
         {letters_after_restart}",
        poisoned.len()
    ));
    let letters = dead_letters_by_key(&stack);
    let counts: BTreeMap<String, usize> = letters
        .iter()
        .map(|(key, found)| (key.clone(), found.len()))
        .collect();
    for (what, id) in &poisoned {
        let key = format!("{}:{}", id.partition, id.offset);
        assert_eq!(
            counts.get(&key).copied().unwrap_or(0),
            1,
            "{what} (at {key}): dead letters by key {counts:?}"
        );
    }
    assert_eq!(
        counts.values().sum::<usize>(),
        poisoned.len(),
        "only the poison messages are dead letters, once each: {counts:?}"
    );
    observed.assert_exactly_once(&BTreeMap::from([(
        stream.to_owned(),
        (0..next_seq).collect(),
    )]));
    assert!(worker.exited().is_none(), "the worker stopped");
}

/// A record that cannot be rendered never opens a document, whatever the
/// worker had open when it read it. A replay reads it again from the
/// committed offset (held back by another stream's open document) after
/// its stream's window was reported: if it opened a document then, the
/// next window's report would begin at the dead letter, in the replay and
/// not in the first run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_opens_no_document_when_a_replay_reads_it_again() {
    let stack = TestStack::create("dead-opens").await;
    let api = stack.start_api().await;
    let windowed = &quire_tests::unique("dlwin");
    let partition = partition_of(windowed, 12);
    // A plain stream on the same partition, whose open document keeps the
    // committed offset before the windowed stream's messages.
    let plain = (0..)
        .map(|_| quire_tests::unique("dlplain"))
        .find(|name| partition_of(name, 12) == partition)
        .expect("a stream on the partition");
    api.put_definition(
        windowed,
        serde_json::json!({
            "window": {"every": "3s", "time_zone": "UTC", "grace": "1s", "skip_empty": true}
        }),
    )
    .await;
    let (mut worker, _) = stack.worker("w1").spawn_monitored();
    api.send_ok(&plain, &quire_tests::records(&plain, 0, 1))
        .await;

    let topic = stack.topics.records.clone();
    let record_headers = [(HEADER_KIND, "record"), (HEADER_VERSION, "1")];
    let producer = TransactionalProducer::connect(&stack.kafka, &quire_tests::unique("test-opens"))
        .await
        .expect("a producer");
    let ids = producer
        .transact(vec![
            good_record(&topic, windowed, 0),
            records_message(&topic, windowed, b"[1, 2]", &record_headers),
        ])
        .await
        .expect("publish");
    let poison = ids[1];
    assert_eq!(
        poison.partition, partition as i32,
        "on the plain stream's partition"
    );

    // The window closes by the log; its report holds the one record.
    let first = stack
        .wait_for("the windowed stream's first report", LONG, |observed| {
            observed.sequence_numbers(windowed) == [0]
        })
        .await;
    let window_end = first
        .reports
        .values()
        .find(|report| report.stream() == windowed.as_str())
        .map(|report| {
            quire_messages::window::parse_time(report.manifest["window_end"].as_str().unwrap())
                .unwrap()
        })
        .expect("the report");
    // A crash: the next start reads again from the plain stream's record.
    worker.kill();
    let (mut worker, _) = stack.worker("w1").spawn_monitored();
    // Past the end of the window after the dead letter's, and its grace: a
    // message appended now closes it, and anything opened in it.
    let closed = window_end + 3_000 + 1_000 + 500;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    tokio::time::sleep(Duration::from_millis(
        closed.saturating_sub(now).max(0) as u64
    ))
    .await;
    let cut = api.cut(&plain).await;
    api.wait_completed(&cut, LONG).await;

    let observed = stack.observe().await;
    let poison_offset = poison.offset;
    let windowed_events: Vec<_> = observed
        .events
        .iter()
        .filter(|event| event["stream"].as_str() == Some(windowed.as_str()))
        .collect();
    for event in &windowed_events {
        assert!(
            event["first_offset"].as_i64() != Some(poison_offset)
                && event["last_offset"].as_i64() != Some(poison_offset),
            "a report begins or ends at the dead letter (offset {poison_offset}): {event}"
        );
    }
    assert_eq!(
        windowed_events.len(),
        1,
        "one report for the windowed stream (empty windows skipped): {windowed_events:?}"
    );
    assert_eq!(
        dead_letters_by_key(&stack)
            .get(&format!("{}:{}", poison.partition, poison.offset))
            .map(Vec::len),
        Some(1),
        "the dead letter published once"
    );
    assert!(worker.exited().is_none(), "the worker stopped");
}

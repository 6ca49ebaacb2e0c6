//! Faults survived, against real parts: Kafka stopped and restarted under
//! load (a private broker, never the stack's), S3 failing in every way a
//! proxy can make it fail, and poison messages in the records log. Each test
//! ends with the exactly-once checks and a worker that is still running.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_messages::{DeadLetter, HEADER_KIND, HEADER_VERSION};
use quire_queue::{MessageId, OutMessage, TransactionalProducer};
use quire_tests::kafka_process::KafkaProcess;
use quire_tests::read_all;
use quire_tests::s3::{Fault, FaultProxy, ProxyMode};
use quire_tests::{ApiProcess, Attempt, Observed, TestStack, WorkerProcess, records};
use serde_json::{Value, json};

/// How long one request may take before the client gives up on it: an API
/// that cannot publish must say so (503) well before this.
pub(crate) const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a sender keeps retrying one array.
/// An attempt cut off by the client timeout while its commit was under way
/// holds the key until the API has its outcome: up to 3 commit attempts of
/// kafka.request_timeout_ms (30 s) each.
const GIVE_UP: Duration = Duration::from_secs(180);
pub(crate) const LONG: Duration = Duration::from_secs(180);

pub(crate) fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// What one sender did: the records the API accepted, and every attempt.
pub(crate) struct Sent {
    stream: String,
    accepted: Vec<u64>,
    pub(crate) attempts: Vec<Attempt>,
    /// Set when an array was neither accepted nor refused within
    /// [`GIVE_UP`], or got an answer other than 200 / 503 / 429: what
    /// happened to its records is unknown, so the run proves nothing.
    failure: Option<String>,
}

/// Sends `make(stream, first_seq, count)` arrays of `array` records, one
/// after the other with `pause` between them, until `stop` is raised, each
/// under its own idempotency key and retried until accepted.
pub(crate) async fn send_numbered(
    api: Arc<ApiProcess>,
    stream: String,
    array: u64,
    pause: Duration,
    make: fn(&str, u64, u64) -> Vec<Value>,
    stop: Arc<AtomicBool>,
) -> Sent {
    let mut sent = Sent {
        stream: stream.clone(),
        accepted: Vec::new(),
        attempts: Vec::new(),
        failure: None,
    };
    let mut next = 0;
    while !stop.load(Ordering::Acquire) {
        let attempts = api
            .send_until_accepted(
                &stream,
                &make(&stream, next, array),
                CLIENT_TIMEOUT,
                GIVE_UP,
            )
            .await;
        let last = attempts.last().expect("at least one attempt").clone();
        sent.attempts.extend(attempts);
        if !last.accepted() {
            sent.failure = Some(format!(
                "stream {stream}: the array from seq {next} was not accepted: {:?}",
                last.outcome
            ));
            return sent;
        }
        sent.accepted.extend(next..next + array);
        next += array;
        tokio::time::sleep(pause).await;
    }
    sent
}

/// The senders' records by stream, after checking none of them failed.
pub(crate) fn accepted_by_stream(senders: &[Sent]) -> BTreeMap<String, Vec<u64>> {
    for sender in senders {
        assert!(
            sender.failure.is_none(),
            "{}",
            sender.failure.as_ref().unwrap()
        );
    }
    senders
        .iter()
        .map(|sender| (sender.stream.clone(), sender.accepted.clone()))
        .collect()
}

/// The last stable offset and the high watermark of every partition of the
/// design's topics, for a failure's message:
/// which of them a transaction holds back.
fn topic_offsets(stack: &TestStack) -> String {
    let mut out = Vec::new();
    for spec in quire_queue::design_topics(&stack.topics, 1, quire_queue::DEFAULT_PARTITIONS) {
        let topic = &spec.name;
        let offsets: Vec<String> = (0..spec.partitions)
            .map(|partition| {
                let (stable, high) = quire_tests::stable_and_high(&stack.kafka, topic, partition);
                if stable == high {
                    format!("{partition}:{high}")
                } else {
                    format!("{partition}:{stable}<{high}")
                }
            })
            .collect();
        out.push(format!("{topic} [{}]", offsets.join(" ")));
    }
    format!("offsets (stable<high where held back): {}", out.join("; "))
}

/// The worker's `/readyz` answer and its counters (no histogram), for a
/// failure's message: what it was doing.
async fn worker_state(monitor: Option<&str>) -> String {
    let Some(base) = monitor else {
        return "not monitored".into();
    };
    let http = reqwest::Client::new();
    let mut parts = Vec::new();
    // /healthz tells a wedged loop (it stops turning) from an idle one.
    for path in ["healthz", "readyz", "metrics"] {
        let text = match http.get(format!("{base}/{path}")).send().await {
            Ok(response) => response
                .text()
                .await
                .unwrap_or_else(|error| error.to_string()),
            Err(error) => error.to_string(),
        };
        let kept: Vec<&str> = text
            .lines()
            .filter(|line| {
                !line.starts_with('#') && !line.contains("_bucket{") && !line.contains("_bucket ")
            })
            .collect();
        parts.push(format!("/{path}: {}", kept.join(" | ")));
    }
    parts.join("; ")
}

/// Waits until the report events account for every accepted record of every
/// stream, then reads everything back. Fails at once if the worker exits:
/// it must resume by itself.
pub(crate) async fn wait_until_reported(
    stack: &TestStack,
    worker: &mut WorkerProcess,
    monitor: Option<&str>,
    sent: &BTreeMap<String, Vec<u64>>,
    limit: Duration,
) -> Observed {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status}) instead of resuming by itself");
        }
        let events = read_all(&stack.kafka, &stack.topics.report_events, 3, true);
        let mut reported: BTreeMap<String, u64> = BTreeMap::new();
        for event in &events {
            let event: Value = serde_json::from_slice(&event.payload).expect("event JSON");
            *reported
                .entry(event["stream"].as_str().unwrap_or_default().to_owned())
                .or_default() += event["records"].as_u64().unwrap_or(0);
        }
        let done = sent.iter().all(|(stream, sequence)| {
            reported.get(stream).copied().unwrap_or(0) >= sequence.len() as u64
        });
        if done {
            let observed = stack.observe().await;
            if observed.settled() {
                return observed;
            }
        }
        if Instant::now() >= deadline {
            panic!(
                "timed out waiting for every accepted record to be reported: reported {reported:?}, \
                 accepted {:?}; {}; worker: {}",
                sent.iter()
                    .map(|(stream, sequence)| (stream, sequence.len()))
                    .collect::<Vec<_>>(),
                topic_offsets(stack),
                worker_state(monitor).await
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs a blocking broker operation without stalling the runtime's other tasks.
pub(crate) fn blocking<T>(operation: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(operation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_broker_keeps_its_data_across_a_kill_and_a_stop() {
    let mut broker = blocking(KafkaProcess::start_new);
    let topic = quire_queue::TopicSpec {
        name: quire_tests::unique("test.private"),
        partitions: 2,
        replication: 1,
        config: Default::default(),
        growable: false,
    };
    broker.create_topics(std::slice::from_ref(&topic)).await;
    // One transactional id for both producers, as a restarted service has:
    // a SIGKILL right after the first commit can leave its COMMIT marker
    // skipped (see hanging.rs), and the second producer's commit on the
    // same partition, under the bumped epoch, is what releases it.
    let transactional_id = quire_tests::unique("test-private");
    let producer = TransactionalProducer::connect(&broker.settings(), &transactional_id)
        .await
        .expect("a producer on the private broker");
    let message =
        |text: &str| OutMessage::new(&topic.name, Some(b"key".to_vec()), text.as_bytes().to_vec());
    producer
        .transact(vec![message("before the kill")])
        .await
        .expect("publish");
    drop(producer);
    let bootstrap = broker.bootstrap.clone();
    blocking(|| broker.kill());
    assert!(!broker.is_running());
    blocking(|| broker.start());
    assert_eq!(broker.bootstrap, bootstrap, "same address after a restart");
    let producer = TransactionalProducer::connect(&broker.settings(), &transactional_id)
        .await
        .expect("a producer after the restart");
    producer
        .transact(vec![message("after the restart")])
        .await
        .expect("publish after the restart");
    blocking(|| broker.stop());
    blocking(|| broker.start());
    let payloads: Vec<Vec<u8>> = read_all(&broker.settings(), &topic.name, 2, true)
        .into_iter()
        .map(|seen| seen.payload)
        .collect();
    assert_eq!(
        payloads,
        [b"before the kill".to_vec(), b"after the restart".to_vec()],
        "both committed messages survive a SIGKILL and a stop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_stopped_and_restarted_mid_run_loses_and_doubles_nothing() {
    let mut broker = blocking(KafkaProcess::start_new);
    let stack = TestStack::create_on("fault-kafka", &broker).await;
    let api = Arc::new(stack.start_api().await);
    let mut worker = stack.worker("w1").spawn();
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..3)
        .map(|index| {
            tokio::spawn(send_numbered(
                api.clone(),
                stream_name(&format!("restart{index}")),
                20,
                Duration::from_millis(100),
                records,
                stop.clone(),
            ))
        })
        .collect();

    tokio::time::sleep(Duration::from_secs(5)).await;
    blocking(|| broker.stop());
    let stopped_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let restart_begun_at = Instant::now();
    blocking(|| broker.start());
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.store(true, Ordering::Release);
    let mut results = Vec::new();
    for sender in senders {
        results.push(sender.await.expect("sender task"));
    }

    // While the broker was away (from the end of its shutdown to its
    // restart): 503 with Retry-After, never a 200, never a hang.
    let attempts: Vec<&Attempt> = results.iter().flat_map(|sent| &sent.attempts).collect();
    let while_away: Vec<&&Attempt> = attempts
        .iter()
        .filter(|attempt| attempt.sent_at >= stopped_at && attempt.answered_at <= restart_begun_at)
        .collect();
    let unavailable_while_away = while_away
        .iter()
        .filter(|attempt| {
            matches!(&attempt.outcome, Ok(answer) if answer.status == 503 && answer.retry_after.is_some())
        })
        .count();
    // Anything else while away: a 200 (published where nothing can be), an
    // error without Retry-After, no answer at all.
    let otherwise_while_away: Vec<String> = while_away
        .iter()
        .filter(|attempt| {
            !matches!(&attempt.outcome, Ok(answer) if (answer.status == 503 || answer.status == 429) && answer.retry_after.is_some())
        })
        .map(|attempt| match &attempt.outcome {
            Ok(answer) => format!("{} {}", answer.status, answer.body),
            Err(error) => error.message.clone(),
        })
        .collect();
    let unavailable_without_retry_after = attempts
        .iter()
        .filter(|attempt| {
            matches!(&attempt.outcome, Ok(answer) if answer.status == 503 && answer.retry_after.is_none())
        })
        .count();
    let no_answer: Vec<String> = attempts
        .iter()
        .filter_map(|attempt| attempt.outcome.as_ref().err())
        .map(|error| error.message.clone())
        .collect();
    let accepted_after_restart = attempts
        .iter()
        .filter(|attempt| attempt.accepted() && attempt.answered_at > restart_begun_at)
        .count();
    quire_tests::figures(&format!(
        "kafka restart: {} attempts, {} while the broker was away ({unavailable_while_away} \
         answered 503 + Retry-After, {} otherwise), {} without an answer, \
         {accepted_after_restart} arrays accepted after the restart",
        attempts.len(),
        while_away.len(),
        otherwise_while_away.len(),
        no_answer.len()
    ));
    let sent = accepted_by_stream(&results);
    assert!(
        unavailable_while_away > 0,
        "no 503 with Retry-After while the broker was away ({} attempts then)",
        while_away.len()
    );
    assert!(
        otherwise_while_away.is_empty(),
        "while the broker was away the API answered other than 503 (or 429) with Retry-After: \
         {otherwise_while_away:?}"
    );
    assert_eq!(
        unavailable_without_retry_after, 0,
        "a 503 without Retry-After"
    );
    assert!(
        no_answer.is_empty(),
        "requests got no answer within {CLIENT_TIMEOUT:?}: {no_answer:?}"
    );
    for sender in &results {
        assert!(
            sender
                .attempts
                .iter()
                .any(|attempt| attempt.accepted() && attempt.answered_at > restart_begun_at),
            "stream {}: no array accepted after the restart",
            sender.stream
        );
    }

    for stream in sent.keys() {
        api.cut(stream).await;
    }
    let observed = wait_until_reported(&stack, &mut worker, None, &sent, LONG).await;
    observed.assert_exactly_once(&sent);
    assert!(
        worker.exited().is_none(),
        "the worker exited instead of resuming by itself"
    );
}

/// A record of about 1.6 KB: enough of them fill an 8 MiB part, so large
/// documents are multipart uploads.
pub(crate) fn padded_records(stream: &str, first: u64, count: u64) -> Vec<Value> {
    (first..first + count)
        .map(|seq| json!({"stream": stream, "seq": seq, "pad": "p".repeat(1600)}))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_errors_delays_resets_and_an_outage_damage_no_report_and_lose_nothing() {
    let stack = TestStack::create("fault-s3").await;
    let proxy = FaultProxy::switchable(&stack.bucket.settings.endpoint).await;
    // The API reads S3 directly; only the worker goes through the proxy.
    let api = Arc::new(stack.start_api().await);
    let mut worker = stack
        .worker("w1")
        .with(|settings| {
            settings.s3.endpoint = proxy.endpoint.clone();
            // About 9.6 MB of padded records: two parts of 8 MiB.
            settings.worker.rollover_records = std::num::NonZero::new(6000).unwrap();
        })
        .spawn();
    let stop = Arc::new(AtomicBool::new(false));
    let large = stream_name("large");
    let small: Vec<String> = (0..2)
        .map(|index| stream_name(&format!("small{index}")))
        .collect();
    let mut senders = vec![tokio::spawn(send_numbered(
        api.clone(),
        large.clone(),
        100,
        Duration::from_millis(250),
        padded_records,
        stop.clone(),
    ))];
    for stream in &small {
        senders.push(tokio::spawn(send_numbered(
            api.clone(),
            stream.clone(),
            50,
            Duration::from_millis(250),
            records,
            stop.clone(),
        )));
    }
    // Small streams are cut every 3 s: many small reports (single PutObject).
    let cutter = {
        let api = api.clone();
        let small = small.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut cuts = 0;
            while !stop.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_secs(3)).await;
                for stream in &small {
                    api.cut(stream).await;
                    cuts += 1;
                }
            }
            cuts
        })
    };

    let phases = [
        ("pass-through", ProxyMode::PassThrough, 5),
        (
            "503 on 30%",
            ProxyMode::Failing {
                fault: Fault::ServiceUnavailable,
                percent: 30,
            },
            10,
        ),
        (
            "500 on 30%",
            ProxyMode::Failing {
                fault: Fault::InternalError,
                percent: 30,
            },
            8,
        ),
        (
            "slow, 400 ms",
            ProxyMode::Slow {
                delay: Duration::from_millis(400),
            },
            8,
        ),
        (
            "resets on 30%",
            ProxyMode::Failing {
                fault: Fault::ResetConnection,
                percent: 30,
            },
            8,
        ),
        ("down", ProxyMode::Down, 15),
        ("healed", ProxyMode::PassThrough, 8),
    ];
    let mut phase_report = Vec::new();
    for (name, mode, seconds) in phases {
        let faults_before = proxy.faults_injected();
        let requests_before = proxy.requests_seen();
        proxy.set_mode(mode);
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let faults = proxy.faults_injected() - faults_before;
        let requests = proxy.requests_seen() - requests_before;
        phase_report.push(format!("{name}: {requests} requests, {faults} failed"));
        if matches!(mode, ProxyMode::Failing { .. } | ProxyMode::Down) {
            assert!(
                faults > 0,
                "phase {name} injected no fault: the worker sent no request to S3"
            );
        }
    }
    quire_tests::figures(&format!("s3 faults: {}", phase_report.join("; ")));
    stop.store(true, Ordering::Release);
    let mut results = Vec::new();
    for sender in senders {
        results.push(sender.await.expect("sender task"));
    }
    let cuts = cutter.await.expect("cutter task");
    let sent = accepted_by_stream(&results);
    for stream in sent.keys() {
        api.cut(stream).await;
    }

    wait_until_reported(&stack, &mut worker, None, &sent, LONG).await;
    // Aborts run as the worker gives up on a document; let the last finish.
    assert!(
        stack
            .bucket
            .no_pending_upload_within("", Duration::from_secs(30))
            .await,
        "multipart uploads left pending after healing: {:?}",
        stack.bucket.pending_uploads("").await
    );
    let observed = stack.observe().await;
    observed.assert_exactly_once(&sent);
    let largest = observed
        .reports
        .values()
        .map(|report| report.document.len())
        .max()
        .unwrap_or(0);
    quire_tests::figures(&format!(
        "s3 faults: {} reports ({cuts} timed cuts), largest {largest} bytes, {} records",
        observed.reports.len(),
        sent.values().map(Vec::len).sum::<usize>()
    ));
    assert!(
        largest > 8 * 1024 * 1024,
        "no report was large enough to be a multipart upload"
    );
    assert!(
        worker.exited().is_none(),
        "the worker exited instead of resuming by itself"
    );
}

/// A message for the records topic with the headers the API would put on it
/// (`quire-kind`, `quire-v`), or other ones.
pub(crate) fn records_message(
    topic: &str,
    stream: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> OutMessage {
    headers.iter().fold(
        OutMessage::new(topic, Some(stream.as_bytes().to_vec()), payload.to_vec()),
        |message, (name, value)| message.with_header(*name, value.as_bytes()),
    )
}

/// A record as the API writes it (`quire_messages::records`).
pub(crate) fn good_record(topic: &str, stream: &str, seq: u64) -> OutMessage {
    let record = &records(stream, seq, 1)[0];
    let stream = quire_messages::StreamName::new(stream).unwrap();
    let message = quire_messages::records::record(&stream, &serde_json::to_vec(record).unwrap());
    OutMessage::from_parts(topic, message.key, message.payload, message.headers, None)
}

/// The dead letters of the test's topic, by key, with their bodies.
pub(crate) fn dead_letters_by_key(stack: &TestStack) -> BTreeMap<String, Vec<DeadLetter>> {
    let mut letters: BTreeMap<String, Vec<DeadLetter>> = BTreeMap::new();
    for seen in read_all(&stack.kafka, &stack.topics.dead_letters, 3, true) {
        let key = String::from_utf8(seen.key.expect("a dead letter has a key")).unwrap();
        letters
            .entry(key)
            .or_default()
            .push(serde_json::from_slice(&seen.payload).expect("dead letter JSON"));
    }
    letters
}

/// Checks that the message at `id` reached the dead letters once, keyed
/// `partition:offset`, with a reason that contains `reason`.
fn assert_dead_lettered(
    letters: &BTreeMap<String, Vec<DeadLetter>>,
    what: &str,
    id: MessageId,
    stream: &str,
    reason: &str,
) {
    let key = format!("{}:{}", id.partition, id.offset);
    let found = letters.get(&key).map(Vec::as_slice).unwrap_or_default();
    assert_eq!(
        found.len(),
        1,
        "{what} (at {key}): {} dead letters, expected one; all: {letters:?}",
        found.len()
    );
    let letter = &found[0];
    assert_eq!(letter.stream, stream, "{what}: stream");
    assert_eq!(
        (letter.partition, letter.offset),
        (id.partition, id.offset),
        "{what}: position"
    );
    assert!(
        letter.reason.contains(reason),
        "{what}: reason {:?} does not say {reason:?}",
        letter.reason
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_go_to_dead_letters_and_the_stream_goes_on() {
    let stack = TestStack::create("fault-poison").await;
    let api = stack.start_api().await;
    let mut worker = stack.worker("w1").spawn();
    let stream = stream_name("poison");
    let topic = stack.topics.records.clone();
    let record_headers = [(HEADER_KIND, "record"), (HEADER_VERSION, "1")];
    // (what, message, what its dead letter's reason says)
    let poisons: Vec<(&str, OutMessage, &str)> = vec![
        (
            "invalid JSON",
            records_message(
                &topic,
                &stream,
                br#"{"seq": 9000, "text": "#,
                &record_headers,
            ),
            "not JSON",
        ),
        (
            "a JSON array",
            records_message(&topic, &stream, b"[1, 2, 3]", &record_headers),
            "must be a JSON object",
        ),
        (
            "a JSON string",
            records_message(&topic, &stream, br#""just text""#, &record_headers),
            "must be a JSON object",
        ),
        (
            "a character XML 1.0 forbids",
            records_message(
                &topic,
                &stream,
                br#"{"seq": 9001, "text": "bell \u0007"}"#,
                &record_headers,
            ),
            "U+0007",
        ),
        (
            "a cut marker of a newer version",
            records_message(
                &topic,
                &stream,
                br#"{"v": 2, "trigger": "api"}"#,
                &[(HEADER_KIND, "cut"), (HEADER_VERSION, "1")],
            ),
            "version 2",
        ),
        (
            "a message of an unknown kind",
            records_message(
                &topic,
                &stream,
                br#"{"seq": 9002}"#,
                &[(HEADER_KIND, "recipe"), (HEADER_VERSION, "1")],
            ),
            "quire-kind",
        ),
    ];
    // Good records around and between every poison message, in one log.
    let mut messages = Vec::new();
    let mut poison_positions = Vec::new();
    let mut next_seq = 0;
    for (what, poison, reason) in poisons {
        for _ in 0..10 {
            messages.push(good_record(&topic, &stream, next_seq));
            next_seq += 1;
        }
        poison_positions.push((what, messages.len(), reason));
        messages.push(poison);
    }
    for _ in 0..10 {
        messages.push(good_record(&topic, &stream, next_seq));
        next_seq += 1;
    }
    let producer =
        TransactionalProducer::connect(&stack.kafka, &quire_tests::unique("test-poison"))
            .await
            .expect("a producer for the poison messages");
    let ids = producer.transact(messages).await.expect("publish");
    // More through the API, then a cut: the stream went on past the poison.
    api.send_ok(&stream, &records(&stream, next_seq, 20)).await;
    next_seq += 20;
    let first_report = api.cut(&stream).await;
    api.wait_completed(&first_report, LONG).await;
    // And on: a later array and cut complete too.
    api.send_ok(&stream, &records(&stream, next_seq, 20)).await;
    next_seq += 20;
    let second_report = api.cut(&stream).await;
    api.wait_completed(&second_report, LONG).await;

    let observed = stack
        .wait_for("the dead letters", LONG, |observed| {
            observed.dead_letters.len() >= poison_positions.len()
        })
        .await;
    let letters = dead_letters_by_key(&stack);
    for (what, position, reason) in &poison_positions {
        assert_dead_lettered(&letters, what, ids[*position], &stream, reason);
    }
    assert_eq!(
        letters.values().map(Vec::len).sum::<usize>(),
        poison_positions.len(),
        "only the poison messages are dead letters: {letters:?}"
    );
    let report_ids: BTreeSet<&String> = observed.reports.keys().collect();
    assert_eq!(
        report_ids,
        BTreeSet::from([&first_report, &second_report]),
        "exactly the two cuts made reports (the newer-version marker cut nothing)"
    );
    assert_eq!(
        observed.sequence_numbers(&stream),
        (0..next_seq).collect::<Vec<_>>(),
        "every good record once, in order"
    );
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..next_seq).collect())]));
    assert!(
        worker.exited().is_none(),
        "the worker stopped on a poison message"
    );
}

/// ARCHITECTURE.md: records carry their version in the `quire-v` header and
/// "newer versions are refused by name"; a record that cannot be rendered is
/// a dead letter and "the stream goes on; no crash loop". So a record of a
/// version this release does not know is neither rendered as if it were
/// version 1 nor a reason to stop: it is a dead letter naming the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_a_newer_version_is_a_dead_letter_naming_its_version() {
    let stack = TestStack::create("fault-version").await;
    let api = stack.start_api().await;
    let mut worker = stack.worker("w1").spawn();
    let stream = stream_name("version");
    let topic = stack.topics.records.clone();
    const NEWER_SEQ: u64 = 9999;
    let mut messages: Vec<OutMessage> = (0..5)
        .map(|seq| good_record(&topic, &stream, seq))
        .collect();
    let newer = &records(&stream, NEWER_SEQ, 1)[0];
    messages.push(records_message(
        &topic,
        &stream,
        &serde_json::to_vec(newer).unwrap(),
        &[(HEADER_KIND, "record"), (HEADER_VERSION, "2")],
    ));
    messages.extend((5..10).map(|seq| good_record(&topic, &stream, seq)));
    let producer =
        TransactionalProducer::connect(&stack.kafka, &quire_tests::unique("test-version"))
            .await
            .expect("a producer");
    let ids = producer.transact(messages).await.expect("publish");
    let report = api.cut(&stream).await;
    api.wait_completed(&report, LONG).await;

    let observed = stack.wait_for("the report", LONG, |_| true).await;
    let sequence = observed.sequence_numbers(&stream);
    assert!(
        !sequence.contains(&NEWER_SEQ),
        "the record of version 2 was rendered as if it were version 1; a newer version must be \
         refused by name (a dead letter), never misread"
    );
    assert_eq!(sequence, (0..10).collect::<Vec<_>>());
    let letters = dead_letters_by_key(&stack);
    assert_dead_lettered(
        &letters,
        "a record of version 2",
        ids[5],
        &stream,
        "version 2",
    );
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..10).collect())]));
    assert!(
        worker.exited().is_none(),
        "the worker stopped on a record of a newer version"
    );
}

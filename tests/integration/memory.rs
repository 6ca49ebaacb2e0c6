//! Memory stays within the budget in catch-up: 500 streams of about 6 MiB
//! each are queued before a worker starts, with `memory_budget_bytes` at
//! 256 MiB, so the open documents together (about 3 GiB, each under one part)
//! are far more than the budget, and the memory cuts the worker publishes land
//! only after the whole backlog. The worker drains it: its peak resident
//! memory (VmHWM, sampled from /proc while it runs) stays within the budget
//! plus the stated overhead, every record is reported exactly once, and the
//! spill directory is empty at the end. The last line it prints,
//! `memory: ...`, holds the numbers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_messages::{HEADER_KIND, HEADER_VERSION, MessageKind};
use quire_tests::TestStack;
use quire_tests::{read_all, unique};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

const STREAMS: u64 = 500;
/// About 12 KiB of JSON per record: 512 records make about 6 MiB a stream,
/// and the whole backlog about 256,000 records.
const RECORD_PAD: usize = 12 * 1024;
const RECORDS_PER_STREAM: u64 = 512;
const MIB: u64 = 1024 * 1024;
const BUDGET: u64 = 256 * MIB;
/// What the worker holds besides the documents' memory, which the budget
/// bounds (and the worker's own gauge shows within it): librdkafka's
/// prefetch queue (`queued.max.messages.kbytes`, 64 MiB by default) and the
/// fetch responses being decoded (up to `fetch.max.bytes`, 50 MiB), the
/// array in hand (5,000 records of 12 KiB, about 60 MiB, and their
/// rendering), the allocator's free lists and arenas (large buffers freed on
/// one thread and allocated on another), the runtime and the clients.
/// Measured here: a peak of 514-538 MiB (258-282 MiB over the budget) when
/// the test runs alone, and 581 MiB in a CI run beside the other tests
/// (jemalloc's background purge and librdkafka's fetcher get less CPU),
/// while the documents' memory stayed at 198 MiB, with 1.4 GiB spilled.
/// A smaller prefetch queue (16 MiB) took the alone peak to 407 MiB but
/// doubled the drain time, so the default stays.
const OVERHEAD: u64 = 384 * MIB;

/// The peak resident memory of a process (VmHWM), in bytes; `None` once it
/// has exited.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

fn stream_name(index: u64) -> String {
    format!("memory-{index:03}")
}

/// Queues the backlog straight on the records topic; see [`queue_interleaved`].
async fn queue_backlog(stack: &TestStack) -> u64 {
    let streams: Vec<String> = (0..STREAMS).map(stream_name).collect();
    queue_interleaved(stack, &streams, RECORDS_PER_STREAM, RECORD_PAD).await
}

/// Queues `records_per_stream` records of each of `streams` straight on the
/// records topic, in the records format of the producer API (key = stream,
/// JSON object `{"stream", "seq", "pad"}` with `record_pad` bytes of pad,
/// `quire-kind: record`, `quire-v`), interleaving the streams as concurrent
/// senders would. Returns the bytes queued.
pub(crate) async fn queue_interleaved(
    stack: &TestStack,
    streams: &[String],
    records_per_stream: u64,
    record_pad: usize,
) -> u64 {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &stack.kafka.bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("batch.size", "1000000")
        .set("queue.buffering.max.kbytes", "262144")
        .set("message.timeout.ms", "120000")
        .create()
        .expect("backlog producer");
    let pad = "x".repeat(record_pad);
    let version = quire_messages::CURRENT_VERSION.to_string();
    let mut bytes = 0u64;
    let mut deliveries = Vec::new();
    for seq in 0..records_per_stream {
        for stream in streams {
            let payload = format!(r#"{{"stream":"{stream}","seq":{seq},"pad":"{pad}"}}"#);
            bytes += payload.len() as u64;
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: HEADER_KIND,
                    value: Some(MessageKind::Record.as_header()),
                })
                .insert(Header {
                    key: HEADER_VERSION,
                    value: Some(version.as_str()),
                });
            let mut record = FutureRecord::to(&stack.topics.records)
                .key(stream.as_str())
                .payload(&payload)
                .headers(headers);
            loop {
                match producer.send_result(record) {
                    Ok(delivery) => {
                        deliveries.push(delivery);
                        break;
                    }
                    // The local queue is full: let it drain.
                    Err((_, returned)) => {
                        record = returned;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        }
        if deliveries.len() >= 20_000 {
            for delivery in deliveries.drain(..) {
                delivery
                    .await
                    .expect("delivery answered")
                    .expect("record delivered");
            }
        }
    }
    for delivery in deliveries {
        delivery
            .await
            .expect("delivery answered")
            .expect("record delivered");
    }
    producer
        .flush(Duration::from_secs(60))
        .expect("backlog flushed");
    bytes
}

/// The most the worker's own gauges showed: memory held for documents
/// (what the budget bounds) and bytes spilled.
#[derive(Debug, Default)]
struct Counted {
    held: u64,
    spilled: u64,
    over_budget: u64,
}

impl Counted {
    async fn sample(&mut self, http: &reqwest::Client, base: &str) {
        let Ok(response) = http.get(format!("{base}/metrics")).send().await else {
            return;
        };
        let Ok(text) = response.text().await else {
            return;
        };
        for line in text.lines() {
            let Some((name, value)) = line.split_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                continue;
            };
            match name {
                "quire_worker_memory_held_bytes" => self.held = self.held.max(value),
                "quire_worker_spilled_bytes" => self.spilled = self.spilled.max(value),
                "quire_worker_memory_over_budget_bytes" => {
                    self.over_budget = self.over_budget.max(value)
                }
                _ => {}
            }
        }
    }
}

/// The `seq` values of a rendered document, in document order.
pub(crate) fn sequence_numbers(document: &[u8]) -> Vec<u64> {
    const OPEN: &[u8] = b"<seq>";
    let mut found = Vec::new();
    let mut rest = document;
    while let Some(at) = rest.windows(OPEN.len()).position(|window| window == OPEN) {
        rest = &rest[at + OPEN.len()..];
        let end = rest
            .iter()
            .position(|byte| *byte == b'<')
            .expect("a closed seq element");
        let text = std::str::from_utf8(&rest[..end]).expect("seq text");
        found.push(text.parse().expect("seq number"));
        rest = &rest[end..];
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_far_larger_than_the_memory_budget_is_reported_within_it() {
    let stack = TestStack::create("memory").await;
    let started = Instant::now();
    let queued_bytes = queue_backlog(&stack).await;
    let queued_in = started.elapsed();
    let spill_dir = std::env::temp_dir().join(unique("quire-test-spill"));
    let spill_dir_text = spill_dir.display().to_string();
    let drain_started = Instant::now();
    let (mut worker, metrics_base) = stack
        .worker("memory-0")
        .with(|settings| settings.worker.memory_budget_bytes = BUDGET)
        // The default spill directory, `quire-spill` of the temp dir, in a
        // temp dir of the test's own.
        .variable("TMPDIR", &spill_dir_text)
        .drain()
        .spawn_monitored();
    let http = reqwest::Client::new();
    let mut peak = 0u64;
    let mut counted = Counted::default();
    let mut samples = 0u64;
    let exit = loop {
        if let Some(sampled) = peak_rss(worker.id()) {
            peak = peak.max(sampled);
        }
        assert!(
            peak <= BUDGET + OVERHEAD,
            "peak RSS {} MiB while draining, past the budget of {} MiB plus the overhead of {} MiB",
            peak / MIB,
            BUDGET / MIB,
            OVERHEAD / MIB
        );
        if samples.is_multiple_of(4) {
            counted.sample(&http, &metrics_base).await;
        }
        samples += 1;
        if let Some(status) = worker.exited() {
            break status;
        }
        assert!(
            drain_started.elapsed() < Duration::from_secs(600),
            "the worker did not drain the backlog within 10 minutes (peak so far {} MiB)",
            peak / MIB
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drained_in = drain_started.elapsed();
    assert!(exit.success(), "the worker exited with {exit}");

    // Every record in exactly one report, every report announced once and
    // matching its manifest.
    let events = read_all(&stack.kafka, &stack.topics.report_events, 3, true);
    let mut announced = BTreeMap::new();
    for event in &events {
        let event: serde_json::Value = serde_json::from_slice(&event.payload).expect("event");
        let id = event["report_id"].as_str().expect("report id").to_owned();
        assert!(
            announced.insert(id.clone(), event).is_none(),
            "{id} announced twice"
        );
    }
    let mut reported: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let manifests = stack.bucket.list("manifests/").await;
    assert_eq!(manifests.len(), announced.len(), "a report per event");
    for key in manifests {
        let manifest: serde_json::Value =
            serde_json::from_slice(&stack.bucket.read(&key).await.expect("manifest"))
                .expect("manifest JSON");
        let id = manifest["report_id"].as_str().expect("report id");
        assert!(announced.contains_key(id), "{id} stored but not announced");
        let document = stack
            .bucket
            .read(manifest["key"].as_str().expect("document key"))
            .await
            .expect("the document of a manifest");
        use sha2::Digest;
        let digest = sha2::Sha256::digest(&document);
        let hex = hex::encode(digest);
        assert_eq!(manifest["sha256"].as_str(), Some(hex.as_str()), "{id}");
        assert_eq!(manifest["bytes"].as_u64(), Some(document.len() as u64));
        let sequence = sequence_numbers(&document);
        assert_eq!(manifest["records"].as_u64(), Some(sequence.len() as u64));
        reported
            .entry(manifest["stream"].as_str().expect("stream").to_owned())
            .or_default()
            .extend(sequence);
    }
    assert_eq!(reported.len() as u64, STREAMS, "every stream reported");
    let expected: Vec<u64> = (0..RECORDS_PER_STREAM).collect();
    for (stream, mut sequence) in reported {
        sequence.sort_unstable();
        assert_eq!(
            sequence, expected,
            "{stream}: a record is missing or doubled"
        );
    }
    assert!(
        stack.bucket.pending_uploads("").await.is_empty(),
        "multipart uploads left pending"
    );
    let left: Vec<_> = std::fs::read_dir(spill_dir.join("quire-spill").join("memory-0"))
        .map(|entries| entries.flatten().map(|entry| entry.path()).collect())
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&spill_dir);
    assert!(left.is_empty(), "spill files left behind: {left:?}");

    quire_tests::figures(&format!(
        "memory: {STREAMS} streams, {} MiB queued in {:.1} s, drained in {:.1} s into {} reports; peak RSS {} MiB for a budget of {} MiB + {} MiB overhead; counted at most {} MiB held, {} MiB spilled, {} MiB over budget",
        queued_bytes / MIB,
        queued_in.as_secs_f64(),
        drained_in.as_secs_f64(),
        announced.len(),
        peak / MIB,
        BUDGET / MIB,
        OVERHEAD / MIB,
        counted.held / MIB,
        counted.spilled / MIB,
        counted.over_budget / MIB,
    ));
    assert!(
        counted.held <= BUDGET && counted.over_budget == 0,
        "the worker counted {} MiB held ({} MiB over budget) for a budget of {} MiB",
        counted.held / MIB,
        counted.over_budget / MIB,
        BUDGET / MIB
    );
    assert!(
        counted.spilled > 0,
        "the backlog was meant to need the spill"
    );
    assert!(
        peak <= BUDGET + OVERHEAD,
        "peak RSS {} MiB is past the budget of {} MiB plus the overhead of {} MiB",
        peak / MIB,
        BUDGET / MIB,
        OVERHEAD / MIB
    );
}

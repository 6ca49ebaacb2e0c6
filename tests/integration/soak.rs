//! The soak: a steady load for `QUIRE_SOAK_SECONDS` (default 300), with
//! periodic cuts and rollovers, while the worker's memory and the group's
//! lag are sampled every 5 s. Memory stays flat, lag stays bounded and comes
//! back to (near) zero, and every record is reported exactly once. The last
//! line it prints, `soak: ...`, holds the numbers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_tests::read_all;
use quire_tests::{ApiProcess, TestStack, records};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

const STREAMS: u64 = 8;
const ARRAY: u64 = 100;
/// Records per second over all streams.
const RATE: u64 = 2_000;
/// Each stream's documents roll over at this many records (every ~40 s at
/// 250 records/s per stream) ...
const ROLLOVER_RECORDS: u64 = 10_000;
/// ... and each stream is cut this often, staggered across streams.
const CUT_EVERY: Duration = Duration::from_secs(60);
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// The worker's resident memory may grow this much from the second minute
/// to the last one (allocator noise), no more: a leak of 25 bytes a record
/// at this rate would add about 9 MiB a minute. (Measured here: +1.2 MiB,
/// with a median of 35 MiB.)
const RSS_MARGIN_MIB: f64 = 24.0;
/// Documents here stay under one part, so the worker holds every open one
/// whole (8 streams x ~1.5 MB); librdkafka may prefetch up to 8 MiB per
/// partition (12 of them) if the worker falls behind. (Measured here: a
/// peak of 36 MiB.)
const RSS_PEAK_MIB: f64 = 256.0;
/// The committed offset never passes an open document, so lag includes
/// every open document (at most a rollover's worth per stream) plus what
/// arrived in the last seconds. More than 15 s of input beyond that means
/// the worker falls behind.
const MAX_LAG: i64 = (STREAMS * ROLLOVER_RECORDS + 15 * RATE) as i64;
/// After the last cut the committed offsets reach the end of each partition
/// up to the transaction markers after the last messages.
const FINAL_LAG: i64 = 50;

fn soak_seconds() -> u64 {
    std::env::var("QUIRE_SOAK_SECONDS")
        .ok()
        .map(|value| {
            value
                .parse()
                .unwrap_or_else(|_| panic!("QUIRE_SOAK_SECONDS={value} is not a number"))
        })
        .unwrap_or(300)
}

/// Resident memory of a process in MiB (VmRSS of /proc/<pid>/status).
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|error| panic!("/proc/{pid}/status: {error} (did the worker exit?)"));
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib / 1024.0
}

/// Sum over the partitions of `topic` of high watermark minus the offset
/// `group` committed (the whole partition if it committed nothing).
fn consumer_lag(settings: &KafkaSettings, group: &str, topic: &str, partitions: i32) -> i64 {
    let committed = quire_tests::committed_offsets(settings, group, topic, partitions);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &settings.bootstrap_servers)
        .create()
        .expect("watermark reader");
    (0..partitions)
        .zip(committed)
        .map(|(partition, committed)| {
            let (low, high) = consumer
                .fetch_watermarks(topic, partition, Duration::from_secs(10))
                .expect("watermarks");
            (high - committed.unwrap_or(low)).max(0)
        })
        .sum()
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Least-squares slope of `(seconds, MiB)` samples, in MiB per minute.
fn slope_per_minute(samples: &[(f64, f64)]) -> f64 {
    let count = samples.len() as f64;
    let mean_x = samples.iter().map(|(x, _)| x).sum::<f64>() / count;
    let mean_y = samples.iter().map(|(_, y)| y).sum::<f64>() / count;
    let covariance: f64 = samples
        .iter()
        .map(|(x, y)| (x - mean_x) * (y - mean_y))
        .sum();
    let variance: f64 = samples.iter().map(|(x, _)| (x - mean_x).powi(2)).sum();
    if variance == 0.0 {
        return 0.0;
    }
    covariance / variance * 60.0
}

/// One stream's steady sender: an array every `STREAMS * ARRAY / RATE`
/// seconds, each retried until accepted. Returns the accepted sequence.
async fn send_steadily(api: Arc<ApiProcess>, stream: String, stop: Arc<AtomicBool>) -> Vec<u64> {
    let period = Duration::from_secs_f64((STREAMS * ARRAY) as f64 / RATE as f64);
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = 0;
    while !stop.load(Ordering::Acquire) {
        ticker.tick().await;
        let attempts = api
            .send_until_accepted(
                &stream,
                &records(&stream, next, ARRAY),
                Duration::from_secs(30),
                Duration::from_secs(120),
            )
            .await;
        let last = attempts.last().expect("an attempt");
        assert!(
            last.accepted(),
            "stream {stream}: array from seq {next} not accepted: {:?}",
            last.outcome
        );
        next += ARRAY;
    }
    (0..next).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_memory_stays_flat_lag_stays_bounded_and_every_record_is_reported_once() {
    let seconds = soak_seconds();
    assert!(
        seconds >= 60,
        "QUIRE_SOAK_SECONDS={seconds}: a soak needs at least a minute"
    );
    // The second minute is the baseline, the last minute is compared with
    // it; shorter runs scale both windows down.
    let window = (seconds as f64 / 5.0).min(60.0);
    let stack = TestStack::create("soak").await;
    let api = Arc::new(stack.start_api().await);
    let mut worker = stack
        .worker("w1")
        .with(|settings| {
            settings.worker.rollover_records = std::num::NonZero::new(ROLLOVER_RECORDS).unwrap()
        })
        .spawn();
    let worker_pid = worker.id();
    let streams: Vec<String> = (0..STREAMS)
        .map(|index| {
            format!(
                "soak{index}-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let senders: Vec<_> = streams
        .iter()
        .map(|stream| tokio::spawn(send_steadily(api.clone(), stream.clone(), stop.clone())))
        .collect();
    let cutter = {
        let api = api.clone();
        let streams = streams.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let stagger = CUT_EVERY / STREAMS as u32;
            let mut cuts = 0u64;
            let mut next = 0;
            while !stop.load(Ordering::Acquire) {
                tokio::time::sleep(stagger).await;
                api.cut(&streams[next % streams.len()]).await;
                next += 1;
                cuts += 1;
            }
            cuts
        })
    };

    let mut rss_samples: Vec<(f64, f64)> = Vec::new();
    let mut lag_samples: Vec<i64> = Vec::new();
    let mut sampler = tokio::time::interval(SAMPLE_EVERY);
    while started.elapsed() < Duration::from_secs(seconds) {
        sampler.tick().await;
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status}) during the soak");
        }
        rss_samples.push((started.elapsed().as_secs_f64(), rss_mib(worker_pid)));
        let settings = stack.kafka.clone();
        let group = stack.group.clone();
        let topic = stack.topics.records.clone();
        let lag = tokio::task::spawn_blocking(move || consumer_lag(&settings, &group, &topic, 12))
            .await
            .expect("lag sample");
        lag_samples.push(lag);
    }
    stop.store(true, Ordering::Release);
    let sending_time = started.elapsed().as_secs_f64();
    let mut sent = BTreeMap::new();
    for (stream, sender) in streams.iter().zip(senders) {
        sent.insert(stream.clone(), sender.await.expect("sender task"));
    }
    let cuts = cutter.await.expect("cutter task");
    let total: usize = sent.values().map(Vec::len).sum();
    for stream in &streams {
        api.cut(stream).await;
    }

    // Caught up: the events account for every record (read from the events
    // only; the documents are read once, at the end).
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status}) while catching up");
        }
        let reported: u64 = read_all(&stack.kafka, &stack.topics.report_events, 3, true)
            .iter()
            .map(|event| {
                let event: serde_json::Value =
                    serde_json::from_slice(&event.payload).expect("event JSON");
                event["records"].as_u64().unwrap_or(0)
            })
            .sum();
        if reported >= total as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker did not catch up: {reported} of {total} records reported"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let catch_up = started.elapsed().as_secs_f64() - sending_time;
    let final_lag = {
        let settings = stack.kafka.clone();
        let group = stack.group.clone();
        let topic = stack.topics.records.clone();
        tokio::task::spawn_blocking(move || consumer_lag(&settings, &group, &topic, 12))
            .await
            .expect("final lag")
    };

    let peak = rss_samples.iter().map(|(_, mib)| *mib).fold(0.0, f64::max);
    let in_window = |from: f64, to: f64| -> Vec<f64> {
        rss_samples
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, mib)| *mib)
            .collect()
    };
    let baseline = median(&in_window(window, 2.0 * window));
    let last = median(&in_window(seconds as f64 - window, f64::MAX));
    let after_warm_up: Vec<(f64, f64)> = rss_samples
        .iter()
        .copied()
        .filter(|(at, _)| *at >= window)
        .collect();
    let trend = slope_per_minute(&after_warm_up);
    let max_lag = lag_samples.iter().copied().max().unwrap_or(0);
    quire_tests::figures(&format!(
        "soak: {seconds} s, {total} records over {STREAMS} streams at {:.0} records/s (target \
         {RATE}), {cuts} timed cuts; worker RSS peak {peak:.1} MiB, second-minute median \
         {baseline:.1} MiB, last-minute median {last:.1} MiB, trend {trend:+.2} MiB/min; max lag \
         {max_lag} (bound {MAX_LAG}), final lag {final_lag}; caught up {catch_up:.1} s after \
         the senders stopped",
        total as f64 / sending_time
    ));

    assert!(
        last <= baseline + RSS_MARGIN_MIB,
        "worker memory grew: last-minute median {last:.1} MiB > second-minute median \
         {baseline:.1} MiB + {RSS_MARGIN_MIB} MiB"
    );
    assert!(peak < RSS_PEAK_MIB, "worker RSS peaked at {peak:.1} MiB");
    assert!(
        max_lag < MAX_LAG,
        "lag reached {max_lag}, beyond {MAX_LAG}: the worker fell behind"
    );
    assert!(
        final_lag <= FINAL_LAG,
        "lag {final_lag} after everything was reported"
    );
    let observed = stack.observe().await;
    observed.assert_exactly_once(&sent);
    assert!(
        worker.exited().is_none(),
        "the worker exited during the soak"
    );
}

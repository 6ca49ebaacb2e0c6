//! The pipeline, measured: records of about 100 bytes through HTTP into
//! completed XML reports in S3, with one producer API and one report
//! generator (the real release binaries) on this machine, against plain
//! librdkafka produce and consume of the same records as the ceilings.
//!
//! Each row gives CPU per record per service, the records topic's bytes on
//! the broker's disk per record (after ingest alone) and the services' peak
//! RSS. Scenarios, in one run:
//! 1. ingest alone: every record over HTTP, no worker running;
//! 2. worker alone: every stream cut, then one `report-generator --drain` on
//!    what ingest queued, until it exits 0 (render, upload, commit);
//! 3. end to end: on fresh topics and bucket, a serving worker first, then
//!    the records as in (1), every stream cut, until every record is in a
//!    completed report; then again with the same records over
//!    `--many-streams` streams (1,000 by default: many more, smaller
//!    reports), its rate against (3)'s and the worker's CPU per report;
//! 4. the ceilings: plain idempotent produce (acks=all, no transactions) and
//!    a plain consume of the same record bytes, on 12 partitions; and the
//!    batch ceiling, plain produce of the same records framed as batch
//!    messages (`quire_messages::batch`, each request's records under
//!    `--batch-bytes`), what the API could reach once records travel so.
//!
//! Every scenario also gives the CPU time (user + system, from
//! `/proc/<pid>/stat`) the producer API and the report generator spent per
//! record: on 2 shared cores a far steadier figure than the wall time. The
//! whole sequence runs `--runs` times (3 by default); the table shows each
//! run and the last line the medians. The ceilings are measured the same
//! way in every run, on a topic of their own created for it: the consume
//! ceiling reads what the produce ceiling wrote moments before, so its data
//! is in the page cache (as the worker's is in the end to end scenario).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use bytes::Bytes;
use quire_tests::{ApiProcess, TestStack, release_binary};
use quire_tests::{TestTopic, kafka_settings, unique};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

#[derive(clap::Args, Clone)]
pub struct PipelineArgs {
    /// Records per scenario.
    #[arg(long, default_value_t = 1_000_000)]
    records: usize,
    /// Approximate size of one record's JSON object, in bytes.
    #[arg(long, default_value_t = 100)]
    record_bytes: usize,
    /// Streams the records are spread over.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Concurrent HTTP client tasks (connections) sending records.
    #[arg(long, default_value_t = 12)]
    connections: usize,
    /// Records per request (one JSON array).
    #[arg(long, default_value_t = 500)]
    array: usize,
    /// Partitions of the ceiling topic (the records topic has 12).
    #[arg(long, default_value_t = 12)]
    ceiling_partitions: i32,
    /// The byte bound of a batch message in the batch ceiling: plain
    /// librdkafka producing each request's records framed as quire's batch
    /// messages (`quire_messages::batch`), as few messages as this allows.
    #[arg(long, default_value_t = 256 * 1024)]
    batch_bytes: usize,
    /// Upper bound of each scenario, in seconds: past it the benchmark fails
    /// rather than hang.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Times the whole sequence runs; the last line gives the medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    runs: u64,
    /// Another build of the producer API to measure against in the same
    /// runs (a copy of `target/release/producer-api` from before a change):
    /// each run then goes through the three scenarios with the baseline
    /// builds and with the workspace's, in turns, and the last line gives
    /// the CPU ratios.
    #[arg(long)]
    baseline_api: Option<PathBuf>,
    /// The same for the report generator.
    #[arg(long)]
    baseline_worker: Option<PathBuf>,
    /// Streams of the second end to end scenario, the same records spread
    /// over many streams (so many more, smaller reports); 0 leaves it out.
    #[arg(long, default_value_t = 1_000)]
    many_streams: usize,
    /// The producer API's `compression.type` (none, lz4, zstd, gzip,
    /// snappy), for both builds; its own default when absent.
    #[arg(long)]
    compression: Option<String>,
    /// The local stack's Kafka log directory: the bytes the records topic
    /// takes on the broker's disk after "ingest alone" are read there.
    #[arg(long, default_value = ".stack/run/kafka/data")]
    kafka_data_dir: PathBuf,
}

/// Which builds of the services a scenario runs.
#[derive(Clone, Copy, PartialEq)]
enum Builds {
    /// The workspace's release binaries.
    Workspace,
    /// `--baseline-api` / `--baseline-worker` where given, else the
    /// workspace's.
    Baseline,
}

struct Row {
    name: &'static str,
    builds: Builds,
    records: usize,
    seconds: f64,
    /// CPU time of the producer API during the scenario, if it ran.
    api_cpu: Option<Duration>,
    /// CPU time of the report generator during the scenario, if it ran.
    worker_cpu: Option<Duration>,
    /// Bytes the records topic takes on the broker's disk afterwards.
    disk_bytes: Option<u64>,
    /// Peak resident memory (VmHWM) of the API and of the report
    /// generator at the scenario's end, where they ran.
    api_rss: Option<u64>,
    worker_rss: Option<u64>,
    /// Reports completed in the scenario, where it counts them.
    reports: Option<usize>,
}

/// The peak resident memory of process `pid` so far (VmHWM), in bytes;
/// `None` once it has exited.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// Bytes of the log segments of `topic` under Kafka's log directory
/// `data_dir` (every partition's `{topic}-{n}` directory).
fn topic_disk_bytes(data_dir: &std::path::Path, topic: &str) -> anyhow::Result<u64> {
    let mut bytes = 0;
    let prefix = format!("{topic}-");
    for entry in std::fs::read_dir(data_dir)
        .with_context(|| format!("reading Kafka's log directory {}", data_dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name();
        let Some(partition) = name.to_str().and_then(|name| name.strip_prefix(&prefix)) else {
            continue;
        };
        if partition.parse::<u32>().is_err() {
            continue;
        }
        for segment in std::fs::read_dir(entry.path())? {
            let segment = segment?;
            if segment
                .path()
                .extension()
                .is_some_and(|extension| extension == "log")
            {
                bytes += segment.metadata()?.len();
            }
        }
    }
    Ok(bytes)
}

/// CPU time (user + system) process `pid` has used so far, from
/// `/proc/<pid>/stat` (fields 14 and 15, in clock ticks).
pub(crate) fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from its ')'.
    let after = &stat[stat.rfind(')').context("no ')' in /proc/<pid>/stat")? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    ensure!(fields.len() > 12, "short /proc/{pid}/stat: {stat}");
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(Duration::from_secs_f64(
        ticks as f64 / clock_ticks_per_second()?,
    ))
}

/// `getconf CLK_TCK` (100 on Linux here), asked once.
fn clock_ticks_per_second() -> anyhow::Result<f64> {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    if let Some(ticks) = TICKS.get() {
        return Ok(*ticks);
    }
    let output = Command::new("getconf").arg("CLK_TCK").output()?;
    let ticks: f64 = String::from_utf8_lossy(&output.stdout).trim().parse()?;
    ensure!(ticks > 0.0, "getconf CLK_TCK answered {ticks}");
    Ok(*TICKS.get_or_init(|| ticks))
}

/// CPU microseconds per record.
fn per_record(cpu: Duration, records: usize) -> f64 {
    cpu.as_secs_f64() * 1e6 / records as f64
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

impl Row {
    fn rate(&self) -> f64 {
        self.records as f64 / self.seconds
    }
}

/// One request: its stream and its body (a JSON array), serialized up front
/// so the client's own work while timing is only HTTP.
struct Request {
    stream: String,
    body: Bytes,
}

/// The records to send: `requests` and, for the ceilings, every record's
/// (key, bytes) in the same order.
struct Workload {
    streams: Vec<String>,
    requests: Vec<Request>,
    messages: Vec<(String, Vec<u8>)>,
    /// The same records as batch messages: each request's records, in
    /// order, packed under `--batch-bytes`.
    batches: Vec<(String, Vec<u8>)>,
}

fn stream_name(index: usize) -> String {
    format!("bench-{index}")
}

/// One record: `{"stream":"bench-3","seq":123,"payload":"xxx..."}`, padded to
/// about `size` bytes.
fn record(stream: &str, seq: u64, size: usize) -> Vec<u8> {
    let bare = format!(r#"{{"stream":"{stream}","seq":{seq},"payload":""}}"#);
    let padding = size.saturating_sub(bare.len()).max(1);
    format!(
        r#"{{"stream":"{stream}","seq":{seq},"payload":"{}"}}"#,
        "x".repeat(padding)
    )
    .into_bytes()
}

impl Workload {
    /// Request `i` goes to stream `i % streams`; each stream's `seq` counts
    /// from 0 in the order its requests are built.
    fn build(args: &PipelineArgs, streams: usize) -> Workload {
        let streams: Vec<String> = (0..streams).map(stream_name).collect();
        let mut next_seq = vec![0_u64; streams.len()];
        let mut requests = Vec::new();
        let mut messages = Vec::with_capacity(args.records);
        let mut batches = Vec::new();
        let mut sent = 0;
        while sent < args.records {
            let count = args.array.min(args.records - sent);
            let index = requests.len() % streams.len();
            let stream = &streams[index];
            let mut body = Vec::with_capacity(count * (args.record_bytes + 1) + 2);
            body.push(b'[');
            let first = messages.len();
            for position in 0..count {
                let bytes = record(stream, next_seq[index], args.record_bytes);
                next_seq[index] += 1;
                if position > 0 {
                    body.push(b',');
                }
                body.extend_from_slice(&bytes);
                messages.push((stream.clone(), bytes));
            }
            body.push(b']');
            let records = messages[first..].iter().map(|(_, bytes)| bytes.as_slice());
            for batch in quire_messages::batch::pack(records, args.batch_bytes) {
                batches.push((stream.clone(), batch));
            }
            requests.push(Request {
                stream: stream.clone(),
                body: Bytes::from(body),
            });
            sent += count;
        }
        Workload {
            streams,
            requests,
            messages,
            batches,
        }
    }
}

pub async fn run(args: PipelineArgs) -> anyhow::Result<()> {
    ensure!(
        args.records > 1 && args.streams > 0 && args.connections > 0 && args.array > 0,
        "--records must be above 1, --streams, --connections and --array above 0"
    );
    let limit = Duration::from_secs(args.timeout_secs);
    // Both services are built (or this stops here, saying how to build them).
    release_binary("producer-api");
    release_binary("report-generator");
    for baseline in [&args.baseline_api, &args.baseline_worker]
        .into_iter()
        .flatten()
    {
        ensure!(
            baseline.is_file(),
            "the baseline build {} is not a file",
            baseline.display()
        );
    }
    let workload = Arc::new(Workload::build(&args, args.streams));
    let many = (args.many_streams > 0).then(|| Arc::new(Workload::build(&args, args.many_streams)));
    eprintln!(
        "pipeline benchmark: {} records of ~{} bytes ({} bytes each as sent), {} streams, \
         {} connections, arrays of {} ({} requests)",
        args.records,
        args.record_bytes,
        workload.messages[0].1.len(),
        args.streams,
        args.connections,
        args.array,
        workload.requests.len()
    );
    let mut runs: Vec<Vec<Row>> = Vec::new();
    for run in 1..=args.runs {
        eprintln!("run {run} of {}", args.runs);
        runs.push(one_run(&args, &workload, many.as_ref(), limit, run).await?);
    }
    report(&runs);
    Ok(())
}

/// The ceilings and the three scenarios, once.
async fn one_run(
    args: &PipelineArgs,
    workload: &Arc<Workload>,
    many: Option<&Arc<Workload>>,
    limit: Duration,
    run: u64,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();

    // The ceilings first, on a topic of their own.
    {
        let topic = TestTopic::create("bench-pipeline-ceiling", args.ceiling_partitions).await;
        let name = topic.name.clone();
        let produced = Arc::clone(workload);
        let seconds =
            tokio::task::spawn_blocking(move || ceiling_produce(&name, &produced.messages, limit))
                .await??;
        rows.push(Row {
            name: "ceiling produce (plain librdkafka, idempotent, acks=all)",
            records: args.records,
            seconds,
            builds: Builds::Workspace,
            api_cpu: None,
            worker_cpu: None,
            disk_bytes: None,
            api_rss: None,
            worker_rss: None,
            reports: None,
        });
        eprintln!("  ceiling produce: {seconds:.3} s");
        let batches = TestTopic::create("bench-pipeline-batches", args.ceiling_partitions).await;
        let name = batches.name.clone();
        let produced = Arc::clone(workload);
        let seconds =
            tokio::task::spawn_blocking(move || ceiling_produce(&name, &produced.batches, limit))
                .await??;
        rows.push(Row {
            name: "ceiling produce, batch messages (the same records, framed)",
            records: args.records,
            seconds,
            builds: Builds::Workspace,
            api_cpu: None,
            worker_cpu: None,
            disk_bytes: None,
            api_rss: None,
            worker_rss: None,
            reports: None,
        });
        eprintln!(
            "  ceiling produce, batches: {seconds:.3} s, {} messages",
            workload.batches.len()
        );
        let name = topic.name.clone();
        let (partitions, records) = (args.ceiling_partitions, args.records);
        let (read, seconds) =
            tokio::task::spawn_blocking(move || ceiling_consume(&name, partitions, records, limit))
                .await??;
        ensure!(
            read == records,
            "ceiling consume: read {read} of the {records} records produced"
        );
        rows.push(Row {
            name: "ceiling consume (plain librdkafka)",
            records: read,
            seconds,
            builds: Builds::Workspace,
            api_cpu: None,
            worker_cpu: None,
            disk_bytes: None,
            api_rss: None,
            worker_rss: None,
            reports: None,
        });
        eprintln!("  ceiling consume: {seconds:.3} s");
    }

    // With a baseline, both builds in turns: the baseline first in odd
    // runs, the workspace's first in even ones, so neither always has the
    // warmer or the quieter slot.
    let mut order = vec![Builds::Workspace];
    if args.baseline_api.is_some() || args.baseline_worker.is_some() {
        order.push(Builds::Baseline);
        if run % 2 == 1 {
            order.reverse();
        }
    }
    for builds in order {
        if builds == Builds::Baseline {
            eprintln!("  with the baseline builds:");
        }
        rows.extend(scenarios(args, workload, many, limit, builds).await?);
    }
    Ok(rows)
}

/// Scenarios 1 to 3 with `builds` of the services, and 3 again over
/// `many` streams.
async fn scenarios(
    args: &PipelineArgs,
    workload: &Arc<Workload>,
    many: Option<&Arc<Workload>>,
    limit: Duration,
    builds: Builds,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let (api_binary, worker_binary) = match builds {
        Builds::Workspace => (None, None),
        Builds::Baseline => (
            args.baseline_api.as_deref(),
            args.baseline_worker.as_deref(),
        ),
    };

    // 1 and 2: ingest alone, then the worker alone on what ingest queued.
    {
        let stack = TestStack::create("bench-pipeline").await;
        let api = start_api(&stack, limit, api_binary, args).await?;
        let api_before = cpu_time(api.pid)?;
        let seconds = ingest(&api.client, workload, args.connections, limit).await?;
        let api_cpu = cpu_time(api.pid)? - api_before;
        let disk_bytes = topic_disk_bytes(&args.kafka_data_dir, &stack.topics.records)?;
        rows.push(Row {
            name: "ingest alone (HTTP -> API -> Kafka, no worker)",
            records: args.records,
            seconds,
            builds,
            api_cpu: Some(api_cpu),
            worker_cpu: None,
            disk_bytes: Some(disk_bytes),
            api_rss: peak_rss(api.pid),
            worker_rss: None,
            reports: None,
        });
        eprintln!("  ingest alone: {seconds:.3} s");
        for stream in &workload.streams {
            api.client.cut(stream).await?;
        }
        let mut worker = spawn_worker(&stack, "bench-drain", true, worker_binary)?;
        let started = Instant::now();
        let code = worker.wait(limit).await?;
        let seconds = started.elapsed().as_secs_f64();
        ensure!(
            code == Some(0),
            "report-generator --drain exited with {code:?}, not 0"
        );
        let mut manifests = Manifests::default();
        let reported = manifests.refresh(&stack).await?;
        ensure!(
            reported == args.records as u64,
            "worker alone: the reports hold {reported} records, {} were sent ({} manifests)",
            args.records,
            manifests.read.len()
        );
        manifests.check_streams(&workload.streams)?;
        rows.push(Row {
            name: "worker alone (--drain: render, upload, commit)",
            records: args.records,
            seconds,
            builds,
            api_cpu: None,
            // Its whole life, start-up and take-over included.
            worker_cpu: Some(worker.cpu),
            disk_bytes: None,
            api_rss: None,
            worker_rss: Some(worker.peak_rss),
            reports: None,
        });
        eprintln!(
            "  worker alone: {seconds:.3} s, {} reports",
            manifests.read.len()
        );
    }

    // 3: end to end, and again over many streams.
    let binaries = (api_binary, worker_binary);
    let e2e = "end to end (HTTP -> completed reports in S3)";
    rows.push(end_to_end(args, workload, limit, builds, binaries, e2e).await?);
    if let Some(many) = many {
        let name = "end to end, many streams (--many-streams)";
        rows.push(end_to_end(args, many, limit, builds, binaries, name).await?);
    }
    Ok(rows)
}

/// Scenario 3: end to end on a fresh stack, a worker already serving,
/// `workload` sent and cut; its row named `name`.
async fn end_to_end(
    args: &PipelineArgs,
    workload: &Arc<Workload>,
    limit: Duration,
    builds: Builds,
    (api_binary, worker_binary): (Option<&std::path::Path>, Option<&std::path::Path>),
    name: &'static str,
) -> anyhow::Result<Row> {
    let stack = TestStack::create("bench-pipeline-e2e").await;
    let api = start_api(&stack, limit, api_binary, args).await?;
    let spawned = Instant::now();
    let mut worker = spawn_worker(&stack, "bench-serve", false, worker_binary)?;
    wait_for_member(&stack.group, &mut worker, limit).await?;
    // A serving worker has its partitions in hand: one record of a
    // stream of its own, cut, and its report completed, prove it (the
    // start-up and the take-over are not part of the end to end time).
    let mut manifests = Manifests::default();
    let warm_up = "bench-warm-up".to_owned();
    api.client
        .send(
            &warm_up,
            Bytes::from(format!(
                "[{}]",
                String::from_utf8(record(&warm_up, 0, 100))?
            )),
        )
        .await?;
    api.client.cut(&warm_up).await?;
    while manifests.refresh(&stack).await? < 1 {
        if let Some(code) = worker.exited()? {
            bail!("the serving report-generator exited with {code:?} during the warm-up");
        }
        ensure!(
            spawned.elapsed() < limit,
            "the serving report-generator did not complete the warm-up report within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "  end to end: the serving worker started, joined, took its partitions and \
         completed a warm-up report in {:.3} s",
        spawned.elapsed().as_secs_f64()
    );
    let api_before = cpu_time(api.pid)?;
    let worker_before = cpu_time(worker.child.id())?;
    let started = Instant::now();
    ingest(&api.client, workload, args.connections, limit).await?;
    let ingested = started.elapsed().as_secs_f64();
    for stream in &workload.streams {
        api.client.cut(stream).await?;
    }
    loop {
        // Less the warm-up's record.
        let reported = manifests.refresh(&stack).await? - 1;
        if reported >= args.records as u64 {
            ensure!(
                reported == args.records as u64,
                "end to end: the reports hold {reported} records, {} were sent",
                args.records
            );
            break;
        }
        if let Some(code) = worker.exited()? {
            bail!("the serving report-generator exited with {code:?} at {reported} records");
        }
        ensure!(
            started.elapsed() < limit,
            "end to end: only {reported} of {} records reported after {limit:?}",
            args.records
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let api_cpu = cpu_time(api.pid)? - api_before;
    let worker_cpu = cpu_time(worker.child.id())? - worker_before;
    let mut streams = workload.streams.clone();
    streams.push(warm_up);
    manifests.check_streams(&streams)?;
    let row = Row {
        name,
        records: args.records,
        seconds,
        builds,
        api_cpu: Some(api_cpu),
        worker_cpu: Some(worker_cpu),
        disk_bytes: None,
        api_rss: peak_rss(api.pid),
        worker_rss: peak_rss(worker.child.id()),
        reports: Some(manifests.read.len() - 1),
    };
    eprintln!(
        "  {name}: {seconds:.3} s (ingest part {ingested:.3} s), {} reports",
        manifests.read.len() - 1
    );
    let code = worker.terminate(Duration::from_secs(60)).await?;
    ensure!(
        code == Some(0),
        "the serving report-generator exited with {code:?} on SIGTERM"
    );
    Ok(row)
}

/// Each run's table, then one line of medians.
fn report(runs: &[Vec<Row>]) {
    let cpu = |cpu: Option<Duration>, records: usize| {
        cpu.map(|cpu| format!("{:.2}", per_record(cpu, records)))
            .unwrap_or_else(|| "-".to_owned())
    };
    println!(
        "{:<4} {:<70} {:>9} {:>8} {:>10} {:>12} {:>12} {:>10} {:>11} {:>11}",
        "run",
        "scenario",
        "records",
        "seconds",
        "records/s",
        "api cpu-us/r",
        "wkr cpu-us/r",
        "disk B/r",
        "api RSS MiB",
        "wkr RSS MiB"
    );
    let mib = |bytes: Option<u64>| {
        bytes
            .map(|bytes| format!("{}", bytes / (1024 * 1024)))
            .unwrap_or_else(|| "-".to_owned())
    };
    for (index, rows) in runs.iter().enumerate() {
        for row in rows {
            let name = match row.builds {
                Builds::Workspace => row.name.to_owned(),
                Builds::Baseline => format!("{} [baseline]", row.name),
            };
            println!(
                "{:<4} {:<70} {:>9} {:>8.3} {:>10.0} {:>12} {:>12} {:>10} {:>11} {:>11}",
                index + 1,
                name,
                row.records,
                row.seconds,
                row.rate(),
                cpu(row.api_cpu, row.records),
                cpu(row.worker_cpu, row.records),
                row.disk_bytes
                    .map(|bytes| format!("{:.1}", bytes as f64 / row.records as f64))
                    .unwrap_or_else(|| "-".to_owned()),
                mib(row.api_rss),
                mib(row.worker_rss),
            );
        }
    }
    let find_in = |rows: &'_ [Row], prefix: &str, builds: Builds| -> usize {
        rows.iter()
            .position(|row| row.builds == builds && row.name.starts_with(prefix))
            .expect("scenario ran")
    };
    let find = |rows: &'_ [Row], prefix: &str| find_in(rows, prefix, Builds::Workspace);
    let median_of =
        |value: &dyn Fn(&[Row]) -> f64| median(runs.iter().map(|rows| value(rows)).collect());
    let rate = |prefix: &'static str| move |rows: &[Row]| rows[find(rows, prefix)].rate();
    let e2e = median_of(&rate("end to end"));
    let ingest_over_ceiling =
        median_of(&|rows: &[Row]| rate("ingest alone")(rows) / rate("ceiling produce")(rows));
    let worker_over_ceiling =
        median_of(&|rows: &[Row]| rate("worker alone")(rows) / rate("ceiling consume")(rows));
    let e2e_over_ceiling =
        median_of(&|rows: &[Row]| rate("end to end")(rows) / rate("ceiling produce")(rows));
    let batch_ceiling_over_ceiling = median_of(&|rows: &[Row]| {
        rate("ceiling produce, batch")(rows) / rate("ceiling produce")(rows)
    });
    let worker_records_per_s = median_of(&rate("worker alone"));
    // The most any run's workspace build held, in any scenario.
    let peak_of = |rss: fn(&Row) -> Option<u64>| {
        runs.iter()
            .flatten()
            .filter(|row| row.builds == Builds::Workspace)
            .filter_map(rss)
            .max()
            .unwrap_or_default()
            / (1024 * 1024)
    };
    let api_peak_rss_mib = peak_of(|row| row.api_rss);
    // Over many streams: the rate against the 8-stream end to end of the
    // same run, and the worker's CPU per report.
    let mut many = String::new();
    if runs[0]
        .iter()
        .any(|row| row.name.starts_with("end to end, many"))
    {
        let many_over =
            median_of(&|rows: &[Row]| rate("end to end, many")(rows) / rate("end to end (")(rows));
        let per_report = median_of(&|rows: &[Row]| {
            let row = &rows[find(rows, "end to end, many")];
            row.worker_cpu.unwrap_or_default().as_secs_f64() * 1e3
                / row.reports.unwrap_or(1).max(1) as f64
        });
        many = format!(
            " many_streams_e2e_over_e2e={many_over:.2} many_streams_worker_cpu_ms_per_report={per_report:.3}"
        );
    }
    let worker_peak_rss_mib = peak_of(|row| row.worker_rss);
    let disk_per_record = median_of(&|rows: &[Row]| {
        let row = &rows[find(rows, "ingest alone")];
        row.disk_bytes.unwrap_or_default() as f64 / row.records as f64
    });
    let api_cpu = median_of(&|rows: &[Row]| {
        let row = &rows[find(rows, "ingest alone")];
        per_record(row.api_cpu.unwrap_or_default(), row.records)
    });
    let worker_cpu = median_of(&|rows: &[Row]| {
        let row = &rows[find(rows, "worker alone")];
        per_record(row.worker_cpu.unwrap_or_default(), row.records)
    });
    // With a baseline: each run's CPU per record of the workspace's build
    // over the baseline's, in the scenario where the service runs alone.
    let mut baseline = String::new();
    if runs[0].iter().any(|row| row.builds == Builds::Baseline) {
        let cpu_of = |rows: &[Row], prefix: &str, builds: Builds, api: bool| {
            let row = &rows[find_in(rows, prefix, builds)];
            let cpu = if api { row.api_cpu } else { row.worker_cpu };
            per_record(cpu.unwrap_or_default(), row.records)
        };
        let over = |prefix: &'static str, api: bool| {
            median_of(&|rows: &[Row]| {
                cpu_of(rows, prefix, Builds::Workspace, api)
                    / cpu_of(rows, prefix, Builds::Baseline, api)
            })
        };
        let baseline_api =
            median_of(&|rows: &[Row]| cpu_of(rows, "ingest alone", Builds::Baseline, true));
        let baseline_worker =
            median_of(&|rows: &[Row]| cpu_of(rows, "worker alone", Builds::Baseline, false));
        let rate_over = |prefix: &'static str| {
            median_of(&|rows: &[Row]| {
                rows[find_in(rows, prefix, Builds::Workspace)].rate()
                    / rows[find_in(rows, prefix, Builds::Baseline)].rate()
            })
        };
        baseline = format!(
            " baseline_api_cpu_us_per_record={baseline_api:.2} \
             baseline_worker_cpu_us_per_record={baseline_worker:.2} \
             api_cpu_over_baseline={:.2} worker_cpu_over_baseline={:.2} \
             ingest_rate_over_baseline={:.2} worker_rate_over_baseline={:.2} \
             e2e_rate_over_baseline={:.2}",
            over("ingest alone", true),
            over("worker alone", false),
            rate_over("ingest alone"),
            rate_over("worker alone"),
            rate_over("end to end"),
        );
    }
    println!(
        "pipeline runs={} e2e_records_per_s={e2e:.0} ingest_over_ceiling={ingest_over_ceiling:.2} \
         worker_over_ceiling={worker_over_ceiling:.2} api_cpu_us_per_record={api_cpu:.2} \
         worker_cpu_us_per_record={worker_cpu:.2} worker_records_per_s={worker_records_per_s:.0} \
         e2e_over_ceiling={e2e_over_ceiling:.2} disk_bytes_per_record={disk_per_record:.1} \
         api_peak_rss_mib={api_peak_rss_mib} worker_peak_rss_mib={worker_peak_rss_mib} \
         batch_ceiling_over_ceiling={batch_ceiling_over_ceiling:.2}{many}{baseline}",
        runs.len()
    );
}

/// Sends every request of `workload`, `connections` at a time; the seconds
/// until every one was answered 200.
async fn ingest(
    api: &ApiClient,
    workload: &Arc<Workload>,
    connections: usize,
    limit: Duration,
) -> anyhow::Result<f64> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (api, workload, next) = (api.clone(), Arc::clone(workload), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(request) = workload.requests.get(index) else {
                    return Ok::<(), anyhow::Error>(());
                };
                api.send(&request.stream, request.body.clone()).await?;
            }
        }));
    }
    let all = futures::future::try_join_all(tasks);
    let results = tokio::time::timeout(limit, all)
        .await
        .map_err(|_| anyhow!("ingest did not finish within {limit:?}"))??;
    for result in results {
        result?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The completed reports' manifests, read once each.
#[derive(Default)]
struct Manifests {
    /// manifest key -> (stream, records)
    read: BTreeMap<String, (String, u64)>,
}

impl Manifests {
    /// Reads the manifests not read yet; the records of all of them.
    async fn refresh(&mut self, stack: &TestStack) -> anyhow::Result<u64> {
        for key in stack.bucket.list("manifests/").await {
            if self.read.contains_key(&key) {
                continue;
            }
            let bytes = stack
                .bucket
                .read(&key)
                .await
                .ok_or_else(|| anyhow!("manifest {key} listed but not readable"))?;
            let manifest: serde_json::Value =
                serde_json::from_slice(&bytes).with_context(|| format!("manifest {key}"))?;
            let records = manifest["records"]
                .as_u64()
                .ok_or_else(|| anyhow!("manifest {key} has no record count: {manifest}"))?;
            let stream = manifest["stream"].as_str().unwrap_or_default().to_owned();
            self.read.insert(key, (stream, records));
        }
        Ok(self.read.values().map(|(_, records)| records).sum())
    }

    /// Every stream sent to has at least one report, and no other stream has.
    fn check_streams(&self, streams: &[String]) -> anyhow::Result<()> {
        let reported: BTreeSet<&str> = self.read.values().map(|(s, _)| s.as_str()).collect();
        let sent: BTreeSet<&str> = streams.iter().map(String::as_str).collect();
        ensure!(
            reported == sent,
            "reports are of streams {reported:?}, records were sent to {sent:?}"
        );
        Ok(())
    }
}

/// Waits (bounded) until the worker is a member of its group, so the end to
/// end time does not count its start-up and first join.
async fn wait_for_member(group: &str, worker: &mut Service, limit: Duration) -> anyhow::Result<()> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka_settings().bootstrap_servers);
    let client: BaseConsumer = config.create()?;
    let started = Instant::now();
    loop {
        if let Some(code) = worker.exited()? {
            bail!("the serving report-generator exited with {code:?} before joining its group");
        }
        let stable = tokio::task::block_in_place(|| {
            client
                .fetch_group_list(Some(group), Duration::from_secs(5))
                .map(|list| {
                    list.groups()
                        .iter()
                        .any(|found| found.state() == "Stable" && !found.members().is_empty())
                })
                .unwrap_or(false)
        });
        if stable {
            return Ok(());
        }
        ensure!(
            started.elapsed() < limit.min(Duration::from_secs(60)),
            "the serving report-generator did not join group {group} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Plain idempotent produce of `messages`, keyed by stream: seconds until
/// every one is delivered.
fn ceiling_produce(
    topic: &str,
    messages: &[(String, Vec<u8>)],
    limit: Duration,
) -> anyhow::Result<f64> {
    let producer: FutureProducer = crate::queue::ceiling_config().create()?;
    let started = Instant::now();
    let mut deliveries = Vec::with_capacity(messages.len());
    for (key, payload) in messages {
        let mut record = FutureRecord::to(topic).key(key.as_str()).payload(payload);
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    deliveries.push(delivery);
                    break;
                }
                // The local queue is full: let deliveries drain it.
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    returned,
                )) => {
                    ensure!(started.elapsed() < limit, "ceiling produce stalled");
                    producer.poll(Duration::from_millis(10));
                    record = returned;
                }
                Err((error, _)) => return Err(error.into()),
            }
        }
    }
    producer.flush(limit)?;
    for delivery in deliveries {
        futures::executor::block_on(delivery)?.map_err(|(error, _)| error)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// A plain consumer assigned every partition from the beginning: messages
/// read after the first one, and the seconds from the first one on (timing
/// starts once messages flow, as for the array consumer). The ceiling of
/// both the queue and the pipeline benchmarks.
pub(crate) fn ceiling_consume(
    topic: &str,
    partitions: i32,
    records: usize,
    limit: Duration,
) -> anyhow::Result<(usize, f64)> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka_settings().bootstrap_servers)
        .set("group.id", unique("bench-pipeline-ceiling"))
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = config.create()?;
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    // Timed from the assignment to the last record, every record counted
    // (earlier this was timed from the first record's arrival and left that
    // one out: 999,999 of 1,000,000, and a rate that swung with how long
    // the first fetch took).
    let started = Instant::now();
    let mut read = 0;
    while read < records {
        ensure!(
            started.elapsed() < limit,
            "ceiling consume stalled at {read} of {records}"
        );
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            message?;
            read += 1;
        }
    }
    Ok((read, started.elapsed().as_secs_f64()))
}

/// The producer API of `stack`, healthy (bounded by `limit` and 60 s).
/// Each scenario cuts every one of `streams` once, at once: its
/// per-principal control limit (600 a minute by default) is raised to let
/// them through, as an operator would for such a client, so the figures
/// measure the pipeline rather than the rate limit.
async fn start_api(
    stack: &TestStack,
    limit: Duration,
    binary: Option<&std::path::Path>,
    args: &PipelineArgs,
) -> anyhow::Result<Api> {
    // Cuts are rate-limited per principal: room for every stream's.
    let streams = args.streams.max(args.many_streams);
    let mut launch = stack.api();
    if let Some(compression) = &args.compression {
        launch
            .settings
            .kafka
            .properties
            .insert("compression.type".to_owned(), compression.clone());
    }
    let principal = &mut launch
        .settings
        .api
        .control_requests_per_minute_per_principal;
    let needed = u32::try_from(streams.saturating_mul(4)).unwrap_or(u32::MAX);
    *principal =
        (*principal).max(std::num::NonZeroU32::new(needed).unwrap_or(std::num::NonZeroU32::MIN));
    let process = launch
        .binary(binary)
        .try_start_api(limit.min(Duration::from_secs(60)))
        .await
        .map_err(|error| anyhow!(error))?;
    Ok(Api {
        pid: process.pid(),
        client: ApiClient {
            base: process.base.clone(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()?,
        },
        _process: process,
    })
}

/// Report generator `replica` of `stack` (`--drain` if `drain`).
fn spawn_worker(
    stack: &TestStack,
    replica: &str,
    drain: bool,
    binary: Option<&std::path::Path>,
) -> anyhow::Result<Service> {
    let mut launch = stack.worker(replica).binary(binary);
    if drain {
        launch = launch.drain();
    }
    Service::spawn(launch.command().stdout(Stdio::null()), "report-generator")
}

/// A child process, killed when dropped.
struct Service {
    child: Child,
    name: &'static str,
    /// Its CPU time when last looked at (just before it was reaped, once
    /// it has exited: an exited child's `/proc` entry holds its final
    /// times until it is reaped).
    cpu: Duration,
    /// Its peak resident memory when last looked at (a process that has
    /// exited has none left to read).
    peak_rss: u64,
}

impl Service {
    fn spawn(command: &mut Command, name: &'static str) -> anyhow::Result<Service> {
        Ok(Service {
            child: command.spawn().with_context(|| format!("start {name}"))?,
            name,
            cpu: Duration::ZERO,
            peak_rss: 0,
        })
    }

    /// `Some(exit code)` once the process has exited.
    fn exited(&mut self) -> anyhow::Result<Option<Option<i32>>> {
        if let Ok(cpu) = cpu_time(self.child.id()) {
            self.cpu = cpu;
        }
        if let Some(rss) = peak_rss(self.child.id()) {
            self.peak_rss = self.peak_rss.max(rss);
        }
        Ok(self.child.try_wait()?.map(|status| status.code()))
    }

    /// Waits (bounded) for the process to exit; its exit code.
    async fn wait(&mut self, limit: Duration) -> anyhow::Result<Option<i32>> {
        let started = Instant::now();
        loop {
            if let Some(code) = self.exited()? {
                return Ok(code);
            }
            if started.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("{} did not exit within {limit:?}; killed", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then waits (bounded); the exit code.
    async fn terminate(&mut self, limit: Duration) -> anyhow::Result<Option<i32>> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        ensure!(status.success(), "kill -TERM {} failed", self.child.id());
        self.wait(limit).await
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The producer API's address and an HTTP client (cheap to clone).
#[derive(Clone)]
struct ApiClient {
    base: String,
    http: reqwest::Client,
}

/// The producer API: a client and its process (killed when dropped).
struct Api {
    client: ApiClient,
    pid: u32,
    _process: ApiProcess,
}

impl ApiClient {
    /// Posts one JSON array; fails unless it is answered 200.
    async fn send(&self, stream: &str, body: Bytes) -> anyhow::Result<()> {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/records", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .with_context(|| format!("records request to {stream}"))?;
        let status = response.status();
        let answer = response.bytes().await?;
        ensure!(
            status.as_u16() == 200,
            "records to {stream} answered {status}: {}",
            String::from_utf8_lossy(&answer)
        );
        Ok(())
    }

    /// Cuts the stream (a marker after everything accepted so far).
    async fn cut(&self, stream: &str) -> anyhow::Result<()> {
        let response = self
            .http
            .post(format!("{}/v1/streams/{stream}/reports", self.base))
            .send()
            .await
            .with_context(|| format!("cut of {stream}"))?;
        let status = response.status();
        ensure!(
            status.as_u16() == 202,
            "cut of {stream} answered {status}: {}",
            response.text().await.unwrap_or_default()
        );
        Ok(())
    }
}

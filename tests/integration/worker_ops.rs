//! Operating the report generator: its metrics, health and readiness
//! endpoints, against the real Kafka and S3 server, with the real binaries.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_tests::unique;
use quire_tests::{TestStack, records};
use report_generator::Mode;

const LONG: Duration = Duration::from_secs(90);

/// The samples of a Prometheus / OpenMetrics text exposition:
/// `name{labels}` -> value.
fn parse_exposition(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The samples of one metric family: its series' labels (`{...}`, or the
/// empty string) -> value.
fn family(samples: &BTreeMap<String, f64>, name: &str) -> BTreeMap<String, f64> {
    samples
        .iter()
        .filter_map(|(series, value)| {
            let labels = series.strip_prefix(name)?;
            (labels.is_empty() || labels.starts_with('{')).then(|| (labels.to_owned(), *value))
        })
        .collect()
}

async fn get(http: &reqwest::Client, url: &str) -> (u16, String) {
    match http.get(url).send().await {
        Ok(response) => (
            response.status().as_u16(),
            response.text().await.unwrap_or_default(),
        ),
        Err(error) => (0, error.to_string()),
    }
}

/// Polls `url` until `done(status, body)` holds (bounded); the last answer.
async fn wait_until(
    http: &reqwest::Client,
    url: &str,
    what: &str,
    done: impl Fn(u16, &str) -> bool,
) -> (u16, String) {
    let deadline = Instant::now() + LONG;
    loop {
        let (status, body) = get(http, url).await;
        if done(status, &body) {
            return (status, body);
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: last answer {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_reports_records_reports_and_lag_and_answers_health_checks() {
    let stack = TestStack::create("ops-metrics").await;
    let api = stack.start_api().await;
    // In process: Application::build binds the monitoring port first and
    // says which it is, no log to scrape.
    let mut settings = stack.worker_settings("ops-1");
    settings.worker.statistics_interval = Duration::from_millis(300);
    let worker = stack.start_worker_in_process(settings, Mode::Serve).await;
    let base = worker.base_url();
    let http = reqwest::Client::new();

    let (status, body) = get(&http, &format!("{base}/healthz")).await;
    assert_eq!(status, 200, "healthz: {body}");
    // Ready once it holds its assignment (all 12 partitions: it is alone).
    let (_, body) = wait_until(
        &http,
        &format!("{base}/readyz"),
        "readiness",
        |status, _| status == 200,
    )
    .await;
    let readiness: serde_json::Value = serde_json::from_str(&body).expect("readyz JSON");
    assert_eq!(readiness["status"], "ready");
    assert_eq!(readiness["partitions"], 12, "{body}");

    let streams: Vec<String> = (0..3)
        .map(|n| {
            format!(
                "ops-{n}-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        })
        .collect();
    let mut sent = BTreeMap::new();
    for stream in &streams {
        api.send_ok(stream, &records(stream, 0, 40)).await;
        api.send_ok(stream, &records(stream, 40, 20)).await;
        api.cut(stream).await;
        sent.insert(stream.clone(), (0..60).collect::<Vec<u64>>());
    }
    let observed = stack
        .wait_for("three reports", LONG, |observed| {
            observed.reports.len() == 3
        })
        .await;
    observed.assert_exactly_once(&sent);

    // The counters follow committed arrays; the lag follows librdkafka's
    // statistics (every 300 ms here): wait until both have caught up.
    let metrics_url = format!("{base}/metrics");
    let (_, text) = wait_until(
        &http,
        &metrics_url,
        "metrics to catch up",
        |status, text| {
            let samples = parse_exposition(text);
            let lag = family(&samples, "quire_worker_consumer_lag");
            status == 200
                && samples.get("quire_worker_records_total") == Some(&180.0)
                && lag.len() == 12
                && lag.values().all(|value| *value == 0.0)
        },
    )
    .await;
    assert!(
        text.ends_with("# EOF\n"),
        "OpenMetrics text ends with # EOF"
    );
    let samples = parse_exposition(&text);
    assert_eq!(
        samples.get(r#"quire_worker_reports_total{trigger="api"}"#),
        Some(&3.0),
        "{text}"
    );
    assert_eq!(samples.get("quire_worker_dead_letters_total"), Some(&0.0));
    assert_eq!(samples.get("quire_worker_open_documents"), Some(&0.0));
    assert_eq!(samples.get("quire_worker_assigned_partitions"), Some(&12.0));
    assert_eq!(samples.get("quire_worker_restarts_total"), Some(&0.0));
    assert!(
        samples
            .get("quire_worker_commits_total")
            .copied()
            .unwrap_or(0.0)
            >= 1.0,
        "{text}"
    );
    assert!(
        samples
            .get("quire_worker_bytes_uploaded_total")
            .copied()
            .unwrap_or(0.0)
            > 0.0,
        "the three documents were uploaded: {text}"
    );
    assert!(
        samples
            .get("quire_worker_array_records_count")
            .copied()
            .unwrap_or(0.0)
            >= 1.0
    );
    assert!(
        samples
            .get(r#"quire_worker_rebalances_total{kind="assigned"}"#)
            .copied()
            .unwrap_or(0.0)
            >= 1.0,
        "{text}"
    );
    let unstable = family(&samples, "quire_worker_last_stable_offset_lag");
    assert_eq!(unstable.len(), 12, "{text}");
    assert!(
        unstable.values().all(|value| *value == 0.0),
        "no transaction hangs: {unstable:?}"
    );

    let (status, _) = get(&http, &format!("{base}/healthz")).await;
    assert_eq!(status, 200);
    let summary = worker
        .stop(Duration::from_secs(40))
        .await
        .expect("the shutdown future ends the worker cleanly");
    assert_eq!(summary.reports, 3, "{summary:?}");
    assert_eq!(summary.records, 180, "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_session_restarts_by_itself_and_loses_or_doubles_nothing() {
    let stack = TestStack::create("ops-restart").await;
    let api = stack.start_api().await;
    let prefix = unique("test-ops-worker");
    let (mut worker, base) = stack
        .worker("ops-r")
        .with(|settings| {
            settings.worker.transactional_id_prefix = prefix.clone();
            settings.worker.restart_backoff_initial = Duration::from_millis(200);
        })
        .spawn_monitored();
    let http = reqwest::Client::new();
    let readyz = format!("{base}/readyz");
    wait_until(&http, &readyz, "readiness", |status, _| status == 200).await;

    let stream = format!("ops-r-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    api.send_ok(&stream, &records(&stream, 0, 30)).await;
    api.cut(&stream).await;
    stack
        .wait_for("the first report", LONG, |observed| {
            observed.reports.len() == 1
        })
        .await;

    // Another producer with the worker's transactional id fences the
    // worker's producer: its next transaction fails for good, which ends
    // the session.
    let intruder =
        quire_queue::TransactionalProducer::connect(&stack.kafka, &format!("{prefix}-ops-r"))
            .await
            .expect("a producer with the worker's transactional id");
    api.send_ok(&stream, &records(&stream, 30, 30)).await;
    api.cut(&stream).await;

    let metrics_url = format!("{base}/metrics");
    wait_until(&http, &metrics_url, "a session restart", |status, text| {
        let samples = parse_exposition(text);
        status == 200
            && samples
                .get("quire_worker_restarts_total")
                .is_some_and(|restarts| *restarts >= 1.0)
    })
    .await;
    // Dropping a producer flushes: not on an async worker thread.
    tokio::task::block_in_place(|| drop(intruder));
    let observed = stack
        .wait_for("the second report", LONG, |observed| {
            observed.reports.len() == 2
        })
        .await;
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..60).collect())]));
    wait_until(
        &http,
        &readyz,
        "readiness after the restart",
        |status, _| status == 200,
    )
    .await;
    assert!(
        worker.exited().is_none(),
        "the worker exited instead of restarting its session"
    );
    let (exit, _) = worker.terminate(Duration::from_secs(40));
    assert_eq!(exit, Some(0), "SIGTERM ends the worker cleanly");
}

/// A transaction no producer of quire will end (another program's, left
/// open) holds its records partition back: the worker names the partition
/// and the offset in `/readyz` and in `quire_worker_partition_stuck_seconds`
/// once the last stable offset has stood still for longer than the
/// transaction timeout, and forgets it once the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_held_back_by_a_foreign_open_transaction_is_named_until_it_ends() {
    let stack = TestStack::create("ops-stuck").await;
    let mut settings = stack.worker_settings("ops-stuck");
    settings.worker.statistics_interval = Duration::from_millis(300);
    // Stuck after 3 s unmoved, instead of the default 10.
    settings.kafka.transaction_timeout = Duration::from_millis(3000);
    let worker = stack.start_worker_in_process(settings, Mode::Serve).await;
    let base = worker.base_url();
    let http = reqwest::Client::new();
    wait_until(
        &http,
        &format!("{base}/readyz"),
        "readiness",
        |status, body| status == 200 && body.contains("\"ready\""),
    )
    .await;

    // Another program's producer: its own transaction timeout is a minute.
    let foreign = quire_tests::raw_transactional_producer(&stack.kafka, &unique("foreign"));
    let at = quire_tests::send_in_transaction(&foreign, &stack.topics.records, "held-back").await;
    let opened = Instant::now();
    let (_, body) = wait_until(
        &http,
        &format!("{base}/readyz"),
        "a stuck partition",
        |status, body| status == 200 && body.contains("\"degraded\""),
    )
    .await;
    let named = opened.elapsed();
    let readiness: serde_json::Value = serde_json::from_str(&body).unwrap();
    let stuck = readiness["stuck_partitions"]
        .as_array()
        .expect("stuck_partitions");
    assert_eq!(stuck.len(), 1, "{readiness}");
    assert_eq!(stuck[0]["partition"], at.partition, "{readiness}");
    assert_eq!(stuck[0]["last_stable_offset"], at.offset, "{readiness}");
    assert!(
        named >= Duration::from_secs(3),
        "named stuck after {named:?}, before the transaction timeout"
    );
    let (_, text) = get(&http, &format!("{base}/metrics")).await;
    let stuck_seconds = family(
        &parse_exposition(&text),
        "quire_worker_partition_stuck_seconds",
    );
    assert_eq!(
        stuck_seconds.keys().collect::<Vec<_>>(),
        vec![&format!("{{partition=\"{}\"}}", at.partition)],
        "{text}"
    );

    // Once it ends (aborted here), the partition moves on and is forgotten.
    tokio::task::spawn_blocking(move || {
        rdkafka::producer::Producer::abort_transaction(&foreign, Duration::from_secs(30))
            .expect("abort the foreign transaction")
    })
    .await
    .unwrap();
    wait_until(
        &http,
        &format!("{base}/readyz"),
        "the partition moving on",
        |status, body| {
            status == 200 && body.contains("\"ready\"") && body.contains("\"stuck_partitions\":[]")
        },
    )
    .await;
    let (_, text) = get(&http, &format!("{base}/metrics")).await;
    assert!(
        family(
            &parse_exposition(&text),
            "quire_worker_partition_stuck_seconds"
        )
        .is_empty(),
        "{text}"
    );
    quire_tests::figures(&format!(
        "stuck partition: named in /readyz {named:?} after the foreign transaction opened (limit 3 s)"
    ));
    worker
        .stop(Duration::from_secs(30))
        .await
        .expect("worker stops");
}

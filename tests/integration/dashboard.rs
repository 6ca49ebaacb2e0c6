//! The example Grafana dashboard (deploy/grafana/quire-dashboard.json) queries
//! only metrics the running services really export, with the job names the
//! example Prometheus configuration (deploy/prometheus/prometheus.yml) gives.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use quire_tests::{TestStack, records};

const DASHBOARD: &str = include_str!("../../deploy/grafana/quire-dashboard.json");
const PROMETHEUS: &str = include_str!("../../deploy/prometheus/prometheus.yml");

/// Every `quire_…` metric name a panel's query uses.
fn queried_metrics() -> BTreeSet<String> {
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).expect("dashboard JSON");
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target has an expr");
            let mut rest = expr;
            while let Some(start) = rest.find("quire_") {
                let tail = &rest[start..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                names.insert(tail[..end].to_owned());
                rest = &tail[end..];
            }
        }
    }
    names
}

/// The metric families an exposition declares (`# TYPE name kind`), with the
/// sample names each kind produces.
fn exported(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "gauge" | "unknown" => &[""],
            _ => &["", "_total", "_sum", "_count"],
        };
        for suffix in suffixes {
            names.insert(format!("{name}{suffix}"));
        }
    }
    names
}

#[test]
fn the_dashboard_selects_the_jobs_the_prometheus_example_scrapes() {
    let config: serde_norway::Value = serde_norway::from_str(PROMETHEUS).expect("prometheus.yml");
    let jobs: BTreeSet<String> = config["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
        .iter()
        .map(|job| job["job_name"].as_str().expect("job_name").to_owned())
        .collect();
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).expect("dashboard JSON");
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if variable["type"] == "custom" {
            let job = variable["query"].as_str().expect("query");
            assert!(
                jobs.contains(job),
                "the dashboard selects job {job}, prometheus.yml scrapes {jobs:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported_by_a_service() {
    let queried = queried_metrics();
    assert!(
        queried.iter().any(|name| name.starts_with("quire_api_"))
            && queried.iter().any(|name| name.starts_with("quire_worker_")),
        "the dashboard covers both services: {queried:?}"
    );

    // Labelled families (lag per partition, reports by trigger, transactions
    // by outcome...) show only once they have a series: make some traffic,
    // with frequent statistics, and scrape until every name is there.
    let stack = TestStack::create("dashboard").await;
    let api = stack.start_api().await;
    let (mut worker, worker_base) = stack
        .worker("dashboard-1")
        .with(|settings| settings.worker.statistics_interval = Duration::from_millis(300))
        .spawn_monitored();
    let stream = quire_tests::unique("dashboard");
    api.send_ok(&stream, &records(&stream, 0, 20)).await;
    let report = api.cut(&stream).await;
    api.wait_completed(&report, Duration::from_secs(90)).await;

    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let missing = loop {
        let mut exposition = String::new();
        for url in [
            format!("{}/metrics", api.base),
            format!("{worker_base}/metrics"),
        ] {
            let response = http.get(&url).send().await.expect("a metrics answer");
            assert_eq!(response.status().as_u16(), 200, "{url}");
            exposition.push_str(&response.text().await.expect("metrics text"));
        }
        let exported = exported(&exposition);
        let missing: Vec<String> = queried.difference(&exported).cloned().collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics no service exports: {missing:?}"
    );
    worker.kill();
}

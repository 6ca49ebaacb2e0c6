//! Slow S3 (issue 27, part 6): every UploadPart slowed to tens of seconds, a
//! brownout that still succeeds. An array's S3 work then outlasts
//! `max.poll.interval.ms`; the worker must stay in its group (no
//! rebalance), so no new owner starts the same uploads again, and
//! everything is reported once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_tests::s3::{FaultProxy, ProxyMode};
use quire_tests::{TestStack, WorkerProcess, read_all, worker_metric};
use serde_json::Value;

use crate::faults::padded_records;

/// The least librdkafka allows: the test stack's `session.timeout.ms`.
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(6);
/// Each UploadPart waits this long at the proxy: a document's completion,
/// which waits for its last part, takes several max poll intervals.
const PART_DELAY: Duration = Duration::from_secs(20);
const LONG: Duration = Duration::from_secs(180);

/// Waits until the worker at `base` holds all `partitions`.
async fn wait_for_assignment(worker: &mut WorkerProcess, base: &str, partitions: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status})");
        }
        let assigned = worker_metric(base, "quire_worker_assigned_partitions").await;
        if assigned == Some(partitions) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the worker holds {assigned:?} partitions, not {partitions}, after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_slower_than_max_poll_interval_keep_the_worker_in_its_group_and_upload_once() {
    let stack = TestStack::create("brownout").await;
    let proxy = FaultProxy::switchable(&stack.bucket.settings.endpoint).await;
    // The API reads S3 directly; only the worker goes through the proxy.
    let api = stack.start_api().await;
    let (mut worker, base) = stack
        .worker("w1")
        .with(|settings| {
            settings.s3.endpoint = proxy.endpoint.clone();
            settings.worker.max_poll_interval =
                Duration::from_millis(MAX_POLL_INTERVAL.as_millis() as u64);
        })
        .log_filter("warn,quire_queue=info,report_generator=info")
        .spawn_monitored();
    wait_for_assignment(&mut worker, &base, 12.0).await;
    let rebalances_before = worker_metric(&base, "quire_worker_rebalances_total")
        .await
        .expect("the worker exports its rebalances");

    proxy.set_mode(ProxyMode::SlowParts { delay: PART_DELAY });
    // About 9.6 MB of one stream: a document of two 8 MiB parts, each
    // UploadPart slowed.
    let stream = quire_tests::unique("slow");
    let mut sent = 0;
    for _ in 0..12 {
        api.send_ok(&stream, &padded_records(&stream, sent, 500))
            .await;
        sent += 500;
    }
    let cut_at = Instant::now();
    let report = api.cut(&stream).await;
    let deadline = cut_at + LONG;
    loop {
        if let Some(status) = worker.exited() {
            panic!("the worker exited ({status})");
        }
        let twice: BTreeMap<String, u32> = proxy
            .uploads_created()
            .into_iter()
            .filter(|(_, count)| *count > 1)
            .collect();
        assert!(
            twice.is_empty(),
            "uploads started again on the same keys after {:?} (the worker left its group and \
             rendered the document again): {twice:?}; rebalances {:?} (before the brownout {rebalances_before})",
            cut_at.elapsed(),
            worker_metric(&base, "quire_worker_rebalances_total").await
        );
        // Reported means its event is committed (the API calls a report
        // completed once its manifest is stored, before the transaction).
        let announced = read_all(&stack.kafka, &stack.topics.report_events, 3, true)
            .iter()
            .any(|event| {
                serde_json::from_slice::<Value>(&event.payload)
                    .is_ok_and(|event| event["report_id"] == report.as_str())
            });
        if announced {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "report {report} not announced after {LONG:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = cut_at.elapsed();
    let rebalances_after = worker_metric(&base, "quire_worker_rebalances_total")
        .await
        .expect("the worker exports its rebalances");
    let restarts = worker_metric(&base, "quire_worker_restarts_total").await;
    let created = proxy.uploads_created();
    quire_tests::figures(&format!(
        "brownout: UploadPart delayed {PART_DELAY:?}, max.poll.interval.ms {}; the cut took \
         {took:?}; rebalances {rebalances_before} before, {rebalances_after} after; session \
         restarts {restarts:?}; uploads created by key {created:?}",
        MAX_POLL_INTERVAL.as_millis()
    ));
    assert!(
        took > MAX_POLL_INTERVAL * 3,
        "the document's S3 work took only {took:?}: it did not outlast max.poll.interval.ms \
         several times, so the test shows nothing"
    );
    assert_eq!(
        rebalances_after, rebalances_before,
        "the worker's partitions moved during the brownout"
    );
    assert_eq!(
        restarts.unwrap_or(0.0),
        0.0,
        "the worker's session restarted during the brownout"
    );
    assert!(
        !created.is_empty() && created.values().all(|count| *count == 1),
        "every multipart upload started once: {created:?}"
    );
    let observed = stack.observe().await;
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..sent).collect())]));
    let largest = observed
        .reports
        .values()
        .map(|report| report.document.len())
        .max()
        .unwrap_or(0);
    assert!(
        largest > 8 * 1024 * 1024,
        "the report ({largest} bytes) was not a multipart upload"
    );
    assert!(worker.exited().is_none(), "the worker stopped");
}

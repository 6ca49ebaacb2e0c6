//! Scheduled reports (time windows cut by the log's append time) and key
//! templates, end to end on the real broker and S3 server.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use quire_messages::layout::RETENTION_PREFIXES;
use quire_messages::window::{WindowSpec, parse_time};
use quire_tests::{ApiProcess, Observed, TestStack, read_all, records};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(120);
const EVERY_MS: i64 = 3_000;
const ZONE: &str = "Europe/Paris";
const TEMPLATE: &str =
    "reports/{stream}/dt={yyyy}-{mm}-{dd}/hh={hh}/{partition}-{first_offset}.xml";

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Sends arrays of 3 records to each stream every 250 ms for `period`.
async fn send_for(
    api: &ApiProcess,
    streams: &[&str],
    sent: &mut BTreeMap<String, Vec<u64>>,
    period: Duration,
) {
    let until = Instant::now() + period;
    while Instant::now() < until {
        for stream in streams {
            let next = sent.get(*stream).map_or(0, Vec::len) as u64;
            api.send_ok(stream, &records(stream, next, 3)).await;
            sent.entry((*stream).to_owned())
                .or_default()
                .extend(next..next + 3);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The broker's append time of every record of `streams`, by stream and
/// sequence number, read from the records topic independently.
fn log_times(stack: &TestStack, streams: &[&str]) -> BTreeMap<(String, u64), i64> {
    let mut times = BTreeMap::new();
    for message in read_all(&stack.kafka, &stack.topics.records, 12, true) {
        // Every record of a batch message has the message's log time.
        for (_, body) in quire_tests::records_of(std::slice::from_ref(&message)) {
            let (Some(stream), Some(seq)) = (body["stream"].as_str(), body["seq"].as_u64()) else {
                continue;
            };
            if streams.contains(&stream) {
                times.insert(
                    (stream.to_owned(), seq),
                    message.timestamp_ms.expect("a log time"),
                );
            }
        }
    }
    times
}

/// `(start, end)` of a report's window, in ms.
fn window_of(report: &quire_tests::Report) -> (i64, i64) {
    let start = report.manifest["window_start"]
        .as_str()
        .unwrap_or_else(|| panic!("no window_start in {}", report.manifest));
    let end = report.manifest["window_end"].as_str().expect("window_end");
    (parse_time(start).unwrap(), parse_time(end).unwrap())
}

fn reports_of<'a>(
    observed: &'a Observed,
    stream: &str,
) -> Vec<(&'a String, &'a quire_tests::Report)> {
    observed
        .reports
        .iter()
        .filter(|(_, report)| report.stream() == stream)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_hold_every_record_of_their_log_time_once_through_a_kill_and_a_replay() {
    let stack = TestStack::create("windows").await;
    let api = stack.start_api().await;
    // `plain` reports every window, empty ones included; `keyed` skips empty
    // windows and stores its documents under a Hive-style key template.
    let plain = stream_name("win");
    let keyed = stream_name("winkey");
    let window = json!({"every": "3s", "time_zone": ZONE, "grace": "1s"});
    api.put_definition(&plain, json!({ "window": window }))
        .await;
    api.put_definition(
        &keyed,
        json!({
            "window": {"every": "3s", "time_zone": ZONE, "grace": "1s", "skip_empty": true},
            "key_template": TEMPLATE,
        }),
    )
    .await;
    let streams = [plain.as_str(), keyed.as_str()];
    let mut sent = BTreeMap::new();

    let mut worker = stack.worker("w1").spawn();
    send_for(&api, &streams, &mut sent, Duration::from_millis(4_500)).await;
    // An explicit cut inside a window: the window's next records open its
    // next document (sequence 2).
    let cut_id = api.cut(&plain).await;
    send_for(&api, &streams, &mut sent, Duration::from_millis(500)).await;
    // Longer than a window and its grace without a record: `plain` gets an
    // empty report for the quiet window, `keyed` none.
    tokio::time::sleep(Duration::from_millis(7_000)).await;
    send_for(&api, &streams, &mut sent, Duration::from_millis(2_000)).await;
    // Killed mid-window, with documents open; records keep coming.
    worker.kill();
    send_for(&api, &streams, &mut sent, Duration::from_millis(2_000)).await;
    let _successor = stack.worker("w1").spawn();
    send_for(&api, &streams, &mut sent, Duration::from_millis(3_000)).await;

    // No cut: every window closes by itself (the last by its marker).
    let observed = stack
        .wait_for("every record in its window's report", LONG, |observed| {
            sent.iter()
                .all(|(stream, sequence)| observed.sequence_numbers(stream).len() >= sequence.len())
        })
        .await;
    observed.assert_exactly_once(&sent);

    // Every record is in the report of the window its log time falls in.
    let times = log_times(&stack, &streams);
    let schedule = WindowSpec {
        every: "3s".into(),
        time_zone: ZONE.into(),
        grace: "1s".into(),
        skip_empty: false,
    }
    .schedule()
    .unwrap();
    let mut empty_windows = BTreeMap::<&str, usize>::new();
    for stream in streams {
        let mut sequences: BTreeMap<i64, Vec<u64>> = BTreeMap::new();
        for (id, report) in reports_of(&observed, stream) {
            let (start, end) = window_of(report);
            assert_eq!(end - start, EVERY_MS, "{id}: a window of 3 s");
            assert_eq!(schedule.window_of(start).start_ms, start, "{id}: aligned");
            let records = report.records();
            if records.is_empty() {
                *empty_windows.entry(stream).or_default() += 1;
            }
            for record in records {
                let seq: u64 = record["seq"].parse().unwrap();
                let time = times[&(stream.to_owned(), seq)];
                assert!(
                    (start..end).contains(&time),
                    "{id}: record {seq} has log time {time}, outside its window [{start}, {end})"
                );
            }
            let sequence = report.manifest["window_sequence"]
                .as_u64()
                .expect("sequence");
            sequences.entry(start).or_default().push(sequence);
            let document = std::str::from_utf8(&report.document).unwrap();
            let window_start = report.manifest["window_start"].as_str().unwrap();
            assert!(
                document.contains(&format!("window-start=\"{window_start}\""))
                    && document.contains(&format!("window-sequence=\"{sequence}\"")),
                "{id}: the summary names its window: {document}"
            );
            assert!(
                window_start.ends_with("+01:00"),
                "Paris in winter: {window_start}"
            );
            let event = observed
                .events
                .iter()
                .find(|event| event["report_id"].as_str() == Some(id.as_str()))
                .expect("event");
            assert_eq!(event["window_start"], report.manifest["window_start"]);
            assert_eq!(event["window_end"], report.manifest["window_end"]);
        }
        // Every window reported once: its documents numbered 1, 2, ...
        for (start, mut numbers) in sequences.clone() {
            numbers.sort_unstable();
            let expected: Vec<u64> = (1..=numbers.len() as u64).collect();
            assert_eq!(
                numbers, expected,
                "{stream}: window {start} reported twice or with a gap"
            );
        }
        // From the first record's window to the last one's, every window of
        // `plain` has a report (the quiet one an empty report).
        let record_times: Vec<i64> = times
            .iter()
            .filter(|((of, _), _)| of == stream)
            .map(|(_, time)| *time)
            .collect();
        let first = schedule
            .window_of(*record_times.iter().min().unwrap())
            .start_ms;
        let last = schedule
            .window_of(*record_times.iter().max().unwrap())
            .start_ms;
        let windows_with_records: BTreeSet<i64> = record_times
            .iter()
            .map(|time| schedule.window_of(*time).start_ms)
            .collect();
        for start in (first..=last).step_by(EVERY_MS as usize) {
            if stream == plain {
                assert!(
                    sequences.contains_key(&start),
                    "{stream}: window {start} not reported"
                );
            } else {
                assert_eq!(
                    sequences.contains_key(&start),
                    windows_with_records.contains(&start),
                    "{stream}: skip_empty reports exactly the windows with records ({start})"
                );
            }
        }
    }
    let cut = &observed.reports[&cut_id];
    assert_eq!(cut.manifest["trigger"], "api", "{}", cut.manifest);
    assert!(cut.manifest["window_start"].is_string(), "{}", cut.manifest);
    let most_in_a_window = reports_of(&observed, &plain)
        .iter()
        .filter_map(|(_, report)| report.manifest["window_sequence"].as_u64())
        .max()
        .unwrap_or(0);
    quire_tests::figures(&format!(
        "windows: at most {most_in_a_window} documents in one window of {plain}"
    ));
    quire_tests::figures(&format!(
        "windows: {} reports of {plain} ({} empty), {} of {keyed}, {} records",
        reports_of(&observed, &plain).len(),
        empty_windows.get(plain.as_str()).copied().unwrap_or(0),
        reports_of(&observed, &keyed).len(),
        times.len()
    ));
    assert!(
        empty_windows.get(plain.as_str()).copied().unwrap_or(0) >= 1,
        "the quiet window of {plain} got an empty report"
    );
    assert_eq!(
        empty_windows.get(keyed.as_str()),
        None,
        "skip_empty: no empty report"
    );

    // The template's keys: the window's local date and hour.
    for (id, report) in reports_of(&observed, &keyed) {
        let (start, _) = window_of(report);
        let hour = schedule.civil_hour(start);
        let expected = format!(
            "reports/{keyed}/dt={:04}-{:02}-{:02}/hh={:02}/{:05}-{:020}.xml",
            hour.year,
            hour.month,
            hour.day,
            hour.hour,
            report.manifest["partition"].as_i64().unwrap(),
            report.manifest["first_offset"].as_i64().unwrap()
        );
        assert_eq!(
            report.manifest["key"].as_str(),
            Some(expected.as_str()),
            "{id}"
        );
    }

    // A templated report downloads straight from S3 by plain HTTP.
    let (id, report) = reports_of(&observed, &keyed)[0];
    let (status, body) = api.get(&format!("/v1/reports/{id}/url")).await;
    assert_eq!(status, 200, "{body}");
    let url = body["url"].as_str().expect("a presigned URL");
    let response = reqwest::get(url).await.expect("GET the presigned URL");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(
        response.bytes().await.unwrap().as_ref(),
        report.document.as_slice(),
        "{id}: the presigned URL serves the templated key's bytes"
    );

    // A window's reports, found through the API's window index.
    let (_, with_records) = reports_of(&observed, &plain)
        .into_iter()
        .find(|(_, report)| !report.records().is_empty())
        .unwrap();
    let window_start = with_records.manifest["window_start"]
        .as_str()
        .unwrap()
        .to_owned();
    let expected: BTreeSet<&str> = reports_of(&observed, &plain)
        .into_iter()
        .filter(|(_, report)| report.manifest["window_start"] == window_start.as_str())
        .map(|(id, _)| id.as_str())
        .collect();
    let (status, page) = api
        .get(&format!(
            "/v1/streams/{plain}/reports?window_start={}",
            window_start.replace('+', "%2B")
        ))
        .await;
    assert_eq!(status, 200, "{page}");
    let listed: BTreeSet<&str> = page["reports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|report| report["report_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, expected, "the window's reports and only those");
    let (status, body) = api
        .get(&format!(
            "/v1/streams/{plain}/reports?window_start=yesterday"
        ))
        .await;
    assert_eq!(status, 400, "{body}");
    // The CLI's `quire list --window-start` asks the same.
    let output = std::process::Command::new(quire_tests::release_binary("quire"))
        .args(["--api", &api.base, "--json", "list", "--stream", &plain])
        .args(["--window-start", &window_start])
        .env_remove("QUIRE_API_TOKEN")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run quire");
    assert!(output.status.success(), "{output:?}");
    let listed: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let listed: BTreeSet<&str> = listed["reports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|report| report["report_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, expected, "quire list --window-start");

    // A replay through another group, into another bucket, cuts at the same
    // records: the same keys and the same bytes.
    stack
        .assert_replay_renders(
            "windows",
            12,
            streams
                .iter()
                .flat_map(|stream| reports_of(&observed, stream)),
            LONG,
        )
        .await;
    drop(_successor);

    // Retention finds the templated documents and the window index.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let swept = stack
        .bucket
        .handle()
        .expire_older_than(&RETENTION_PREFIXES, Duration::from_secs(1))
        .await
        .expect("retention sweep");
    assert!(swept.deleted > 0);
    assert!(
        stack
            .bucket
            .list(&format!("reports/{keyed}/"))
            .await
            .is_empty(),
        "templated documents expired"
    );
    assert!(
        stack.bucket.list("windows/").await.is_empty(),
        "window index expired"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_left_on_a_templated_key_is_aborted_when_its_document_opens_again() {
    let stack = TestStack::create("template-sweep").await;
    let api = stack.start_api().await;
    let stream = stream_name("flat");
    // The file name starts with the offset: the partition sweep cannot tell
    // whose it is, so the document's own opening must clear it.
    let template = "reports/{stream}/flat/{first_offset}-{partition}.xml";
    api.put_definition(&stream, json!({ "key_template": template }))
        .await;
    let ids = api.send_ok(&stream, &records(&stream, 0, 20)).await;
    // The document's first offset is its first batch message's.
    let quire_tests::RecordId {
        partition, offset, ..
    } = quire_tests::RecordId::parse(&ids[0]);
    let key = format!("reports/{stream}/flat/{offset:020}-{partition:05}.xml");
    // What a worker killed mid-document leaves: an upload with a part.
    let upload = stack
        .bucket
        .client
        .create_multipart_upload()
        .bucket(&stack.bucket.name)
        .key(&key)
        .send()
        .await
        .expect("create upload");
    stack
        .bucket
        .client
        .upload_part()
        .bucket(&stack.bucket.name)
        .key(&key)
        .upload_id(upload.upload_id().unwrap())
        .part_number(1)
        .body(vec![b'x'; 1024].into())
        .send()
        .await
        .expect("upload part");
    assert_eq!(stack.bucket.pending_uploads("reports/").await.len(), 1);

    let _worker = stack.worker("w1").spawn();
    let id = api.cut(&stream).await;
    let status = api.wait_completed(&id, LONG).await;
    assert_eq!(status["manifest"]["key"].as_str(), Some(key.as_str()));
    let observed = stack
        .wait_for("the report", LONG, |observed| !observed.reports.is_empty())
        .await;
    observed.assert_exactly_once(&BTreeMap::from([(stream.clone(), (0..20).collect())]));
    assert_eq!(
        observed.pending_uploads, 0,
        "the orphaned upload was aborted"
    );

    // Templates are checked where they are written: 422 naming the problem.
    for (template, problem) in [
        ("reports/{stream}/{first_offset}.xml", "{partition}"),
        ("manifests/{partition}-{first_offset}.xml", "reports/"),
        ("reports/{stream}/{partition}-{first_offset}.json", ".xml"),
        ("reports/{date}/{partition}-{first_offset}.xml", "{date}"),
        ("reports/a b/{partition}-{first_offset}.xml", "' '"),
    ] {
        let (status, body) = api
            .try_put_definition(&stream, json!({ "key_template": template }))
            .await;
        assert_eq!(status, 422, "{template}: {body}");
        assert!(
            body.to_string().contains(problem),
            "{template}: the answer names {problem}: {body}"
        );
    }
    let (status, body) = api
        .try_put_definition(&stream, json!({"window": {"every": "7m"}}))
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("does not divide a day"), "{body}");
    let (status, body) = api
        .try_put_definition(
            &stream,
            json!({"window": {"every": "1h", "time_zone": "Mars/Olympus"}}),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("Mars/Olympus"), "{body}");
}

/// A windowed stream's definition changes while its document is open; the
/// worker commits the change and is killed. The replay reads from before
/// the change (another stream's open document holds the committed offset)
/// and opens the document again under the windowed definition: it is the
/// window's second document, as the first read numbered it, not a second
/// "first".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_before_a_definition_change_numbers_the_windows_documents_as_the_first_read_did()
 {
    let stack = TestStack::create("win-change").await;
    let api = stack.start_api().await;
    let windowed = stream_name("wchange");
    let partition = quire_tests::partition_of(&windowed, 12);
    let plain = (0..)
        .map(|_| stream_name("wplain"))
        .find(|name| quire_tests::partition_of(name, 12) == partition)
        .expect("a stream on the partition");
    api.put_definition(
        &windowed,
        json!({"window": {"every": "1h", "time_zone": "UTC", "grace": "1s"}}),
    )
    .await;
    let (mut worker, base) = stack.worker("w1").spawn_monitored();
    api.send_ok(&plain, &records(&plain, 0, 1)).await;
    api.send_ok(&windowed, &records(&windowed, 0, 1)).await;
    let first = api.cut(&windowed).await;
    api.wait_completed(&first, LONG).await;
    // The window's second document is open when the definition changes.
    api.send_ok(&windowed, &records(&windowed, 1, 1)).await;
    api.put_definition(&windowed, json!({"root": "unwindowed"}))
        .await;
    api.send_ok(&plain, &records(&plain, 1, 1)).await;
    // Four records committed: the change, before the last, is too.
    crate::dead_letters::wait_for_committed_records(&mut worker, &base, 4.0).await;
    worker.kill();
    let (mut worker, _) = stack.worker("w1").spawn_monitored();
    let second = api.cut(&windowed).await;
    api.wait_completed(&second, LONG).await;
    let cut = api.cut(&plain).await;
    api.wait_completed(&cut, LONG).await;

    let observed = stack.observe().await;
    let mut sent = BTreeMap::new();
    sent.insert(windowed.clone(), vec![0, 1]);
    sent.insert(plain.clone(), vec![0, 1]);
    observed.assert_exactly_once(&sent);
    let mut sequences: BTreeMap<i64, Vec<u64>> = BTreeMap::new();
    for (id, report) in reports_of(&observed, &windowed) {
        let (start, _) = window_of(report);
        let sequence = report.manifest["window_sequence"]
            .as_u64()
            .unwrap_or_else(|| panic!("{id}: no window_sequence"));
        sequences.entry(start).or_default().push(sequence);
    }
    assert_eq!(
        sequences.values().map(Vec::len).sum::<usize>(),
        2,
        "two windowed reports: {sequences:?}"
    );
    for (start, mut numbers) in sequences {
        numbers.sort_unstable();
        let expected: Vec<u64> = (1..=numbers.len() as u64).collect();
        assert_eq!(
            numbers, expected,
            "window {start}: its documents numbered twice or with a gap"
        );
    }
    assert!(worker.exited().is_none(), "the worker stopped");
}

//! Gzip- and Zstandard-compressed reports and report retention, against the real Kafka and
//! S3 server: the producer API and report generators as child processes.

use std::io::Read;
use std::time::{Duration, Instant};

use quire_messages::layout::RETENTION_PREFIXES;
use quire_s3::{LifecycleOutcome, Retention};
use quire_tests::s3::TestBucket;
use quire_tests::{ApiProcess, Report, TestStack, records, sha256_hex};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut xml = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut xml)
        .expect("the stored bytes are one valid gzip stream");
    xml
}

fn unzstd(bytes: &[u8]) -> Vec<u8> {
    let mut xml = Vec::new();
    zstd::stream::read::Decoder::new(bytes)
        .and_then(|mut decoder| decoder.read_to_end(&mut xml))
        .expect("the stored bytes are valid Zstandard frames");
    xml
}

/// `GET /v1/reports/{id}/content`: status, Content-Type, Content-Encoding,
/// body. A document served is data, never active content: this asserts it
/// comes as a download named after its id, not sniffed, and sandboxed.
async fn content(api: &ApiProcess, id: &str) -> (u16, String, Option<String>, Vec<u8>) {
    let response = api
        .http
        .get(format!("{}/v1/reports/{id}/content", api.base))
        .send()
        .await
        .expect("content request");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|value| value.to_str().expect("ASCII header").to_owned())
    };
    let content_type = header("content-type").unwrap_or_default();
    let encoding = header("content-encoding");
    let status = response.status().as_u16();
    if status == 200 {
        let extension = match content_type.as_str() {
            "application/gzip" => "xml.gz",
            "application/zstd" => "xml.zst",
            _ => "xml",
        };
        assert_eq!(
            header("content-disposition").as_deref(),
            Some(format!("attachment; filename=\"{id}.{extension}\"").as_str())
        );
        assert_eq!(header("x-content-type-options").as_deref(), Some("nosniff"));
        assert_eq!(
            header("content-security-policy").as_deref(),
            Some("sandbox")
        );
    }
    (
        status,
        content_type,
        encoding,
        response.bytes().await.expect("body").to_vec(),
    )
}

/// The `seq` of every record of an XML document, in document order.
fn sequence_of(manifest: &Value, xml: Vec<u8>) -> Vec<u64> {
    Report {
        manifest: manifest.clone(),
        document: xml,
    }
    .records()
    .iter()
    .map(|record| record["seq"].parse().expect("seq number"))
    .collect()
}

async fn stored_content_type(bucket: &TestBucket, key: &str) -> Option<String> {
    bucket
        .client
        .head_object()
        .bucket(&bucket.name)
        .key(key)
        .send()
        .await
        .expect("HeadObject of a report")
        .content_type()
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_stream_stores_xml_gz_that_gunzips_to_exactly_its_records_beside_a_plain_stream() {
    let stack = TestStack::create("gzip").await;
    let api = stack.start_api().await;
    let _worker = stack.worker("w1").spawn();
    let compressed = stream_name("gz");
    let plain = stream_name("plain");
    api.put_definition(&compressed, json!({"root": "orders", "gzip": true}))
        .await;
    let (code, definition) = api
        .get(&format!("/v1/streams/{compressed}/definition"))
        .await;
    assert_eq!(code, 200);
    assert_eq!(definition["definition"]["gzip"], true);
    assert_eq!(
        definition["definition"]["v"], 2,
        "a gzip definition is version 2"
    );
    for stream in [&compressed, &plain] {
        api.send_ok(stream, &records(stream, 0, 300)).await;
        api.send_ok(stream, &records(stream, 300, 200)).await;
    }
    let compressed_id = api.cut(&compressed).await;
    let plain_id = api.cut(&plain).await;

    // The gzip report: key, stored bytes, manifest, content.
    let status = api.wait_completed(&compressed_id, LONG).await;
    let manifest = &status["manifest"];
    let key = manifest["key"].as_str().expect("manifest key");
    assert!(
        key.starts_with(&format!("reports/{compressed}/")) && key.ends_with(".xml.gz"),
        "gzip report key {key}"
    );
    let stored = stack.bucket.read(key).await.expect("the stored report");
    assert_eq!(&stored[..2], &[0x1f, 0x8b], "stored bytes are gzip");
    assert_eq!(&stored[4..8], &[0, 0, 0, 0], "no mtime in the gzip header");
    assert_eq!(manifest["bytes"].as_u64(), Some(stored.len() as u64));
    assert_eq!(
        manifest["sha256"].as_str(),
        Some(sha256_hex(&stored).as_str()),
        "the manifest's SHA-256 is that of the stored object"
    );
    assert_eq!(
        stored_content_type(&stack.bucket, key).await.as_deref(),
        Some("application/gzip")
    );
    let xml = gunzip(&stored);
    assert_eq!(
        manifest["uncompressed_bytes"].as_u64(),
        Some(xml.len() as u64)
    );
    assert!(
        stored.len() < xml.len(),
        "{} stored bytes for {} of XML",
        stored.len(),
        xml.len()
    );
    let text = std::str::from_utf8(&xml).expect("UTF-8 XML");
    let document = roxmltree::Document::parse(text).expect("well-formed XML");
    assert_eq!(document.root_element().tag_name().name(), "orders");
    assert_eq!(
        sequence_of(manifest, xml.clone()),
        (0..500).collect::<Vec<u64>>(),
        "exactly the records sent, in order"
    );
    let (code, content_type, encoding, served) = content(&api, &compressed_id).await;
    assert_eq!(code, 200);
    assert_eq!(content_type, "application/gzip");
    assert_eq!(
        encoding, None,
        "served as the gzip file, not as encoded XML"
    );
    assert_eq!(served, stored, "content streams the stored bytes");

    // The plain report beside it is unchanged: `.xml`, XML bytes.
    let status = api.wait_completed(&plain_id, LONG).await;
    let manifest = &status["manifest"];
    let key = manifest["key"].as_str().expect("manifest key");
    assert!(key.ends_with(".xml"), "plain report key {key}");
    assert!(manifest.get("uncompressed_bytes").is_none());
    let (code, content_type, _, served) = content(&api, &plain_id).await;
    assert_eq!(code, 200);
    assert_eq!(content_type, "application/xml");
    assert!(served.starts_with(b"<?xml"));
    assert_eq!(
        manifest["sha256"].as_str(),
        Some(sha256_hex(&served).as_str())
    );
    assert_eq!(
        sequence_of(manifest, served),
        (0..500).collect::<Vec<u64>>()
    );
    assert_eq!(
        stored_content_type(&stack.bucket, key).await.as_deref(),
        Some("application/xml")
    );

    // Both are listed, each with its own key.
    let (code, page) = api.get(&format!("/v1/streams/{compressed}/reports")).await;
    assert_eq!(code, 200);
    let listed = page["reports"].as_array().expect("reports");
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0]["manifest"]["key"]
            .as_str()
            .is_some_and(|key| key.ends_with(".xml.gz"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_report_rendered_again_after_a_crash_before_commit_has_the_same_bytes() {
    let stack = TestStack::create("gzip-replay").await;
    let api = stack.start_api().await;
    let stream = stream_name("gzreplay");
    api.put_definition(&stream, json!({"gzip": true})).await;
    for array in 0..4 {
        api.send_ok(&stream, &records(&stream, array * 250, 250))
            .await;
    }
    let report_id = api.cut(&stream).await;

    // It stores the object and manifest, then dies before its transaction.
    let mut doomed = stack.worker("w1").failpoint("crash-before-commit").spawn();
    assert_ne!(
        doomed.wait(LONG),
        Some(0),
        "the failpoint crashed the worker"
    );
    let first = stack.observe().await;
    assert!(first.events.is_empty(), "nothing was committed");
    let first_report = first
        .reports
        .get(&report_id)
        .expect("the object and manifest were stored before the crash")
        .clone();
    let key = first_report.manifest["key"]
        .as_str()
        .expect("key")
        .to_owned();
    assert!(key.ends_with(".xml.gz"), "{key}");

    // Remove both, so that what the next owner stores is its own rendering.
    for object in [key.clone(), format!("manifests/{report_id}.json")] {
        stack
            .bucket
            .client
            .delete_object()
            .bucket(&stack.bucket.name)
            .key(&object)
            .send()
            .await
            .expect("DeleteObject");
    }
    assert!(stack.bucket.read(&key).await.is_none());

    // Well over a second later: a gzip header holding a time would differ.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _successor = stack.worker("w1").spawn();
    let observed = stack
        .wait_for(
            "the report rendered again and announced",
            LONG,
            |observed| !observed.events.is_empty(),
        )
        .await;
    let second_report = &observed.reports[&report_id];
    assert_eq!(
        second_report.manifest["key"].as_str(),
        Some(key.as_str()),
        "same key"
    );
    assert_eq!(
        second_report.document, first_report.document,
        "the same log rendered twice gives the same gzip bytes"
    );
    assert_eq!(second_report.manifest, first_report.manifest);
    assert_eq!(observed.events.len(), 1, "one event");
    assert_eq!(
        observed.events[0]["sha256"], first_report.manifest["sha256"],
        "the event names the bytes stored"
    );
    assert_eq!(
        sequence_of(&second_report.manifest, gunzip(&second_report.document)),
        (0..1000).collect::<Vec<u64>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_log_rendered_again_by_another_group_gives_the_same_gzip_bytes() {
    // The first rendering: this stack's topics, group and bucket.
    let first = TestStack::create("gzip-again").await;
    let api = first.start_api().await;
    let stream = stream_name("gzagain");
    api.put_definition(&stream, json!({"gzip": true, "attributes": ["seq"]}))
        .await;
    api.send_ok(&stream, &records(&stream, 0, 400)).await;
    let first_id = api.cut(&stream).await;
    api.send_ok(&stream, &records(&stream, 400, 300)).await;
    let second_id = api.cut(&stream).await;
    let mut worker = first.worker("w1").drain().spawn();
    assert_eq!(
        worker.wait(LONG),
        Some(0),
        "drain reports everything and exits 0"
    );

    // A new group reads the same log from its beginning, with watermarks,
    // events and a bucket of its own, well over a second later.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = TestStack::create("gzip-again2").await;
    let mut replay = again
        .worker("w1")
        .with(|settings| settings.kafka.topics.records = first.topics.records.clone())
        .drain()
        .spawn();
    assert_eq!(replay.wait(LONG), Some(0));

    let rendered = first.observe().await;
    let rendered_again = again.observe().await;
    assert_eq!(rendered.reports.len(), 2);
    for id in [&first_id, &second_id] {
        let one = &rendered.reports[id];
        let other = rendered_again
            .reports
            .get(id)
            .unwrap_or_else(|| panic!("report {id} rendered again"));
        let key = one.manifest["key"].as_str().expect("key");
        assert!(key.ends_with(".xml.gz"), "{key}");
        assert_eq!(other.manifest["key"].as_str(), Some(key), "same key");
        assert_eq!(other.document, one.document, "report {id}: same bytes");
        assert_eq!(other.manifest, one.manifest, "report {id}: same manifest");
        assert_eq!(
            one.manifest["sha256"].as_str(),
            Some(sha256_hex(&one.document).as_str())
        );
    }
    // The attribute definition shaped the XML inside the gzip.
    let xml = gunzip(&rendered.reports[&second_id].document);
    let text = std::str::from_utf8(&xml).expect("UTF-8");
    let document = roxmltree::Document::parse(text).expect("well-formed XML");
    let seqs: Vec<u64> = document
        .root_element()
        .children()
        .filter(|node| node.is_element() && node.tag_name().name() == "record")
        .map(|record| {
            record
                .attribute("seq")
                .expect("seq attribute")
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, (400..700).collect::<Vec<u64>>());
}

/// Puts a small object at each key.
async fn put_objects(bucket: &TestBucket, keys: &[&str]) {
    for key in keys {
        bucket
            .client
            .put_object()
            .bucket(&bucket.name)
            .key(*key)
            .body(b"x".to_vec().into())
            .send()
            .await
            .unwrap_or_else(|error| panic!("PutObject {key}: {error}"));
    }
}

async fn all_keys(bucket: &TestBucket) -> Vec<String> {
    let mut keys = bucket.list("").await;
    keys.sort();
    keys
}

const OLD_REPORT: &str = "reports/s/00000-00000000000000000001.xml.gz";
const OLD_MANIFEST: &str = "manifests/s~0-1.json";
const OLD_OTHER: &str = "definitions/s.json";
const NEW_REPORT: &str = "reports/s/00000-00000000000000000002.xml";
const NEW_MANIFEST: &str = "manifests/s~0-2.json";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_and_manifests_older_than_the_cutoff_are_deleted_and_newer_ones_kept() {
    let bucket = TestBucket::create("retention").await;
    let handle = bucket.handle();
    put_objects(&bucket, &[OLD_REPORT, OLD_MANIFEST, OLD_OTHER]).await;
    // S3 times have whole seconds: the old objects end well before the cutoff.
    tokio::time::sleep(Duration::from_secs(4)).await;
    put_objects(&bucket, &[NEW_REPORT, NEW_MANIFEST]).await;

    let swept = handle
        .expire_older_than(&RETENTION_PREFIXES, Duration::from_secs(2))
        .await
        .expect("sweep");
    assert_eq!(swept.examined, 4, "only reports/ and manifests/ are listed");
    assert_eq!(swept.deleted, 2);
    assert_eq!(
        all_keys(&bucket).await,
        vec![OLD_OTHER, NEW_MANIFEST, NEW_REPORT],
        "old reports and manifests went; new ones and other prefixes stay"
    );
    let again = handle
        .expire_older_than(&RETENTION_PREFIXES, Duration::from_secs(2))
        .await
        .expect("second sweep");
    assert_eq!(again.deleted, 0, "a second sweep finds nothing more");
    bucket.delete().await.expect("bucket left clean");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_lifecycle_rules_retention_falls_back_to_a_sweep_that_stops_when_told() {
    let bucket = TestBucket::create("lifecycle").await;
    let handle = bucket.handle();
    let outcome = handle
        .put_expiration_rules(&RETENTION_PREFIXES, 7)
        .await
        .expect("a lifecycle attempt answers, supported or not");
    // The local stack's versitygw (POSIX backend) has no lifecycle rules; on a
    // server that has them, the sweep below is not how retention runs.
    assert!(
        matches!(outcome, LifecycleOutcome::Unsupported { .. }),
        "the local S3 server took lifecycle rules: {outcome:?}"
    );

    put_objects(&bucket, &[OLD_REPORT, OLD_MANIFEST]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    put_objects(&bucket, &[NEW_REPORT]).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let task = quire_s3::spawn_retention(
        handle,
        Retention {
            keep_for: Some(Duration::from_secs(2)),
            // One sweep at start, then a long wait the stop ends.
            sweep_every: Duration::from_secs(3600),
        },
        &RETENTION_PREFIXES,
        stop.clone(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while all_keys(&bucket).await != vec![NEW_REPORT] {
        assert!(
            Instant::now() < deadline,
            "the start-up sweep did not delete the old objects: {:?}",
            all_keys(&bucket).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the retention task ends once stopped")
        .expect("the retention task did not panic");
    assert_eq!(all_keys(&bucket).await, vec![NEW_REPORT]);
    bucket.delete().await.expect("bucket left clean");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_stream_stores_xml_zst_frames_that_another_group_renders_to_the_same_bytes() {
    let first = TestStack::create("zstd").await;
    let api = first.start_api().await;
    let stream = stream_name("zst");
    // A header, written last, becomes a frame of its own ahead of the
    // records' frame.
    api.put_definition(
        &stream,
        json!({"root": "orders", "zstd": true, "header": {"fields": [{"name": "n", "value": "records"}]}}),
    )
    .await;
    let (code, definition) = api.get(&format!("/v1/streams/{stream}/definition")).await;
    assert_eq!(code, 200);
    assert_eq!(definition["definition"]["zstd"], true);
    assert_eq!(
        definition["definition"]["v"], 7,
        "a zstd definition is version 7"
    );
    api.send_ok(&stream, &records(&stream, 0, 300)).await;
    api.send_ok(&stream, &records(&stream, 300, 200)).await;
    let id = api.cut(&stream).await;
    let _worker = first.worker("w1").spawn();
    let status = api.wait_completed(&id, LONG).await;
    let manifest = status["manifest"].clone();
    let key = manifest["key"].as_str().expect("manifest key").to_owned();
    assert!(
        key.starts_with(&format!("reports/{stream}/")) && key.ends_with(".xml.zst"),
        "zstd report key {key}"
    );
    let stored = first.bucket.read(&key).await.expect("the stored report");
    assert_eq!(
        &stored[..4],
        &[0x28, 0xb5, 0x2f, 0xfd],
        "stored bytes are a zstd frame"
    );
    assert_eq!(manifest["bytes"].as_u64(), Some(stored.len() as u64));
    assert_eq!(
        manifest["sha256"].as_str(),
        Some(sha256_hex(&stored).as_str())
    );
    assert_eq!(
        stored_content_type(&first.bucket, &key).await.as_deref(),
        Some("application/zstd")
    );
    let xml = unzstd(&stored);
    assert_eq!(
        manifest["uncompressed_bytes"].as_u64(),
        Some(xml.len() as u64)
    );
    assert!(
        stored.len() * 2 < xml.len(),
        "{} stored bytes for {} of XML",
        stored.len(),
        xml.len()
    );
    let text = std::str::from_utf8(&xml).expect("UTF-8 XML");
    let document = roxmltree::Document::parse(text).expect("well-formed XML");
    assert_eq!(document.root_element().tag_name().name(), "orders");
    let header_count = document
        .descendants()
        .find(|node| node.tag_name().name() == "n")
        .and_then(|node| node.text())
        .map(str::to_owned);
    assert_eq!(
        header_count.as_deref(),
        Some("500"),
        "the header frame holds the total"
    );
    assert_eq!(
        sequence_of(&manifest, xml.clone()),
        (0..500).collect::<Vec<u64>>(),
        "exactly the records sent, in order"
    );
    let (code, content_type, encoding, served) = content(&api, &id).await;
    assert_eq!(code, 200);
    assert_eq!(content_type, "application/zstd");
    assert_eq!(
        encoding, None,
        "served as the zstd file, not as encoded XML"
    );
    assert_eq!(served, stored);

    // A new group reads the same log from its beginning, into a bucket of
    // its own: the same key, bytes and manifest.
    let again = TestStack::create("zstd-again").await;
    let mut replay = again
        .worker("w1")
        .with(|settings| settings.kafka.topics.records = first.topics.records.clone())
        .drain()
        .spawn();
    assert_eq!(replay.wait(LONG), Some(0));
    let rendered_again = again.observe().await;
    let other = rendered_again
        .reports
        .get(&id)
        .unwrap_or_else(|| panic!("report {id} rendered again"));
    assert_eq!(
        other.manifest["key"].as_str(),
        Some(key.as_str()),
        "same key"
    );
    assert_eq!(other.document, stored, "same bytes");
    assert_eq!(other.manifest, manifest, "same manifest");
}

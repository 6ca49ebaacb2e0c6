//! What a pipeline run left behind, read back independently of the
//! services: events and dead letters from Kafka, manifests and documents
//! from S3 (parsed by an independent XML parser), and the exactly-once
//! checks over them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::read_all;
use crate::stack::TestStack;

impl TestStack {
    /// Everything the pipeline published and stored, read back independently.
    ///
    /// A consistent cut of a pipeline that keeps reporting (an idle
    /// windowed stream gets an empty report every window): the events are
    /// read before the bucket is listed and again after. Every event read
    /// before is kept, so an event whose report was never stored is still
    /// found; of those read after, the ones of the reports listed are kept,
    /// so a report listed is announced as soon as its transaction commits
    /// (milliseconds after its objects), not only if it committed before
    /// the listing began, which under load can take longer than a window.
    pub async fn observe(&self) -> Observed {
        let kafka = &self.kafka;
        let read_events = || -> Vec<Value> {
            read_all(kafka, &self.topics.report_events, 3, true)
                .into_iter()
                .map(|message| serde_json::from_slice(&message.payload).expect("event JSON"))
                .collect()
        };
        let before: BTreeSet<String> = read_events()
            .iter()
            .map(|event| event["report_id"].as_str().unwrap_or_default().to_owned())
            .collect();
        let dead_letters: Vec<Value> = read_all(kafka, &self.topics.dead_letters, 3, true)
            .into_iter()
            .map(|message| serde_json::from_slice(&message.payload).expect("dead letter JSON"))
            .collect();
        let mut reports = BTreeMap::new();
        for key in self.bucket.list("manifests/").await {
            let manifest: Value =
                serde_json::from_slice(&self.bucket.read(&key).await.expect("manifest"))
                    .expect("manifest JSON");
            let document_key = manifest["key"].as_str().expect("manifest key").to_owned();
            let document = self
                .bucket
                .read(&document_key)
                .await
                .expect("document of a manifest");
            reports.insert(
                manifest["report_id"].as_str().unwrap().to_owned(),
                Report { manifest, document },
            );
        }
        // The log only grows: the events read now hold those read before.
        let events = read_events()
            .into_iter()
            .filter(|event| {
                let id = event["report_id"].as_str().unwrap_or_default();
                before.contains(id) || reports.contains_key(id)
            })
            .collect();
        Observed {
            events,
            dead_letters,
            reports,
            pending_uploads: self.bucket.pending_uploads("").await.len(),
        }
    }

    /// Waits until `done` holds for what is observed and the observation is
    /// settled (every stored report's event is published: a report's objects
    /// are written before the transaction that announces it) (bounded).
    pub async fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        done: impl Fn(&Observed) -> bool,
    ) -> Observed {
        let deadline = Instant::now() + limit;
        loop {
            let observed = self.observe().await;
            if observed.settled() && done(&observed) {
                return observed;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {} events, {} reports, {} dead letters; \
                 reports without an event: {:#?}",
                observed.events.len(),
                observed.reports.len(),
                observed.dead_letters.len(),
                observed.unannounced()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// A report generator's metric from its `/metrics` at `base`: the sum of
/// every series of `name` (all its labels), `None` while the worker does not
/// answer or does not export it yet.
pub async fn worker_metric(base: &str, name: &str) -> Option<f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name 3` or `name{labels} 3`, never a longer metric's name.
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(value) = rest
            .rsplit(' ')
            .next()
            .and_then(|value| value.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

impl TestStack {
    /// Replays the whole records log through another group into another
    /// bucket (its own watermark and event topics, `partitions` watermark
    /// partitions), and asserts that every report of `reports` is rendered
    /// again to the same key with the same bytes, within `limit`: every cut
    /// is decided by the log.
    pub async fn assert_replay_renders<'a>(
        &self,
        prefix: &str,
        partitions: i32,
        reports: impl IntoIterator<Item = (&'a String, &'a Report)>,
        limit: Duration,
    ) {
        self.assert_replay_renders_with(prefix, partitions, reports, limit, |_| {})
            .await;
    }

    /// [`TestStack::assert_replay_renders`] with the replaying worker's
    /// settings changed as the first run's were (a rollover count, say).
    pub async fn assert_replay_renders_with<'a>(
        &self,
        prefix: &str,
        partitions: i32,
        reports: impl IntoIterator<Item = (&'a String, &'a Report)>,
        limit: Duration,
        configure: impl FnOnce(&mut quire_config::Settings),
    ) {
        let bucket = crate::s3::TestBucket::create(&format!("{prefix}-replay")).await;
        let watermark_settings: Vec<(&str, &str)> = std::iter::once(("cleanup.policy", "compact"))
            .chain(quire_queue::WATERMARK_COMPACTION.iter().copied())
            .collect();
        let watermarks =
            crate::TestTopic::create_with(&format!("{prefix}-rw"), partitions, &watermark_settings)
                .await;
        let events = crate::TestTopic::create(&format!("{prefix}-re"), 3).await;
        let group = crate::unique(&format!("{prefix}-replay"));
        let mut replayer = self
            .worker("replayer")
            .with(|settings| {
                settings.s3.bucket = bucket.name.clone();
                settings.kafka.topics.watermarks = watermarks.name.clone();
                settings.kafka.topics.report_events = events.name.clone();
                settings.worker.group_id = group.clone();
                settings.kafka.partitions = partitions;
                configure(settings);
            })
            .spawn();
        let deadline = Instant::now() + limit;
        for (id, report) in reports {
            let key = report.manifest["key"].as_str().expect("a manifest's key");
            let replayed = loop {
                if let Some(manifest) = bucket.read(&format!("manifests/{id}.json")).await {
                    let manifest: Value = serde_json::from_slice(&manifest).expect("manifest");
                    assert_eq!(manifest["key"].as_str(), Some(key), "{id}: the same key");
                    break bucket.read(key).await.expect("replayed document");
                }
                assert!(Instant::now() < deadline, "replay did not render {id}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            };
            assert!(
                replayed == report.document,
                "replay of {id} rendered other bytes"
            );
        }
        replayer.kill();
    }
}

/// A report as stored: its manifest and its document's bytes.
#[derive(Debug, Clone)]
pub struct Report {
    pub manifest: Value,
    pub document: Vec<u8>,
}

impl Report {
    /// The records of the document, each as (field name -> text) of its
    /// child elements, parsed by an independent XML parser (the summary
    /// and a header named `header` left out).
    pub fn records(&self) -> Vec<BTreeMap<String, String>> {
        let text = std::str::from_utf8(&self.document).expect("UTF-8 document");
        let document = roxmltree::Document::parse(text).expect("well-formed XML");
        let root = document.root_element();
        root.children()
            .filter(|node| {
                // The summary, and a definition's header (the tests keep
                // its default name): not records.
                node.is_element() && !matches!(node.tag_name().name(), "summary" | "header")
            })
            .map(|record| {
                record
                    .children()
                    .filter(|node| node.is_element())
                    .map(|field| {
                        (
                            field.tag_name().name().to_owned(),
                            field.text().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .collect()
    }

    pub fn summary_records(&self) -> u64 {
        let text = std::str::from_utf8(&self.document).expect("UTF-8 document");
        let document = roxmltree::Document::parse(text).expect("well-formed XML");
        let summary = document
            .root_element()
            .children()
            .rev()
            .find(|node| node.is_element())
            .expect("a summary element");
        summary
            .attribute("records")
            .expect("records attribute")
            .parse()
            .unwrap()
    }

    pub fn stream(&self) -> &str {
        self.manifest["stream"].as_str().unwrap()
    }
}

/// What a test reads back after the pipeline ran.
#[derive(Debug, Clone)]
pub struct Observed {
    pub events: Vec<Value>,
    pub dead_letters: Vec<Value>,
    pub reports: BTreeMap<String, Report>,
    pub pending_uploads: usize,
}

impl Observed {
    /// Every stored report has its event (none is between its S3 write and
    /// its transaction).
    pub fn settled(&self) -> bool {
        self.unannounced().is_empty()
    }

    /// The manifests of the stored reports that no event announces (a
    /// settled observation has none).
    pub fn unannounced(&self) -> Vec<&Value> {
        self.reports
            .iter()
            .filter(|(id, _)| {
                !self
                    .events
                    .iter()
                    .any(|event| event["report_id"].as_str() == Some(id.as_str()))
            })
            .map(|(_, report)| &report.manifest)
            .collect()
    }

    /// The `seq` values of every record in every report of `stream`, in
    /// report order (by partition and offset) then document order.
    pub fn sequence_numbers(&self, stream: &str) -> Vec<u64> {
        let mut reports: Vec<&Report> = self
            .reports
            .values()
            .filter(|report| report.stream() == stream)
            .collect();
        reports.sort_by_key(|report| {
            (
                report.manifest["partition"].as_i64(),
                report.manifest["first_offset"].as_i64(),
            )
        });
        reports
            .iter()
            .flat_map(|report| report.records())
            .map(|record| {
                record
                    .get("seq")
                    .expect("seq field")
                    .parse()
                    .expect("seq number")
            })
            .collect()
    }

    /// The exactly-once checks: every record sent (`sent[stream]` = its
    /// sequence numbers) is in exactly one completed report, every report's
    /// event was published exactly once, every document matches its
    /// manifest, and no multipart upload is pending.
    pub fn assert_exactly_once(&self, sent: &BTreeMap<String, Vec<u64>>) {
        for (stream, sequence) in sent {
            let reported = self.sequence_numbers(stream);
            let expected: Vec<u64> = sequence.clone();
            let mut reported_sorted = reported.clone();
            reported_sorted.sort_unstable();
            let mut expected_sorted = expected.clone();
            expected_sorted.sort_unstable();
            assert_eq!(
                reported_sorted.len(),
                expected_sorted.len(),
                "stream {stream}: records reported {} != sent {}",
                reported.len(),
                expected.len()
            );
            assert_eq!(
                reported_sorted, expected_sorted,
                "stream {stream}: a record is missing or doubled"
            );
        }
        let mut event_ids = BTreeSet::new();
        for event in &self.events {
            let id = event["report_id"]
                .as_str()
                .expect("event report id")
                .to_owned();
            assert!(
                event_ids.insert(id.clone()),
                "event of {id} published twice"
            );
            let report = self
                .reports
                .get(&id)
                .unwrap_or_else(|| panic!("event of {id} without a stored report"));
            assert_eq!(
                event["sha256"], report.manifest["sha256"],
                "event and manifest of {id} disagree"
            );
        }
        for (id, report) in &self.reports {
            assert!(
                event_ids.contains(id),
                "report {id} stored but its event was never published"
            );
            use sha2::Digest;
            let digest = sha2::Sha256::digest(&report.document);
            let hex = hex::encode(digest);
            assert_eq!(
                report.manifest["sha256"].as_str(),
                Some(hex.as_str()),
                "document {id} does not match its manifest"
            );
            assert_eq!(
                report.manifest["bytes"].as_u64(),
                Some(report.document.len() as u64)
            );
            assert_eq!(
                report.summary_records(),
                report.records().len() as u64,
                "summary of {id}"
            );
        }
        assert_eq!(self.pending_uploads, 0, "multipart uploads left pending");
    }
}

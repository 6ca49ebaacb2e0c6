//! A full spill disk slows the worker down, never stops it (issue 27, part 3).
//!
//! The spill directory is a real 16 MiB tmpfs. 12 streams of about 10 MiB
//! each (about 130 MiB) are queued before a worker starts in drain mode under
//! a 32 MiB budget: far more than the budget and the disk together. Every
//! document passes one part (8 MiB), so documents spill until the disk is
//! full, keep growing in memory past the budget, and then send parts whose
//! start is in a spill file. The worker drains it all without a single
//! session restart: every record is in exactly one report, the spill-failure
//! counter shows the full-disk path ran, no multipart upload stays pending,
//! and the spill directory is empty at the end. The last line it prints,
//! `spill: ...`, holds the numbers.
//!
//! Gzip compressors cannot spill: past `worker.max_gzip_documents` the
//! largest gzip documents are cut early, and nothing is lost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use quire_tests::{TestStack, unique};

use crate::memory::queue_interleaved;

const STREAMS: u64 = 12;
/// About 12 KiB of JSON per record: 900 records make about 10.6 MiB a
/// stream, past one part of 8 MiB.
const RECORD_PAD: usize = 12 * 1024;
const RECORDS_PER_STREAM: u64 = 900;
const MIB: u64 = 1024 * 1024;
/// The smallest budget that holds two parts in flight and one being filled.
const BUDGET: u64 = 32 * MIB;
const PARTS_IN_FLIGHT_TOTAL: usize = 2;
const TMPFS_BYTES: u64 = 16 * MIB;
const DRAIN_LIMIT: Duration = Duration::from_secs(120);

/// A tmpfs of its own, mounted for the test and unmounted when dropped
/// (failed test included).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` on a new directory. Fails the test, naming
    /// why, when it cannot: the test needs a real small filesystem (root, or
    /// CAP_SYS_ADMIN, and mount(8)).
    fn mount(bytes: u64) -> Tmpfs {
        let dir = std::env::temp_dir().join(unique("quire-test-tmpfs"));
        std::fs::create_dir_all(&dir).expect("create the tmpfs mount point");
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .output();
        let failure = match mounted {
            Ok(output) if output.status.success() => None,
            Ok(output) => Some(format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )),
            Err(error) => Some(format!("cannot run mount(8): {error}")),
        };
        if let Some(failure) = failure {
            let _ = std::fs::remove_dir(&dir);
            panic!(
                "mounting a {} MiB tmpfs on {} failed ({failure}); this test needs a real small filesystem: run it as root or with CAP_SYS_ADMIN",
                bytes / MIB,
                dir.display()
            );
        }
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|status| status.success());
        if !unmounted {
            // Busy (a process still holds a file there): detach it now, the
            // kernel frees it once the last file closes.
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What the worker's own metrics showed, at most (all are counters, or
/// gauges whose peak is what matters).
#[derive(Debug, Default)]
struct Sampled {
    restarts: u64,
    spill_failures: u64,
    spilled: u64,
    over_budget: u64,
}

impl Sampled {
    async fn sample(&mut self, http: &reqwest::Client, base: &str) {
        let Ok(response) = http.get(format!("{base}/metrics")).send().await else {
            return;
        };
        let Ok(text) = response.text().await else {
            return;
        };
        let mut spill_failures = 0;
        for line in text.lines() {
            let Some((name, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let value = value as u64;
            let name = name.split('{').next().unwrap_or(name);
            match name {
                "quire_worker_restarts_total" => self.restarts = self.restarts.max(value),
                "quire_worker_spill_failures_total" => spill_failures += value,
                "quire_worker_spilled_bytes" => self.spilled = self.spilled.max(value),
                "quire_worker_memory_over_budget_bytes" => {
                    self.over_budget = self.over_budget.max(value)
                }
                _ => {}
            }
        }
        self.spill_failures = self.spill_failures.max(spill_failures);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spill_disk_slows_the_worker_down_and_never_stops_it() {
    let tmpfs = Tmpfs::mount(TMPFS_BYTES);
    let stack = TestStack::create("spill").await;
    let streams: Vec<String> = (0..STREAMS)
        .map(|index| format!("spill-{index:02}"))
        .collect();
    let queued_bytes = queue_interleaved(&stack, &streams, RECORDS_PER_STREAM, RECORD_PAD).await;
    assert!(
        queued_bytes > BUDGET + TMPFS_BYTES,
        "the backlog must not fit in the budget and the disk together"
    );

    let spill_dir = tmpfs.path().display().to_string();
    let drain_started = Instant::now();
    let (mut worker, metrics_base) = stack
        .worker("spill-0")
        .with(|settings| {
            settings.worker.memory_budget_bytes = BUDGET;
            settings.worker.parts_in_flight_total =
                std::num::NonZero::new(PARTS_IN_FLIGHT_TOTAL).unwrap();
            settings.worker.spill_dir = Some(spill_dir.clone());
        })
        .drain()
        .spawn_monitored();
    let http = reqwest::Client::new();
    let mut sampled = Sampled::default();
    let exit = loop {
        sampled.sample(&http, &metrics_base).await;
        assert_eq!(
            sampled.restarts,
            0,
            "the worker restarted its session {} time(s) after {:.1} s: a full spill disk must not fail a document ({sampled:?})",
            sampled.restarts,
            drain_started.elapsed().as_secs_f64()
        );
        if let Some(status) = worker.exited() {
            break status;
        }
        assert!(
            drain_started.elapsed() < DRAIN_LIMIT,
            "the worker did not drain the backlog within {DRAIN_LIMIT:?} ({sampled:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drained_in = drain_started.elapsed();
    assert!(exit.success(), "the worker exited with {exit}");

    let sent: BTreeMap<String, Vec<u64>> = streams
        .iter()
        .map(|stream| (stream.clone(), (0..RECORDS_PER_STREAM).collect()))
        .collect();
    let observed = stack.observe().await;
    observed.assert_exactly_once(&sent);

    let left: Vec<_> = std::fs::read_dir(tmpfs.path().join("spill-0"))
        .map(|entries| entries.flatten().map(|entry| entry.path()).collect())
        .unwrap_or_default();
    quire_tests::figures(&format!(
        "spill: {STREAMS} streams, {} MiB queued, drained in {:.1} s into {} reports with a {} MiB budget and a {} MiB spill disk; at most {} MiB spilled, {} MiB over budget; {} spills refused, {} restarts",
        queued_bytes / MIB,
        drained_in.as_secs_f64(),
        observed.reports.len(),
        BUDGET / MIB,
        TMPFS_BYTES / MIB,
        sampled.spilled / MIB,
        sampled.over_budget / MIB,
        sampled.spill_failures,
        sampled.restarts,
    ));
    assert!(left.is_empty(), "spill files left behind: {left:?}");
    assert!(
        sampled.spill_failures > 0,
        "the full-disk path never ran: no spill was refused ({sampled:?})"
    );
    assert!(
        sampled.spilled > 0,
        "the spill disk was never used ({sampled:?})"
    );
    assert!(
        sampled.over_budget > 0,
        "with the disk full, documents are held in memory past the budget ({sampled:?})"
    );
}

/// At most `worker.max_gzip_documents` gzip compressors stay open: with a
/// bound of 2 and 5 gzip streams queued, the worker cuts the largest by
/// marker (trigger `memory`) until 2 are left, exactly 3 of them; the two
/// left are cut by the API; every record is in exactly one report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_documents_past_their_bound_are_cut_early_and_nothing_is_lost() {
    const GZIP_STREAMS: u64 = 5;
    const BOUND: usize = 2;
    const RECORDS: u64 = 100;
    let stack = TestStack::create("gzip-bound").await;
    let api = stack.start_api().await;
    let streams: Vec<String> = (0..GZIP_STREAMS)
        .map(|index| format!("gzip-bound-{index}"))
        .collect();
    for stream in &streams {
        api.put_definition(stream, serde_json::json!({"gzip": true}))
            .await;
        api.send_ok(stream, &quire_tests::records(stream, 0, RECORDS))
            .await;
    }
    let _worker = stack
        .worker("gzip-bound-0")
        .with(|settings| {
            settings.worker.max_gzip_documents = std::num::NonZero::new(BOUND).unwrap()
        })
        .spawn();
    let memory_cuts = |observed: &quire_tests::Observed| {
        observed
            .reports
            .values()
            .filter(|report| report.manifest["trigger"] == "memory")
            .count()
    };
    let observed = stack
        .wait_for(
            "the gzip documents past the bound cut",
            Duration::from_secs(60),
            |observed| memory_cuts(observed) >= GZIP_STREAMS as usize - BOUND,
        )
        .await;
    let cut_early: Vec<String> = observed
        .reports
        .values()
        .map(|report| report.stream().to_owned())
        .collect();
    let left: Vec<&String> = streams
        .iter()
        .filter(|stream| !cut_early.contains(stream))
        .collect();
    assert_eq!(left.len(), BOUND, "{BOUND} gzip documents stay open");
    for stream in left {
        api.cut(stream).await;
    }
    let observed = stack
        .wait_for(
            "every gzip stream reported",
            Duration::from_secs(60),
            |observed| observed.reports.len() == GZIP_STREAMS as usize,
        )
        .await;
    assert_eq!(
        memory_cuts(&observed),
        GZIP_STREAMS as usize - BOUND,
        "only the documents past the bound are cut early"
    );
    for report in observed.reports.values() {
        let mut xml = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(report.document.as_slice()),
            &mut xml,
        )
        .expect("a gzip report");
        let seqs: Vec<u64> = quire_tests::Report {
            manifest: report.manifest.clone(),
            document: xml,
        }
        .records()
        .iter()
        .map(|record| record["seq"].parse().expect("seq number"))
        .collect();
        assert_eq!(
            seqs,
            (0..RECORDS).collect::<Vec<_>>(),
            "{}: every record once, in order",
            report.stream()
        );
    }
    assert_eq!(observed.events.len(), GZIP_STREAMS as usize);
    assert_eq!(
        observed.pending_uploads, 0,
        "multipart uploads left pending"
    );
}

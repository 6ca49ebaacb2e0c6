//! Documents rendered again because of rebalances: three report generators
//! (the release binaries) serve while eight streams send; one of them is
//! stopped (SIGTERM) and, once its partitions moved, started again. Every
//! open document a worker drops is rendered again from its first offset by
//! the partition's next owner. The workers' JSON logs say how many each
//! dropped and why: its partition was revoked (unavoidable: the partition
//! moves), or its whole session ended (a refused transaction restarting the
//! session drops the documents of the partitions it keeps, too).

use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure};
use quire_config::LogFormat;
use quire_tests::TestStack;
use serde_json::{Value, json};

#[derive(clap::Args, Clone)]
pub struct RebalanceArgs {
    /// Streams sending at once.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Seconds of steady sending before, between and after the two changes.
    #[arg(long, default_value_t = 15)]
    phase_secs: u64,
    /// Scale-in / scale-out cycles of the third worker.
    #[arg(long, default_value_t = 2)]
    cycles: usize,
}

/// What the workers' logs said, summed over the workers.
#[derive(Debug, Default, Clone)]
struct Counts {
    /// Open documents of revoked partitions, aborted by a live worker.
    revoked_documents: u64,
    /// Open documents dropped when a session ended on an error (restart).
    session_documents: u64,
    /// Open documents dropped by a worker stopping (SIGTERM).
    stopped_documents: u64,
    session_restarts: u64,
    refused_transactions: u64,
    assignments: u64,
    revocations: u64,
}

impl Counts {
    fn count(&mut self, entry: &Value) {
        // The workers log JSON with the event's fields flattened in.
        let fields = if entry["fields"].is_object() {
            &entry["fields"]
        } else {
            entry
        };
        let message = fields["message"].as_str().unwrap_or_default();
        let field = |name: &str| fields[name].as_u64().unwrap_or(0);
        match message {
            "partition revoked: aborting its open documents" => {
                self.revoked_documents += field("open");
                self.revocations += 1;
            }
            "open documents dropped: their next owner renders them again" => {
                if fields["ended"].as_str() == Some("error") {
                    self.session_documents += field("documents");
                } else {
                    self.stopped_documents += field("documents");
                }
            }
            "worker session failed; restarting after a backoff" => self.session_restarts += 1,
            "transaction refused by the group; committing what is still owned with the next array" => {
                self.refused_transactions += 1
            }
            "assignment taken" => self.assignments += 1,
            _ => {}
        }
    }
}

struct Worker {
    child: Child,
}

impl Worker {
    fn spawn(
        stack: &TestStack,
        replica: &str,
        counts: &Arc<Mutex<Counts>>,
    ) -> anyhow::Result<Self> {
        let mut child = stack
            .worker(replica)
            .with(|settings| settings.log.format = LogFormat::Json)
            .command()
            .env("RUST_LOG", "warn,report_generator=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?;
        let counts = Arc::clone(counts);
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Ok(entry) = serde_json::from_str::<Value>(&line) {
                    counts.lock().expect("counts").count(&entry);
                }
            }
        });
        Ok(Worker { child })
    }

    fn terminate(&mut self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        ensure!(status.success(), "kill -TERM");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_wait()?.is_none() {
            ensure!(Instant::now() < deadline, "worker did not stop");
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn run(args: RebalanceArgs) -> anyhow::Result<()> {
    let stack = TestStack::create("bench-rebalance").await;
    let api = stack
        .api()
        .try_start_api(Duration::from_secs(60))
        .await
        .map_err(|error| anyhow!(error))?;
    let base = api.base.clone();
    let http = reqwest::Client::new();

    let counts = Arc::new(Mutex::new(Counts::default()));
    let mut workers: BTreeMap<&str, Worker> = BTreeMap::new();
    for replica in ["r1", "r2", "r3"] {
        workers.insert(replica, Worker::spawn(&stack, replica, &counts)?);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    for index in 0..args.streams {
        let stream = format!(
            "rebalance-{index}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        let (http, base, stop, sent) = (
            http.clone(),
            base.clone(),
            Arc::clone(&stop),
            Arc::clone(&sent),
        );
        senders.push(tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(Ordering::Acquire) {
                let records: Vec<Value> = (seq..seq + 20)
                    .map(|n| json!({"seq": n, "text": "x".repeat(200)}))
                    .collect();
                if let Ok(response) = http
                    .post(format!("{base}/v1/streams/{stream}/records"))
                    .json(&records)
                    .send()
                    .await
                    && response.status().is_success()
                {
                    seq += 20;
                    sent.fetch_add(20, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    let phase = Duration::from_secs(args.phase_secs);
    tokio::time::sleep(phase).await;
    let warm = counts.lock().expect("counts").clone();
    for _ in 0..args.cycles {
        // Scale in: a stopped static member's partitions move after the
        // session timeout (6 s here); scale out: it joins again.
        workers.get_mut("r3").expect("r3").terminate()?;
        tokio::time::sleep(phase).await;
        workers.insert("r3", Worker::spawn(&stack, "r3", &counts)?);
        tokio::time::sleep(phase).await;
    }
    stop.store(true, Ordering::Release);
    for sender in senders {
        sender.await?;
    }
    let end = counts.lock().expect("counts").clone();
    for worker in workers.values_mut() {
        worker.terminate()?;
    }
    drop(api);

    let rebalances = (2 * args.cycles) as f64;
    let re_rendered = (end.revoked_documents - warm.revoked_documents)
        + (end.session_documents - warm.session_documents);
    println!(
        "3 workers, {} streams sending ({} records), r3 stopped and started {} times: {} rebalances",
        args.streams,
        sent.load(Ordering::Relaxed),
        args.cycles,
        rebalances
    );
    println!(
        "{:<58} {:>8}",
        "during the scaling (after warm-up)", "count"
    );
    let rows = [
        (
            "open documents of revoked partitions aborted",
            end.revoked_documents - warm.revoked_documents,
        ),
        (
            "open documents dropped by session restarts",
            end.session_documents - warm.session_documents,
        ),
        (
            "open documents dropped by the stopped worker",
            end.stopped_documents - warm.stopped_documents,
        ),
        (
            "session restarts",
            end.session_restarts - warm.session_restarts,
        ),
        (
            "transactions refused by the group, carried on",
            end.refused_transactions - warm.refused_transactions,
        ),
        ("partition revocations", end.revocations - warm.revocations),
        ("assignments taken", end.assignments - warm.assignments),
    ];
    for (name, value) in rows {
        println!("{name:<58} {value:>8}");
    }
    println!(
        "rebalance: rebalances={rebalances} re_rendered_by_live_workers={re_rendered} per_rebalance={:.1}",
        re_rendered as f64 / rebalances
    );
    Ok(())
}

//! Zombies are fenced and rebalances keep what they can: a worker frozen
//! while its partitions moved commits nothing when it wakes up, and two
//! processes with one replica id stop instead of fencing each other forever.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_tests::read_all;
use quire_tests::{Launch, Observed, TestStack, partition_of, records};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

fn stream_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Whether process `pid` is stopped (state `T` in /proc/<pid>/stat).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // The state follows the command name, which is in parentheses.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state == "T")
}

fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// Every committed watermark of `stream`, in log order.
fn watermark_history(stack: &TestStack, stream: &str) -> Vec<Value> {
    read_all(&stack.kafka, &stack.topics.watermarks, 12, true)
        .into_iter()
        .filter(|message| message.key.as_deref() == Some(stream.as_bytes()))
        .map(|message| serde_json::from_slice(&message.payload).expect("watermark JSON"))
        .collect()
}

fn root_of(watermark: &Value) -> Option<&str> {
    watermark["definition"]["root"].as_str()
}

fn events_of(observed: &Observed, report_id: &str) -> usize {
    observed
        .events
        .iter()
        .filter(|event| event["report_id"].as_str() == Some(report_id))
        .count()
}

/// What a zombie's late commit would break: a second event for a report, a
/// watermark going back, or a definition reverted.
fn zombie_damage(stack: &TestStack, observed: &Observed, stream: &str) -> Option<String> {
    if let Some(doubled) = observed.events.iter().find_map(|event| {
        let id = event["report_id"].as_str()?;
        (events_of(observed, id) > 1).then(|| id.to_owned())
    }) {
        return Some(format!("report.completed of {doubled} published twice"));
    }
    let history = watermark_history(stack, stream);
    for pair in history.windows(2) {
        let (earlier, later) = (&pair[0], &pair[1]);
        if later["offset"].as_i64() < earlier["offset"].as_i64() {
            return Some(format!(
                "the watermark of {stream} went back: {earlier} then {later}"
            ));
        }
        if root_of(earlier) == Some("after") && root_of(later) == Some("before") {
            return Some(format!(
                "the definition of {stream} was reverted: {earlier} then {later}"
            ));
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_frozen_before_its_commit_commits_nothing_once_its_partition_moved() {
    let stack = TestStack::create("fence-zombie").await;
    let api = stack.start_api().await;
    let reported = stream_name("zombie");
    let target = partition_of(&reported, 12);
    // Another stream on the same partition keeps a document open there, so
    // the partition's commit point does not move while reports complete.
    let pinned = (0..)
        .map(|_| stream_name("pinned"))
        .find(|candidate| partition_of(candidate, 12) == target)
        .unwrap();
    let mut sent: BTreeMap<String, Vec<u64>> = BTreeMap::new();

    let mut zombie = stack.worker("w1").failpoint("pause-before-commit").spawn();
    api.put_definition(&reported, json!({"root": "before"}))
        .await;
    api.send_ok(&pinned, &records(&pinned, 0, 5)).await;
    sent.insert(pinned.clone(), (0..5).collect());
    // The pinned document opened after the first definition: once the
    // commit point reaches it, the watermark carries that definition.
    let deadline = Instant::now() + LONG;
    while watermark_history(&stack, &reported)
        .last()
        .and_then(root_of)
        != Some("before")
    {
        assert!(
            Instant::now() < deadline,
            "the first definition was never persisted"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    api.put_definition(&reported, json!({"root": "after"}))
        .await;
    api.send_ok(&reported, &records(&reported, 0, 10)).await;
    sent.insert(reported.clone(), (0..10).collect());
    let first = api.cut(&reported).await;
    // W1 completes the report's object and manifest, then stops itself
    // before the transaction that would announce them.
    let deadline = Instant::now() + LONG;
    while !is_stopped(zombie.id()) {
        assert!(
            zombie.exited().is_none(),
            "the worker exited instead of pausing"
        );
        assert!(Instant::now() < deadline, "the worker never paused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let frozen = stack.observe().await;
    assert!(
        frozen.reports.contains_key(&first),
        "the object was completed before the pause"
    );
    assert_eq!(events_of(&frozen, &first), 0, "but not announced");

    // W2 takes the partition over once W1's session times out, renders the
    // report again and announces it; then the partition moves on.
    let mut successor = stack.worker("w2").spawn();
    stack
        .wait_for("the successor's announcement", LONG, |observed| {
            events_of(observed, &first) == 1
        })
        .await;
    let pinned_report = api.cut(&pinned).await;
    api.send_ok(&reported, &records(&reported, 10, 10)).await;
    sent.get_mut(&reported).unwrap().extend(10..20);
    let second = api.cut(&reported).await;
    stack
        .wait_for("the successor's next reports", LONG, |observed| {
            events_of(observed, &pinned_report) == 1 && events_of(observed, &second) == 1
        })
        .await;
    let deadline = Instant::now() + LONG;
    while watermark_history(&stack, &reported)
        .last()
        .and_then(root_of)
        != Some("after")
    {
        assert!(
            Instant::now() < deadline,
            "the second definition was never persisted"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // W1 wakes up and goes on with the commit it was about to make.
    signal(zombie.id(), "CONT");
    let settle = Instant::now() + Duration::from_secs(15);
    while Instant::now() < settle {
        let observed = stack.observe().await;
        if let Some(damage) = zombie_damage(&stack, &observed, &reported) {
            panic!("the thawed worker committed: {damage}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    zombie.kill();
    successor.kill();

    // A later owner starts from what is committed: the later definition,
    // and nothing reported twice.
    let _later = stack.worker("w3").spawn();
    api.send_ok(&reported, &records(&reported, 20, 10)).await;
    sent.get_mut(&reported).unwrap().extend(20..30);
    let third = api.cut(&reported).await;
    let observed = stack
        .wait_for("the later owner's report", LONG, |observed| {
            events_of(observed, &third) == 1
        })
        .await;
    if let Some(damage) = zombie_damage(&stack, &observed, &reported) {
        panic!("{damage}");
    }
    observed.assert_exactly_once(&sent);
    for id in [&first, &second, &third] {
        let text = std::str::from_utf8(&observed.reports[id].document).expect("UTF-8");
        let document = roxmltree::Document::parse(text).expect("well-formed XML");
        assert_eq!(
            document.root_element().tag_name().name(),
            "after",
            "report {id} was rendered with a reverted definition"
        );
    }
}

/// A worker whose stderr is kept, for what it says when it exits.
struct LoggedWorker {
    child: std::process::Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl LoggedWorker {
    fn spawn(launch: Launch) -> LoggedWorker {
        let mut child = launch
            .command()
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start report-generator");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("{line}");
                let mut log = sink.lock().expect("log");
                log.push_str(&line);
                log.push('\n');
            }
        });
        LoggedWorker { child, log }
    }
}

impl Drop for LoggedWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_with_one_replica_id_stop_fencing_each_other_and_say_why() {
    let stack = TestStack::create("fence-twins").await;
    let twin = || {
        stack
            .worker("twin")
            .with(|settings| settings.worker.restart_backoff_initial = Duration::from_millis(200))
    };
    let mut first = LoggedWorker::spawn(twin());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut second = LoggedWorker::spawn(twin());
    let deadline = Instant::now() + Duration::from_secs(150);
    let (status, log) = loop {
        if let Some(status) = first.child.try_wait().expect("try_wait") {
            break (status, first.log.lock().unwrap().clone());
        }
        if let Some(status) = second.child.try_wait().expect("try_wait") {
            break (status, second.log.lock().unwrap().clone());
        }
        assert!(
            Instant::now() < deadline,
            "two workers with one replica id still fence each other after 150 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        !status.success(),
        "a worker sharing its replica id exits non-zero"
    );
    assert!(
        log.contains("worker.replica_id") && log.contains("\"twin\""),
        "its last words name worker.replica_id and the id: {log}"
    );
}

fn out(topic: &str, tag: &str) -> quire_queue::OutMessage {
    quire_queue::OutMessage::new(topic, None, tag.as_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transaction_carries_every_owned_partition_so_a_fenced_member_commits_nothing() {
    use quire_queue::{ArrayConsumer, ConsumerOptions, QueueError, TransactionalProducer};
    let settings = quire_tests::kafka_settings();
    let topic = quire_tests::TestTopic::create("fence-offsets", 2).await;
    let output = quire_tests::TestTopic::create("fence-offsets-out", 1).await;
    let group = quire_tests::unique("fence-offsets");
    let producer =
        TransactionalProducer::connect(&settings, &quire_tests::unique("fence-producer"))
            .await
            .expect("producer");
    // Twenty messages on partition 0; partition 1 stays empty, never read.
    producer
        .transact(
            (0..20)
                .map(|n| out(&topic.name, &format!("m{n}")).to_partition(0))
                .collect(),
        )
        .await
        .expect("input");
    let mut options = ConsumerOptions::new(&group, &topic.name);
    options.group_instance_id = Some("member".into());
    options.cooperative = true;
    options.session_timeout = Some(Duration::from_secs(6));
    let first = ArrayConsumer::new(&settings, &options).expect("consumer");
    let deadline = Instant::now() + LONG;
    let mut read = 0;
    let last = loop {
        let array = first
            .next_array(100, Duration::from_millis(300))
            .await
            .expect("next_array");
        read += array.len();
        if read >= 20 {
            break array;
        }
        assert!(Instant::now() < deadline, "only {read} of 20 read");
    };

    // Only partition 0's offset is given; partition 1's start goes too.
    let outcome = first
        .commit_in_transaction(
            &last,
            Some(BTreeMap::from([(0, 20)])),
            &producer,
            vec![out(&output.name, "committed")],
        )
        .await
        .expect("a member's transaction");
    assert_eq!(outcome.commit.committed, BTreeMap::from([(0, 20), (1, 0)]));
    assert_eq!(
        quire_tests::committed_offsets(&settings, &group, &topic.name, 2),
        vec![Some(20), Some(0)]
    );

    // A second consumer with the same static member id takes the
    // membership over; the first, with no offset to move, still publishes
    // under its old membership, and is refused.
    let second = ArrayConsumer::new(&settings, &options).expect("consumer");
    let deadline = Instant::now() + LONG;
    while second.assignment().is_empty() {
        assert!(Instant::now() < deadline, "the second member got nothing");
        second
            .next_array(100, Duration::from_millis(300))
            .await
            .expect("next_array");
    }
    let error = first
        .commit_in_transaction(
            &last,
            Some(BTreeMap::new()),
            &producer,
            vec![out(&output.name, "zombie")],
        )
        .await
        .expect_err("a fenced member's transaction");
    assert!(matches!(error, QueueError::GroupRefused(_)), "{error}");
    let published: Vec<Vec<u8>> = read_all(&settings, &output.name, 1, true)
        .into_iter()
        .map(|message| message.payload)
        .collect();
    assert_eq!(published, vec![b"committed".to_vec()]);
    tokio::task::block_in_place(|| drop((first, second, producer)));
}

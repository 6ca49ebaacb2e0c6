//! Production's shape, three brokers, one of them dying under the pipeline
//! (issue 27, part 6: the worker's stall after a records leader is killed).
//!
//! What held the worker: a worker that takes partitions over reads their
//! watermark partitions with a `PartitionReader`, and librdkafka sends a
//! watermark request to the leader its cached metadata names, dead or not;
//! nothing refreshed that cache when the controller moved the leadership.
//! Each request then waited its whole timeout at the dead broker, every
//! retry too, until the take-over gave up after `kafka.request_timeout_ms`
//! (30 s) and the session restarted: worker stalls of 35-56 s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quire_queue::{OutMessage, PartitionReader, ReaderOptions, TopicSpec, TransactionalProducer};
use quire_tests::kafka_process::{KafkaCluster, transaction_state_partition};
use quire_tests::{Attempt, TestStack, partition_of, records};

use crate::faults::{
    CLIENT_TIMEOUT, LONG, accepted_by_stream, blocking, send_numbered, stream_name,
    wait_until_reported,
};

/// The brokers' own failover: the controller fences a broker that stops
/// heartbeating after `broker.session.timeout.ms` (9 s by default), and
/// its partitions get new leaders.
const BROKER_FAILOVER: Duration = Duration::from_secs(9);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_asks_the_new_leader_once_the_brokers_moved_it() {
    let mut cluster = blocking(|| KafkaCluster::start_new(3));
    let topic = TopicSpec {
        name: quire_tests::unique("test.leader-moves"),
        partitions: 1,
        replication: 3,
        config: Default::default(),
        growable: false,
    };
    cluster.create_topics(std::slice::from_ref(&topic)).await;
    let settings = cluster.settings();
    let messages: Vec<OutMessage> = (0..10)
        .map(|index| OutMessage::new(&topic.name, None, format!("{index}").into_bytes()))
        .collect();
    TransactionalProducer::connect(&settings, &quire_tests::unique("test-leader-moves"))
        .await
        .expect("producer")
        .transact(messages)
        .await
        .expect("publish");
    let reader = PartitionReader::new(&settings, "test-leader-moves", ReaderOptions::default())
        .expect("reader");
    // Both of the reader's clients learn the leader, once the transaction's
    // commit marker is written (the last stable offset passed its messages).
    let name = topic.name.clone();
    let before = blocking(|| {
        let stable = reader
            .wait_until_stable_past(&name, 0, 9, Duration::from_secs(30))
            .expect("last stable offset");
        let deadline = Instant::now() + Duration::from_secs(30);
        (
            reader
                .watermarks(&name, 0, deadline)
                .expect("high watermark"),
            stable,
        )
    });

    let leader = blocking(|| cluster.leader_of(&name, 0));
    blocking(|| cluster.kill(leader));
    let killed = Instant::now();
    // As the take-over asks (watermarks::load): with the request timeout as
    // its deadline.
    let after = blocking(|| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let high = reader.watermarks(&name, 0, deadline);
        let stable = reader.stable_watermarks(&name, 0, deadline);
        (high, stable)
    });
    let took = killed.elapsed();
    quire_tests::figures(&format!(
        "leader moves: node {leader} killed; the reader answered {:?} / {:?} after {took:?}",
        after.0.as_ref().map_err(ToString::to_string),
        after.1.as_ref().map_err(ToString::to_string)
    ));
    assert_eq!(
        after.0.expect("the high watermark from the new leader"),
        before.0
    );
    assert_eq!(
        after.1.expect("the last stable offset from the new leader"),
        before.1
    );
    // The failover, then a request timeout (5 s) or two: not the whole
    // deadline.
    assert!(
        took < BROKER_FAILOVER + Duration::from_secs(15),
        "the reader took {took:?} to reach the new leader"
    );
    drop(cluster);
}

/// `quire_worker_records_total` from the worker's `/metrics`, sampled every
/// 250 ms until `stop`: when the worker's progress stalled.
async fn sample_worker_records(metrics_url: String, stop: Arc<AtomicBool>) -> Vec<(Instant, f64)> {
    let http = reqwest::Client::new();
    let mut samples = Vec::new();
    while !stop.load(Ordering::Acquire) {
        if let Ok(response) = http.get(&metrics_url).send().await
            && let Ok(text) = response.text().await
            && let Some(value) = text
                .lines()
                .find_map(|line| line.strip_prefix("quire_worker_records_total "))
                .and_then(|value| value.trim().parse::<f64>().ok())
        {
            samples.push((Instant::now(), value));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    samples
}

/// Around `at`: from the last accepted array before it to the first after
/// it (the API's refusal window), and how many 503s came in between.
fn acceptance_gap(attempts: &[&Attempt], at: Instant) -> (Duration, usize) {
    let before = attempts
        .iter()
        .filter(|attempt| attempt.accepted() && attempt.answered_at <= at)
        .map(|attempt| attempt.answered_at)
        .max()
        .unwrap_or(at);
    let after = attempts
        .iter()
        .filter(|attempt| attempt.accepted() && attempt.answered_at > at)
        .map(|attempt| attempt.answered_at)
        .min()
        .expect("an array accepted after the kill");
    let refused = attempts
        .iter()
        .filter(|attempt| attempt.answered_at > before && attempt.answered_at < after)
        .filter(|attempt| matches!(&attempt.outcome, Ok(answer) if answer.status == 503))
        .count();
    (after - before, refused)
}

/// Around `at`: the worker's last progress at or before it (`at` if none)
/// and its first progress after it.
fn progress_around(samples: &[(Instant, f64)], at: Instant) -> (Instant, Instant) {
    let mut last_progress = None;
    let mut previous = None;
    for &(when, value) in samples {
        let moved = previous.is_some_and(|earlier| value > earlier);
        previous = Some(value);
        if !moved {
            continue;
        }
        if when <= at {
            last_progress = Some(when);
        } else {
            return (last_progress.unwrap_or(at), when);
        }
    }
    panic!("the worker made no progress after the kill at all");
}

/// Around `at`: from the worker's last progress before it to its first
/// after it.
fn progress_gap(samples: &[(Instant, f64)], at: Instant) -> Duration {
    let (last, next) = progress_around(samples, at);
    next - last
}

/// Around `at`: how long the worker went without progress while it had
/// something to do. Its progress gap, counted from `at` if records accepted
/// since its last progress were waiting then, or else from the first array
/// accepted after `at` (a worker with nothing to read is not stalled).
fn worker_delay(samples: &[(Instant, f64)], attempts: &[&Attempt], at: Instant) -> Duration {
    let (last, next) = progress_around(samples, at);
    let waiting_since = attempts
        .iter()
        .filter(|attempt| attempt.accepted() && attempt.answered_at > last)
        .map(|attempt| attempt.answered_at)
        .min()
        .map_or(next, |accepted| accepted.max(at));
    next.saturating_duration_since(waiting_since)
}

/// Production's shape: three brokers, every topic replicated three times
/// with `min.insync.replicas=2`. SIGKILLed mid-run while three senders
/// publish and a worker serves: first the leader of the partition of
/// `__transaction_state` that coordinates the API's first producer, then
/// the leader of the busiest records partition; each restarted 10 s
/// later. Nothing accepted may be lost, doubled or left behind a hanging
/// transaction; the API's refusal window and the worker's stall are
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_brokers_losing_a_coordinator_and_a_records_leader_lose_double_and_hold_back_nothing()
{
    let mut cluster = blocking(|| KafkaCluster::start_new(3));
    let stack = TestStack::create_on_cluster("fault-3b", &cluster).await;
    // Releases, recreated producers and each request's outcome: what a
    // request left without an answer was waiting for.
    let launch = stack
        .api()
        .log_filter("warn,quire_queue=info,producer_api=info");
    let prefix = launch.settings.api.transactional_id_prefix.clone();
    let api = Arc::new(launch.start_api().await);
    let (mut worker, base) = stack
        .worker("w1")
        .log_filter("warn,report_generator=info,report_generator::worker=debug,quire_queue=info")
        .spawn_monitored();
    let stop = Arc::new(AtomicBool::new(false));
    let streams: Vec<String> = (0..3)
        .map(|index| stream_name(&format!("b3{index}")))
        .collect();
    let senders: Vec<_> = streams
        .iter()
        .map(|stream| {
            tokio::spawn(send_numbered(
                api.clone(),
                stream.clone(),
                20,
                Duration::from_millis(100),
                records,
                stop.clone(),
            ))
        })
        .collect();
    // Sampled until everything is reported: a worker that resumes only
    // after the senders stopped still shows when.
    let sampled = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_worker_records(
        format!("{base}/metrics"),
        sampled.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;

    // The coordinator of the API's first producer (`{prefix}-api-0-0`;
    // the test cluster has 3 transaction-state partitions).
    let coordinating = transaction_state_partition(&format!("{prefix}-api-0-0"), 3);
    let coordinator = blocking(|| cluster.leader_of("__transaction_state", coordinating));
    blocking(|| cluster.kill(coordinator));
    let coordinator_killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    blocking(|| cluster.start(coordinator));
    tokio::time::sleep(Duration::from_secs(10)).await;

    let busiest = partition_of(&streams[0], 12) as i32;
    let leader = blocking(|| cluster.leader_of(&stack.topics.records, busiest));
    blocking(|| cluster.kill(leader));
    let leader_killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    blocking(|| cluster.start(leader));
    tokio::time::sleep(Duration::from_secs(10)).await;

    stop.store(true, Ordering::Release);
    let mut results = Vec::new();
    for sender in senders {
        results.push(sender.await.expect("sender task"));
    }
    let attempts: Vec<&Attempt> = results.iter().flat_map(|sent| &sent.attempts).collect();
    let (coordinator_window, coordinator_refusals) = acceptance_gap(&attempts, coordinator_killed);
    let (leader_window, leader_refusals) = acceptance_gap(&attempts, leader_killed);
    // When each unanswered request was sent, from the coordinator's kill
    // (the records leader was killed about 20 s later).
    let unanswered_at: Vec<String> = attempts
        .iter()
        .filter(|attempt| attempt.outcome.is_err())
        .map(|attempt| {
            let at = attempt
                .sent_at
                .saturating_duration_since(coordinator_killed);
            format!("{:.1}s", at.as_secs_f64())
        })
        .collect();
    let no_answer = unanswered_at.len();
    assert_eq!(
        no_answer, 0,
        "requests got no answer within {CLIENT_TIMEOUT:?} (sent at {unanswered_at:?} after the \
         coordinator kill)"
    );
    let sent = accepted_by_stream(&results);
    for stream in sent.keys() {
        api.cut(stream).await;
    }
    let observed = wait_until_reported(&stack, &mut worker, Some(&base), &sent, LONG).await;
    sampled.store(true, Ordering::Release);
    let samples = sampler.await.expect("sampler task");
    let coordinator_delay = worker_delay(&samples, &attempts, coordinator_killed);
    let leader_delay = worker_delay(&samples, &attempts, leader_killed);
    quire_tests::figures(&format!(
        "three brokers: {} attempts, {} records accepted, every request answered; \
         coordinator (node {coordinator}) killed: no array accepted for {coordinator_window:?} \
         ({coordinator_refusals} answered 503), worker stalled {:?} ({coordinator_delay:?} with \
         records waiting); records leader (node {leader}) killed: no array accepted for \
         {leader_window:?} ({leader_refusals} answered 503), worker stalled {:?} \
         ({leader_delay:?} with records waiting)",
        attempts.len(),
        sent.values().map(Vec::len).sum::<usize>(),
        progress_gap(&samples, coordinator_killed),
        progress_gap(&samples, leader_killed),
    ));
    // A worker that loses a broker waits for the brokers' failover (the
    // controller fences a silent broker after broker.session.timeout.ms,
    // 9 s, and moves its leaderships and coordinators), for its own session
    // (a group coordinator gone: its session times out and it rejoins the
    // new one) and at most a transaction timeout for a transaction in
    // flight; nothing of it waits for a request timeout (30 s) on a dead
    // broker.
    let settings = stack.worker_settings("w1");
    let bound =
        BROKER_FAILOVER + settings.worker.session_timeout + settings.kafka.transaction_timeout;
    for (kill, delay) in [
        ("coordinator", coordinator_delay),
        ("records leader", leader_delay),
    ] {
        assert!(
            delay <= bound,
            "after the {kill} kill the worker stood still for {delay:?} with records waiting, \
             more than {bound:?}"
        );
    }
    observed.assert_exactly_once(&sent);
    // Nothing left behind a hanging transaction: a transaction in flight
    // (a periodic release) may hold a partition for a moment, never past
    // the transaction timeout.
    for partition in 0..12 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let settings = stack.kafka.clone();
            let topic = stack.topics.records.clone();
            let (stable, high) =
                blocking(move || quire_tests::stable_and_high(&settings, &topic, partition));
            if stable == high {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}[{partition}]: the last stable offset stays behind the high watermark ({stable} < {high}) for 30 s",
                stack.topics.records
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert!(
        worker.exited().is_none(),
        "the worker exited instead of resuming by itself"
    );
    drop(api);
    drop(cluster);
}

//! The consumer's keep-alive, against the real broker: a member whose work
//! on an array outlasts `max.poll.interval.ms` stays in its group, reads on
//! exactly where it stopped (pausing drops what librdkafka prefetched, which
//! is fetched again), and a rebalance that comes meanwhile reaches it with
//! its next read, never in the middle of its work.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quire_queue::{
    Array, ArrayConsumer, ConsumerOptions, MessageId, OutMessage, RebalanceEvent,
    TransactionalProducer,
};
use quire_tests::{TestTopic, kafka_settings, unique};

/// The least librdkafka allows with a session timeout of 6 s.
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(6);

fn options(group: &str, topic: &TestTopic) -> ConsumerOptions {
    let mut options = ConsumerOptions::new(group, &topic.name);
    options.cooperative = true;
    options.session_timeout = Some(Duration::from_secs(6));
    options.max_poll_interval = Some(MAX_POLL_INTERVAL);
    options
}

async fn publish(topic: &TestTopic, count: usize) {
    let messages: Vec<OutMessage> = (0..count)
        .map(|index| {
            OutMessage::new(
                &topic.name,
                Some(format!("key-{index}").into_bytes()),
                format!("message {index}").into_bytes(),
            )
        })
        .collect();
    TransactionalProducer::connect(&kafka_settings(), &unique("test-keep-alive"))
        .await
        .expect("producer")
        .transact(messages)
        .await
        .expect("publish");
}

/// The first array that holds messages, read `max` at a time (librdkafka
/// prefetches the rest).
async fn first_array(consumer: &ArrayConsumer, max: usize) -> Array {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let array = consumer
            .next_array(max, Duration::from_millis(300))
            .await
            .expect("next_array");
        if !array.is_empty() {
            return array;
        }
        assert!(Instant::now() < deadline, "no message within 60 s");
    }
}

fn record(seen: &mut BTreeMap<MessageId, usize>, array: &Array) {
    for message in &array.messages {
        *seen.entry(message.id()).or_default() += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_array_work_outlasts_max_poll_interval_stays_and_reads_on_exactly() {
    let topic = TestTopic::create("keep-alive", 3).await;
    let sent = 300;
    publish(&topic, sent).await;
    let consumer =
        ArrayConsumer::new(&kafka_settings(), &options(&unique("keep-alive"), &topic)).unwrap();
    let mut seen = BTreeMap::new();
    let array = first_array(&consumer, 10).await;
    record(&mut seen, &array);

    // The work on this array (S3 uploads in a brownout, say) takes three
    // max poll intervals; the keep-alive pauses the partitions and polls.
    let keep_alive = consumer.keep_alive();
    tokio::time::sleep(MAX_POLL_INTERVAL * 3).await;
    keep_alive.stop().await;
    let committed = consumer
        .commit(&array)
        .await
        .expect("the group still counts this member: its commit is accepted");
    assert!(committed.dropped.is_empty(), "{committed:?}");

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut events = Vec::new();
    while seen.len() < sent {
        assert!(
            Instant::now() < deadline,
            "{} of {sent} messages read",
            seen.len()
        );
        let array = consumer
            .next_array(100, Duration::from_millis(300))
            .await
            .expect("next_array");
        events.extend(array.rebalances.iter().cloned());
        record(&mut seen, &array);
        consumer.commit(&array).await.expect("commit");
    }
    assert!(
        events.is_empty(),
        "the partitions moved though the member polled: {events:?}"
    );
    let twice: Vec<&MessageId> = seen
        .iter()
        .filter(|(_, count)| **count > 1)
        .map(|(id, _)| id)
        .collect();
    assert!(twice.is_empty(), "read twice after the pause: {twice:?}");
    // Each partition read from its first offset on, without a gap.
    let mut by_partition: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for id in seen.keys() {
        by_partition
            .entry(id.partition)
            .or_default()
            .push(id.offset);
    }
    for (partition, offsets) in by_partition {
        let expected: Vec<i64> = (offsets[0]..offsets[0] + offsets.len() as i64).collect();
        assert_eq!(offsets, expected, "partition {partition} has a gap");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_served_by_a_keep_alive_reaches_the_member_with_its_next_read() {
    let topic = TestTopic::create("keep-alive-rebalance", 4).await;
    let sent = 400;
    publish(&topic, sent).await;
    let group = unique("keep-alive-rebalance");
    let first = ArrayConsumer::new(&kafka_settings(), &options(&group, &topic)).unwrap();
    let seen = Arc::new(Mutex::new(BTreeMap::new()));
    let array = first_array(&first, 10).await;
    record(&mut seen.lock().unwrap(), &array);
    assert_eq!(first.assignment().len(), 4, "the only member holds all");

    let keep_alive = first.keep_alive();
    // A second member joins while the first works on its array.
    let second = Arc::new(ArrayConsumer::new(&kafka_settings(), &options(&group, &topic)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (second, stop, seen) = (Arc::clone(&second), Arc::clone(&stop), Arc::clone(&seen));
        tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                let array = second
                    .next_array(100, Duration::from_millis(300))
                    .await
                    .expect("next_array of the second member");
                record(&mut seen.lock().unwrap(), &array);
                let _refused_is_read_again = second.commit(&array).await;
            }
        })
    };
    // For three max poll intervals, the first member's assignment does not
    // change under its work: the revocation waits for its next read.
    let window = Instant::now() + MAX_POLL_INTERVAL * 3;
    while Instant::now() < window {
        assert_eq!(
            first.assignment().len(),
            4,
            "the assignment changed in the middle of the array's work"
        );
        assert!(
            second.assignment().is_empty(),
            "the second member got partitions the first still works on"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    keep_alive.stop().await;
    let mut pending = vec![array];
    first
        .commit_in_order(&mut pending)
        .await
        .expect("commit of the array in hand");

    // The next read applies the revocation; then the second member gets
    // the partitions, and between them they read everything.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut revoked = BTreeSet::new();
    let mut revoked_by_first_read = None;
    loop {
        let read = seen.lock().unwrap().len();
        if read >= sent && !second.assignment().is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{read} of {sent} read; revoked {revoked:?}; the second member holds {:?}",
            second.assignment()
        );
        let array = first
            .next_array(100, Duration::from_millis(300))
            .await
            .expect("next_array of the first member");
        for event in &array.rebalances {
            if let RebalanceEvent::Revoked { partitions, .. } = event {
                revoked.extend(partitions.iter().copied());
            }
        }
        revoked_by_first_read.get_or_insert(!revoked.is_empty());
        record(&mut seen.lock().unwrap(), &array);
        pending.push(array);
        first.commit_in_order(&mut pending).await.expect("commit");
    }
    stop.store(true, Ordering::Release);
    reader.await.expect("the second member's task");
    assert_eq!(
        revoked_by_first_read,
        Some(true),
        "the first read after the work carries the revocation"
    );
    let first_holds: BTreeSet<i32> = first.assignment().into_iter().collect();
    let second_holds: BTreeSet<i32> = second.assignment().into_iter().collect();
    assert!(first_holds.is_disjoint(&second_holds));
    assert_eq!(first_holds.len() + second_holds.len(), 4);
    assert_eq!(
        seen.lock().unwrap().len(),
        sent,
        "every message read by one member or the other"
    );
}

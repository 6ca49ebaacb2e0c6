//! The array queue, against the real broker: each test names the behaviour
//! it checks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use quire_queue::{
    ArrayBounds, ArrayConsumer, ArrayEnqueuer, ConsumerOptions, DrainExit, GroupCommitLimits,
    MessageId, OutMessage, ProducerOptions, QueueError, RebalanceEvent, Release,
    TransactionalProducer,
};
use quire_tests::{
    TestTopic, committed_offsets, delete_records_before, kafka_settings, payloads, read_all, unique,
};

fn messages(topic: &str, count: usize, tag: &str) -> Vec<OutMessage> {
    payloads(count, 40)
        .into_iter()
        .enumerate()
        .map(|(index, mut payload)| {
            payload.extend_from_slice(tag.as_bytes());
            OutMessage::new(
                topic,
                Some(format!("key-{}", index % 7).into_bytes()),
                payload,
            )
        })
        .collect()
}

/// A message librdkafka refuses locally (larger than message.max.bytes), so
/// the transaction it is in must abort.
fn oversized(topic: &str) -> OutMessage {
    OutMessage::new(topic, None, vec![b'x'; 2_000_000])
}

async fn producer() -> TransactionalProducer {
    TransactionalProducer::connect(&kafka_settings(), &unique("test-producer"))
        .await
        .expect("producer")
}

fn consumer(topic: &TestTopic, group: &str) -> ArrayConsumer {
    ArrayConsumer::new(&kafka_settings(), &ConsumerOptions::new(group, &topic.name))
        .expect("consumer")
}

/// Reads arrays until `count` messages have arrived (bounded); the arrays
/// that held messages, in order (a wait that timed out empty, as the first
/// ones do while the group assigns partitions on a busy machine, is left out).
async fn read_until(consumer: &ArrayConsumer, count: usize) -> Vec<quire_queue::Array> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut arrays = Vec::new();
    let mut total = 0;
    while total < count {
        assert!(
            Instant::now() < deadline,
            "only {total} of {count} messages arrived"
        );
        let array = consumer
            .next_array(500, Duration::from_millis(500))
            .await
            .expect("next_array");
        total += array.len();
        if !array.is_empty() {
            arrays.push(array);
        }
    }
    arrays
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_is_one_transaction_and_ids_match_what_a_consumer_reads() {
    let topic = TestTopic::create("ids", 3).await;
    let producer = producer().await;
    let sent = messages(&topic.name, 2_500, "");
    let ids = producer.transact(sent.clone()).await.expect("transact");

    assert_eq!(ids.len(), sent.len(), "one id per message");
    let seen = read_all(&kafka_settings(), &topic.name, 3, true);
    assert_eq!(seen.len(), sent.len());
    let by_id: BTreeMap<MessageId, _> = seen
        .iter()
        .map(|message| {
            (
                MessageId {
                    partition: message.partition,
                    offset: message.offset,
                },
                message,
            )
        })
        .collect();
    for (id, message) in ids.iter().zip(&sent) {
        let found = by_id
            .get(id)
            .unwrap_or_else(|| panic!("id {id} not in the log"));
        assert_eq!(
            found.payload, message.payload,
            "id {id} names another message"
        );
        assert_eq!(found.key, message.key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_array_is_invisible_to_read_committed_consumers() {
    let topic = TestTopic::create("abort", 3).await;
    let producer = producer().await;
    let mut doomed = messages(&topic.name, 1_000, "-doomed");
    doomed.push(oversized(&topic.name));
    let error = producer
        .transact(doomed)
        .await
        .expect_err("the oversized message aborts the array");
    assert!(
        matches!(error, QueueError::TransactionAborted(_)),
        "{error}"
    );

    // The producer is still usable, and only the next array is visible.
    let kept = messages(&topic.name, 100, "-kept");
    producer
        .transact(kept.clone())
        .await
        .expect("transact after abort");
    let seen = read_all(&kafka_settings(), &topic.name, 3, true);
    assert_eq!(seen.len(), kept.len());
    assert!(
        seen.iter()
            .all(|message| message.payload.ends_with(b"-kept"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_share_transactions() {
    let topic = TestTopic::create("group-commit", 3).await;
    let mut settings = kafka_settings();
    settings
        .properties
        .insert("statistics.interval.ms".into(), "100".into());
    let producer = TransactionalProducer::connect(&settings, &unique("test-group-commit"))
        .await
        .unwrap();
    let enqueuer = ArrayEnqueuer::start(producer.clone(), GroupCommitLimits::default());

    let callers = 64;
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let enqueuer = enqueuer.clone();
            let array = messages(&topic.name, 50, &format!("-caller{caller}"));
            tokio::spawn(async move { (caller, enqueuer.enqueue_array(array).await) })
        })
        .collect();
    let mut all_ids = BTreeSet::new();
    for task in tasks {
        let (caller, result) = task.await.unwrap();
        let ids = result.unwrap_or_else(|error| panic!("caller {caller}: {error}"));
        assert_eq!(ids.len(), 50);
        all_ids.extend(ids);
    }
    assert_eq!(all_ids.len(), callers * 50, "every message has its own id");
    assert_eq!(
        read_all(&settings, &topic.name, 3, true).len(),
        callers * 50
    );

    let transactions = wait_for_request_count(&producer, "EndTxn", 1).await;
    assert!(
        transactions < callers as i64,
        "{callers} concurrent arrays took {transactions} transactions: no sharing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_group_transaction_fails_every_caller_in_it_and_shows_none() {
    let topic = TestTopic::create("group-abort", 3).await;
    let producer = producer().await;
    let enqueuer = ArrayEnqueuer::start(producer, GroupCommitLimits::default());

    // A large array keeps the producer busy, so the next two arrays queue up
    // behind it and share the following transaction.
    let busy = {
        let enqueuer = enqueuer.clone();
        let array = messages(&topic.name, 40_000, "-busy");
        tokio::spawn(async move { enqueuer.enqueue_array(array).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let good = {
        let enqueuer = enqueuer.clone();
        let array = messages(&topic.name, 100, "-good");
        tokio::spawn(async move { enqueuer.enqueue_array(array).await })
    };
    let bad = {
        let enqueuer = enqueuer.clone();
        let mut array = messages(&topic.name, 100, "-bad");
        array.push(oversized(&topic.name));
        tokio::spawn(async move { enqueuer.enqueue_array(array).await })
    };
    busy.await.unwrap().expect("the busy array commits");
    let bad_error = bad
        .await
        .unwrap()
        .expect_err("an array with an oversized message fails");
    let good_error = good
        .await
        .unwrap()
        .expect_err("its transaction partner fails with it");
    assert_eq!(bad_error.to_string(), good_error.to_string());

    let seen = read_all(&kafka_settings(), &topic.name, 3, true);
    assert_eq!(seen.len(), 40_000, "only the busy array is visible");
    assert!(
        seen.iter()
            .all(|message| message.payload.ends_with(b"-busy"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_array_never_exceeds_max_and_idles_for_max_wait() {
    let topic = TestTopic::create("bounds", 3).await;
    producer()
        .await
        .transact(messages(&topic.name, 1_234, ""))
        .await
        .unwrap();
    let consumer = consumer(&topic, &unique("bounds"));

    let mut total = 0;
    while total < 1_234 {
        let array = consumer
            .next_array(100, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(array.len() <= 100, "array of {} for max 100", array.len());
        assert!(!array.is_empty() || array.waited >= Duration::from_secs(2));
        total += array.len();
    }
    assert_eq!(total, 1_234);

    for max_wait in [Duration::from_millis(300), Duration::from_millis(1_500)] {
        let started = Instant::now();
        let array = consumer.next_array(100, max_wait).await.unwrap();
        let took = started.elapsed();
        assert!(array.is_empty());
        assert!(
            took >= max_wait,
            "idle wait returned after {took:?} < {max_wait:?}"
        );
        assert!(
            took <= max_wait + Duration::from_secs(1),
            "idle wait returned after {took:?} > {max_wait:?} + 1 s"
        );
    }
}

/// Batch messages of 40 records each (on one partition, so they arrive in
/// order) weigh their records: an array of at most 100 records ends at the
/// message that reaches 100 (three batches, 120 records), and a byte bound
/// ends it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_array_within_counts_the_records_a_batch_message_carries() {
    let topic = TestTopic::create("bounds-records", 1).await;
    let stream = quire_messages::StreamName::new("orders").unwrap();
    let texts: Vec<String> = (0..40).map(|seq| format!(r#"{{"seq":{seq}}}"#)).collect();
    let batches: Vec<OutMessage> = (0..10)
        .map(|_| {
            let message = quire_messages::records::batches(
                &stream,
                texts.iter().map(String::as_bytes),
                usize::MAX,
            )
            .remove(0);
            OutMessage::from_parts(
                &topic.name,
                message.key,
                message.payload,
                message.headers,
                None,
            )
        })
        .collect();
    let batch_bytes = batches[0].payload.len();
    producer().await.transact(batches).await.unwrap();
    let consumer = consumer(&topic, &unique("bounds-records"));
    let weigh: fn(&quire_queue::InMessage) -> usize = |message| {
        quire_messages::records::record_count(
            &message.headers,
            message.payload.as_deref().unwrap_or_default(),
        )
    };
    let bounds = |records: usize, bytes: usize| ArrayBounds {
        records,
        bytes,
        wait: Duration::from_secs(5),
        weigh,
    };
    // The group assigns the partition first: wait through empty arrays.
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        let array = consumer
            .next_array_within(bounds(100, usize::MAX))
            .await
            .unwrap();
        if !array.is_empty() {
            break array;
        }
        assert!(Instant::now() < deadline, "no message within 60 s");
    };
    assert_eq!(first.len(), 3, "3 batches reach 100 records (120)");
    let by_bytes = consumer
        .next_array_within(bounds(usize::MAX, batch_bytes * 2))
        .await
        .unwrap();
    assert_eq!(by_bytes.len(), 2, "2 batches reach twice a batch's bytes");
    let rest = consumer
        .next_array_within(bounds(1_000, usize::MAX))
        .await
        .unwrap();
    assert_eq!(rest.len(), 5, "what is left, within 1,000 records");
    assert!(rest.waited >= Duration::from_secs(5), "it waited for more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_resumes_exactly_after_the_simple_commit() {
    let topic = TestTopic::create("resume-simple", 3).await;
    let group = unique("resume-simple");
    let sent = messages(&topic.name, 1_500, "");
    producer().await.transact(sent.clone()).await.unwrap();

    let first = consumer(&topic, &group);
    let array = read_until(&first, 1).await.pop().unwrap();
    let outcome = first.commit(&array).await.unwrap();
    assert!(outcome.dropped.is_empty());
    assert_eq!(outcome.committed, array.next_offsets());
    let read_before: BTreeSet<MessageId> =
        array.messages.iter().map(|message| message.id()).collect();
    drop(first);

    let second = consumer(&topic, &group);
    let rest = read_until(&second, sent.len() - read_before.len()).await;
    let read_after: Vec<MessageId> = rest
        .iter()
        .flat_map(|array| array.messages.iter().map(|message| message.id()))
        .collect();
    assert_eq!(
        read_after.len(),
        sent.len() - read_before.len(),
        "nothing read twice"
    );
    assert!(
        read_after.iter().all(|id| !read_before.contains(id)),
        "a committed message came back"
    );
    let every: BTreeSet<MessageId> = read_before.into_iter().chain(read_after).collect();
    assert_eq!(every.len(), sent.len(), "nothing skipped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_resumes_exactly_at_explicit_offsets() {
    let topic = TestTopic::create("resume-explicit", 1).await;
    let group = unique("resume-explicit");
    producer()
        .await
        .transact(messages(&topic.name, 300, ""))
        .await
        .unwrap();

    let first = consumer(&topic, &group);
    let arrays = read_until(&first, 300).await;
    // Commit less than "after the last message": offset 120 of partition 0.
    let last = arrays.last().unwrap();
    let outcome = first
        .commit_offsets(last, BTreeMap::from([(0, 120)]))
        .await
        .unwrap();
    assert_eq!(outcome.committed, BTreeMap::from([(0, 120)]));
    drop(first);
    assert_eq!(
        committed_offsets(&kafka_settings(), &group, &topic.name, 1),
        vec![Some(120)]
    );

    let second = consumer(&topic, &group);
    let rest = read_until(&second, 180).await;
    let offsets: Vec<i64> = rest
        .iter()
        .flat_map(|array| array.messages.iter().map(|message| message.offset))
        .collect();
    let expected: Vec<i64> = (120..300).collect();
    assert_eq!(offsets, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_ends_on_a_short_array_having_read_everything() {
    let topic = TestTopic::create("drain-short", 3).await;
    producer()
        .await
        .transact(messages(&topic.name, 1_234, ""))
        .await
        .unwrap();
    let group = unique("drain-short");
    let consumer = consumer(&topic, &group);
    let mut read = BTreeSet::new();
    let summary = consumer
        .drain(500, Duration::from_secs(1), |array| {
            read.extend(array.messages.iter().map(|message| message.id()))
        })
        .await
        .unwrap();
    assert_eq!(read.len(), 1_234);
    assert_eq!(summary.messages, 1_234);
    assert_eq!(summary.exit, DrainExit::ShortArray);
    let committed: i64 = committed_offsets(&kafka_settings(), &group, &topic.name, 3)
        .into_iter()
        .flatten()
        .sum();
    assert!(
        committed >= 1_234,
        "the last array was committed before the loop ended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_ends_on_an_empty_wait_when_the_last_array_was_full() {
    let topic = TestTopic::create("drain-empty", 1).await;
    producer()
        .await
        .transact(messages(&topic.name, 1_000, ""))
        .await
        .unwrap();
    let consumer = consumer(&topic, &unique("drain-empty"));
    let mut sizes = Vec::new();
    let summary = consumer
        .drain(500, Duration::from_secs(1), |array| sizes.push(array.len()))
        .await
        .unwrap();
    assert_eq!(summary.messages, 1_000);
    assert_eq!(summary.exit, DrainExit::EmptyWait);
    assert_eq!(sizes.iter().sum::<usize>(), 1_000);
    assert_eq!(sizes.last(), Some(&0), "the loop ended on an empty wait");
}

/// Two members split the partitions and every message is read; a message
/// is read twice only where its reader's commit could not count: the group
/// refused it while it rebalanced and the partition was revoked before the
/// commit was tried again, or it was revoked before the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_in_a_group_split_partitions_and_read_everything_once() {
    let topic = TestTopic::create("split", 6).await;
    let group = unique("split");
    let sent = 3_000;
    producer()
        .await
        .transact(messages(&topic.name, sent, ""))
        .await
        .unwrap();

    let mut options = ConsumerOptions::new(&group, &topic.name);
    options.cooperative = true;
    let first = ArrayConsumer::new(&kafka_settings(), &options).unwrap();
    let second = ArrayConsumer::new(&kafka_settings(), &options).unwrap();
    let mut seen: BTreeMap<MessageId, usize> = BTreeMap::new();
    let mut partitions_of = [BTreeSet::new(), BTreeSet::new()];
    // Arrays not committed yet (the group refused their commit, or an
    // earlier one's), to commit after the next read, and the messages that
    // may be read again because their commit could not count.
    let mut refused: [Vec<quire_queue::Array>; 2] = [Vec::new(), Vec::new()];
    let mut may_repeat: BTreeSet<MessageId> = BTreeSet::new();
    let mut refusals = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    // Both must hold partitions before either reads everything alone.
    loop {
        assert!(Instant::now() < deadline, "the group did not settle");
        let (a, b) = tokio::join!(
            first.next_array(200, Duration::from_millis(300)),
            second.next_array(200, Duration::from_millis(300))
        );
        for (index, (consumer, array)) in [(&first, a.unwrap()), (&second, b.unwrap())]
            .into_iter()
            .enumerate()
        {
            for message in &array.messages {
                *seen.entry(message.id()).or_default() += 1;
                partitions_of[index].insert(message.partition);
            }
            // In order, stopping at a refusal: a commit never moves back.
            refused[index].push(array);
            let before = refused[index].len();
            let committed = consumer.commit_in_order(&mut refused[index]).await.unwrap();
            if !refused[index].is_empty() {
                refusals += 1;
            }
            assert_eq!(committed.len() + refused[index].len(), before);
            for (array, outcome) in committed {
                may_repeat.extend(
                    array
                        .messages
                        .iter()
                        .filter(|message| outcome.dropped.contains(&message.partition))
                        .map(|message| message.id()),
                );
            }
        }
        let pending = refused.iter().any(|arrays| !arrays.is_empty());
        if seen.len() >= sent
            && !pending
            && !first.assignment().is_empty()
            && !second.assignment().is_empty()
        {
            break;
        }
    }
    assert_eq!(seen.len(), sent, "every message read");
    let twice: Vec<&MessageId> = seen
        .iter()
        .filter(|(id, count)| **count > 1 && !may_repeat.contains(id))
        .map(|(id, _)| id)
        .collect();
    assert!(
        twice.is_empty(),
        "read twice though their commit counted ({refusals} refused commits): {twice:?}"
    );
    assert!(
        seen.values().all(|&count| count <= 2),
        "a message was read more than twice"
    );
    let first_partitions: BTreeSet<i32> = first.assignment().into_iter().collect();
    let second_partitions: BTreeSet<i32> = second.assignment().into_iter().collect();
    assert!(first_partitions.is_disjoint(&second_partitions));
    assert_eq!(first_partitions.len() + second_partitions.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_transactional_commit_leaves_the_offsets_where_they_were() {
    let topic = TestTopic::create("txn-commit", 1).await;
    let output = TestTopic::create("txn-commit-out", 1).await;
    let group = unique("txn-commit");
    producer()
        .await
        .transact(messages(&topic.name, 200, ""))
        .await
        .unwrap();
    let consumer = consumer(&topic, &group);
    let producer = producer().await;

    let arrays = read_until(&consumer, 200).await;
    let first = &arrays[0];
    let outcome = consumer
        .commit_in_transaction(
            first,
            Some(BTreeMap::from([(0, 50)])),
            &producer,
            messages(&output.name, 10, "-out"),
        )
        .await
        .unwrap();
    assert_eq!(outcome.commit.committed, BTreeMap::from([(0, 50)]));
    assert_eq!(outcome.ids.len(), 10);
    assert_eq!(
        committed_offsets(&kafka_settings(), &group, &topic.name, 1),
        vec![Some(50)]
    );

    let mut doomed = messages(&output.name, 10, "-doomed");
    doomed.push(oversized(&output.name));
    let error = consumer
        .commit_in_transaction(
            arrays.last().unwrap(),
            Some(BTreeMap::from([(0, 200)])),
            &producer,
            doomed,
        )
        .await
        .expect_err("the oversized message aborts the transaction");
    assert!(
        matches!(error, QueueError::TransactionAborted(_)),
        "{error}"
    );
    assert_eq!(
        committed_offsets(&kafka_settings(), &group, &topic.name, 1),
        vec![Some(50)],
        "an aborted transaction moved the offsets"
    );
    let out = read_all(&kafka_settings(), &output.name, 1, true);
    assert_eq!(out.len(), 10);
    assert!(out.iter().all(|message| message.payload.ends_with(b"-out")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_partition_cannot_be_committed_afterwards() {
    let topic = TestTopic::create("revoke", 4).await;
    let group = unique("revoke");
    producer()
        .await
        .transact(messages(&topic.name, 2_000, ""))
        .await
        .unwrap();
    let mut options = ConsumerOptions::new(&group, &topic.name);
    options.cooperative = true;

    let first = ArrayConsumer::new(&kafka_settings(), &options).unwrap();
    let held = read_until(&first, 1).await.pop().unwrap();
    assert_eq!(
        held.assigned_partitions().count(),
        4,
        "alone, the first consumer holds all"
    );

    // A second member joins; the first gives partitions up in its next poll.
    let second = ArrayConsumer::new(&kafka_settings(), &options).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut revoked = Vec::new();
    while second.assignment().is_empty() {
        assert!(Instant::now() < deadline, "the second member got nothing");
        let (a, b) = tokio::join!(
            first.next_array(1, Duration::from_millis(200)),
            second.next_array(1, Duration::from_millis(200))
        );
        for event in a.unwrap().rebalances {
            if let RebalanceEvent::Revoked { partitions, .. } = event {
                revoked.extend(partitions);
            }
        }
        let _ = b.unwrap();
    }
    assert!(!revoked.is_empty(), "the first member saw no revocation");
    let before = committed_offsets(&kafka_settings(), &group, &topic.name, 4);

    // The array read before the rebalance tries to commit every partition.
    let everything: BTreeMap<i32, i64> = (0..4).map(|partition| (partition, 1_000)).collect();
    let outcome = first.commit_offsets(&held, everything).await.unwrap();
    let dropped: BTreeSet<i32> = outcome.dropped.iter().copied().collect();
    assert_eq!(
        dropped,
        revoked.iter().copied().collect(),
        "revoked partitions are reported"
    );
    let after = committed_offsets(&kafka_settings(), &group, &topic.name, 4);
    for partition in &revoked {
        assert_eq!(
            after[*partition as usize], before[*partition as usize],
            "partition {partition} was committed after its revocation"
        );
    }
    for partition in outcome.committed.keys() {
        assert_eq!(after[*partition as usize], Some(1_000));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_of_a_protected_setting_is_refused() {
    let topic = TestTopic::create("protected", 1).await;
    for key in [
        "enable.auto.commit",
        "isolation.level",
        "enable.idempotence",
        "transactional.id",
    ] {
        let mut settings = kafka_settings();
        settings.properties.insert(key.into(), "whatever".into());
        let consumer_error =
            ArrayConsumer::new(&settings, &ConsumerOptions::new(unique("g"), &topic.name))
                .err()
                .expect("consumer refused");
        let producer_error = TransactionalProducer::connect(&settings, &unique("p"))
            .await
            .err()
            .expect("producer refused");
        for error in [consumer_error, producer_error] {
            assert!(
                matches!(&error, QueueError::ProtectedProperty { key: named, .. } if named == key),
                "{error}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_show_one_transaction_per_array_and_batched_produce_requests() {
    let topic = TestTopic::create("stats", 3).await;
    let mut settings = kafka_settings();
    settings
        .properties
        .insert("statistics.interval.ms".into(), "100".into());

    let mut produce_per_array = Vec::new();
    for size in [100, 10_000] {
        let producer = TransactionalProducer::connect(&settings, &unique("test-stats"))
            .await
            .unwrap();
        let arrays = 5;
        for _ in 0..arrays {
            producer
                .transact(messages(&topic.name, size, ""))
                .await
                .unwrap();
        }
        let transactions = wait_for_request_count(&producer, "EndTxn", arrays).await;
        assert_eq!(
            transactions, arrays,
            "one transaction end per array of {size}"
        );
        let produce = wait_for_request_count(&producer, "Produce", arrays).await;
        produce_per_array.push(produce as f64 / arrays as f64);
    }
    let (small, large) = (produce_per_array[0], produce_per_array[1]);
    // 100x the messages per array; the produce requests are batches per
    // partition, so they stay about the same.
    assert!(
        large <= small * 2.0 + 3.0,
        "produce requests per array grew from {small} (100 messages) to {large} (10,000 messages)"
    );
}

/// The count of `request` requests the producer sent, summed over brokers.
fn request_count(producer: &TransactionalProducer, request: &str) -> i64 {
    producer
        .statistics()
        .latest()
        .map(|statistics| {
            statistics
                .brokers
                .values()
                .map(|broker| broker.req.get(request).copied().unwrap_or(0))
                .sum::<i64>()
        })
        .unwrap_or(0)
}

/// [`request_count`] once it reaches `at_least` (statistics arrive every
/// interval), plus one more interval so a late request is not missed.
async fn wait_for_request_count(
    producer: &TransactionalProducer,
    request: &str,
    at_least: i64,
) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    while request_count(producer, request) < at_least && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    request_count(producer, request)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_starts_at_the_beginning_and_a_deleted_committed_offset_is_an_error() {
    let topic = TestTopic::create("retention", 1).await;
    let group = unique("retention");
    producer()
        .await
        .transact(messages(&topic.name, 100, ""))
        .await
        .unwrap();

    let first = consumer(&topic, &group);
    let arrays = read_until(&first, 100).await;
    assert_eq!(
        arrays[0].messages[0].offset, 0,
        "a new group starts at the beginning of the log"
    );
    first
        .commit_offsets(arrays.last().unwrap(), BTreeMap::from([(0, 10)]))
        .await
        .unwrap();
    drop(first);

    // Retention deletes what the group has not read yet.
    delete_records_before(&kafka_settings(), &topic.name, 0, 50).await;
    let second = consumer(&topic, &group);
    let deadline = Instant::now() + Duration::from_secs(30);
    let error = loop {
        assert!(
            Instant::now() < deadline,
            "no error for a committed offset that was deleted"
        );
        match second.next_array(100, Duration::from_millis(500)).await {
            Ok(array) => assert!(
                array.is_empty(),
                "jumped silently to offset {}",
                array.messages[0].offset
            ),
            Err(error) => break error,
        }
    };
    assert!(
        matches!(&error, QueueError::OffsetOutOfRange { partition: 0, .. }),
        "{error}"
    );

    // A new group still starts at the (new) beginning.
    let fresh = consumer(&topic, &unique("retention-fresh"));
    let arrays = read_until(&fresh, 50).await;
    assert_eq!(arrays[0].messages[0].offset, 50);
}

/// Followers, made from where their array landed, are written in its
/// transaction: with group commit, each array's followers name its own
/// offsets, and all are visible exactly when the arrays are; a follower
/// that cannot be written aborts the whole transaction (what the API's
/// stored answers to `Idempotency-Key`s will rest on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_name_where_their_array_landed_and_share_its_transaction() {
    let records = TestTopic::create("followers-records", 3).await;
    let answers = TestTopic::create("followers-answers", 1).await;
    let enqueuer = ArrayEnqueuer::start(producer().await, GroupCommitLimits::default());
    let follower = |answers: String, tag: String, size: usize| -> quire_queue::Followers {
        Box::new(move |ids: &[MessageId]| {
            let named: Vec<String> = ids.iter().map(ToString::to_string).collect();
            vec![OutMessage::new(
                answers,
                Some(tag.into_bytes()),
                vec![b'n'; size]
                    .into_iter()
                    .chain(named.join(",").into_bytes())
                    .collect(),
            )]
        })
    };
    // A large array first, so the next ones queue up and share transactions.
    let busy = enqueuer.enqueue_array(messages(&records.name, 20_000, "-busy"));
    let tagged = (0..6).map(|index| {
        let tag = format!("-array{index}");
        let array = messages(&records.name, 50, &tag);
        let followers = follower(answers.name.clone(), tag.clone(), 0);
        let enqueuer = enqueuer.clone();
        async move {
            (
                tag,
                enqueuer.enqueue_array_then(array, Some(followers)).await,
            )
        }
    });
    let (busy, tagged) = tokio::join!(busy, futures::future::join_all(tagged));
    busy.expect("the busy array commits");
    let stored: BTreeMap<String, String> = read_all(&kafka_settings(), &answers.name, 1, true)
        .into_iter()
        .map(|answer| {
            (
                String::from_utf8(answer.key.unwrap()).unwrap(),
                String::from_utf8(answer.payload).unwrap(),
            )
        })
        .collect();
    let seen = read_all(&kafka_settings(), &records.name, 3, true);
    let at: BTreeMap<(i32, i64), &[u8]> = seen
        .iter()
        .map(|message| {
            (
                (message.partition, message.offset),
                message.payload.as_slice(),
            )
        })
        .collect();
    for (tag, outcome) in &tagged {
        let ids = outcome.as_ref().expect("a tagged array commits");
        let named: Vec<String> = ids.iter().map(ToString::to_string).collect();
        assert_eq!(stored.get(tag), Some(&named.join(",")), "{tag}'s follower");
        for id in ids {
            let payload = at
                .get(&(id.partition, id.offset))
                .expect("the id is committed");
            assert!(payload.ends_with(tag.as_bytes()), "{id} is not {tag}'s");
        }
    }
    assert_eq!(stored.len(), 6);

    // A follower librdkafka refuses (too large) aborts its array too.
    let array = messages(&records.name, 10, "-refused");
    let error = enqueuer
        .enqueue_array_then(
            array,
            Some(follower(answers.name.clone(), "refused".into(), 2_000_000)),
        )
        .await
        .expect_err("a follower that cannot be written fails the array");
    assert!(
        matches!(error, QueueError::TransactionAborted(_)),
        "{error}"
    );
    let seen = read_all(&kafka_settings(), &records.name, 3, true);
    assert!(
        !seen
            .iter()
            .any(|message| message.payload.ends_with(b"-refused"))
    );
    let stored = read_all(&kafka_settings(), &answers.name, 1, true);
    assert_eq!(stored.len(), 6, "the refused follower is not visible");
}

/// A topic tail hands over every committed message once, covers
/// transaction markers and aborted batches (which hand nothing over), and
/// a transaction still open holds a catch-up back until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_covers_markers_and_aborts_and_waits_for_an_open_transaction() {
    use std::sync::{Arc, Mutex};

    let topic = TestTopic::create("tail", 2).await;
    let transactional_id = unique("test-producer");
    let mut producer = TransactionalProducer::connect(&kafka_settings(), &transactional_id)
        .await
        .expect("producer");
    // Before the tail starts: one committed array, one aborted.
    let committed = messages(&topic.name, 300, "-before");
    producer.transact(committed).await.expect("transact");
    let mut doomed = messages(&topic.name, 50, "-doomed");
    doomed.push(oversized(&topic.name));
    producer.transact(doomed).await.expect_err("aborted");
    if !producer.is_usable() {
        // librdkafka can answer an abort that closely follows the
        // transaction's start with a fatal INVALID_TXN_STATE
        // (confluentinc/librdkafka#4849, open; seen once in CI here). The
        // services replace such a producer; so does this test, whose subject
        // is the tail. The same transactional id fences the old one and ends
        // whatever of its transaction the broker holds.
        eprintln!("tail test: the abort left the producer unusable (librdkafka#4849); replaced");
        producer = TransactionalProducer::connect(&kafka_settings(), &transactional_id)
            .await
            .expect("replacement producer");
    }

    // (partition, offset, payload) of every message the tail reads.
    type Seen = Vec<(i32, i64, Vec<u8>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let collected = Arc::clone(&seen);
    let settings = kafka_settings();
    let topic_name = topic.name.clone();
    let tail = tokio::task::spawn_blocking(move || {
        quire_queue::TopicTail::start(&settings, &unique("tail"), &topic_name, 2, move |message| {
            collected.lock().unwrap().push((
                message.partition,
                message.offset,
                message.payload.unwrap_or_default(),
            ));
        })
    })
    .await
    .unwrap()
    .expect("tail");
    let limit = Duration::from_secs(20);
    tail.catch_up_all(2, limit)
        .await
        .expect("the tail covers what was there, markers and aborted batches included");
    assert_eq!(seen.lock().unwrap().len(), 300, "committed messages, once");

    // After: another committed array; a catch-up returns once it is read.
    producer
        .transact(messages(&topic.name, 200, "-after"))
        .await
        .expect("transact");
    tail.catch_up_all(2, limit).await.expect("caught up again");
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 500);
        assert!(
            seen.iter()
                .all(|(_, _, payload)| !payload.ends_with(b"-doomed"))
        );
        let distinct: BTreeSet<(i32, i64)> = seen.iter().map(|(p, o, _)| (*p, *o)).collect();
        assert_eq!(distinct.len(), 500, "no message handed over twice");
    }

    // An open transaction on partition 0 holds a catch-up of partition 0
    // (it may hold an answer), not of partition 1.
    let foreign = quire_tests::raw_transactional_producer(&kafka_settings(), &unique("open"));
    let at = quire_tests::send_in_transaction(&foreign, &topic.name, "open").await;
    let open_partition = at.partition;
    let other = 1 - open_partition;
    tail.catch_up(other, limit)
        .await
        .expect("another partition is not held");
    let held = tail.catch_up(open_partition, Duration::from_secs(2)).await;
    assert!(
        held.is_err(),
        "a catch-up passed an open transaction: {held:?}"
    );
    let committing = tokio::task::spawn_blocking(move || {
        rdkafka::producer::Producer::commit_transaction(&foreign, Duration::from_secs(30))
            .expect("commit the open transaction")
    });
    tail.catch_up(open_partition, limit)
        .await
        .expect("caught up once the transaction ended");
    committing.await.unwrap();
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|(partition, offset, _)| *partition == at.partition && *offset == at.offset),
        "the message of the committed transaction was handed over"
    );
}

/// A release that cannot go out (its partition has no leader; here its
/// topic is gone) holds the producer for its whole patience. An array queued
/// meanwhile is answered by the group commit's `max_wait`, aborted and
/// unsent, not once the release gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_queued_behind_a_stuck_release_is_answered_by_its_max_wait() {
    let records = TestTopic::create("release-wait", 1).await;
    let gone = TestTopic::create("release-gone", 1).await;
    let patience = Duration::from_secs(6);
    let release = Release {
        messages: vec![OutMessage::new(&gone.name, None, b"release".to_vec()).to_partition(0)],
        patience,
        on_release: None,
    };
    let producer = TransactionalProducer::connect_with(
        &kafka_settings(),
        &unique("test-release-wait"),
        ProducerOptions {
            send_timeout: None,
            commit_timeout: None,
            release: Some(release),
        },
    )
    .await
    .expect("producer (its first release commits)");
    drop(gone);
    producer.request_release();
    let max_wait = Duration::from_secs(1);
    let enqueuer = ArrayEnqueuer::start(
        producer,
        GroupCommitLimits {
            max_wait: Some(max_wait),
            ..GroupCommitLimits::default()
        },
    );

    let started = Instant::now();
    let answer = enqueuer
        .enqueue_array(messages(&records.name, 10, "-late"))
        .await;
    let took = started.elapsed();
    assert!(
        matches!(answer, Err(QueueError::TransactionAborted(_))),
        "an array that could not begin in time is aborted: {answer:?}"
    );
    assert!(
        took < max_wait + Duration::from_millis(1_500),
        "answered after {took:?}: it waited for the release (patience {patience:?}), \
         not its max_wait ({max_wait:?})"
    );
    // Once the release has given up, the array still is nowhere.
    tokio::time::sleep(patience + Duration::from_secs(1)).await;
    assert_eq!(read_all(&kafka_settings(), &records.name, 1, true).len(), 0);
}

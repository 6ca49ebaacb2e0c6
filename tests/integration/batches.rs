//! Batch messages (issue 29): the worker reads a stream whose log holds the
//! old one-record messages followed by batches and by one-record messages
//! again, as an upgrade in place leaves it (no drain), and reports every
//! record once, in log order; a record that cannot be rendered inside a
//! batch is a dead letter named by its place in the batch, and the other
//! records of its batch are reported.

use std::time::Duration;

use quire_messages::{StreamName, records};
use quire_queue::{OutMessage, TransactionalProducer};
use quire_tests::{TestStack, unique};

use crate::faults::{dead_letters_by_key, good_record};
use crate::memory::sequence_numbers;

/// The batch message of `stream` holding `texts`, in order.
fn batch_message(topic: &str, stream: &str, texts: &[String]) -> OutMessage {
    let name = StreamName::new(stream).unwrap();
    let mut batches = records::batches(&name, texts.iter().map(String::as_bytes), usize::MAX);
    assert_eq!(batches.len(), 1, "one batch");
    let message = batches.remove(0);
    OutMessage::from_parts(topic, message.key, message.payload, message.headers, None)
}

fn record_text(stream: &str, seq: u64) -> String {
    serde_json::to_string(&quire_tests::records(stream, seq, 1)[0]).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_of_single_records_then_batches_renders_every_record_once_in_order() {
    let stack = TestStack::create("batches").await;
    let stream = &unique("upgrade");
    let topic = stack.topics.records.clone();
    let mut messages = Vec::new();
    // Written by an API before batches: one message per record.
    for seq in 0..6 {
        messages.push(good_record(&topic, stream, seq));
    }
    // Then batches, one of them with a record that cannot be rendered (a
    // JSON array) at its place 2.
    messages.push(batch_message(
        &topic,
        stream,
        &(6..10)
            .map(|seq| record_text(stream, seq))
            .collect::<Vec<_>>(),
    ));
    let mut poisoned: Vec<String> = (10..14).map(|seq| record_text(stream, seq)).collect();
    poisoned.insert(2, "[1, 2]".to_owned());
    messages.push(batch_message(&topic, stream, &poisoned));
    // And single records again (an API replica not yet upgraded).
    for seq in 14..17 {
        messages.push(good_record(&topic, stream, seq));
    }
    let producer = TransactionalProducer::connect(&stack.kafka, &unique("test-upgrade"))
        .await
        .expect("a producer");
    let ids = producer.transact(messages).await.expect("publish");
    let poison_batch = ids[7];

    let mut worker = stack.worker("w1").drain().spawn();
    assert_eq!(
        worker.wait(Duration::from_secs(120)),
        Some(0),
        "the drain ends with 0"
    );

    let mut reported = Vec::new();
    let manifests = stack.bucket.list("manifests/").await;
    assert!(!manifests.is_empty(), "a report");
    let mut keys = Vec::new();
    for key in &manifests {
        let manifest: serde_json::Value =
            serde_json::from_slice(&stack.bucket.read(key).await.expect("manifest")).unwrap();
        let document = stack
            .bucket
            .read(manifest["key"].as_str().unwrap())
            .await
            .expect("its document");
        let sequence = sequence_numbers(&document);
        assert_eq!(manifest["records"].as_u64(), Some(sequence.len() as u64));
        keys.push(manifest["first_offset"].as_i64().unwrap());
        reported.extend(sequence);
    }
    assert_eq!(
        reported,
        (0..17).collect::<Vec<u64>>(),
        "every record once, in log order"
    );

    let letters = dead_letters_by_key(&stack);
    let key = format!("{}:{}:2", poison_batch.partition, poison_batch.offset);
    assert_eq!(
        letters.keys().collect::<Vec<_>>(),
        [&key],
        "one dead letter, named by its place in its batch"
    );
    let letter = &letters[&key][0];
    assert_eq!(
        (letter.offset, letter.index, letter.payload.as_str()),
        (poison_batch.offset, Some(2), "[1, 2]")
    );
    assert!(
        letter.reason.contains("cannot be rendered"),
        "{}",
        letter.reason
    );
}

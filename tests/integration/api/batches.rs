//! Records travel as batch messages: a request's records, in order, in as
//! few messages of the records topic as `api.batch_max_bytes` allows, each
//! record named by its batch message and its place in it; and the API
//! refuses to start with a bound the records topic could not carry.

use std::num::NonZeroUsize;

use producer_api::StartupError;
use quire_tests::{RecordId, TestStack, records_of, unique};

use super::committed_messages;

const BOUND: usize = 2048;

/// Record `seq`'s exact text: keys spaced and on two lines, as a client
/// may send them (the API keeps the bytes), `pad` bytes of padding.
fn text(seq: usize, pad: usize) -> String {
    format!("{{ \"seq\" : {seq},\n  \"pad\": \"{}\" }}", "x".repeat(pad))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_bound_lands_as_several_bounded_batches_and_each_id_names_its_record() {
    let stack = TestStack::create("api-batches").await;
    let api = stack
        .api()
        .with(|settings| settings.api.batch_max_bytes = NonZeroUsize::new(BOUND).unwrap())
        .start_api()
        .await;
    let stream = unique("batched");
    // 60 records of 60 to 650 bytes, and one of 5000 (past the bound: it
    // goes alone), about 25 KB in all.
    let texts: Vec<String> = (0..61)
        .map(|seq| {
            text(
                seq,
                if seq == 30 {
                    5000
                } else {
                    30 + (seq * 37) % 600
                },
            )
        })
        .collect();
    let body = format!("[{}]", texts.join(",\n"));
    let (status, answer) = api.send_body(&stream, body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["count"], 61);
    let ids = RecordId::all_of(&answer);
    assert_eq!(ids.len(), texts.len());

    let messages = committed_messages(&stack, &stream);
    assert!(
        messages.len() >= 25_000 / BOUND,
        "{} messages for about 25 KB under a bound of {BOUND}",
        messages.len()
    );
    for message in &messages {
        assert_eq!(
            quire_messages::records::kind_of(&message.headers),
            Some(quire_messages::MessageKind::Batch)
        );
        let inside = quire_tests::records_in(message);
        assert!(
            message.payload.len() <= BOUND || inside.len() == 1,
            "a batch of {} records and {} bytes at {}-{}",
            inside.len(),
            message.payload.len(),
            message.offset,
            message.partition
        );
    }
    // As few as the bound allows: no batch could have taken the next one's
    // first record.
    for pair in messages.windows(2) {
        let next_first = quire_tests::records_in(&pair[1]).remove(0);
        assert!(
            pair[0].payload.len() + quire_messages::batch::FRAME_OVERHEAD + next_first.len()
                > BOUND
        );
    }
    // Every record once, in order, byte for byte.
    let carried: Vec<Vec<u8>> = messages.iter().flat_map(quire_tests::records_in).collect();
    let sent: Vec<Vec<u8>> = texts.iter().map(|text| text.clone().into_bytes()).collect();
    assert_eq!(carried, sent);
    // Each id names exactly its record: the message at its partition and
    // offset holds, at its index, the record sent at that place.
    let read = records_of(&messages);
    assert_eq!(
        read.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        ids,
        "the answer's ids, in order, are where the records are"
    );
    for (place, id) in ids.iter().enumerate() {
        let message = messages
            .iter()
            .find(|message| (message.partition, message.offset) == (id.partition, id.offset))
            .unwrap_or_else(|| panic!("no message at {id}"));
        assert_eq!(
            quire_tests::records_in(message)[id.index],
            sent[place],
            "{id} names record {place}"
        );
    }
    assert_eq!(
        api.metric("quire_api_batch_messages_total").await,
        Some(messages.len() as f64)
    );
    assert_eq!(
        api.metric("quire_api_records_accepted_total").await,
        Some(61.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_to_start_when_a_batch_could_pass_the_topics_max_message_bytes() {
    const TOPIC_LIMIT: usize = 65_536;
    let stack = TestStack::create_with_records_config(
        "api-batch-limit",
        &[("max.message.bytes", &TOPIC_LIMIT.to_string())],
    )
    .await;
    let settings = |batch: usize, record: usize| {
        let mut settings = stack.settings();
        settings.api.listen = "127.0.0.1:0".into();
        settings.api.batch_max_bytes = NonZeroUsize::new(batch).unwrap();
        settings.api.max_record_bytes = NonZeroUsize::new(record).unwrap();
        // One record batch of librdkafka's holds several messages, up to
        // batch.size: the topic must take it whole.
        settings
            .kafka
            .properties
            .insert("batch_size".into(), TOPIC_LIMIT.to_string());
        settings
    };
    let refusal = |settings| async {
        match producer_api::Application::build(settings).await {
            Ok(_) => panic!("the API started"),
            Err(error) => error,
        }
    };
    // The default bound (256 KiB) passes the topic's 64 KiB.
    let error = refusal(settings(262_144, 16_384)).await;
    let message = error.to_string();
    assert!(
        matches!(
            error,
            StartupError::MessageRoom {
                key: "batch_max_bytes",
                ..
            }
        ),
        "{message}"
    );
    for needle in [
        "api.batch_max_bytes (262144)",
        &stack.topics.records,
        "max.message.bytes (65536",
    ] {
        assert!(message.contains(needle), "{needle:?} in {message}");
    }
    // So does the largest record alone in its batch.
    let error = refusal(settings(16_384, 900_000)).await.to_string();
    assert!(
        error.contains("api.max_record_bytes (900000)")
            && error.contains("max.message.bytes (65536"),
        "{error}"
    );
    // On the bound, the API starts, and a record of the largest size, alone
    // in its batch, and full batches beside it are all taken by the topic.
    let room = producer_api::startup::MESSAGE_ROOM;
    let batch = TOPIC_LIMIT - room;
    let record = batch - quire_messages::batch::FRAME_OVERHEAD;
    let launch = stack.api().with(|launched| {
        let wanted = settings(batch, record);
        launched.api.batch_max_bytes = wanted.api.batch_max_bytes;
        launched.api.max_record_bytes = wanted.api.max_record_bytes;
        launched.kafka.properties = wanted.kafka.properties;
    });
    let api = launch.start_api().await;
    let stream = unique("at-the-limit");
    // The largest record: `record` bytes exactly.
    let largest = {
        let shell = text(0, 0).len();
        text(0, record - shell)
    };
    assert_eq!(largest.len(), record);
    let texts: Vec<String> = std::iter::once(largest)
        .chain((1..200).map(|seq| text(seq, 900)))
        .collect();
    let body = format!("[{}]", texts.join(","));
    let (status, answer) = api.send_body(&stream, body).await;
    assert_eq!(status, 200, "{answer}");
    let messages = committed_messages(&stack, &stream);
    assert!(messages.len() >= 4, "{} messages", messages.len());
    let carried: Vec<Vec<u8>> = messages.iter().flat_map(quire_tests::records_in).collect();
    assert_eq!(
        carried,
        texts
            .iter()
            .map(|text| text.clone().into_bytes())
            .collect::<Vec<_>>()
    );
    assert_eq!(RecordId::all_of(&answer).len(), texts.len());
}

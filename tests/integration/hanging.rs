//! A broker crash must never hold back an array the API answered 200 for.
//!
//! On a single broker SIGKILLed right after a transaction's commit was
//! acknowledged, the restarted transaction coordinator can find a partition
//! briefly leaderless, skip that partition's COMMIT marker and still mark the
//! transaction complete: the partition's last stable offset then stays at
//! the array, and every read_committed reader (the workers, the API's
//! look-ups) stops there until the same producer commits there again. The
//! API releases what its own transactions may have left open, at start-up
//! and whenever it sees the brokers come back.

use std::time::{Duration, Instant};

use quire_tests::kafka_process::KafkaProcess;
use quire_tests::pipeline::{TestStack, partition_of};
use quire_tests::{read_all, unique};
use serde_json::json;

/// Rounds of "POST, SIGKILL at the 200, restart". Before the repair about
/// one round in two left its partition behind here.
const ROUNDS: u64 = 6;
/// How soon after the broker is back every accepted array must be readable.
const READABLE_WITHIN: Duration = Duration::from_secs(30);
const RECORDS_PARTITIONS: i32 = 12;

fn blocking<T: Send + 'static>(operation: impl FnOnce() -> T + Send + 'static) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(operation)
}

/// Whether the record `seq` of `stream` is readable under read_committed.
async fn readable(broker: &KafkaProcess, topic: &str, stream: &str, seq: u64) -> bool {
    let settings = broker.settings();
    let topic = topic.to_owned();
    let stream = stream.to_owned();
    blocking(move || {
        read_all(&settings, &topic, RECORDS_PARTITIONS, true)
            .iter()
            .filter(|message| message.key.as_deref() == Some(stream.as_bytes()))
            .filter_map(|message| serde_json::from_slice::<serde_json::Value>(&message.payload).ok())
            .any(|record| record["seq"].as_u64() == Some(seq))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_look_ups_after_broker_restarts_answer_from_the_broker_not_a_stale_error() {
    let broker = blocking(KafkaProcess::start_new).await.unwrap();
    let stack = TestStack::create_on("stale-errors", &broker).await;
    let api = stack.start_api().await;
    let stream = unique("stale");
    let report_id = api.cut(&stream).await;
    // No worker: the report stays pending, and each look-up reads the log
    // with a pooled reader that lives through the restarts below.
    let (status, body) = api.get(&format!("/v1/reports/{report_id}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "pending", "{body}");
    let mut broker = Some(broker);
    for _ in 0..3 {
        let mut restarted = broker.take().unwrap();
        restarted = blocking(move || {
            restarted.kill();
            // Long enough for the readers to queue "all brokers down".
            std::thread::sleep(Duration::from_secs(3));
            restarted.start();
            restarted
        })
        .await
        .unwrap();
        broker = Some(restarted);
    }
    // Once the API says Kafka answers, a look-up answers from the broker.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = api.get("/readyz").await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the API never became ready again");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for attempt in 0..4 {
        let (status, body) = api.get(&format!("/v1/reports/{report_id}")).await;
        assert_eq!(
            (status, &body["status"]),
            (200, &json!("pending")),
            "look-up {attempt} after the restarts: {body}"
        );
    }
    drop(api);
    drop(broker);
}

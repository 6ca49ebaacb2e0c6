//! `Idempotency-Key`: a replay is answered from the first request and
//! publishes nothing, a reused key is 422, an invalid one 400; answers live
//! in Kafka, so another replica and a restarted one answer them too.

use quire_tests::{TestStack, records, unique};
use serde_json::{Value, json};

use super::{committed_bodies, sequence_numbers};

/// A retry of one array through another spelling of its stream's path
/// (`%69` for `i`) is the same request: answered from the first, published
/// once. The key used to be scoped by the raw path, and published again.
#[tokio::test]
async fn a_retry_through_an_encoded_stream_path_is_a_replay() {
    let stack = TestStack::create("api-idem-path").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("idem");
    let encoded = format!("%69{}", &stream[1..]);
    let array = json!(records(&stream, 0, 5));
    let (status, headers, first) = api
        .post(
            &format!("/v1/streams/{encoded}/records"),
            &array,
            Some(b"k"),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, again) = api
        .post(&format!("/v1/streams/{stream}/records"), &array, Some(b"k"))
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first);
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        (0..5).collect::<Vec<u64>>()
    );
}

#[tokio::test]
async fn a_retried_array_is_answered_once_and_published_once() {
    let stack = TestStack::create("api-idem").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("idem");
    let path = format!("/v1/streams/{stream}/records");
    let array = json!(records(&stream, 0, 25));

    let (status, headers, first) = api.post(&path, &array, Some(b"key-1")).await;
    assert_eq!(status, 200, "{first}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, again) = api.post(&path, &array, Some(b"key-1")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(again, first, "a replay gets the first answer, ids included");

    // The same key for another body is refused, and publishes nothing.
    let other = json!(records(&stream, 100, 3));
    let (status, headers, refused) = api.post(&path, &other, Some(b"key-1")).await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(refused["error"]["code"], "idempotency_key_reused");
    assert!(headers.get("idempotent-replayed").is_none());
    // The same key on another stream is another key.
    let other_stream = unique("idem-other");
    let (status, headers, _) = api
        .post(
            &format!("/v1/streams/{other_stream}/records"),
            &json!(records(&other_stream, 0, 1)),
            Some(b"key-1"),
        )
        .await;
    assert_eq!(status, 200);
    assert!(headers.get("idempotent-replayed").is_none());

    let published = sequence_numbers(&committed_bodies(&stack, &stream));
    assert_eq!(published, (0..25).collect::<Vec<_>>(), "the array once");
    assert_eq!(
        api.metric("quire_api_idempotent_replays_total").await,
        Some(1.0)
    );
}

#[tokio::test]
async fn a_retried_cut_is_one_marker_with_one_report_id() {
    let stack = TestStack::create("api-cut").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("cut");
    let path = format!("/v1/streams/{stream}/reports");
    let (status, headers, first) = api.post(&path, &Value::Null, Some(b"cut-1")).await;
    assert_eq!(status, 202, "{first}");
    let location = headers["location"].clone();
    let (status, headers, again) = api.post(&path, &Value::Null, Some(b"cut-1")).await;
    assert_eq!(status, 202, "{again}");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["location"], location);
    assert_eq!(again["report_id"], first["report_id"]);
    assert_eq!(committed_bodies(&stack, &stream).len(), 1, "one cut marker");

    // Without a key, every cut is a cut.
    let (status, _, second) = api.post(&path, &Value::Null, None).await;
    assert_eq!(status, 202);
    assert_ne!(second["report_id"], first["report_id"]);
    assert_eq!(committed_bodies(&stack, &stream).len(), 2);
}

#[tokio::test]
async fn invalid_idempotency_keys_are_400_and_publish_nothing() {
    let stack = TestStack::create("api-keys").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("keys");
    let path = format!("/v1/streams/{stream}/records");
    let array = json!(records(&stream, 0, 2));
    let too_long = vec![b'k'; 256];
    for key in [&b""[..], b"has space", "é".as_bytes(), &too_long] {
        let (status, _, body) = api.post(&path, &array, Some(key)).await;
        assert_eq!(status, 400, "{key:?}: {body}");
        assert_eq!(body["error"]["code"], "invalid_idempotency_key");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Idempotency-Key"),
            "{body}"
        );
    }
    let longest = vec![b'k'; 255];
    let (status, _, body) = api.post(&path, &array, Some(&longest)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        sequence_numbers(&committed_bodies(&stack, &stream)),
        vec![0, 1]
    );
}

/// An `Idempotency-Key`'s answer lives in Kafka, written in the array's
/// own transaction: a retry that reaches another replica, or the same
/// replica after a restart, is answered from it and publishes nothing.
/// Before, keys lived in one process: the second replica and the
/// restarted one published the array again.
#[tokio::test]
async fn a_key_is_answered_by_another_replica_and_after_a_restart() {
    let stack = TestStack::create("api-key-log").await;
    let replica = |id: &'static str| {
        stack
            .api()
            .with(move |settings| settings.api.replica_id = id.into())
    };
    let first = replica("api-a").start_api().await;
    let second = replica("api-b").start_api().await;
    let stream = unique("shared-key");
    let records_path = format!("/v1/streams/{stream}/records");
    let cut_path = format!("/v1/streams/{stream}/reports");
    let array = json!(records(&stream, 0, 4));

    let (status, headers, answer) = first.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{answer}");
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, replayed) = second.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(
        headers
            .get("idempotent-replayed")
            .map(|value| value.to_str().unwrap()),
        Some("true"),
        "the other replica did not replay"
    );
    assert_eq!(replayed, answer, "the other replica's answer differs");
    // The key with another body, on the other replica: refused.
    let other = json!(records(&stream, 10, 1));
    let (status, _, refused) = second.post(&records_path, &other, Some(b"k-1")).await;
    assert_eq!(status, 422, "{refused}");
    let (status, _, cut) = second.post(&cut_path, &json!({}), Some(b"cut-1")).await;
    assert_eq!(status, 202, "{cut}");

    drop(first);
    drop(second);
    let restarted = replica("api-a").start_api().await;
    let (status, headers, again) = restarted.post(&records_path, &array, Some(b"k-1")).await;
    assert_eq!(status, 200, "{again}");
    assert!(
        headers.contains_key("idempotent-replayed"),
        "not replayed after a restart"
    );
    assert_eq!(again, answer);
    let (status, headers, cut_again) = restarted.post(&cut_path, &json!({}), Some(b"cut-1")).await;
    assert_eq!(status, 202, "{cut_again}");
    assert!(headers.contains_key("idempotent-replayed"));
    assert_eq!(cut_again, cut, "the cut's report id changed");
    assert_eq!(
        headers
            .get("location")
            .map(|value| value.to_str().unwrap().to_owned()),
        Some(format!(
            "/v1/reports/{}",
            cut["report_id"].as_str().unwrap()
        )),
    );

    let bodies = committed_bodies(&stack, &stream);
    assert_eq!(
        sequence_numbers(&bodies),
        [0, 1, 2, 3],
        "published more than once"
    );
}

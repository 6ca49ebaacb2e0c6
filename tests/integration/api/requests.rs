//! What odd requests get: made-up methods and paths do not grow the
//! metrics, a record naming one key twice is refused whole.

use quire_tests::{TestStack, records, unique};
use serde_json::Value;

use super::{committed_bodies, raw_request, sequence_numbers};

/// Every label of `/metrics` takes a bounded set of values: made-up
/// methods (each 2 KB here) are counted as `other`, and paths no route
/// matches as `unmatched`, so one client cannot grow every scrape.
#[tokio::test]
async fn made_up_methods_and_paths_do_not_grow_the_metrics() {
    let stack = TestStack::create("api-labels").await;
    let api = stack.start_api().await;
    let scrape = || async {
        api.http
            .get(api.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    };
    let before = scrape().await;
    for index in 0..100 {
        let method = format!("M{index}{}", "Q".repeat(2000));
        let status = raw_request(api.port(), &method, "/healthz");
        assert!(status.starts_with("HTTP/1.1 "), "an answer: {status:?}");
        let path = format!("/nowhere/{index}/{}", "p".repeat(2000));
        let status = raw_request(api.port(), "GET", &path);
        assert!(status.contains(" 404"), "{status:?}");
    }
    let after = scrape().await;
    assert!(!after.contains("QQQQ"), "a made-up method became a label");
    assert!(!after.contains("pppp"), "a raw path became a label");
    assert!(after.contains(r#"method="other""#), "{after}");
    assert!(after.contains(r#"route="unmatched""#), "{after}");
    assert!(
        after.len() < before.len() + 16 * 1024,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
}

/// A record naming one key twice is refused with 422 naming record and
/// key, and nothing of its array is published: the raw text would carry
/// the first value (a NUL here) past a check made on the last.
#[tokio::test]
async fn a_record_with_a_key_named_twice_is_refused_and_nothing_is_published() {
    let stack = TestStack::create("api-duplicates").await;
    let api = stack.start_api_in_process().await;
    let stream = unique("dup");
    let response = api
        .http
        .post(api.url(&format!("/v1/streams/{stream}/records")))
        .header("content-type", "application/json")
        .body(r#"[{"seq":0}, {"a":"\u0000","a":"ok"}]"#)
        .send()
        .await
        .expect("records request");
    assert_eq!(response.status().as_u16(), 422);
    let body: Value = response.json().await.expect("error body");
    assert_eq!(body["error"]["code"], "duplicate_key", "{body}");
    assert_eq!(body["error"]["index"], 1, "{body}");
    assert_eq!(body["error"]["path"], "a", "{body}");
    // A later array of the same stream is published; the refused one is not.
    api.send_ok(&stream, &records(&stream, 1, 1)).await;
    let published = committed_bodies(&stack, &stream);
    assert_eq!(sequence_numbers(&published), [1], "{published:?}");
}

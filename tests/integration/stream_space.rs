//! A stream's documents stay in its own space (issue 27, part 4): a token
//! scoped to one stream prefix cannot give its streams a key template that
//! places their reports under another stream's prefix, and the take-over
//! sweep aborts only the uploads whose key proves they are its partition's.

use std::time::{Duration, Instant};

use quire_tests::client::token_line;
use quire_tests::{TestStack, unique};
use serde_json::{Value, json};

/// A pending multipart upload at `key`, with one part: what a worker killed
/// mid-document leaves.
async fn leave_an_upload(stack: &TestStack, key: &str) {
    let bucket = &stack.bucket;
    let upload = bucket
        .client
        .create_multipart_upload()
        .bucket(&bucket.name)
        .key(key)
        .send()
        .await
        .expect("CreateMultipartUpload");
    bucket
        .client
        .upload_part()
        .bucket(&bucket.name)
        .key(key)
        .upload_id(upload.upload_id().expect("an upload id"))
        .part_number(1)
        .body(vec![b'x'; 1024].into())
        .send()
        .await
        .expect("UploadPart");
}

/// On the code before this change, the first template below was accepted
/// (202) from a token that reaches only `…evil-` streams, and the worker then
/// wrote evil-x's reports under `reports/orders/`.
#[tokio::test]
async fn a_scoped_token_cannot_place_its_streams_reports_in_another_streams_space() {
    let stack = TestStack::create("stream-space").await;
    let prefix = unique("space");
    let evil = unique("evil-secret");
    let api = stack
        .api()
        .with(|settings| {
            settings.api.tokens = vec![token_line(
                "evil",
                &evil,
                "write",
                &format!("{prefix}-evil-"),
            )];
        })
        .start_api()
        .await;
    let stream = format!("{prefix}-evil-x");
    let put = |template: &str| {
        let request = api
            .http
            .put(api.url(&format!("/v1/streams/{stream}/definition")))
            .bearer_auth(&evil)
            .json(&json!({ "key_template": template }));
        async move {
            let response = request.send().await.expect("PUT definition");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };

    for (template, problem) in [
        // Another stream's folder: Athena reading reports/orders/ would
        // take evil-x's reports for orders'.
        (
            "reports/orders/{partition}-{first_offset}.xml",
            "must start with reports/{stream}/",
        ),
        (
            "reports/orders/dt={yyyy}-{mm}-{dd}/{stream}-{partition}-{first_offset}.xml",
            "must start with reports/{stream}/",
        ),
        // A folder shared by every stream.
        (
            "reports/{yyyy}/{stream}/{partition}-{first_offset}.xml",
            "must start with reports/{stream}/",
        ),
        // In its own folder, but with the file name of partition 7's
        // documents, whatever partition it is on: the sweep of partition 7
        // would abort its live upload.
        (
            "reports/{stream}/{partition}/00007-{first_offset}.xml",
            "take-over sweep",
        ),
    ] {
        let (status, body) = put(template).await;
        assert_eq!(status, 422, "{template}: {body}");
        assert_eq!(
            body["error"]["code"], "invalid_definition",
            "{template}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(problem),
            "{template}: the answer names {problem:?}: {message}"
        );
    }

    // In its own space, a template is the token's to choose.
    let (status, body) =
        put("reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml").await;
    assert_eq!(status, 202, "{body}");
}

/// On the code before this change, the worker's sweep of partition 0 also
/// aborted the three uploads whose keys only start like a partition-0
/// document's (another folder than a stream's, more after `.xml`, a 21-digit
/// offset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_take_over_sweep_aborts_only_the_uploads_its_partitions_own() {
    let stack = TestStack::create("strict-sweep").await;
    let stream = unique("swept");
    let offset = "00000000000000000001";
    // What dead owners of partitions 0 and 11 left: the sweep's to abort.
    let owned = [
        format!("reports/{stream}/00000-{offset}.xml"),
        format!("reports/{stream}/dt=2026-03-29/00011-{offset}.xml.gz"),
    ];
    // Keys the sweep cannot prove are a partition's.
    let not_owned = [
        format!("reports/not~a~stream/00000-{offset}.xml"),
        format!("reports/{stream}/00000-{offset}.xml.bak"),
        format!("reports/{stream}/00000-{offset}0.xml"),
    ];
    for key in owned.iter().chain(&not_owned) {
        leave_an_upload(&stack, key).await;
    }
    assert_eq!(stack.bucket.pending_uploads("reports/").await.len(), 5);

    // A worker takes all twelve partitions and sweeps them.
    let _worker = stack.worker("w1").spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pending: Vec<String> = stack
            .bucket
            .pending_uploads("reports/")
            .await
            .into_iter()
            .map(|upload| upload.key)
            .collect();
        if owned.iter().all(|key| !pending.contains(key)) {
            let mut left = pending.clone();
            left.sort();
            let mut expected = not_owned.to_vec();
            expected.sort();
            assert_eq!(
                left, expected,
                "the sweep aborted uploads it could not prove were its partitions'"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sweep did not abort its partitions' uploads within 60 s: {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let handle = stack.bucket.handle();
    for key in &not_owned {
        handle
            .abort_pending_uploads(key)
            .await
            .expect("clean up the uploads left on purpose");
    }
}

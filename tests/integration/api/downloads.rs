//! Downloads that do not pass through the API: presigned S3 URLs of
//! report documents, used by `quire get`.

use std::time::{Duration, Instant};

use quire_tests::{TestStack, records, sha256_hex, unique};
use serde_json::Value;

use super::quire;

/// Downloads that do not pass through the API (issue 15): `GET
/// /v1/reports/{id}/url` hands out a presigned S3 URL that plain HTTP, with
/// no token, reads the document's exact bytes from, under the report's own
/// download name; `?redirect=true` answers 307 to one; `quire get` uses it
/// and checks the SHA-256 (and `--through-api` does not); S3 refuses the URL
/// once it has expired. An API with them off says so and serves the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_presigned_url_downloads_the_document_straight_from_s3_until_it_expires() {
    let stack = TestStack::create("presign").await;
    let mut launch = stack.api();
    launch.settings.api.download_url_expiry = Some(std::time::Duration::from_millis(5000));
    let endpoint = launch.settings.s3.endpoint.clone();
    let api = launch.start_api().await;
    let _worker = stack.worker("presign-worker").spawn();
    let stream = unique("presign");
    api.send_ok(&stream, &records(&stream, 0, 250)).await;
    let id = api.cut(&stream).await;
    let status = api.wait_completed(&id, Duration::from_secs(60)).await;
    let key = status["manifest"]["key"].as_str().expect("key").to_owned();
    let stored = stack.bucket.read(&key).await.expect("the stored report");
    let digest = sha256_hex(&stored);
    assert_eq!(status["manifest"]["sha256"], digest.as_str());
    // The S3 checksum the server verified, computed here from the bytes.
    let crc32c = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .encode(crc_fast::crc32_iscsi(&stored).to_be_bytes())
    };
    let checksum =
        serde_json::json!({"algorithm": "CRC32C", "type": "FULL_OBJECT", "value": crc32c});
    assert_eq!(status["manifest"]["checksum"], checksum, "{status}");

    let (code, body) = api.get(&format!("/v1/reports/{id}/url")).await;
    assert_eq!(code, 200, "{body}");
    let url = body["url"].as_str().expect("url").to_owned();
    let signed_at = Instant::now();
    assert!(url.starts_with(&endpoint), "{url} is on {endpoint}");
    assert!(url.contains("X-Amz-Signature="), "{url}");
    assert_eq!(body["report_id"], id.as_str());
    assert_eq!(body["sha256"], digest.as_str());
    assert_eq!(body["bytes"], stored.len() as u64);
    assert_eq!(body["checksum"], checksum);
    assert_eq!(body["expires_in_s"], 5);
    assert!(
        body["expires_at"]
            .as_str()
            .is_some_and(|at| at.ends_with('Z')),
        "{body}"
    );

    // Plain HTTP, no token, no redirect following: the exact bytes.
    let plain = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let response = plain.get(&url).send().await.expect("GET the presigned URL");
    assert_eq!(response.status().as_u16(), 200);
    let header = |response: &reqwest::Response, name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(
        header(&response, "content-type").as_deref(),
        Some("application/xml")
    );
    assert_eq!(
        header(&response, "content-disposition"),
        Some(format!("attachment; filename=\"{id}.xml\""))
    );
    assert_eq!(response.bytes().await.unwrap().as_ref(), stored.as_slice());

    // ?redirect=true: a 307 to such a URL; an unknown parameter is a 400.
    let content = format!("{}/v1/reports/{id}/content", api.base);
    let response = plain
        .get(format!("{content}?redirect=true"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 307);
    assert_eq!(header(&response, "x-quire-sha256"), Some(digest.clone()));
    assert_eq!(
        header(&response, "x-quire-checksum-crc32c"),
        Some(crc32c.clone())
    );
    assert_eq!(
        header(&response, "cache-control").as_deref(),
        Some("no-store")
    );
    let location = header(&response, "location").expect("Location");
    assert!(location.starts_with(&endpoint), "{location}");
    let redirected = plain.get(&location).send().await.unwrap();
    assert_eq!(
        redirected.bytes().await.unwrap().as_ref(),
        stored.as_slice()
    );
    let response = plain
        .get(format!("{content}?redirect=yes"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let response = plain.get(format!("{content}?jump=1")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 400);

    // The CLI downloads from S3 by default, through the API when told.
    let directory = std::env::temp_dir().join(unique("quire-presign-test"));
    std::fs::create_dir_all(&directory).unwrap();
    for (options, source) in [(&[][..], "s3"), (&["--through-api"][..], "api")] {
        let output = directory.join(format!("{source}.xml"));
        let mut arguments = vec!["get", &id, "-o", output.to_str().unwrap(), "--json"];
        arguments.extend_from_slice(options);
        let (code, stdout, stderr) = quire(&api, &arguments);
        assert_eq!(code, 0, "quire get {options:?}: {stderr}");
        let summary: Value = serde_json::from_str(stdout.trim()).expect("get JSON");
        assert_eq!(summary["source"], source, "{summary}");
        assert_eq!(summary["verified"], true, "{summary}");
        assert_eq!(summary["sha256"], digest.as_str());
        assert_eq!(summary["crc32c_verified"], true, "{summary}");
        assert_eq!(summary["crc32c"], crc32c.as_str());
        assert_eq!(std::fs::read(&output).unwrap(), stored);
    }

    // Past its expiry, S3 refuses the URL. The sleep is the thing tested:
    // the URL's time runs out (S3 keeps no state to poll).
    let expired = signed_at + Duration::from_secs(5) + Duration::from_secs(2);
    tokio::time::sleep(expired.saturating_duration_since(Instant::now())).await;
    let response = plain.get(&url).send().await.unwrap();
    assert_eq!(
        response.status().as_u16(),
        403,
        "an expired URL: {:?}",
        response.text().await
    );

    // An API with them off (another replica, so its producers are its own).
    let mut launch = stack.api();
    launch.settings.api.download_url_expiry = None;
    launch.settings.api.replica_id = "api-no-urls".into();
    let without = launch.start_api().await;
    let (code, body) = without.get(&format!("/v1/reports/{id}/url")).await;
    assert_eq!(code, 404);
    assert_eq!(body["error"]["code"], "download_urls_off");
    let response = plain
        .get(format!(
            "{}/v1/reports/{id}/content?redirect=true",
            without.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200, "served, not redirected");
    assert_eq!(response.bytes().await.unwrap().as_ref(), stored.as_slice());
    let output = directory.join("off.xml");
    let (code, stdout, stderr) = quire(
        &without,
        &["get", &id, "-o", output.to_str().unwrap(), "--json"],
    );
    assert_eq!(code, 0, "quire get: {stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).expect("get JSON");
    assert_eq!(summary["source"], "api", "{summary}");
    assert_eq!(std::fs::read(&output).unwrap(), stored);
    let _ = std::fs::remove_dir_all(&directory);
}

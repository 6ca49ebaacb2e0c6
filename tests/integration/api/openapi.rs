//! The OpenAPI document: served, and matching the routes the API serves
//! and the statuses they answer.

use std::collections::{BTreeMap, BTreeSet};

use quire_tests::{TestStack, records, unique};
use serde_json::{Value, json};

const OPENAPI_YAML: &str = include_str!("../../../services/producer-api/openapi.yaml");

/// Every documented operation: (METHOD, path template) -> statuses listed.
fn documented_operations(document: &Value) -> BTreeMap<(String, String), BTreeSet<u16>> {
    let mut operations = BTreeMap::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            let statuses = operation["responses"]
                .as_object()
                .expect("responses")
                .keys()
                .map(|status| status.parse().expect("numeric status"))
                .collect();
            operations.insert((method.to_uppercase(), path.clone()), statuses);
        }
    }
    operations
}

#[tokio::test]
async fn the_openapi_document_is_served_and_matches_the_routes() {
    let stack = TestStack::create("api-openapi").await;
    let api = stack.start_api_in_process().await;

    let served_yaml = api
        .http
        .get(api.url("/openapi.yaml"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        served_yaml, OPENAPI_YAML,
        "the served document is the embedded one"
    );
    let document: Value = serde_norway::from_str(OPENAPI_YAML).expect("YAML");
    let served_json: Value = api
        .http
        .get(api.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(served_json, document);
    assert_eq!(document["openapi"], "3.1.0");

    let operations = documented_operations(&document);
    let stream = unique("doc");
    // A pending report id to look at.
    let (status, _, cut) = api
        .post(&format!("/v1/streams/{stream}/reports"), &Value::Null, None)
        .await;
    assert_eq!(status, 202);
    let report_id = cut["report_id"].as_str().unwrap().to_owned();

    // For each operation: a valid request and a deliberately invalid one
    // (a bad stream name or report id where the path has one).
    let mut exercised = BTreeSet::new();
    for ((method, template), statuses) in &operations {
        let mut attempts = vec![(
            template
                .replace("{stream}", &stream)
                .replace("{id}", &report_id),
            "valid",
        )];
        if template.contains('{') {
            attempts.push((
                template
                    .replace("{stream}", "-bad-name")
                    .replace("{id}", "not-a-report-id"),
                "invalid",
            ));
        }
        for (path, kind) in attempts {
            let url = api.url(&path);
            let request = match method.as_str() {
                "GET" => api.http.get(url),
                "POST" if template.ends_with("/records") => {
                    api.http.post(url).json(&records(&stream, 0, 2))
                }
                "POST" => api.http.post(url),
                "PUT" => api
                    .http
                    .put(url)
                    .json(&json!({"root": "doc", "gzip": true})),
                other => panic!("undocumented method {other} in the test"),
            };
            let response = request.send().await.expect("request");
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default();
            assert!(
                !body.contains("\"code\":\"not_found\"")
                    && !body.contains("\"code\":\"method_not_allowed\""),
                "{method} {template} is documented but not served: {body}"
            );
            assert!(
                statuses.contains(&status),
                "{method} {path} ({kind}) answered {status}, which the document does not list for it ({statuses:?}): {body}"
            );
        }
        exercised.insert((method.clone(), template.clone()));
    }
    assert_eq!(exercised.len(), operations.len());

    // Methods the document does not list on a documented path are not served.
    for template in operations
        .keys()
        .map(|(_, template)| template.clone())
        .collect::<BTreeSet<_>>()
    {
        let path = template
            .replace("{stream}", &stream)
            .replace("{id}", &report_id);
        for method in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            if operations.contains_key(&(method.to_owned(), template.clone())) {
                continue;
            }
            let response = api
                .http
                .request(method.parse().unwrap(), api.url(&path))
                .send()
                .await
                .expect("request");
            assert_eq!(
                response.status().as_u16(),
                405,
                "{method} {template} is served but not documented"
            );
        }
    }
}

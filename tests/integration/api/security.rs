//! Tokens and their scopes, the CLI over TLS, and no secret in the log.

use quire_tests::{TestStack, records, unique};
use serde_json::{Value, json};

use super::{committed_bodies, quire_at};

/// Tokens with scopes on the running API: a write-only token on one prefix
/// publishes there and nowhere else, a read-only token reads and cannot
/// publish, an unknown token is 401; the CLI talks to the API through a
/// TLS endpoint (and refuses one it cannot verify, or a token in clear
/// text beyond loopback); and neither a token nor a Kafka SASL password
/// reaches the API's debug log. On the previous main every known token
/// could do everything on every stream, and tokens were configured in
/// plain text.
#[tokio::test]
async fn tokens_act_within_their_scopes_over_https_and_no_secret_is_logged() {
    use quire_tests::client::token_line;

    let stack = TestStack::create("api-scopes").await;
    let prefix = unique("scoped");
    let [writer, reader, admin] =
        ["writer", "reader", "admin"].map(|name| unique(&format!("{name}-secret")));
    let kafka_password = unique("sasl-password");
    let directory = std::env::temp_dir().join(unique("quire-scopes-test"));
    std::fs::create_dir_all(&directory).unwrap();
    let log = directory.join("api.log");
    let api = stack
        .api()
        .with(|settings| {
            settings.api.tokens = vec![
                token_line("writer", &writer, "write", &format!("{prefix}-")),
                token_line("reader", &reader, "read", "*"),
                token_line("admin", &admin, "read+write", "*"),
            ];
            settings
                .kafka
                .properties
                .insert("sasl_password".into(), kafka_password.clone());
        })
        .log_to(&log, "debug")
        .start_api()
        .await;

    let own = format!("{prefix}-a");
    let other = unique("elsewhere");
    let send = |stream: &str, token: Option<&str>| {
        let mut request = api
            .http
            .post(api.url(&format!("/v1/streams/{stream}/records")))
            .json(&json!(records(stream, 0, 3)));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.expect("POST");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, body) = send(&own, Some(&writer)).await;
    assert_eq!(status, 200, "the writer on its prefix: {body}");
    let (status, body) = send(&other, Some(&writer)).await;
    assert_eq!(status, 403, "the writer beyond its prefix: {body}");
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
    assert_eq!(body["error"]["stream"], other.as_str(), "{body}");
    let (status, body) = send(&own, Some(&reader)).await;
    assert_eq!(status, 403, "the reader writing: {body}");
    assert_eq!(body["error"]["missing_scope"], "write", "{body}");
    let (status, _) = send(&own, Some("not-a-token")).await;
    assert_eq!(status, 401);
    let (status, _) = send(&own, None).await;
    assert_eq!(status, 401);
    let list = |token: &str| {
        let request = api
            .http
            .get(api.url(&format!("/v1/streams/{own}/reports")))
            .bearer_auth(token);
        async move {
            let response = request.send().await.expect("GET");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (status, body) = list(&writer).await;
    assert_eq!(status, 403, "the writer reading: {body}");
    assert_eq!(body["error"]["missing_scope"], "read", "{body}");
    assert_eq!(list(&reader).await.0, 200);

    // The CLI through TLS, with the authority's certificate.
    let target = format!("127.0.0.1:{}", api.port()).parse().unwrap();
    let proxy = quire_tests::tls::TlsProxy::start(target);
    let ca = proxy.ca_pem.to_str().unwrap().to_owned();
    let file = directory.join("records.ndjson");
    let over_tls = format!("{prefix}-tls");
    let lines: Vec<String> = records(&over_tls, 0, 40)
        .iter()
        .map(Value::to_string)
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let (code, _, stderr) = quire_at(
        &proxy.base,
        &["--ca-cert", &ca, "--token", &admin],
        &["send", "-s", &over_tls, file.to_str().unwrap(), "--json"],
    );
    assert_eq!(code, 0, "quire send over https: {stderr}");
    assert!(proxy.handshakes.load(std::sync::atomic::Ordering::SeqCst) > 0);
    let (code, stdout, stderr) = quire_at(
        &proxy.base,
        &["--ca-cert", &ca, "--token", &reader],
        &["list", "-s", &over_tls, "--json"],
    );
    assert_eq!(code, 0, "quire list over https: {stderr} {stdout}");
    // Without the authority, the certificate is refused: nothing is sent.
    let (code, _, stderr) = quire_at(
        &proxy.base,
        &["--token", &admin],
        &[
            "send",
            "-s",
            &over_tls,
            file.to_str().unwrap(),
            "--state",
            directory.join("p2").to_str().unwrap(),
        ],
    );
    assert_eq!(
        code, 1,
        "an unverifiable certificate was accepted: {stderr}"
    );
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    // A token is not sent in clear text beyond loopback (nothing listens there).
    let (code, _, stderr) = quire_at(
        "http://192.0.2.1:9",
        &["--token", &admin],
        &["list", "-s", &over_tls],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("clear text"), "{stderr}");
    assert!(
        !stderr.contains(&admin),
        "the refusal echoed the token: {stderr}"
    );

    let published = |stream: &str| committed_bodies(&stack, stream).len();
    assert_eq!(published(&own), 3, "the writer's one array");
    assert_eq!(published(&other), 0, "a refused array was published");
    assert_eq!(published(&over_tls), 40, "the CLI's records over TLS");

    drop(api);
    let logged = std::fs::read_to_string(&log).expect("the API's log");
    assert!(
        logged.lines().count() > 5,
        "the debug log is nearly empty: {logged}"
    );
    for (what, secret) in [
        ("the writer's token", writer.as_str()),
        ("the reader's token", reader.as_str()),
        ("the admin's token", admin.as_str()),
        ("the SASL password", kafka_password.as_str()),
    ] {
        assert!(!logged.contains(secret), "{what} is in the API's log");
    }
    let _ = std::fs::remove_dir_all(&directory);
}

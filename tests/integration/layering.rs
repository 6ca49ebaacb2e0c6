//! What each crate must not depend on (ARCHITECTURE.md, "Deliberate
//! absences"), read from the manifests: a dependency added against the map
//! fails here, naming the crate and the dependency.

use std::path::Path;

/// The dependency names of a manifest's `[dependencies]` table, read with a
/// TOML parser, so every form is seen: `name = "1"`, `name.workspace = true`,
/// `name = { ... }` and a `[dependencies.name]` table; a renamed dependency
/// (`package = "..."`) is named by the crate it brings.
fn dependencies(manifest: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(manifest);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    let parsed: toml::Table = text
        .parse()
        .unwrap_or_else(|error| panic!("{manifest} is not TOML: {error}"));
    let names = dependency_names(&parsed);
    assert!(!names.is_empty(), "{manifest} lists no dependencies");
    names
}

fn dependency_names(manifest: &toml::Table) -> Vec<String> {
    let Some(table) = manifest.get("dependencies").and_then(toml::Value::as_table) else {
        return Vec::new();
    };
    table
        .iter()
        .map(|(name, spec)| {
            spec.get("package")
                .and_then(toml::Value::as_str)
                .unwrap_or(name)
                .to_owned()
        })
        .collect()
}

#[test]
fn every_form_of_a_dependency_is_seen() {
    let manifest: toml::Table = r#"
        [dependencies]
        plain = "1"
        tokio.workspace = true
        inline = { version = "1", features = ["x"] }
        kafka = { package = "rdkafka", version = "0.39" }

        [dependencies.table-form]
        version = "2"

        [dev-dependencies]
        only-in-tests = "1"
    "#
    .parse()
    .unwrap();
    let mut names = dependency_names(&manifest);
    names.sort();
    assert_eq!(
        names,
        ["inline", "plain", "rdkafka", "table-form", "tokio"],
        "dev-dependencies are not the crate's own"
    );
}

fn assert_absent(manifest: &str, forbidden: &[&str], why: &str) {
    let present: Vec<String> = dependencies(manifest)
        .into_iter()
        .filter(|name| forbidden.contains(&name.as_str()))
        .collect();
    assert!(
        present.is_empty(),
        "{manifest} depends on {present:?}: {why}"
    );
}

#[test]
fn only_the_queue_crate_links_rdkafka() {
    for manifest in [
        "services/producer-api/Cargo.toml",
        "services/report-generator/Cargo.toml",
        "services/cli/Cargo.toml",
        "shared/s3/Cargo.toml",
        "shared/xml/Cargo.toml",
        "shared/messages/Cargo.toml",
        "shared/config/Cargo.toml",
        "shared/log/Cargo.toml",
    ] {
        assert_absent(
            manifest,
            &["rdkafka", "rdkafka-sys"],
            "Kafka clients are built in quire-queue only (client.rs checks their properties)",
        );
    }
    assert!(dependencies("shared/queue/Cargo.toml").contains(&"rdkafka".to_owned()));
}

#[test]
fn the_log_crate_knows_no_http() {
    assert_absent(
        "shared/log/Cargo.toml",
        &["axum", "hyper", "reqwest", "quire-xml"],
        "which log and which partition is a question of Kafka and the bucket, not of the API",
    );
}

#[test]
fn the_xml_renderer_knows_neither_kafka_nor_s3() {
    assert_absent(
        "shared/xml/Cargo.toml",
        &["quire-queue", "quire-s3", "aws-sdk-s3", "tokio"],
        "rendering is a pure function of records and a definition",
    );
}

#[test]
fn the_s3_writer_knows_neither_kafka_nor_quire_messages_nor_xml() {
    assert_absent(
        "shared/s3/Cargo.toml",
        &["quire-queue", "quire-messages", "quire-xml", "quick-xml"],
        "the writer stores bytes under the keys its caller gives",
    );
}

#[test]
fn the_message_formats_depend_on_nothing_of_quire() {
    assert_absent(
        "shared/messages/Cargo.toml",
        &[
            "quire-queue",
            "quire-s3",
            "quire-xml",
            "quire-config",
            "tokio",
        ],
        "formats are data: every crate may use them, they use none",
    );
}

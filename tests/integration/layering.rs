//! What each crate must not depend on (ARCHITECTURE.md, "Deliberate
//! absences"), read from the manifests: a dependency added against the map
//! fails here, naming the crate and the dependency.

use std::path::Path;

/// The dependency names of a manifest's `[dependencies]` table.
fn dependencies(manifest: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(manifest);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    let mut names = Vec::new();
    let mut in_dependencies = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if in_dependencies
            && let Some((name, _)) = line.split_once('=')
            && !line.starts_with('#')
        {
            names.push(name.trim().trim_end_matches(".workspace").to_owned());
        }
    }
    assert!(!names.is_empty(), "{manifest} lists no dependencies");
    names
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

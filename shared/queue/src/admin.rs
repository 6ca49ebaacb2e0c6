//! Topic creation and the start-up check that topics are what DESIGN.md says.

use std::collections::BTreeMap;

use quire_config::{KafkaSettings, TopicNames};
use rdkafka::admin::{
    AdminClient, AdminOptions, NewPartitions, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;

use crate::QueueError;
use crate::client::base_config;

/// A topic with the partition count and settings quire relies on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: i32,
    pub replication: i32,
    pub config: Vec<(String, String)>,
    /// The records and watermark topics may have grown past `partitions`
    /// (an operator's `--alter`, or quire's own growth procedure part way):
    /// more partitions than expected is not a mismatch for them, fewer is.
    pub growable: bool,
}

/// The partition count of the records and watermark topics when quire
/// creates them, unless `kafka.partitions` says otherwise.
pub const DEFAULT_PARTITIONS: i32 = 12;

const SEVEN_DAYS_MS: u64 = 7 * 24 * 3600 * 1000;
/// How long stored Idempotency-Key answers are kept (at least the API's
/// default `idempotency_ttl_ms`, 24 h).
pub const IDEMPOTENCY_RETENTION_MS: u64 = 2 * 24 * 3600 * 1000;

/// The watermark topic's compaction settings: what bounds the read of a
/// take-over. The active segment is never compacted, so it rolls after
/// `segment.ms` or `segment.bytes`, whichever comes first; the cleaner then
/// compacts a partition once a tenth of it is dirty, and at the latest
/// `max.compaction.lag.ms` after a write, with no minimum lag. A new owner
/// therefore reads one latest value per stream plus at most about a segment
/// (1 MiB, or ten minutes of writes) of not-yet-compacted ones, however long
/// the topic has lived. Checked at start-up: each is a bound the topic must
/// not exceed.
pub const WATERMARK_COMPACTION: &[(&str, &str)] = &[
    ("segment.ms", "600000"),
    ("segment.bytes", "1048576"),
    ("min.cleanable.dirty.ratio", "0.1"),
    ("min.compaction.lag.ms", "0"),
    ("max.compaction.lag.ms", "600000"),
];

/// The topic setting that says whose clock a message's timestamp is.
pub const TIMESTAMP_TYPE: &str = "message.timestamp.type";
/// The broker's, at append: the records topic's, so that time windows are
/// cut by the log (timestamps that never go backwards on a partition), not
/// by producers' clocks.
pub const LOG_APPEND_TIME: &str = "LogAppendTime";

/// The project's topics, per DESIGN.md: the records and watermark topics
/// with `partitions` partitions each (watermark partition p belongs to
/// record partition p), the others with fixed counts.
pub fn design_topics(names: &TopicNames, replication: i32, partitions: i32) -> Vec<TopicSpec> {
    let spec = |name: &str, partitions: i32, config: &[(&str, String)]| TopicSpec {
        name: name.to_owned(),
        partitions,
        replication,
        config: config
            .iter()
            .map(|(key, value)| ((*key).to_owned(), value.clone()))
            .collect(),
        growable: name == names.records || name == names.watermarks,
    };
    vec![
        spec(
            &names.records,
            partitions,
            &[
                ("retention.ms", SEVEN_DAYS_MS.to_string()),
                (TIMESTAMP_TYPE, LOG_APPEND_TIME.to_owned()),
            ],
        ),
        spec(
            &names.watermarks,
            partitions,
            &std::iter::once(("cleanup.policy", "compact".to_owned()))
                .chain(
                    WATERMARK_COMPACTION
                        .iter()
                        .map(|(key, value)| (*key, (*value).to_owned())),
                )
                .collect::<Vec<_>>(),
        ),
        spec(&names.report_events, 3, &[]),
        spec(&names.dead_letters, 3, &[]),
        spec(
            &names.idempotency,
            12,
            &[("retention.ms", IDEMPOTENCY_RETENTION_MS.to_string())],
        ),
    ]
}

pub(crate) fn admin_client(
    settings: &KafkaSettings,
) -> Result<AdminClient<DefaultClientContext>, QueueError> {
    base_config(settings)?.create().map_err(QueueError::client)
}

fn options(settings: &KafkaSettings) -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(settings.request_timeout))
}

/// Creates the topics that do not exist yet. Existing topics are left alone
/// (use [`check_topics`] to verify them).
pub async fn ensure_topics(
    settings: &KafkaSettings,
    specs: &[TopicSpec],
) -> Result<(), QueueError> {
    let admin = admin_client(settings)?;
    let new_topics: Vec<NewTopic<'_>> = specs
        .iter()
        .map(|spec| {
            spec.config.iter().fold(
                NewTopic::new(
                    &spec.name,
                    spec.partitions,
                    TopicReplication::Fixed(spec.replication),
                ),
                |topic, (key, value)| topic.set(key, value),
            )
        })
        .collect();
    let results = admin
        .create_topics(&new_topics, &options(settings))
        .await
        .map_err(|error| QueueError::Admin(error.to_string()))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(QueueError::Admin(format!("creating topic {topic}: {code}")));
            }
        }
    }
    Ok(())
}

/// Grows `topic` to `partitions` partitions (CreatePartitions). A topic
/// that already has them is left alone; fewer is refused by Kafka (a
/// partition count never shrinks).
pub async fn grow_topic(
    settings: &KafkaSettings,
    topic: &str,
    partitions: i32,
) -> Result<(), QueueError> {
    let admin = admin_client(settings)?;
    let count = usize::try_from(partitions).map_err(|_| {
        QueueError::Admin(format!("growing topic {topic}: {partitions} partitions"))
    })?;
    let results = admin
        .create_partitions(&[NewPartitions::new(topic, count)], &options(settings))
        .await
        .map_err(|error| QueueError::Admin(error.to_string()))?;
    for result in results {
        match result {
            Ok(_) => {}
            // Already that many: a growth run again after a partial one.
            Err((_, RDKafkaErrorCode::InvalidPartitions))
                if crate::describe_topic(settings, topic).await?.partitions == partitions => {}
            Err((topic, code)) => {
                return Err(QueueError::Admin(format!(
                    "growing topic {topic} to {partitions} partitions: {code}"
                )));
            }
        }
    }
    Ok(())
}

/// Deletes topics (tests clean up after themselves with it).
pub async fn delete_topics(settings: &KafkaSettings, names: &[&str]) -> Result<(), QueueError> {
    let admin = admin_client(settings)?;
    let results = admin
        .delete_topics(names, &options(settings))
        .await
        .map_err(|error| QueueError::Admin(error.to_string()))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => {
                return Err(QueueError::Admin(format!("deleting topic {topic}: {code}")));
            }
        }
    }
    Ok(())
}

/// Verifies that every topic exists with the expected partition count and
/// settings. A changed partition count would move keys between partitions,
/// so a service refuses to run on one.
pub async fn check_topics(settings: &KafkaSettings, specs: &[TopicSpec]) -> Result<(), QueueError> {
    let admin = admin_client(settings)?;
    let timeout = settings.request_timeout;
    let metadata_client: BaseConsumer = base_config(settings)?
        .create()
        .map_err(QueueError::client)?;
    let metadata =
        tokio::task::spawn_blocking(move || metadata_client.fetch_metadata(None, timeout))
            .await?
            .map_err(QueueError::client)?;
    let resources: Vec<ResourceSpecifier<'_>> = specs
        .iter()
        .map(|spec| ResourceSpecifier::Topic(&spec.name))
        .collect();
    let configs = admin
        .describe_configs(&resources, &options(settings))
        .await
        .map_err(|error| QueueError::Admin(error.to_string()))?;
    for (spec, config) in specs.iter().zip(configs) {
        let found = metadata
            .topics()
            .iter()
            .find(|topic| topic.name() == spec.name)
            .filter(|topic| topic.error().is_none())
            .ok_or_else(|| {
                QueueError::TopicMismatch(format!(
                    "topic {} does not exist (deploy/local/stack up creates it)",
                    spec.name
                ))
            })?;
        let partitions = found.partitions().len() as i32;
        let fits = if spec.growable {
            partitions >= spec.partitions
        } else {
            partitions == spec.partitions
        };
        if !fits {
            return Err(QueueError::TopicMismatch(format!(
                "topic {} has {partitions} partitions, expected {}{}",
                spec.name,
                if spec.growable { "at least " } else { "" },
                spec.partitions
            )));
        }
        let config = config.map_err(|code| {
            QueueError::TopicMismatch(format!("describing topic {}: {code}", spec.name))
        })?;
        // Retention may be tuned by the operator; compaction may not change,
        // since the watermarks rely on it and the records must not be compacted.
        let expected_policy = spec
            .config
            .iter()
            .find(|(key, _)| key == "cleanup.policy")
            .map_or("delete", |(_, value)| value.as_str());
        let actual_policy = config
            .get("cleanup.policy")
            .and_then(|entry| entry.value.clone())
            .unwrap_or_default();
        if actual_policy != expected_policy {
            return Err(QueueError::TopicMismatch(format!(
                "topic {} has cleanup.policy={actual_policy}, expected {expected_policy}",
                spec.name
            )));
        }
        // Time windows are cut by the broker's append time.
        if let Some((_, expected)) = spec.config.iter().find(|(key, _)| key == TIMESTAMP_TYPE) {
            let actual = config
                .get(TIMESTAMP_TYPE)
                .and_then(|entry| entry.value.clone())
                .unwrap_or_default();
            if actual != *expected {
                return Err(QueueError::TopicMismatch(format!(
                    "topic {} has {TIMESTAMP_TYPE}={actual}, expected {expected} (time windows are cut by the broker's append time); set it with: kafka-configs.sh --bootstrap-server ... --alter --entity-type topics --entity-name {} --add-config {TIMESTAMP_TYPE}={expected}",
                    spec.name, spec.name
                )));
            }
        }
        // The compaction bounds may be tightened, never loosened: a looser
        // one lets a take-over read unbounded history.
        for (key, bound) in &spec.config {
            if !WATERMARK_COMPACTION
                .iter()
                .any(|(bounded, _)| bounded == key)
            {
                continue;
            }
            let actual = config
                .get(key)
                .and_then(|entry| entry.value.clone())
                .unwrap_or_default();
            if !within_bound(&actual, bound) {
                return Err(QueueError::TopicMismatch(format!(
                    "topic {} has {key}={actual}, expected at most {bound} (so a take-over reads a bounded amount)",
                    spec.name
                )));
            }
        }
    }
    Ok(())
}

/// The live settings of `topic` as the brokers describe them (name ->
/// value; settings without a value are left out): what a service checks its
/// own configuration against at start-up.
pub async fn topic_config(
    settings: &KafkaSettings,
    topic: &str,
) -> Result<BTreeMap<String, String>, QueueError> {
    let admin = admin_client(settings)?;
    let described = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &options(settings))
        .await
        .map_err(|error| QueueError::Admin(error.to_string()))?;
    let config = described
        .into_iter()
        .next()
        .ok_or_else(|| QueueError::Admin(format!("describing topic {topic}: no answer")))?
        .map_err(|code| QueueError::TopicMismatch(format!("describing topic {topic}: {code}")))?;
    Ok(config
        .entries
        .into_iter()
        .filter_map(|entry| entry.value.map(|value| (entry.name, value)))
        .collect())
}

/// Whether a numeric topic setting is at most its bound; an unreadable value
/// is not.
fn within_bound(actual: &str, bound: &str) -> bool {
    match (actual.trim().parse::<f64>(), bound.parse::<f64>()) {
        (Ok(actual), Ok(bound)) => actual <= bound,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watermark_topic_is_compacted_within_bounds_and_the_records_are_not() {
        let names = TopicNames {
            records: "r".into(),
            report_events: "e".into(),
            watermarks: "w".into(),
            dead_letters: "d".into(),
            idempotency: "i".into(),
        };
        let specs = design_topics(&names, 1, DEFAULT_PARTITIONS);
        let watermarks = specs.iter().find(|spec| spec.name == "w").unwrap();
        for (key, value) in WATERMARK_COMPACTION {
            assert!(
                watermarks
                    .config
                    .contains(&((*key).to_owned(), (*value).to_owned())),
                "{key}"
            );
        }
        let records = specs.iter().find(|spec| spec.name == "r").unwrap();
        assert!(
            records
                .config
                .contains(&(TIMESTAMP_TYPE.to_owned(), LOG_APPEND_TIME.to_owned())),
            "windows are cut by the broker's time"
        );
        assert!(
            records
                .config
                .iter()
                .all(|(key, _)| key != "cleanup.policy")
        );
    }

    #[test]
    fn a_bound_may_be_tightened_not_loosened() {
        assert!(within_bound("600000", "600000"));
        assert!(within_bound("60000", "600000"));
        assert!(within_bound("0.05", "0.1"));
        assert!(!within_bound("604800000", "600000"));
        assert!(!within_bound("0.5", "0.1"));
        assert!(!within_bound("", "0"));
    }
}

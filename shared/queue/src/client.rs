//! Building librdkafka client configurations, in one place.
//!
//! The user's pass-through properties go in first; then the properties the
//! semantics depend on are set in code. A user property that names one of
//! those is refused at start-up rather than silently overwritten, so nobody
//! believes they changed something they did not.

use quire_config::KafkaSettings;
use rdkafka::ClientConfig;

use crate::QueueError;

/// Properties quire sets itself, with why. librdkafka aliases are listed too.
pub const PROTECTED_PROPERTIES: &[(&str, &str)] = &[
    (
        "bootstrap.servers",
        "set it through kafka.bootstrap_servers",
    ),
    (
        "metadata.broker.list",
        "set it through kafka.bootstrap_servers",
    ),
    (
        "enable.auto.commit",
        "quire commits once per array, only what is durable",
    ),
    (
        "auto.commit.enable",
        "quire commits once per array, only what is durable",
    ),
    ("enable.auto.offset.store", "quire commits explicit offsets"),
    (
        "isolation.level",
        "consumers read only committed transactions",
    ),
    (
        "auto.offset.reset",
        "a new group starts at the beginning; a deleted offset is an error",
    ),
    (
        "enable.partition.eof",
        "drain mode detects the end of each partition",
    ),
    ("group.id", "set by the service"),
    (
        "group.instance.id",
        "set by the service for static membership",
    ),
    ("partition.assignment.strategy", "set by the service"),
    ("enable.idempotence", "array enqueue is idempotent"),
    ("acks", "array enqueue waits for all in-sync replicas"),
    (
        "request.required.acks",
        "array enqueue waits for all in-sync replicas",
    ),
    ("transactional.id", "set by the service, stable per replica"),
    (
        "transaction.timeout.ms",
        "set it through kafka.transaction_timeout_ms",
    ),
    (
        "partitioner",
        "the stream-to-partition mapping must never change",
    ),
];

/// The shared part of every client's configuration: bootstrap servers and
/// the user's pass-through properties, validated.
pub(crate) fn base_config(settings: &KafkaSettings) -> Result<ClientConfig, QueueError> {
    let mut config = ClientConfig::new();
    for (key, value) in settings.client_properties() {
        if let Some((_, reason)) = PROTECTED_PROPERTIES
            .iter()
            .find(|(protected, _)| *protected == key)
        {
            return Err(QueueError::ProtectedProperty { key, reason });
        }
        config.set(key, value);
    }
    config.set("bootstrap.servers", &settings.bootstrap_servers);
    Ok(config)
}

/// A transactional, idempotent producer's configuration.
pub(crate) fn producer_config(
    settings: &KafkaSettings,
    transactional_id: &str,
) -> Result<ClientConfig, QueueError> {
    let mut config = base_config(settings)?;
    // Throughput defaults the user may change: commit_transaction flushes at
    // once, so a long linger costs no latency at the end of an array.
    set_default(&mut config, "linger.ms", "50");
    set_default(&mut config, "batch.size", "1048576");
    // Right after a commit the coordinator is still writing its markers, and
    // the next transaction's first AddPartitionsToTxn is answered
    // CONCURRENT_TRANSACTIONS; librdkafka retries after retry.backoff.ms,
    // whose default (100 ms) would then bound us to ten transactions a second.
    set_default(&mut config, "retry.backoff.ms", "5");
    // Batches compress well: measured by `quire-bench pipeline` (500,000
    // records of 100 bytes, 8 streams), lz4 took the records topic from 104
    // to 5.5 bytes per record on the broker's disk for 0.16 CPU-us per
    // record more in the API (1.12 against 0.96). zstd is not built into
    // this librdkafka. The user may still set it (`none` turns it off).
    set_default(&mut config, "compression.type", "lz4");
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("transactional.id", transactional_id)
        .set(
            "transaction.timeout.ms",
            settings.transaction_timeout.as_millis().to_string(),
        )
        // The Java client's partitioner, so every client maps a key alike.
        .set("partitioner", "murmur2_random");
    Ok(config)
}

/// An idempotent producer outside any transaction: for the few writes that
/// readers take uncommitted (the partition layout), so that nobody's open
/// transaction on the same partition can hold them back.
pub(crate) fn plain_producer_config(settings: &KafkaSettings) -> Result<ClientConfig, QueueError> {
    let mut config = base_config(settings)?;
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random");
    Ok(config)
}

/// A group consumer's configuration: read_committed, no auto commit, no
/// silent offset reset, partition EOF events for drain mode.
pub(crate) fn consumer_config(
    settings: &KafkaSettings,
    group_id: &str,
    group_instance_id: Option<&str>,
    cooperative: bool,
    statistics_interval: Option<std::time::Duration>,
    session_timeout: Option<std::time::Duration>,
    max_poll_interval: Option<std::time::Duration>,
) -> Result<ClientConfig, QueueError> {
    let mut config = base_config(settings)?;
    // Catching up on a backlog: 1 MiB per partition per fetch (the default)
    // made a worker wait on fetch round trips; measured by the pipeline
    // benchmark at 1,000,000 records, 8 MiB took the worker from 107k to
    // 154k records/s. The user may still set it.
    set_default(&mut config, "max.partition.fetch.bytes", "8388608");
    // Partitions added to the topic are noticed (and the group rebalanced
    // to assign them) within seconds, not at librdkafka's default five
    // minutes: a grown records topic is served at once. One metadata
    // request per interval; the user may still set it.
    set_default(&mut config, "topic.metadata.refresh.interval.ms", "5000");
    config
        .set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        // New partitions start at the beginning explicitly (see the rebalance
        // callback); any other reset, e.g. a committed offset that retention
        // deleted, surfaces as an error instead of a jump.
        .set("auto.offset.reset", "error")
        .set("enable.partition.eof", "true");
    if cooperative {
        config.set("partition.assignment.strategy", "cooperative-sticky");
    }
    if let Some(instance_id) = group_instance_id {
        config.set("group.instance.id", instance_id);
    }
    // The service asks for statistics (lag metrics); a user's own
    // statistics.interval.ms stands when the service does not.
    if let Some(interval) = statistics_interval {
        config.set(
            "statistics.interval.ms",
            interval.as_millis().max(1).to_string(),
        );
    }
    // A consumer-only property: set here rather than through the pass-through
    // map, which producers share (and warn about).
    if let Some(timeout) = session_timeout {
        config.set("session.timeout.ms", timeout.as_millis().max(1).to_string());
    }
    if let Some(interval) = max_poll_interval {
        config.set(
            "max.poll.interval.ms",
            interval.as_millis().max(1).to_string(),
        );
    }
    Ok(config)
}

/// A partition reader's configuration (see `reader.rs`): assign-only, no
/// commits, partition EOF events, `isolation_level` as asked.
pub(crate) fn reader_config(
    settings: &KafkaSettings,
    group_id: &str,
    isolation_level: &str,
    small_fetches: bool,
) -> Result<ClientConfig, QueueError> {
    let mut config = base_config(settings)?;
    config
        .set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", isolation_level)
        .set("enable.partition.eof", "true")
        // The end of a short partition is known at once, and a fetch left
        // waiting there by the previous read does not delay the next, not
        // after the broker's default 500 ms wait for more data.
        .set("fetch.wait.max.ms", "10");
    if small_fetches {
        // One message is read per look-up: do not prefetch megabytes after
        // it (the broker still returns a whole batch that is larger).
        config
            .set("max.partition.fetch.bytes", "65536")
            .set("queued.max.messages.kbytes", "1024");
    }
    Ok(config)
}

/// librdkafka's `message.max.bytes` when nothing sets it.
const LIBRDKAFKA_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// The sizes a transactional producer's configuration bounds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerSizes {
    /// `message.max.bytes`: the largest message librdkafka sends, and the
    /// largest record batch it builds.
    pub message_max_bytes: usize,
    /// `batch.size`: the record batch librdkafka fills for one partition
    /// (a first message larger than it still goes, alone).
    pub batch_size: usize,
}

impl ProducerSizes {
    /// The largest record batch of several messages librdkafka sends: a
    /// topic whose `max.message.bytes` is below it may refuse a batch of
    /// messages that each fit.
    pub fn record_batch_cap(&self) -> usize {
        self.message_max_bytes.min(self.batch_size)
    }
}

/// What a transactional producer of quire's is configured with (the user's
/// `kafka.properties` over quire's and librdkafka's defaults); `Err` names a
/// property that is not a number.
pub fn producer_sizes(settings: &KafkaSettings) -> Result<ProducerSizes, String> {
    let config = producer_config(settings, "sizes").map_err(|error| error.to_string())?;
    let read = |key: &str, default: usize| match config.get(key) {
        None => Ok(default),
        Some(value) => value
            .trim()
            .parse()
            .map_err(|_| format!("kafka.properties.{key} {value:?} is not a number of bytes")),
    };
    Ok(ProducerSizes {
        message_max_bytes: read("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)?,
        batch_size: read("batch.size", LIBRDKAFKA_MESSAGE_MAX_BYTES)?,
    })
}

fn set_default(config: &mut ClientConfig, key: &str, value: &str) {
    if config.get(key).is_none() {
        config.set(key, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings_with(key: &str, value: &str) -> KafkaSettings {
        let mut settings = KafkaSettings::for_bootstrap("127.0.0.1:1");
        settings.properties.insert(key.to_owned(), value.to_owned());
        settings
    }

    #[test]
    fn a_protected_property_is_refused_by_name() {
        for key in [
            "enable.auto.commit",
            "isolation_level",
            "acks",
            "partitioner",
        ] {
            let error = base_config(&settings_with(key, "x")).unwrap_err();
            let dotted = key.replace('_', ".");
            assert!(
                matches!(&error, QueueError::ProtectedProperty { key, .. } if *key == dotted),
                "{error}"
            );
            assert!(error.to_string().contains(&dotted));
        }
    }

    #[test]
    fn other_properties_pass_through() {
        let config = producer_config(&settings_with("security.protocol", "ssl"), "t").unwrap();
        assert_eq!(config.get("security.protocol"), Some("ssl"));
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("transaction.timeout.ms"), Some("10000"));
    }

    #[test]
    fn producer_sizes_are_the_users_over_quires_and_librdkafkas_defaults() {
        let defaults = producer_sizes(&KafkaSettings::for_bootstrap("127.0.0.1:1")).unwrap();
        assert_eq!(
            defaults,
            ProducerSizes {
                message_max_bytes: 1_000_000,
                batch_size: 1_048_576
            }
        );
        assert_eq!(defaults.record_batch_cap(), 1_000_000);
        let smaller = producer_sizes(&settings_with("batch_size", "65536")).unwrap();
        assert_eq!(smaller.record_batch_cap(), 65_536);
        let error = producer_sizes(&settings_with("message_max_bytes", "big")).unwrap_err();
        assert!(error.contains("message.max.bytes"), "{error}");
    }

    #[test]
    fn tuning_defaults_yield_to_the_user() {
        let config = producer_config(&settings_with("linger.ms", "5"), "t").unwrap();
        assert_eq!(config.get("linger.ms"), Some("5"));
        assert_eq!(
            config.get("compression.type"),
            Some("lz4"),
            "quire's default"
        );
        let config = producer_config(&settings_with("compression.type", "none"), "t").unwrap();
        assert_eq!(config.get("compression.type"), Some("none"));
    }

    #[test]
    fn consumers_read_committed_without_auto_commit() {
        let settings = KafkaSettings::for_bootstrap("127.0.0.1:1");
        let config = consumer_config(
            &settings,
            "g",
            Some("r-1"),
            true,
            Some(std::time::Duration::from_secs(2)),
            Some(std::time::Duration::from_secs(6)),
            Some(std::time::Duration::from_secs(8)),
        )
        .unwrap();
        assert_eq!(config.get("session.timeout.ms"), Some("6000"));
        assert_eq!(config.get("max.poll.interval.ms"), Some("8000"));
        assert_eq!(config.get("isolation.level"), Some("read_committed"));
        assert_eq!(config.get("enable.auto.commit"), Some("false"));
        assert_eq!(config.get("group.instance.id"), Some("r-1"));
        assert_eq!(
            config.get("partition.assignment.strategy"),
            Some("cooperative-sticky")
        );
        assert_eq!(config.get("statistics.interval.ms"), Some("2000"));
    }
}

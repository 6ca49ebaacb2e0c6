//! What start-up checks before it connects to anything: every setting that
//! needs no broker and no bucket is validated here, so a bad one is refused
//! at once (not after the topics are checked and the stored
//! `Idempotency-Key` answers are loaded, which may take minutes).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quire_config::Settings;

use super::StartupError;
use crate::auth::BearerTokens;
use crate::openapi;
use crate::rate::ControlLimits;
use crate::serve::ConnectionLimits;
use crate::storage::MAX_DOWNLOAD_URL_EXPIRY;
use crate::validation::Limits;

/// The settings, checked and in the types the API uses.
pub struct Checked {
    pub limits: Limits,
    pub connections: ConnectionLimits,
    pub control_limits: Arc<ControlLimits>,
    /// The endpoint download URLs are signed for, or None when they are off.
    pub download_endpoint: Option<String>,
    pub tokens: BearerTokens,
    /// `api.kafka_check_interval_ms`, at least 1 ms.
    pub check_interval: Duration,
}

/// Room a message of the records topic needs beyond its payload: Kafka's
/// record batch header (61 bytes) and record framing (a few dozen), the key
/// (a stream name, at most 128 bytes) and the `quire-kind` and `quire-v`
/// headers, with plenty to spare.
pub const MESSAGE_ROOM: usize = 1024;

/// Checks every setting that needs no connection; `address` is where the
/// API listens (authentication depends on it).
pub fn check(settings: &Settings, address: SocketAddr) -> Result<Checked, StartupError> {
    let sizes =
        quire_queue::producer_sizes(&settings.kafka).map_err(StartupError::ProducerSizes)?;
    check_message_room(settings, &MessageLimit::Client(sizes.message_max_bytes))?;
    let checked = Checked {
        limits: limits(settings)?,
        connections: connection_limits(settings)?,
        control_limits: Arc::new(control_limits(settings)),
        download_endpoint: download_endpoint(settings)?,
        tokens: authentication(settings, address)?,
        check_interval: settings
            .api
            .kafka_check_interval
            .max(Duration::from_millis(1)),
    };
    openapi::check().map_err(StartupError::OpenApi)?;
    Ok(checked)
}

/// The bearer tokens. A listed token that is empty is a mistake, never
/// "authentication off"; and without tokens the API serves only loopback
/// unless `api.allow_unauthenticated` says otherwise.
fn authentication(settings: &Settings, address: SocketAddr) -> Result<BearerTokens, StartupError> {
    let api = &settings.api;
    for (index, token) in api.tokens.iter().enumerate() {
        for earlier in &api.tokens[..index] {
            if earlier.name == token.name || earlier.sha256 == token.sha256 {
                return Err(StartupError::DuplicateToken {
                    first: earlier.name.clone(),
                    second: token.name.clone(),
                });
            }
        }
    }
    let tokens = BearerTokens::new(&api.tokens);
    if !tokens.enabled() && !address.ip().is_loopback() && !api.allow_unauthenticated {
        return Err(StartupError::Unauthenticated { address });
    }
    if !tokens.enabled() && !address.ip().is_loopback() {
        tracing::warn!(%address, "authentication is off (api.allow_unauthenticated) on a non-loopback address");
    }
    Ok(tokens)
}

/// Refuses an `Idempotency-Key` lifetime longer than the idempotency topic
/// keeps the answers (`config`: the topic's live settings). Within the TTL a
/// retry must find its first answer; the answers outlive a restart and are
/// shared by replicas only through the topic, so the topic must keep them
/// at least that long. A topic that deletes nothing by time (retention.ms
/// -1, or a policy without `delete`) keeps them forever.
pub fn check_idempotency_ttl(
    ttl_ms: u64,
    topic: &str,
    config: &std::collections::BTreeMap<String, String>,
) -> Result<(), StartupError> {
    let deletes = config
        .get("cleanup.policy")
        .is_none_or(|policy| policy.split(',').any(|part| part.trim() == "delete"));
    let retention_ms = config
        .get("retention.ms")
        .and_then(|value| value.trim().parse::<i64>().ok());
    match retention_ms {
        Some(retention_ms) if deletes && retention_ms >= 0 && ttl_ms > retention_ms as u64 => {
            Err(StartupError::IdempotencyTtlBeyondRetention {
                ttl_ms,
                retention_ms,
                topic: topic.to_owned(),
            })
        }
        _ => Ok(()),
    }
}

/// The largest message a records-topic batch must fit under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageLimit {
    /// The kafka client's `message.max.bytes`.
    Client(usize),
    /// The records topic's `max.message.bytes`.
    Topic { topic: String, bytes: usize },
}

impl MessageLimit {
    fn bytes(&self) -> usize {
        match self {
            MessageLimit::Client(bytes) | MessageLimit::Topic { bytes, .. } => *bytes,
        }
    }
}

impl std::fmt::Display for MessageLimit {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageLimit::Client(bytes) => write!(
                formatter,
                "the kafka client's message.max.bytes ({bytes}; kafka.properties.message.max.bytes raises it)"
            ),
            MessageLimit::Topic { topic, bytes } => write!(
                formatter,
                "the records topic {topic}'s max.message.bytes ({bytes}; the topic's config raises it)"
            ),
        }
    }
}

/// The records topic's `max.message.bytes` (`config`: its live settings);
/// `None` when the broker did not say.
pub fn topic_message_limit(
    topic: &str,
    config: &std::collections::BTreeMap<String, String>,
) -> Option<MessageLimit> {
    let bytes = config.get("max.message.bytes")?.trim().parse().ok()?;
    Some(MessageLimit::Topic {
        topic: topic.to_owned(),
        bytes,
    })
}

/// Refuses batches or records a message of the records topic could not
/// carry under `limit`: a full batch (`api.batch_max_bytes`) and the largest
/// record alone in its batch (`api.max_record_bytes` and its frame), each
/// with [`MESSAGE_ROOM`]. Past it, Kafka would refuse the message and abort
/// the transaction of every request sharing it.
pub fn check_message_room(settings: &Settings, limit: &MessageLimit) -> Result<(), StartupError> {
    let api = &settings.api;
    let needs = [
        ("batch_max_bytes", api.batch_max_bytes.get(), 0),
        (
            "max_record_bytes",
            api.max_record_bytes.get(),
            quire_messages::batch::FRAME_OVERHEAD,
        ),
    ];
    for (key, value, frame) in needs {
        if value.saturating_add(frame + MESSAGE_ROOM) > limit.bytes() {
            return Err(StartupError::MessageRoom {
                key,
                value,
                room: frame + MESSAGE_ROOM,
                limit: limit.to_string(),
            });
        }
    }
    Ok(())
}

/// Refuses a records topic whose `max.message.bytes` (`limit`) is below the
/// record batches the producers build (`sizes`): librdkafka fills one batch
/// per partition with several messages, up to `batch.size` and
/// `message.max.bytes`, and the broker applies the topic's limit to the
/// whole batch, so a batch of messages that each fit would be refused and
/// every request sharing its transaction aborted.
pub fn check_record_batches(
    limit: &MessageLimit,
    sizes: quire_queue::ProducerSizes,
) -> Result<(), StartupError> {
    let cap = sizes.record_batch_cap();
    if cap > limit.bytes() {
        return Err(StartupError::RecordBatches {
            cap,
            limit: limit.to_string(),
        });
    }
    Ok(())
}

/// The endpoint download URLs are signed for, or None when they are off.
fn download_endpoint(settings: &Settings) -> Result<Option<String>, StartupError> {
    let Some(expiry) = settings.api.download_url_expiry else {
        return Ok(None);
    };
    if expiry > MAX_DOWNLOAD_URL_EXPIRY {
        return Err(StartupError::DownloadUrlExpiry(expiry.as_millis()));
    }
    let endpoint = match settings.api.download_url_endpoint.as_deref().map(str::trim) {
        None | Some("") => return Ok(Some(settings.s3.endpoint.clone())),
        Some(endpoint) => endpoint,
    };
    // Credentials in the URL are never echoed.
    let shown = if endpoint.contains('@') {
        "(an endpoint with credentials in it)".to_owned()
    } else {
        endpoint.to_owned()
    };
    let bad = || StartupError::DownloadUrlEndpoint(shown.clone());
    let uri: axum::http::Uri = endpoint.parse().map_err(|_| bad())?;
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let bare = matches!(uri.path(), "" | "/") && uri.query().is_none();
    let host_ok = uri
        .authority()
        .is_some_and(|authority| !authority.host().is_empty() && !authority.as_str().contains('@'));
    if !(scheme_ok && bare && host_ok) {
        return Err(bad());
    }
    Ok(Some(endpoint.trim_end_matches('/').to_owned()))
}

fn control_limits(settings: &Settings) -> ControlLimits {
    let api = &settings.api;
    ControlLimits::new(
        api.control_requests_per_minute_per_stream,
        api.control_requests_per_minute_per_principal,
    )
}

fn connection_limits(settings: &Settings) -> Result<ConnectionLimits, StartupError> {
    let api = &settings.api;
    for (key, zero) in [
        ("header_read_timeout_ms", api.header_read_timeout.is_zero()),
        ("idle_timeout_ms", api.idle_timeout.is_zero()),
    ] {
        if zero {
            return Err(StartupError::ZeroLimit { key });
        }
    }
    Ok(ConnectionLimits {
        header_read_timeout: api.header_read_timeout,
        idle_timeout: api.idle_timeout,
        max_connections: api.max_connections.get(),
    })
}

fn limits(settings: &Settings) -> Result<Limits, StartupError> {
    let api = &settings.api;
    if api.max_in_flight_bytes < api.max_body_bytes {
        return Err(StartupError::InFlightBelowBody {
            in_flight: api.max_in_flight_bytes.get(),
            body: api.max_body_bytes.get(),
        });
    }
    Ok(Limits {
        max_body_bytes: api.max_body_bytes.get(),
        max_record_bytes: api.max_record_bytes.get(),
        max_records_per_request: api.max_records_per_request.get(),
        body_read_timeout: api.body_read_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_tokens(tokens: &[&str]) -> Settings {
        let mut settings = quire_config::defaults();
        settings.api.tokens = tokens
            .iter()
            .map(|name| {
                let digest = hex::encode(quire_config::ApiToken::digest_of(name));
                format!("{name}:{digest}:read+write:*").parse().unwrap()
            })
            .collect();
        settings
    }

    /// Every limit that must be at least 1 is refused at 0, whichever it
    /// is, before anything connects: counts when the settings load (their
    /// types cannot hold 0), durations here.
    #[test]
    fn every_limit_at_zero_is_refused_before_anything_connects() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert!(check(&quire_config::defaults(), loopback).is_ok());
        for key in [
            "max_body_bytes",
            "max_record_bytes",
            "max_records_per_request",
            "max_in_flight_bytes",
            "idempotency_max_keys",
            "max_connections",
            "control_requests_per_minute_per_stream",
            "control_requests_per_minute_per_principal",
            "producers",
        ] {
            let variable = format!("QUIRE_API__{}", key.to_uppercase());
            let error = quire_config::load_with(None, [(variable, "0".to_owned())])
                .err()
                .unwrap_or_else(|| panic!("{key} = 0 was accepted"))
                .to_string();
            assert!(
                error.contains(key) && error.contains("nonzero"),
                "{key}: {error}"
            );
        }
        type ZeroIt = fn(&mut Settings);
        let zeroes: [(&str, ZeroIt); 2] = [
            ("header_read_timeout_ms", |s| {
                s.api.header_read_timeout = Duration::ZERO
            }),
            ("idle_timeout_ms", |s| s.api.idle_timeout = Duration::ZERO),
        ];
        for (name, zero) in zeroes {
            let mut settings = quire_config::defaults();
            zero(&mut settings);
            match check(&settings, loopback) {
                Err(StartupError::ZeroLimit { key }) => assert_eq!(key, name),
                Err(other) => panic!("{name}: {other}"),
                Ok(_) => panic!("{name} = 0 was accepted"),
            }
        }
    }

    #[test]
    fn an_idempotency_ttl_past_the_topics_retention_is_refused() {
        let config = |pairs: &[(&str, &str)]| -> std::collections::BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect()
        };
        let two_days = config(&[("cleanup.policy", "delete"), ("retention.ms", "172800000")]);
        assert!(check_idempotency_ttl(172_800_000, "quire.idempotency", &two_days).is_ok());
        assert!(check_idempotency_ttl(86_400_000, "quire.idempotency", &two_days).is_ok());
        let error = check_idempotency_ttl(172_800_001, "quire.idempotency", &two_days)
            .err()
            .unwrap();
        let message = error.to_string();
        for needle in [
            "api.idempotency_ttl_ms (172800001)",
            "retention.ms = 172800000",
            "quire.idempotency",
        ] {
            assert!(message.contains(needle), "{needle:?} in {message}");
        }
        // Topics that delete nothing by time keep answers forever.
        for forever in [
            config(&[("cleanup.policy", "delete"), ("retention.ms", "-1")]),
            config(&[("cleanup.policy", "compact"), ("retention.ms", "1000")]),
            config(&[]),
        ] {
            assert!(
                check_idempotency_ttl(u64::MAX, "t", &forever).is_ok(),
                "{forever:?}"
            );
        }
        let both = config(&[
            ("cleanup.policy", "compact,delete"),
            ("retention.ms", "1000"),
        ]);
        assert!(check_idempotency_ttl(1001, "t", &both).is_err());
    }

    #[test]
    fn batches_and_the_largest_record_must_fit_the_topic_and_the_client() {
        let topic = |bytes: usize| MessageLimit::Topic {
            topic: "quire.records".into(),
            bytes,
        };
        let mut settings = quire_config::defaults();
        // The defaults fit Kafka's defaults (topic 1048588, client 1000000).
        assert!(check_message_room(&settings, &topic(1_048_588)).is_ok());
        assert!(check_message_room(&settings, &MessageLimit::Client(1_000_000)).is_ok());
        settings.api.max_record_bytes = std::num::NonZero::new(100_000).unwrap();
        let room = MESSAGE_ROOM;
        assert!(check_message_room(&settings, &topic(262_144 + room)).is_ok());
        let error = check_message_room(&settings, &topic(262_144 + room - 1))
            .err()
            .unwrap()
            .to_string();
        for needle in [
            "api.batch_max_bytes (262144)",
            "quire.records",
            "max.message.bytes (263167",
        ] {
            assert!(error.contains(needle), "{needle:?} in {error}");
        }
        // A record past the batch bound goes alone: it and its frame must fit.
        settings.api.batch_max_bytes = std::num::NonZero::new(1000).unwrap();
        let limit = 100_000 + 4 + room;
        assert!(check_message_room(&settings, &topic(limit)).is_ok());
        let error = check_message_room(&settings, &topic(limit - 1))
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("api.max_record_bytes (100000)"), "{error}");
        // The client's limit, from kafka.properties, is checked before
        // anything connects.
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let mut settings = quire_config::defaults();
        settings.api.batch_max_bytes = std::num::NonZero::new(2 * 1024 * 1024).unwrap();
        let error = check(&settings, loopback).err().unwrap().to_string();
        assert!(
            error.contains("api.batch_max_bytes (2097152)")
                && error.contains("message.max.bytes (1000000"),
            "{error}"
        );
        settings
            .kafka
            .properties
            .insert("message_max_bytes".into(), "5000000".into());
        assert!(check(&settings, loopback).is_ok());
        // Several messages go in one record batch, up to batch.size and
        // message.max.bytes: the topic must take that whole batch.
        let sizes = quire_queue::producer_sizes(&quire_config::defaults().kafka).unwrap();
        assert!(check_record_batches(&topic(1_048_588), sizes).is_ok());
        let error = check_record_batches(&topic(999_999), sizes)
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.contains("up to 1000000 bytes") && error.contains("max.message.bytes (999999"),
            "{error}"
        );
        settings
            .kafka
            .properties
            .insert("message_max_bytes".into(), "lots".into());
        let error = check(&settings, loopback).err().unwrap().to_string();
        assert!(error.contains("message.max.bytes"), "{error}");
    }

    #[test]
    fn without_tokens_only_loopback_is_served_unless_said_on_purpose() {
        let everywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let error = authentication(&with_tokens(&[]), everywhere).err().unwrap();
        assert!(matches!(error, StartupError::Unauthenticated { .. }));
        assert!(
            error.to_string().contains("api.allow_unauthenticated"),
            "{error}"
        );
        assert!(
            !authentication(&with_tokens(&[]), loopback)
                .unwrap()
                .enabled()
        );
        assert!(
            authentication(&with_tokens(&["t"]), everywhere)
                .unwrap()
                .enabled()
        );
        let mut open_on_purpose = with_tokens(&[]);
        open_on_purpose.api.allow_unauthenticated = true;
        assert!(
            !authentication(&open_on_purpose, everywhere)
                .unwrap()
                .enabled()
        );
    }

    #[test]
    fn download_urls_are_off_at_0_and_bounded_to_7_days_on_a_bare_endpoint() {
        let mut settings = quire_config::defaults();
        assert_eq!(
            download_endpoint(&settings).unwrap().as_deref(),
            Some(settings.s3.endpoint.as_str()),
            "on by default, signed for s3.endpoint"
        );
        settings.api.download_url_expiry = None;
        assert!(download_endpoint(&settings).unwrap().is_none());
        settings.api.download_url_expiry = Some(Duration::from_secs(7 * 24 * 3600));
        assert!(download_endpoint(&settings).unwrap().is_some());
        settings.api.download_url_expiry = Some(Duration::from_secs(7 * 24 * 3600 + 1));
        let error = download_endpoint(&settings).err().unwrap();
        assert!(error.to_string().contains("7 days"), "{error}");

        settings.api.download_url_expiry = Some(Duration::from_secs(60));
        settings.api.download_url_endpoint = Some("https://s3.example.com:9000/".into());
        assert_eq!(
            download_endpoint(&settings).unwrap().as_deref(),
            Some("https://s3.example.com:9000")
        );
        for bad in [
            "s3.example.com",
            "ftp://s3.example.com",
            "https://s3.example.com/bucket",
            "https://s3.example.com/?x=1",
            "https://user:secret@s3.example.com",
            "not a url",
        ] {
            settings.api.download_url_endpoint = Some(bad.into());
            let error = download_endpoint(&settings).err().unwrap();
            assert!(
                matches!(error, StartupError::DownloadUrlEndpoint(_)),
                "{bad}: {error}"
            );
            assert!(!error.to_string().contains("secret"), "{error}");
        }
    }

    #[test]
    fn two_tokens_with_one_name_or_one_digest_are_an_error() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let mut settings = with_tokens(&["a", "b"]);
        assert!(authentication(&settings, loopback).is_ok());
        settings.api.tokens[1].name = "a".into();
        let error = authentication(&settings, loopback).err().unwrap();
        assert!(
            matches!(error, StartupError::DuplicateToken { .. }),
            "{error}"
        );
        let mut settings = with_tokens(&["a", "b"]);
        settings.api.tokens[1].sha256 = settings.api.tokens[0].sha256;
        let error = authentication(&settings, loopback).err().unwrap();
        assert!(
            matches!(error, StartupError::DuplicateToken { .. }),
            "{error}"
        );
    }
}

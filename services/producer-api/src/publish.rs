//! Publishing to the records topic: a few transactional producers, each
//! behind an [`ArrayEnqueuer`] (group commit), requests spread over them.
//!
//! One request's messages always go through one `enqueue_array` call: one
//! transaction, possibly shared with other requests' arrays, all visible or
//! none. Concurrent requests share transactions, so throughput does not
//! collapse to one transaction round trip per request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use quire_config::{ApiSettings, KafkaSettings};
use quire_messages::{CURRENT_VERSION, HEADER_KIND, HEADER_VERSION, MessageKind, StreamName};
use quire_queue::{
    ArrayEnqueuer, GroupCommitLimits, MessageId, OutMessage, QueueError, TransactionalProducer,
};
use serde_json::value::RawValue;

struct Slot {
    transactional_id: String,
    enqueuer: ArrayEnqueuer,
    /// Set when the producer reported a fatal error (fenced): it is skipped,
    /// and readiness reports it.
    fatal: AtomicBool,
}

pub struct Publisher {
    slots: Vec<Slot>,
    next: AtomicUsize,
}

/// Builds the messages of the records topic.
#[derive(Debug, Clone)]
pub struct RecordsTopic {
    topic: String,
    version_header: Vec<u8>,
}

/// `{transactional_id_prefix}-{replica_id}-{n}`: stable per replica, so a
/// restarted replica fences its predecessor's producers.
pub fn transactional_ids(api: &ApiSettings) -> Vec<String> {
    (0..api.producers.max(1))
        .map(|index| format!("{}-{}-{index}", api.transactional_id_prefix, api.replica_id))
        .collect()
}

impl Publisher {
    /// Connects the producers (initialising their transactions fences any
    /// older instance with the same ids) and starts their group commit.
    pub async fn connect(kafka: &KafkaSettings, api: &ApiSettings) -> Result<Self, QueueError> {
        let ids = transactional_ids(api);
        let producers = futures::future::try_join_all(
            ids.iter()
                .map(|transactional_id| TransactionalProducer::connect(kafka, transactional_id)),
        )
        .await?;
        let limits = GroupCommitLimits {
            // A request's array always goes whole; let a group hold several.
            max_messages: GroupCommitLimits::default()
                .max_messages
                .max(api.max_records_per_request),
            max_bytes: GroupCommitLimits::default()
                .max_bytes
                .max(api.max_body_bytes),
            ..GroupCommitLimits::default()
        };
        let slots = producers
            .into_iter()
            .zip(ids)
            .map(|(producer, transactional_id)| Slot {
                transactional_id,
                enqueuer: ArrayEnqueuer::start(producer, limits),
                fatal: AtomicBool::new(false),
            })
            .collect();
        Ok(Publisher {
            slots,
            next: AtomicUsize::new(0),
        })
    }

    /// Publishes `messages` atomically; one id per message, in order.
    pub async fn publish(&self, messages: Vec<OutMessage>) -> Result<Vec<MessageId>, QueueError> {
        let slot = self.pick();
        let outcome = slot.enqueuer.enqueue_array(messages).await;
        if let Err(QueueError::ProducerFatal(_)) = &outcome
            && !slot.fatal.swap(true, Ordering::AcqRel)
        {
            tracing::error!(
                transactional_id = %slot.transactional_id,
                "producer is fenced or unusable; another replica may use the same api.replica_id"
            );
        }
        outcome
    }

    /// Round robin over the producers still alive (all of them if none is).
    fn pick(&self) -> &Slot {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let count = self.slots.len();
        (0..count)
            .map(|step| &self.slots[(start + step) % count])
            .find(|slot| !slot.fatal.load(Ordering::Acquire))
            .unwrap_or(&self.slots[start % count])
    }

    /// Transactional ids of producers that are fenced or unusable.
    pub fn unusable_producers(&self) -> Vec<&str> {
        self.slots
            .iter()
            .filter(|slot| slot.fatal.load(Ordering::Acquire))
            .map(|slot| slot.transactional_id.as_str())
            .collect()
    }
}

impl RecordsTopic {
    pub fn new(topic: &str) -> Self {
        RecordsTopic {
            topic: topic.to_owned(),
            version_header: CURRENT_VERSION.to_string().into_bytes(),
        }
    }

    /// A record: its exact JSON text, keyed by its stream.
    pub fn record_message(&self, stream: &StreamName, record: &RawValue) -> OutMessage {
        self.message(
            MessageKind::Record,
            stream,
            record.get().as_bytes().to_vec(),
        )
    }

    /// A control message (cut marker, definition) on the stream's key, so it
    /// lands in order with the stream's records.
    pub fn control_message(
        &self,
        kind: MessageKind,
        stream: &StreamName,
        body: Vec<u8>,
    ) -> OutMessage {
        debug_assert_ne!(kind, MessageKind::Record);
        self.message(kind, stream, body)
    }

    fn message(&self, kind: MessageKind, stream: &StreamName, payload: Vec<u8>) -> OutMessage {
        OutMessage {
            topic: self.topic.clone(),
            key: Some(stream.as_str().as_bytes().to_vec()),
            payload,
            headers: vec![
                (HEADER_KIND.to_owned(), kind.as_header().as_bytes().to_vec()),
                (HEADER_VERSION.to_owned(), self.version_header.clone()),
            ],
            partition: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_its_exact_text_keyed_by_stream_with_kind_and_version() {
        let topic = RecordsTopic::new("quire.records");
        let stream = StreamName::new("orders").unwrap();
        let record: &RawValue = serde_json::from_str(r#"{"n": 1.50}"#).unwrap();
        let message = topic.record_message(&stream, record);
        assert_eq!(message.topic, "quire.records");
        assert_eq!(message.key.as_deref(), Some(&b"orders"[..]));
        assert_eq!(message.payload, br#"{"n": 1.50}"#);
        assert_eq!(
            message.headers,
            [
                ("quire-kind".to_owned(), b"record".to_vec()),
                ("quire-v".to_owned(), b"1".to_vec())
            ]
        );
        assert_eq!(message.partition, None);
        let cut = topic.control_message(MessageKind::Cut, &stream, b"{}".to_vec());
        assert_eq!(cut.headers[0], ("quire-kind".to_owned(), b"cut".to_vec()));
        assert_eq!(cut.key.as_deref(), Some(&b"orders"[..]));
    }

    #[test]
    fn transactional_ids_are_prefix_replica_and_index() {
        let mut api = quire_config::defaults().api;
        api.transactional_id_prefix = "quire-api".into();
        api.replica_id = "api-2".into();
        api.producers = 3;
        assert_eq!(
            transactional_ids(&api),
            [
                "quire-api-api-2-0",
                "quire-api-api-2-1",
                "quire-api-api-2-2"
            ]
        );
        api.producers = 0;
        assert_eq!(transactional_ids(&api), ["quire-api-api-2-0"]);
    }
}

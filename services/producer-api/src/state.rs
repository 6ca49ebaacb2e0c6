//! What every handler shares.

use std::sync::Arc;

use quire_queue::{MessageId, OutMessage, QueueError};

use crate::admission::InFlightBytes;
use crate::idempotency::IdempotencyStore;
use crate::kafka_health::KafkaHealth;
use crate::log_reader::LogReader;
use crate::metrics::Metrics;
use crate::publish::{Publisher, RecordsTopic};
use crate::storage::Storage;
use crate::validation::Limits;

/// The API's connections and settings, built once at start-up.
pub struct Services {
    pub limits: Limits,
    pub records_topic: RecordsTopic,
    pub publisher: Publisher,
    pub storage: Storage,
    pub log: Arc<LogReader>,
    pub metrics: Arc<Metrics>,
    /// `api.max_in_flight_bytes`.
    pub in_flight_bytes: Arc<InFlightBytes>,
    /// Answers remembered by `Idempotency-Key`.
    pub idempotency: Arc<IdempotencyStore>,
    /// The background Kafka check's verdict.
    pub kafka_health: Arc<KafkaHealth>,
    /// Whether bearer tokens are checked (keys are then scoped per token).
    pub tokens_enabled: bool,
    /// `api.replica_id`, named when a producer is fenced.
    pub replica_id: String,
}

impl Services {
    /// Publishes `messages` in one transaction (shared with other requests
    /// by group commit). A commit whose outcome is unknown (Kafka failed in
    /// the middle of it) is settled by reading the log where the messages
    /// were written, once the transaction has ended: committed is answered
    /// as committed, aborted as aborted (503: nothing was published, retry);
    /// only what cannot be settled stays "outcome unknown" (500).
    pub async fn publish(&self, messages: Vec<OutMessage>) -> Result<Vec<MessageId>, QueueError> {
        let key = messages.first().and_then(|message| message.key.clone());
        match self.publisher.publish(messages).await {
            Err(QueueError::CommitOutcomeUnknown { source, ids }) => {
                let (Some(key), Some(&first)) = (key, ids.first()) else {
                    return Err(QueueError::CommitOutcomeUnknown { source, ids });
                };
                match self.log.settle(&key, first).await {
                    Ok(true) => {
                        tracing::info!(
                            partition = first.partition,
                            offset = first.offset,
                            "commit outcome settled from the log: committed"
                        );
                        Ok(ids)
                    }
                    Ok(false) => {
                        tracing::info!(
                            partition = first.partition,
                            offset = first.offset,
                            "commit outcome settled from the log: aborted"
                        );
                        Err(QueueError::TransactionAborted(source))
                    }
                    Err(error) => {
                        tracing::warn!(error = %error, "commit outcome could not be settled from the log");
                        Err(QueueError::CommitOutcomeUnknown { source, ids })
                    }
                }
            }
            outcome => outcome,
        }
    }
}

pub type AppState = Arc<Services>;

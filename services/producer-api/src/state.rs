//! What every handler shares.

use std::sync::Arc;

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

pub type AppState = Arc<Services>;

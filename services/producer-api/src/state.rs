//! What every handler shares.

use std::sync::Arc;

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
    pub log: LogReader,
    pub metrics: Arc<Metrics>,
    /// `api.replica_id`, named when a producer is fenced.
    pub replica_id: String,
}

pub type AppState = Arc<Services>;

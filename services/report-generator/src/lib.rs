//! quire's report generator: record arrays from Kafka into XML reports on S3,
//! exactly once. See ARCHITECTURE.md for the loop and its invariants.

mod document;
mod error;
mod partition;
mod watermarks;
mod worker;

pub use error::WorkerError;
pub use worker::{Mode, RunSummary, Worker};

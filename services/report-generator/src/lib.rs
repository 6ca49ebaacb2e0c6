//! quire's report generator: record arrays from Kafka into XML reports on S3,
//! exactly once. See ARCHITECTURE.md for the loop and its invariants.
//!
//! - `application.rs`: the report generator as a value (`Application::build`
//!   binds its monitoring port, `run_until(shutdown)` runs it);
//! - `worker.rs`: one session of the loop, read -> apply -> commit (its
//!   Kafka clients, its S3 handle; `worker/session.rs`, `worker/timed.rs`,
//!   `worker/outbox.rs`);
//! - `pipeline.rs`: one assigned partition, applying `decide.rs`'s pure
//!   decisions about each message to its documents (`document.rs`) and its
//!   state (`partition.rs`);
//! - `supervisor.rs`: runs sessions, rebuilding one after a Kafka or S3
//!   failure, exiting on errors a restart cannot cure;
//! - `monitoring.rs` and `metrics.rs`: `/metrics`, `/healthz`, `/readyz`;
//! - `stuck.rs`: partitions held back by a hanging transaction;
//! - `topics.rs`: a recreated or grown topic noticed while a session runs.

mod application;
mod decide;
mod document;
mod error;
mod metrics;
mod monitoring;
mod partition;
mod pipeline;
mod stuck;
pub mod supervisor;
mod topics;
mod watermarks;
mod worker;

pub use application::Application;
pub use error::{Recovery, WorkerError};
pub use metrics::WorkerMetrics;
pub use monitoring::{Monitor, SessionState, WorkerHealth};
pub use worker::{Mode, RunSummary, Worker};

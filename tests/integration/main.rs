//! Integration tests against the real Kafka broker and S3 server of the local
//! stack (`deploy/local/stack up`). One test binary; one module per feature.

mod api;
mod backlog;
mod batches;
mod brownout;
mod checksums;
mod compose;
mod dashboard;
mod dead_letters;
mod documents;
mod faults;
mod fencing;
mod growth;
mod hanging;
mod keep_alive;
mod layering;
mod memory;
mod operator;
mod pipeline;
mod queue;
mod rebalance;
mod recreate;
mod reports;
mod soak;
mod spill;
mod stream_space;
mod three_brokers;
mod windows;
mod worker_ops;
mod writer;

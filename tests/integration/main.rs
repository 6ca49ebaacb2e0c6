//! Integration tests against the real Kafka broker and S3 server of the local
//! stack (`deploy/local/stack up`). One test binary; one module per feature.

mod compose;
mod pipeline;
mod queue;
mod writer;

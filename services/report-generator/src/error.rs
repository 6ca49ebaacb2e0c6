use quire_queue::QueueError;
use quire_s3::WriterError;

/// What stops the worker. Records that cannot be rendered are not errors:
/// they go to the dead-letter topic and the stream goes on.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Queue(#[from] QueueError),

    #[error("s3 upload failed: {0}")]
    Writer(#[from] WriterError),

    #[error("s3 request failed: {0}")]
    S3(String),

    #[error("kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),

    #[error(
        "watermark partition {partition} still has an open transaction after {waited_ms} ms; is another worker stuck?"
    )]
    WatermarksUnstable { partition: i32, waited_ms: u128 },

    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

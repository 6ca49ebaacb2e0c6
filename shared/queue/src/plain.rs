//! Writes outside any transaction.
//!
//! Everything quire publishes goes out in transactions, but for one kind of
//! message: the partition layout (quire-log), which every API replica must
//! see within seconds. Its readers read it uncommitted, so that a
//! transaction left open on the same partition (a crashed worker's, for up
//! to `kafka.transaction_timeout_ms`) cannot hide it; a message written
//! outside any transaction is never aborted, so reading it uncommitted
//! reads only what was written.

use std::time::Duration;

use quire_config::KafkaSettings;
use rdkafka::producer::{FutureProducer, Producer};

use crate::client::plain_producer_config;
use crate::producer::future_record;
use crate::{MessageId, OutMessage, QueueError};

/// Sends `messages` with an idempotent producer (`acks=all`) and waits for
/// every acknowledgement, at most `kafka.request_timeout_ms`.
pub async fn send_acknowledged(
    settings: &KafkaSettings,
    messages: &[OutMessage],
) -> Result<Vec<MessageId>, QueueError> {
    let producer: FutureProducer = plain_producer_config(settings)?
        .create()
        .map_err(QueueError::client)?;
    let timeout = settings.request_timeout.max(Duration::from_millis(1));
    let mut ids = Vec::with_capacity(messages.len());
    for message in messages {
        let delivered = producer
            .send(future_record(message), timeout)
            .await
            .map_err(|(error, _)| {
                QueueError::Admin(format!("sending to {}: {error}", message.topic))
            })?;
        ids.push(MessageId {
            partition: delivered.partition,
            offset: delivered.offset,
        });
    }
    // Dropping a producer flushes on the caller's thread: nothing is left
    // to flush, every delivery was awaited.
    let _ = producer.flush(Duration::ZERO);
    Ok(ids)
}

use rdkafka::error::KafkaError;

use crate::MessageId;

/// Everything the array queue can fail with. Cloneable, because a failed
/// group-commit transaction hands the same error to every caller in it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QueueError {
    #[error(
        "kafka property `{key}` is set by quire and cannot be overridden ({reason}); remove it from kafka.properties"
    )]
    ProtectedProperty { key: String, reason: &'static str },

    #[error("kafka client could not be created: {0}")]
    Client(KafkaError),

    #[error("kafka transaction failed and was aborted: nothing of it is visible: {0}")]
    TransactionAborted(KafkaError),

    #[error(
        "kafka transaction refused by the consumer group (its generation moved: a rebalance, or this member was fenced or timed out) and aborted: nothing of it is visible: {0}"
    )]
    GroupRefused(KafkaError),

    /// Fenced by a newer instance of its transactional id, or unusable for
    /// another reason (an abort that did not finish, an authorization the
    /// broker refuses): [`QueueError::is_fencing`] tells which.
    #[error("kafka producer hit a fatal error and must be recreated: {0}")]
    ProducerFatal(KafkaError),

    #[error(
        "the kafka transaction's commit was asked for but did not finish: it may or may not be committed (look before sending it again): {source}"
    )]
    CommitOutcomeUnknown {
        source: KafkaError,
        /// Where the caller's messages were written, in order, when every
        /// delivery report said so (else empty): reading the log at one of
        /// them, with read_committed, once the transaction has ended, tells
        /// whether it was committed.
        ids: Vec<MessageId>,
    },

    #[error("kafka consumer error: {0}")]
    Consume(KafkaError),

    #[error(
        "committed offset of {topic}[{partition}] is out of range (deleted by retention?); refusing to jump silently"
    )]
    OffsetOutOfRange { topic: String, partition: i32 },

    #[error("kafka offset commit failed: {0}")]
    Commit(KafkaError),

    #[error(
        "kafka offset commit refused by the consumer group (a rebalance is under way, or this member was fenced or timed out): read the next array and commit this one again; partitions revoked meanwhile go to their next owner from the last committed offset: {0}"
    )]
    CommitRefused(KafkaError),

    #[error("kafka admin operation failed: {0}")]
    Admin(String),

    #[error("topic check failed: {0}")]
    TopicMismatch(String),

    #[error("the group-commit task has stopped")]
    EnqueuerStopped,

    #[error("blocking kafka task panicked or was cancelled: {0}")]
    Join(String),

    #[error("{0}")]
    Read(#[from] crate::ReadError),

    #[error("cannot start a kafka client's thread: {0}")]
    Thread(String),
}

impl QueueError {
    /// Whether the producer was fenced: another producer with the same
    /// transactional id started (`init_transactions` bumped the epoch), so
    /// the broker answers this one PRODUCER_FENCED or INVALID_PRODUCER_EPOCH
    /// (librdkafka reports both as its own `_FENCED`). Told by the librdkafka
    /// error code, wherever the fencing surfaced: a fatal error, or a commit
    /// whose outcome it left unknown. Other fatal errors (a producer marked
    /// unusable after an abort that did not finish, an authorization
    /// refused) are not fencings.
    pub fn is_fencing(&self) -> bool {
        match self {
            QueueError::ProducerFatal(error) => is_fencing_error(error),
            QueueError::CommitOutcomeUnknown { source, .. } => is_fencing_error(source),
            _ => false,
        }
    }

    /// A client that could not be created. librdkafka's configuration
    /// error quotes the refused value; a secret property's value (a SASL
    /// or SSL password, a key) is replaced by `[redacted]` before the error
    /// can reach a log.
    pub fn client(error: KafkaError) -> Self {
        QueueError::Client(match error {
            KafkaError::ClientConfig(result, description, key, _value)
                if quire_config::is_secret_property(&key) =>
            {
                KafkaError::ClientConfig(result, description, key, "[redacted]".to_owned())
            }
            other => other,
        })
    }
}

impl From<tokio::task::JoinError> for QueueError {
    fn from(error: tokio::task::JoinError) -> Self {
        QueueError::Join(error.to_string())
    }
}

/// Whether librdkafka's error says a newer producer with the same
/// transactional id fenced this one.
pub fn is_fencing_error(error: &KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode;
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
        )
    )
}

/// Errors librdkafka recovers from by itself (broker restarts, leader
/// moves). A client polled after the brokers came back may still hand out
/// such an error event queued while they were away: a stale event, not a
/// verdict on the broker now.
pub fn is_transient(error: &KafkaError) -> bool {
    use rdkafka::error::RDKafkaErrorCode;
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::Resolve
        )
    )
}

#[cfg(test)]
mod fencing_tests {
    use rdkafka::error::RDKafkaErrorCode;

    use super::*;

    #[test]
    fn only_a_fencing_code_is_a_fencing() {
        for code in [
            RDKafkaErrorCode::Fenced,
            RDKafkaErrorCode::ProducerFenced,
            RDKafkaErrorCode::InvalidProducerEpoch,
        ] {
            assert!(QueueError::ProducerFatal(KafkaError::MessageProduction(code)).is_fencing());
            assert!(
                QueueError::CommitOutcomeUnknown {
                    source: KafkaError::Flush(code),
                    ids: Vec::new(),
                }
                .is_fencing()
            );
            // Not fatal, not ours to count.
            assert!(!QueueError::TransactionAborted(KafkaError::Flush(code)).is_fencing());
        }
        for code in [
            // A producer marked unusable by quire (an abort that did not
            // finish): librdkafka holds no fatal error of its own.
            RDKafkaErrorCode::Fatal,
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
            RDKafkaErrorCode::ClusterAuthorizationFailed,
            RDKafkaErrorCode::InvalidTransactionalState,
            RDKafkaErrorCode::FencedLeaderEpoch,
            RDKafkaErrorCode::OperationTimedOut,
        ] {
            assert!(
                !QueueError::ProducerFatal(KafkaError::MessageProduction(code)).is_fencing(),
                "{code:?}"
            );
        }
        assert!(
            !QueueError::CommitOutcomeUnknown {
                source: KafkaError::Canceled,
                ids: Vec::new(),
            }
            .is_fencing()
        );
    }
}

#[cfg(test)]
mod redaction_tests {
    use rdkafka::types::RDKafkaConfRes;

    use super::*;

    #[test]
    fn a_refused_secret_property_is_not_quoted() {
        let refused = |key: &str, value: &str| {
            QueueError::client(KafkaError::ClientConfig(
                RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
                "Invalid value".to_owned(),
                key.to_owned(),
                value.to_owned(),
            ))
            .to_string()
        };
        let text = refused("sasl.password", "hunter2");
        assert!(
            !text.contains("hunter2") && text.contains("[redacted]"),
            "{text}"
        );
        let text = refused("linger.ms", "soon");
        assert!(text.contains("soon"), "{text}");
    }
}

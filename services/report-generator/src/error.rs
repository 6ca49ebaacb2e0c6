use quire_queue::KafkaError;
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
    Kafka(#[from] KafkaError),

    #[error(transparent)]
    Read(#[from] quire_queue::ReadError),

    #[error(
        "watermark partition {partition} still has an open transaction after {waited_ms} ms; is another worker stuck?"
    )]
    WatermarksUnstable { partition: i32, waited_ms: u128 },

    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),

    /// A topic was deleted and created again, or the watermark topic grew,
    /// while the session ran: a new session starts from what Kafka and
    /// the bucket say now.
    #[error("the topics changed under the session: {0}")]
    LogChanged(String),

    #[error(transparent)]
    Log(#[from] quire_log::LogError),

    #[error(
        "this worker was fenced {fenced} times in a row: another process is running with worker.replica_id = {replica_id:?} (the replica id makes the transactional id and the static group member id); give every replica its own worker.replica_id"
    )]
    ReplicaIdInUse { replica_id: String, fenced: u32 },
}

/// What the supervisor does about an error that ended a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Kafka or S3 failed in a way a new session may not meet again (a
    /// fenced or failed transaction, a broker away, S3 failing after the
    /// writer's retries): rebuild the clients and resume from the last
    /// committed transaction.
    Restart,
    /// Restarting would meet the same error (configuration, topics that are
    /// not what the design needs, offsets deleted by retention, a bug): exit
    /// non-zero so an operator sees it.
    Exit,
}

impl WorkerError {
    /// Whether a new session may cure this error.
    pub fn recovery(&self) -> Recovery {
        let permanent = match self {
            WorkerError::Queue(error) => queue_error_is_permanent(error),
            // An invalid policy comes from the configuration. Nothing that
            // data can cause exits: documents end before they would pass
            // their declared maximum (inline rollovers), so an
            // ObjectTooLarge would be a bug that a new session, which
            // renders from the log again, may well not meet.
            WorkerError::Writer(error) => matches!(error, WriterError::InvalidPolicy { .. }),
            WorkerError::S3(_) | WorkerError::WatermarksUnstable { .. } | WorkerError::Read(_) => {
                false
            }
            WorkerError::Kafka(error) => kafka_client_error_is_permanent(error),
            WorkerError::Config(_) => true,
            WorkerError::LogChanged(_) => false,
            // Topics and a recorded layout that disagree need an operator;
            // Kafka or S3 away does not.
            WorkerError::Log(error) => matches!(error, quire_log::LogError::Layout(_)),
            // A panic is a bug; a cancelled task only happens at shutdown.
            WorkerError::Join(error) => error.is_panic(),
            // Another process holds the same identity: an operator's error.
            WorkerError::ReplicaIdInUse { .. } => true,
        };
        if permanent {
            Recovery::Exit
        } else {
            Recovery::Restart
        }
    }

    /// A short name of the failing side, for logs: `kafka`, `s3`, `config`...
    pub fn cause(&self) -> &'static str {
        match self {
            WorkerError::Queue(error) if error.is_fencing() => "kafka-fenced",
            WorkerError::Queue(QueueError::ProducerFatal(_)) => "kafka-producer-fatal",
            WorkerError::Queue(QueueError::TransactionAborted(_)) => "kafka-transaction",
            WorkerError::Queue(QueueError::OffsetOutOfRange { .. }) => "offset-out-of-range",
            WorkerError::Queue(
                QueueError::TopicMismatch(_) | QueueError::ProtectedProperty { .. },
            )
            | WorkerError::Config(_) => "config",
            WorkerError::Queue(_) | WorkerError::Kafka(_) | WorkerError::Read(_) => "kafka",
            WorkerError::WatermarksUnstable { .. } => "watermarks-unstable",
            WorkerError::Writer(_) | WorkerError::S3(_) => "s3",
            WorkerError::Join(_) => "task",
            WorkerError::LogChanged(_) => "topics-changed",
            WorkerError::Log(quire_log::LogError::Layout(_)) => "config",
            WorkerError::Log(quire_log::LogError::S3(_)) => "s3",
            WorkerError::Log(_) => "kafka",
            WorkerError::ReplicaIdInUse { .. } => "config",
        }
    }
}

fn queue_error_is_permanent(error: &QueueError) -> bool {
    match error {
        QueueError::ProtectedProperty { .. }
        | QueueError::TopicMismatch(_)
        | QueueError::OffsetOutOfRange { .. } => true,
        // Creating a client fails on a bad property; the same variant carries
        // init_transactions and metadata failures, which a broker that comes
        // back cures.
        QueueError::Client(error) => kafka_client_error_is_permanent(error),
        // Failed, fenced or unknown transactions, consumer and commit errors,
        // admin requests: a new session (new producer epoch, offsets read
        // back from the group) starts from what is known to be committed.
        _ => false,
    }
}

/// A configuration librdkafka refuses, or a subscription it cannot make,
/// fails the same way every time.
fn kafka_client_error_is_permanent(error: &KafkaError) -> bool {
    matches!(
        error,
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) | KafkaError::Subscription(_)
    )
}

#[cfg(test)]
mod tests {
    use quire_queue::RDKafkaErrorCode;

    use super::*;

    fn s3_failure() -> WriterError {
        WriterError::S3 {
            operation: "UploadPart",
            bucket: "b".into(),
            key: "reports/s/00001-00000000000000000001.xml".into(),
            attempts: 5,
            status: Some(503),
            retryable: true,
            detail: "service unavailable".into(),
        }
    }

    #[test]
    fn kafka_and_s3_failures_restart_the_session() {
        let restartable = [
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                RDKafkaErrorCode::Fatal,
            ))),
            WorkerError::Queue(QueueError::TransactionAborted(KafkaError::Flush(
                RDKafkaErrorCode::OperationTimedOut,
            ))),
            WorkerError::Queue(QueueError::Consume(KafkaError::MessageConsumption(
                RDKafkaErrorCode::AllBrokersDown,
            ))),
            // check_topics' metadata request while the broker is away.
            WorkerError::Queue(QueueError::Client(KafkaError::MetadataFetch(
                RDKafkaErrorCode::OperationTimedOut,
            ))),
            WorkerError::Kafka(KafkaError::MetadataFetch(
                RDKafkaErrorCode::OperationTimedOut,
            )),
            WorkerError::WatermarksUnstable {
                partition: 3,
                waited_ms: 25_000,
            },
            WorkerError::Writer(s3_failure()),
            WorkerError::S3("writing manifest manifests/a~0-1.json: timeout".into()),
        ];
        for error in restartable {
            assert_eq!(error.recovery(), Recovery::Restart, "{error}");
        }
    }

    #[test]
    fn what_a_restart_cannot_cure_exits() {
        let permanent = [
            WorkerError::Config("worker.replica_id must not be empty".into()),
            WorkerError::Queue(QueueError::TopicMismatch(
                "topic quire.records has 6 partitions, expected 12".into(),
            )),
            WorkerError::Queue(QueueError::OffsetOutOfRange {
                topic: "quire.records".into(),
                partition: 4,
            }),
            WorkerError::Queue(QueueError::ProtectedProperty {
                key: "isolation.level".into(),
                reason: "consumers read only committed transactions",
            }),
            WorkerError::Queue(QueueError::Client(KafkaError::ClientCreation(
                "invalid value for sasl.mechanism".into(),
            ))),
            WorkerError::Kafka(KafkaError::ClientCreation("bad property".into())),
            WorkerError::Writer(WriterError::InvalidPolicy {
                reason: "max_in_flight must be at least 1".into(),
            }),
        ];
        for error in permanent {
            assert_eq!(error.recovery(), Recovery::Exit, "{error}");
        }
    }

    #[test]
    fn nothing_data_can_cause_exits() {
        // A stream's volume, a backlog or a record: never "exit", which is
        // for configuration and operator errors.
        let data_driven = [
            WorkerError::Writer(WriterError::ObjectTooLarge {
                bucket: "b".into(),
                key: "k".into(),
                declared_maximum: 10,
                attempted_size: 11,
            }),
            // A dead letter or an event the broker refuses as too large.
            WorkerError::Queue(QueueError::TransactionAborted(
                KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
            )),
            WorkerError::S3("gzip compression of k failed: out of memory".into()),
        ];
        for error in data_driven {
            assert_eq!(error.recovery(), Recovery::Restart, "{error}");
        }
    }

    #[test]
    fn the_cause_names_the_failing_side() {
        assert_eq!(WorkerError::Writer(s3_failure()).cause(), "s3");
        assert_eq!(
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                RDKafkaErrorCode::Fenced
            )))
            .cause(),
            "kafka-fenced"
        );
        assert_eq!(
            WorkerError::Queue(QueueError::CommitOutcomeUnknown {
                source: KafkaError::Flush(RDKafkaErrorCode::ProducerFenced),
                ids: Vec::new(),
            })
            .cause(),
            "kafka-fenced"
        );
        // Fatal, but nobody took the transactional id: named as what it is.
        assert_eq!(
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                RDKafkaErrorCode::Fatal
            )))
            .cause(),
            "kafka-producer-fatal"
        );
        assert_eq!(
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::Canceled)).cause(),
            "kafka-producer-fatal"
        );
        assert_eq!(
            WorkerError::Queue(QueueError::TopicMismatch("x".into())).cause(),
            "config"
        );
    }
}

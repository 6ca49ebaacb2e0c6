//! The array queue: the seed's ENQUEUE_ARRAY / DEQUEUE_ARRAY, done on Kafka.
//!
//! - [`TransactionalProducer::transact`] publishes an array of messages in one
//!   Kafka transaction (idempotent, `acks=all`) and returns one [`MessageId`]
//!   per message, in order. [`ArrayEnqueuer`] lets several callers' arrays
//!   share one transaction (group commit): all of them are visible or none.
//! - [`ArrayConsumer::next_array`] returns up to `max` committed messages,
//!   waiting at most `max_wait`, across every assigned partition.
//! - One commit per array: [`ArrayConsumer::commit`] (after the last message
//!   of each partition), [`ArrayConsumer::commit_offsets`] (explicit offsets)
//!   and [`ArrayConsumer::commit_in_transaction`] (offsets inside a producer
//!   transaction with the group metadata, so a fenced or stale member cannot
//!   commit).
//! - [`ArrayConsumer::keep_alive`] keeps a member in its group while it works
//!   on an array for longer than `max.poll.interval.ms`.
//!
//! Array does not imply bulk unless it is bulk underneath: librdkafka batches
//! produce requests and prefetches fetches, one transaction ends per array and
//! one offset commit is sent per array. Nothing here does a round trip per
//! message. Every blocking librdkafka call runs on tokio's blocking pool,
//! never on an async worker thread.

mod admin;
mod client;
mod consumer;
mod context;
mod describe;
mod error;
mod group_commit;
mod keep_alive;
mod message;
mod plain;
mod producer;
mod reader;
mod tail;

pub use admin::{
    DEFAULT_PARTITIONS, IDEMPOTENCY_RETENTION_MS, TopicSpec, WATERMARK_COMPACTION, check_topics,
    delete_topics, design_topics, ensure_topics, grow_topic, topic_config,
};
pub use client::{PROTECTED_PROPERTIES, ProducerSizes, producer_sizes};
pub use consumer::{
    Array, ArrayBounds, ArrayConsumer, ArrayEnd, CommitOutcome, ConsumerOptions, DrainExit,
    DrainSummary, TransactionOutcome, owned_headers,
};
pub use context::{PartitionProgress, RebalanceEvent};
pub use describe::{TopicIdentity, describe_topic, describe_topic_blocking, partition_for_key};
pub use error::{QueueError, is_fencing_error, is_transient};
pub use group_commit::{ArrayEnqueuer, GroupCommitLimits, TransactionObserver, TransactionReport};
pub use keep_alive::KeepAlive;
pub use message::{InMessage, MessageId, OutMessage};
pub use plain::send_acknowledged;
pub use producer::{
    Followers, ProducerOptions, ProducerStatistics, Release, TransactionalProducer,
};
pub use reader::{PartitionReader, ReadError, ReaderOptions};
pub use tail::TopicTail;

/// Re-exported so callers can read librdkafka's statistics, and match the
/// errors inside [`QueueError`], without depending on rdkafka themselves:
/// only quire-queue links it.
pub use rdkafka::error::{KafkaError, RDKafkaErrorCode};
pub use rdkafka::statistics::Statistics;

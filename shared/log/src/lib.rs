//! The records log: which log quire is on, and which partition each stream
//! of it is on.
//!
//! - [`identity`]: the records topic's Kafka topic id, and the first log
//!   quire ran on under its name (the bucket's `logs/{topic}.json`), hence
//!   the [`LogTag`](quire_messages::LogTag) of report ids and keys of every
//!   later log. A watermark, a report id or a manifest of another log never
//!   applies to this one.
//! - [`layout`]: the partition layout quire routes streams by (recorded on
//!   partition 0 of the watermark topic), resolved at start-up, followed by
//!   the API, and the stream-to-partition mapping itself.
//! - [`grow`]: the procedure that grows the layout without losing or
//!   splitting a report (`report-generator partitions grow`).
//!
//! Deliberately absent: the formats themselves (quire-messages owns them)
//! and any Kafka client of its own making (quire-queue builds them all).

pub mod grow;
pub mod identity;
pub mod layout;

pub use identity::{LogIdentity, commit_metadata, committed_watermarks, identify};
pub use layout::{
    LayoutFollower, ResolvedLayout, layout_message, partition_of, read_layout, record_layout,
    resolve_layout,
};

/// What finding the log or its layout can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{0}")]
    Queue(#[from] quire_queue::QueueError),
    #[error("{0}")]
    Read(#[from] quire_queue::ReadError),
    #[error("s3: {0}")]
    S3(String),
    #[error("{0}")]
    Unreadable(String),
    /// The topics and the recorded layout disagree in a way no restart
    /// cures: an operator must act (the message says how).
    #[error("{0}")]
    Layout(String),
    #[error("blocking task failed: {0}")]
    Join(String),
}

impl From<tokio::task::JoinError> for LogError {
    fn from(error: tokio::task::JoinError) -> Self {
        LogError::Join(error.to_string())
    }
}

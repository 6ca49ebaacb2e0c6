//! The one error type of the S3 crate.

/// What can go wrong while writing a document to S3, sweeping uploads, or
/// expiring old reports.
#[derive(Debug, thiserror::Error)]
pub enum WriterError {
    /// The caller tried to write more than it declared; nothing of the refused
    /// append was written, and the writer is still usable.
    #[error(
        "s3://{bucket}/{key} would grow to {attempted_size} bytes, past its declared maximum of {declared_maximum} bytes; the append was refused"
    )]
    ObjectTooLarge {
        bucket: String,
        key: String,
        declared_maximum: u64,
        attempted_size: u64,
    },

    /// The upload policy cannot be used (zero parts in flight, a maximum object
    /// size beyond what S3 can store, no attempts...).
    #[error("invalid upload policy: {reason}")]
    InvalidPolicy { reason: String },

    /// An S3 call failed for good: it was not retryable, or every attempt the
    /// retry policy allows failed.
    #[error("{operation} of s3://{bucket}/{key} failed after {attempts} attempt(s): {detail}")]
    S3 {
        operation: &'static str,
        bucket: String,
        key: String,
        attempts: u32,
        /// The HTTP status the server answered, when it answered.
        status: Option<u16>,
        /// Whether the last failure was of a retryable kind (the attempts ran out).
        retryable: bool,
        /// The SDK error with its whole chain of causes.
        detail: String,
    },

    /// A background part upload ended without a result (it panicked or the
    /// runtime is shutting down).
    #[error("a part upload of s3://{bucket}/{key} ended without a result: {source}")]
    PartTaskEnded {
        bucket: String,
        key: String,
        #[source]
        source: tokio::task::JoinError,
    },

    /// The document's SHA-256 could not be computed: the hashing of a part
    /// was interrupted (its task panicked or the runtime is shutting down).
    #[error(
        "the SHA-256 of s3://{bucket}/{key} could not be computed: a part's hashing was interrupted"
    )]
    HashingInterrupted { bucket: String, key: String },

    /// The bytes a document spilled to local disk could not be read back.
    /// The document is abandoned like one whose upload failed; the log still
    /// holds everything it was rendered from. (A spill that cannot be
    /// written is no error: its bytes stay in memory.)
    #[error("the spill file of s3://{bucket}/{key} failed: {detail}")]
    Spill {
        bucket: String,
        key: String,
        detail: String,
    },

    /// The writer was used after it finished, was aborted, or failed (the
    /// failure itself was returned by the call that met it).
    #[error(
        "the writer of s3://{bucket}/{key} is closed: it already finished, was aborted, or failed"
    )]
    Closed { bucket: String, key: String },

    /// Listing the pending multipart uploads under a prefix failed.
    #[error("listing pending multipart uploads of s3://{bucket}/{prefix} failed: {detail}")]
    ListUploads {
        bucket: String,
        prefix: String,
        detail: String,
    },
}

impl WriterError {
    /// The HTTP status of the server's answer, for S3 failures that got one.
    pub fn status(&self) -> Option<u16> {
        match self {
            WriterError::S3 { status, .. } => *status,
            _ => None,
        }
    }
}

impl From<WriterError> for std::io::Error {
    /// For the `AsyncWrite` implementation: a refused append is invalid input,
    /// everything else is an I/O failure that carries the writer's error.
    fn from(error: WriterError) -> Self {
        let kind = match &error {
            WriterError::ObjectTooLarge { .. } | WriterError::InvalidPolicy { .. } => {
                std::io::ErrorKind::InvalidInput
            }
            WriterError::Closed { .. } => std::io::ErrorKind::BrokenPipe,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, error)
    }
}

//! quire's S3 layer: the buffered multipart writer and the client it runs on.
//!
//! Reports are built from many small appends (one per record). The seed
//! article got 15-20x by buffering such appends into large chunks and writing
//! the storage once per chunk; here the chunks are multipart parts:
//!
//! - [`build_client`] configures the aws-sdk-s3 client for S3-compatible
//!   servers, in one place;
//! - [`S3Bucket::writer`] opens a [`MultipartWriter`] for one key under an
//!   [`UploadPolicy`] (part size from the declared maximum object size, parts
//!   in flight, retries); appends of any size in, equal parts out, memory
//!   held in buffers that grow with the document, SHA-256 computed on the way;
//! - [`MemoryPool`] is the memory every writer of a bucket handle shares: one
//!   budget for buffers and spare parts, a limit on parts in flight across
//!   every writer, and a bounded spill directory for what the budget cannot
//!   hold ([`S3Bucket::with_memory`]);
//! - [`S3Bucket::abort_pending_uploads`] is the take-over sweep: the new owner
//!   of a partition aborts the uploads a dead owner left pending;
//! - [`WriterCounters`] counts bytes, parts, retries and aborts;
//! - [`start_retention`] expires old reports and manifests: bucket lifecycle
//!   rules where the server has them, else a periodic sweep
//!   ([`S3Bucket::expire_older_than`]).

mod bucket;
mod calls;
mod checksum;
mod client;
mod counters;
mod error;
mod memory;
mod policy;
mod retention;
mod sweep;
mod tags;
mod writer;

pub use bucket::S3Bucket;
pub use checksum::StoredChecksum;
pub use client::build_client;
pub use counters::{CountersSnapshot, WriterCounters};
pub use error::WriterError;
pub use memory::{MemoryPolicy, MemoryPool, MemorySnapshot};
pub use policy::{
    DEFAULT_MAX_IN_FLIGHT, MAXIMUM_OBJECT_SIZE, MAXIMUM_PART_COUNT, MINIMUM_PART_SIZE, RetryPolicy,
    UploadPolicy, part_size_for,
};
pub use retention::{
    ExpiredObjects, LIFECYCLE_RULE_ID_PREFIX, LifecycleOutcome, Retention, spawn_retention,
    start_retention,
};
pub use sweep::PendingUpload;
pub use tags::{MAX_TAGS, is_tag_text};
pub use writer::{MultipartWriter, WrittenObject};

/// The SDK this crate is built on, for callers that need its types.
pub use aws_sdk_s3;

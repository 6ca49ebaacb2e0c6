//! The bucket handle: which bucket, the client that reaches it, the counters
//! and the memory its writers share, and where writers are opened. What the
//! handle does besides opening writers lives beside what it is about: the
//! take-over sweep in `sweep.rs`, report retention in `retention.rs`.

use std::sync::Arc;

use aws_sdk_s3::Client;

use crate::counters::WriterCounters;
use crate::error::WriterError;
use crate::memory::MemoryPool;
use crate::policy::UploadPolicy;
use crate::writer::MultipartWriter;

/// One bucket, the client that reaches it, and the counters and memory its
/// writers share.
#[derive(Debug, Clone)]
pub struct S3Bucket {
    client: Client,
    name: String,
    counters: Arc<WriterCounters>,
    /// The memory every writer of this handle (and its clones) shares.
    memory: Arc<MemoryPool>,
}

impl S3Bucket {
    /// A handle on bucket `name`, with counters of its own.
    pub fn new(client: Client, name: impl Into<String>) -> Self {
        let counters: Arc<WriterCounters> = Arc::default();
        S3Bucket {
            client,
            name: name.into(),
            memory: Arc::new(MemoryPool::unlimited(counters.clone())),
            counters,
        }
    }

    /// Makes the writers and sweeps of this handle add to `counters` (one set
    /// per process, read by its metrics).
    pub fn with_counters(mut self, counters: Arc<WriterCounters>) -> Self {
        // A new unlimited pool reports to the new counters; call
        // `with_memory` afterwards for a budget.
        self.memory = Arc::new(MemoryPool::unlimited(counters.clone()));
        self.counters = counters;
        self
    }

    /// Makes every writer of this handle share `memory`: its budget, its
    /// limit on parts in flight and its spill directory. Build the pool with
    /// this handle's counters, so its gauges reach them.
    pub fn with_memory(mut self, memory: Arc<MemoryPool>) -> Self {
        self.memory = memory;
        self
    }

    pub fn memory(&self) -> &Arc<MemoryPool> {
        &self.memory
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn counters(&self) -> &Arc<WriterCounters> {
        &self.counters
    }

    /// A call on `key` of this bucket that failed, as the error callers see.
    pub(crate) fn failed(
        &self,
        operation: &'static str,
        key: &str,
        failure: crate::calls::CallFailure,
    ) -> WriterError {
        WriterError::S3 {
            operation,
            bucket: self.name().to_owned(),
            key: key.to_owned(),
            attempts: failure.attempts,
            status: failure.status,
            retryable: failure.retryable,
            detail: failure.detail,
        }
    }

    /// A writer for one document at `key`, under `policy`, stored with the
    /// server's default content type. Nothing is sent to S3 until the first
    /// part is full (or `finish()`).
    pub fn writer(
        &self,
        key: impl Into<String>,
        policy: &UploadPolicy,
    ) -> Result<MultipartWriter, WriterError> {
        self.typed_writer(key, None, policy)
    }

    /// [`writer`](Self::writer), the object stored with `content_type`.
    pub fn typed_writer(
        &self,
        key: impl Into<String>,
        content_type: Option<&str>,
        policy: &UploadPolicy,
    ) -> Result<MultipartWriter, WriterError> {
        MultipartWriter::new(
            self.client.clone(),
            self.name.clone(),
            key.into(),
            content_type.map(str::to_owned),
            policy,
            self.counters.clone(),
            self.memory.clone(),
        )
    }
}

//! The buffered multipart writer: appends of any size in, equal parts out,
//! uploaded in the background with a bounded number in flight.
//!
//! Life of a document:
//! - appends fill a buffer that grows with the document (doubling from
//!   16 KiB up to one part) while the writer's [`MemoryPool`] has room; past
//!   that, the buffer's bytes spill to a file of the pool's spill directory
//!   and the buffer is reused. A full part (spilled bytes, then the buffer)
//!   is sent only when more bytes arrive, so a document of at most one part
//!   never starts a multipart upload and goes up as one PutObject;
//! - the first part creates the multipart upload; each part uploads in a task
//!   of its own, at most `max_in_flight` at once for this writer and at most
//!   the pool's `parts_in_flight` across every writer; the append that would
//!   start one more waits for one to end (back-pressure); a spilled part is
//!   read back into memory by its task, on the blocking pool;
//! - each part is hashed into the document's SHA-256 on the blocking pool,
//!   in part order, while it uploads;
//! - `finish()` sends the last part, waits for every part and completes;
//! - a part that fails after its retries, `abort()`, a failed `finish()` and a
//!   drop without `finish()` all abort the multipart upload.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use aws_sdk_s3::types::CompletedPart;
use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};
use tokio::sync::{AcquireError, OwnedSemaphorePermit, oneshot};
use tokio::task::{JoinError, JoinHandle, JoinSet};

use crate::calls::UploadTarget;
use crate::counters::WriterCounters;
use crate::error::WriterError;
use crate::memory::{MemoryPool, SMALLEST_BUFFER, SpillFile};
use crate::policy::UploadPolicy;

/// What `finish()` stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenObject {
    pub bucket: String,
    pub key: String,
    /// Bytes in the object.
    pub bytes: u64,
    /// Parts of the multipart upload; 1 for a single PutObject.
    pub parts: u32,
    /// SHA-256 of the object's bytes, lowercase hex, computed while streaming.
    pub sha256_hex: String,
    /// True when the document fitted in one part and was stored with one
    /// PutObject (no multipart upload was created).
    pub single_put: bool,
    /// The ETag the server gave the object.
    pub e_tag: Option<String>,
}

/// Writes one document to one key. Build it with [`crate::S3Bucket::writer`].
///
/// Memory: the writer holds at most part size x (`max_in_flight` + 1) bytes
/// (the buffer being filled and the parts in flight), allocated as the
/// document grows and counted in its [`MemoryPool`]; see
/// [`MultipartWriter::held_bytes`], [`MultipartWriter::spilled_bytes`] and
/// [`MultipartWriter::peak_buffered_bytes`].
///
/// The [`tokio::io::AsyncWrite`] implementation writes through the same
/// buffer. Its `flush` and `shutdown` send nothing (parts have a fixed size,
/// and only [`MultipartWriter::finish`] may send a short last part); they only
/// report a failure met in the background.
pub struct MultipartWriter {
    target: Arc<UploadTarget>,
    part_size: usize,
    max_in_flight: usize,
    declared_maximum: u64,
    /// The end of the part being filled (its start is in `spill`, if any).
    /// A writer that was never written to holds no memory; the buffer grows
    /// with the document, within the pool's budget.
    buffer: BytesMut,
    /// The buffer's capacity, as counted in the pool.
    buffer_counted: u64,
    /// The most bytes the buffer may hold: the part size less the spilled
    /// bytes of the current part.
    buffer_limit: usize,
    /// The start of the current part, when the pool had no memory for it.
    spill: Option<SpillFile>,
    pool: Arc<MemoryPool>,
    /// The wait for a permit of the pool's limit on parts in flight.
    permit_wait: Option<PermitWait>,
    /// Whether this writer already said it went past the budget.
    warned_over_budget: bool,
    document_hash: HashChain,
    bytes_accepted: u64,
    parts_sent: u32,
    /// CreateMultipartUpload, running as a task of its own so that a writer
    /// dropped meanwhile can still learn the upload id and abort it.
    creation: Option<JoinHandle<Result<String, WriterError>>>,
    upload: Option<OpenUpload>,
    /// Bytes of the parts in flight, released by each part's task as it ends.
    in_flight_bytes: Arc<AtomicU64>,
    /// In-flight bytes right after the last part was sent. Between two sends
    /// parts only end, none starts, so this is the most that was in flight
    /// while the current buffer filled.
    in_flight_bytes_when_buffer_started: u64,
    peak_buffered_bytes: u64,
    phase: Phase,
}

type PermitWait = Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, AcquireError>> + Send>>;

/// Where an append's bytes can go now.
enum Room {
    /// Into the buffer (it has room for at least one byte of them).
    Buffer,
    /// This many were written straight to the spill file.
    Spilled(usize),
}

struct OpenUpload {
    upload_id: Arc<str>,
    in_flight: JoinSet<Result<CompletedPart, WriterError>>,
    completed_parts: Vec<CompletedPart>,
}

enum Phase {
    Open,
    /// A part failed: the upload is being aborted, and the failure is handed
    /// to the caller once the abort has ended.
    AbortingAfterFailure {
        abort: JoinHandle<()>,
        cause: Option<WriterError>,
    },
    /// Finished, aborted, or failed (the failure was already returned).
    Closed,
}

impl MultipartWriter {
    pub(crate) fn new(
        client: aws_sdk_s3::Client,
        bucket: String,
        key: String,
        content_type: Option<String>,
        policy: &UploadPolicy,
        counters: Arc<WriterCounters>,
        pool: Arc<MemoryPool>,
    ) -> Result<Self, WriterError> {
        policy.validate()?;
        let part_size =
            usize::try_from(policy.part_size()).map_err(|_| WriterError::InvalidPolicy {
                reason: format!(
                    "parts of {} bytes do not fit in this machine's memory",
                    policy.part_size()
                ),
            })?;
        let target = UploadTarget::new(client, bucket, key, content_type, policy, counters);
        Ok(MultipartWriter {
            target: Arc::new(target),
            part_size,
            max_in_flight: policy.max_in_flight,
            declared_maximum: policy.max_object_size,
            buffer: BytesMut::new(),
            buffer_counted: 0,
            buffer_limit: part_size,
            spill: None,
            pool,
            permit_wait: None,
            warned_over_budget: false,
            document_hash: HashChain::new(),
            bytes_accepted: 0,
            parts_sent: 0,
            creation: None,
            upload: None,
            in_flight_bytes: Arc::new(AtomicU64::new(0)),
            in_flight_bytes_when_buffer_started: 0,
            peak_buffered_bytes: 0,
            phase: Phase::Open,
        })
    }

    pub fn key(&self) -> &str {
        &self.target.key
    }

    /// The size of every part but the last.
    pub fn part_size(&self) -> usize {
        self.part_size
    }

    /// Bytes accepted so far.
    pub fn bytes_written(&self) -> u64 {
        self.bytes_accepted
    }

    /// Bytes the writer holds now: the buffer being filled plus the parts in
    /// flight.
    pub fn buffered_bytes(&self) -> u64 {
        self.buffer.len() as u64 + self.in_flight_bytes.load(Ordering::Relaxed)
    }

    /// Memory the writer holds now: its buffer's capacity plus the parts in
    /// flight. What the pool's budget counts.
    pub fn held_bytes(&self) -> u64 {
        self.buffer_counted + self.in_flight_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the current part waiting in a spill file.
    pub fn spilled_bytes(&self) -> u64 {
        self.spill.as_ref().map_or(0, |spill| spill.len)
    }

    /// Bytes accepted and not sent yet: the current part so far.
    fn unsent(&self) -> usize {
        self.part_size - self.buffer_limit + self.buffer.len()
    }

    /// The most bytes the writer has held at once. Checked at every part
    /// boundary; an upper bound, as it pairs the fullest buffer with the
    /// in-flight bytes as they stood when that buffer started filling.
    pub fn peak_buffered_bytes(&self) -> u64 {
        self.peak_buffered_bytes
            .max(self.in_flight_bytes_when_buffer_started + self.buffer.len() as u64)
    }

    /// Appends `data`, of any size. Waits when the buffer is full and
    /// `max_in_flight` parts are already uploading.
    ///
    /// An append that would take the document past its declared maximum is
    /// refused whole with [`WriterError::ObjectTooLarge`] and the writer stays
    /// usable. A part that failed after its retries fails this call (or a
    /// later one) once the upload is aborted; the writer is then closed.
    pub async fn append(&mut self, data: &[u8]) -> Result<(), WriterError> {
        if self.append_within_buffer(data) {
            return Ok(());
        }
        self.refuse_past_declared_maximum(data.len())?;
        poll_fn(|context| self.poll_open(context)).await?;
        let mut rest = data;
        while !rest.is_empty() {
            let accepted = poll_fn(|context| self.poll_write_chunk(context, rest)).await?;
            rest = &rest[accepted..];
        }
        Ok(())
    }

    /// The fast path of the common small append: if `data` fits in the
    /// buffer, copies it there and returns true. A few comparisons and one
    /// copy: no polling machinery, no atomics.
    #[inline]
    fn append_within_buffer(&mut self, data: &[u8]) -> bool {
        let room = self.buffer.capacity().min(self.buffer_limit) - self.buffer.len();
        let fits = data.len() <= room
            && data.len() as u64 <= self.declared_maximum - self.bytes_accepted
            && matches!(self.phase, Phase::Open);
        if fits {
            self.buffer.extend_from_slice(data);
            self.bytes_accepted += data.len() as u64;
        }
        fits
    }

    /// Sends the last part and completes the upload, or stores a document of
    /// at most one part with one PutObject. On failure the multipart upload is
    /// aborted before the error is returned.
    pub async fn finish(mut self) -> Result<WrittenObject, WriterError> {
        poll_fn(|context| self.poll_open(context)).await?;
        match self.complete().await {
            Ok(written) => {
                self.phase = Phase::Closed;
                self.target.counters.document_completed();
                tracing::info!(
                    bucket = %written.bucket,
                    key = %written.key,
                    bytes = written.bytes,
                    parts = written.parts,
                    single_put = written.single_put,
                    peak_buffered_bytes = self.peak_buffered_bytes(),
                    "document stored"
                );
                Ok(written)
            }
            Err(cause) => {
                self.phase = Phase::Closed;
                let creation = self.creation.take();
                let upload = self.upload.take();
                abort_upload_logging_failure(
                    self.target.clone(),
                    creation,
                    upload,
                    "finish failed",
                )
                .await;
                Err(cause)
            }
        }
    }

    /// Abandons the document: stops the parts in flight and aborts the
    /// multipart upload, so no part stays stored and no object appears.
    pub async fn abort(mut self) -> Result<(), WriterError> {
        match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::Open => {}
            Phase::AbortingAfterFailure { abort, .. } => {
                // A failure already started the abort; wait for it to end.
                let _ = abort.await;
                return Ok(());
            }
            Phase::Closed => return Ok(()),
        }
        let creation = self.creation.take();
        let upload = self.upload.take();
        abort_upload(
            self.target.clone(),
            creation,
            upload,
            "aborted by the caller",
        )
        .await
    }

    fn refuse_past_declared_maximum(&self, appended: usize) -> Result<(), WriterError> {
        let attempted_size = self.bytes_accepted + appended as u64;
        if attempted_size <= self.declared_maximum {
            return Ok(());
        }
        Err(WriterError::ObjectTooLarge {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
            declared_maximum: self.declared_maximum,
            attempted_size,
        })
    }

    fn closed_error(&self) -> WriterError {
        WriterError::Closed {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
        }
    }

    /// Ready(Ok) while the writer is open; otherwise the error to return, once
    /// the abort that a failure started has ended.
    fn poll_open(&mut self, context: &mut Context<'_>) -> Poll<Result<(), WriterError>> {
        match &mut self.phase {
            Phase::Open => Poll::Ready(Ok(())),
            Phase::AbortingAfterFailure { abort, cause } => {
                // The abort task logs its own failure; a panic in it leaves the
                // upload to the take-over sweep, and the cause still stands.
                let _ = ready!(Pin::new(abort).poll(context));
                let cause = cause.take();
                self.phase = Phase::Closed;
                Poll::Ready(Err(cause.unwrap_or_else(|| self.closed_error())))
            }
            Phase::Closed => Poll::Ready(Err(self.closed_error())),
        }
    }

    /// Accepts a prefix of `data` (as much as fits in the buffer), sending the
    /// full buffer first if needed. Returns how many bytes were accepted.
    fn poll_write_chunk(
        &mut self,
        context: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<Result<usize, WriterError>> {
        if self.append_within_buffer(data) {
            return Poll::Ready(Ok(data.len()));
        }
        ready!(self.poll_open(context))?;
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.refuse_past_declared_maximum(data.len())?;
        if self.unsent() == self.part_size
            && let Err(cause) = ready!(self.poll_send_buffer(context))
        {
            self.begin_abort_after_failure(cause);
            return self.poll_open(context).map_ok(|()| 0);
        }
        let wanted = (self.part_size - self.unsent()).min(data.len());
        let accepted = match self.make_room(&data[..wanted]) {
            Room::Buffer => {
                let room = self.buffer.capacity().min(self.buffer_limit) - self.buffer.len();
                let accepted = room.min(wanted);
                debug_assert!(accepted > 0);
                self.buffer.extend_from_slice(&data[..accepted]);
                accepted
            }
            Room::Spilled(written) => written,
        };
        self.bytes_accepted += accepted as u64;
        Poll::Ready(Ok(accepted))
    }

    /// Makes room for (a prefix of) `data`, which fits in the current part:
    /// a spare part buffer for a fresh part, else a larger buffer if the pool
    /// has the memory, else the buffer's bytes (and, if the buffer is too
    /// small for them, `data`) go to the spill file; with the spill full,
    /// its disk out of room or its write failing, the buffer grows past the
    /// budget (counted as over budget) rather than lose data or fail.
    fn make_room(&mut self, data: &[u8]) -> Room {
        let needed = self.buffer.len() + data.len();
        if needed <= self.buffer.capacity() {
            return Room::Buffer;
        }
        if self.buffer.is_empty()
            && self.spill.is_none()
            && self.parts_sent > 0
            && let Some(spare) = self.pool.take_spare()
        {
            // A document past its first part will fill this one too.
            self.pool.release_buffer(self.buffer_counted);
            self.buffer_counted = spare.capacity() as u64;
            self.buffer = spare;
            return Room::Buffer;
        }
        let doubled = (self.buffer.capacity() * 2).max(SMALLEST_BUFFER);
        let target = doubled.max(needed).min(self.buffer_limit);
        if self.grow_buffer(target, false) || (target > needed && self.grow_buffer(needed, false)) {
            return Room::Buffer;
        }
        if let Some(room) = self.spill_buffer(data) {
            return room;
        }
        if !self.warned_over_budget {
            self.warned_over_budget = true;
            tracing::warn!(
                key = %self.target.key,
                spilled_bytes = self.pool.snapshot().spilled_bytes,
                "memory budget reached and the spill is full or refused: holding the document in memory past the budget"
            );
        }
        // The spill may have taken the buffer's bytes before it refused
        // `data`: size the buffer for what it holds now. Doubling still, so
        // that appends past the budget stay linear.
        let needed = self.buffer.len() + data.len();
        let doubled = (self.buffer.capacity() * 2).max(SMALLEST_BUFFER);
        self.grow_buffer(doubled.max(needed).min(self.buffer_limit), true);
        Room::Buffer
    }

    /// Replaces the buffer by one of `capacity` bytes (its bytes copied), if
    /// the pool has the memory or `force` is set.
    fn grow_buffer(&mut self, capacity: usize, force: bool) -> bool {
        let delta = capacity.saturating_sub(self.buffer.capacity()) as u64;
        if delta == 0 {
            return true;
        }
        if force {
            self.pool.force_reserve_buffer(delta);
        } else if !self.pool.try_reserve_buffer(delta) {
            return false;
        }
        let mut grown = BytesMut::with_capacity(capacity);
        grown.extend_from_slice(&self.buffer);
        let old_capacity = self.buffer_counted;
        self.buffer = grown;
        // What was reserved is the growth; the allocator may give more.
        let actual = self.buffer.capacity() as u64;
        let counted = old_capacity + delta;
        if actual > counted {
            self.pool.force_reserve_buffer(actual - counted);
        }
        self.buffer_counted = actual.max(counted);
        true
    }

    /// Moves the buffer's bytes to the spill file (keeping the buffer for the
    /// next bytes), or, when the buffer cannot hold `data` even empty, writes
    /// `data` there too. `None` when the spill took nothing more: it is full,
    /// its filesystem has no room, or a write failed (the pool counts and
    /// warns); whatever did not reach the file is still in memory.
    fn spill_buffer(&mut self, data: &[u8]) -> Option<Room> {
        let through = self.buffer.capacity().min(self.part_size) < data.len();
        let bytes = self.buffer.len() + if through { data.len() } else { 0 };
        self.pool
            .try_reserve_spill(bytes as u64, &self.target.key)
            .ok()?;
        let pool = &self.pool;
        let spill = self.spill.get_or_insert_with(|| {
            SpillFile::new(pool).expect("a spill reservation needs a spill directory")
        });
        let buffered = self.buffer.len();
        let mut failure = None;
        if buffered > 0 {
            match spill.append(&self.buffer) {
                Ok(()) => self.buffer.clear(),
                Err(error) => {
                    // The rest of the reservation was for `data`.
                    self.pool.release_spill((bytes - buffered) as u64);
                    failure = Some(error);
                }
            }
        }
        if through
            && failure.is_none()
            && let Err(error) = spill.append(data)
        {
            failure = Some(error);
        }
        let spilled = spill.len as usize;
        self.buffer_limit = self.part_size - spilled;
        if let Some(error) = failure {
            self.pool.spill_write_failed(&self.target.key, &error);
            if spilled == 0 {
                self.spill = None;
            }
            return None;
        }
        Some(if through {
            Room::Spilled(data.len())
        } else {
            Room::Buffer
        })
    }

    /// A permit of the pool's limit on parts in flight, once one is free.
    fn poll_part_permit(&mut self, context: &mut Context<'_>) -> Poll<OwnedSemaphorePermit> {
        let parts = &self.pool.parts;
        let wait = self
            .permit_wait
            .get_or_insert_with(|| Box::pin(parts.clone().acquire_owned()));
        let permit = ready!(wait.as_mut().poll(context));
        self.permit_wait = None;
        Poll::Ready(permit.expect("the pool's semaphore is never closed"))
    }

    /// Sends the buffer as the next part: creates the multipart upload first
    /// if this is the first part, then waits until fewer than `max_in_flight`
    /// parts are in flight (collecting the parts that ended, and their
    /// failures).
    fn poll_send_buffer(&mut self, context: &mut Context<'_>) -> Poll<Result<(), WriterError>> {
        if self.upload.is_none() {
            let target = &self.target;
            let creation = self
                .creation
                .get_or_insert_with(|| tokio::spawn(target.clone().create_multipart_upload()));
            let created = ready!(Pin::new(creation).poll(context));
            self.creation = None;
            let upload_id = created.map_err(|source| self.task_ended(source))??;
            self.upload = Some(OpenUpload {
                upload_id: upload_id.into(),
                in_flight: JoinSet::new(),
                completed_parts: Vec::new(),
            });
        }
        let upload = self.upload.as_mut().expect("the upload was created above");
        loop {
            let ended = if upload.in_flight.len() < self.max_in_flight {
                match upload.in_flight.try_join_next() {
                    Some(ended) => ended,
                    None => break,
                }
            } else {
                match ready!(upload.in_flight.poll_join_next(context)) {
                    Some(ended) => ended,
                    None => break,
                }
            };
            record_ended_part(upload, ended, &self.target)?;
        }
        let permit = ready!(self.poll_part_permit(context));
        self.send_buffer_as_part(permit)?;
        Poll::Ready(Ok(()))
    }

    /// The current part, taken out of the writer: the buffer itself (no
    /// copy), or the spill file and the buffer behind it. The buffer's bytes
    /// never join the file (a full disk cannot fail the part): the upload
    /// task appends them to the file's bytes as it reads them back. The
    /// memory the part holds is counted as in flight from here on, under
    /// `permit`.
    fn take_part(&mut self, permit: OwnedSemaphorePermit) -> (PartBody, InFlightMemory) {
        self.note_peak_buffered_bytes();
        let counted = self.buffer_counted;
        self.pool.buffer_to_in_flight(counted);
        self.buffer_counted = 0;
        let buffer = std::mem::take(&mut self.buffer).freeze();
        self.buffer_limit = self.part_size;
        let Some(spill) = self.spill.take() else {
            let memory = InFlightMemory::counted(self.pool.clone(), counted, permit);
            return (PartBody::Memory(buffer), memory);
        };
        // Reading it back needs the whole part's memory, from the in-flight
        // reserve, while the buffer's bytes wait beside it.
        let read_back = spill.len + buffer.len() as u64;
        self.pool.add_in_flight(read_back);
        let memory = InFlightMemory::counted(self.pool.clone(), counted + read_back, permit);
        (
            PartBody::Spilled {
                spill,
                tail: buffer,
            },
            memory,
        )
    }

    /// Takes the current part out of the writer and starts its upload and its
    /// hashing in the background.
    fn send_buffer_as_part(&mut self, permit: OwnedSemaphorePermit) -> Result<(), WriterError> {
        let (body, memory) = self.take_part(permit);
        let part_length = body.len();
        let hashing = self.document_hash.link();
        // The first part's SHA-256 is the document hash so far: handing it to
        // SigV4 spares a second pass over those bytes.
        let reuse_hash_for_signing = self.parts_sent == 0 && self.target.signs_payload();
        self.parts_sent += 1;
        let part_number = self.parts_sent as i32;
        let in_flight = InFlightPart::start(
            part_length,
            self.in_flight_bytes.clone(),
            self.target.counters.clone(),
            memory,
        );
        let target = self.target.clone();
        let pool = self.pool.clone();
        let upload = self.upload.as_mut().expect("parts are sent into an upload");
        let upload_id = upload.upload_id.clone();
        upload.in_flight.spawn(async move {
            // The part counts as in flight until it is both stored and hashed,
            // so the accounting covers every reference to its buffer.
            let _in_flight = in_flight;
            let part = body.load(&target).await?;
            let hashing = hashing.hash(part.clone());
            let uploaded = if reuse_hash_for_signing {
                let payload_sha256 = hashing.await;
                target
                    .upload_part(&upload_id, part_number, &part, payload_sha256)
                    .await
            } else {
                let (uploaded, _) = tokio::join!(
                    target.upload_part(&upload_id, part_number, &part, None),
                    hashing
                );
                uploaded
            };
            if uploaded.is_ok() {
                pool.give_back(part);
            }
            uploaded
        });
        self.in_flight_bytes_when_buffer_started = self.in_flight_bytes.load(Ordering::Relaxed);
        Ok(())
    }

    fn note_peak_buffered_bytes(&mut self) {
        self.peak_buffered_bytes = self.peak_buffered_bytes();
    }

    fn begin_abort_after_failure(&mut self, cause: WriterError) {
        let creation = self.creation.take();
        let upload = self.upload.take();
        let abort = tokio::spawn(abort_upload_logging_failure(
            self.target.clone(),
            creation,
            upload,
            "a part failed",
        ));
        self.phase = Phase::AbortingAfterFailure {
            abort,
            cause: Some(cause),
        };
    }

    async fn complete(&mut self) -> Result<WrittenObject, WriterError> {
        if self.upload.is_none() && self.creation.is_none() {
            // At most one part: one PutObject, no multipart upload.
            let permit = poll_fn(|context| self.poll_part_permit(context)).await;
            let (body, _memory) = self.take_part(permit);
            let document = body.load(&self.target).await?;
            let hashing = self.document_hash.link().hash(document.clone());
            let stored = if self.target.signs_payload() {
                // The document's SHA-256 is its payload hash: hashed once.
                let payload_sha256 = hashing.await;
                self.target.put_object(&document, payload_sha256).await
            } else {
                let (stored, _) = tokio::join!(self.target.put_object(&document, None), hashing);
                stored
            };
            let e_tag = stored?;
            return self.written(1, true, e_tag).await;
        }
        if self.unsent() > 0 {
            poll_fn(|context| self.poll_send_buffer(context)).await?;
        }
        let upload = self.upload.as_mut().expect("a multipart upload is open");
        while let Some(ended) = upload.in_flight.join_next().await {
            record_ended_part(upload, ended, &self.target)?;
        }
        let mut parts = std::mem::take(&mut upload.completed_parts);
        parts.sort_by_key(|part| part.part_number());
        debug_assert_eq!(parts.len(), self.parts_sent as usize);
        let e_tag = self
            .target
            .complete_multipart_upload(&upload.upload_id, parts)
            .await?;
        self.written(self.parts_sent, false, e_tag).await
    }

    /// What was stored, once every part has been hashed.
    async fn written(
        &mut self,
        parts: u32,
        single_put: bool,
        e_tag: Option<String>,
    ) -> Result<WrittenObject, WriterError> {
        let document_hash = std::mem::replace(&mut self.document_hash, HashChain::new());
        let sha256_hex =
            document_hash
                .finish()
                .await
                .ok_or_else(|| WriterError::HashingInterrupted {
                    bucket: self.target.bucket.clone(),
                    key: self.target.key.clone(),
                })?;
        Ok(WrittenObject {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
            bytes: self.bytes_accepted,
            parts,
            sha256_hex,
            single_put,
            e_tag,
        })
    }

    fn task_ended(&self, source: JoinError) -> WriterError {
        WriterError::PartTaskEnded {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
            source,
        }
    }
}

impl Drop for MultipartWriter {
    /// A writer dropped without `finish()` or `abort()` aborts its upload in
    /// the background, so no orphaned parts stay stored.
    fn drop(&mut self) {
        // The buffer's memory leaves the pool's count with the writer (a
        // spill file removes itself).
        self.pool.release_buffer(self.buffer_counted);
        self.buffer_counted = 0;
        if !matches!(self.phase, Phase::Open) {
            return;
        }
        let creation = self.creation.take();
        let upload = self.upload.take();
        if creation.is_none() && upload.is_none() {
            // Nothing was sent to S3.
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(abort_upload_logging_failure(
                    self.target.clone(),
                    creation,
                    upload,
                    "the writer was dropped without finish",
                ));
            }
            Err(_) => tracing::warn!(
                bucket = %self.target.bucket,
                key = %self.target.key,
                "writer dropped outside a tokio runtime: its multipart upload stays pending until a take-over sweep aborts it"
            ),
        }
    }
}

impl tokio::io::AsyncWrite for MultipartWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .poll_write_chunk(context, data)
            .map_err(std::io::Error::from)
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut()
            .poll_open(context)
            .map_err(std::io::Error::from)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.poll_flush(context)
    }
}

fn record_ended_part(
    upload: &mut OpenUpload,
    ended: Result<Result<CompletedPart, WriterError>, JoinError>,
    target: &UploadTarget,
) -> Result<(), WriterError> {
    match ended {
        Ok(Ok(part)) => {
            upload.completed_parts.push(part);
            Ok(())
        }
        Ok(Err(failure)) => Err(failure),
        Err(source) => Err(WriterError::PartTaskEnded {
            bucket: target.bucket.clone(),
            key: target.key.clone(),
            source,
        }),
    }
}

/// How long an abort lets the part attempts under way end before it cuts
/// them off.
const ABORT_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// Lets the part attempts under way end (no new attempt starts), learns the
/// upload id if the creation was still running, and aborts the upload.
///
/// Why not cut the parts off at once: a server may still store a part whose
/// request the client dropped (it had the whole body already), after the
/// abort, where no listing shows it and nothing deletes it. An attempt that
/// ended with an answer cannot land later.
async fn abort_upload(
    target: Arc<UploadTarget>,
    creation: Option<JoinHandle<Result<String, WriterError>>>,
    upload: Option<OpenUpload>,
    reason: &str,
) -> Result<(), WriterError> {
    target.abandoned.cancel();
    let upload_id: Arc<str> = match (upload, creation) {
        (Some(mut upload), _) => {
            let parts_ended = tokio::time::timeout(ABORT_GRACE_PERIOD, async {
                while upload.in_flight.join_next().await.is_some() {}
            })
            .await;
            if parts_ended.is_err() {
                tracing::warn!(
                    bucket = %target.bucket,
                    key = %target.key,
                    grace_period_s = ABORT_GRACE_PERIOD.as_secs(),
                    "parts still uploading after the grace period are cut off: one may outlive the abort"
                );
                upload.in_flight.shutdown().await;
            }
            upload.upload_id
        }
        (None, Some(creation)) => match creation.await {
            Ok(Ok(upload_id)) => upload_id.into(),
            // The upload was never created: nothing to abort.
            _ => return Ok(()),
        },
        (None, None) => return Ok(()),
    };
    target.abort_multipart_upload(&upload_id, reason).await
}

async fn abort_upload_logging_failure(
    target: Arc<UploadTarget>,
    creation: Option<JoinHandle<Result<String, WriterError>>>,
    upload: Option<OpenUpload>,
    reason: &'static str,
) {
    let bucket = target.bucket.clone();
    let key = target.key.clone();
    if let Err(error) = abort_upload(target, creation, upload, reason).await {
        tracing::error!(
            %bucket,
            %key,
            reason,
            %error,
            "multipart upload could not be aborted: a take-over sweep must abort it"
        );
    }
}

/// What an upload sends: a part (or a whole small document) in memory, or
/// its start spilled to a file, read back by the upload's task, and its end
/// still in memory.
enum PartBody {
    Memory(Bytes),
    Spilled { spill: SpillFile, tail: Bytes },
}

impl PartBody {
    fn len(&self) -> u64 {
        match self {
            PartBody::Memory(part) => part.len() as u64,
            PartBody::Spilled { spill, tail } => spill.len + tail.len() as u64,
        }
    }

    /// The bytes, in memory. A spill file is read on the blocking pool and
    /// deleted once read; a failed read-back fails the part (those bytes are
    /// gone: the document is rendered again from the log).
    async fn load(self, target: &UploadTarget) -> Result<Bytes, WriterError> {
        let (spill, tail) = match self {
            PartBody::Memory(bytes) => return Ok(bytes),
            PartBody::Spilled { spill, tail } => (spill, tail),
        };
        let read = tokio::task::spawn_blocking(move || {
            let mut part = BytesMut::with_capacity(spill.len as usize + tail.len());
            spill.read_into(&mut part).map(|()| {
                part.extend_from_slice(&tail);
                part
            })
        })
        .await;
        let failed = |detail: String| WriterError::Spill {
            bucket: target.bucket.clone(),
            key: target.key.clone(),
            detail,
        };
        match read {
            Ok(Ok(part)) => Ok(part.freeze()),
            Ok(Err(error)) => Err(failed(format!("cannot read back: {error}"))),
            Err(error) => Err(failed(format!(
                "reading back ended without a result: {error}"
            ))),
        }
    }
}

/// Bytes counted as in flight in the pool, and the permit of the pool's
/// limit on parts in flight, for as long as an upload holds them.
struct InFlightMemory {
    pool: Arc<MemoryPool>,
    bytes: u64,
    _permit: OwnedSemaphorePermit,
}

impl InFlightMemory {
    /// Takes over `bytes` the caller already counted as in flight.
    fn counted(pool: Arc<MemoryPool>, bytes: u64, permit: OwnedSemaphorePermit) -> Self {
        InFlightMemory {
            pool,
            bytes,
            _permit: permit,
        }
    }
}

impl Drop for InFlightMemory {
    fn drop(&mut self) {
        self.pool.release_in_flight(self.bytes);
    }
}

/// Holds a part's bytes in the writer's accounting (and the in-flight gauge)
/// for as long as its task runs, however the task ends.
struct InFlightPart {
    bytes: u64,
    in_flight_bytes: Arc<AtomicU64>,
    counters: Arc<WriterCounters>,
    _memory: InFlightMemory,
}

impl InFlightPart {
    fn start(
        bytes: u64,
        in_flight_bytes: Arc<AtomicU64>,
        counters: Arc<WriterCounters>,
        memory: InFlightMemory,
    ) -> Self {
        in_flight_bytes.fetch_add(bytes, Ordering::Relaxed);
        counters.part_started();
        InFlightPart {
            bytes,
            in_flight_bytes,
            counters,
            _memory: memory,
        }
    }
}

impl Drop for InFlightPart {
    fn drop(&mut self) {
        self.in_flight_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
        self.counters.part_ended();
    }
}

/// The document's SHA-256, computed part after part on the blocking pool
/// while the parts upload. Hashing 8 MiB takes milliseconds: done by the
/// appending task it would stall the appends, and done on a runtime worker it
/// would stall the connections' I/O. Each link hashes one part once every
/// earlier part is hashed, and hands the state on.
struct HashChain {
    /// The state after the last linked part, once that part is hashed.
    end: oneshot::Receiver<Sha256>,
    links: u32,
}

impl HashChain {
    fn new() -> Self {
        let (sender, receiver) = oneshot::channel();
        let _ = sender.send(Sha256::new());
        HashChain {
            end: receiver,
            links: 0,
        }
    }

    /// The next place in the chain, taken in part order; its part's bytes
    /// come later ([`HashLink::hash`]), once they are in memory. If a link
    /// is dropped unfinished (its part failed or was cancelled), the chain
    /// stays broken and [`HashChain::finish`] says so.
    fn link(&mut self) -> HashLink {
        let (sender, receiver) = oneshot::channel();
        let previous = std::mem::replace(&mut self.end, receiver);
        let first_link = self.links == 0;
        self.links += 1;
        HashLink {
            previous,
            sender,
            first_link,
        }
    }

    /// The lowercase hex SHA-256 of every linked part, in order; `None` if a
    /// link never finished.
    async fn finish(self) -> Option<String> {
        let hasher = self.end.await.ok()?;
        Some(hex::encode(hasher.finalize()))
    }
}

/// One part's place in a [`HashChain`].
struct HashLink {
    previous: oneshot::Receiver<Sha256>,
    sender: oneshot::Sender<Sha256>,
    first_link: bool,
}

impl HashLink {
    /// The work of hashing `part` after every part linked before it. The
    /// first link also yields the SHA-256 of its part alone (lowercase hex),
    /// which is the document hash so far; later links yield `None`.
    fn hash(self, part: Bytes) -> impl Future<Output = Option<String>> + Send + 'static {
        let HashLink {
            previous,
            sender,
            first_link,
        } = self;
        async move {
            let mut hasher = previous.await.ok()?;
            let (hasher, part_sha256) = tokio::task::spawn_blocking(move || {
                hasher.update(&part);
                let part_sha256 = first_link.then(|| hex::encode(hasher.clone().finalize()));
                (hasher, part_sha256)
            })
            .await
            .ok()?;
            let _ = sender.send(hasher);
            part_sha256
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::S3Bucket;
    use crate::policy::MINIMUM_PART_SIZE;

    /// A client for an address nothing listens on: these tests must never
    /// reach a server, and would fail if they tried.
    fn unreachable_bucket() -> S3Bucket {
        let config = aws_sdk_s3::Config::builder()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .endpoint_url("http://127.0.0.1:9")
            .credentials_provider(aws_sdk_s3::config::Credentials::new(
                "test", "test", None, None, "test",
            ))
            .force_path_style(true)
            .build();
        S3Bucket::new(aws_sdk_s3::Client::from_conf(config), "no-such-bucket")
    }

    #[tokio::test]
    async fn writing_past_the_declared_maximum_is_refused_and_nothing_of_it_is_written() {
        let policy = UploadPolicy::for_max_object_size(100);
        let mut writer = unreachable_bucket().writer("doc.xml", &policy).unwrap();
        writer.append(&[b'a'; 60]).await.unwrap();
        writer.append(&[b'b'; 40]).await.unwrap();

        let error = writer.append(b"c").await.unwrap_err();
        assert!(
            matches!(
                error,
                WriterError::ObjectTooLarge {
                    declared_maximum: 100,
                    attempted_size: 101,
                    ..
                }
            ),
            "{error}"
        );
        assert!(error.to_string().contains("declared maximum of 100 bytes"));
        assert_eq!(
            writer.bytes_written(),
            100,
            "the refused append wrote nothing"
        );
        assert_eq!(writer.buffered_bytes(), 100);
        // Still usable: an empty append is fine.
        writer.append(b"").await.unwrap();
    }

    #[tokio::test]
    async fn the_async_write_path_refuses_past_the_maximum_as_invalid_input() {
        use tokio::io::AsyncWriteExt;
        let policy = UploadPolicy::for_max_object_size(10);
        let mut writer = unreachable_bucket().writer("doc.xml", &policy).unwrap();
        writer.write_all(b"0123456789").await.unwrap();
        let error = writer.write_all(b"x").await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[tokio::test]
    async fn a_document_within_one_part_stays_in_the_buffer_until_finish() {
        let policy = UploadPolicy::for_max_object_size(64 * 1024 * 1024);
        let mut writer = unreachable_bucket().writer("doc.xml", &policy).unwrap();
        assert_eq!(writer.part_size() as u64, MINIMUM_PART_SIZE);
        for _ in 0..1024 {
            writer.append(&[7u8; 8 * 1024]).await.unwrap();
        }
        // Exactly one full part, and no upload started: appends never touched
        // the (unreachable) server.
        assert_eq!(writer.bytes_written(), MINIMUM_PART_SIZE);
        assert_eq!(writer.peak_buffered_bytes(), MINIMUM_PART_SIZE);
        assert!(writer.upload.is_none() && writer.creation.is_none());
    }

    #[test]
    fn invalid_policies_are_refused_when_the_writer_is_built() {
        let mut policy = UploadPolicy::for_max_object_size(1024);
        policy.max_in_flight = 0;
        assert!(matches!(
            unreachable_bucket().writer("doc.xml", &policy),
            Err(WriterError::InvalidPolicy { .. })
        ));
    }

    /// Set in the child process that
    /// [`a_spill_write_that_fails_leaves_the_bytes_in_memory_in_order`] runs
    /// itself in, under a file-size limit.
    const FILE_SIZE_LIMITED: &str = "QUIRE_S3_TEST_FILE_SIZE_LIMITED";
    /// The largest file the child may write: spill writes past it fail
    /// (EFBIG) as a full disk's would (ENOSPC).
    const FILE_SIZE_LIMIT: u64 = 64 * 1024;

    /// A spill write that fails does not fail the document: the first
    /// 64 KiB reach the spill file, the file-size limit refuses the next
    /// write, and everything after stays in memory past the budget. The
    /// failure is counted, and the part read back is every byte, in order.
    /// Run in a child process of its own, as the limit is the process's.
    #[test]
    fn a_spill_write_that_fails_leaves_the_bytes_in_memory_in_order() {
        if std::env::var_os(FILE_SIZE_LIMITED).is_none() {
            let name =
                "writer::tests::a_spill_write_that_fails_leaves_the_bytes_in_memory_in_order";
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--test-threads=1", "--nocapture"])
                .env(FILE_SIZE_LIMITED, "1")
                .output()
                .expect("run the test binary again");
            let printed = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            assert!(output.status.success(), "the child failed:\n{printed}");
            assert!(
                printed.contains("1 passed"),
                "the child ran no test:\n{printed}"
            );
            return;
        }
        // The kernel kills a process that writes past its file-size limit
        // (SIGXFSZ) unless the signal is ignored; the write then fails.
        // SAFETY: ignoring a signal installs no handler.
        unsafe {
            nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGXFSZ,
                nix::sys::signal::SigHandler::SigIgn,
            )
        }
        .expect("ignore SIGXFSZ");
        nix::sys::resource::setrlimit(
            nix::sys::resource::Resource::RLIMIT_FSIZE,
            FILE_SIZE_LIMIT,
            nix::sys::resource::RLIM_INFINITY,
        )
        .expect("limit the size of files");
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(spill_write_fails_under_the_file_size_limit());
    }

    async fn spill_write_fails_under_the_file_size_limit() {
        let dir = std::env::temp_dir().join(format!("quire-spill-fsize-{}", std::process::id()));
        let counters = Arc::new(WriterCounters::default());
        let part_size = MINIMUM_PART_SIZE;
        let pool = Arc::new(
            MemoryPool::new(
                crate::MemoryPolicy {
                    budget_bytes: 2 * part_size,
                    parts_in_flight: 1,
                    part_size,
                    spill_dir: Some(dir.clone()),
                    spill_max_bytes: u64::MAX,
                },
                counters.clone(),
            )
            .unwrap(),
        );
        // Other documents hold the whole budget: this one's every byte
        // must spill, or stay in memory past the budget.
        pool.force_reserve_buffer(2 * part_size);
        let bucket = unreachable_bucket()
            .with_counters(counters.clone())
            .with_memory(pool.clone());
        let mut writer = bucket
            .writer(
                "doc.xml",
                &UploadPolicy::for_max_object_size(64 * 1024 * 1024),
            )
            .unwrap();
        let mut expected = Vec::new();
        for chunk in 0..256u32 {
            let bytes: Vec<u8> = (0..4096u32)
                .map(|at| ((chunk * 7 + at) % 251) as u8)
                .collect();
            writer
                .append(&bytes)
                .await
                .expect("a failed spill does not fail an append");
            expected.extend_from_slice(&bytes);
        }
        assert_eq!(writer.bytes_written(), expected.len() as u64);
        assert_eq!(
            writer.spilled_bytes(),
            FILE_SIZE_LIMIT,
            "what fitted under the limit is in the file, nothing of the failed write"
        );
        let counted = counters.snapshot();
        assert!(counted.spill_write_failures >= 1, "{counted:?}");
        assert!(counted.memory_over_budget_bytes > 0, "{counted:?}");
        assert_eq!(counted.spilled_bytes, FILE_SIZE_LIMIT);

        // The part as finish() would send it: the file read back, then the
        // bytes held in memory.
        let permit = pool.parts.clone().acquire_owned().await.unwrap();
        let (body, memory) = writer.take_part(permit);
        let part = body.load(&writer.target).await.expect("read back");
        assert!(part[..] == expected[..], "the part is every byte, in order");
        drop(memory);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "the spill file is deleted once read back"
        );
        assert_eq!(counters.snapshot().spilled_bytes, 0);
        drop(writer);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_writer_can_move_between_tasks() {
        fn assert_send<T: Send + 'static>() {}
        assert_send::<MultipartWriter>();
    }
}

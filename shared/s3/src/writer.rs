//! The buffered multipart writer: appends of any size in, equal parts out,
//! uploaded in the background with a bounded number in flight.
//!
//! Life of a document:
//! - appends fill a buffer of exactly one part; a full buffer is sent as the
//!   next part only when more bytes arrive, so a document of at most one part
//!   never starts a multipart upload and goes up as one PutObject;
//! - the first part creates the multipart upload; each part uploads in a task
//!   of its own, at most `max_in_flight` at once; the append that would start
//!   one more waits for one to end (back-pressure);
//! - each part is hashed into the document's SHA-256 on the blocking pool,
//!   in part order, while it uploads;
//! - `finish()` sends the last part, waits for every part and completes;
//! - a part that fails after its retries, `abort()`, a failed `finish()` and a
//!   drop without `finish()` all abort the multipart upload.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use aws_sdk_s3::types::CompletedPart;
use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinHandle, JoinSet};

use crate::calls::UploadTarget;
use crate::counters::WriterCounters;
use crate::error::WriterError;
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
/// (the buffer being filled and the parts in flight); see
/// [`MultipartWriter::buffered_bytes`] and
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
    /// The part being filled; empty with no capacity between two parts, so a
    /// writer that was never written to holds no memory.
    buffer: BytesMut,
    spare_buffers: Arc<SpareBuffers>,
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
        policy: &UploadPolicy,
        counters: Arc<WriterCounters>,
    ) -> Result<Self, WriterError> {
        policy.validate()?;
        let part_size =
            usize::try_from(policy.part_size()).map_err(|_| WriterError::InvalidPolicy {
                reason: format!(
                    "parts of {} bytes do not fit in this machine's memory",
                    policy.part_size()
                ),
            })?;
        let target = UploadTarget::new(
            client,
            bucket,
            key,
            policy.retry.clone(),
            policy.attempt_timeout,
            policy.sign_payload,
            counters,
        );
        Ok(MultipartWriter {
            target: Arc::new(target),
            part_size,
            max_in_flight: policy.max_in_flight,
            declared_maximum: policy.max_object_size,
            buffer: BytesMut::new(),
            spare_buffers: Arc::new(SpareBuffers::new(part_size, policy.max_in_flight + 1)),
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
        let room = self.buffer.capacity().min(self.part_size) - self.buffer.len();
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
        if self.buffer.len() == self.part_size
            && let Err(cause) = ready!(self.poll_send_buffer(context))
        {
            self.begin_abort_after_failure(cause);
            return self.poll_open(context).map_ok(|()| 0);
        }
        if self.buffer.capacity() == 0 {
            self.buffer = self.spare_buffers.take();
        }
        debug_assert!(self.buffer.capacity() >= self.part_size);
        let accepted = (self.part_size - self.buffer.len()).min(data.len());
        self.buffer.extend_from_slice(&data[..accepted]);
        self.bytes_accepted += accepted as u64;
        Poll::Ready(Ok(accepted))
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
        self.send_buffer_as_part();
        Poll::Ready(Ok(()))
    }

    /// Freezes the buffer into the next part (no copy) and starts its upload
    /// and its hashing in the background.
    fn send_buffer_as_part(&mut self) {
        self.note_peak_buffered_bytes();
        let part = std::mem::take(&mut self.buffer).freeze();
        let hashing = self.document_hash.link(part.clone());
        // The first part's SHA-256 is the document hash so far: handing it to
        // SigV4 spares a second pass over those bytes.
        let reuse_hash_for_signing = self.parts_sent == 0 && self.target.signs_payload();
        self.parts_sent += 1;
        let part_number = self.parts_sent as i32;
        let in_flight = InFlightPart::start(
            part.len() as u64,
            self.in_flight_bytes.clone(),
            self.target.counters.clone(),
        );
        let target = self.target.clone();
        let spare_buffers = self.spare_buffers.clone();
        let upload = self.upload.as_mut().expect("parts are sent into an upload");
        let upload_id = upload.upload_id.clone();
        upload.in_flight.spawn(async move {
            // The part counts as in flight until it is both stored and hashed,
            // so the accounting covers every reference to its buffer.
            let _in_flight = in_flight;
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
                spare_buffers.give_back(part);
            }
            uploaded
        });
        self.in_flight_bytes_when_buffer_started = self.in_flight_bytes.load(Ordering::Relaxed);
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
            self.note_peak_buffered_bytes();
            let document = std::mem::take(&mut self.buffer).freeze();
            let hashing = self.document_hash.link(document.clone());
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
        if !self.buffer.is_empty() {
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
    target.abandoned.stop();
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

/// Holds a part's bytes in the writer's accounting (and the in-flight gauge)
/// for as long as its task runs, however the task ends.
struct InFlightPart {
    bytes: u64,
    in_flight_bytes: Arc<AtomicU64>,
    counters: Arc<WriterCounters>,
}

impl InFlightPart {
    fn start(bytes: u64, in_flight_bytes: Arc<AtomicU64>, counters: Arc<WriterCounters>) -> Self {
        in_flight_bytes.fetch_add(bytes, Ordering::Relaxed);
        counters.part_started();
        InFlightPart {
            bytes,
            in_flight_bytes,
            counters,
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

    /// The work of hashing `part` after every part linked before it. The
    /// first link also yields the SHA-256 of its part alone (lowercase hex),
    /// which is the document hash so far; later links yield `None`. If a link
    /// is dropped unfinished (its part failed or was cancelled), the chain
    /// stays broken and [`HashChain::finish`] says so.
    fn link(&mut self, part: Bytes) -> impl Future<Output = Option<String>> + Send + 'static {
        let (sender, receiver) = oneshot::channel();
        let previous = std::mem::replace(&mut self.end, receiver);
        let first_link = self.links == 0;
        self.links += 1;
        async move {
            let mut hasher = previous.await.ok()?;
            let (hasher, part_sha256) = tokio::task::spawn_blocking(move || {
                hasher.update(&part);
                let part_sha256 = first_link.then(|| lowercase_hex(&hasher.clone().finalize()));
                (hasher, part_sha256)
            })
            .await
            .ok()?;
            let _ = sender.send(hasher);
            part_sha256
        }
    }

    /// The lowercase hex SHA-256 of every linked part, in order; `None` if a
    /// link never finished.
    async fn finish(self) -> Option<String> {
        let hasher = self.end.await.ok()?;
        Some(lowercase_hex(&hasher.finalize()))
    }
}

/// Buffers of uploaded parts, kept for the next parts: a fresh 8 MiB
/// allocation costs 2,048 page faults as it fills, a reused one none. Holds
/// at most `limit` buffers, and since one is only allocated when none is
/// spare, the writer never has more than `max_in_flight + 1` of them.
struct SpareBuffers {
    part_size: usize,
    limit: usize,
    buffers: Mutex<Vec<BytesMut>>,
}

impl SpareBuffers {
    fn new(part_size: usize, limit: usize) -> Self {
        SpareBuffers {
            part_size,
            limit,
            buffers: Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> BytesMut {
        let spare = self
            .buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        spare.unwrap_or_else(|| BytesMut::with_capacity(self.part_size))
    }

    /// Keeps the part's memory if nothing else refers to it any more (the
    /// SDK has dropped its request body by the time the call returns).
    fn give_back(&self, part: Bytes) {
        let Ok(mut buffer) = part.try_into_mut() else {
            return;
        };
        if buffer.capacity() < self.part_size {
            return;
        }
        buffer.clear();
        let mut buffers = self.buffers.lock().unwrap_or_else(PoisonError::into_inner);
        if buffers.len() < self.limit {
            buffers.push(buffer);
        }
    }
}

fn lowercase_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        hex.push(DIGITS[usize::from(byte >> 4)] as char);
        hex.push(DIGITS[usize::from(byte & 0x0f)] as char);
    }
    hex
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

    #[test]
    fn a_writer_can_move_between_tasks() {
        fn assert_send<T: Send + 'static>() {}
        assert_send::<MultipartWriter>();
    }

    #[test]
    fn hex_is_lowercase_and_two_digits_per_byte() {
        assert_eq!(lowercase_hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
    }
}

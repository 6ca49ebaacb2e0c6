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
//!
//! [`MultipartWriter`] composes three values, each keeping its own
//! invariants: the part being filled and the memory the writer holds
//! ([`buffer`]: buffer, spill file, pool accounting), the upload protocol
//! ([`upload`]: create, parts, complete, abort), and the document's SHA-256
//! ([`digest`]). The writer itself keeps the document's size within its
//! declared maximum and decides when a part leaves.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use crate::calls::UploadTarget;
use crate::counters::WriterCounters;
use crate::error::WriterError;
use crate::memory::MemoryPool;
use crate::policy::UploadPolicy;

mod buffer;
mod digest;
mod upload;

use buffer::{HeldPart, PartBuffer};
use digest::HashChain;
use upload::Upload;

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
    /// The additional checksum the server verified and stores with the
    /// object; `None` under `s3.checksum = "none"`.
    pub checksum: Option<crate::StoredChecksum>,
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
///
/// Dropped without `finish()` or `abort()`, it aborts its multipart upload in
/// the background, so no orphaned parts stay stored.
pub struct MultipartWriter {
    /// The current part, and the memory the writer holds.
    part: PartBuffer,
    /// The multipart upload (or single PutObject), and where it goes.
    upload: Upload,
    document_hash: HashChain,
    bytes_accepted: u64,
    declared_maximum: u64,
    /// Set by [`MultipartWriter::hold_first_part`].
    hold_first: bool,
    /// The first part, held until the document ends.
    held: Option<HeldPart>,
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
            part: PartBuffer::new(pool, part_size),
            upload: Upload::new(target, policy.max_in_flight),
            document_hash: HashChain::new(),
            bytes_accepted: 0,
            declared_maximum: policy.max_object_size,
            hold_first: false,
            held: None,
        })
    }

    /// Holds the document's first part until it ends, for a head known
    /// only then (a header with the document's totals): the part stays in
    /// memory (or in the spill file, where the pool had no room for it),
    /// counted in the pool, and goes up last, as part 1 after `head`, by
    /// [`finish_with_head`](Self::finish_with_head); S3 takes parts in any
    /// order. A document of at most one part is still one PutObject. The
    /// SHA-256 of such a document cannot be computed in part order, so the
    /// stored object is read back once and hashed, which also checks what
    /// the server stored. Call it before the first append.
    pub fn hold_first_part(&mut self) {
        debug_assert_eq!(self.bytes_accepted, 0, "held before any append");
        self.hold_first = true;
    }

    pub fn key(&self) -> &str {
        &self.upload.target().key
    }

    /// The size of every part but the last.
    pub fn part_size(&self) -> usize {
        self.part.part_size()
    }

    /// Bytes accepted so far.
    pub fn bytes_written(&self) -> u64 {
        self.bytes_accepted
    }

    /// Bytes the writer holds now: the buffer being filled plus the parts in
    /// flight.
    pub fn buffered_bytes(&self) -> u64 {
        let held = self
            .held
            .as_ref()
            .map_or(0, |held| held.len() - held.spilled_bytes());
        self.part.buffered_bytes() + held
    }

    /// Memory the writer holds now: its buffer's capacity plus the parts in
    /// flight. What the pool's budget counts.
    pub fn held_bytes(&self) -> u64 {
        self.part.held_bytes() + self.held.as_ref().map_or(0, HeldPart::held_bytes)
    }

    /// Bytes of the current part (and of a held first part) waiting in a
    /// spill file.
    pub fn spilled_bytes(&self) -> u64 {
        self.part.spilled_bytes() + self.held.as_ref().map_or(0, HeldPart::spilled_bytes)
    }

    /// The most bytes the writer has held at once. Checked at every part
    /// boundary; an upper bound, as it pairs the fullest buffer with the
    /// in-flight bytes as they stood when that buffer started filling.
    pub fn peak_buffered_bytes(&self) -> u64 {
        self.part.peak_bytes() + self.held.as_ref().map_or(0, HeldPart::held_bytes)
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
        poll_fn(|context| self.upload.poll_open(context)).await?;
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
        let fits = self.part.has_room_for(data.len())
            && data.len() as u64 <= self.declared_maximum - self.bytes_accepted
            && self.upload.is_open();
        if fits {
            self.part.push(data);
            self.bytes_accepted += data.len() as u64;
        }
        fits
    }

    /// Sends the last part and completes the upload, or stores a document of
    /// at most one part with one PutObject. On failure the multipart upload is
    /// aborted before the error is returned.
    pub async fn finish(self) -> Result<WrittenObject, WriterError> {
        self.finish_with_head(&[]).await
    }

    /// [`finish`](Self::finish) with `head` stored before every byte
    /// appended: with the first part held
    /// ([`hold_first_part`](Self::hold_first_part)), the bytes that only
    /// the document's end could give. Without it `head` must be empty.
    pub async fn finish_with_head(mut self, head: &[u8]) -> Result<WrittenObject, WriterError> {
        assert!(
            self.hold_first || head.is_empty(),
            "a head goes only before a held first part"
        );
        poll_fn(|context| self.upload.poll_open(context)).await?;
        match self.complete(head).await {
            Ok(written) => {
                self.upload.close_stored();
                self.upload.target().counters.document_completed();
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
                self.upload.abort_logging_failure("finish failed").await;
                Err(cause)
            }
        }
    }

    /// Abandons the document: stops the parts in flight and aborts the
    /// multipart upload, so no part stays stored and no object appears.
    pub async fn abort(mut self) -> Result<(), WriterError> {
        self.upload.abort("aborted by the caller").await
    }

    fn refuse_past_declared_maximum(&self, appended: usize) -> Result<(), WriterError> {
        let attempted_size = self.bytes_accepted + appended as u64;
        if attempted_size <= self.declared_maximum {
            return Ok(());
        }
        let target = self.upload.target();
        Err(WriterError::ObjectTooLarge {
            bucket: target.bucket.clone(),
            key: target.key.clone(),
            declared_maximum: self.declared_maximum,
            attempted_size,
        })
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
        ready!(self.upload.poll_open(context))?;
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.refuse_past_declared_maximum(data.len())?;
        if self.part.is_full()
            && let Err(cause) = ready!(self.poll_send_part(context))
        {
            self.upload.begin_abort_after_failure(cause);
            return self.upload.poll_open(context).map_ok(|()| 0);
        }
        let accepted = self.part.accept(data, &self.upload.target().key);
        self.bytes_accepted += accepted as u64;
        Poll::Ready(Ok(accepted))
    }

    /// Sends the current part: once the upload has room for it (created, and
    /// fewer than `max_in_flight` parts in flight) and the pool a permit for
    /// it, it leaves the buffer, takes the next place in the document's hash,
    /// and uploads in the background.
    /// A first part to hold is kept instead (see
    /// [`hold_first_part`](Self::hold_first_part)); the parts of such a
    /// document are hashed when it is read back, not in part order.
    fn poll_send_part(&mut self, context: &mut Context<'_>) -> Poll<Result<(), WriterError>> {
        if self.hold_first && self.held.is_none() && !self.upload.is_multipart() {
            self.held = Some(self.part.take_held());
            self.upload.reserve_first_part();
            return Poll::Ready(Ok(()));
        }
        ready!(self.upload.poll_room_for_part(context))?;
        let (body, memory) = ready!(self.part.poll_take(context));
        let hashing = (!self.hold_first).then(|| self.document_hash.link());
        self.upload.send_part(body, memory, hashing);
        Poll::Ready(Ok(()))
    }

    async fn complete(&mut self, head: &[u8]) -> Result<WrittenObject, WriterError> {
        self.refuse_past_declared_maximum(head.len())?;
        if !self.upload.is_multipart() && self.held.is_none() {
            // At most one part: one PutObject, no multipart upload.
            let (mut body, _memory) = poll_fn(|context| self.part.poll_take(context)).await;
            if !head.is_empty() {
                let loaded = body.load().await;
                let rest = self.spill_failure(loaded)?;
                let mut whole = bytes::BytesMut::with_capacity(head.len() + rest.len());
                whole.extend_from_slice(head);
                whole.extend_from_slice(&rest);
                body = buffer::PartBody::Memory(whole.freeze());
            }
            let hashing = self.document_hash.link();
            let (e_tag, checksum) = self.upload.put_object(body, hashing).await?;
            return self.written(1, true, e_tag, checksum, head.len()).await;
        }
        if self.part.unsent() > 0 {
            poll_fn(|context| self.poll_send_part(context)).await?;
        }
        if let Some(mut held) = self.held.take() {
            // Reading a spilled part back needs an open upload's room no
            // more than any part: it is the document's last call but one.
            poll_fn(|context| self.upload.poll_room_for_part(context)).await?;
            let first = held.with_head(head).await;
            let first = self.spill_failure(first)?;
            self.upload.upload_first_part(first).await?;
            drop(held);
        }
        let (parts, e_tag, checksum) = self.upload.complete().await?;
        self.written(parts, false, e_tag, checksum, head.len())
            .await
    }

    fn spill_failure<T>(&self, loaded: Result<T, String>) -> Result<T, WriterError> {
        loaded.map_err(|detail| {
            let target = self.upload.target();
            WriterError::Spill {
                bucket: target.bucket.clone(),
                key: target.key.clone(),
                detail,
            }
        })
    }

    /// What was stored, once every part has been hashed.
    async fn written(
        &mut self,
        parts: u32,
        single_put: bool,
        e_tag: Option<String>,
        checksum: Option<crate::StoredChecksum>,
        head_bytes: usize,
    ) -> Result<WrittenObject, WriterError> {
        let bytes = self.bytes_accepted + head_bytes as u64;
        let target = self.upload.target();
        let sha256_hex = if self.hold_first && !single_put {
            // Part 1 went up last: the object is hashed as stored.
            let (sha256_hex, stored) = target.read_back_sha256().await?;
            if stored != bytes {
                return Err(target.wrong_answer(
                    "GetObject",
                    format!("the stored object has {stored} bytes, not the {bytes} written"),
                ));
            }
            sha256_hex
        } else {
            let document_hash = std::mem::replace(&mut self.document_hash, HashChain::new());
            document_hash
                .finish()
                .await
                .ok_or_else(|| WriterError::HashingInterrupted {
                    bucket: target.bucket.clone(),
                    key: target.key.clone(),
                })?
        };
        Ok(WrittenObject {
            bucket: target.bucket.clone(),
            key: target.key.clone(),
            bytes,
            parts,
            sha256_hex,
            single_put,
            e_tag,
            checksum,
        })
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
            .upload
            .poll_open(context)
            .map_err(std::io::Error::from)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.poll_flush(context)
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
        assert!(!writer.upload.is_multipart());
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
        let (body, memory) = writer.part.take(permit);
        let part = body.load().await.expect("read back");
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

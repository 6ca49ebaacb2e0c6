//! The upload protocol of one document: a single PutObject for a document of
//! at most one part; otherwise CreateMultipartUpload (by the first part),
//! parts uploaded in tasks of their own with at most `max_in_flight` in
//! flight, CompleteMultipartUpload; and the abort, whoever asks for it. Each
//! call is retried by [`UploadTarget`] (`calls.rs`).
//!
//! An [`Upload`] is a state machine ([`State`]): nothing sent, creating,
//! open, aborting after a failure, closed. Whatever S3 holds of it is
//! aborted when it fails, when its writer asks, and when it is dropped
//! before it closed.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use aws_sdk_s3::types::CompletedPart;
use bytes::Bytes;
use tokio::task::{JoinError, JoinHandle, JoinSet};

use super::buffer::{InFlightMemory, PartBody};
use super::digest::HashLink;
use crate::StoredChecksum;
use crate::calls::UploadTarget;
use crate::checksum::{PartChecksum, object_checksum};
use crate::counters::WriterCounters;
use crate::error::WriterError;

/// How long an abort lets the part attempts under way end before it cuts
/// them off.
const ABORT_GRACE_PERIOD: Duration = Duration::from_secs(10);

/// One document's upload (see the module).
pub(super) struct Upload {
    target: Arc<UploadTarget>,
    max_in_flight: usize,
    parts_sent: u32,
    state: State,
}

enum State {
    /// Nothing was sent to S3: a document that ends now is stored with one
    /// PutObject.
    NotStarted,
    /// CreateMultipartUpload, running as a task of its own so that a writer
    /// dropped meanwhile can still learn the upload id and abort it.
    Creating(JoinHandle<Result<String, WriterError>>),
    Open(OpenUpload),
    /// A part failed: the upload is being aborted, and the failure is handed
    /// to the caller once the abort has ended.
    AbortingAfterFailure {
        abort: JoinHandle<()>,
        cause: Option<WriterError>,
    },
    /// Finished, aborted, or failed (the failure was already returned).
    Closed,
}

/// A stored part and the checksum it was stored with.
type UploadedPart = (CompletedPart, Option<PartChecksum>);

struct OpenUpload {
    upload_id: Arc<str>,
    in_flight: JoinSet<Result<UploadedPart, WriterError>>,
    completed_parts: Vec<UploadedPart>,
}

/// What S3 may hold of an upload: what an abort has to undo.
enum Started {
    Creating(JoinHandle<Result<String, WriterError>>),
    Open(OpenUpload),
}

impl State {
    /// What S3 may hold of the upload in this state.
    fn into_started(self) -> Option<Started> {
        match self {
            State::Creating(creation) => Some(Started::Creating(creation)),
            State::Open(upload) => Some(Started::Open(upload)),
            State::NotStarted | State::AbortingAfterFailure { .. } | State::Closed => None,
        }
    }
}

impl Upload {
    pub(super) fn new(target: UploadTarget, max_in_flight: usize) -> Self {
        Upload {
            target: Arc::new(target),
            max_in_flight,
            parts_sent: 0,
            state: State::NotStarted,
        }
    }

    pub(super) fn target(&self) -> &UploadTarget {
        &self.target
    }

    /// Whether the writer may still take bytes: no failure, not closed.
    #[inline]
    pub(super) fn is_open(&self) -> bool {
        matches!(
            self.state,
            State::NotStarted | State::Creating(_) | State::Open(_)
        )
    }

    /// Whether a multipart upload was started (or is being created).
    pub(super) fn is_multipart(&self) -> bool {
        matches!(self.state, State::Creating(_) | State::Open(_))
    }

    pub(super) fn closed_error(&self) -> WriterError {
        WriterError::Closed {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
        }
    }

    /// Ready(Ok) while the upload is open; otherwise the error to return,
    /// once the abort that a failure started has ended.
    pub(super) fn poll_open(&mut self, context: &mut Context<'_>) -> Poll<Result<(), WriterError>> {
        match &mut self.state {
            State::AbortingAfterFailure { abort, cause } => {
                // The abort task logs its own failure; a panic in it leaves the
                // upload to the take-over sweep, and the cause still stands.
                let _ = ready!(Pin::new(abort).poll(context));
                let cause = cause.take();
                self.state = State::Closed;
                Poll::Ready(Err(cause.unwrap_or_else(|| self.closed_error())))
            }
            State::Closed => Poll::Ready(Err(self.closed_error())),
            State::NotStarted | State::Creating(_) | State::Open(_) => Poll::Ready(Ok(())),
        }
    }

    /// Ready once the next part may be sent: creates the multipart upload
    /// first if this is the first part, then waits until fewer than
    /// `max_in_flight` parts are in flight (collecting the parts that ended,
    /// and their failures).
    pub(super) fn poll_room_for_part(
        &mut self,
        context: &mut Context<'_>,
    ) -> Poll<Result<(), WriterError>> {
        loop {
            match &mut self.state {
                State::NotStarted => {
                    let creation = tokio::spawn(self.target.clone().create_multipart_upload());
                    self.state = State::Creating(creation);
                }
                State::Creating(creation) => {
                    let created = ready!(Pin::new(creation).poll(context));
                    // Created or not, there is no creation left to abort.
                    self.state = State::NotStarted;
                    let upload_id = created.map_err(|source| self.task_ended(source))??;
                    self.state = State::Open(OpenUpload {
                        upload_id: upload_id.into(),
                        in_flight: JoinSet::new(),
                        completed_parts: Vec::new(),
                    });
                }
                State::Open(_) => break,
                State::AbortingAfterFailure { .. } | State::Closed => {
                    return Poll::Ready(Err(self.closed_error()));
                }
            }
        }
        let State::Open(upload) = &mut self.state else {
            unreachable!("the loop above ends with the upload open")
        };
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
        Poll::Ready(Ok(()))
    }

    /// Starts the upload of the next part, and its hashing, in a task of its
    /// own; call it once [`Self::poll_room_for_part`] is ready.
    pub(super) fn send_part(
        &mut self,
        body: PartBody,
        memory: InFlightMemory,
        hashing: Option<HashLink>,
    ) {
        let State::Open(upload) = &mut self.state else {
            panic!("parts are sent into an open upload");
        };
        self.parts_sent += 1;
        let part_number = self.parts_sent as i32;
        let in_flight = InFlightPart::start(self.target.counters.clone(), memory);
        let target = self.target.clone();
        let upload_id = upload.upload_id.clone();
        upload.in_flight.spawn(async move {
            // The part counts as in flight until it is both stored and hashed,
            // so the accounting covers every reference to its buffer.
            let in_flight = in_flight;
            let part = load(body, &target).await?;
            let checksum = PartChecksum::compute(target.checksum, &part).await;
            let uploaded = match hashing {
                Some(hashing) => {
                    hashing
                        .hash_while(part.clone(), target.signs_payload(), |payload_sha256| {
                            target.upload_part(
                                &upload_id,
                                part_number,
                                &part,
                                payload_sha256,
                                checksum,
                            )
                        })
                        .await
                }
                None => {
                    target
                        .upload_part(&upload_id, part_number, &part, None, checksum)
                        .await
                }
            };
            if uploaded.is_ok() {
                in_flight.memory.give_back(part);
            }
            uploaded.map(|completed| (completed, checksum))
        });
    }

    /// Keeps part number 1 for a part uploaded last
    /// ([`Self::upload_first_part`]); the parts sent from now on are 2, 3...
    pub(super) fn reserve_first_part(&mut self) {
        debug_assert_eq!(self.parts_sent, 0);
        self.parts_sent = 1;
    }

    /// Uploads the part reserved by [`Self::reserve_first_part`], now
    /// that its bytes are known, into the open upload.
    pub(super) async fn upload_first_part(&mut self, part: Bytes) -> Result<(), WriterError> {
        let State::Open(upload) = &mut self.state else {
            panic!("the first part goes into an open upload");
        };
        let checksum = PartChecksum::compute(self.target.checksum, &part).await;
        let completed = self
            .target
            .upload_part(&upload.upload_id, 1, &part, None, checksum)
            .await?;
        upload.completed_parts.push((completed, checksum));
        Ok(())
    }

    /// Stores a whole document of at most one part with one PutObject (no
    /// multipart upload), hashing it on the way. Returns its ETag and its
    /// checksum.
    pub(super) async fn put_object(
        &self,
        body: PartBody,
        hashing: HashLink,
    ) -> Result<(Option<String>, Option<StoredChecksum>), WriterError> {
        debug_assert!(!self.is_multipart());
        let document = load(body, &self.target).await?;
        let checksum = PartChecksum::compute(self.target.checksum, &document).await;
        let e_tag = hashing
            .hash_while(
                document.clone(),
                self.target.signs_payload(),
                |payload_sha256| self.target.put_object(&document, payload_sha256, checksum),
            )
            .await?;
        let stored = checksum.and_then(|checksum| object_checksum(&[checksum], true));
        Ok((e_tag, stored))
    }

    /// Waits for every part sent and completes the multipart upload. Returns
    /// the number of parts, the object's ETag and its checksum. On failure
    /// the upload is still open, for the caller to abort.
    pub(super) async fn complete(
        &mut self,
    ) -> Result<(u32, Option<String>, Option<StoredChecksum>), WriterError> {
        let State::Open(upload) = &mut self.state else {
            panic!("a multipart upload is open");
        };
        while let Some(ended) = upload.in_flight.join_next().await {
            record_ended_part(upload, ended, &self.target)?;
        }
        let mut parts = std::mem::take(&mut upload.completed_parts);
        parts.sort_by_key(|(part, _)| part.part_number());
        debug_assert_eq!(parts.len(), self.parts_sent as usize);
        let checksums: Option<Vec<PartChecksum>> =
            parts.iter().map(|(_, checksum)| *checksum).collect();
        let checksum = checksums.and_then(|checksums| object_checksum(&checksums, false));
        let parts = parts.into_iter().map(|(part, _)| part).collect();
        let e_tag = self
            .target
            .complete_multipart_upload(&upload.upload_id, parts, checksum.as_ref())
            .await?;
        Ok((self.parts_sent, e_tag, checksum))
    }

    /// The document is stored: nothing is left to abort.
    pub(super) fn close_stored(&mut self) {
        self.state = State::Closed;
    }

    /// Closes the upload and aborts it in the background; the failure that
    /// made it necessary is returned by [`Self::poll_open`] once the abort
    /// has ended.
    pub(super) fn begin_abort_after_failure(&mut self, cause: WriterError) {
        let started = std::mem::replace(&mut self.state, State::Closed).into_started();
        let abort = tokio::spawn(abort_upload_logging_failure(
            self.target.clone(),
            started,
            "a part failed",
        ));
        self.state = State::AbortingAfterFailure {
            abort,
            cause: Some(cause),
        };
    }

    /// Closes the upload and aborts it, logging an abort that fails (for a
    /// caller with an error of its own to return).
    pub(super) async fn abort_logging_failure(&mut self, reason: &'static str) {
        let started = std::mem::replace(&mut self.state, State::Closed).into_started();
        abort_upload_logging_failure(self.target.clone(), started, reason).await;
    }

    /// Closes the upload and aborts it: stops the parts in flight, so no part
    /// stays stored and no object appears. An abort a failure already
    /// started is waited for.
    pub(super) async fn abort(&mut self, reason: &str) -> Result<(), WriterError> {
        match std::mem::replace(&mut self.state, State::Closed) {
            State::AbortingAfterFailure { abort, .. } => {
                // A failure already started the abort; wait for it to end.
                let _ = abort.await;
                Ok(())
            }
            State::Closed => Ok(()),
            state => abort_upload(self.target.clone(), state.into_started(), reason).await,
        }
    }

    fn task_ended(&self, source: JoinError) -> WriterError {
        WriterError::PartTaskEnded {
            bucket: self.target.bucket.clone(),
            key: self.target.key.clone(),
            source,
        }
    }
}

impl Drop for Upload {
    /// An upload dropped before it closed (its writer dropped without
    /// `finish()` or `abort()`) is aborted in the background, so no orphaned
    /// parts stay stored.
    fn drop(&mut self) {
        let Some(started) = std::mem::replace(&mut self.state, State::Closed).into_started() else {
            // Nothing was sent to S3, or the upload already ended.
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(abort_upload_logging_failure(
                    self.target.clone(),
                    Some(started),
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

/// A part's bytes in memory; a spill that cannot be read back fails the part.
async fn load(body: PartBody, target: &UploadTarget) -> Result<Bytes, WriterError> {
    body.load().await.map_err(|detail| WriterError::Spill {
        bucket: target.bucket.clone(),
        key: target.key.clone(),
        detail,
    })
}

/// A part's task, counted as in flight (with its memory) for as long as it
/// runs, however it ends.
struct InFlightPart {
    counters: Arc<WriterCounters>,
    memory: InFlightMemory,
}

impl InFlightPart {
    fn start(counters: Arc<WriterCounters>, memory: InFlightMemory) -> Self {
        counters.part_started();
        InFlightPart { counters, memory }
    }
}

impl Drop for InFlightPart {
    fn drop(&mut self) {
        self.counters.part_ended();
    }
}

fn record_ended_part(
    upload: &mut OpenUpload,
    ended: Result<Result<UploadedPart, WriterError>, JoinError>,
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

/// Lets the part attempts under way end (no new attempt starts), learns the
/// upload id if the creation was still running, and aborts the upload.
///
/// Why not cut the parts off at once: a server may still store a part whose
/// request the client dropped (it had the whole body already), after the
/// abort, where no listing shows it and nothing deletes it. An attempt that
/// ended with an answer cannot land later.
async fn abort_upload(
    target: Arc<UploadTarget>,
    started: Option<Started>,
    reason: &str,
) -> Result<(), WriterError> {
    target.abandoned.cancel();
    let upload_id: Arc<str> = match started {
        Some(Started::Open(mut upload)) => {
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
        Some(Started::Creating(creation)) => match creation.await {
            Ok(Ok(upload_id)) => upload_id.into(),
            // The upload was never created: nothing to abort.
            _ => return Ok(()),
        },
        None => return Ok(()),
    };
    target.abort_multipart_upload(&upload_id, reason).await
}

async fn abort_upload_logging_failure(
    target: Arc<UploadTarget>,
    started: Option<Started>,
    reason: &'static str,
) {
    let bucket = target.bucket.clone();
    let key = target.key.clone();
    if let Err(error) = abort_upload(target, started, reason).await {
        tracing::error!(
            %bucket,
            %key,
            reason,
            %error,
            "multipart upload could not be aborted: a take-over sweep must abort it"
        );
    }
}

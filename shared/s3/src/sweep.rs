//! The take-over sweep: pending multipart uploads a dead owner left behind,
//! listed and aborted.

use crate::bucket::S3Bucket;
use crate::calls::{CallLabel, abort_upload, call_settings_without_retries, with_retries};
use crate::error::WriterError;
use crate::policy::RetryPolicy;

/// A multipart upload that was started and neither completed nor aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingUpload {
    pub key: String,
    pub upload_id: String,
}

impl S3Bucket {
    /// Every pending multipart upload whose key starts with `prefix`, all
    /// pages of ListMultipartUploads.
    pub async fn list_pending_uploads(
        &self,
        prefix: &str,
    ) -> Result<Vec<PendingUpload>, WriterError> {
        let retry = RetryPolicy::default();
        let call = CallLabel::new("ListMultipartUploads", prefix);
        let mut pending = Vec::new();
        let mut key_marker: Option<String> = None;
        let mut upload_id_marker: Option<String> = None;
        loop {
            let page = with_retries(&retry, self.counters(), &call, |_attempt| {
                self.client()
                    .list_multipart_uploads()
                    .bucket(self.name())
                    .prefix(prefix)
                    .set_key_marker(key_marker.clone())
                    .set_upload_id_marker(upload_id_marker.clone())
                    .customize()
                    .config_override(call_settings_without_retries())
                    .send()
            })
            .await
            .map_err(|failure| WriterError::ListUploads {
                bucket: self.name().to_owned(),
                prefix: prefix.to_owned(),
                detail: failure.detail,
            })?;
            pending.extend(page.uploads().iter().filter_map(|upload| {
                Some(PendingUpload {
                    key: upload.key()?.to_owned(),
                    upload_id: upload.upload_id()?.to_owned(),
                })
            }));
            if page.is_truncated() != Some(true) {
                return Ok(pending);
            }
            let next_key_marker = page.next_key_marker().map(str::to_owned);
            let next_upload_id_marker = page.next_upload_id_marker().map(str::to_owned);
            let advances = next_key_marker.is_some()
                && (next_key_marker != key_marker || next_upload_id_marker != upload_id_marker);
            if !advances {
                // A server that says "truncated" without moving its markers
                // would loop us forever; what we have is what we can get.
                tracing::warn!(bucket = %self.name(), prefix, "listing of pending uploads is truncated but does not advance");
                return Ok(pending);
            }
            key_marker = next_key_marker;
            upload_id_marker = next_upload_id_marker;
        }
    }

    /// The take-over sweep: aborts every pending multipart upload whose key
    /// starts with `prefix` (uploads left by a writer whose process died) and
    /// returns how many it aborted. Uploads that vanish meanwhile (their
    /// writer finished or aborted them) are not counted.
    ///
    /// Only call it for keys no live writer is writing: the new owner of a
    /// partition sweeps that partition's keys before it opens documents there.
    pub async fn abort_pending_uploads(&self, prefix: &str) -> Result<usize, WriterError> {
        self.abort_pending_uploads_where(prefix, |_key| true).await
    }

    /// The take-over sweep for keys a prefix alone cannot select: aborts the
    /// pending uploads under `prefix` whose key `belongs` accepts (a worker
    /// taking record partition p sweeps `reports/*/p-*`, across streams).
    pub async fn abort_pending_uploads_where(
        &self,
        prefix: &str,
        belongs: impl Fn(&str) -> bool,
    ) -> Result<usize, WriterError> {
        let retry = RetryPolicy::default();
        let pending: Vec<PendingUpload> = self
            .list_pending_uploads(prefix)
            .await?
            .into_iter()
            .filter(|upload| belongs(&upload.key))
            .collect();
        let mut aborted = 0;
        for upload in &pending {
            let aborted_now = abort_upload(
                self.client(),
                self.name(),
                &upload.key,
                &upload.upload_id,
                &retry,
                self.counters(),
                call_settings_without_retries(),
            )
            .await?;
            if aborted_now {
                aborted += 1;
                tracing::info!(
                    bucket = %self.name(),
                    key = %upload.key,
                    upload_id = %upload.upload_id,
                    "pending multipart upload aborted by take-over sweep"
                );
            }
        }
        tracing::info!(bucket = %self.name(), prefix, found = pending.len(), aborted, "take-over sweep done");
        Ok(aborted)
    }
}

//! Every S3 call the writer and the sweep make, each retried with backoff and
//! jitter, each attempt traced and counted.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use aws_runtime::auth::PayloadSigningOverride;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextMut;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_s3::error::{BoxError, DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumAlgorithm, ChecksumType, CompletedMultipartUpload, CompletedPart};
use backon::Retryable;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::checksum::{FULL_OBJECT, PartChecksum, StoredChecksum, answers_match};
use crate::counters::WriterCounters;
use crate::error::WriterError;
use crate::policy::{RetryPolicy, UploadPolicy};

type HttpResponse = aws_sdk_s3::config::http::HttpResponse;

/// Where a document goes and how its calls behave; shared by the writer and
/// its background part uploads.
#[derive(Debug)]
pub(crate) struct UploadTarget {
    pub client: Client,
    pub bucket: String,
    pub key: String,
    /// Stored with the object; `None`: the server's default.
    pub content_type: Option<String>,
    pub retry: RetryPolicy,
    pub counters: Arc<WriterCounters>,
    /// Whether SigV4 signs the bodies of parts and single puts.
    sign_payload: bool,
    /// The additional checksum of parts and objects.
    pub checksum: quire_config::ChecksumChoice,
    /// Set when the upload is being aborted: no new attempt starts.
    /// Cancelled when the upload is being aborted: no new attempt starts.
    pub abandoned: CancellationToken,
    /// Timeouts of one attempt: the policy's attempt timeout over the
    /// client's own (connect timeout...).
    timeouts: TimeoutConfig,
}

impl UploadTarget {
    pub fn new(
        client: Client,
        bucket: String,
        key: String,
        content_type: Option<String>,
        policy: &UploadPolicy,
        counters: Arc<WriterCounters>,
    ) -> Self {
        let mut timeouts = TimeoutConfig::builder()
            .operation_attempt_timeout(policy.attempt_timeout)
            .build();
        if let Some(client_timeouts) = client.config().timeout_config() {
            timeouts.take_defaults_from(client_timeouts);
        }
        UploadTarget {
            client,
            bucket,
            key,
            content_type,
            retry: policy.retry.clone(),
            counters,
            sign_payload: policy.sign_payload,
            checksum: policy.checksum,
            abandoned: CancellationToken::new(),
            timeouts,
        }
    }

    /// Per-call settings: no SDK retries (we retry per part so that every
    /// attempt is traced and counted, and a part's bytes are re-sent from the
    /// same buffer), and a bounded attempt.
    fn call_settings(&self) -> aws_sdk_s3::config::Builder {
        aws_sdk_s3::config::Builder::default()
            .retry_config(RetryConfig::disabled())
            .timeout_config(self.timeouts.clone())
    }

    fn failure(&self, operation: &'static str, failure: CallFailure) -> WriterError {
        WriterError::S3 {
            operation,
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            attempts: failure.attempts,
            status: failure.status,
            retryable: failure.retryable,
            detail: failure.detail,
        }
    }

    /// A call that succeeded with an answer the writer cannot accept: not
    /// worth repeating as it is (the caller aborts and starts again).
    pub(crate) fn wrong_answer(&self, operation: &'static str, detail: String) -> WriterError {
        WriterError::S3 {
            operation,
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            attempts: 1,
            status: None,
            retryable: false,
            detail,
        }
    }

    /// Starts a multipart upload and returns its id.
    pub async fn create_multipart_upload(self: Arc<Self>) -> Result<String, WriterError> {
        let call = CallLabel::new("CreateMultipartUpload", &self.key).stopped_by(&self.abandoned);
        let output = with_retries(&self.retry, &self.counters, &call, |_attempt| {
            self.client
                .create_multipart_upload()
                .bucket(&self.bucket)
                .key(&self.key)
                .set_content_type(self.content_type.clone())
                .set_checksum_algorithm(self.checksum_algorithm())
                .set_checksum_type(self.checksum_type())
                .customize()
                .config_override(self.call_settings())
                .send()
        })
        .await
        .map_err(|failure| self.failure(call.operation, failure))?;
        let upload_id = output.upload_id.ok_or_else(|| {
            self.wrong_answer(call.operation, "the answer carries no upload id".to_owned())
        })?;
        tracing::debug!(bucket = %self.bucket, key = %self.key, upload_id = %upload_id, "multipart upload created");
        Ok(upload_id)
    }

    /// The upload's checksum algorithm, declared when it is created.
    fn checksum_algorithm(&self) -> Option<ChecksumAlgorithm> {
        match self.checksum {
            quire_config::ChecksumChoice::Crc32c => Some(ChecksumAlgorithm::Crc32C),
            quire_config::ChecksumChoice::Sha256 => Some(ChecksumAlgorithm::Sha256),
            quire_config::ChecksumChoice::None => None,
        }
    }

    /// CRC32C parts combine into a full-object checksum; SHA-256 ones only
    /// into a composite one.
    fn checksum_type(&self) -> Option<ChecksumType> {
        match self.checksum {
            quire_config::ChecksumChoice::Crc32c => Some(ChecksumType::FullObject),
            quire_config::ChecksumChoice::Sha256 => Some(ChecksumType::Composite),
            quire_config::ChecksumChoice::None => None,
        }
    }

    /// Whether SigV4 signs the bodies, so a payload hash is worth handing it.
    pub fn signs_payload(&self) -> bool {
        self.sign_payload
    }

    /// Uploads one part; every retry re-sends the same `part` (a cheap clone
    /// of a shared buffer, not a copy). `payload_sha256`, the part's SHA-256
    /// in lowercase hex if the caller has it, spares SigV4 hashing it again.
    /// `checksum`, the part's additional checksum, goes with it: the server
    /// refuses the part if its bytes do not match (and it is sent again).
    pub async fn upload_part(
        &self,
        upload_id: &str,
        part_number: i32,
        part: &Bytes,
        payload_sha256: Option<String>,
        checksum: Option<PartChecksum>,
    ) -> Result<CompletedPart, WriterError> {
        let (crc32c, sha256) = checksum_values(checksum);
        let call = CallLabel::new("UploadPart", &self.key)
            .part(part_number, part.len())
            .stopped_by(&self.abandoned);
        let output = with_retries(&self.retry, &self.counters, &call, |_attempt| {
            let request = self
                .client
                .upload_part()
                .bucket(&self.bucket)
                .key(&self.key)
                .upload_id(upload_id)
                .part_number(part_number)
                .content_length(part.len() as i64)
                .set_checksum_crc32_c(crc32c.clone())
                .set_checksum_sha256(sha256.clone())
                .body(ByteStream::from(part.clone()))
                .customize()
                .config_override(self.call_settings());
            match (self.sign_payload, &payload_sha256) {
                (false, _) => request.disable_payload_signing().send(),
                (true, None) => request.send(),
                (true, Some(sha256)) => request
                    .interceptor(PrecomputedPayloadHash(sha256.clone()))
                    .send(),
            }
        })
        .await
        .map_err(|failure| self.failure(call.operation, failure))?;
        self.counters.part_uploaded(part.len() as u64);
        Ok(CompletedPart::builder()
            .part_number(part_number)
            .set_e_tag(output.e_tag)
            .set_checksum_crc32_c(crc32c)
            .set_checksum_sha256(sha256)
            .build())
    }

    /// Stores a document of at most one part with one PutObject;
    /// `payload_sha256` as for [`UploadTarget::upload_part`].
    pub async fn put_object(
        &self,
        document: &Bytes,
        payload_sha256: Option<String>,
        checksum: Option<PartChecksum>,
    ) -> Result<Option<String>, WriterError> {
        let (crc32c, sha256) = checksum_values(checksum);
        let call = CallLabel::new("PutObject", &self.key)
            .part(1, document.len())
            .stopped_by(&self.abandoned);
        let output = with_retries(&self.retry, &self.counters, &call, |_attempt| {
            let request = self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(&self.key)
                .set_content_type(self.content_type.clone())
                .content_length(document.len() as i64)
                .set_checksum_crc32_c(crc32c.clone())
                .set_checksum_sha256(sha256.clone())
                .body(ByteStream::from(document.clone()))
                .customize()
                .config_override(self.call_settings());
            match (self.sign_payload, &payload_sha256) {
                (false, _) => request.disable_payload_signing().send(),
                (true, None) => request.send(),
                (true, Some(sha256)) => request
                    .interceptor(PrecomputedPayloadHash(sha256.clone()))
                    .send(),
            }
        })
        .await
        .map_err(|failure| self.failure(call.operation, failure))?;
        self.counters.single_put(document.len() as u64);
        Ok(output.e_tag)
    }

    /// Reads the stored object back and returns its SHA-256 (lowercase
    /// hex) and length: the digest of a document whose first part was
    /// uploaded last, which no hash in part order can give, and a check of
    /// what the server stored. Hashed on the blocking pool, 8 MiB at a
    /// time; a failed read is read again from the start, with backoff.
    pub async fn read_back_sha256(&self) -> Result<(String, u64), WriterError> {
        use backon::BackoffBuilder as _;
        let mut delays = self.retry.backoff().build();
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.read_back_once().await {
                Ok(read) => return Ok(read),
                Err(detail) => match delays.next() {
                    Some(delay) if attempts < self.retry.max_attempts => {
                        tracing::warn!(key = %self.key, attempts, %detail, "reading the document back failed; again");
                        tokio::time::sleep(delay).await;
                    }
                    _ => {
                        return Err(WriterError::S3 {
                            operation: "GetObject",
                            bucket: self.bucket.clone(),
                            key: self.key.clone(),
                            attempts,
                            status: None,
                            retryable: true,
                            detail,
                        });
                    }
                },
            }
        }
    }

    async fn read_back_once(&self) -> Result<(String, u64), String> {
        use sha2::Digest as _;
        const BATCH: usize = 8 * 1024 * 1024;
        let output = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(&self.key)
            .customize()
            .config_override(self.call_settings())
            .send()
            .await
            .map_err(|error| DisplayErrorContext(&error).to_string())?;
        let mut body = output.body;
        let mut hasher = sha2::Sha256::new();
        let mut length = 0u64;
        let mut batch = bytes::BytesMut::with_capacity(BATCH);
        loop {
            let chunk = body
                .try_next()
                .await
                .map_err(|error| format!("reading the body: {error}"))?;
            let last = chunk.is_none();
            if let Some(chunk) = chunk {
                length += chunk.len() as u64;
                batch.extend_from_slice(&chunk);
            }
            if batch.len() >= BATCH || (last && !batch.is_empty()) {
                let bytes = std::mem::replace(&mut batch, bytes::BytesMut::with_capacity(BATCH));
                hasher = tokio::task::spawn_blocking(move || {
                    hasher.update(&bytes);
                    hasher
                })
                .await
                .map_err(|error| format!("hashing ended without a result: {error}"))?;
            }
            if last {
                return Ok((hex::encode(hasher.finalize()), length));
            }
        }
    }

    /// Completes the upload from its parts, in part-number order. A
    /// full-object checksum goes with the request, for the server to
    /// verify against what it stored; the checksum the server answers with
    /// must be `checksum`, or the completion fails (and the caller aborts
    /// the upload: a document whose bytes S3 holds otherwise is never
    /// announced).
    pub async fn complete_multipart_upload(
        &self,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        checksum: Option<&StoredChecksum>,
    ) -> Result<Option<String>, WriterError> {
        let call = CallLabel::new("CompleteMultipartUpload", &self.key);
        let completed = CompletedMultipartUpload::builder()
            .set_parts(Some(parts))
            .build();
        let full_object = checksum.filter(|checksum| checksum.kind == FULL_OBJECT);
        let output = with_retries(&self.retry, &self.counters, &call, |_attempt| {
            let request = self
                .client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(&self.key)
                .upload_id(upload_id)
                .multipart_upload(completed.clone());
            let request = match full_object {
                Some(checksum) if checksum.algorithm == "CRC32C" => request
                    .checksum_crc32_c(checksum.value.clone())
                    .checksum_type(ChecksumType::FullObject),
                _ => request,
            };
            request
                .customize()
                .config_override(self.call_settings())
                .send()
        })
        .await
        .map_err(|failure| self.failure(call.operation, failure))?;
        if let Some(expected) = checksum {
            let answered = match expected.algorithm {
                "CRC32C" => output.checksum_crc32_c(),
                _ => output.checksum_sha256(),
            };
            if let Some(answered) = answered
                && !answers_match(expected, answered)
            {
                return Err(self.wrong_answer(
                    call.operation,
                    format!(
                        "the server stored the object with {} {answered}, not the {} computed while it streamed",
                        expected.algorithm, expected.value
                    ),
                ));
            }
        }
        Ok(output.e_tag)
    }

    /// Aborts the upload. An upload the server no longer knows counts as
    /// aborted: someone (a retry, a sweep) already did it.
    pub async fn abort_multipart_upload(
        &self,
        upload_id: &str,
        reason: &str,
    ) -> Result<(), WriterError> {
        let aborted_by_this_call = abort_upload(
            &self.client,
            &self.bucket,
            &self.key,
            upload_id,
            &self.retry,
            &self.counters,
            self.call_settings(),
        )
        .await?;
        if aborted_by_this_call {
            tracing::info!(bucket = %self.bucket, key = %self.key, upload_id, reason, "multipart upload aborted");
        } else {
            tracing::info!(bucket = %self.bucket, key = %self.key, upload_id, reason, "multipart upload was already gone");
        }
        Ok(())
    }
}

/// A part's checksum as the request's CRC32C and SHA-256 header values.
fn checksum_values(checksum: Option<PartChecksum>) -> (Option<String>, Option<String>) {
    match checksum {
        Some(checksum @ PartChecksum::Crc32c { .. }) => (Some(checksum.base64()), None),
        Some(checksum @ PartChecksum::Sha256(_)) => (None, Some(checksum.base64())),
        None => (None, None),
    }
}

/// Aborts one multipart upload with retries; `Ok(true)` if this call aborted
/// it, `Ok(false)` if the server no longer knew it.
pub(crate) async fn abort_upload(
    client: &Client,
    bucket: &str,
    key: &str,
    upload_id: &str,
    retry: &RetryPolicy,
    counters: &WriterCounters,
    call_settings: aws_sdk_s3::config::Builder,
) -> Result<bool, WriterError> {
    let call = CallLabel::new("AbortMultipartUpload", key);
    let result = with_retries(retry, counters, &call, |_attempt| {
        client
            .abort_multipart_upload()
            .bucket(bucket)
            .key(key)
            .upload_id(upload_id)
            .customize()
            .config_override(call_settings.clone())
            .send()
    })
    .await;
    match result {
        Ok(_) => {
            counters.upload_aborted();
            Ok(true)
        }
        Err(failure) if failure.status == Some(404) => Ok(false),
        Err(failure) => Err(WriterError::S3 {
            operation: call.operation,
            bucket: bucket.to_owned(),
            key: key.to_owned(),
            attempts: failure.attempts,
            status: failure.status,
            retryable: failure.retryable,
            detail: failure.detail,
        }),
    }
}

/// Hands SigV4 the body's SHA-256 computed beforehand (lowercase hex), so
/// the signer does not hash the body a second time. The server checks it
/// against the bytes it receives, as it would a hash the signer computed.
#[derive(Debug)]
struct PrecomputedPayloadHash(String);

impl Intercept for PrecomputedPayloadHash {
    fn name(&self) -> &'static str {
        "PrecomputedPayloadHash"
    }

    fn modify_before_signing(
        &self,
        _context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _runtime_components: &RuntimeComponents,
        config: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        config
            .interceptor_state()
            .store_put(PayloadSigningOverride::Precomputed(self.0.clone()));
        Ok(())
    }
}

/// Per-call settings for callers without an [`UploadTarget`] (the sweep).
pub(crate) fn call_settings_without_retries() -> aws_sdk_s3::config::Builder {
    aws_sdk_s3::config::Builder::default().retry_config(RetryConfig::disabled())
}

/// What a traced call is: operation, key and, for parts, number and size.
pub(crate) struct CallLabel<'a> {
    pub operation: &'static str,
    pub key: &'a str,
    pub part_number: Option<i32>,
    pub bytes: Option<usize>,
    /// Once this is stopped, no further attempt of the call starts and a
    /// backoff wait ends early.
    pub stop: Option<CancellationToken>,
}

impl<'a> CallLabel<'a> {
    pub fn new(operation: &'static str, key: &'a str) -> Self {
        CallLabel {
            operation,
            key,
            part_number: None,
            bytes: None,
            stop: None,
        }
    }

    fn part(mut self, part_number: i32, bytes: usize) -> Self {
        self.part_number = Some(part_number);
        self.bytes = Some(bytes);
        self
    }

    fn stopped_by(mut self, stop: &CancellationToken) -> Self {
        self.stop = Some(stop.clone());
        self
    }

    fn is_stopped(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled)
    }
}

/// How a call failed for good.
#[derive(Debug)]
pub(crate) struct CallFailure {
    pub attempts: u32,
    pub status: Option<u16>,
    pub retryable: bool,
    pub detail: String,
}

/// Runs `attempt_once` until it succeeds, fails with an error that is not
/// retryable, or the policy's attempts run out; waits between attempts with
/// exponential backoff and jitter. Each attempt is traced (operation, key,
/// part number, bytes, attempt, duration) and each retry counted.
pub(crate) async fn with_retries<T, E, AttemptFuture>(
    retry: &RetryPolicy,
    counters: &WriterCounters,
    call: &CallLabel<'_>,
    mut attempt_once: impl FnMut(u32) -> AttemptFuture,
) -> Result<T, CallFailure>
where
    AttemptFuture: Future<Output = Result<T, SdkError<E, HttpResponse>>>,
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let attempts_made = AtomicU32::new(0);
    // The backoff's sleeper must own what it uses.
    let stop = call.stop.clone();
    let result = (|| {
        let attempt = attempts_made.fetch_add(1, Ordering::Relaxed) + 1;
        let started = Instant::now();
        let pending = attempt_once(attempt);
        let stopped = call.is_stopped();
        async move {
            if stopped {
                // Dropped unpolled: nothing was sent.
                return Err(SdkError::construction_failure(
                    "the upload is being aborted: no new attempt starts",
                ));
            }
            let outcome = pending.await;
            let duration_ms = started.elapsed().as_secs_f64() * 1000.0;
            match &outcome {
                Ok(_) => tracing::debug!(
                    operation = call.operation,
                    key = call.key,
                    part_number = call.part_number,
                    bytes = call.bytes,
                    attempt,
                    duration_ms,
                    "s3 call succeeded"
                ),
                Err(error) => tracing::warn!(
                    operation = call.operation,
                    key = call.key,
                    part_number = call.part_number,
                    bytes = call.bytes,
                    attempt,
                    duration_ms,
                    status = status_of(error),
                    retryable = is_retryable(error),
                    error = %DisplayErrorContext(error),
                    "s3 call attempt failed"
                ),
            }
            outcome
        }
    })
    .retry(retry.backoff())
    .sleep(move |delay| {
        let stop = stop.clone();
        async move {
            match stop {
                // Cut short once the upload is being aborted.
                Some(stop) => {
                    let _ = stop.run_until_cancelled(tokio::time::sleep(delay)).await;
                }
                None => tokio::time::sleep(delay).await,
            }
        }
    })
    .when(is_retryable)
    .notify(|_error, delay| {
        counters.retried();
        tracing::debug!(
            operation = call.operation,
            key = call.key,
            part_number = call.part_number,
            delay_ms = delay.as_millis() as u64,
            "s3 call will be retried"
        );
    })
    .await;
    result.map_err(|error| CallFailure {
        attempts: attempts_made.load(Ordering::Relaxed),
        status: status_of(&error),
        retryable: is_retryable(&error),
        detail: DisplayErrorContext(&error).to_string(),
    })
}

fn status_of<E>(error: &SdkError<E, HttpResponse>) -> Option<u16> {
    error
        .raw_response()
        .map(|response| response.status().as_u16())
}

/// Error codes S3 services use for "try again later", whatever the status.
/// `BadDigest` and the checksum mismatches are among them: the bytes
/// changed on the way, and the writer sends them again from its buffer.
const RETRYABLE_ERROR_CODES: &[&str] = &[
    "BadDigest",
    "XAmzContentChecksumMismatch",
    "XAmzContentSHA256Mismatch",
    "InternalError",
    "RequestTimeout",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
];

/// Server errors (5xx), throttling (429 and the codes above), timeouts,
/// connection failures and unreadable answers are worth another attempt;
/// everything else (4xx, a request that could not be built) is not.
pub(crate) fn is_retryable<E: ProvideErrorMetadata>(error: &SdkError<E, HttpResponse>) -> bool {
    match error {
        SdkError::TimeoutError(_) | SdkError::ResponseError(_) => true,
        SdkError::DispatchFailure(failure) => !failure.is_user(),
        SdkError::ServiceError(service_error) => {
            let status = service_error.raw().status().as_u16();
            status >= 500
                || status == 429
                || service_error
                    .err()
                    .code()
                    .is_some_and(|code| RETRYABLE_ERROR_CODES.contains(&code))
        }
        _ => false,
    }
}

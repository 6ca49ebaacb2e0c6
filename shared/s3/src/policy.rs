//! The upload policy: how large the parts are, how many upload at once, and
//! how failed calls are retried.

use std::time::Duration;

use backon::ExponentialBuilder;

use crate::error::WriterError;

/// The smallest part the writer uses. S3 requires 5 MiB for every part but
/// the last; 8 MiB keeps the number of requests per document low.
pub const MINIMUM_PART_SIZE: u64 = 8 * 1024 * 1024;

/// The most parts one multipart upload may have (an S3 limit).
pub const MAXIMUM_PART_COUNT: u64 = 10_000;

/// The largest object S3 stores (5 TiB).
pub const MAXIMUM_OBJECT_SIZE: u64 = 5 * 1024 * 1024 * 1024 * 1024;

/// Parts uploading at once, unless the caller says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4;

/// The part size for a document of at most `max_object_size` bytes:
/// `max(8 MiB, ceil(max_object_size / 10,000))`, the smallest size that is at
/// least [`MINIMUM_PART_SIZE`] and still fits the whole document in
/// [`MAXIMUM_PART_COUNT`] parts.
pub fn part_size_for(max_object_size: u64) -> u64 {
    MINIMUM_PART_SIZE.max(max_object_size.div_ceil(MAXIMUM_PART_COUNT))
}

/// How one document is uploaded.
///
/// - **Part size** is fixed for the whole upload, because some S3 services
///   require every part but the last to have the same size. It follows from
///   the maximum object size the caller declares ([`part_size_for`]); writing
///   past that maximum fails with [`WriterError::ObjectTooLarge`].
/// - **Parts in flight**: a full buffer becomes a part uploaded in the
///   background; at most `max_in_flight` upload at once, and an append that
///   needs one more waits. Memory therefore stays within
///   [`UploadPolicy::memory_bound`] = part size x (`max_in_flight` + 1),
///   however large the document and however slow the server.
/// - **Retries** follow [`RetryPolicy`], per part and per call, so every
///   attempt is traced and counted (the SDK's own retries are off for these
///   calls).
/// - **Payload signing**: SigV4 can sign each part's bytes, which costs a
///   SHA-256 pass over every byte on the client and another on the server
///   (on top of the document's own SHA-256). Over HTTPS, TLS already
///   protects the bytes in transit and AWS's own SDKs skip it; over plain
///   HTTP it is the only integrity check the server makes, so it is on by
///   default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadPolicy {
    /// The most bytes the document may have.
    pub max_object_size: u64,
    /// How many parts may upload at once (at least 1).
    pub max_in_flight: usize,
    /// How failed calls are retried.
    pub retry: RetryPolicy,
    /// How long one attempt of one call (one part upload, for instance) may
    /// take before it counts as a retryable timeout.
    pub attempt_timeout: Duration,
    /// Whether SigV4 signs the bytes of each part (`x-amz-content-sha256`
    /// is their SHA-256) or sends them as `UNSIGNED-PAYLOAD`.
    pub sign_payload: bool,
    /// The additional checksum of every part and of the object, verified
    /// by the server (see [`crate::StoredChecksum`]).
    pub checksum: quire_config::ChecksumChoice,
}

impl UploadPolicy {
    /// The default policy for documents of at most `max_object_size` bytes.
    pub fn for_max_object_size(max_object_size: u64) -> Self {
        UploadPolicy {
            max_object_size,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            retry: RetryPolicy::default(),
            // Generous: an 8 MiB part at 1 MiB/s still makes it.
            attempt_timeout: Duration::from_secs(120),
            sign_payload: true,
            checksum: quire_config::ChecksumChoice::default(),
        }
    }

    /// The size of every part but the last, fixed for the whole upload.
    pub fn part_size(&self) -> u64 {
        part_size_for(self.max_object_size)
    }

    /// The most bytes a writer under this policy holds at once: the buffer
    /// being filled plus the parts in flight.
    pub fn memory_bound(&self) -> u64 {
        self.part_size() * (self.max_in_flight as u64 + 1)
    }

    /// Refuses policies the writer cannot honour.
    pub fn validate(&self) -> Result<(), WriterError> {
        let invalid = |reason: String| Err(WriterError::InvalidPolicy { reason });
        if self.max_object_size > MAXIMUM_OBJECT_SIZE {
            return invalid(format!(
                "max_object_size {} is larger than the {MAXIMUM_OBJECT_SIZE} bytes S3 can store",
                self.max_object_size
            ));
        }
        if self.max_in_flight == 0 {
            return invalid("max_in_flight must be at least 1".to_owned());
        }
        if self.retry.max_attempts == 0 {
            return invalid("retry.max_attempts must be at least 1".to_owned());
        }
        if self.retry.base_delay > self.retry.max_delay {
            return invalid(format!(
                "retry.base_delay {:?} is longer than retry.max_delay {:?}",
                self.retry.base_delay, self.retry.max_delay
            ));
        }
        if self.attempt_timeout.is_zero() {
            return invalid("attempt_timeout must be longer than zero".to_owned());
        }
        Ok(())
    }
}

/// Exponential backoff with jitter for retryable failures (5xx, throttling,
/// timeouts, connection resets): the n-th retry waits about
/// `base_delay x 2^(n-1)`, at most `max_delay`, plus a random jitter of up to
/// that much again, so writers that failed together do not retry together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per call, the first included (1 = no retry).
    pub max_attempts: u32,
    /// The wait before the first retry.
    pub base_delay: Duration,
    /// The longest wait between two attempts.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The backoff schedule, for `backon`.
    pub(crate) fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.base_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_max_times(self.max_attempts.saturating_sub(1) as usize)
            .with_jitter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * MIB;
    const TIB: u64 = 1024 * GIB;

    #[test]
    fn small_and_moderate_documents_use_the_minimum_part_size() {
        for declared in [0, 1, 5 * MIB, 8 * MIB, 8 * MIB + 1, GIB, 64 * GIB] {
            assert_eq!(part_size_for(declared), 8 * MIB, "declared {declared}");
        }
    }

    #[test]
    fn the_part_size_grows_once_ten_thousand_minimum_parts_are_not_enough() {
        let largest_with_minimum_parts = 8 * MIB * MAXIMUM_PART_COUNT;
        assert_eq!(part_size_for(largest_with_minimum_parts), 8 * MIB);
        assert_eq!(part_size_for(largest_with_minimum_parts + 1), 8 * MIB + 1);
        assert_eq!(part_size_for(100 * GIB), 10_737_419);
        assert_eq!(part_size_for(TIB), 109_951_163);
        assert_eq!(part_size_for(5 * TIB), 549_755_814);
    }

    #[test]
    fn every_declared_size_up_to_five_tib_fits_in_ten_thousand_minimal_parts() {
        // Sizes spread over the whole range (each power of two, and its
        // neighbours), then a dense sweep around the threshold.
        let mut declared_sizes = vec![0, 1, MAXIMUM_OBJECT_SIZE];
        for exponent in 0..=42 {
            let power = 1u64 << exponent;
            declared_sizes.extend([power - 1, power, power + 1, power * 3 / 2]);
        }
        let threshold = MINIMUM_PART_SIZE * MAXIMUM_PART_COUNT;
        declared_sizes.extend((threshold - 20_000..threshold + 20_000).step_by(997));
        declared_sizes.retain(|size| *size <= MAXIMUM_OBJECT_SIZE);

        for declared in declared_sizes {
            let part_size = part_size_for(declared);
            assert!(part_size >= MINIMUM_PART_SIZE, "declared {declared}");
            assert!(part_size <= 5 * GIB, "S3 parts are at most 5 GiB");
            assert!(
                declared.div_ceil(part_size) <= MAXIMUM_PART_COUNT,
                "declared {declared}: {part_size}-byte parts need too many parts"
            );
            // The smallest such size: one byte less would need too many parts.
            if part_size > MINIMUM_PART_SIZE {
                assert!(
                    declared.div_ceil(part_size - 1) > MAXIMUM_PART_COUNT,
                    "declared {declared}: {part_size} is not the smallest part size"
                );
            }
            let policy = UploadPolicy::for_max_object_size(declared);
            assert_eq!(policy.part_size(), part_size);
            assert_eq!(policy.memory_bound(), part_size * 5);
            policy.validate().expect("every size up to 5 TiB is valid");
        }
    }

    #[test]
    fn policies_the_writer_cannot_honour_are_refused() {
        let too_large = UploadPolicy::for_max_object_size(MAXIMUM_OBJECT_SIZE + 1);
        assert!(
            too_large
                .validate()
                .unwrap_err()
                .to_string()
                .contains("larger than")
        );

        let mut no_parts_in_flight = UploadPolicy::for_max_object_size(GIB);
        no_parts_in_flight.max_in_flight = 0;
        assert!(no_parts_in_flight.validate().is_err());

        let mut no_attempts = UploadPolicy::for_max_object_size(GIB);
        no_attempts.retry.max_attempts = 0;
        assert!(no_attempts.validate().is_err());
    }

    #[test]
    fn the_backoff_allows_the_configured_number_of_retries_within_the_maximum_delay() {
        let retry = RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(30),
        };
        let delays: Vec<Duration> = backon::BackoffBuilder::build(retry.backoff()).collect();
        assert_eq!(delays.len(), 3, "4 attempts = 3 retries");
        for delay in delays {
            // Jitter adds up to the delay again.
            assert!(delay <= Duration::from_millis(60), "{delay:?}");
        }
    }
}

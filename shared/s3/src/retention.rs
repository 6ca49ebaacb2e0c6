//! Report retention: the objects under the caller's prefixes (quire's
//! reports and their manifests: `quire_messages::layout::RETENTION_PREFIXES`)
//! are deleted once older than `s3.report_retention_days`.
//!
//! The server does it best: at start-up the worker puts bucket lifecycle
//! rules (one per prefix, ids starting `quire-retention-`; other rules of the
//! bucket are kept). A server without lifecycle rules (versitygw's POSIX
//! backend answers NotImplemented) gets a sweep instead: once at start, then
//! every `s3.retention_sweep_minutes`, list each prefix a page at a time and
//! delete what was last modified before the cutoff, reports before
//! manifests, so a report never outlives its manifest (a manifest without its
//! report answers "gone"; a report without a manifest would be invisible).
//! Deletes are idempotent, so every replica may sweep.
//!
//! With retention 0 (keep forever), rules this module put earlier are
//! removed, so turning retention off really keeps reports.

use std::time::{Duration, SystemTime};

use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::DateTime;
use aws_sdk_s3::types::{
    BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule,
    LifecycleRuleFilter,
};
use futures::{StreamExt, TryStreamExt};
use quire_config::S3Settings;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::bucket::S3Bucket;
use crate::calls::{CallLabel, call_settings_without_retries, with_retries};
use crate::error::WriterError;
use crate::policy::RetryPolicy;

/// Ids of the lifecycle rules this module owns start with this.
pub const LIFECYCLE_RULE_ID_PREFIX: &str = "quire-retention-";

/// Keys listed per ListObjectsV2 page (the S3 maximum): a sweep holds one
/// page at a time, however many objects the bucket has.
const LIST_PAGE_SIZE: i32 = 1000;

/// Deletes in flight at once during a sweep.
const DELETES_AT_ONCE: usize = 8;

/// How long reports are kept and how often the fallback sweep runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Objects last modified longer ago than this are deleted; `None` keeps
    /// them forever.
    pub keep_for: Option<Duration>,
    /// Time between two sweeps, where the server has no lifecycle rules.
    pub sweep_every: Duration,
}

impl Retention {
    /// From `s3.report_retention_days` (0 = forever) and
    /// `s3.retention_sweep_minutes`.
    pub fn from_settings(settings: &S3Settings) -> Self {
        let keep_for = settings
            .report_retention_days
            .map(|days| Duration::from_secs(u64::from(days.get()) * 24 * 60 * 60));
        Retention {
            keep_for,
            sweep_every: settings.retention_sweep.max(Duration::from_secs(60)),
        }
    }

    /// Whole days for a lifecycle rule (which counts in days): rounded up, at
    /// least one.
    fn lifecycle_days(keep_for: Duration) -> i32 {
        let day = 24 * 60 * 60;
        let days = keep_for.as_secs().div_ceil(day).max(1);
        i32::try_from(days).unwrap_or(i32::MAX)
    }
}

/// What one sweep of one prefix did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpiredObjects {
    /// Objects listed.
    pub examined: u64,
    /// Objects deleted because they were older than the cutoff.
    pub deleted: u64,
}

impl std::ops::AddAssign for ExpiredObjects {
    fn add_assign(&mut self, other: Self) {
        self.examined += other.examined;
        self.deleted += other.deleted;
    }
}

/// How the server took the lifecycle rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LifecycleOutcome {
    /// The bucket holds the rules: the server expires the objects itself.
    Applied,
    /// The server has no lifecycle rules (NotImplemented, or no such
    /// operation): sweep instead. `detail` is its answer.
    Unsupported { detail: String },
}

impl S3Bucket {
    /// Deletes every object under each of `prefixes` (in that order) last
    /// modified more than `age` ago, a page of `LIST_PAGE_SIZE` keys at a
    /// time; returns what it examined and deleted. Objects that vanish
    /// meanwhile are fine (a delete of a missing key succeeds), so sweeps of
    /// several replicas may overlap.
    pub async fn expire_older_than(
        &self,
        prefixes: &[&str],
        age: Duration,
    ) -> Result<ExpiredObjects, WriterError> {
        self.expire_older_than_until(prefixes, age, None).await
    }

    async fn expire_older_than_until(
        &self,
        prefixes: &[&str],
        age: Duration,
        stop: Option<&CancellationToken>,
    ) -> Result<ExpiredObjects, WriterError> {
        let cutoff = DateTime::from(
            SystemTime::now()
                .checked_sub(age)
                .unwrap_or(SystemTime::UNIX_EPOCH),
        );
        let mut total = ExpiredObjects::default();
        for prefix in prefixes {
            let swept = self.expire_prefix(prefix, cutoff, stop).await?;
            tracing::info!(
                bucket = %self.name(),
                prefix,
                examined = swept.examined,
                deleted = swept.deleted,
                max_age_s = age.as_secs(),
                "retention sweep of prefix done"
            );
            total += swept;
        }
        Ok(total)
    }

    async fn expire_prefix(
        &self,
        prefix: &str,
        cutoff: DateTime,
        stop: Option<&CancellationToken>,
    ) -> Result<ExpiredObjects, WriterError> {
        let retry = RetryPolicy::default();
        let mut swept = ExpiredObjects::default();
        let mut continuation: Option<String> = None;
        loop {
            if stop.is_some_and(CancellationToken::is_cancelled) {
                return Ok(swept);
            }
            let call = CallLabel::new("ListObjectsV2", prefix);
            let page = with_retries(&retry, self.counters(), &call, |_attempt| {
                self.client()
                    .list_objects_v2()
                    .bucket(self.name())
                    .prefix(prefix)
                    .max_keys(LIST_PAGE_SIZE)
                    .set_continuation_token(continuation.clone())
                    .customize()
                    .config_override(call_settings_without_retries())
                    .send()
            })
            .await
            .map_err(|failure| self.failed(call.operation, prefix, failure))?;
            let expired: Vec<String> = page
                .contents()
                .iter()
                .filter(|object| {
                    object
                        .last_modified()
                        .is_some_and(|modified| *modified < cutoff)
                })
                .filter_map(|object| object.key().map(str::to_owned))
                .collect();
            swept.examined += page.contents().len() as u64;
            swept.deleted += expired.len() as u64;
            futures::stream::iter(expired)
                .map(|key| {
                    let retry = &retry;
                    async move { self.delete_object(&key, retry).await }
                })
                .buffer_unordered(DELETES_AT_ONCE)
                .try_collect::<()>()
                .await?;
            let next = match page.is_truncated() {
                Some(true) => page.next_continuation_token().map(str::to_owned),
                _ => None,
            };
            match next {
                Some(token) if Some(&token) != continuation.as_ref() => continuation = Some(token),
                Some(_) => {
                    // A page that says "more" without moving on would loop forever.
                    tracing::warn!(bucket = %self.name(), prefix, "object listing is truncated but does not advance");
                    return Ok(swept);
                }
                None => return Ok(swept),
            }
        }
    }

    async fn delete_object(&self, key: &str, retry: &RetryPolicy) -> Result<(), WriterError> {
        let call = CallLabel::new("DeleteObject", key);
        with_retries(retry, self.counters(), &call, |_attempt| {
            self.client()
                .delete_object()
                .bucket(self.name())
                .key(key)
                .customize()
                .config_override(call_settings_without_retries())
                .send()
        })
        .await
        .map_err(|failure| self.failed(call.operation, key, failure))?;
        tracing::debug!(bucket = %self.name(), key, "expired object deleted");
        Ok(())
    }

    /// Puts lifecycle rules expiring each of `prefixes` after `days` days,
    /// keeping the bucket's other rules. [`LifecycleOutcome::Unsupported`]
    /// when the server has no lifecycle rules; an error for other failures.
    pub async fn put_expiration_rules(
        &self,
        prefixes: &[&str],
        days: u32,
    ) -> Result<LifecycleOutcome, WriterError> {
        let days = i32::try_from(days.max(1)).unwrap_or(i32::MAX);
        let mut rules: Vec<LifecycleRule> = match self.lifecycle_rules().await? {
            BucketRules::Readable(rules) => {
                rules.into_iter().filter(|rule| !is_ours(rule)).collect()
            }
            BucketRules::Unsupported(detail) => {
                return Ok(LifecycleOutcome::Unsupported { detail });
            }
        };
        for prefix in prefixes {
            rules.push(expiration_rule(prefix, days)?);
        }
        match self.put_lifecycle_rules(rules).await {
            Ok(()) => Ok(LifecycleOutcome::Applied),
            Err(LifecycleCallError::Unsupported(detail)) => {
                Ok(LifecycleOutcome::Unsupported { detail })
            }
            Err(LifecycleCallError::Failed(error)) => Err(error),
        }
    }

    /// Removes the rules [`S3Bucket::put_expiration_rules`] put, keeping the
    /// bucket's other rules; whether there were any.
    pub async fn remove_expiration_rules(&self) -> Result<bool, WriterError> {
        let BucketRules::Readable(all) = self.lifecycle_rules().await? else {
            return Ok(false);
        };
        let foreign: Vec<LifecycleRule> =
            all.iter().filter(|rule| !is_ours(rule)).cloned().collect();
        if foreign.len() == all.len() {
            return Ok(false);
        }
        if foreign.is_empty() {
            let call = CallLabel::new("DeleteBucketLifecycle", "");
            with_retries(
                &RetryPolicy::default(),
                self.counters(),
                &call,
                |_attempt| {
                    self.client()
                        .delete_bucket_lifecycle()
                        .bucket(self.name())
                        .customize()
                        .config_override(call_settings_without_retries())
                        .send()
                },
            )
            .await
            .map_err(|failure| self.failed(call.operation, "", failure))?;
        } else {
            match self.put_lifecycle_rules(foreign).await {
                Ok(()) => {}
                Err(LifecycleCallError::Unsupported(_)) => return Ok(false),
                Err(LifecycleCallError::Failed(error)) => return Err(error),
            }
        }
        Ok(true)
    }

    /// Every lifecycle rule of the bucket (none when it has no
    /// configuration), or the server's answer when it has no lifecycle rules.
    async fn lifecycle_rules(&self) -> Result<BucketRules, WriterError> {
        let answer = self
            .client()
            .get_bucket_lifecycle_configuration()
            .bucket(self.name())
            .customize()
            .config_override(call_settings_without_retries())
            .send()
            .await;
        match answer {
            Ok(output) => Ok(BucketRules::Readable(output.rules().to_vec())),
            Err(error) if error_code(&error) == Some("NoSuchLifecycleConfiguration") => {
                Ok(BucketRules::Readable(Vec::new()))
            }
            Err(error) if is_unsupported(&error) => Ok(BucketRules::Unsupported(
                DisplayErrorContext(&error).to_string(),
            )),
            Err(error) => Err(self.sdk_failed("GetBucketLifecycleConfiguration", &error)),
        }
    }

    async fn put_lifecycle_rules(
        &self,
        rules: Vec<LifecycleRule>,
    ) -> Result<(), LifecycleCallError> {
        let configuration = BucketLifecycleConfiguration::builder()
            .set_rules(Some(rules))
            .build()
            .map_err(|error| {
                LifecycleCallError::Failed(WriterError::InvalidPolicy {
                    reason: format!("lifecycle configuration: {error}"),
                })
            })?;
        let answer = self
            .client()
            .put_bucket_lifecycle_configuration()
            .bucket(self.name())
            .lifecycle_configuration(configuration)
            .customize()
            .config_override(call_settings_without_retries())
            .send()
            .await;
        match answer {
            Ok(_) => Ok(()),
            Err(error) if is_unsupported(&error) => Err(LifecycleCallError::Unsupported(
                DisplayErrorContext(&error).to_string(),
            )),
            Err(error) => Err(LifecycleCallError::Failed(
                self.sdk_failed("PutBucketLifecycleConfiguration", &error),
            )),
        }
    }

    fn sdk_failed<E>(
        &self,
        operation: &'static str,
        error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> WriterError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        WriterError::S3 {
            operation,
            bucket: self.name().to_owned(),
            key: String::new(),
            attempts: 1,
            status: error
                .raw_response()
                .map(|response| response.status().as_u16()),
            retryable: false,
            detail: DisplayErrorContext(error).to_string(),
        }
    }
}

/// A bucket's lifecycle rules as read.
enum BucketRules {
    Readable(Vec<LifecycleRule>),
    /// The server has no lifecycle rules; its answer.
    Unsupported(String),
}

enum LifecycleCallError {
    Unsupported(String),
    Failed(WriterError),
}

fn expiration_rule(prefix: &str, days: i32) -> Result<LifecycleRule, WriterError> {
    let id = format!("{LIFECYCLE_RULE_ID_PREFIX}{}", prefix.trim_end_matches('/'));
    LifecycleRule::builder()
        .id(id)
        .filter(LifecycleRuleFilter::builder().prefix(prefix).build())
        .status(ExpirationStatus::Enabled)
        .expiration(LifecycleExpiration::builder().days(days).build())
        .build()
        .map_err(|error| WriterError::InvalidPolicy {
            reason: format!("lifecycle rule for {prefix}: {error}"),
        })
}

fn is_ours(rule: &LifecycleRule) -> bool {
    rule.id()
        .is_some_and(|id| id.starts_with(LIFECYCLE_RULE_ID_PREFIX))
}

fn error_code<E: ProvideErrorMetadata>(
    error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> Option<&str> {
    error
        .as_service_error()
        .and_then(ProvideErrorMetadata::code)
}

/// A server without lifecycle rules: NotImplemented (501), or an operation
/// it does not route (405).
fn is_unsupported<E: ProvideErrorMetadata>(
    error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> bool {
    let status = error
        .raw_response()
        .map(|response| response.status().as_u16());
    matches!(status, Some(501 | 405))
        || matches!(
            error_code(error),
            Some("NotImplemented" | "MethodNotAllowed" | "NotSupported")
        )
}

/// Starts report retention for the bucket of `settings` and returns its
/// task, which ends once `stop` is raised (or at once when the server took
/// the lifecycle rules, or retention is off). Failures are logged, never
/// fatal: a sweep that fails is tried again at the next interval.
///
/// `prefixes` are deleted in their order (quire's: a report before its
/// manifest). The report generator calls it once at start-up.
pub async fn start_retention(
    settings: &S3Settings,
    prefixes: &'static [&'static str],
    stop: CancellationToken,
) -> JoinHandle<()> {
    let bucket = S3Bucket::new(crate::build_client(settings).await, &settings.bucket);
    spawn_retention(bucket, Retention::from_settings(settings), prefixes, stop)
}

/// [`start_retention`] on a bucket handle and a [`Retention`] of any length
/// (tests keep objects for seconds).
pub fn spawn_retention(
    bucket: S3Bucket,
    retention: Retention,
    prefixes: &'static [&'static str],
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let Some(keep_for) = retention.keep_for else {
            match bucket.remove_expiration_rules().await {
                Ok(true) => {
                    tracing::info!(bucket = %bucket.name(), "retention is off: quire's lifecycle rules removed")
                }
                Ok(false) => {
                    tracing::debug!(bucket = %bucket.name(), "retention is off: reports are kept forever")
                }
                Err(error) => {
                    tracing::warn!(bucket = %bucket.name(), error = %error, "retention is off but quire's lifecycle rules could not be removed")
                }
            }
            return;
        };
        let days = Retention::lifecycle_days(keep_for);
        match bucket
            .put_expiration_rules(prefixes, days.unsigned_abs())
            .await
        {
            Ok(LifecycleOutcome::Applied) => {
                tracing::info!(bucket = %bucket.name(), days, "retention: lifecycle rules put; the server expires reports and manifests");
                return;
            }
            Ok(LifecycleOutcome::Unsupported { detail }) => {
                tracing::info!(bucket = %bucket.name(), days, sweep_every_s = retention.sweep_every.as_secs(), detail, "retention: the server has no lifecycle rules; sweeping instead");
            }
            Err(error) => {
                tracing::warn!(bucket = %bucket.name(), days, sweep_every_s = retention.sweep_every.as_secs(), error = %error, "retention: lifecycle rules could not be put; sweeping instead");
            }
        }
        while !stop.is_cancelled() {
            match bucket
                .expire_older_than_until(prefixes, keep_for, Some(&stop))
                .await
            {
                Ok(swept) => {
                    tracing::info!(bucket = %bucket.name(), examined = swept.examined, deleted = swept.deleted, "retention sweep done")
                }
                Err(error) => {
                    tracing::warn!(bucket = %bucket.name(), error = %error, "retention sweep failed; trying again at the next interval")
                }
            }
            // Sleeps the period, or less once stopped.
            let _ = stop
                .run_until_cancelled(tokio::time::sleep(retention.sweep_every))
                .await;
        }
        tracing::debug!(bucket = %bucket.name(), "retention task stopped");
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(days: u32, minutes: u64) -> S3Settings {
        S3Settings {
            report_retention_days: std::num::NonZeroU32::new(days),
            retention_sweep: Duration::from_secs(minutes * 60),
            ..quire_config::defaults().s3
        }
    }

    #[test]
    fn zero_days_keeps_reports_forever() {
        let retention = Retention::from_settings(&settings(0, 60));
        assert_eq!(retention.keep_for, None);
        assert_eq!(retention.sweep_every, Duration::from_secs(3600));
        assert_eq!(quire_config::defaults().s3.report_retention_days, None);
    }

    #[test]
    fn days_become_a_maximum_age_and_whole_lifecycle_days() {
        let retention = Retention::from_settings(&settings(30, 0));
        assert_eq!(retention.keep_for, Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(
            retention.sweep_every,
            Duration::from_secs(60),
            "at least a minute"
        );
        assert_eq!(
            Retention::lifecycle_days(Duration::from_secs(30 * 86_400)),
            30
        );
        assert_eq!(Retention::lifecycle_days(Duration::from_secs(3)), 1);
        assert_eq!(Retention::lifecycle_days(Duration::from_secs(86_401)), 2);
    }

    #[test]
    fn rules_are_named_so_that_other_rules_of_the_bucket_are_kept() {
        let rule = expiration_rule("reports/", 7).unwrap();
        assert_eq!(rule.id(), Some("quire-retention-reports"));
        assert!(is_ours(&rule));
        assert_eq!(
            rule.expiration().and_then(LifecycleExpiration::days),
            Some(7)
        );
        let foreign = LifecycleRule::builder()
            .id("archive-logs")
            .status(ExpirationStatus::Enabled)
            .build()
            .unwrap();
        assert!(!is_ours(&foreign));
    }
}

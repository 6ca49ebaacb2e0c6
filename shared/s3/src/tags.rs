//! Object tags: the selectors lifecycle rules and people use (a report's
//! stream, id, counts and window), set on a stored object with one
//! PutObjectTagging, retried like every call.

use aws_sdk_s3::types::{Tag, Tagging};

use crate::S3Bucket;
use crate::calls::{CallLabel, call_settings_without_retries, with_retries};
use crate::error::WriterError;
use crate::policy::RetryPolicy;

/// S3's limits: 10 tags an object, keys of 128 characters, values of 256.
pub const MAX_TAGS: usize = 10;
const MAX_TAG_KEY: usize = 128;
const MAX_TAG_VALUE: usize = 256;

/// Whether `text` holds only what S3 allows in a tag everywhere: letters,
/// digits, spaces and `+ - = . _ : / @`.
pub fn is_tag_text(text: &str) -> bool {
    text.chars().all(|character| {
        character.is_alphanumeric()
            || matches!(
                character,
                ' ' | '+' | '-' | '=' | '.' | '_' | ':' | '/' | '@'
            )
    })
}

impl S3Bucket {
    /// Replaces the tags of the object at `key` with `tags`, in order.
    ///
    /// # Errors
    ///
    /// [`WriterError::InvalidPolicy`] for tags S3 would refuse (too many,
    /// too long, a character it does not allow), without a call; the
    /// call's failure otherwise.
    pub async fn tag_object(&self, key: &str, tags: &[(&str, String)]) -> Result<(), WriterError> {
        if tags.len() > MAX_TAGS {
            return Err(WriterError::InvalidPolicy {
                reason: format!("{} tags for {key}; S3 keeps at most {MAX_TAGS}", tags.len()),
            });
        }
        let mut set = Vec::with_capacity(tags.len());
        for (name, value) in tags {
            let fits = !name.is_empty()
                && name.chars().count() <= MAX_TAG_KEY
                && value.chars().count() <= MAX_TAG_VALUE
                && is_tag_text(name)
                && is_tag_text(value);
            if !fits {
                return Err(WriterError::InvalidPolicy {
                    reason: format!("the tag {name:?} = {value:?} of {key} is not one S3 accepts"),
                });
            }
            set.push(
                Tag::builder()
                    .key(*name)
                    .value(value)
                    .build()
                    .map_err(|error| WriterError::InvalidPolicy {
                        reason: error.to_string(),
                    })?,
            );
        }
        let tagging = Tagging::builder()
            .set_tag_set(Some(set))
            .build()
            .map_err(|error| WriterError::InvalidPolicy {
                reason: error.to_string(),
            })?;
        let call = CallLabel::new("PutObjectTagging", key);
        with_retries(
            &RetryPolicy::default(),
            self.counters(),
            &call,
            |_attempt| {
                self.client()
                    .put_object_tagging()
                    .bucket(self.name())
                    .key(key)
                    .tagging(tagging.clone())
                    .customize()
                    .config_override(call_settings_without_retries())
                    .send()
            },
        )
        .await
        .map_err(|failure| self.failed(call.operation, key, failure))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_text_is_what_s3_allows() {
        assert!(is_tag_text("orders.eu"));
        assert!(is_tag_text("2026-12-07T09:00:00+01:00"));
        assert!(is_tag_text("orders/3-43"));
        assert!(!is_tag_text("orders~3-43"));
        assert!(!is_tag_text("a\"b"));
        assert!(!is_tag_text("a\nb"));
    }
}

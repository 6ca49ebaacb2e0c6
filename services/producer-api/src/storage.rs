//! The bucket as the API sees it: manifests, definitions' readable copies,
//! report documents to stream out, and the readiness probe.
//!
//! The API only reads what the workers write (manifests, documents) and
//! writes one kind of object itself: `definitions/{stream}.json`.

use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::error::{DisplayErrorContext, SdkError};
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use quire_messages::layout;
use quire_messages::{Manifest, ReportId};

/// What an S3 call of the API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("the S3 call {operation} on s3://{bucket}/{key} failed: {detail}")]
    Call {
        operation: &'static str,
        bucket: String,
        key: String,
        detail: String,
    },
    #[error("s3://{bucket}/{key} is not a document this release can read: {detail}")]
    Unreadable {
        bucket: String,
        key: String,
        detail: String,
    },
    #[error("the continuation token is not one this listing returned; start again without it")]
    BadContinuation,
    #[error("the S3 call {operation} on s3://{bucket} took longer than {timeout:?}")]
    TimedOut {
        operation: &'static str,
        bucket: String,
        timeout: Duration,
    },
}

/// The object at a manifest's key, against the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DocumentCheck {
    /// The object the manifest describes: same size and, when the manifest
    /// records one, same ETag.
    Described,
    /// No object at the key (deleted: report retention, or by hand).
    Missing,
    /// Another object: a replay that cut the log elsewhere wrote other
    /// bytes to the same key. What was found, for the log.
    Replaced {
        bytes: Option<i64>,
        e_tag: Option<String>,
    },
}

/// A report document opened for streaming, or why not.
pub enum OpenedDocument {
    Object(StoredObject),
    Missing,
    /// The object at the key is no longer the one the manifest describes
    /// (`If-Match` failed: it was replaced since it was checked).
    Replaced,
}

/// An ETag without its quotes (servers and SDKs differ in keeping them).
fn bare_e_tag(e_tag: &str) -> &str {
    e_tag.trim().trim_matches('"')
}

/// A report document about to be streamed to a client.
pub struct StoredObject {
    pub body: ByteStream,
    pub content_length: Option<i64>,
}

/// One page of keys under a prefix.
pub struct KeyPage {
    pub keys: Vec<String>,
    /// Present when more keys follow: pass it back to get the next page.
    pub continuation: Option<String>,
}

/// The bucket of `s3.bucket`, through the client `quire_s3::build_client` made.
#[derive(Clone)]
pub struct Storage {
    client: Client,
    bucket: String,
}

pub use quire_messages::layout::definition_key;

impl Storage {
    pub fn new(client: Client, bucket: String) -> Self {
        Storage { client, bucket }
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The manifest of a completed report, or None while there is none.
    pub async fn manifest(&self, id: &ReportId) -> Result<Option<Manifest>, StorageError> {
        let key = layout::manifest_key(id);
        let Some(bytes) = self.get_small(&key).await? else {
            return Ok(None);
        };
        self.decode_manifest(&key, &bytes).map(Some)
    }

    /// Decodes a manifest read from `key`.
    pub fn decode_manifest(&self, key: &str, bytes: &[u8]) -> Result<Manifest, StorageError> {
        quire_messages::decode::<Manifest>("manifest", bytes).map_err(|error| {
            StorageError::Unreadable {
                bucket: self.bucket.clone(),
                key: key.to_owned(),
                detail: error.to_string(),
            }
        })
    }

    /// A small object whole (manifests, definitions), or None if it does not exist.
    pub async fn get_small(&self, key: &str) -> Result<Option<Bytes>, StorageError> {
        let Some(object) = self.open(key).await? else {
            return Ok(None);
        };
        let bytes = object
            .body
            .collect()
            .await
            .map_err(|error| self.call_failed("GetObject", key, &error))?;
        Ok(Some(bytes.into_bytes()))
    }

    /// Opens an object for streaming, or None if it does not exist.
    pub async fn open(&self, key: &str) -> Result<Option<StoredObject>, StorageError> {
        let answer = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await;
        match answer {
            Ok(output) => Ok(Some(StoredObject {
                content_length: output.content_length(),
                body: output.body,
            })),
            Err(error) if is_not_found(&error) => Ok(None),
            Err(error) => Err(self.call_failed("GetObject", key, &DisplayErrorContext(&error))),
        }
    }

    /// Whether the object at `manifest.key` is the one `manifest` describes
    /// (one HeadObject): its size, and its ETag when the manifest has one.
    pub async fn check_document(&self, manifest: &Manifest) -> Result<DocumentCheck, StorageError> {
        let key = &manifest.key;
        let answer = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await;
        let head = match answer {
            Ok(head) => head,
            Err(error) if is_not_found(&error) => return Ok(DocumentCheck::Missing),
            Err(error) => {
                return Err(self.call_failed("HeadObject", key, &DisplayErrorContext(&error)));
            }
        };
        let bytes = head.content_length();
        let same_size = bytes.and_then(|bytes| u64::try_from(bytes).ok()) == Some(manifest.bytes);
        let same_tag = match (&manifest.e_tag, head.e_tag()) {
            (Some(recorded), Some(found)) => bare_e_tag(recorded) == bare_e_tag(found),
            (Some(_), None) => false,
            (None, _) => true,
        };
        if same_size && same_tag {
            Ok(DocumentCheck::Described)
        } else {
            Ok(DocumentCheck::Replaced {
                bytes,
                e_tag: head.e_tag().map(str::to_owned),
            })
        }
    }

    /// Opens a report document for streaming, only while it is the object
    /// whose ETag is `e_tag` (GetObject with `If-Match`), when given.
    pub async fn open_document(
        &self,
        key: &str,
        e_tag: Option<&str>,
    ) -> Result<OpenedDocument, StorageError> {
        let answer = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .set_if_match(e_tag.map(str::to_owned))
            .send()
            .await;
        match answer {
            Ok(output) => Ok(OpenedDocument::Object(StoredObject {
                content_length: output.content_length(),
                body: output.body,
            })),
            Err(error) if is_not_found(&error) => Ok(OpenedDocument::Missing),
            Err(error) if status_of(&error) == Some(412) => Ok(OpenedDocument::Replaced),
            Err(error) => Err(self.call_failed("GetObject", key, &DisplayErrorContext(&error))),
        }
    }

    pub async fn put_json(&self, key: &str, body: Vec<u8>) -> Result<(), StorageError> {
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(layout::JSON_CONTENT_TYPE)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(|error| self.call_failed("PutObject", key, &DisplayErrorContext(&error)))?;
        Ok(())
    }

    /// At most `limit` keys under `prefix`, in the bucket's (lexicographic)
    /// order, from where `continuation` left off.
    pub async fn list_keys(
        &self,
        prefix: &str,
        limit: i32,
        continuation: Option<String>,
    ) -> Result<KeyPage, StorageError> {
        let continued = continuation.is_some();
        let output = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(prefix)
            .max_keys(limit)
            .set_continuation_token(continuation)
            .send()
            .await
            .map_err(|error| {
                let refused = error
                    .raw_response()
                    .is_some_and(|response| response.status().as_u16() == 400);
                if continued && refused {
                    StorageError::BadContinuation
                } else {
                    self.call_failed("ListObjectsV2", prefix, &DisplayErrorContext(&error))
                }
            })?;
        let keys = output
            .contents()
            .iter()
            .filter_map(|object| object.key().map(str::to_owned))
            .collect();
        let continuation = match output.is_truncated() {
            Some(true) => output.next_continuation_token().map(str::to_owned),
            _ => None,
        };
        Ok(KeyPage { keys, continuation })
    }

    /// HeadBucket, bounded by `timeout`: the readiness probe.
    pub async fn check_bucket(&self, timeout: Duration) -> Result<(), StorageError> {
        let call = self.client.head_bucket().bucket(&self.bucket).send();
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(self.call_failed("HeadBucket", "", &DisplayErrorContext(&error))),
            Err(_elapsed) => Err(StorageError::TimedOut {
                operation: "HeadBucket",
                bucket: self.bucket.clone(),
                timeout,
            }),
        }
    }

    fn call_failed(
        &self,
        operation: &'static str,
        key: &str,
        error: &dyn std::fmt::Display,
    ) -> StorageError {
        StorageError::Call {
            operation,
            bucket: self.bucket.clone(),
            key: key.to_owned(),
            detail: error.to_string(),
        }
    }
}

/// Presigned GET URLs of report documents, so clients download straight
/// from S3 (`api.download_url_expiry_ms`, `api.download_url_endpoint`).
///
/// Signing is local (SigV4 query parameters, no call to the server), with
/// the API's own credentials, for the endpoint clients reach: the signature
/// covers the host, so a URL signed for the address the API uses inside a
/// compose network would not work from outside it. A URL reads that one
/// object until it expires, without a token: it is never logged.
#[derive(Clone)]
pub struct DownloadUrls {
    client: Client,
    bucket: String,
    expiry: Duration,
}

/// One presigned URL and when it stops working.
pub struct DownloadUrl {
    pub url: String,
    pub expires_at: std::time::SystemTime,
}

/// The longest a SigV4 presigned URL may live.
pub const MAX_DOWNLOAD_URL_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

impl DownloadUrls {
    /// `client` is configured for the endpoint clients reach.
    pub fn new(client: Client, bucket: String, expiry: Duration) -> Self {
        DownloadUrls {
            client,
            bucket,
            expiry,
        }
    }

    pub fn expiry(&self) -> Duration {
        self.expiry
    }

    /// A GET URL of `key`, whose answer carries `content_type` and a
    /// `Content-Disposition` naming `file_name` (S3's `response-content-*`
    /// overrides, part of the signature).
    pub async fn presign(
        &self,
        key: &str,
        content_type: &str,
        file_name: &str,
    ) -> Result<DownloadUrl, StorageError> {
        let signed_at = std::time::SystemTime::now();
        let config = PresigningConfig::builder()
            .start_time(signed_at)
            .expires_in(self.expiry)
            .build()
            .map_err(|error| StorageError::Call {
                operation: "presign GetObject",
                bucket: self.bucket.clone(),
                key: key.to_owned(),
                detail: error.to_string(),
            })?;
        let request = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .response_content_type(content_type)
            .response_content_disposition(format!("attachment; filename=\"{file_name}\""))
            .presigned(config)
            .await
            .map_err(|error| StorageError::Call {
                operation: "presign GetObject",
                bucket: self.bucket.clone(),
                key: key.to_owned(),
                detail: DisplayErrorContext(&error).to_string(),
            })?;
        Ok(DownloadUrl {
            url: request.uri().to_owned(),
            expires_at: signed_at + self.expiry,
        })
    }
}

/// A 404 from the server (NoSuchKey, or a server that says it differently).
fn is_not_found<E>(error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> bool {
    status_of(error) == Some(404)
}

/// The HTTP status the server answered, if it answered.
fn status_of<E>(error: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> Option<u16> {
    error
        .raw_response()
        .map(|response| response.status().as_u16())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_compare_without_their_quotes() {
        assert_eq!(bare_e_tag("\"abc-2\""), "abc-2");
        assert_eq!(bare_e_tag("abc-2"), "abc-2");
        assert_eq!(bare_e_tag(" \"abc\" "), "abc");
    }
}

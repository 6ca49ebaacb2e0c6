//! Which log quire is on: the records topic's Kafka topic id, and whether
//! it is the first log quire ran on under that name.
//!
//! Deleting and creating the records topic again (an ordinary recovery
//! step) starts offsets over at 0. Without its identity, a watermark of the
//! old log would skip the new log's records, and a new cut could get an old
//! report's id and be answered "completed" with the old content. So:
//! watermarks and manifests carry the topic id they were written for, and
//! the report ids and keys of every log but the first carry its tag. The
//! first log's id is kept in the bucket (`logs/{topic}.json`), which
//! outlives both topics; it is written once, by whichever service starts
//! first.

use aws_sdk_s3::Client;
use aws_sdk_s3::primitives::ByteStream;
use quire_config::KafkaSettings;
use quire_messages::{LogRegistry, LogTag, ReportId, StreamName, layout};
use quire_queue::TopicIdentity;

use crate::LogError;

/// The log quire is on now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogIdentity {
    /// The records topic as Kafka describes it (id, live partition count).
    pub records: TopicIdentity,
    /// The id of the first log quire ran on under this topic name.
    pub first_log: String,
    /// This log's tag in report ids and keys; none for the first log.
    pub tag: Option<LogTag>,
}

impl LogIdentity {
    /// Whether something written for log `log` (a watermark's or a
    /// manifest's `log` field; absent: written before quire recorded it,
    /// which was on the first log) belongs to this log.
    pub fn is_this_log(&self, log: Option<&str>) -> bool {
        log.unwrap_or(&self.first_log) == self.records.id
    }

    /// Whether a report id's tag names this log.
    pub fn names_this_log(&self, tag: Option<&LogTag>) -> bool {
        tag == self.tag.as_ref()
    }

    /// The id of the report cut at `partition` and `offset` of this log.
    pub fn report_id(&self, stream: StreamName, partition: i32, offset: i64) -> ReportId {
        ReportId::new(stream, partition, offset, self.tag.clone())
    }
}

/// The metadata a worker commits beside every offset: the watermark topic
/// (by its topic id) that holds the watermarks of what that offset commits.
/// A successor that finds another watermark topic now knows the watermarks
/// were lost (the topic deleted and created again).
pub fn commit_metadata(watermarks_id: &str) -> String {
    format!("{COMMIT_METADATA_PREFIX}{watermarks_id}")
}

/// The watermark topic id a committed offset's metadata names, if it is
/// quire's.
pub fn committed_watermarks(metadata: &str) -> Option<&str> {
    metadata
        .strip_prefix(COMMIT_METADATA_PREFIX)
        .filter(|id| !id.is_empty())
}

const COMMIT_METADATA_PREFIX: &str = "quire:watermarks=";

/// Describes the records topic and finds (or, the first time, records) the
/// first log of its name in the bucket.
pub async fn identify(
    kafka: &KafkaSettings,
    s3: &Client,
    bucket: &str,
) -> Result<LogIdentity, LogError> {
    let records = quire_queue::describe_topic(kafka, &kafka.topics.records).await?;
    let registry = registry(s3, bucket, &records).await?;
    let tag = registry.tag_of(&records.id);
    if let Some(tag) = &tag {
        tracing::info!(topic = %records.name, log = %records.id, first_log = %registry.first_log, %tag, "the records topic is not the first log of its name: report ids and keys carry its tag");
    }
    Ok(LogIdentity {
        records,
        first_log: registry.first_log,
        tag,
    })
}

/// The registry of `records`' name, written with `records` as the first
/// log when the bucket has none.
async fn registry(
    s3: &Client,
    bucket: &str,
    records: &TopicIdentity,
) -> Result<LogRegistry, LogError> {
    let key = layout::log_registry_key(&records.name).ok_or_else(|| {
        LogError::Layout(format!(
            "kafka.topics.records {:?} is not a Kafka topic name",
            records.name
        ))
    })?;
    match s3.get_object().bucket(bucket).key(&key).send().await {
        Ok(object) => {
            let bytes = object
                .body
                .collect()
                .await
                .map_err(|error| LogError::S3(format!("reading {key}: {error}")))?
                .into_bytes();
            quire_messages::decode::<LogRegistry>("log registry", &bytes)
                .map_err(|error| LogError::Unreadable(format!("{key}: {error}")))
        }
        Err(error)
            if error
                .raw_response()
                .is_some_and(|response| response.status().as_u16() == 404) =>
        {
            // Services starting together all write the id they see: the
            // same one, unless the topic was recreated in between.
            let registry = LogRegistry::new(&records.name, &records.id);
            s3.put_object()
                .bucket(bucket)
                .key(&key)
                .content_type(layout::JSON_CONTENT_TYPE)
                .body(ByteStream::from(quire_messages::encode(&registry)))
                .send()
                .await
                .map_err(|error| {
                    LogError::S3(format!(
                        "writing {key}: {}",
                        aws_sdk_s3::error::DisplayErrorContext(&error)
                    ))
                })?;
            tracing::info!(%key, log = %records.id, "first log of the records topic recorded");
            Ok(registry)
        }
        Err(error) => Err(LogError::S3(format!(
            "reading {key}: {}",
            aws_sdk_s3::error::DisplayErrorContext(&error)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(id: &str, first: &str) -> LogIdentity {
        LogIdentity {
            records: TopicIdentity {
                name: "r".into(),
                id: id.into(),
                partitions: 12,
            },
            first_log: first.into(),
            tag: LogTag::for_log(id, first),
        }
    }

    #[test]
    fn committed_offsets_name_their_watermark_topic() {
        let metadata = commit_metadata("W1");
        assert_eq!(committed_watermarks(&metadata), Some("W1"));
        assert_eq!(committed_watermarks(""), None);
        assert_eq!(committed_watermarks("someone else's"), None);
    }

    #[test]
    fn what_was_written_before_logs_were_named_belongs_to_the_first() {
        let first = identity("A", "A");
        assert!(first.is_this_log(None));
        assert!(first.is_this_log(Some("A")));
        assert!(!first.is_this_log(Some("B")));
        let later = identity("B", "A");
        assert!(
            !later.is_this_log(None),
            "an old watermark skips nothing of a new log"
        );
        assert!(later.is_this_log(Some("B")));
        assert!(first.names_this_log(None) && !later.names_this_log(None));
        let id = later.report_id(StreamName::new("s").unwrap(), 1, 2);
        assert!(later.names_this_log(id.log.as_ref()));
        assert!(!first.names_this_log(id.log.as_ref()));
    }
}

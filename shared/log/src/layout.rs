//! Which partition a stream is on.
//!
//! A stream's messages go to `partition_for_key(stream, layout.partitions)`
//! (Kafka's default partitioner, computed by librdkafka), chosen by quire
//! and set on every message, never left to the client's partitioner: the
//! client would use the topic's *live* count, so an operator's
//! `kafka-topics --alter` would move streams under running documents. The
//! layout's count only changes through the growth procedure ([`crate::grow`]).
//!
//! The layout is recorded on partition 0 of the watermark topic, key
//! `quire:layout` (compacted, transactional like everything there). A
//! deployment that never recorded one (created before it existed, or just
//! now) gets the count its topics were created with, and the first service
//! to start records it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_messages::{LogLayout, StreamName, watermarks};
use quire_queue::{InMessage, OutMessage, TopicIdentity, TopicTail};

use crate::LogError;

/// The partition `stream` is on when the layout has `partitions`.
pub fn partition_of(stream: &StreamName, partitions: i32) -> i32 {
    quire_queue::partition_for_key(stream.as_str().as_bytes(), partitions)
}

/// The layout in force, and whether it must still be recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLayout {
    pub layout: LogLayout,
    /// Derived from the topics (none was recorded for this log): the caller
    /// records it ([`record_layout`]) before relying on it.
    pub unrecorded: bool,
}

/// `layout` as a message of the watermark topic.
pub fn layout_message(watermarks_topic: &str, layout: &LogLayout) -> OutMessage {
    let message = watermarks::layout(layout);
    OutMessage::from_parts(
        watermarks_topic,
        message.key,
        message.payload,
        message.headers,
        message.partition,
    )
}

/// The latest layout recorded on the watermark topic (any log's), everything
/// written before the call included.
pub async fn read_layout(
    kafka: &KafkaSettings,
    watermarks_topic: &str,
) -> Result<Option<LogLayout>, LogError> {
    let (kafka_settings, topic) = (kafka.clone(), watermarks_topic.to_owned());
    let follower = tokio::task::spawn_blocking(move || {
        LayoutFollower::start(&kafka_settings, "quire-layout-reader", &topic)
    })
    .await??;
    let (layout, _) = follower
        .fresh(kafka.request_timeout.max(Duration::from_millis(1)))
        .await?;
    Ok(layout)
}

/// Records `layout` (outside any transaction, acknowledged by every
/// in-sync replica).
pub async fn record_layout(
    kafka: &KafkaSettings,
    watermarks_topic: &str,
    layout: &LogLayout,
) -> Result<(), LogError> {
    quire_queue::send_acknowledged(kafka, &[layout_message(watermarks_topic, layout)]).await?;
    tracing::info!(log = %layout.log, partitions = layout.partitions, moving_to = ?layout.moving_to, "partition layout recorded");
    Ok(())
}

/// The layout a message of watermark partition 0 records, if it is one.
fn layout_of(message: &InMessage) -> Option<Result<LogLayout, LogError>> {
    if message.key.as_deref() != Some(watermarks::LAYOUT_KEY.as_bytes()) {
        return None;
    }
    let payload = message.payload.as_deref()?;
    Some(
        quire_messages::decode::<LogLayout>("partition layout", payload)
            .map_err(|error| LogError::Unreadable(error.to_string())),
    )
}

/// The layout of the log `records` describes, given what was recorded
/// (`recorded`, any log's), the watermark topic's live partition count and
/// `kafka.partitions`.
///
/// - A layout recorded for this log is the layout; the topics must have at
///   least its partitions (more: grown by an operator, or by a growth
///   under way; the extra partitions are not routed to yet).
/// - Without one, the topics must be as quire creates them: the watermark
///   topic with exactly `kafka.partitions`, the records topic with at least
///   that (an `--alter` of the records topic alone is survived, not used).
///   The layout is that count, to be recorded.
pub fn resolve_layout(
    recorded: Option<LogLayout>,
    records: &TopicIdentity,
    watermarks_partitions: i32,
    setting: i32,
) -> Result<ResolvedLayout, LogError> {
    if let Some(layout) = recorded.filter(|layout| layout.log == records.id) {
        if records.partitions < layout.partitions || watermarks_partitions < layout.partitions {
            return Err(LogError::Layout(format!(
                "the partition layout routes streams among {} partitions, but topic {} has {} and the watermark topic {}: a partition count never shrinks, so these are not the topics the layout was recorded for",
                layout.partitions, records.name, records.partitions, watermarks_partitions
            )));
        }
        return Ok(ResolvedLayout {
            layout,
            unrecorded: false,
        });
    }
    if watermarks_partitions == setting && records.partitions >= setting {
        return Ok(ResolvedLayout {
            layout: LogLayout::new(&records.id, setting),
            unrecorded: true,
        });
    }
    Err(LogError::Layout(format!(
        "no partition layout is recorded for topic {} (id {}), and its topics are not as kafka.partitions ({setting}) creates them: the records topic has {} partitions and the watermark topic {}. Set kafka.partitions to the count streams were routed by (the watermark topic's, if only the records topic was altered), then grow with `report-generator partitions grow --to N`",
        records.name, records.id, records.partitions, watermarks_partitions
    )))
}

/// Follows the recorded layout for the life of the process (the API): a
/// tail on watermark partition 0 keeping the latest layout, and a check
/// that the copy is current.
pub struct LayoutFollower {
    tail: TopicTail,
    latest: Arc<Mutex<Option<LogLayout>>>,
}

impl LayoutFollower {
    /// Starts following. Blocks for the partition's beginning: call it from
    /// the blocking pool or at start-up.
    pub fn start(
        kafka: &KafkaSettings,
        group_id: &str,
        watermarks_topic: &str,
    ) -> Result<Self, LogError> {
        let latest = Arc::new(Mutex::new(None));
        let store = Arc::clone(&latest);
        let tail = TopicTail::start_uncommitted(
            kafka,
            group_id,
            watermarks_topic,
            watermarks::LAYOUT_PARTITION + 1,
            move |message| match layout_of(&message) {
                Some(Ok(layout)) => {
                    *store.lock().unwrap_or_else(PoisonError::into_inner) = Some(layout);
                }
                Some(Err(error)) => {
                    tracing::warn!(error = %error, offset = message.offset, "unreadable partition layout ignored");
                }
                None => {}
            },
        )?;
        Ok(LayoutFollower { tail, latest })
    }

    /// The latest layout recorded, once everything written to the layout's
    /// partition before this call has been read (at most `limit`): the
    /// answer is at least as new as the moment the call began, which it
    /// returns with it.
    pub async fn fresh(&self, limit: Duration) -> Result<(Option<LogLayout>, Instant), LogError> {
        let asked = Instant::now();
        self.tail
            .catch_up(watermarks::LAYOUT_PARTITION, limit)
            .await?;
        let latest = self
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Ok((latest, asked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(partitions: i32) -> TopicIdentity {
        TopicIdentity {
            name: "r".into(),
            id: "id".into(),
            partitions,
        }
    }

    #[test]
    fn a_recorded_layout_of_this_log_is_the_layout_and_the_topics_may_have_grown_past_it() {
        let recorded = LogLayout::new("id", 12);
        let resolved = resolve_layout(Some(recorded.clone()), &records(16), 12, 24).unwrap();
        assert_eq!(resolved.layout, recorded);
        assert!(!resolved.unrecorded);
        assert!(resolve_layout(Some(recorded), &records(8), 12, 12).is_err());
    }

    #[test]
    fn without_a_layout_the_topics_must_be_as_created_and_an_old_logs_layout_does_not_count() {
        let resolved = resolve_layout(None, &records(12), 12, 12).unwrap();
        assert_eq!(resolved.layout.partitions, 12);
        assert!(resolved.unrecorded);
        let altered = resolve_layout(None, &records(16), 12, 12).unwrap();
        assert_eq!(
            altered.layout.partitions, 12,
            "a bare --alter moves nothing"
        );
        let error = resolve_layout(None, &records(16), 16, 12).unwrap_err();
        assert!(
            error.to_string().contains("kafka.partitions (12)"),
            "{error}"
        );
        let old = LogLayout::new("another log", 16);
        let fresh = resolve_layout(Some(old), &records(12), 12, 12).unwrap();
        assert_eq!(fresh.layout, LogLayout::new("id", 12));
        assert!(fresh.unrecorded);
    }

    #[test]
    fn streams_are_routed_as_kafkas_partitioner_routes_their_name() {
        let stream = StreamName::new("orders").unwrap();
        assert_eq!(
            partition_of(&stream, 12),
            quire_queue::partition_for_key(b"orders", 12)
        );
    }
}

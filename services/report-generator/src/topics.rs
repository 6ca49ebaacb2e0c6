//! Watching what the topics are while a session runs.
//!
//! Every `worker.topic_check_interval_ms` the session asks Kafka to
//! describe the records and watermark topics. A topic deleted and created
//! again (another topic id) ends the session: the next one starts from what
//! Kafka and the bucket say now. A grown watermark topic lets the session
//! serve the record partitions it held paused; a grown records topic is
//! said (librdkafka's own metadata refresh rebalances the group onto the new
//! partitions; the partitions past the watermark topic's count are held, and
//! nothing is routed to them: the layout's count routes streams, not the
//! live count).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use quire_config::KafkaSettings;
use quire_queue::TopicIdentity;
use tokio_util::sync::CancellationToken;

/// What the watch saw change, for the loop to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicChange {
    /// A topic was deleted and created again: the session must end.
    Recreated(String),
    /// The watermark topic has this many partitions now: held record
    /// partitions below it can be served.
    WatermarksGrew(i32),
    /// The records topic has this many partitions now (an `--alter`, or a
    /// growth under way): said, and served once the watermark topic has
    /// them too.
    RecordsGrew(i32),
}

/// See the module documentation.
pub struct TopicWatch {
    changes: Arc<Mutex<Vec<TopicChange>>>,
    stop: CancellationToken,
}

impl TopicWatch {
    /// Starts watching, from what the session was built on.
    pub fn start(
        kafka: &KafkaSettings,
        records: TopicIdentity,
        watermarks: TopicIdentity,
        interval: Duration,
    ) -> Self {
        let changes = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (seen, token, kafka) = (Arc::clone(&changes), stop.clone(), kafka.clone());
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval.max(Duration::from_millis(100)));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let (mut records, mut watermarks) = (records, watermarks);
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let now = (
                    quire_queue::describe_topic(&kafka, &records.name).await,
                    quire_queue::describe_topic(&kafka, &watermarks.name).await,
                );
                let (Ok(records_now), Ok(watermarks_now)) = now else {
                    // Kafka away or a topic missing for a moment: the
                    // session's own calls say what that means.
                    continue;
                };
                let found = changed(&records, &watermarks, &records_now, &watermarks_now);
                let end = found
                    .iter()
                    .any(|change| matches!(change, TopicChange::Recreated(_)));
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend(found);
                if end {
                    return;
                }
                (records, watermarks) = (records_now, watermarks_now);
            }
        });
        TopicWatch { changes, stop }
    }

    /// The changes seen since the last call, oldest first.
    pub fn take_changes(&self) -> Vec<TopicChange> {
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Drop for TopicWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What changed between two looks at the topics.
fn changed(
    records: &TopicIdentity,
    watermarks: &TopicIdentity,
    records_now: &TopicIdentity,
    watermarks_now: &TopicIdentity,
) -> Vec<TopicChange> {
    if records_now.id != records.id {
        return vec![TopicChange::Recreated(format!(
            "topic {} was deleted and created again (topic id {} is now {}): a new log starts",
            records.name, records.id, records_now.id
        ))];
    }
    if watermarks_now.id != watermarks.id {
        return vec![TopicChange::Recreated(format!(
            "topic {} was deleted and created again (topic id {} is now {})",
            watermarks.name, watermarks.id, watermarks_now.id
        ))];
    }
    let mut found = Vec::new();
    if watermarks_now.partitions > watermarks.partitions {
        found.push(TopicChange::WatermarksGrew(watermarks_now.partitions));
    }
    if records_now.partitions > records.partitions {
        found.push(TopicChange::RecordsGrew(records_now.partitions));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(name: &str, id: &str, partitions: i32) -> TopicIdentity {
        TopicIdentity {
            name: name.into(),
            id: id.into(),
            partitions,
        }
    }

    #[test]
    fn a_recreated_topic_ends_the_session_and_a_grown_one_is_said() {
        let (records, watermarks) = (topic("r", "R1", 12), topic("w", "W1", 12));
        assert_eq!(changed(&records, &watermarks, &records, &watermarks), []);
        assert_eq!(
            changed(&records, &watermarks, &topic("r", "R1", 16), &watermarks),
            [TopicChange::RecordsGrew(16)]
        );
        assert_eq!(
            changed(
                &records,
                &watermarks,
                &topic("r", "R1", 16),
                &topic("w", "W1", 16)
            ),
            [
                TopicChange::WatermarksGrew(16),
                TopicChange::RecordsGrew(16)
            ]
        );
        let recreated = changed(&records, &watermarks, &topic("r", "R2", 12), &watermarks);
        assert!(
            matches!(&recreated[..], [TopicChange::Recreated(why)] if why.contains("deleted and created again")),
            "{recreated:?}"
        );
        assert!(matches!(
            &changed(&records, &watermarks, &records, &topic("w", "W2", 12))[..],
            [TopicChange::Recreated(_)]
        ));
    }
}

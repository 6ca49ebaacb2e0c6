//! How far each stream is reported: the API's copy of the watermarks.
//!
//! `quire.watermarks` (compacted, partition p for record partition p, key =
//! stream) holds, per stream, the offset of the last message that is in a
//! completed report; a worker writes it in the transaction that announces
//! the report, after the report's document and manifest are stored. So a
//! report whose cut marker is at or below its stream's watermark was
//! completed, and if no manifest describes it now, something deleted it
//! after: report retention (`s3.report_retention_days` deletes documents,
//! then manifests). That is how `GET /v1/reports/{id}` tells an expired
//! report (410 `report_expired`) from a pending one, exactly and without a
//! clock: the cut marker stays in the log for the records' retention, which
//! is usually longer than the reports', so the marker alone cannot tell.
//!
//! Each replica follows the watermark topic for its whole life
//! (`quire_queue::TopicTail`: one read_committed client, a thread of its
//! own), keeping one offset per stream, as a worker taking every partition
//! would. It is consulted only for a report whose manifest is absent and
//! whose marker is in the log: the answer costs no request. Until the tail
//! has read a partition to its end once (start-up), a look-up there waits
//! for it, at most [`CATCH_UP_LIMIT`]; past that it answers "not reported",
//! which keeps the report pending, the answer before expiry was known.
//!
//! What it does not see: an empty window's report keyed by a marker that
//! landed after a later window's document opened (the watermark stays below
//! that document, see ARCHITECTURE.md "Time windows"), and a report cut
//! inline by a rollover, whose id names a record rather than a marker: once
//! their manifests expired they answer as before (pending, or 404).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quire_config::KafkaSettings;
use quire_messages::watermarks::{self, WatermarkEntry};
use quire_messages::{ReportId, StreamName};
use quire_queue::{InMessage, QueueError, TopicTail};

/// How long a look-up waits for the tail to read its partition the first
/// time (start-up); later look-ups use what the tail holds.
pub const CATCH_UP_LIMIT: Duration = Duration::from_secs(2);

/// The latest watermark offset per record partition and stream, and the
/// records log it was written for (`Watermark::log`).
type Offsets = HashMap<(i32, StreamName), (i64, Option<String>)>;

/// See the module documentation.
pub struct Reported {
    offsets: Arc<Mutex<Offsets>>,
    tail: TopicTail,
    /// Per partition: the tail has read it to its end once.
    caught_up: Vec<AtomicBool>,
}

impl Reported {
    /// Starts following the watermark topic (`partitions` partitions, as
    /// many as the records topic). Blocks for the partitions' low
    /// watermarks: call it at start-up, from the blocking pool.
    pub fn start(
        settings: &KafkaSettings,
        partitions: i32,
        group_id: &str,
    ) -> Result<Self, QueueError> {
        let offsets: Arc<Mutex<Offsets>> = Arc::default();
        let topic = settings.topics.watermarks.as_str();
        let tail = {
            let (offsets, named) = (Arc::clone(&offsets), topic.to_owned());
            TopicTail::start(settings, group_id, topic, partitions, move |message| {
                apply(&named, &message, &offsets);
            })?
        };
        Ok(Reported {
            offsets,
            tail,
            caught_up: (0..partitions).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    /// Whether a worker committed the report `id` names: its stream's
    /// watermark of the log in use (`log`; a watermark of a records topic
    /// deleted and created since says nothing of this one) is at or past
    /// the report's offset.
    pub async fn is_reported(&self, id: &ReportId, log: &quire_log::LogIdentity) -> bool {
        let Some(caught_up) = usize::try_from(id.partition)
            .ok()
            .and_then(|index| self.caught_up.get(index))
        else {
            return false;
        };
        if !caught_up.load(Ordering::Acquire) {
            match self.tail.catch_up(id.partition, CATCH_UP_LIMIT).await {
                Ok(()) => caught_up.store(true, Ordering::Release),
                Err(error) => {
                    tracing::debug!(report_id = %id, error = %error, "the watermarks are not read yet; the report counts as not reported");
                    return false;
                }
            }
        }
        self.offsets
            .lock()
            .expect("watermark offsets")
            .get(&(id.partition, id.stream.clone()))
            .is_some_and(|(reported, written_for)| {
                log.is_this_log(written_for.as_deref()) && *reported >= id.offset
            })
    }
}

/// One message of the watermark topic: a stream's latest watermark, its
/// tombstone, or a worker's release (skipped).
fn apply(topic: &str, message: &InMessage, offsets: &Mutex<Offsets>) {
    let WatermarkEntry::Stream(stream, watermark) = watermarks::read(
        message.key.as_deref(),
        &message.headers,
        message.payload.as_deref(),
    ) else {
        return;
    };
    let slot = (message.partition, stream);
    let offset = match watermark {
        Ok(None) => None,
        Ok(Some(watermark)) => watermark.offset.map(|offset| (offset, watermark.log)),
        Err(error) => {
            tracing::warn!(topic, partition = message.partition, offset = message.offset, error = %error, "unreadable watermark ignored");
            return;
        }
    };
    let mut offsets = offsets.lock().expect("watermark offsets");
    match offset {
        Some(offset) => {
            offsets.insert(slot, offset);
        }
        None => {
            offsets.remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(partition: i32, key: &str, payload: Option<&str>) -> InMessage {
        InMessage {
            topic: Arc::from("w"),
            partition,
            offset: 1,
            key: Some(key.as_bytes().to_vec()),
            payload: payload.map(|text| text.as_bytes().to_vec()),
            timestamp_ms: None,
            headers: Vec::new(),
        }
    }

    #[test]
    fn the_latest_watermark_of_each_stream_is_kept_and_a_tombstone_forgets_it() {
        let offsets = Mutex::new(Offsets::new());
        let orders = StreamName::new("orders").unwrap();
        apply(
            "w",
            &message(3, "orders", Some(r#"{"v":1,"partition":3,"offset":40}"#)),
            &offsets,
        );
        apply(
            "w",
            &message(3, "orders", Some(r#"{"v":1,"partition":3,"offset":42}"#)),
            &offsets,
        );
        apply(
            "w",
            &message(4, "orders", Some(r#"{"v":1,"partition":4,"offset":7}"#)),
            &offsets,
        );
        assert_eq!(
            offsets.lock().unwrap().get(&(3, orders.clone())),
            Some(&(42, None))
        );
        assert_eq!(
            offsets.lock().unwrap().get(&(4, orders.clone())),
            Some(&(7, None))
        );
        // Unreadable or invalid: ignored, the last good value stays.
        apply("w", &message(3, "orders", Some("not json")), &offsets);
        apply(
            "w",
            &message(
                3,
                "not a stream!",
                Some(r#"{"v":1,"partition":3,"offset":9}"#),
            ),
            &offsets,
        );
        assert_eq!(
            offsets.lock().unwrap().get(&(3, orders.clone())),
            Some(&(42, None))
        );
        assert_eq!(offsets.lock().unwrap().len(), 2);
        apply("w", &message(3, "orders", None), &offsets);
        assert_eq!(offsets.lock().unwrap().get(&(3, orders)), None);
    }
}

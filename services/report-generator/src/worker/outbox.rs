//! What one array's transaction publishes, and the transaction the group
//! refused, carried to the next array without what revoked partitions put
//! in it.

use std::time::{Duration, Instant};

use quire_messages::Trigger;
use quire_messages::records::LogMessage;
use quire_queue::{OutMessage, QueueError};

use crate::WorkerError;

/// A message of quire's format (`quire_messages`) on `topic`.
pub fn on_topic(topic: &str, message: LogMessage) -> OutMessage {
    OutMessage::from_parts(
        topic,
        message.key,
        message.payload,
        message.headers,
        message.partition,
    )
}

/// The messages one array's transaction publishes.
#[derive(Default)]
pub struct Outbox {
    pub messages: Vec<OutMessage>,
    /// The trigger of each report completed in this array.
    pub reports: Vec<Trigger>,
    pub records: u64,
    pub dead_letters: u64,
    /// Release messages skipped (producers' control messages, no stream).
    pub released: u64,
    /// Window markers published.
    pub window_markers: u64,
    /// Move markers processed (a growth of the partition layout).
    pub moves: u64,
    /// The record partition each message (then each report) came from, in
    /// order: a transaction the group refused is carried to the next array
    /// without the partitions revoked meanwhile.
    sources: Sources,
}

#[derive(Default)]
struct Sources {
    messages: Vec<i32>,
    reports: Vec<i32>,
}

impl Outbox {
    /// The messages and reports added since the last tag came from `partition`.
    pub fn tag_new(&mut self, partition: i32) {
        let untagged = self.messages.len() - self.sources.messages.len();
        self.sources
            .messages
            .extend(std::iter::repeat_n(partition, untagged));
        let untagged = self.reports.len() - self.sources.reports.len();
        self.sources
            .reports
            .extend(std::iter::repeat_n(partition, untagged));
    }

    /// The messages added since the last tag are the worker's markers (or
    /// watermarks): each comes from the record partition it is written to.
    pub fn tag_new_by_target(&mut self) {
        for message in &self.messages[self.sources.messages.len()..] {
            self.sources.messages.push(message.partition.unwrap_or(-1));
        }
    }

    /// Forgets what came from `partition`; how many messages that was.
    pub fn drop_partition(&mut self, partition: i32) -> usize {
        debug_assert_eq!(self.messages.len(), self.sources.messages.len());
        let before = self.messages.len();
        let mut sources = self.sources.messages.iter();
        self.messages.retain(|_| sources.next() != Some(&partition));
        self.sources.messages.retain(|source| *source != partition);
        let mut sources = self.sources.reports.iter();
        self.reports.retain(|_| sources.next() != Some(&partition));
        self.sources.reports.retain(|source| *source != partition);
        before - self.messages.len()
    }
}

/// Refused transactions are carried over for at least this long (and at
/// least `worker.session_timeout_ms`) before the session is restarted.
const REFUSED_CARRY_MIN: Duration = Duration::from_secs(10);

/// A transaction the group refused, kept for the next array's.
pub struct Refused {
    pub outbox: Outbox,
    /// When the first of the refusals in a row happened.
    pub since: Instant,
}

impl Refused {
    /// A transaction the group refused because its generation moved (a
    /// rebalance completed without this member, or it was timed out or
    /// fenced): nothing of it is visible. Instead of ending the session and
    /// rendering every open document of every partition again, its messages
    /// are kept for the next array's transaction, which applies the
    /// rebalance first: what came from revoked partitions is dropped with
    /// them, the rest is committed with the next array, under the new
    /// generation. Bounded: refused for longer than the session timeout
    /// (`session_timeout`, the group's own bound on an unresponsive member),
    /// the session ends.
    pub fn carry(
        outbox: Outbox,
        refused_since: Option<Instant>,
        session_timeout: Duration,
        error: quire_queue::KafkaError,
    ) -> Result<Refused, WorkerError> {
        let since = refused_since.unwrap_or_else(Instant::now);
        if since.elapsed() > session_timeout.max(REFUSED_CARRY_MIN) {
            tracing::warn!(
                refused_for_ms = since.elapsed().as_millis() as u64,
                "transactions refused by the group for too long; restarting the session"
            );
            return Err(WorkerError::Queue(QueueError::GroupRefused(error)));
        }
        tracing::warn!(
            error = %error,
            messages = outbox.messages.len(),
            "transaction refused by the group; committing what is still owned with the next array"
        );
        Ok(Refused { outbox, since })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_outbox_forgets_what_a_revoked_partition_put_in_it() {
        let message = |partition: Option<i32>| {
            let message = OutMessage::new("t", None, b"m".to_vec());
            match partition {
                Some(partition) => message.to_partition(partition),
                None => message,
            }
        };
        let mut outbox = Outbox::default();
        // An event and a report from partition 1, one from partition 2.
        outbox.messages.push(message(None));
        outbox.reports.push(Trigger::Records);
        outbox.tag_new(1);
        outbox.messages.push(message(None));
        outbox.reports.push(Trigger::Age);
        outbox.tag_new(2);
        // A worker's marker and a watermark, written to the partition they
        // come from.
        outbox.messages.push(message(Some(2)));
        outbox.messages.push(message(Some(1)));
        outbox.tag_new_by_target();
        assert_eq!(outbox.drop_partition(1), 2);
        assert_eq!(outbox.messages.len(), 2);
        assert_eq!(outbox.reports, [Trigger::Age]);
        assert_eq!(outbox.sources.messages, [2, 2]);
        assert_eq!(
            outbox.drop_partition(3),
            0,
            "nothing of an unknown partition"
        );
    }
}

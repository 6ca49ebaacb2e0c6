//! Events, watermarks, dead letters and manifests.

use serde::{Deserialize, Serialize};

use crate::{Definition, ReportId, StreamName};

/// Why a document was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Trigger {
    /// `POST /v1/streams/{stream}/reports`.
    Api,
    /// The document reached its maximum record count.
    Records,
    /// The document reached its maximum byte size.
    Bytes,
    /// The document reached its maximum age.
    Age,
    /// The open documents together reached the worker's memory budget.
    Memory,
    /// The worker drained everything queued before it exits.
    Drain,
    /// The document's time window ended (a later message of its partition,
    /// or the window's marker, is at or past the window's end).
    Window,
    /// The stream moved to another partition (a growth of the partition
    /// layout): its document ends at the move marker.
    Move,
}

/// What a report event says. quire announces completed reports only: a
/// report that cannot be written yet is retried (its records are never
/// skipped), and a record that can never be reported is a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportEventKind {
    #[serde(rename = "report.completed")]
    Completed,
}

/// Published on `quire.report-events`, keyed by stream, in the same
/// transaction that commits the report's watermark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportEvent {
    pub v: u32,
    #[serde(rename = "type")]
    pub kind: ReportEventKind,
    pub report_id: ReportId,
    pub stream: StreamName,
    pub key: String,
    pub partition: i32,
    pub first_offset: i64,
    pub last_offset: i64,
    pub records: u64,
    pub bytes: u64,
    pub sha256: String,
    pub trigger: Trigger,
    /// Start of the report's time window, for a windowed stream (RFC 3339
    /// with the zone's offset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_start: Option<String>,
    /// End of the report's time window (exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_end: Option<String>,
    /// The document's place in its window: 1, then 2, ... when cuts or
    /// rollovers split the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_sequence: Option<u32>,
    /// The object's S3 additional checksum, as in its manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<ObjectChecksum>,
}

impl ReportEvent {
    /// The `report.completed` event of the report `manifest` describes: the
    /// one place an event is made from a manifest.
    pub fn completed(manifest: &Manifest) -> Self {
        ReportEvent {
            v: crate::CURRENT_VERSION,
            kind: ReportEventKind::Completed,
            report_id: manifest.report_id.clone(),
            stream: manifest.stream.clone(),
            key: manifest.key.clone(),
            partition: manifest.partition,
            first_offset: manifest.first_offset,
            last_offset: manifest.last_offset,
            records: manifest.records,
            bytes: manifest.bytes,
            sha256: manifest.sha256.clone(),
            trigger: manifest.trigger,
            window_start: manifest.window_start.clone(),
            window_end: manifest.window_end.clone(),
            window_sequence: manifest.window_sequence,
            checksum: manifest.checksum.clone(),
        }
    }
}

/// The value of a stream's key on `quire.watermarks` (compacted, partition p
/// belongs to record partition p): how far the stream is reported, and the
/// definition in force where its partition's committed offset stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermark {
    pub v: u32,
    pub partition: i32,
    /// Offset of the last message (marker included) that is in a completed
    /// report; replays skip the stream's messages at or below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
    /// The definition in force at the partition's committed offset, since a
    /// replay from there does not see the definition messages before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<Definition>,
    /// A windowed stream's progress through its windows, as it stands at
    /// the partition's committed offset (before the definition changes past
    /// it: see `window_after_changes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowProgress>,
    /// The definition changes past the committed offset that a replay reads
    /// again, each with the stream's window progress after it as the worker
    /// that read it left it (documents completed under the new definition
    /// included, whose messages the replay skips): the replay takes that
    /// progress when it reads the change again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub window_after_changes: Vec<WindowAfterChange>,
    /// The Kafka topic id of the records log this watermark is of: a
    /// watermark of another log (the topic was deleted and created again)
    /// does not apply. Absent in watermarks written before it existed,
    /// which are taken as the first log's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    /// Only under the partition's reserved key
    /// [`DEAD_LETTERS_KEY`](crate::watermarks::DEAD_LETTERS_KEY): the highest
    /// offset of the record partition whose dead letter is published. A
    /// replay publishes no dead letter at or below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letters_through: Option<i64>,
}

/// A stream's window progress after the definition change at `offset`
/// (`None`: not windowed, or not started under the new definition).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowAfterChange {
    pub offset: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowProgress>,
}

/// How far a windowed stream is through its windows: every window before
/// `next_ms` is reported (or skipped, under `skip_empty`); `started` lists
/// the later windows that already have completed documents. Written with
/// the watermark in the transaction that commits those reports, so a replay
/// neither reports a window twice nor forgets one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowProgress {
    /// The schedule this progress follows; a definition with another one
    /// starts afresh.
    pub spec: crate::window::WindowSpec,
    /// Start of the first window not yet done (ms since the epoch).
    pub next_ms: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub started: Vec<StartedWindow>,
}

/// A window at or after [`WindowProgress::next_ms`] with completed documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedWindow {
    pub start_ms: i64,
    pub end_ms: i64,
    /// Documents of the window completed so far.
    pub documents: u32,
}

/// A record that cannot be rendered, on `quire.dead-letters`, keyed by
/// `partition:offset` so a replay's repeats can be de-duplicated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub v: u32,
    pub stream: String,
    pub partition: i32,
    pub offset: i64,
    /// The record's place in its batch message (0, 1, ...); absent when the
    /// whole message is the dead letter (a one-record message, or a message
    /// nothing can be read of).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub reason: String,
    /// The record (or the message) body, as UTF-8 (lossy) for a person to read; at most
    /// [`DeadLetter::PAYLOAD_LIMIT`] bytes of it (the record itself stays in
    /// the records topic at `partition` and `offset`).
    pub payload: String,
    /// Size of the whole message body, when `payload` holds only its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_truncated_from: Option<u64>,
}

impl DeadLetter {
    /// The most of a body a dead letter carries: with the reason and JSON
    /// escaping, a dead letter stays far below the broker's message size
    /// limit whatever the record, so a record can never stop the stream.
    pub const PAYLOAD_LIMIT: usize = 64 * 1024;

    /// The dead letter of the message at `partition` and `offset` (of its
    /// record at `index` in a batch).
    pub fn new(
        stream: String,
        partition: i32,
        offset: i64,
        index: Option<u32>,
        reason: String,
        body: &[u8],
    ) -> Self {
        let (payload, payload_truncated_from) = if body.len() <= Self::PAYLOAD_LIMIT {
            (String::from_utf8_lossy(body).into_owned(), None)
        } else {
            let mut text = String::from_utf8_lossy(&body[..Self::PAYLOAD_LIMIT]).into_owned();
            // A character cut in two at the limit became U+FFFD: drop it.
            if text.ends_with('\u{FFFD}') {
                text.pop();
            }
            (text, Some(body.len() as u64))
        };
        DeadLetter {
            v: crate::CURRENT_VERSION,
            stream,
            partition,
            offset,
            index,
            reason,
            payload,
            payload_truncated_from,
        }
    }

    /// `{partition}:{offset}`, or `{partition}:{offset}:{index}` for a
    /// record of a batch: one key per dead letter.
    pub fn key(partition: i32, offset: i64, index: Option<u32>) -> String {
        match index {
            Some(index) => format!("{partition}:{offset}:{index}"),
            None => format!("{partition}:{offset}"),
        }
    }
}

/// `manifests/{report_id}.json`, written before the report's event. Its
/// times come from the log (message timestamps), so a replay writes the same
/// manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub v: u32,
    pub report_id: ReportId,
    pub stream: StreamName,
    pub key: String,
    pub partition: i32,
    /// The document's first offset (its first record's, or the marker's for
    /// an empty report).
    pub first_offset: i64,
    /// The cut marker's offset.
    pub last_offset: i64,
    pub records: u64,
    /// Size of the stored object (compressed, for a `.xml.gz` report).
    pub bytes: u64,
    /// SHA-256 of the stored object, as downloaded (lowercase hex).
    pub sha256: String,
    /// The stored object's ETag, as S3 answered its upload (with its
    /// quotes): what the API compares the object at `key` against before it
    /// serves this manifest, since a replay of the log that cut elsewhere
    /// (after a crash and a changed rollover setting) writes other bytes to
    /// the same key. The same bytes in the same parts give the same ETag on
    /// servers whose ETags are MD5s (versitygw; S3 without SSE-KMS), so a
    /// replay of the same cut writes the same manifest. Absent in manifests
    /// of earlier releases (then the size alone is compared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e_tag: Option<String>,
    /// Size of the XML before compression; only for gzip reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncompressed_bytes: Option<u64>,
    pub trigger: Trigger,
    /// Log timestamp of the first record (ms since the epoch), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_record_time_ms: Option<i64>,
    /// Log timestamp of the cut marker (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_time_ms: Option<i64>,
    /// Start of the report's time window, for a windowed stream (RFC 3339
    /// with the zone's offset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_start: Option<String>,
    /// End of the report's time window (exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_end: Option<String>,
    /// The document's place in its window: 1, then 2, ... when cuts or
    /// rollovers split the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_sequence: Option<u32>,
    /// The Kafka topic id of the records log the report was cut from
    /// (absent in manifests written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    /// The S3 additional checksum the server verified and stores with the
    /// object (absent under `s3.checksum = "none"`, and in manifests
    /// written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<ObjectChecksum>,
}

/// An object's S3 additional checksum, as S3 writes it: a reader can ask
/// the server for it (GetObject with `x-amz-checksum-mode: ENABLED`) and
/// compute it from the bytes (a full-object one) to check what it read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectChecksum {
    /// `CRC32C` or `SHA256`.
    pub algorithm: String,
    /// `FULL_OBJECT`: the checksum of the object's bytes; `COMPOSITE`: the
    /// checksum of its parts' checksums, with `-N` for N parts.
    #[serde(rename = "type")]
    pub kind: String,
    /// Base64 of the checksum's big-endian bytes.
    pub value: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_carries_at_most_its_limit_of_the_body() {
        let small = DeadLetter::new("s".into(), 1, 2, None, "bad".into(), b"{not json");
        assert_eq!(small.payload, "{not json");
        assert_eq!(small.payload_truncated_from, None);

        // Two-byte characters, so the limit falls inside one of them.
        let body = "é".repeat(DeadLetter::PAYLOAD_LIMIT).into_bytes();
        let large = DeadLetter::new("s".into(), 1, 2, None, "bad".into(), &body);
        assert!(large.payload.len() <= DeadLetter::PAYLOAD_LIMIT);
        assert!(
            large.payload.chars().all(|c| c == 'é'),
            "no broken character"
        );
        assert_eq!(large.payload_truncated_from, Some(body.len() as u64));
        // Quotes double under JSON escaping: still far below a megabyte.
        let quotes = vec![b'"'; 900_000];
        let encoded = crate::encode(&DeadLetter::new(
            "s".into(),
            1,
            2,
            None,
            "bad".into(),
            &quotes,
        ));
        assert!(encoded.len() < 200_000, "{} bytes", encoded.len());
    }
}

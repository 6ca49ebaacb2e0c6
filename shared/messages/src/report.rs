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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportEventKind {
    #[serde(rename = "report.completed")]
    Completed,
    #[serde(rename = "report.failed")]
    Failed,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
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
}

/// A record that cannot be rendered, on `quire.dead-letters`, keyed by
/// `partition:offset` so a replay's repeats can be de-duplicated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub v: u32,
    pub stream: String,
    pub partition: i32,
    pub offset: i64,
    pub reason: String,
    /// The message body, as UTF-8 (lossy) for a person to read.
    pub payload: String,
}

impl DeadLetter {
    pub fn key(partition: i32, offset: i64) -> String {
        format!("{partition}:{offset}")
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
}

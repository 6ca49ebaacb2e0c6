//! Every body quire puts on Kafka or next to a report in S3, in one crate, so
//! a producer and a worker of different releases agree on them.
//!
//! Versioning: every JSON body carries `"v"`; records carry the header
//! [`HEADER_VERSION`]. A reader accepts every version up to
//! [`CURRENT_VERSION`] and refuses newer ones with a clear error, never a
//! silent misreading. Unknown fields are ignored, so a newer writer may add
//! optional fields without a version bump. Definitions refuse unknown fields
//! (they are what an API client typed), so a field that changes what is
//! stored raises their version instead, only on the definitions that use it:
//! a definition with `gzip` is version 2, one without stays version 1.
//!
//! The log `quire.records` holds, per stream key, in order (built and told
//! apart by [`records`]; the watermark topic's format is [`watermarks`]'s,
//! the events' and dead letters' [`events`]; the bucket's keys are in
//! [`layout`]):
//! - records: the JSON object exactly as the producer sent it (header
//!   `quire-kind: record`);
//! - cut markers ([`CutMarker`], `quire-kind: cut`);
//! - definition changes ([`Definition`], `quire-kind: definition`).
//!
//! Everything that decides a document's content is in that log.

pub mod batch;
pub mod compression;
mod definition;
pub mod events;
pub mod fields;
pub mod header;
pub mod key_template;
pub mod layout;
pub mod log;
mod names;
pub mod records;
mod report;
pub mod watermarks;
pub mod window;

use serde::{Deserialize, Serialize};

pub use definition::{
    Definition, DefinitionError, MAX_INDENT, SUMMARY_ELEMENT, is_xml_name, is_xml_name_char,
    is_xml_name_start_char,
};
pub use log::{Handover, LogLayout, LogRegistry, LogTag, PartitionMove, PartitionMoved};
pub use names::{ReportId, StreamName, StreamNameError};
pub use report::{
    DeadLetter, Manifest, ObjectChecksum, ReportEvent, ReportEventKind, StartedWindow, Trigger,
    Watermark, WindowAfterChange, WindowProgress,
};

/// The version this release writes.
pub const CURRENT_VERSION: u32 = 1;

/// Header naming what a `quire.records` message is.
pub const HEADER_KIND: &str = "quire-kind";
/// Header carrying the body's version on records (whose body is the
/// producer's own JSON object).
pub const HEADER_VERSION: &str = "quire-v";

/// What a message of `quire.records` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// One record, its JSON text as the payload (what the API wrote before
    /// batch messages; still read, so a log that holds both renders in
    /// order).
    Record,
    /// Records of one stream in order, framed ([`crate::batch`]): what the
    /// API writes.
    Batch,
    Cut,
    Definition,
    /// A producer's own control message, carrying no stream (no key): it
    /// exists only so that the transaction writing it puts a COMMIT marker on
    /// its partition, releasing what an earlier transaction of the same
    /// producer may have left open there (a marker a crashed coordinator
    /// skipped). Workers skip it.
    Release,
    /// A growth of the partition layout reaching this partition
    /// ([`PartitionMove`], no key): the streams that move complete their
    /// documents here and are handed over to their new partitions.
    Move,
    /// A stream arriving on its new partition ([`Handover`], on its key).
    Handover,
}

impl MessageKind {
    pub fn as_header(self) -> &'static str {
        match self {
            MessageKind::Record => "record",
            MessageKind::Batch => "batch",
            MessageKind::Cut => "cut",
            MessageKind::Definition => "definition",
            MessageKind::Release => "release",
            MessageKind::Move => "move",
            MessageKind::Handover => "handover",
        }
    }

    pub fn from_header(value: &[u8]) -> Option<Self> {
        match value {
            b"record" => Some(MessageKind::Record),
            b"batch" => Some(MessageKind::Batch),
            b"cut" => Some(MessageKind::Cut),
            b"definition" => Some(MessageKind::Definition),
            b"release" => Some(MessageKind::Release),
            b"move" => Some(MessageKind::Move),
            b"handover" => Some(MessageKind::Handover),
            _ => None,
        }
    }
}

/// A cut marker: the document of its stream ends where this marker lands.
///
/// The API publishes markers for explicit cuts (`document` = None: cut
/// whatever is open). A worker publishes markers for rollovers and names the
/// document it cuts by its first offset, so a marker that lands after that
/// document was already cut (another owner decided the same rollover) is
/// ignored, and a replay cuts at exactly the same places.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CutMarker {
    pub v: u32,
    pub trigger: Trigger,
    /// First offset of the document this marker cuts, for worker markers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<i64>,
    /// The time window this marker closes (trigger `window`): published once
    /// a worker's clock passes the window's end plus its grace, so that an
    /// idle stream's window is reported too. Its own log time is past the
    /// window's end, so it lands after every record of the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<window::Window>,
}

impl CutMarker {
    pub fn explicit() -> Self {
        CutMarker {
            v: CURRENT_VERSION,
            trigger: Trigger::Api,
            document: None,
            window: None,
        }
    }

    pub fn rollover(trigger: Trigger, document_first_offset: i64) -> Self {
        CutMarker {
            v: CURRENT_VERSION,
            trigger,
            document: Some(document_first_offset),
            window: None,
        }
    }

    /// The marker that closes `window` of a windowed stream.
    pub fn window(window: window::Window) -> Self {
        CutMarker {
            v: CURRENT_VERSION,
            trigger: Trigger::Window,
            document: None,
            window: Some(window),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("body is not valid JSON for {what}: {source}")]
    Json {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("{what} has version {found}, newer than this release reads ({newest}); upgrade it")]
    TooNew {
        what: &'static str,
        found: u32,
        newest: u32,
    },
}

/// Decodes a versioned JSON body, refusing versions newer than ours.
pub fn decode<'a, T>(what: &'static str, bytes: &'a [u8]) -> Result<T, DecodeError>
where
    T: Deserialize<'a> + Versioned,
{
    let value: T =
        serde_json::from_slice(bytes).map_err(|source| DecodeError::Json { what, source })?;
    if value.version() > T::NEWEST_VERSION {
        return Err(DecodeError::TooNew {
            what,
            found: value.version(),
            newest: T::NEWEST_VERSION,
        });
    }
    Ok(value)
}

/// Encodes a body as compact JSON.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("quire's message types always serialise")
}

/// A body with a version field.
pub trait Versioned {
    /// The newest version of this body this release reads.
    const NEWEST_VERSION: u32 = CURRENT_VERSION;

    fn version(&self) -> u32;
}

macro_rules! versioned {
    ($($type:ty),*) => {$(
        impl Versioned for $type {
            fn version(&self) -> u32 {
                self.v
            }
        }
    )*};
}
versioned!(
    CutMarker,
    ReportEvent,
    Watermark,
    DeadLetter,
    Manifest,
    LogRegistry,
    LogLayout,
    PartitionMove,
    PartitionMoved,
    Handover
);

/// Definitions gained `gzip` in version 2 ([`Definition::GZIP_VERSION`]), and
/// `window` and `key_template` in version 3 ([`Definition::WINDOW_VERSION`]).
impl Versioned for Definition {
    const NEWEST_VERSION: u32 = Definition::NEWEST_VERSION;

    fn version(&self) -> u32 {
        self.v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_version_is_refused_by_name() {
        let error = decode::<CutMarker>("cut marker", br#"{"v":2,"trigger":"api"}"#).unwrap_err();
        assert!(error.to_string().contains("version 2"), "{error}");
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let marker: CutMarker = decode(
            "cut marker",
            br#"{"v":1,"trigger":"records","document":7,"future":true}"#,
        )
        .unwrap();
        assert_eq!(marker, CutMarker::rollover(Trigger::Records, 7));
    }

    #[test]
    fn kinds_round_trip_through_their_header() {
        for kind in [
            MessageKind::Record,
            MessageKind::Batch,
            MessageKind::Cut,
            MessageKind::Definition,
            MessageKind::Release,
            MessageKind::Move,
            MessageKind::Handover,
        ] {
            assert_eq!(
                MessageKind::from_header(kind.as_header().as_bytes()),
                Some(kind)
            );
        }
        assert_eq!(MessageKind::from_header(b"other"), None);
    }
}

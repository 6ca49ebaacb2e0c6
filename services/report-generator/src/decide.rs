//! The worker's decisions about the log, as pure functions: what to do with
//! a message, given the stats of its stream's open document, the message,
//! the definition in force and the settings. Nothing here touches Kafka, S3
//! or a clock; the partition's pipeline (`pipeline.rs`) applies what they
//! return. That is what makes "every cut is decided by the log" a property
//! the unit tests can check (`pipeline/properties.rs`).

use quire_messages::records::{Incoming, RecordTexts, StreamMessage};
use quire_messages::window::Window;
use quire_messages::{CutMarker, Definition, Handover, PartitionMove, StreamName, Trigger};

use crate::partition::StreamWindow;

/// What the pipeline knows of an open document when it decides: its place in
/// the log and its size so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocumentStats {
    pub first_offset: i64,
    pub records: u64,
    /// Bytes of the stored object so far (compressed under gzip, less what
    /// the compressor still holds).
    pub bytes: u64,
    /// Offset and log time of the last record appended.
    pub last_record_offset: Option<i64>,
    pub last_record_time_ms: Option<i64>,
}

/// The settings that decide where a document ends. They depend on nothing
/// but the worker's configuration, so the same log gives the same cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutLimits {
    pub rollover_records: u64,
    pub rollover_bytes: u64,
    /// The most a document may hold before its closing summary: a record
    /// whose rendering would pass it starts the next document.
    pub record_limit: u64,
}

/// What to do with one message of the records topic.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision<'a> {
    /// A producer's release: counted, nothing else.
    Released,
    /// Nothing to do.
    Skip(Skip),
    /// To the dead-letter topic, with this reason (once: unless the
    /// partition's dead-letter mark covers the message).
    DeadLetter(String),
    /// The stream's definition from this message on (even below the
    /// watermark: it shapes the documents that open after it).
    Define(StreamName, Definition),
    /// The stream arrives on this partition in a grown layout.
    Handover(StreamName, Handover),
    /// A growth of the layout reaches this partition.
    Move(PartitionMove),
    /// A record to render and append to its stream's document (opened if
    /// none is): then [`fit`] and [`rollover`] decide where it ends.
    Append(StreamName, RecordTexts<'a>),
    /// The stream's open document ends at this marker; with nothing open,
    /// an empty report keyed by the marker.
    CutAt(StreamName, Trigger),
    /// A marker of the window that ended (see [`window_marker`]).
    WindowMarker(StreamName, Window),
}

/// Why a message needs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// At or below the stream's watermark: in a completed report already.
    Reported,
    /// A rollover marker naming a document that is no longer open (cut
    /// inline meanwhile, or by another owner's same decision).
    StaleMarker,
}

/// What to do with a message, `incoming` as the format owner read it:
/// `reported` tells whether the stream's watermark covers `offset`, and
/// `open_first_offset` is the first offset of the stream's open document.
pub fn decide<'a>(
    incoming: Incoming<'a>,
    reported: impl Fn(&StreamName) -> bool,
    open_first_offset: impl Fn(&StreamName) -> Option<i64>,
) -> Decision<'a> {
    let (stream, body) = match incoming {
        Incoming::Release => return Decision::Released,
        Incoming::Move(Ok(marker)) => return Decision::Move(marker),
        Incoming::Move(Err(reason)) | Incoming::Invalid(reason) => {
            return Decision::DeadLetter(reason);
        }
        Incoming::Stream(stream, body) => (stream, body),
    };
    if let StreamMessage::Definition(definition) = body {
        return match definition {
            Ok(definition) => Decision::Define(stream, definition),
            Err(reason) => Decision::DeadLetter(reason),
        };
    }
    if reported(&stream) {
        return Decision::Skip(Skip::Reported);
    }
    match body {
        StreamMessage::Definition(_) => unreachable!("decided above"),
        StreamMessage::Handover(Ok(arrived)) => Decision::Handover(stream, arrived),
        StreamMessage::Records(Ok(texts)) => Decision::Append(stream, texts),
        StreamMessage::Handover(Err(reason))
        | StreamMessage::Records(Err(reason))
        | StreamMessage::Cut(Err(reason)) => Decision::DeadLetter(reason),
        StreamMessage::Cut(Ok(CutMarker {
            window: Some(window),
            ..
        })) => Decision::WindowMarker(stream, window),
        StreamMessage::Cut(Ok(CutMarker {
            document: Some(named),
            ..
        })) if open_first_offset(&stream) != Some(named) => Decision::Skip(Skip::StaleMarker),
        StreamMessage::Cut(Ok(marker)) => Decision::CutAt(stream, marker.trigger),
    }
}

/// What a message's records (one, or a batch's) come to once rendered for
/// their stream's open document: the records that rendered and their bytes.
/// Those that could not be rendered are dead letters of their own, decided
/// by the renderer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rendered {
    pub records: u64,
    pub bytes: u64,
    /// The message is a batch (its dead letters name each record's place).
    pub batch: bool,
}

/// Whether a message's rendered records fit their stream's open document.
/// They go together: a batch is one place in the log, so a document never
/// ends inside one and keys, watermarks and commits stay offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// Append them.
    Append,
    /// Nothing rendered (every record is a dead letter). `abort`: the
    /// document holds no record (it was opened for this message) and is
    /// abandoned. A dead letter never opens a document: a replay, which may
    /// read it when its stream has nothing open, then decides as the first
    /// read did.
    Nothing { abort: bool },
    /// The document ends before the message, at its last record (trigger
    /// `bytes`); the message opens the next one.
    CutBefore { last_offset: i64 },
    /// Even alone in a document they would pass the limit: every record of
    /// the message is a dead letter, for this reason; `abort` as above.
    TooLarge { reason: String, abort: bool },
}

/// Where a message whose records render to `rendered` goes, given its
/// stream's open document: records that would take the document past the
/// writer's declared maximum end the document *before* the message.
pub fn fit(document: &DocumentStats, rendered: Rendered, limits: &CutLimits) -> Fit {
    let empty = document.last_record_offset.is_none();
    if rendered.records == 0 {
        return Fit::Nothing { abort: empty };
    }
    if document.bytes.saturating_add(rendered.bytes) <= limits.record_limit {
        return Fit::Append;
    }
    match document.last_record_offset {
        // Even alone in a document they would pass the maximum.
        None => Fit::TooLarge {
            reason: format!(
                "{} renders to {} bytes, more than a report may hold ({} bytes)",
                if rendered.batch {
                    "the record's batch"
                } else {
                    "record"
                },
                rendered.bytes,
                limits.record_limit
            ),
            abort: true,
        },
        Some(last_offset) => Fit::CutBefore { last_offset },
    }
}

/// Whether the document ends *at* the message just appended: the record (or
/// batch) that brings it to `rollover_records` or `rollover_bytes` (no
/// marker; the report's id names that message). A document may pass either
/// by at most one batch.
pub fn rollover(document: &DocumentStats, limits: &CutLimits) -> Option<Trigger> {
    if document.records >= limits.rollover_records {
        Some(Trigger::Records)
    } else if document.bytes >= limits.rollover_bytes {
        Some(Trigger::Bytes)
    } else {
        None
    }
}

/// Whether a windowed document whose window ends at `window_end_ms` is
/// complete once its partition's log time is `time_ms`: a document ends at
/// the first message of its partition at or past its window's end, whatever
/// stream that message is of.
pub fn window_closed(window_end_ms: i64, time_ms: i64) -> bool {
    window_end_ms <= time_ms
}

/// What a window marker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowMarker {
    /// The window gets its empty report, keyed by the marker.
    EmptyReport,
    /// Nothing, for this reason.
    Ignore(IgnoredMarker),
}

/// Why a window marker does nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoredMarker {
    /// The stream has no windows.
    NoWindows,
    /// The marker is of another schedule.
    OtherSchedule,
    /// The window is done or has documents, or the definition skips empty
    /// windows.
    Done,
    /// The marker landed before its window ended by log time (the broker's
    /// clock is behind the worker's by more than the grace: records of the
    /// window may still come after it); another is published later.
    Early,
}

/// A marker closing `window` (published by a worker once its clock passed
/// the window's end plus grace), read at log time `time_ms`, for a stream
/// whose windows are `progress`. Every document whose window ended is
/// already completed by then (the marker's log time is past the end); what
/// is left is a window without documents.
pub fn window_marker(
    progress: Option<&StreamWindow>,
    window: Window,
    time_ms: i64,
) -> WindowMarker {
    let Some(progress) = progress else {
        return WindowMarker::Ignore(IgnoredMarker::NoWindows);
    };
    if progress.schedule.window_of(window.start_ms) != window {
        return WindowMarker::Ignore(IgnoredMarker::OtherSchedule);
    }
    if progress.reported(window) || progress.schedule.skip_empty() {
        return WindowMarker::Ignore(IgnoredMarker::Done);
    }
    if time_ms < window.end_ms {
        return WindowMarker::Ignore(IgnoredMarker::Early);
    }
    WindowMarker::EmptyReport
}

#[cfg(test)]
mod tests {
    use super::*;
    use quire_messages::records;

    fn stream(name: &str) -> StreamName {
        StreamName::new(name).unwrap()
    }

    fn limits() -> CutLimits {
        CutLimits {
            rollover_records: 3,
            rollover_bytes: 1_000,
            record_limit: 2_000,
        }
    }

    fn document(records: u64, bytes: u64) -> DocumentStats {
        DocumentStats {
            first_offset: 10,
            records,
            bytes,
            last_record_offset: (records > 0).then_some(10 + records as i64 - 1),
            last_record_time_ms: None,
        }
    }

    fn decide_message(
        message: &records::LogMessage,
        reported: bool,
        open: Option<i64>,
    ) -> Decision<'_> {
        decide(
            records::read(message.key.as_deref(), &message.headers, &message.payload),
            |_| reported,
            |_| open,
        )
    }

    #[test]
    fn a_record_is_appended_unless_its_stream_already_reported_it() {
        let orders = stream("orders");
        let message = records::record(&orders, br#"{"a":1}"#);
        assert_eq!(
            decide_message(&message, false, None),
            Decision::Append(orders, RecordTexts::One(br#"{"a":1}"#.as_slice()))
        );
        assert_eq!(
            decide_message(&message, true, None),
            Decision::Skip(Skip::Reported)
        );
    }

    #[test]
    fn a_definition_applies_even_below_the_watermark() {
        let orders = stream("orders");
        let message = records::definition(&orders, &Definition::default());
        assert_eq!(
            decide_message(&message, true, None),
            Decision::Define(orders, Definition::default())
        );
    }

    #[test]
    fn a_rollover_marker_cuts_only_the_document_it_names() {
        let orders = stream("orders");
        let marker = records::cut(&orders, &CutMarker::rollover(Trigger::Age, 10));
        assert_eq!(
            decide_message(&marker, false, Some(10)),
            Decision::CutAt(orders.clone(), Trigger::Age)
        );
        assert_eq!(
            decide_message(&marker, false, Some(12)),
            Decision::Skip(Skip::StaleMarker)
        );
        let explicit = records::cut(&orders, &CutMarker::explicit());
        assert_eq!(
            decide_message(&explicit, false, None),
            Decision::CutAt(orders, Trigger::Api),
            "nothing open: an empty report"
        );
    }

    #[test]
    fn what_cannot_be_read_is_a_dead_letter_and_a_release_is_counted() {
        assert_eq!(
            decide(
                records::read(Some(b"orders"), &[], b"{}"),
                |_| false,
                |_| None
            ),
            Decision::DeadLetter("missing or unknown quire-kind header".into())
        );
        let release = records::release(1);
        assert_eq!(decide_message(&release, false, None), Decision::Released);
    }

    fn rendered(records: u64, bytes: u64) -> Rendered {
        Rendered {
            records,
            bytes,
            batch: records > 1,
        }
    }

    #[test]
    fn records_that_do_not_fit_end_the_document_before_them_or_alone_are_dead_letters() {
        assert_eq!(
            fit(&document(2, 1_500), rendered(1, 500), &limits()),
            Fit::Append
        );
        assert_eq!(
            fit(&document(2, 1_501), rendered(1, 500), &limits()),
            Fit::CutBefore { last_offset: 11 }
        );
        // A batch goes whole: the document ends before it.
        assert_eq!(
            fit(&document(2, 1_000), rendered(40, 1_001), &limits()),
            Fit::CutBefore { last_offset: 11 }
        );
        assert!(matches!(
            fit(&document(0, 100), rendered(1, 1_901), &limits()),
            Fit::TooLarge { abort: true, reason } if reason.starts_with("record renders to 1901 bytes")
        ));
        assert!(matches!(
            fit(&document(0, 100), rendered(5, 1_901), &limits()),
            Fit::TooLarge { abort: true, reason } if reason.starts_with("the record's batch renders")
        ));
        assert_eq!(
            fit(&document(1, 100), rendered(0, 0), &limits()),
            Fit::Nothing { abort: false }
        );
        // Opened for a message none of whose records renders: abandoned, so
        // a dead letter never begins a document.
        assert_eq!(
            fit(&document(0, 100), rendered(0, 0), &limits()),
            Fit::Nothing { abort: true }
        );
    }

    #[test]
    fn a_document_ends_at_the_record_that_reaches_a_rollover() {
        assert_eq!(rollover(&document(2, 999), &limits()), None);
        assert_eq!(
            rollover(&document(3, 10), &limits()),
            Some(Trigger::Records)
        );
        assert_eq!(
            rollover(&document(1, 1_000), &limits()),
            Some(Trigger::Bytes)
        );
        assert!(window_closed(10, 10) && !window_closed(11, 10));
    }
}

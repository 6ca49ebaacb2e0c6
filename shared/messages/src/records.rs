//! The records topic's message format, in one place: how each kind of
//! message is built (key, `quire-kind` and `quire-v` headers, payload) and
//! how a reader tells them apart. Topic-free: the services put these on
//! their topic.
//!
//! | kind | key | payload |
//! | --- | --- | --- |
//! | `record` | the stream | the producer's JSON object, byte for byte |
//! | `cut` | the stream | a [`CutMarker`] |
//! | `definition` | the stream | a [`Definition`] |
//! | `release` | none (records) or [`RELEASE_KEY`] (compacted topics) | `{"v":1}` |
//! | `move` | none, one per partition of the old layout | a [`PartitionMove`] |
//! | `handover` | the stream, on its new partition | a [`Handover`] |
//!
//! The watermark topic holds, beside each stream's [`crate::Watermark`],
//! the partition layout on partition 0 under [`LAYOUT_KEY`] ([`layout`]).
//! Keys starting `quire:` are quire's own ([`is_reserved_key`]): no stream
//! name can start so.
//!
//! The watermarks topic is keyed by stream, plus two reserved keys no
//! stream can have: [`RELEASE_KEY`] and [`DEAD_LETTERS_KEY`] (one per
//! partition, [`dead_letter_mark`]).
//!
//! Every message carries `quire-v: CURRENT_VERSION`; a reader refuses a
//! newer one ([`unreadable_version`]), never misreads it.

use crate::{
    CURRENT_VERSION, CutMarker, Definition, HEADER_KIND, HEADER_VERSION, Handover, LogLayout,
    MessageKind, PartitionMove, PartitionMoved, StreamName, Watermark,
};

/// The key of release messages on a compacted topic (which refuses
/// keyless messages): no stream can have it.
pub const RELEASE_KEY: &str = "quire:release";

/// The key of the partition layout on the watermark topic (partition 0).
pub const LAYOUT_KEY: &str = "quire:layout";

/// The watermark topic's partition that holds the layout.
pub const LAYOUT_PARTITION: i32 = 0;

/// The key under which a worker records, on watermark partition p, that it
/// processed partition p's move marker ([`moved`]).
pub const MOVED_KEY: &str = "quire:moved";

/// Whether a key on a compacted topic is one of quire's own (a release, the
/// layout, a move processed, a dead-letter mark), never a stream's.
pub fn is_reserved_key(key: &[u8]) -> bool {
    key.starts_with(b"quire:")
}

/// The key, on the watermarks topic, of a partition's dead-letter mark: a
/// [`Watermark`] whose `dead_letters_through` is the highest offset of the
/// record partition whose dead letter is published. Messages without a
/// valid stream (no key, an invalid name) have their dead letters too, so
/// the mark is the partition's, not a stream's.
pub const DEAD_LETTERS_KEY: &str = "quire:dead-letters";

/// One message as quire writes it, without its topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogMessage {
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub payload: Vec<u8>,
    /// Set for release messages (one per partition); else the key decides.
    pub partition: Option<i32>,
}

fn headers(kind: MessageKind) -> Vec<(String, Vec<u8>)> {
    vec![
        (HEADER_KIND.to_owned(), kind.as_header().as_bytes().to_vec()),
        (
            HEADER_VERSION.to_owned(),
            CURRENT_VERSION.to_string().into_bytes(),
        ),
    ]
}

/// A record: its exact JSON text, keyed by its stream.
pub fn record(stream: &StreamName, json: &[u8]) -> LogMessage {
    control(MessageKind::Record, stream, json.to_vec())
}

/// A message of `kind` on the stream's key, so it lands in order with the
/// stream's records; `body` is its encoded payload.
pub fn control(kind: MessageKind, stream: &StreamName, body: Vec<u8>) -> LogMessage {
    LogMessage {
        key: Some(stream.as_str().as_bytes().to_vec()),
        headers: headers(kind),
        payload: body,
        partition: None,
    }
}

/// A cut marker of `stream`.
pub fn cut(stream: &StreamName, marker: &CutMarker) -> LogMessage {
    control(MessageKind::Cut, stream, crate::encode(marker))
}

/// A definition change of `stream`.
pub fn definition(stream: &StreamName, definition: &Definition) -> LogMessage {
    control(MessageKind::Definition, stream, crate::encode(definition))
}

/// The marker of a growth to `partitions` partitions on `partition` of the
/// old layout: no key, no stream (see [`PartitionMove`]).
pub fn partition_move(partition: i32, marker: &PartitionMove) -> LogMessage {
    LogMessage {
        key: None,
        headers: headers(MessageKind::Move),
        payload: crate::encode(marker),
        partition: Some(partition),
    }
}

/// `stream` arriving on `partition`, its new one (see [`Handover`]).
pub fn handover(stream: &StreamName, partition: i32, handover: &Handover) -> LogMessage {
    LogMessage {
        partition: Some(partition),
        ..control(MessageKind::Handover, stream, crate::encode(handover))
    }
}

/// The partition layout as the watermark topic holds it: key
/// [`LAYOUT_KEY`] on [`LAYOUT_PARTITION`].
pub fn layout(layout: &LogLayout) -> LogMessage {
    LogMessage {
        key: Some(LAYOUT_KEY.as_bytes().to_vec()),
        headers: Vec::new(),
        payload: crate::encode(layout),
        partition: Some(LAYOUT_PARTITION),
    }
}

/// On watermark partition `partition`: its move marker was processed.
pub fn moved(partition: i32, moved: &PartitionMoved) -> LogMessage {
    LogMessage {
        key: Some(MOVED_KEY.as_bytes().to_vec()),
        headers: Vec::new(),
        payload: crate::encode(moved),
        partition: Some(partition),
    }
}

/// A release message for `partition` of the records topic (see
/// [`MessageKind::Release`]): no key, no stream.
pub fn release(partition: i32) -> LogMessage {
    LogMessage {
        key: None,
        headers: headers(MessageKind::Release),
        payload: format!("{{\"v\":{CURRENT_VERSION}}}").into_bytes(),
        partition: Some(partition),
    }
}

/// A release message for `partition` of a compacted topic: keyed
/// [`RELEASE_KEY`].
pub fn keyed_release(partition: i32) -> LogMessage {
    LogMessage {
        key: Some(RELEASE_KEY.as_bytes().to_vec()),
        ..release(partition)
    }
}

/// The dead-letter mark of record partition `partition`, for the same
/// partition of the watermarks topic: every dead letter of a message at or
/// below `through` is published, in the records log `log` (its topic id).
pub fn dead_letter_mark(partition: i32, through: i64, log: &str) -> LogMessage {
    let mark = Watermark {
        v: CURRENT_VERSION,
        partition,
        offset: None,
        definition: None,
        window: None,
        log: Some(log.to_owned()),
        dead_letters_through: Some(through),
    };
    LogMessage {
        key: Some(DEAD_LETTERS_KEY.as_bytes().to_vec()),
        headers: Vec::new(),
        payload: crate::encode(&mark),
        partition: Some(partition),
    }
}

/// Whether a watermark message's key is the reserved [`DEAD_LETTERS_KEY`].
pub fn is_dead_letter_mark(key: Option<&[u8]>) -> bool {
    key == Some(DEAD_LETTERS_KEY.as_bytes())
}

/// What a message is, from its `quire-kind` header (`None`: absent or
/// unknown).
pub fn kind_of(kind_header: Option<&[u8]>) -> Option<MessageKind> {
    kind_header.and_then(MessageKind::from_header)
}

/// Whether a message (its `quire-kind` header and key) is a release.
pub fn is_release(kind_header: Option<&[u8]>, key: Option<&[u8]>) -> bool {
    kind_of(kind_header) == Some(MessageKind::Release) || key == Some(RELEASE_KEY.as_bytes())
}

/// Why a message's `quire-v` header is one this release cannot read (newer
/// than ours, or not a number); `None` for ours, older ones and no header
/// (records written before the header existed).
pub fn unreadable_version(version_header: Option<&[u8]>) -> Option<String> {
    let header = version_header?;
    match std::str::from_utf8(header)
        .ok()
        .and_then(|text| text.trim().parse::<u32>().ok())
    {
        Some(version) if version <= CURRENT_VERSION => None,
        Some(version) => Some(format!(
            "record has version {version}, newer than this release reads ({CURRENT_VERSION}); upgrade the report generator"
        )),
        None => Some(format!(
            "record has an unreadable {HEADER_VERSION} header: {:?}",
            String::from_utf8_lossy(header)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header<'a>(message: &'a LogMessage, name: &str) -> Option<&'a [u8]> {
        message
            .headers
            .iter()
            .find(|(found, _)| found == name)
            .map(|(_, value)| value.as_slice())
    }

    #[test]
    fn every_kind_carries_its_kind_and_our_version() {
        let stream = StreamName::new("orders").unwrap();
        let messages = [
            (record(&stream, br#"{"a":1}"#), MessageKind::Record),
            (cut(&stream, &CutMarker::explicit()), MessageKind::Cut),
            (release(3), MessageKind::Release),
            (keyed_release(3), MessageKind::Release),
            (
                partition_move(3, &PartitionMove::new(12, 16)),
                MessageKind::Move,
            ),
            (
                handover(
                    &stream,
                    13,
                    &Handover {
                        v: CURRENT_VERSION,
                        from_partition: 3,
                        from_offset: 9,
                        definition: None,
                        window: None,
                    },
                ),
                MessageKind::Handover,
            ),
        ];
        for (message, kind) in messages {
            assert_eq!(kind_of(header(&message, HEADER_KIND)), Some(kind));
            assert_eq!(header(&message, HEADER_VERSION), Some(b"1".as_slice()));
            assert_eq!(unreadable_version(header(&message, HEADER_VERSION)), None);
        }
    }

    #[test]
    fn a_record_is_its_exact_text_keyed_by_its_stream() {
        let stream = StreamName::new("orders").unwrap();
        let text = br#"{ "b" : 2,"a":1 }"#;
        let message = record(&stream, text);
        assert_eq!(message.payload, text);
        assert_eq!(message.key.as_deref(), Some(b"orders".as_slice()));
        assert_eq!(message.partition, None);
    }

    #[test]
    fn moves_and_handovers_go_to_the_partition_they_name_and_the_layout_to_zero() {
        let stream = StreamName::new("orders").unwrap();
        let marker = partition_move(5, &PartitionMove::new(12, 16));
        assert_eq!((marker.key.as_deref(), marker.partition), (None, Some(5)));
        let arrival = handover(
            &stream,
            13,
            &Handover {
                v: CURRENT_VERSION,
                from_partition: 5,
                from_offset: 9,
                definition: None,
                window: None,
            },
        );
        assert_eq!(arrival.key.as_deref(), Some(b"orders".as_slice()));
        assert_eq!(arrival.partition, Some(13));
        let stored = layout(&LogLayout::new("id", 16));
        assert_eq!(stored.partition, Some(LAYOUT_PARTITION));
        assert!(is_reserved_key(stored.key.as_deref().unwrap()));
        assert!(is_reserved_key(RELEASE_KEY.as_bytes()));
        assert!(!is_reserved_key(b"orders"));
    }

    #[test]
    fn releases_are_told_apart_with_or_without_their_header() {
        let plain = release(5);
        assert_eq!((plain.key.as_deref(), plain.partition), (None, Some(5)));
        assert!(is_release(header(&plain, HEADER_KIND), None));
        let keyed = keyed_release(5);
        assert!(is_release(None, keyed.key.as_deref()));
        assert!(!is_release(Some(b"record"), Some(b"orders")));
    }

    #[test]
    fn a_dead_letter_mark_is_a_watermark_under_the_reserved_key() {
        let mark = dead_letter_mark(7, 41, "log");
        assert_eq!(mark.partition, Some(7));
        assert!(is_dead_letter_mark(mark.key.as_deref()));
        assert!(!is_dead_letter_mark(Some(b"orders")));
        assert!(!is_release(None, mark.key.as_deref()));
        assert!(
            StreamName::new(DEAD_LETTERS_KEY).is_err(),
            "no stream can take the reserved key"
        );
        let read: Watermark = crate::decode("watermark", &mark.payload).unwrap();
        assert_eq!(
            (read.partition, read.offset, read.dead_letters_through),
            (7, None, Some(41))
        );
    }

    #[test]
    fn a_watermark_written_before_dead_letter_marks_still_loads() {
        let old = br#"{"v":1,"partition":3,"offset":12}"#;
        let read: Watermark = crate::decode("watermark", old).unwrap();
        assert_eq!((read.offset, read.dead_letters_through), (Some(12), None));
    }

    #[test]
    fn newer_or_garbled_versions_are_refused_by_name() {
        assert_eq!(unreadable_version(None), None);
        assert_eq!(unreadable_version(Some(b"0")), None);
        let newer = (CURRENT_VERSION + 1).to_string();
        let reason = unreadable_version(Some(newer.as_bytes())).unwrap();
        assert!(reason.contains(&format!("version {newer}")), "{reason}");
        let reason = unreadable_version(Some(b"two")).unwrap();
        assert!(reason.contains("unreadable quire-v header"), "{reason}");
    }
}

//! The watermark topic's format, in one place: how each of its messages is
//! built (a stream's [`Watermark`], the partition layout, a move processed,
//! a partition's dead-letter mark, a producer's release) and how a reader
//! tells them apart ([`read`]). Topic-free: the services put these on their
//! topic.
//!
//! | key | partition | payload |
//! | --- | --- | --- |
//! | the stream | the stream's record partition | its [`Watermark`] |
//! | [`DEAD_LETTERS_KEY`] | the record partition | a [`Watermark`] with only `dead_letters_through` |
//! | [`MOVED_KEY`] | the record partition | a [`PartitionMoved`] |
//! | [`LAYOUT_KEY`] | [`LAYOUT_PARTITION`] | the [`LogLayout`] |
//! | [`RELEASE_KEY`] | any | `{"v":1}`, header `quire-kind: release` |
//!
//! Keys starting `quire:` are quire's own ([`is_reserved_key`]): no stream
//! name can start so.

use crate::records::{LogMessage, release};
use crate::{
    CURRENT_VERSION, DecodeError, LogLayout, MessageKind, PartitionMoved, StreamName, Watermark,
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

/// The key, on the watermarks topic, of a partition's dead-letter mark: a
/// [`Watermark`] whose `dead_letters_through` is the highest offset of the
/// record partition whose dead letter is published. Messages without a
/// valid stream (no key, an invalid name) have their dead letters too, so
/// the mark is the partition's, not a stream's.
pub const DEAD_LETTERS_KEY: &str = "quire:dead-letters";

/// Whether a key on a compacted topic is one of quire's own (a release, the
/// layout, a move processed, a dead-letter mark), never a stream's.
pub fn is_reserved_key(key: &[u8]) -> bool {
    key.starts_with(b"quire:")
}

/// `stream`'s watermark, on `partition` (the stream's record partition).
pub fn stream_watermark(partition: i32, stream: &StreamName, watermark: &Watermark) -> LogMessage {
    LogMessage {
        key: Some(stream.as_str().as_bytes().to_vec()),
        headers: Vec::new(),
        payload: crate::encode(watermark),
        partition: Some(partition),
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
        window_after_changes: Vec::new(),
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

/// A message of the watermark topic, as a reader sees it.
#[derive(Debug)]
pub enum WatermarkEntry {
    /// A producer's release (its `quire-kind` header, or [`RELEASE_KEY`]):
    /// nothing to load.
    Release,
    /// The partition's dead-letter mark; `None`: its tombstone.
    DeadLetterMark(Result<Option<Watermark>, DecodeError>),
    /// Another of quire's own keys (the layout, a move processed).
    Reserved,
    /// A key no stream can have (none, not UTF-8, an invalid name).
    InvalidKey,
    /// A stream's watermark; `None`: its tombstone (compaction forgets the
    /// stream).
    Stream(StreamName, Result<Option<Watermark>, DecodeError>),
}

/// Tells a message of the watermark topic apart by its headers and key,
/// and decodes its payload (`None`: a tombstone).
pub fn read(
    key: Option<&[u8]>,
    headers: &[(String, Vec<u8>)],
    payload: Option<&[u8]>,
) -> WatermarkEntry {
    let decode = |what| {
        payload
            .map(|payload| crate::decode::<Watermark>(what, payload))
            .transpose()
    };
    if crate::records::kind_of(headers) == Some(MessageKind::Release)
        || key == Some(RELEASE_KEY.as_bytes())
    {
        return WatermarkEntry::Release;
    }
    if key == Some(DEAD_LETTERS_KEY.as_bytes()) {
        return WatermarkEntry::DeadLetterMark(decode("dead-letter mark"));
    }
    if key.is_some_and(is_reserved_key) {
        return WatermarkEntry::Reserved;
    }
    let Some(stream) = key
        .and_then(|key| std::str::from_utf8(key).ok())
        .and_then(|key| StreamName::new(key).ok())
    else {
        return WatermarkEntry::InvalidKey;
    };
    WatermarkEntry::Stream(stream, decode("watermark"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(message: &LogMessage) -> WatermarkEntry {
        read(
            message.key.as_deref(),
            &message.headers,
            Some(&message.payload),
        )
    }

    #[test]
    fn a_dead_letter_mark_is_a_watermark_under_the_reserved_key() {
        let mark = dead_letter_mark(7, 41, "log");
        assert_eq!(mark.partition, Some(7));
        let WatermarkEntry::DeadLetterMark(Ok(Some(loaded))) = read_back(&mark) else {
            panic!("a dead-letter mark reads as one");
        };
        assert_eq!(
            (loaded.partition, loaded.offset, loaded.dead_letters_through),
            (7, None, Some(41))
        );
        assert!(
            StreamName::new(DEAD_LETTERS_KEY).is_err(),
            "no stream can take the reserved key"
        );
        assert!(matches!(
            read(Some(DEAD_LETTERS_KEY.as_bytes()), &[], None),
            WatermarkEntry::DeadLetterMark(Ok(None))
        ));
    }

    #[test]
    fn every_message_the_topic_holds_reads_back_as_what_it_is() {
        let orders = StreamName::new("orders").unwrap();
        let watermark = Watermark {
            v: CURRENT_VERSION,
            partition: 3,
            offset: Some(12),
            definition: None,
            window: None,
            window_after_changes: Vec::new(),
            log: Some("log".into()),
            dead_letters_through: None,
        };
        let written = stream_watermark(3, &orders, &watermark);
        assert_eq!(written.partition, Some(3));
        match read_back(&written) {
            WatermarkEntry::Stream(stream, Ok(Some(read))) => {
                assert_eq!((stream, read), (orders.clone(), watermark));
            }
            other => panic!("a stream's watermark read as {other:?}"),
        }
        assert!(matches!(
            read(Some(b"orders"), &[], None),
            WatermarkEntry::Stream(_, Ok(None))
        ));
        assert!(matches!(
            read_back(&keyed_release(3)),
            WatermarkEntry::Release
        ));
        assert!(matches!(
            read(None, &crate::records::release(3).headers, None),
            WatermarkEntry::Release
        ));
        let stored = layout(&LogLayout::new("id", 16));
        assert_eq!(stored.partition, Some(LAYOUT_PARTITION));
        assert!(matches!(read_back(&stored), WatermarkEntry::Reserved));
        let processed = moved(
            2,
            &PartitionMoved {
                v: CURRENT_VERSION,
                to: 16,
                offset: 9,
            },
        );
        assert!(matches!(read_back(&processed), WatermarkEntry::Reserved));
        assert!(matches!(read(None, &[], None), WatermarkEntry::InvalidKey));
        assert!(matches!(
            read(Some(b"not a stream"), &[], None),
            WatermarkEntry::InvalidKey
        ));
        assert!(matches!(
            read(Some(b"orders"), &[], Some(b"{")),
            WatermarkEntry::Stream(_, Err(_))
        ));
        assert!(is_reserved_key(RELEASE_KEY.as_bytes()));
        assert!(!is_reserved_key(b"orders"));
    }

    #[test]
    fn a_watermark_written_before_dead_letter_marks_still_loads() {
        let old = br#"{"v":1,"partition":3,"offset":12}"#;
        let WatermarkEntry::Stream(_, Ok(Some(read))) = read(Some(b"orders"), &[], Some(old))
        else {
            panic!("an old watermark loads");
        };
        assert_eq!((read.offset, read.dead_letters_through), (Some(12), None));
    }
}

//! The records topic's message format, in one place: how each kind of
//! message is built (key, `quire-kind` and `quire-v` headers, payload) and
//! how a reader tells them apart. Topic-free: the services put these on
//! their topic.
//!
//! | kind | key | payload |
//! | --- | --- | --- |
//! | `batch` | the stream | records of the stream in order, framed ([`crate::batch`]) |
//! | `record` | the stream | one producer's JSON object, byte for byte (written before batches; still read) |
//! | `cut` | the stream | a [`CutMarker`] |
//! | `definition` | the stream | a [`Definition`] |
//! | `release` | none (records) or `quire:release` (compacted topics) | `{"v":1}` |
//! | `move` | none, one per partition of the old layout | a [`PartitionMove`] |
//! | `handover` | the stream, on its new partition | a [`Handover`] |
//!
//! A reader tells them apart with [`read`]: what each message is, its
//! stream and its decoded body, or why it is a dead letter. The watermark
//! topic's format is `crate::watermarks`'s.
//!
//! Every message carries `quire-v: CURRENT_VERSION`; a reader refuses a
//! newer one ([`unreadable_version`]), never misreads it.

use crate::{
    CURRENT_VERSION, CutMarker, Definition, HEADER_KIND, HEADER_VERSION, Handover, MessageKind,
    PartitionMove, StreamName,
};

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

/// A record: its exact JSON text, keyed by its stream (the format before
/// batches, which readers still take; writers use [`batches`]).
pub fn record(stream: &StreamName, json: &[u8]) -> LogMessage {
    control(MessageKind::Record, stream, json.to_vec())
}

/// The batch messages that carry `records` of `stream`, in order, each
/// payload at most `max_bytes` (a record that alone passes it goes alone).
pub fn batches<'a>(
    stream: &StreamName,
    records: impl IntoIterator<Item = &'a [u8]>,
    max_bytes: usize,
) -> Vec<LogMessage> {
    crate::batch::pack(records, max_bytes)
        .into_iter()
        .map(|payload| control(MessageKind::Batch, stream, payload))
        .collect()
}

/// How many records a message of the records topic carries: a batch's
/// frames, 1 for a single record, 0 for anything else. Walks the frames'
/// lengths only; a truncated batch counts what it holds.
pub fn record_count(headers: &[(String, Vec<u8>)], payload: &[u8]) -> usize {
    match kind_of(headers) {
        Some(MessageKind::Batch) => crate::batch::records(payload).count(),
        Some(MessageKind::Record) => 1,
        _ => 0,
    }
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

/// The value of header `name` among `headers`.
fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(found, _)| found == name)
        .map(|(_, value)| value.as_slice())
}

/// What a message is, from its `quire-kind` header (`None`: absent or
/// unknown).
pub fn kind_of(headers: &[(String, Vec<u8>)]) -> Option<MessageKind> {
    header(headers, HEADER_KIND).and_then(MessageKind::from_header)
}

/// Why a message's `quire-v` header is one this release cannot read (newer
/// than ours, or not a number); `None` for ours, older ones and no header
/// (records written before the header existed).
pub fn unreadable_version(headers: &[(String, Vec<u8>)]) -> Option<String> {
    let header = header(headers, HEADER_VERSION)?;
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

/// A message of the records topic as a reader sees it: told apart by its
/// `quire-kind` header and its key, its body decoded. `Err` and
/// [`Incoming::Invalid`] hold why the message is a dead letter.
// One per message read, moved once into the worker's decision and never
// stored: boxing the definition would cost an allocation per definition for
// nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming<'a> {
    /// A producer releasing its partitions: no stream, nothing to render.
    Release,
    /// A growth of the partition layout: partition-wide, no stream.
    Move(Result<PartitionMove, String>),
    /// A message of a stream.
    Stream(StreamName, StreamMessage<'a>),
    /// Nothing can be made of it (no kind, no valid stream).
    Invalid(String),
}

/// The records a message carries, in order: one (a `record` message) or a
/// batch's.
#[derive(Debug, Clone)]
pub enum RecordTexts<'a> {
    One(&'a [u8]),
    Batch(crate::batch::Records<'a>),
}

impl<'a> Iterator for RecordTexts<'a> {
    /// A record's JSON text, or why a batch ends early (a truncated frame).
    type Item = Result<&'a [u8], String>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            RecordTexts::One(text) => {
                let text = std::mem::take(text);
                *self = RecordTexts::Batch(crate::batch::records(&[]));
                Some(Ok(text))
            }
            RecordTexts::Batch(records) => records.next(),
        }
    }
}

impl PartialEq for RecordTexts<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.clone().eq(other.clone())
    }
}

/// A message of a stream, its body decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamMessage<'a> {
    /// The producer's records (a `record` or a `batch` message); `Err`: a
    /// version this release cannot read.
    Records(Result<RecordTexts<'a>, String>),
    Cut(Result<CutMarker, String>),
    /// A definition change, validated.
    Definition(Result<Definition, String>),
    /// The stream arriving on its new partition; its definition validated.
    Handover(Result<Handover, String>),
}

/// Tells a message of the records topic apart (see [`Incoming`]).
pub fn read<'a>(
    key: Option<&'a [u8]>,
    headers: &'a [(String, Vec<u8>)],
    payload: &'a [u8],
) -> Incoming<'a> {
    let kind = match kind_of(headers) {
        Some(MessageKind::Release) => return Incoming::Release,
        Some(MessageKind::Move) => return Incoming::Move(read_move(payload)),
        Some(kind) => kind,
        None => return Incoming::Invalid("missing or unknown quire-kind header".into()),
    };
    let stream = match key.map(std::str::from_utf8) {
        None | Some(Err(_)) => {
            return Incoming::Invalid("message has no UTF-8 key (stream name)".into());
        }
        Some(Ok(name)) => match StreamName::new(name) {
            Ok(stream) => stream,
            Err(error) => return Incoming::Invalid(format!("invalid stream name: {error}")),
        },
    };
    let message = match kind {
        MessageKind::Release | MessageKind::Move => unreachable!("told apart above"),
        MessageKind::Record | MessageKind::Batch => {
            StreamMessage::Records(match unreadable_version(headers) {
                // Refused by name, never misread as the version we know.
                Some(reason) => Err(reason),
                None if kind == MessageKind::Batch => {
                    Ok(RecordTexts::Batch(crate::batch::records(payload)))
                }
                None => Ok(RecordTexts::One(payload)),
            })
        }
        MessageKind::Cut => StreamMessage::Cut(
            crate::decode::<CutMarker>("cut marker", payload)
                .map_err(|error| format!("invalid cut marker: {error}")),
        ),
        MessageKind::Definition => StreamMessage::Definition(
            crate::decode::<Definition>("definition", payload)
                .map_err(|error| error.to_string())
                .and_then(|definition| {
                    definition
                        .validate()
                        .map(|()| definition)
                        .map_err(|error| error.to_string())
                })
                .map_err(|reason| format!("invalid definition: {reason}")),
        ),
        MessageKind::Handover => StreamMessage::Handover(read_handover(payload)),
    };
    Incoming::Stream(stream, message)
}

fn read_move(payload: &[u8]) -> Result<PartitionMove, String> {
    match crate::decode::<PartitionMove>("move marker", payload) {
        Ok(marker) if marker.from > 0 && marker.to > marker.from => Ok(marker),
        Ok(marker) => Err(format!(
            "move marker from {} to {} partitions",
            marker.from, marker.to
        )),
        Err(error) => Err(format!("invalid move marker: {error}")),
    }
}

fn read_handover(payload: &[u8]) -> Result<Handover, String> {
    let arrived = crate::decode::<Handover>("handover", payload)
        .map_err(|error| format!("invalid handover: {error}"))?;
    if let Some(definition) = &arrived.definition {
        definition
            .validate()
            .map_err(|error| format!("handover with an invalid definition: {error}"))?;
    }
    Ok(arrived)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(message: &LogMessage) -> Incoming<'_> {
        read(message.key.as_deref(), &message.headers, &message.payload)
    }

    #[test]
    fn every_kind_carries_its_kind_and_our_version() {
        let stream = StreamName::new("orders").unwrap();
        let messages = [
            (record(&stream, br#"{"a":1}"#), MessageKind::Record),
            (cut(&stream, &CutMarker::explicit()), MessageKind::Cut),
            (release(3), MessageKind::Release),
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
            assert_eq!(kind_of(&message.headers), Some(kind));
            assert_eq!(
                header(&message.headers, HEADER_VERSION),
                Some(b"1".as_slice())
            );
            assert_eq!(unreadable_version(&message.headers), None);
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
        assert_eq!(
            read_back(&message),
            Incoming::Stream(
                stream,
                StreamMessage::Records(Ok(RecordTexts::One(text.as_slice())))
            )
        );
        assert_eq!(record_count(&message.headers, &message.payload), 1);
    }

    #[test]
    fn a_batch_carries_its_records_in_order_keyed_by_their_stream() {
        let stream = StreamName::new("orders").unwrap();
        let texts: Vec<String> = (0..50).map(|seq| format!(r#"{{"seq":{seq}}}"#)).collect();
        let messages = batches(&stream, texts.iter().map(|text| text.as_bytes()), 100);
        assert!(messages.len() > 1, "the bound splits them");
        let mut read_back_texts = Vec::new();
        for message in &messages {
            assert_eq!(kind_of(&message.headers), Some(MessageKind::Batch));
            assert_eq!(message.key.as_deref(), Some(b"orders".as_slice()));
            let Incoming::Stream(found, StreamMessage::Records(Ok(records))) = read_back(message)
            else {
                panic!("a batch reads back as records");
            };
            assert_eq!(found, stream);
            let records: Vec<&[u8]> = records.collect::<Result<_, _>>().unwrap();
            assert_eq!(
                record_count(&message.headers, &message.payload),
                records.len()
            );
            read_back_texts.extend(records.iter().map(|text| text.to_vec()));
        }
        let sent: Vec<Vec<u8>> = texts.into_iter().map(String::into_bytes).collect();
        assert_eq!(read_back_texts, sent);
        assert_eq!(
            record_count(&cut(&stream, &CutMarker::explicit()).headers, b"{}"),
            0
        );
    }

    #[test]
    fn moves_and_handovers_go_to_the_partition_they_name() {
        let stream = StreamName::new("orders").unwrap();
        let marker = partition_move(5, &PartitionMove::new(12, 16));
        assert_eq!((marker.key.as_deref(), marker.partition), (None, Some(5)));
        assert_eq!(
            read_back(&marker),
            Incoming::Move(Ok(PartitionMove::new(12, 16)))
        );
        let arrived = Handover {
            v: CURRENT_VERSION,
            from_partition: 5,
            from_offset: 9,
            definition: None,
            window: None,
        };
        let arrival = handover(&stream, 13, &arrived);
        assert_eq!(arrival.key.as_deref(), Some(b"orders".as_slice()));
        assert_eq!(arrival.partition, Some(13));
        assert_eq!(
            read_back(&arrival),
            Incoming::Stream(stream, StreamMessage::Handover(Ok(arrived)))
        );
    }

    #[test]
    fn each_message_reads_back_as_what_it_is_or_why_it_is_a_dead_letter() {
        let stream = StreamName::new("orders").unwrap();
        assert_eq!(read_back(&release(5)), Incoming::Release);
        assert_eq!(
            read_back(&cut(&stream, &CutMarker::explicit())),
            Incoming::Stream(
                stream.clone(),
                StreamMessage::Cut(Ok(CutMarker::explicit()))
            )
        );
        let renamed = Definition {
            root: "orders".into(),
            ..Definition::default()
        };
        assert_eq!(
            read_back(&definition(&stream, &renamed)),
            Incoming::Stream(stream.clone(), StreamMessage::Definition(Ok(renamed)))
        );
        let invalid = |reason: &str| Incoming::Invalid(reason.to_owned());
        assert_eq!(
            read(Some(b"orders"), &[], b"{}"),
            invalid("missing or unknown quire-kind header")
        );
        let record_headers = record(&stream, b"{}").headers;
        assert_eq!(
            read(None, &record_headers, b"{}"),
            invalid("message has no UTF-8 key (stream name)")
        );
        assert!(matches!(
            read(Some(b"a b"), &record_headers, b"{}"),
            Incoming::Invalid(reason) if reason.starts_with("invalid stream name: ")
        ));
        let cut_headers = cut(&stream, &CutMarker::explicit()).headers;
        assert!(matches!(
            read(Some(b"orders"), &cut_headers, b"{"),
            Incoming::Stream(_, StreamMessage::Cut(Err(reason))) if reason.starts_with("invalid cut marker: ")
        ));
        let backwards = partition_move(5, &PartitionMove::new(16, 12));
        assert_eq!(
            read_back(&backwards),
            Incoming::Move(Err("move marker from 16 to 12 partitions".into()))
        );
    }

    #[test]
    fn newer_or_garbled_versions_are_refused_by_name() {
        let version = |value: &[u8]| vec![(HEADER_VERSION.to_owned(), value.to_vec())];
        assert_eq!(unreadable_version(&[]), None);
        assert_eq!(unreadable_version(&version(b"0")), None);
        let newer = (CURRENT_VERSION + 1).to_string();
        let reason = unreadable_version(&version(newer.as_bytes())).unwrap();
        assert!(reason.contains(&format!("version {newer}")), "{reason}");
        let reason = unreadable_version(&version(b"two")).unwrap();
        assert!(reason.contains("unreadable quire-v header"), "{reason}");
        let mut headers = version(newer.as_bytes());
        headers.push((HEADER_KIND.to_owned(), b"record".to_vec()));
        assert!(matches!(
            read(Some(b"orders"), &headers, b"{}"),
            Incoming::Stream(_, StreamMessage::Records(Err(_)))
        ));
    }
}

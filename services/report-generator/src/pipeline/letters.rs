//! A message's records rendered for their document, and the dead letters
//! of those that cannot be: what `PartitionPipeline::append` decides on.

use quire_messages::records::RecordTexts;

use super::Document;
use crate::decide;
use crate::document::RecordInput;

/// A dead letter to publish: the record's place in its batch (`None`: the
/// whole message), its body and why.
pub(super) struct Letter<'a> {
    pub index: Option<u32>,
    pub body: &'a [u8],
    pub reason: String,
}

/// Renders a message's records into `document` (see [`Document::render`]):
/// what rendered, and a dead letter for each record that did not. Nearly
/// every record renders straight from its text; the rest are parsed first,
/// which renders them or says why not.
pub(super) fn render_all<'a, D: Document>(
    document: &mut D,
    texts: RecordTexts<'a>,
    fields: &mut Vec<u8>,
) -> (decide::Rendered, Vec<Letter<'a>>) {
    let batch = matches!(texts, RecordTexts::Batch(_));
    let place = |index: usize| batch.then(|| u32::try_from(index).unwrap_or(u32::MAX));
    let mut rendered = decide::Rendered {
        records: 0,
        bytes: 0,
        batch,
    };
    let mut letters = Vec::new();
    for (index, text) in texts.enumerate() {
        let text = match text {
            Ok(text) => text,
            Err(reason) => {
                letters.push(Letter {
                    index: place(index),
                    body: &[],
                    reason: format!("batch message is truncated: {reason}"),
                });
                break;
            }
        };
        fields.clear();
        let result = if quire_xml::render_fields(fields, text) {
            document
                .render(RecordInput::Rendered { text, fields })
                .map_err(|error| format!("record cannot be rendered: {error}"))
        } else {
            match serde_json::from_slice::<serde_json::Value>(text) {
                Ok(record) => document
                    .render(RecordInput::Parsed(&record))
                    .map_err(|error| format!("record cannot be rendered: {error}")),
                Err(error) => Err(format!("record is not JSON: {error}")),
            }
        };
        match result {
            Ok(bytes) => {
                rendered.records += 1;
                rendered.bytes += bytes as u64;
            }
            Err(reason) => letters.push(Letter {
                index: place(index),
                body: text,
                reason,
            }),
        }
    }
    (rendered, letters)
}

/// Every record of a message as a dead letter, for `reason`.
pub(super) fn every_record_a_letter<'a>(texts: &RecordTexts<'a>, reason: &str) -> Vec<Letter<'a>> {
    let batch = matches!(texts, RecordTexts::Batch(_));
    texts
        .clone()
        .enumerate()
        .map(|(index, text)| Letter {
            index: batch.then(|| u32::try_from(index).unwrap_or(u32::MAX)),
            body: text.unwrap_or_default(),
            reason: reason.to_owned(),
        })
        .collect()
}

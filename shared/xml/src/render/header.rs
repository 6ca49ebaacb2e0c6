//! A definition's header: the element before the first record, filled
//! with the document's values once it ends (see [`HeaderValues`]).

use std::borrow::Cow;

use quick_xml::escape::partial_escape;
use quire_messages::header::HeaderValue;

use super::{DocumentRenderer, HeaderValues};
use crate::check::{first_forbidden_character, is_forbidden_character};

impl DocumentRenderer {
    /// Whether the definition has a header: its documents' first part is
    /// held until they end, and [`header`](Self::header) is written after
    /// [`start`](Self::start), before the records.
    pub fn has_header(&self) -> bool {
        self.header.is_some()
    }

    /// Writes the header element, its declared children in order (a value
    /// the document lacks, such as the log time of a document without
    /// records, leaves its child out), then the totals if it asks for them.
    /// Nothing without a header.
    pub fn header(&self, out: &mut Vec<u8>, values: &HeaderValues<'_>) {
        let Some((name, spec)) = &self.header else {
            return;
        };
        let start = out.len();
        out.push(b'<');
        out.extend_from_slice(name.as_bytes());
        out.push(b'>');
        for field in &spec.fields {
            let text = match (field.value, &field.constant) {
                (Some(value), _) => header_value(value, field.of.as_deref(), values),
                (None, Some(constant)) => Some(Cow::Borrowed(constant.as_str())),
                (None, None) => None,
            };
            let Some(text) = text else {
                continue;
            };
            out.push(b'<');
            out.extend_from_slice(field.name.as_bytes());
            out.push(b'>');
            write_header_text(out, &text);
            out.extend_from_slice(b"</");
            out.extend_from_slice(field.name.as_bytes());
            out.push(b'>');
        }
        if spec.totals {
            self.write_totals(out, values.totals);
        }
        out.extend_from_slice(b"</");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b">\n");
        self.lay_out(out, start);
    }
}

/// The text of one header value, `None` when the document lacks it.
fn header_value<'a>(
    value: HeaderValue,
    of: Option<&str>,
    values: &HeaderValues<'a>,
) -> Option<Cow<'a, str>> {
    let total = || {
        values
            .totals
            .iter()
            .find(|total| Some(total.field.as_str()) == of)
    };
    let owned = |text: String| Some(Cow::Owned(text));
    match value {
        HeaderValue::Stream => Some(Cow::Borrowed(values.stream)),
        HeaderValue::ReportId => Some(Cow::Borrowed(values.summary.report_id)),
        HeaderValue::Partition => owned(values.partition.to_string()),
        HeaderValue::FirstOffset => owned(values.summary.first_offset.to_string()),
        HeaderValue::LastOffset => owned(values.summary.last_offset.to_string()),
        HeaderValue::Records => owned(values.summary.records.to_string()),
        HeaderValue::FirstLogTime => values.first_log_time.map(Cow::Borrowed),
        HeaderValue::LastLogTime => values.last_log_time.map(Cow::Borrowed),
        HeaderValue::WindowStart => values.window.map(|window| Cow::Borrowed(window.start)),
        HeaderValue::WindowEnd => values.window.map(|window| Cow::Borrowed(window.end)),
        HeaderValue::WindowSequence => values
            .window
            .and_then(|window| owned(window.sequence.to_string())),
        HeaderValue::Count => total().and_then(|total| owned(total.count.to_string())),
        HeaderValue::Sum => total().map(|total| Cow::Owned(total.sum.clone())),
        HeaderValue::Min => total().and_then(|total| total.min.clone()).map(Cow::Owned),
        HeaderValue::Max => total().and_then(|total| total.max.clone()).map(Cow::Owned),
    }
}

/// Element text, escaped; a character XML 1.0 forbids (a constant checked
/// at PUT cannot hold one) is written as U+FFFD rather than break the
/// document.
fn write_header_text(out: &mut Vec<u8>, text: &str) {
    if first_forbidden_character(text).is_none() {
        out.extend_from_slice(partial_escape(text).as_bytes());
        return;
    }
    let replaced: String = text
        .chars()
        .map(|character| {
            if is_forbidden_character(character) {
                char::REPLACEMENT_CHARACTER
            } else {
                character
            }
        })
        .collect();
    out.extend_from_slice(partial_escape(replaced.as_str()).as_bytes());
}

#[cfg(test)]
mod tests {
    use quire_messages::Definition;

    use crate::{DocumentRenderer, FieldTotal, HeaderValues, Summary, SummaryWindow};
    use crate::{check_definition, log_time_text};

    fn definition(json: &str) -> Definition {
        serde_json::from_str(json).expect("a definition")
    }

    /// The header goes before the first record, in the namespace like the
    /// summary, its children unqualified like the fields, each value the
    /// document's, the constant escaped, its totals the trailer's; a value
    /// the document lacks is left out.
    #[test]
    fn a_header_holds_the_documents_values_and_the_trailers_totals() {
        let definition = definition(
            r#"{"root": "ledger", "record": "entry", "namespace": "urn:example:ledger",
                "prefix": "lg", "totals": ["amount"],
                "fields": [{"name": "amount", "type": "decimal", "required": true}],
                "window": {"every": "1h", "time_zone": "Europe/Paris"},
                "header": {"fields": [
                    {"name": "MsgId", "value": "report_id"},
                    {"name": "NbOfTxs", "value": "records"},
                    {"name": "CtrlSum", "value": "sum", "of": "amount"},
                    {"name": "From", "value": "window_start"},
                    {"name": "Last", "value": "last_log_time"},
                    {"name": "Party", "constant": "A & B <co>"}
                ], "totals": true}}"#,
        );
        check_definition(&definition).unwrap();
        let renderer = DocumentRenderer::new(&definition);
        assert!(renderer.has_header());
        let summary = Summary {
            records: 2,
            first_offset: 40,
            last_offset: 43,
            report_id: "ledger~3-43",
        };
        let window = SummaryWindow {
            start: "2026-12-07T09:00:00+01:00",
            end: "2026-12-07T10:00:00+01:00",
            sequence: 1,
        };
        let totals = [FieldTotal {
            field: "amount".into(),
            count: 2,
            sum: "12.50".into(),
            min: Some("2.25".into()),
            max: Some("10.25".into()),
        }];
        let values = |last: Option<&'static str>| HeaderValues {
            stream: "ledger",
            partition: 3,
            summary: &summary,
            window: Some(&window),
            first_log_time: None,
            last_log_time: last,
            totals: &totals,
        };
        let mut out = Vec::new();
        renderer.header(&mut out, &values(Some("2026-12-07T08:30:00.125Z")));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            concat!(
                "<lg:header><MsgId>ledger~3-43</MsgId><NbOfTxs>2</NbOfTxs><CtrlSum>12.50</CtrlSum>",
                "<From>2026-12-07T09:00:00+01:00</From><Last>2026-12-07T08:30:00.125Z</Last>",
                "<Party>A &amp; B &lt;co&gt;</Party>",
                "<lg:total field=\"amount\" count=\"2\" sum=\"12.50\" min=\"2.25\" max=\"10.25\"/>",
                "</lg:header>\n"
            )
        );
        let mut without = Vec::new();
        renderer.header(&mut without, &values(None));
        assert!(!String::from_utf8(without).unwrap().contains("<Last>"));
        assert_eq!(log_time_text(1_796_630_976_125), "2026-12-07T08:09:36.125Z");
        // No header, nothing written.
        let mut none = Vec::new();
        DocumentRenderer::new(&Definition::default()).header(&mut none, &values(None));
        assert!(none.is_empty());
    }
}

//! The document renderer: bytes appended to the caller's buffer, one call
//! per piece of the document (see the crate docs for the exact shape).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::io::Write as _;
use std::ops::Range;

use quick_xml::escape::partial_escape;
use quick_xml::events::attributes::Attribute;
use quire_messages::header::HeaderSpec;
use quire_messages::{Definition, DefinitionError, SUMMARY_ELEMENT, is_xml_name};
use serde_json::{Map, Value};

use crate::TypedCheck;
use crate::check::{RenderError, first_forbidden_character, is_forbidden_character, record_fields};
use crate::names::{encode_name, write_encoded_name};
use crate::xsd::{TOTAL_ELEMENT, schema_file_name, schema_for};

mod header;
mod typed;

/// The namespace of `xsi:nil`, declared on every root so that a null can be
/// written wherever it occurs (the root is written before any record is seen).
pub const XML_SCHEMA_INSTANCE_NAMESPACE: &str = "http://www.w3.org/2001/XMLSchema-instance";

/// The element each item of an array nested directly in an array becomes.
pub const NESTED_ARRAY_ITEM_ELEMENT: &str = "item";

const XML_DECLARATION: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";

/// The two namespaces that Namespaces in XML forbids as a default namespace;
/// declaring one would make every parser refuse the document.
const RESERVED_NAMESPACES: [&str; 2] = [
    "http://www.w3.org/XML/1998/namespace",
    "http://www.w3.org/2000/xmlns/",
];

/// What a document's totals are, known only when it is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary<'a> {
    pub records: u64,
    pub first_offset: i64,
    pub last_offset: i64,
    pub report_id: &'a str,
}

/// One total of a document, for its summary: a declared numeric field's
/// count of values, exact sum and extremes, as decimal text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldTotal {
    pub field: String,
    pub count: u64,
    pub sum: String,
    /// `None` while no value was counted.
    pub min: Option<String>,
    pub max: Option<String>,
}

/// The time window of a windowed stream's document, for its summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryWindow<'a> {
    /// RFC 3339 with the zone's offset.
    pub start: &'a str,
    pub end: &'a str,
    pub sequence: u32,
}

/// What a document's header is filled with, known when it ends.
#[derive(Debug, Clone, Copy)]
pub struct HeaderValues<'a> {
    pub stream: &'a str,
    pub partition: i32,
    pub summary: &'a Summary<'a>,
    pub window: Option<&'a SummaryWindow<'a>>,
    /// RFC 3339 (see [`log_time_text`]); `None` without records.
    pub first_log_time: Option<&'a str>,
    pub last_log_time: Option<&'a str>,
    pub totals: &'a [FieldTotal],
}

/// A log time (milliseconds since the epoch) as a header writes it: UTC,
/// with milliseconds, `2026-12-07T08:07:39.123Z`, the same on every replay.
pub fn log_time_text(time_ms: i64) -> String {
    match jiff::Timestamp::from_millisecond(time_ms) {
        Ok(time) => time.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(),
        // Out of jiff's range (year -9999 to 9999): no broker writes it.
        Err(_) => "1970-01-01T00:00:00.000Z".to_owned(),
    }
}

/// Renders documents of one definition. Everything the definition decides
/// (names, renames, which fields are attributes) is worked out once here, so
/// that rendering a record only walks the record.
///
/// Stateless between calls: the caller keeps its document's buffer and
/// counts, and calls [`start`](Self::start), [`record`](Self::record) per
/// record and [`finish`](Self::finish) with the totals.
#[derive(Debug, Clone)]
pub struct DocumentRenderer {
    /// The declaration and the root start tag up to its per-document
    /// attributes: `<?xml ...?>\n<report xmlns:xsi="..."`.
    document_prefix: Vec<u8>,
    /// `</report>\n`
    document_end: Vec<u8>,
    /// `<record`
    record_start: Vec<u8>,
    /// `</record>\n`
    record_end: Vec<u8>,
    /// The top-level fields named by the definition's attributes or renames.
    /// Empty for most definitions, which then skip every lookup.
    named_top_level_fields: BTreeMap<String, TopLevelField>,
    /// `summary`, or `{prefix}:summary`.
    summary_name: String,
    /// `total`, or `{prefix}:total`.
    total_name: String,
    /// The definition's header, with its element's qualified name.
    header: Option<(String, HeaderSpec)>,
    /// A typed definition's fields, written in their order.
    typed: Option<TypedLayout>,
    /// A typed definition's check, run on every record before it is
    /// written: the API's very check, so a record that slipped past it (sent
    /// before the definition reached that API replica) is refused here too.
    check: Option<TypedCheck>,
    /// Spaces per level when the definition asks for indentation.
    indent: Option<usize>,
}

#[derive(Debug, Clone)]
struct TypedLayout {
    fields: Vec<quire_messages::fields::Field>,
    keep_undeclared: bool,
    /// The schema's namespace, if any, and its file name (see
    /// [`crate::schema_file_name`]), for the root's `xsi:schemaLocation`.
    namespace: Option<String>,
    schema_file: String,
}

/// Where a document says its schema is: the key of the schema in the
/// report's bucket, `schemas/{stream}/{file}` (the producer API serves the
/// same bytes at `GET /v1/streams/{stream}/schemas/{file}`).
pub fn schema_key(stream: &str, schema_file: &str) -> String {
    format!("schemas/{stream}/{schema_file}")
}

#[derive(Debug, Clone)]
struct TopLevelField {
    /// The element or attribute name: the rename target, else the encoded
    /// field name.
    xml_name: String,
    /// A string, number, boolean or null value goes into the record's start
    /// tag instead of a child element.
    scalar_as_attribute: bool,
}

impl DocumentRenderer {
    /// Never fails: a definition should have passed
    /// [`Definition::validate`], but if one did not, whatever it names is
    /// still made into well-formed XML (invalid names are encoded, a
    /// namespace that may not be the default one is left out, forbidden
    /// characters in a namespace become U+FFFD, two attribute
    /// fields that would share a name keep the first, in field-name order,
    /// as an attribute and write the other as an element), so a bad control
    /// message can never stop a worker.
    pub fn new(definition: &Definition) -> Self {
        let usable_namespace = definition
            .namespace
            .as_ref()
            .filter(|namespace| !RESERVED_NAMESPACES.contains(&namespace.as_str()));
        let prefix = definition
            .prefix
            .as_deref()
            .filter(|prefix| usable_namespace.is_some() && is_xml_name(prefix));
        let qualified = |name: Cow<'_, str>| match prefix {
            Some(prefix) => format!("{prefix}:{name}"),
            None => name.into_owned(),
        };
        let root_name = qualified(definition_name(&definition.root));
        let record_name = qualified(definition_name(&definition.record));

        let mut document_prefix = Vec::with_capacity(256);
        document_prefix.extend_from_slice(XML_DECLARATION.as_bytes());
        document_prefix.push(b'<');
        document_prefix.extend_from_slice(root_name.as_bytes());
        if let Some(namespace) = usable_namespace {
            let declaration = match prefix {
                Some(prefix) => format!("xmlns:{prefix}"),
                None => "xmlns".to_owned(),
            };
            write_document_attribute(&mut document_prefix, &declaration, namespace);
        }
        write_attribute(
            &mut document_prefix,
            "xmlns:xsi",
            XML_SCHEMA_INSTANCE_NAMESPACE,
        );

        Self {
            document_prefix,
            document_end: format!("</{root_name}>\n").into_bytes(),
            record_start: format!("<{record_name}").into_bytes(),
            record_end: format!("</{record_name}>\n").into_bytes(),
            named_top_level_fields: named_top_level_fields(definition),
            summary_name: qualified(Cow::Borrowed(SUMMARY_ELEMENT)),
            total_name: qualified(Cow::Borrowed(TOTAL_ELEMENT)),
            header: definition
                .header
                .as_ref()
                .map(|header| (qualified(definition_name(&header.element)), header.clone())),
            typed: definition.is_typed().then(|| TypedLayout {
                fields: definition.fields.clone(),
                keep_undeclared: definition.undeclared.is_keep(),
                namespace: usable_namespace.cloned(),
                schema_file: schema_file_name(&schema_for(definition)),
            }),
            check: TypedCheck::new(definition),
            indent: definition
                .indent
                .map(|width| usize::from(width.clamp(1, quire_messages::MAX_INDENT))),
        }
    }

    /// A typed definition's schema file name (see [`crate::schema_file_name`]).
    pub fn schema_file(&self) -> Option<&str> {
        self.typed.as_ref().map(|typed| typed.schema_file.as_str())
    }

    /// Writes the declaration and the root start tag, which carries the
    /// stream, the partition and the document's first offset (the same
    /// values as its S3 key), the default namespace if the definition has
    /// one, and `xmlns:xsi` for nulls.
    pub fn start(&self, out: &mut Vec<u8>, stream: &str, partition: i32, first_offset: i64) {
        out.extend_from_slice(&self.document_prefix);
        if let Some(typed) = &self.typed {
            let location = schema_key(stream, &typed.schema_file);
            match &typed.namespace {
                Some(namespace) => write_document_attribute(
                    out,
                    "xsi:schemaLocation",
                    &format!("{namespace} {location}"),
                ),
                None => write_document_attribute(out, "xsi:noNamespaceSchemaLocation", &location),
            }
        }
        write_document_attribute(out, "stream", stream);
        write_number_attribute(out, "partition", partition);
        write_number_attribute(out, "first-offset", first_offset);
        out.extend_from_slice(b">\n");
    }

    /// Appends one record element and a newline.
    ///
    /// # Errors
    ///
    /// Exactly when [`crate::check_record`] fails, with the same error (the
    /// record is not an object, holds a character XML 1.0 forbids, or is
    /// nested too deep), or, under a typed definition, when
    /// [`crate::TypedCheck`] does ([`RenderError::Type`]). Nothing is written then, so the document stays
    /// well-formed and the caller can dead-letter the record and go on.
    pub fn record(&self, out: &mut Vec<u8>, record: &Value) -> Result<(), RenderError> {
        let fields = record_fields(record)?;
        if let Some(check) = &self.check {
            check.check(record)?;
        }
        let start = out.len();
        out.extend_from_slice(&self.record_start);
        if !self.named_top_level_fields.is_empty() {
            self.write_record_attributes(out, fields);
        }
        out.push(b'>');
        let content_start = out.len();
        if let Some(typed) = &self.typed {
            let top_level_name =
                |key: &str, value: &Value| match self.named_top_level_fields.get(key) {
                    None => Some(None),
                    Some(field) if field.scalar_as_attribute && is_scalar(value) => None,
                    Some(field) => Some(Some(field.xml_name.clone())),
                };
            typed::write_declared_fields(
                out,
                &typed.fields,
                typed.keep_undeclared,
                fields,
                Some(&top_level_name),
            );
        } else {
            self.write_fields_in_record_order(out, fields);
        }
        if out.len() == content_start {
            out.pop();
            out.extend_from_slice(b"/>\n");
        } else {
            out.extend_from_slice(&self.record_end);
        }
        self.lay_out(out, start);
        Ok(())
    }

    /// Indents the element written from `start`, one level in from the
    /// root, when the definition asks for it.
    fn lay_out(&self, out: &mut Vec<u8>, start: usize) {
        if let Some(width) = self.indent {
            crate::indent::indent_from(out, start, 1, width);
        }
    }

    fn write_fields_in_record_order(&self, out: &mut Vec<u8>, fields: &Map<String, Value>) {
        for (key, value) in fields {
            match self.named_top_level_fields.get(key.as_str()) {
                None => write_field(out, ElementName::FieldKey(key), value),
                Some(field) if field.scalar_as_attribute && is_scalar(value) => {}
                Some(field) => write_field(out, ElementName::Verbatim(&field.xml_name), value),
            }
        }
    }

    /// Whether [`crate::render_fields`] writes this renderer's record
    /// content: the definition names no attribute and no rename, so a
    /// field's element is its encoded key wherever it is.
    pub fn renders_fields_verbatim(&self) -> bool {
        self.named_top_level_fields.is_empty() && self.typed.is_none()
    }

    /// Appends one record element and a newline around `fields`, the
    /// elements [`crate::render_fields`] wrote for it: byte for byte what
    /// [`record`](Self::record) writes for the same record, when
    /// [`renders_fields_verbatim`](Self::renders_fields_verbatim).
    pub fn record_of_fields(&self, out: &mut Vec<u8>, fields: &[u8]) {
        debug_assert!(self.renders_fields_verbatim());
        let start = out.len();
        out.extend_from_slice(&self.record_start);
        if fields.is_empty() {
            out.extend_from_slice(b"/>\n");
        } else {
            out.push(b'>');
            out.extend_from_slice(fields);
            out.extend_from_slice(&self.record_end);
        }
        self.lay_out(out, start);
    }

    /// Writes the summary element and the root end tag: the document is
    /// complete after this.
    pub fn finish(&self, out: &mut Vec<u8>, summary: &Summary<'_>) {
        self.finish_in_window(out, summary, None);
    }

    /// [`finish`](Self::finish) for a document of a time window: the
    /// summary also names the window and the document's sequence in it
    /// (`window-start`, `window-end`, `window-sequence`).
    pub fn finish_in_window(
        &self,
        out: &mut Vec<u8>,
        summary: &Summary<'_>,
        window: Option<&SummaryWindow<'_>>,
    ) {
        self.finish_with_totals(out, summary, window, &[]);
    }

    /// [`finish_in_window`](Self::finish_in_window) with the document's
    /// totals, one `<total field=".." count=".." sum=".." min=".." max=".."/>`
    /// each inside the summary, in the order given.
    pub fn finish_with_totals(
        &self,
        out: &mut Vec<u8>,
        summary: &Summary<'_>,
        window: Option<&SummaryWindow<'_>>,
        totals: &[FieldTotal],
    ) {
        let start = out.len();
        out.push(b'<');
        out.extend_from_slice(self.summary_name.as_bytes());
        write_number_attribute(out, "records", summary.records);
        write_number_attribute(out, "first-offset", summary.first_offset);
        write_number_attribute(out, "last-offset", summary.last_offset);
        write_document_attribute(out, "report-id", summary.report_id);
        if let Some(window) = window {
            write_document_attribute(out, "window-start", window.start);
            write_document_attribute(out, "window-end", window.end);
            write_number_attribute(out, "window-sequence", window.sequence);
        }
        if totals.is_empty() {
            out.extend_from_slice(b"/>\n");
        } else {
            out.push(b'>');
            self.write_totals(out, totals);
            out.extend_from_slice(b"</");
            out.extend_from_slice(self.summary_name.as_bytes());
            out.extend_from_slice(b">\n");
        }
        self.lay_out(out, start);
        out.extend_from_slice(&self.document_end);
    }

    /// One `<total field count sum min max/>` per total, in order.
    fn write_totals(&self, out: &mut Vec<u8>, totals: &[FieldTotal]) {
        for total in totals {
            out.push(b'<');
            out.extend_from_slice(self.total_name.as_bytes());
            write_document_attribute(out, "field", &total.field);
            write_number_attribute(out, "count", total.count);
            write_raw_attribute(out, "sum", &total.sum);
            if let (Some(min), Some(max)) = (&total.min, &total.max) {
                write_raw_attribute(out, "min", min);
                write_raw_attribute(out, "max", max);
            }
            out.extend_from_slice(b"/>");
        }
    }

    /// The attribute fields' scalar values, in the record's field order.
    /// A null attribute is left out: an absent attribute is XML's null, and
    /// an empty value would be confused with the empty string.
    fn write_record_attributes(&self, out: &mut Vec<u8>, fields: &Map<String, Value>) {
        for (key, value) in fields {
            let Some(field) = self.named_top_level_fields.get(key.as_str()) else {
                continue;
            };
            if !field.scalar_as_attribute {
                continue;
            }
            match value {
                Value::String(text) => write_attribute(out, &field.xml_name, text),
                Value::Number(number) => write_raw_attribute(out, &field.xml_name, number.as_str()),
                Value::Bool(flag) => write_raw_attribute(out, &field.xml_name, boolean_text(*flag)),
                Value::Null | Value::Array(_) | Value::Object(_) => {}
            }
        }
    }
}

/// Refuses every definition that [`DocumentRenderer::new`] would not render
/// as written: a name it would encode (not an NCName, or `xmlns`) or that
/// XML reserves (starting with `xml` in any case), a reserved default
/// namespace (left out) or one with a character XML forbids (replaced), a
/// control character in it, and two attribute fields written under one
/// name (the second demoted to an element), besides everything
/// [`Definition::validate`] refuses. The producer API runs it before it
/// publishes a definition; decided from the renderer's own choices below,
/// so the two cannot drift.
///
/// Workers keep applying [`Definition::validate`] alone to definitions
/// already in the log, rendered with those silent repairs, so a replay
/// renders them exactly as the first run did.
///
/// # Errors
///
/// The first problem found, naming the field.
pub fn check_definition(definition: &Definition) -> Result<(), DefinitionError> {
    definition.validate()?;
    let reserved = |name: &str| {
        name.get(..3)
            .is_some_and(|start| start.eq_ignore_ascii_case("xml"))
    };
    let chosen_names = [("root", &definition.root), ("record", &definition.record)]
        .into_iter()
        .chain(definition.prefix.iter().map(|prefix| ("prefix", prefix)))
        .chain(
            definition
                .header
                .iter()
                .map(|header| ("header element", &header.element)),
        )
        .chain(
            definition
                .renames
                .values()
                .map(|target| ("rename target", target)),
        );
    for (field, name) in chosen_names {
        if definition_name(name) != name.as_str() || reserved(name) {
            return Err(DefinitionError::ReservedName {
                field,
                name: name.clone(),
            });
        }
    }
    if let Some(namespace) = &definition.namespace {
        if RESERVED_NAMESPACES.contains(&namespace.as_str()) {
            return Err(DefinitionError::ReservedNamespace(namespace.clone()));
        }
        if first_forbidden_character(namespace).is_some() || namespace.chars().any(char::is_control)
        {
            return Err(DefinitionError::InvalidNamespace(namespace.clone()));
        }
    }
    let fields = named_top_level_fields(definition);
    let mut written: BTreeMap<&str, &str> = BTreeMap::new();
    for field in &definition.attributes {
        let planned = &fields[field.as_str()];
        if reserved(&planned.xml_name) {
            return Err(DefinitionError::ReservedName {
                field: "attribute",
                name: planned.xml_name.clone(),
            });
        }
        if let Some(first) = written.insert(&planned.xml_name, field) {
            return Err(DefinitionError::AttributeCollision {
                first: first.to_owned(),
                second: field.clone(),
                name: planned.xml_name.clone(),
            });
        }
        debug_assert!(planned.scalar_as_attribute);
    }
    Ok(())
}

/// The names of the definition's attribute and renamed fields, computed once.
fn named_top_level_fields(definition: &Definition) -> BTreeMap<String, TopLevelField> {
    let xml_name_of = |field: &str| match definition.renames.get(field) {
        Some(target) => definition_name(target).into_owned(),
        None => encode_name(field).into_owned(),
    };
    let mut fields = BTreeMap::new();
    let mut attribute_names_in_use = BTreeSet::new();
    for field in &definition.attributes {
        let xml_name = xml_name_of(field);
        // Two attributes of one name would make the document malformed.
        let scalar_as_attribute = attribute_names_in_use.insert(xml_name.clone());
        fields.insert(
            field.clone(),
            TopLevelField {
                xml_name,
                scalar_as_attribute,
            },
        );
    }
    for field in definition.renames.keys() {
        if !fields.contains_key(field) {
            let xml_name = xml_name_of(field);
            fields.insert(
                field.clone(),
                TopLevelField {
                    xml_name,
                    scalar_as_attribute: false,
                },
            );
        }
    }
    fields
}

/// A name chosen in the definition: used as written when it is a valid
/// NCName (and not `xmlns`, which would declare a namespace as an
/// attribute), encoded otherwise.
fn definition_name(name: &str) -> Cow<'_, str> {
    if is_xml_name(name) && name != "xmlns" {
        Cow::Borrowed(name)
    } else {
        encode_name(name)
    }
}

/// Where an element's name comes from: a name worked out in advance, or a
/// record key encoded while it is written.
#[derive(Clone, Copy)]
enum ElementName<'a> {
    Verbatim(&'a str),
    FieldKey(&'a str),
}

/// A field: one element, or one per item for an array (none for an empty
/// array).
fn write_field(out: &mut Vec<u8>, name: ElementName<'_>, value: &Value) {
    match value {
        Value::Array(items) => {
            for item in items {
                write_element(out, name, item);
            }
        }
        _ => write_element(out, name, value),
    }
}

/// One element holding `value`. Reached with an array only for an array
/// item that is itself an array: that becomes one element whose children
/// are its items, each named [`NESTED_ARRAY_ITEM_ELEMENT`].
fn write_element(out: &mut Vec<u8>, name: ElementName<'_>, value: &Value) {
    out.push(b'<');
    let name_range = write_element_name(out, name);
    out.push(b'>');
    let content_start = out.len();
    match value {
        Value::Null => {
            out.pop();
            out.extend_from_slice(b" xsi:nil=\"true\"/>");
            return;
        }
        Value::Bool(flag) => out.extend_from_slice(boolean_text(*flag).as_bytes()),
        Value::Number(number) => write_number_text(out, number),
        Value::String(text) => out.extend_from_slice(partial_escape(text.as_str()).as_bytes()),
        Value::Object(fields) => {
            for (key, field_value) in fields {
                write_field(out, ElementName::FieldKey(key), field_value);
            }
        }
        Value::Array(items) => {
            for item in items {
                write_element(out, ElementName::Verbatim(NESTED_ARRAY_ITEM_ELEMENT), item);
            }
        }
    }
    if out.len() == content_start {
        // `<name>` becomes `<name/>`.
        out.pop();
        out.extend_from_slice(b"/>");
    } else {
        out.extend_from_slice(b"</");
        out.extend_from_within(name_range);
        out.push(b'>');
    }
}

/// Writes the name and returns where it is, so the end tag can copy it
/// instead of encoding it again.
fn write_element_name(out: &mut Vec<u8>, name: ElementName<'_>) -> Range<usize> {
    let name_start = out.len();
    match name {
        ElementName::Verbatim(xml_name) => out.extend_from_slice(xml_name.as_bytes()),
        ElementName::FieldKey(key) => write_encoded_name(out, key),
    }
    name_start..out.len()
}

/// The number's JSON text as serde_json's `arbitrary_precision` keeps it:
/// every digit as sent (`1.10` stays `1.10`, no float rounding), the
/// exponent marker normalized by its parser (`1E400` -> `1e+400`). JSON
/// number text is digits, `-`, `+`, `.`, `e`, `E`: nothing to escape.
fn write_number_text(out: &mut Vec<u8>, number: &serde_json::Number) {
    let text = number.as_str();
    debug_assert!(
        text.bytes()
            .all(|byte| byte.is_ascii_digit() || matches!(byte, b'-' | b'+' | b'.' | b'e' | b'E')),
        "{text:?} is JSON number text"
    );
    out.extend_from_slice(text.as_bytes());
}

fn is_scalar(value: &Value) -> bool {
    !matches!(value, Value::Array(_) | Value::Object(_))
}

fn boolean_text(flag: bool) -> &'static str {
    if flag { "true" } else { "false" }
}

/// ` name="value"` with the value escaped by quick-xml's attribute escaping,
/// which also writes tab, newline and carriage return as character
/// references (a parser would otherwise normalize them to spaces). quick-xml
/// exposes that escaping only through [`Attribute`]'s conversion.
fn write_attribute(out: &mut Vec<u8>, name: &str, value: &str) {
    let escaped = Attribute::from((name, value));
    write_raw_attribute(out, name, &escaped.value);
}

/// [`write_attribute`] for values the caller vouches for (stream name,
/// report id, namespace: all validated upstream). Should one still hold a
/// character XML 1.0 forbids, it is written as U+FFFD rather than breaking
/// the document; records, by contrast, are refused, never altered.
fn write_document_attribute(out: &mut Vec<u8>, name: &str, value: &str) {
    if first_forbidden_character(value).is_none() {
        write_attribute(out, name, value);
        return;
    }
    let replaced: String = value
        .chars()
        .map(|character| {
            if is_forbidden_character(character) {
                char::REPLACEMENT_CHARACTER
            } else {
                character
            }
        })
        .collect();
    write_attribute(out, name, &replaced);
}

/// ` name="value"` for a value known to need no escaping.
fn write_raw_attribute(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(b' ');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"=\"");
    out.extend_from_slice(value.as_bytes());
    out.push(b'"');
}

fn write_number_attribute(out: &mut Vec<u8>, name: &str, value: impl Display) {
    out.push(b' ');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"=\"");
    let written = write!(out, "{value}");
    debug_assert!(written.is_ok(), "writing to a Vec cannot fail");
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn definition(json: &str) -> Definition {
        serde_json::from_str(json).expect("a definition")
    }

    /// The elements of `document` as (depth, name, attributes, text), text
    /// that is only whitespace between elements left out.
    fn infoset(document: &str) -> Vec<(usize, String, Vec<(String, String)>, String)> {
        let parsed = roxmltree::Document::parse(document).expect("well-formed XML");
        parsed
            .descendants()
            .filter(|node| node.is_element())
            .map(|node| {
                let text: String = node
                    .children()
                    .filter(|child| child.is_text())
                    .filter_map(|child| child.text())
                    .filter(|text| !text.trim().is_empty() || node.children().count() == 1)
                    .collect();
                let attributes = node
                    .attributes()
                    .map(|attribute| (attribute.name().to_owned(), attribute.value().to_owned()))
                    .collect();
                (
                    node.ancestors().count(),
                    node.tag_name().name().to_owned(),
                    attributes,
                    text,
                )
            })
            .collect()
    }

    /// One document, every piece of it, with and without `indent`.
    fn both_ways(definition: &str, records: &[&str]) -> (String, String) {
        let render = |indent: Option<u8>| {
            let mut definition = self::definition(definition);
            definition.indent = indent;
            check_definition(&definition).unwrap();
            let renderer = DocumentRenderer::new(&definition);
            let summary = Summary {
                records: records.len() as u64,
                first_offset: 0,
                last_offset: 9,
                report_id: "s~0-0",
            };
            let totals = [FieldTotal {
                field: "amount".into(),
                count: 2,
                sum: "3.50".into(),
                min: Some("1.25".into()),
                max: Some("2.25".into()),
            }];
            let totals: &[FieldTotal] = if definition.totals.is_empty() {
                &[]
            } else {
                &totals
            };
            let mut out = Vec::new();
            renderer.start(&mut out, "s", 0, 0);
            renderer.header(
                &mut out,
                &HeaderValues {
                    stream: "s",
                    partition: 0,
                    summary: &summary,
                    window: None,
                    first_log_time: Some("2026-12-07T08:30:00.125Z"),
                    last_log_time: None,
                    totals,
                },
            );
            for record in records {
                let value: Value = serde_json::from_str(record).unwrap();
                renderer.record(&mut out, &value).unwrap();
            }
            renderer.finish_with_totals(&mut out, &summary, None, totals);
            String::from_utf8(out).unwrap()
        };
        (render(None), render(Some(2)))
    }

    /// Indentation adds whitespace between elements and nothing else: the
    /// same elements, attributes and texts (spaces in strings included),
    /// each element on a line of its own, a text element on one line.
    #[test]
    fn an_indented_document_holds_what_the_compact_one_holds() {
        let records = [
            r#"{"id": 1, "amount": 1.25, "note": "  two  spaces  ", "tags": ["a", "b"],
                "address": {"city": "Lyon", "zip": null}, "nested": [[1, []], {}], "extra": {"x": ""}}"#,
            r#"{"id": 2, "amount": 2.25}"#,
            r#"{"id": 3}"#,
        ];
        let untyped = r#"{"attributes": ["id"]}"#;
        let typed = r#"{"root": "ledger", "record": "entry", "namespace": "urn:example:ledger",
            "prefix": "lg", "attributes": ["id"], "totals": ["amount"],
            "fields": [{"name": "id", "type": "integer", "required": true},
                       {"name": "amount", "type": "decimal"},
                       {"name": "address", "type": "object", "fields": [
                           {"name": "zip", "type": "string"}, {"name": "city", "type": "string"}]}],
            "header": {"fields": [{"name": "MsgId", "value": "report_id"},
                                  {"name": "First", "value": "first_log_time"}], "totals": true}}"#;
        for definition in [untyped, typed] {
            let (compact, indented) = both_ways(definition, &records);
            assert_eq!(infoset(&compact), infoset(&indented), "{indented}");
            assert!(
                indented.contains("<note>  two  spaces  </note>"),
                "{indented}"
            );
            for line in indented.lines().skip(2) {
                let depth = line.len() - line.trim_start().len();
                assert!(
                    depth % 2 == 0 && !line.trim().is_empty(),
                    "{line:?} in {indented}"
                );
            }
        }
        let (_, indented) = both_ways(typed, &records[1..]);
        assert_eq!(
            indented
                .split_once('\n')
                .unwrap()
                .1
                .split_once('\n')
                .unwrap()
                .1,
            concat!(
                "  <lg:header>\n",
                "    <MsgId>s~0-0</MsgId>\n",
                "    <First>2026-12-07T08:30:00.125Z</First>\n",
                "    <lg:total field=\"amount\" count=\"2\" sum=\"3.50\" min=\"1.25\" max=\"2.25\"/>\n",
                "  </lg:header>\n",
                "  <lg:entry id=\"2\">\n",
                "    <amount>2.25</amount>\n",
                "  </lg:entry>\n",
                "  <lg:entry id=\"3\"/>\n",
                "  <lg:summary records=\"2\" first-offset=\"0\" last-offset=\"9\" report-id=\"s~0-0\">\n",
                "    <lg:total field=\"amount\" count=\"2\" sum=\"3.50\" min=\"1.25\" max=\"2.25\"/>\n",
                "  </lg:summary>\n",
                "</lg:ledger>\n",
            )
        );
    }

    /// Each definition the renderer would change without a word is
    /// refused, naming what it is about; each still passes the log's
    /// older check, so workers render what is in the log as before.
    #[test]
    fn every_definition_the_renderer_would_change_is_refused() {
        let refused = [
            (r#"{"renames":{"a":"xmlns"}}"#, "\"xmlns\""),
            (r#"{"renames":{"a":"XmlThing"}}"#, "\"XmlThing\""),
            (r#"{"root":"xml-report"}"#, "root"),
            (r#"{"record":"xmlns"}"#, "record"),
            (r#"{"attributes":["xmlfield"]}"#, "attribute"),
            (r#"{"attributes":["a"],"renames":{"a":"xmlns"}}"#, "xmlns"),
            (
                r#"{"namespace":"http://www.w3.org/2000/xmlns/"}"#,
                "reserved",
            ),
            (
                r#"{"namespace":"http://www.w3.org/XML/1998/namespace"}"#,
                "reserved",
            ),
            (r#"{"namespace":"urn:a\u0001b"}"#, "urn:a"),
            (r#"{"namespace":"urn:a\u0080b"}"#, "urn:a"),
            (r#"{"renames":{"a":"x","b":"x"}}"#, "\"x\""),
            (r#"{"attributes":["a","b"],"renames":{"a":"b"}}"#, "\"b\""),
        ];
        for (json, named) in refused {
            let definition = definition(json);
            let error = check_definition(&definition).expect_err(json).to_string();
            assert!(error.contains(named), "{json}: {error}");
            if !json.contains("\"x\"") {
                definition
                    .validate()
                    .unwrap_or_else(|error| panic!("{json} was valid in the log: {error}"));
            }
        }
    }

    #[test]
    fn definitions_rendered_as_written_pass() {
        for json in [
            r#"{}"#,
            r#"{"root":"orders","record":"order","namespace":"urn:example:orders"}"#,
            r#"{"attributes":["id","kind"],"renames":{"kind":"type","text":"body"}}"#,
            r#"{"renames":{"a":"b"},"attributes":["b"]}"#,
            r#"{"root":"xm","record":"mlx"}"#,
        ] {
            check_definition(&definition(json)).unwrap_or_else(|error| panic!("{json}: {error}"));
        }
    }
}

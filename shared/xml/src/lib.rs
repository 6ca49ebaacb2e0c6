//! Reports as XML 1.0: the streaming renderer the worker runs on every
//! record, and the check the producer API runs before it accepts one.
//!
//! A document is appended piece by piece to a buffer the caller owns:
//! [`DocumentRenderer::start`] when the document opens,
//! [`DocumentRenderer::record`] per record, [`DocumentRenderer::finish`]
//! when it is cut (the report id and the totals are known only then, so the
//! summary goes last). The bytes depend only on the definition, the records
//! and the values passed in: no clock, no randomness, no hash-map order, so
//! a replay renders the same document byte for byte.
//!
//! # Document shape
//!
//! Always well-formed UTF-8 XML 1.0 (and namespace-well-formed), one line
//! per record:
//!
//! ```text
//! <?xml version="1.0" encoding="UTF-8"?>
//! <{root} [xmlns="{namespace}"] xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" stream="{stream}" partition="{partition}" first-offset="{first offset}">
//! <{record} [{attribute fields}]>{fields as child elements}</{record}>
//! ...one line per record...
//! <summary records="{count}" first-offset="{first}" last-offset="{last}" report-id="{report id}"/>
//! </{root}>
//! ```
//!
//! `xmlns:xsi` is always declared, since the root is written before any
//! null is seen. Stream, report id and namespace are validated upstream;
//! should one still hold a character XML 1.0 forbids, it is written as
//! U+FFFD so the document stays well-formed. Every line ends with `\n`; there is no other whitespace
//! between elements, and none inside a record that was not in its strings.
//! A definition's `indent` lays each record, header and summary out again
//! with every element on a line of its own, indented by that many spaces
//! per level (see the `indent` module): only whitespace between elements,
//! added by one pass over what either rendering path wrote, so both stay
//! byte for byte the same.
//! An empty element is written `<name/>`. The summary element is in the
//! document's default namespace, like the records.
//!
//! # Mapping a record (a JSON object) to its element
//!
//! | JSON | XML |
//! | --- | --- |
//! | field, in the record's order | child element named after the key |
//! | string | escaped text (`<` `>` `&` and CR as references; an empty string gives `<f/>`) |
//! | number | its JSON text, every digit as sent (`1.10`, 30-digit integers unchanged; serde_json's parser writes an exponent as `e+N`/`e-N`: `1E400` -> `1e+400`) |
//! | `true` / `false` | `true` / `false` |
//! | `null` | `<f xsi:nil="true"/>` |
//! | object | element with one child per field (`{}` gives `<f/>`) |
//! | array | the field's element repeated once per item, in order; `[]` writes nothing |
//! | array inside an array | one element for the inner array, its items as `<item>` children (`"m": [[1, 2], []]` gives `<m><item>1</item><item>2</item></m><m/>`) |
//!
//! Definition-driven, top-level fields only:
//! - `attributes`: a listed field whose value is a string, number or boolean
//!   is written as an attribute of the record element, in the record's field
//!   order (values escaped, tab / newline / CR as character references so
//!   they survive attribute normalization); a null one is left out (an
//!   absent attribute); an object or array one stays a child element.
//! - `renames`: the field's element or attribute takes the given name,
//!   written as is.
//! - `namespace`: the default namespace of the whole document.
//!
//! Keys that are not XML NCNames are encoded injectively by [`encode_name`]
//! (`a b` -> `a_x0020_b`, `1st` -> `_x0031_st`, `a:b` -> `a_x003A_b`, the
//! empty key -> `_x0000_`); [`decode_name`] gives back the key exactly.
//!
//! What cannot be rendered is refused, never altered: a record that is not
//! an object, or any key or string holding a character XML 1.0 forbids
//! (U+0000-U+0008, U+000B, U+000C, U+000E-U+001F, U+FFFE, U+FFFF), see
//! [`check_record`].
//!
//! # Example
//!
//! ```
//! use quire_messages::Definition;
//! use quire_xml::{DocumentRenderer, Summary};
//!
//! let definition = Definition {
//!     root: "orders".into(),
//!     record: "order".into(),
//!     namespace: Some("urn:example:orders".into()),
//!     attributes: ["id".to_owned()].into(),
//!     renames: [("customer name".to_owned(), "customer".to_owned())].into(),
//!     ..Definition::default()
//! };
//! let renderer = DocumentRenderer::new(&definition);
//! let record: serde_json::Value = serde_json::from_str(
//!     r#"{"id": 7, "customer name": "Ada & Co", "total": 1.10, "tags": ["new", "vip"],
//!         "note": null, "address": {"zip code": "8000"}, "1st": true, "none": []}"#,
//! )
//! .unwrap();
//!
//! let mut document = Vec::new();
//! renderer.start(&mut document, "orders", 3, 42);
//! renderer.record(&mut document, &record).unwrap();
//! let summary = Summary { records: 1, first_offset: 42, last_offset: 42, report_id: "orders~3-43" };
//! renderer.finish(&mut document, &summary);
//!
//! assert_eq!(
//!     String::from_utf8(document).unwrap(),
//!     concat!(
//!         "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n",
//!         "<orders xmlns=\"urn:example:orders\" xmlns:xsi=\"http://www.w3.org/2001/XMLSchema-instance\" ",
//!         "stream=\"orders\" partition=\"3\" first-offset=\"42\">\n",
//!         "<order id=\"7\"><customer>Ada &amp; Co</customer><total>1.10</total>",
//!         "<tags>new</tags><tags>vip</tags><note xsi:nil=\"true\"/>",
//!         "<address><zip_x0020_code>8000</zip_x0020_code></address><_x0031_st>true</_x0031_st></order>\n",
//!         "<summary records=\"1\" first-offset=\"42\" last-offset=\"42\" report-id=\"orders~3-43\"/>\n",
//!         "</orders>\n",
//!     )
//! );
//! ```

mod check;
mod clean;
pub mod compress;
mod duplicates;
mod indent;
mod keys;
mod names;
mod read;
mod render;
mod stream;
mod totals;
mod typed;
mod xsd;

pub use check::{FieldPart, ForbiddenCharacter, MAX_NESTING_DEPTH, RenderError, check_record};
pub use clean::is_clean_record;
pub use duplicates::first_duplicate_key;
pub use names::{decode_name, encode_name};
pub use read::{MAX_DEFINITION_BYTES, ReadDefinitionError, read_definition};
pub use render::{
    DocumentRenderer, FieldTotal, HeaderValues, NESTED_ARRAY_ITEM_ELEMENT, Summary, SummaryWindow,
    XML_SCHEMA_INSTANCE_NAMESPACE, check_definition, log_time_text, schema_key,
};
pub use stream::render_fields;
pub use totals::Totals;
pub use typed::{MAX_DIGITS, TypeError, TypedCheck};
pub use xsd::{TOTAL_ELEMENT, is_schema_file_name, schema_file_name, schema_for};

//! Typed documents against their generated schema, checked by a real XML
//! Schema validator: xmllint from Debian's libxml2-utils (the stack
//! installs it; `deploy/local/stack env` exports `QUIRE_TEST_XMLLINT`).
//! A test here fails, never skips, when xmllint is missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use quire_messages::Definition;
use quire_xml::{
    DocumentRenderer, Summary, SummaryWindow, Totals, TypedCheck, schema_file_name, schema_for,
};
use serde_json::Value;

fn xmllint() -> PathBuf {
    if let Ok(path) = std::env::var("QUIRE_TEST_XMLLINT") {
        return PathBuf::from(path);
    }
    let found = Command::new("xmllint").arg("--version").output();
    assert!(
        found.is_ok_and(|output| output.status.success()),
        "xmllint is needed (Debian's libxml2-utils): run `deploy/local/stack up` and \
         `eval \"$(deploy/local/stack env)\"`, or install libxml2-utils"
    );
    PathBuf::from("xmllint")
}

/// Validates `document` against `schema` with xmllint: Ok, or its complaint.
fn validate(schema: &str, document: &[u8]) -> Result<(), String> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let directory = std::env::temp_dir().join(format!(
        "quire-xml-schema-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&directory).unwrap();
    let schema_path = directory.join("schema.xsd");
    let document_path = directory.join("document.xml");
    std::fs::write(&schema_path, schema).unwrap();
    std::fs::write(&document_path, document).unwrap();
    let verdict = run_xmllint(&schema_path, &document_path);
    std::fs::remove_dir_all(&directory).unwrap();
    verdict
}

fn run_xmllint(schema: &Path, document: &Path) -> Result<(), String> {
    let output = Command::new(xmllint())
        .arg("--noout")
        .arg("--nonet")
        .arg("--schema")
        .arg(schema)
        .arg(document)
        .output()
        .expect("xmllint runs");
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

fn definition(text: &str) -> Definition {
    let definition: Definition = serde_json::from_str(text).expect("a test definition parses");
    definition.validate().expect("a test definition is valid");
    definition
}

/// Renders a whole document of `records` (each checked first: a test
/// record must fit), with its totals in the summary.
fn document(definition: &Definition, records: &[&str], window: bool) -> Vec<u8> {
    let renderer = DocumentRenderer::new(definition);
    let check = TypedCheck::new(definition).expect("typed");
    let mut totals = Totals::new(definition);
    let mut out = Vec::new();
    renderer.start(&mut out, "orders.eu", 3, 100);
    for text in records {
        let record: Value = serde_json::from_str(text).expect("JSON");
        check
            .check(&record)
            .unwrap_or_else(|error| panic!("{text}: {error}"));
        renderer.record(&mut out, &record).expect("renders");
        if let Some(totals) = &mut totals {
            totals.stage(&record);
            totals.commit();
        }
    }
    let summary = Summary {
        records: records.len() as u64,
        first_offset: 100,
        last_offset: 100 + records.len() as i64,
        report_id: "orders.eu~3-101",
    };
    let window = window.then_some(SummaryWindow {
        start: "2026-03-29T00:00:00+01:00",
        end: "2026-03-30T00:00:00+02:00",
        sequence: 1,
    });
    let totals = totals.map(|totals| totals.totals()).unwrap_or_default();
    renderer.finish_with_totals(&mut out, &summary, window.as_ref(), &totals);
    out
}

const FIELDS: &str = r#"[
    {"name": "id", "type": "string", "required": true, "max_length": 12, "pattern": "[A-Z]{2}-[0-9]+"},
    {"name": "amount", "type": "decimal", "required": true, "scale": 2},
    {"name": "quantity", "type": "integer"},
    {"name": "paid", "type": "boolean"},
    {"name": "day", "type": "date"},
    {"name": "booked", "type": "datetime"},
    {"name": "note", "type": "string"},
    {"name": "customer", "type": "object", "fields": [
        {"name": "name", "type": "string", "required": true},
        {"name": "address", "type": "object", "fields": [
            {"name": "zip", "type": "string"}, {"name": "city", "type": "string"}]}]},
    {"name": "lines", "type": "object", "repeated": true, "fields": [
        {"name": "sku", "type": "string", "required": true},
        {"name": "price", "type": "decimal"}]},
    {"name": "tags", "type": "string", "repeated": true}]"#;

/// Records that fit, hostile content among them: markup and quotes in
/// text, CR/LF/tab, a 40-digit amount, keys in any order, nulls, empty
/// arrays and strings, undeclared fields of every shape.
const RECORDS: [&str; 8] = [
    r#"{"id": "AB-1", "amount": 10.50}"#,
    r#"{"amount": 0.01, "id": "ZZ-99", "quantity": 123456789012345678, "paid": true,
        "day": "2024-02-29", "booked": "2026-03-29T02:30:00.125+14:00"}"#,
    r#"{"id": "AB-2", "amount": -1234567890123456.99, "big": 1234567890123456789012345678901234567890.99,
        "note": "<b>&amp;</b> \"quoted\" 'single' ]]> \r\n\t end"}"#,
    r#"{"id": "AB-3", "amount": 1, "quantity": null, "note": "", "tags": [], "lines": []}"#,
    r#"{"lines": [{"price": 2.5, "sku": "x<y"}, {"sku": "z"}], "id": "AB-4", "amount": 2,
        "tags": ["a", "b & c"], "customer": {"address": {"city": "Zürich"}, "name": "Ada"}}"#,
    r#"{"id": "AB-5", "amount": 3, "extra field": {"deep": [[1, 2], []], "x": null}, "1st": true}"#,
    r#"{"id": "AB-6", "amount": 4, "customer": {"name": "O'Brien", "nickname": "ob"}}"#,
    r#"{"id": "AB-7", "amount": 5, "booked": "2026-10-25T02:30:00Z", "note": null}"#,
];

#[test]
fn typed_documents_validate_against_their_schema_in_every_namespace_style() {
    for (style, shape) in [
        ("no namespace", r#""root": "orders", "record": "order""#),
        (
            "default namespace",
            r#""namespace": "urn:example:orders", "root": "orders""#,
        ),
        (
            "prefixed namespace",
            r#""namespace": "urn:example:orders", "prefix": "o", "root": "orders", "record": "order""#,
        ),
        (
            "attributes and renames",
            r#""attributes": ["id", "paid"], "renames": {"amount": "Amt", "lines": "Line"}"#,
        ),
        (
            "indented",
            r#""namespace": "urn:example:orders", "prefix": "o", "attributes": ["id"], "indent": 2"#,
        ),
    ] {
        let definition = definition(&format!(
            r#"{{{shape}, "fields": {FIELDS}, "totals": ["amount", "quantity"]}}"#
        ));
        let schema = schema_for(&definition);
        // Indentation is layout, not content: one schema either way.
        let unindented = Definition {
            indent: None,
            ..definition.clone()
        };
        assert_eq!(schema, schema_for(&unindented), "{style}");
        for window in [false, true] {
            let document = document(&definition, &RECORDS, window);
            validate(&schema, &document).unwrap_or_else(|complaint| {
                panic!(
                    "{style}: the document does not validate:\n{complaint}\n{}\n{schema}",
                    String::from_utf8_lossy(&document)
                )
            });
        }
        let empty = document(&definition, &[], false);
        validate(&schema, &empty).unwrap_or_else(|complaint| panic!("{style}, empty: {complaint}"));
    }
}

#[test]
fn the_validator_refuses_what_the_schema_forbids() {
    let definition = definition(&format!(
        r#"{{"namespace": "urn:example:orders", "prefix": "o", "fields": {FIELDS}, "undeclared": "refuse"}}"#
    ));
    let schema = schema_for(&definition);
    let good = String::from_utf8(document(
        &definition,
        &[RECORDS[0], RECORDS[1], RECORDS[4]],
        false,
    ))
    .unwrap();
    validate(&schema, good.as_bytes()).unwrap();
    for (what, from, to) in [
        (
            "a decimal with three digits",
            "<amount>10.50</amount>",
            "<amount>10.505</amount>",
        ),
        ("a missing required field", "<id>AB-1</id>", ""),
        ("a pattern broken", "<id>AB-1</id>", "<id>ab-1</id>"),
        (
            "an integer with a fraction",
            "<quantity>123456789012345678</quantity>",
            "<quantity>1.5</quantity>",
        ),
        (
            "a date-time without offset",
            "2026-03-29T02:30:00.125+14:00",
            "2026-03-29T02:30:00.125",
        ),
        (
            "fields out of order",
            "<id>AB-1</id><amount>10.50</amount>",
            "<amount>10.50</amount><id>AB-1</id>",
        ),
        (
            "an undeclared field",
            "<id>AB-1</id><amount>10.50</amount>",
            "<id>AB-1</id><amount>10.50</amount><x>1</x>",
        ),
    ] {
        assert!(good.contains(from), "{what}: {from} is in the document");
        let bad = good.replacen(from, to, 1);
        assert!(
            validate(&schema, bad.as_bytes()).is_err(),
            "{what}: the validator should refuse it"
        );
    }
}

#[test]
fn the_summary_carries_exact_totals_and_the_root_points_to_the_schema() {
    let definition = definition(&format!(
        r#"{{"namespace": "urn:example:orders", "prefix": "o", "fields": {FIELDS}, "totals": ["amount"]}}"#
    ));
    let text = String::from_utf8(document(&definition, &RECORDS, false)).unwrap();
    let file = schema_file_name(&schema_for(&definition));
    assert!(
        text.contains(&format!(
            "xsi:schemaLocation=\"urn:example:orders schemas/orders.eu/{file}\""
        )),
        "{text}"
    );
    // 10.50 + 0.01 - 1234567890123456.99 + 1 + 2 + 3 + 4 + 5
    assert!(
        text.contains(
            "<o:total field=\"amount\" count=\"8\" sum=\"-1234567890123431.48\" \
             min=\"-1234567890123456.99\" max=\"10.50\"/></o:summary>"
        ),
        "{text}"
    );
}

#[test]
fn the_same_definition_gives_the_same_schema_and_a_change_a_new_name() {
    let first = definition(&format!(r#"{{"fields": {FIELDS}}}"#));
    let again = definition(&format!(r#"{{"fields": {FIELDS}}}"#));
    assert_eq!(schema_for(&first), schema_for(&again));
    let changed = definition(&format!(
        r#"{{"fields": {FIELDS}, "undeclared": "refuse"}}"#
    ));
    assert_ne!(
        schema_file_name(&schema_for(&first)),
        schema_file_name(&schema_for(&changed))
    );
}

#[test]
fn the_renderer_refuses_a_record_its_typed_check_refuses() {
    let definition = definition(&format!(r#"{{"fields": {FIELDS}}}"#));
    let renderer = DocumentRenderer::new(&definition);
    let mut out = b"kept".to_vec();
    let misfit: Value = serde_json::from_str(r#"{"id": "AB-1", "amount": "ten"}"#).unwrap();
    let error = renderer.record(&mut out, &misfit).unwrap_err();
    assert!(
        matches!(error, quire_xml::RenderError::Type(ref found) if found.path == "amount"),
        "{error}"
    );
    assert_eq!(out, b"kept", "nothing of a refused record is written");
}

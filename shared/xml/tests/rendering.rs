//! What a record becomes, case by case: the mapping the crate docs promise.

use std::collections::{BTreeMap, BTreeSet};

use quire_messages::Definition;
use quire_xml::{DocumentRenderer, FieldPart, RenderError, Summary, check_record};
use serde_json::{Value, json};

/// The record element the default definition renders for `record_text`
/// (parsed as the worker does, so numbers keep their text), without the
/// trailing newline.
fn render(definition: &Definition, record_text: &str) -> String {
    let record: Value = serde_json::from_str(record_text).expect("test records are JSON");
    let mut out = Vec::new();
    DocumentRenderer::new(definition)
        .record(&mut out, &record)
        .expect("renderable");
    let line = String::from_utf8(out).expect("UTF-8");
    line.strip_suffix('\n')
        .expect("a record ends its line")
        .to_owned()
}

fn render_default(record_text: &str) -> String {
    render(&Definition::default(), record_text)
}

#[test]
fn text_is_escaped() {
    assert_eq!(
        render_default(r#"{"t": "a < b & c > d"}"#),
        "<record><t>a &lt; b &amp; c &gt; d</t></record>"
    );
    assert_eq!(
        render_default(r#"{"t": "]]>"}"#),
        "<record><t>]]&gt;</t></record>"
    );
    assert_eq!(
        render_default(r#"{"t": "quotes \" ' stay"}"#),
        r#"<record><t>quotes " ' stay</t></record>"#
    );
    // CR would be normalized to LF by any parser: written as a reference.
    assert_eq!(
        render_default(r#"{"t": "line\r\nnext\ttab"}"#),
        "<record><t>line&#13;\nnext\ttab</t></record>"
    );
    assert_eq!(render_default(r#"{"t": ""}"#), "<record><t/></record>");
}

#[test]
fn attribute_values_are_escaped_and_keep_their_whitespace() {
    let definition = Definition {
        attributes: BTreeSet::from(["a".to_owned()]),
        ..Definition::default()
    };
    assert_eq!(
        render(&definition, r#"{"a": "say \"hi\" & 'bye' <now>"}"#),
        r#"<record a="say &quot;hi&quot; &amp; &apos;bye&apos; &lt;now&gt;"/>"#
    );
    assert_eq!(
        render(&definition, r#"{"a": "tab\tnewline\ncr\r"}"#),
        r#"<record a="tab&#9;newline&#10;cr&#13;"/>"#
    );
}

#[test]
fn numbers_are_written_exactly_as_sent() {
    assert_eq!(
        render_default(
            r#"{"a": 1.10, "c": 123456789012345678901234567890, "d": -0, "f": 0.1000000000000000000001}"#
        ),
        "<record><a>1.10</a><c>123456789012345678901234567890</c><d>-0</d><f>0.1000000000000000000001</f></record>"
    );
}

#[test]
fn exponents_keep_every_digit_in_serde_json_form() {
    // serde_json's parser writes the exponent as `e+N` / `e-N` (value and
    // digits unchanged): that is the text the renderer receives.
    assert_eq!(
        render_default(r#"{"b": 1e400, "e": 2.5E-3, "g": 1.50e+07}"#),
        "<record><b>1e+400</b><e>2.5e-3</e><g>1.50e+07</g></record>"
    );
}

#[test]
fn booleans_and_null() {
    assert_eq!(
        render_default(r#"{"yes": true, "no": false, "nothing": null}"#),
        r#"<record><yes>true</yes><no>false</no><nothing xsi:nil="true"/></record>"#
    );
}

#[test]
fn fields_keep_the_record_order() {
    assert_eq!(
        render_default(r#"{"z": 1, "a": 2, "m": 3}"#),
        "<record><z>1</z><a>2</a><m>3</m></record>"
    );
}

#[test]
fn nested_objects_become_nested_elements() {
    assert_eq!(
        render_default(
            r#"{"customer": {"name": "Ada", "address": {"city": "Zürich"}}, "empty": {}}"#
        ),
        "<record><customer><name>Ada</name><address><city>Zürich</city></address></customer><empty/></record>"
    );
}

#[test]
fn arrays_repeat_the_element() {
    assert_eq!(
        render_default(r#"{"tags": ["a", "b"], "none": [], "mixed": [1, null, {"k": true}]}"#),
        concat!(
            "<record><tags>a</tags><tags>b</tags>",
            r#"<mixed>1</mixed><mixed xsi:nil="true"/><mixed><k>true</k></mixed></record>"#
        )
    );
}

#[test]
fn arrays_inside_arrays_become_item_children() {
    assert_eq!(
        render_default(r#"{"m": [[1, 2], [], [[3]]]}"#),
        "<record><m><item>1</item><item>2</item></m><m/><m><item><item>3</item></item></m></record>"
    );
}

#[test]
fn an_empty_record_is_an_empty_element() {
    assert_eq!(render_default("{}"), "<record/>");
    assert_eq!(render_default(r#"{"none": []}"#), "<record/>");
}

#[test]
fn keys_that_are_not_xml_names_are_encoded() {
    assert_eq!(
        render_default(r#"{"a b": 1, "a:b": 2, "1st": 3, "": 4, "_x0041_": 5, "xmlns": 6}"#),
        concat!(
            "<record><a_x0020_b>1</a_x0020_b><a_x003A_b>2</a_x003A_b><_x0031_st>3</_x0031_st>",
            "<_x0000_>4</_x0000_><_x005F_x0041_>5</_x005F_x0041_><_x0078_mlns>6</_x0078_mlns></record>"
        )
    );
    assert_eq!(
        render_default(r#"{"outer": {"inner key": [1]}}"#),
        "<record><outer><inner_x0020_key>1</inner_x0020_key></outer></record>"
    );
}

#[test]
fn attributes_and_renames_follow_the_definition() {
    let definition = Definition {
        record: "order".into(),
        attributes: BTreeSet::from([
            "id".to_owned(),
            "kind".to_owned(),
            "gone".to_owned(),
            "deep".to_owned(),
        ]),
        renames: BTreeMap::from([
            ("kind".to_owned(), "type".to_owned()),
            ("customer name".to_owned(), "customer".to_owned()),
        ]),
        ..Definition::default()
    };
    assert_eq!(
        render(
            &definition,
            r#"{"customer name": "Ada", "kind": "retail", "id": 7, "gone": null, "deep": {"x": 1}, "other": true}"#
        ),
        concat!(
            r#"<order type="retail" id="7"><customer>Ada</customer>"#,
            "<deep><x>1</x></deep><other>true</other></order>"
        )
    );
    // Renames and attributes apply to top-level fields only.
    assert_eq!(
        render(
            &definition,
            r#"{"nested": {"id": 1, "customer name": "x"}}"#
        ),
        "<order><nested><id>1</id><customer_x0020_name>x</customer_x0020_name></nested></order>"
    );
    // An array field listed as an attribute stays elements, renamed.
    assert_eq!(
        render(&definition, r#"{"kind": ["a", "b"]}"#),
        "<order><type>a</type><type>b</type></order>"
    );
}

#[test]
fn attribute_names_are_encoded_and_never_collide() {
    let definition = Definition {
        attributes: BTreeSet::from([
            "a b".to_owned(),
            "b".to_owned(),
            "c".to_owned(),
            "xmlns".to_owned(),
        ]),
        renames: BTreeMap::from([("c".to_owned(), "b".to_owned())]),
        ..Definition::default()
    };
    // `b` and `c` (renamed to `b`) would share a name: `b`, first in field
    // name order, keeps the attribute and `c` becomes an element.
    assert_eq!(
        render(&definition, r#"{"a b": 1, "b": 2, "c": 3, "xmlns": "x"}"#),
        r#"<record a_x0020_b="1" b="2" _x0078_mlns="x"><b>3</b></record>"#
    );
}

#[test]
fn document_shape_with_namespace() {
    let definition = Definition {
        root: "orders".into(),
        namespace: Some("urn:example:a&b".into()),
        ..Definition::default()
    };
    let renderer = DocumentRenderer::new(&definition);
    let mut out = Vec::new();
    renderer.start(&mut out, "orders", 7, 1_000);
    renderer.record(&mut out, &json!({"a": 1})).unwrap();
    renderer.record(&mut out, &json!({"a": 2})).unwrap();
    renderer.finish(
        &mut out,
        &Summary {
            records: 2,
            first_offset: 1_000,
            last_offset: 1_001,
            report_id: "orders~7-1002",
        },
    );
    assert_eq!(
        String::from_utf8(out).unwrap(),
        concat!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n",
            "<orders xmlns=\"urn:example:a&amp;b\" xmlns:xsi=\"http://www.w3.org/2001/XMLSchema-instance\" ",
            "stream=\"orders\" partition=\"7\" first-offset=\"1000\">\n",
            "<record><a>1</a></record>\n",
            "<record><a>2</a></record>\n",
            "<summary records=\"2\" first-offset=\"1000\" last-offset=\"1001\" report-id=\"orders~7-1002\"/>\n",
            "</orders>\n",
        )
    );
}

#[test]
fn an_empty_document_is_well_formed() {
    let renderer = DocumentRenderer::new(&Definition::default());
    let mut out = Vec::new();
    renderer.start(&mut out, "s", 0, 5);
    renderer.finish(
        &mut out,
        &Summary {
            records: 0,
            first_offset: 5,
            last_offset: 4,
            report_id: "s~0-5",
        },
    );
    let text = String::from_utf8(out).unwrap();
    let document = roxmltree::Document::parse(&text).expect("well-formed");
    let summary = document
        .root_element()
        .first_element_child()
        .expect("summary");
    assert_eq!(summary.tag_name().name(), "summary");
    assert_eq!(summary.attribute("records"), Some("0"));
}

#[test]
fn a_definition_that_skipped_validation_still_gives_well_formed_xml() {
    let definition = Definition {
        root: "1 root".into(),
        record: "".into(),
        namespace: Some("http://www.w3.org/2000/xmlns/".into()),
        attributes: BTreeSet::from(["a".to_owned()]),
        renames: BTreeMap::from([
            ("a".to_owned(), "xmlns".to_owned()),
            ("b".to_owned(), "x:y".to_owned()),
        ]),
        ..Definition::default()
    };
    let renderer = DocumentRenderer::new(&definition);
    let mut out = Vec::new();
    renderer.start(&mut out, "s", 0, 0);
    renderer.record(&mut out, &json!({"a": 1, "b": 2})).unwrap();
    renderer.finish(
        &mut out,
        &Summary {
            records: 1,
            first_offset: 0,
            last_offset: 0,
            report_id: "s~0-1",
        },
    );
    let text = String::from_utf8(out).unwrap();
    let document =
        roxmltree::Document::parse(&text).unwrap_or_else(|error| panic!("{error}: {text}"));
    assert_eq!(
        document.root_element().tag_name().name(),
        "_x0031__x0020_root"
    );
    let record = document.root_element().first_element_child().unwrap();
    assert_eq!(record.tag_name().name(), "_x0000_");
    assert_eq!(record.attribute("_x0078_mlns"), Some("1"));
    assert_eq!(
        record.first_element_child().unwrap().tag_name().name(),
        "x_x003A_y"
    );
}

#[test]
fn document_values_never_break_the_document() {
    let definition = Definition {
        namespace: Some("urn:\u{1}".into()),
        ..Definition::default()
    };
    let renderer = DocumentRenderer::new(&definition);
    let mut out = Vec::new();
    renderer.start(&mut out, "bad\u{0}stream", -1, -1);
    renderer.finish(
        &mut out,
        &Summary {
            records: 0,
            first_offset: -1,
            last_offset: -2,
            report_id: "id\u{FFFE}\"<&",
        },
    );
    let text = String::from_utf8(out).unwrap();
    let document =
        roxmltree::Document::parse(&text).unwrap_or_else(|error| panic!("{error}: {text}"));
    let root = document.root_element();
    assert_eq!(root.attribute("stream"), Some("bad\u{FFFD}stream"));
    assert_eq!(root.tag_name().namespace(), Some("urn:\u{FFFD}"));
    let summary = root.first_element_child().unwrap();
    assert_eq!(summary.attribute("report-id"), Some("id\u{FFFD}\"<&"));
}

#[test]
fn forbidden_characters_are_refused_with_the_field_path() {
    let renderer = DocumentRenderer::new(&Definition::default());
    for (record, path, character, place) in [
        (json!({"a": "\u{0}"}), "a", '\u{0}', FieldPart::Value),
        (
            json!({"a": {"b": ["ok", "\u{1}"]}}),
            "a.b[1]",
            '\u{1}',
            FieldPart::Value,
        ),
        (
            json!({"items": [{}, {}, {"name": "x\u{FFFE}"}]}),
            "items[2].name",
            '\u{FFFE}',
            FieldPart::Value,
        ),
        (
            json!({"k\u{FFFF}": 1}),
            "[\"k\\uffff\"]",
            '\u{FFFF}',
            FieldPart::Name,
        ),
    ] {
        let mut out = b"kept".to_vec();
        let error = renderer.record(&mut out, &record).unwrap_err();
        assert_eq!(
            Err(error.clone()),
            check_record(&record),
            "the API and the renderer agree"
        );
        let RenderError::ForbiddenCharacter(found) = error else {
            panic!("expected a forbidden character for {record}, got {error:?}");
        };
        assert_eq!(
            (found.path.as_str(), found.character, found.place),
            (path, character, place)
        );
        assert_eq!(out, b"kept", "nothing is written for a refused record");
    }
    let message = check_record(&json!({"items": [{}, {}, {"name": "\u{1}"}]}))
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "field `items[2].name` contains U+0001, a character XML 1.0 does not allow; remove or replace it"
    );
}

#[test]
fn only_objects_are_rendered() {
    let renderer = DocumentRenderer::new(&Definition::default());
    for (record, found) in [
        (json!([]), "an array"),
        (json!(1), "a number"),
        (json!(null), "null"),
        (json!("x"), "a string"),
        (json!(true), "a boolean"),
    ] {
        let mut out = Vec::new();
        assert_eq!(
            renderer.record(&mut out, &record),
            Err(RenderError::NotAnObject { found })
        );
        assert!(out.is_empty());
    }
}

#[test]
fn rendering_is_deterministic() {
    let definition = Definition {
        attributes: BTreeSet::from(["b".to_owned(), "a".to_owned()]),
        ..Definition::default()
    };
    let record: Value = serde_json::from_str(r#"{"b": 1, "a": 2, "c": {"z": 1, "y": 2}}"#).unwrap();
    let render_once = || {
        let mut out = Vec::new();
        DocumentRenderer::new(&definition)
            .record(&mut out, &record)
            .unwrap();
        out
    };
    assert_eq!(render_once(), render_once());
    assert_eq!(
        String::from_utf8(render_once()).unwrap(),
        "<record b=\"1\" a=\"2\"><c><z>1</z><y>2</y></c></record>\n"
    );
}

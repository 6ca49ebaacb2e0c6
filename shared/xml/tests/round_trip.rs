//! Arbitrary records through the renderer and back through an independent
//! XML parser (roxmltree): every document is well-formed, and names and
//! values come back as they were sent.

use std::collections::BTreeSet;

use proptest::collection::vec;
use proptest::prelude::*;
use quire_messages::{Definition, is_xml_name};
use quire_xml::{
    DocumentRenderer, NESTED_ARRAY_ITEM_ELEMENT, RenderError, Summary,
    XML_SCHEMA_INSTANCE_NAMESPACE, check_record, decode_name, encode_name,
};
use roxmltree::Node;
use serde_json::{Map, Value};

const NAMESPACE: &str = "urn:quire:test";

fn is_xml_character(character: char) -> bool {
    !matches!(character, '\u{0}'..='\u{8}' | '\u{B}' | '\u{C}' | '\u{E}'..='\u{1F}' | '\u{FFFE}' | '\u{FFFF}')
}

/// Pieces that stress escaping and name encoding more than random
/// characters would.
fn tricky_piece() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "_",
        "x",
        "0",
        "4",
        "1",
        "A",
        "_x0041_",
        "_x0041",
        "_x00410041_",
        " ",
        ":",
        "é",
        "-",
        ".",
        "·",
        "😀",
        "\u{F0000}",
        "\u{300}",
        "<",
        "&",
        ">",
        "]]>",
        "&amp;",
        "\"",
        "'",
        "\r",
        "\n",
        "\r\n",
        "\t",
        "xmlns",
    ])
}

/// Strings made of allowed characters only: random ones and tricky pieces.
fn allowed_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        any::<char>()
            .prop_filter("allowed in XML 1.0", |&character| is_xml_character(
                character
            ))
            .prop_map(String::from),
        tricky_piece().prop_map(str::to_owned),
    ];
    vec(piece, 0..8).prop_map(|pieces| pieces.concat())
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z]{1,6}",
        Just(String::new()),
        Just("xmlns".to_owned()),
        vec(tricky_piece(), 1..5).prop_map(|pieces| pieces.concat()),
        allowed_text(),
    ]
}

/// JSON number text, from small integers to more digits than any float has.
fn number() -> impl Strategy<Value = Value> {
    r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,12})?([eE][+-]?[0-9]{1,3})?"
        .prop_map(|text| serde_json::from_str(&text).expect("JSON number text parses"))
}

fn scalar(text: BoxedStrategy<String>) -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text.prop_map(Value::String),
    ]
}

fn value(text: BoxedStrategy<String>, keys: BoxedStrategy<String>) -> impl Strategy<Value = Value> {
    scalar(text).prop_recursive(3, 24, 4, move |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((keys.clone(), inner), 0..4)
                .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

fn record_fields() -> impl Strategy<Value = Map<String, Value>> {
    vec((key(), value(allowed_text().boxed(), key().boxed())), 0..6)
        .prop_map(|fields| fields.into_iter().collect())
}

/// Text that sometimes holds a character XML 1.0 forbids.
fn text_maybe_forbidden() -> impl Strategy<Value = String> {
    let forbidden = prop::sample::select(vec![
        '\u{0}', '\u{1}', '\u{8}', '\u{B}', '\u{C}', '\u{1F}', '\u{FFFE}', '\u{FFFF}',
    ]);
    let piece = prop_oneof![8 => allowed_text(), 1 => forbidden.prop_map(String::from)];
    vec(piece, 0..3).prop_map(|pieces| pieces.concat())
}

/// The text of an element that must hold text only.
fn text_of(element: Node<'_, '_>) -> String {
    assert!(
        element.children().all(|child| child.is_text()),
        "{:?} holds text only",
        element.tag_name()
    );
    element.text().unwrap_or("").to_owned()
}

fn assert_in_namespace(element: Node<'_, '_>, namespace: Option<&str>) {
    assert_eq!(
        element.tag_name().namespace(),
        namespace,
        "{:?}",
        element.tag_name()
    );
}

/// The element holds `value` as the mapping says.
fn assert_value(element: Node<'_, '_>, value: &Value, namespace: Option<&str>) {
    assert_in_namespace(element, namespace);
    let nil = element.attribute((XML_SCHEMA_INSTANCE_NAMESPACE, "nil"));
    assert_eq!(nil.is_some(), value.is_null(), "xsi:nil only for null");
    match value {
        Value::Null => {
            assert_eq!(nil, Some("true"));
            assert_eq!(element.children().count(), 0);
        }
        Value::Bool(flag) => assert_eq!(text_of(element), flag.to_string()),
        Value::Number(number) => assert_eq!(text_of(element), number.as_str()),
        Value::String(text) => assert_eq!(&text_of(element), text),
        Value::Object(fields) => assert_children(element, fields, &BTreeSet::new(), namespace),
        Value::Array(items) => {
            assert!(element.children().all(|child| child.is_element()));
            let children: Vec<_> = element.children().collect();
            assert_eq!(children.len(), items.len());
            for (child, item) in children.into_iter().zip(items) {
                assert_eq!(child.tag_name().name(), NESTED_ARRAY_ITEM_ELEMENT);
                assert_value(child, item, namespace);
            }
        }
    }
}

/// The element's attributes and children are exactly the fields: scalar
/// `attribute_keys` fields as attributes (null ones absent), the others as
/// child elements, arrays repeated, all in order, names decoding to keys.
fn assert_children(
    element: Node<'_, '_>,
    fields: &Map<String, Value>,
    attribute_keys: &BTreeSet<String>,
    namespace: Option<&str>,
) {
    let is_attribute = |key: &String, value: &Value| {
        attribute_keys.contains(key) && !matches!(value, Value::Array(_) | Value::Object(_))
    };
    let expected_attributes: Vec<(String, String)> = fields
        .iter()
        .filter(|(key, value)| is_attribute(key, value))
        .filter_map(|(key, value)| {
            let text = match value {
                Value::String(text) => text.clone(),
                Value::Number(number) => number.as_str().to_owned(),
                Value::Bool(flag) => flag.to_string(),
                _ => return None,
            };
            Some((key.clone(), text))
        })
        .collect();
    let attributes: Vec<(String, String)> = element
        .attributes()
        .filter(|attribute| attribute.namespace() != Some(XML_SCHEMA_INSTANCE_NAMESPACE))
        .map(|attribute| {
            (
                decode_name(attribute.name()).into_owned(),
                attribute.value().to_owned(),
            )
        })
        .collect();
    assert_eq!(attributes, expected_attributes);

    let expected_children: Vec<(&String, &Value)> = fields
        .iter()
        .filter(|(key, value)| !is_attribute(key, value))
        .flat_map(|(key, value)| match value {
            Value::Array(items) => items.iter().map(|item| (key, item)).collect(),
            _ => vec![(key, value)],
        })
        .collect();
    assert!(
        element.children().all(|child| child.is_element()),
        "no text between fields"
    );
    let children: Vec<_> = element.children().collect();
    assert_eq!(children.len(), expected_children.len());
    for (child, (key, value)) in children.into_iter().zip(expected_children) {
        assert_eq!(&decode_name(child.tag_name().name()), key);
        assert_value(child, value, namespace);
    }
}

fn render_document(renderer: &DocumentRenderer, records: &[Value], first_offset: i64) -> String {
    let mut out = Vec::new();
    renderer.start(&mut out, "stream-1", 2, first_offset);
    for record in records {
        renderer
            .record(&mut out, record)
            .expect("allowed characters render");
    }
    let records_count = records.len() as u64;
    renderer.finish(
        &mut out,
        &Summary {
            records: records_count,
            first_offset,
            last_offset: first_offset + records.len() as i64 - 1,
            report_id: "stream-1~2-99",
        },
    );
    String::from_utf8(out).expect("documents are UTF-8")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn documents_parse_and_round_trip(
        records in vec(record_fields(), 0..5),
        attribute_choices in vec(any::<bool>(), 6),
        with_namespace in any::<bool>(),
        first_offset in 0..i64::MAX / 2,
    ) {
        // Some top-level keys of the first record become attribute fields.
        let attribute_keys: BTreeSet<String> = records
            .first()
            .map(|fields| {
                fields.keys().zip(&attribute_choices).filter(|(_, chosen)| **chosen).map(|(key, _)| key.clone()).collect()
            })
            .unwrap_or_default();
        let definition = Definition {
            namespace: with_namespace.then(|| NAMESPACE.to_owned()),
            attributes: attribute_keys.clone(),
            ..Definition::default()
        };
        let namespace = definition.namespace.as_deref();
        let records: Vec<Value> = records.into_iter().map(Value::Object).collect();
        let text = render_document(&DocumentRenderer::new(&definition), &records, first_offset);

        let document = roxmltree::Document::parse(&text)
            .unwrap_or_else(|error| panic!("not well-formed: {error}\n{text}"));
        let root = document.root_element();
        assert_in_namespace(root, namespace);
        prop_assert_eq!(root.tag_name().name(), "report");
        prop_assert_eq!(root.attribute("stream"), Some("stream-1"));
        prop_assert_eq!(root.attribute("partition"), Some("2"));
        let first_offset_text = first_offset.to_string();
        prop_assert_eq!(root.attribute("first-offset"), Some(first_offset_text.as_str()));

        let elements: Vec<_> = root.children().filter(|child| child.is_element()).collect();
        prop_assert_eq!(elements.len(), records.len() + 1);
        for (element, record) in elements.iter().zip(&records) {
            prop_assert_eq!(element.tag_name().name(), "record");
            assert_in_namespace(*element, namespace);
            let Value::Object(fields) = record else { unreachable!("records are objects") };
            assert_children(*element, fields, &attribute_keys, namespace);
        }
        let summary = elements.last().expect("the summary closes the document");
        prop_assert_eq!(summary.tag_name().name(), "summary");
        let count_text = records.len().to_string();
        prop_assert_eq!(summary.attribute("records"), Some(count_text.as_str()));
        prop_assert_eq!(summary.attribute("first-offset"), Some(first_offset_text.as_str()));
        let last_offset_text = (first_offset + records.len() as i64 - 1).to_string();
        prop_assert_eq!(summary.attribute("last-offset"), Some(last_offset_text.as_str()));
        prop_assert_eq!(summary.attribute("report-id"), Some("stream-1~2-99"));
    }

    #[test]
    fn check_record_accepts_exactly_what_renders(
        fields in vec((text_maybe_forbidden(), value(text_maybe_forbidden().boxed(), text_maybe_forbidden().boxed())), 0..5),
    ) {
        let record = Value::Object(fields.into_iter().collect());
        let renderer = DocumentRenderer::new(&Definition::default());
        let mut out = b"before".to_vec();
        let rendered = renderer.record(&mut out, &record);
        prop_assert_eq!(&rendered, &check_record(&record));
        match rendered {
            Ok(()) => {
                let element = String::from_utf8(out[b"before".len()..].to_vec()).expect("UTF-8");
                let text = format!("<r xmlns:xsi=\"{XML_SCHEMA_INSTANCE_NAMESPACE}\">{element}</r>");
                prop_assert!(roxmltree::Document::parse(&text).is_ok(), "not well-formed: {}", text);
            }
            Err(RenderError::ForbiddenCharacter(found)) => {
                prop_assert_eq!(out, b"before".to_vec());
                prop_assert!(!is_xml_character(found.character));
            }
            Err(other) => prop_assert!(false, "unexpected {:?}", other),
        }
    }

    #[test]
    fn name_encoding_is_exact_and_gives_xml_names(name in prop_oneof![key(), any::<String>()]) {
        let encoded = encode_name(&name);
        prop_assert!(is_xml_name(&encoded), "{:?} -> {:?}", name, encoded);
        prop_assert_eq!(decode_name(&encoded), name.as_str());
        let kept = is_xml_name(&name) && !name.contains("_x") && name != "xmlns";
        if kept {
            prop_assert_eq!(encoded.as_ref(), name.as_str());
        }
    }
}

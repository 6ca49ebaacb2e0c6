//! A record's fields rendered straight from its JSON text, for the worker's
//! hot path.
//!
//! [`crate::DocumentRenderer::record`] takes a parsed `serde_json::Value`:
//! a tree with an allocation per key, per string and per number, built for
//! each record only to be walked once and dropped. [`render_fields`] walks
//! the text instead, writing each element as the parser reaches it, with
//! keys and strings borrowed from the text where they hold no escape.
//!
//! It writes exactly what the tree walk writes for a definition without
//! attributes or renames, and it only answers for records it can vouch for:
//! an object, parsed whole, with no key named twice in any object (the
//! tree keeps the first position and the last value of such a key), no
//! character XML 1.0 forbids, not near the depth limit, and no `$` in the
//! text (so serde_json's private number key cannot be spelled by a
//! producer). For anything else it writes nothing and returns `false`, and
//! the caller takes the tree walk, which renders it or says why not.

use std::borrow::Cow;
use std::fmt;
use std::io::Write as _;
use std::ops::Range;

use quick_xml::escape::partial_escape;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::check::{MAX_NESTING_DEPTH, first_forbidden_character};
use crate::keys::{Key, KeySet};
use crate::names::write_encoded_name;
use crate::render::NESTED_ARRAY_ITEM_ELEMENT;

/// serde_json's `arbitrary_precision` hands a number to a visitor as a map
/// of one entry under this key, its value the number's text.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Appends the elements of the fields of the JSON object `text` to `out`,
/// as [`crate::DocumentRenderer::record`] writes them between the record's
/// start and end tags when the definition names no attribute and no
/// rename. Returns `false`, with `out` unchanged, for a record it does not
/// vouch for (see the module docs): render that one from its parsed value.
pub fn render_fields(out: &mut Vec<u8>, text: &[u8]) -> bool {
    let starts_as_object = text
        .iter()
        .find(|byte| !byte.is_ascii_whitespace())
        .is_some_and(|&byte| byte == b'{');
    if !starts_as_object || text.contains(&b'$') {
        return false;
    }
    let start = out.len();
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    let rendered = matches!(
        de::Deserializer::deserialize_map(&mut deserializer, Fields { out, depth: 1 }),
        Ok(true)
    ) && deserializer.end().is_ok();
    if !rendered {
        out.truncate(start);
    }
    rendered
}

/// Whether a container `depth` levels down stays clear of the depth limit
/// (with room: the tree walk's own count decides near it).
fn within_depth(depth: usize) -> bool {
    depth + 4 < MAX_NESTING_DEPTH
}

/// The fields of an object `depth` levels down: one field's elements per
/// key, in the text's order.
struct Fields<'out> {
    out: &'out mut Vec<u8>,
    depth: usize,
}

impl<'de> Visitor<'de> for Fields<'_> {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, fields: A) -> Result<bool, A::Error> {
        write_fields(self.out, self.depth, fields, None)
    }
}

/// Writes each field of `fields` (the first key already read when the map
/// turned out to be an object, not a number).
fn write_fields<'de, A: MapAccess<'de>>(
    out: &mut Vec<u8>,
    depth: usize,
    mut fields: A,
    first: Option<Cow<'de, str>>,
) -> Result<bool, A::Error> {
    if !within_depth(depth) {
        return Ok(false);
    }
    let mut keys = KeySet::default();
    let mut next = first;
    loop {
        let key = match next.take() {
            Some(key) => key,
            None => match fields.next_key_seed(Key)? {
                Some(key) => key,
                None => return Ok(true),
            },
        };
        if first_forbidden_character(&key).is_some() {
            return Ok(false);
        }
        let value = fields.next_value_seed(Field {
            out: &mut *out,
            name: Name::Key(&key),
            depth,
        })?;
        if !value {
            return Ok(false);
        }
        if keys.repeats(key) {
            return Ok(false);
        }
    }
}

/// An element's name: a record key, encoded as it is written, or `item`.
#[derive(Clone, Copy)]
enum Name<'a> {
    Key(&'a str),
    Item,
}

impl Name<'_> {
    fn write(self, out: &mut Vec<u8>) -> Range<usize> {
        let start = out.len();
        match self {
            Name::Key(key) => write_encoded_name(out, key),
            Name::Item => out.extend_from_slice(NESTED_ARRAY_ITEM_ELEMENT.as_bytes()),
        }
        start..out.len()
    }
}

/// A field's value: one element, or one per item of an array (none for an
/// empty one).
struct Field<'out, 'name> {
    out: &'out mut Vec<u8>,
    name: Name<'name>,
    depth: usize,
}

/// One element holding a value; an array becomes one element of `item`
/// children.
struct Element<'out, 'name> {
    out: &'out mut Vec<u8>,
    name: Name<'name>,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Field<'_, '_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> DeserializeSeed<'de> for Element<'_, '_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'out, 'name> Field<'out, 'name> {
    fn element(self) -> Element<'out, 'name> {
        Element {
            out: self.out,
            name: self.name,
            depth: self.depth,
        }
    }
}

/// Everything but an array is one element; the visits forward to it.
impl<'de> Visitor<'de> for Field<'_, '_> {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, flag: bool) -> Result<bool, E> {
        self.element().visit_bool(flag)
    }
    fn visit_i64<E: de::Error>(self, number: i64) -> Result<bool, E> {
        self.element().visit_i64(number)
    }
    fn visit_u64<E: de::Error>(self, number: u64) -> Result<bool, E> {
        self.element().visit_u64(number)
    }
    fn visit_f64<E: de::Error>(self, number: f64) -> Result<bool, E> {
        self.element().visit_f64(number)
    }
    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        self.element().visit_unit()
    }
    fn visit_str<E: de::Error>(self, text: &str) -> Result<bool, E> {
        self.element().visit_str(text)
    }
    fn visit_map<A: MapAccess<'de>>(self, fields: A) -> Result<bool, A::Error> {
        self.element().visit_map(fields)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<bool, A::Error> {
        if !within_depth(self.depth + 1) {
            return Ok(false);
        }
        loop {
            let item = items.next_element_seed(Element {
                out: &mut *self.out,
                name: self.name,
                depth: self.depth + 1,
            })?;
            match item {
                None => return Ok(true),
                Some(false) => return Ok(false),
                Some(true) => {}
            }
        }
    }
}

impl Element<'_, '_> {
    /// `<name>` then `text` (already escaped) then `</name>`, or `<name/>`
    /// when `text` is empty.
    fn scalar(self, text: &str) -> bool {
        self.scalar_with(|out| out.extend_from_slice(text.as_bytes()))
    }

    /// [`scalar`](Self::scalar) with the text written by `content`.
    fn scalar_with(self, content: impl FnOnce(&mut Vec<u8>)) -> bool {
        self.out.push(b'<');
        let name = self.name.write(self.out);
        self.out.push(b'>');
        let content_start = self.out.len();
        content(self.out);
        end_container(self.out, name, content_start);
        true
    }
}

/// `</name>`, the name copied from where the start tag wrote it.
fn close(out: &mut Vec<u8>, name: Range<usize>) {
    out.extend_from_slice(b"</");
    out.extend_from_within(name);
    out.push(b'>');
}

impl<'de> Visitor<'de> for Element<'_, '_> {
    type Value = bool;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, flag: bool) -> Result<bool, E> {
        Ok(self.scalar(if flag { "true" } else { "false" }))
    }
    // Under `arbitrary_precision` an integer that fits 64 bits arrives as
    // one, and the tree keeps it as its decimal text: JSON integers have
    // no leading zero or `+`, so that is the text as sent. Every other
    // number arrives as a map (below). A float never arrives as `f64`.
    fn visit_i64<E>(self, number: i64) -> Result<bool, E> {
        Ok(self.scalar_with(|out| {
            let written = write!(out, "{number}");
            debug_assert!(written.is_ok(), "writing to a Vec cannot fail");
        }))
    }
    fn visit_u64<E>(self, number: u64) -> Result<bool, E> {
        Ok(self.scalar_with(|out| {
            let written = write!(out, "{number}");
            debug_assert!(written.is_ok(), "writing to a Vec cannot fail");
        }))
    }
    fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E>(self) -> Result<bool, E> {
        self.out.push(b'<');
        self.name.write(self.out);
        self.out.extend_from_slice(b" xsi:nil=\"true\"/>");
        Ok(true)
    }
    fn visit_str<E>(self, text: &str) -> Result<bool, E> {
        if first_forbidden_character(text).is_some() {
            return Ok(false);
        }
        Ok(self.scalar(&partial_escape(text)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<bool, A::Error> {
        if !within_depth(self.depth + 1) {
            return Ok(false);
        }
        self.out.push(b'<');
        let name = self.name.write(self.out);
        self.out.push(b'>');
        let content_start = self.out.len();
        loop {
            let item = items.next_element_seed(Element {
                out: &mut *self.out,
                name: Name::Item,
                depth: self.depth + 1,
            })?;
            match item {
                None => break,
                Some(false) => return Ok(false),
                Some(true) => {}
            }
        }
        end_container(self.out, name, content_start);
        Ok(true)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<bool, A::Error> {
        let first = fields.next_key_seed(Key)?;
        if first.as_deref() == Some(NUMBER_TOKEN) {
            // A number: its text as the parser kept it (every digit as
            // sent; nothing in it needs escaping).
            let text: Cow<'de, str> = fields.next_value_seed(Key)?;
            return Ok(self.scalar(&text));
        }
        self.out.push(b'<');
        let name = self.name.write(self.out);
        self.out.push(b'>');
        let content_start = self.out.len();
        if first.is_some() && !write_fields(self.out, self.depth + 1, fields, first)? {
            return Ok(false);
        }
        end_container(self.out, name, content_start);
        Ok(true)
    }
}

/// Ends an element whose children were written from `content_start`:
/// `<name>` becomes `<name/>` when there were none.
fn end_container(out: &mut Vec<u8>, name: Range<usize>, content_start: usize) {
    if out.len() == content_start {
        out.pop();
        out.extend_from_slice(b"/>");
    } else {
        close(out, name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DocumentRenderer;
    use quire_messages::Definition;

    /// The tree walk's rendering of `text`, if it renders.
    fn through_the_tree(renderer: &DocumentRenderer, text: &str) -> Option<Vec<u8>> {
        let value: serde_json::Value = serde_json::from_str(text).ok()?;
        let mut out = Vec::new();
        renderer.record(&mut out, &value).ok()?;
        Some(out)
    }

    fn corpus() -> Vec<String> {
        let mut texts: Vec<String> = [
            r#"{}"#,
            r#"{"a":1,"b":"two","c":[true,false,null],"d":{"e":1.50}}"#,
            r#"{"n":1.10,"m":123456789012345678901234567890,"e":1E400,"z":-0,"f":-1.5e-7,"g":0.0}"#,
            r#"{"text":"tab\there, line\nthere, \"quoted\" <&> ' \u00e9 \ud83d\ude00 ]]>"}"#,
            r#"{"empty":"","none":null,"list":[],"object":{},"nested":[[],[[1]],[{}],[null]]}"#,
            r#"{"first name":"x","1st":2,"a:b":3,"xmlthing":4,"é":5,"":6,"a\u0020b":7}"#,
            r#"{"items":[{"sku":"a","qty":1},{"sku":"b","qty":2,"tags":["x","y"]}]}"#,
            r#"{"deep":{"a":{"b":{"c":{"d":[1,[2,[3,[4]]]]}}}}}"#,
            r#"{"only":[[]]}"#,
            r#"{"a":[{"b":[]}]}"#,
            "{\"spaced\" : [ 1 , 2 ] ,\n \"x\" : { } }",
            r#"{"a":"\u0000"}"#,
            r#"{"\u0001":1}"#,
            r#"{"a":"\ud800"}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"a":{"b":1,"b":2}}"#,
            r#"{"$serde_json::private::Number":"1"}"#,
            r#"{"price":"$5"}"#,
            r#"[1,2]"#,
            r#""string""#,
            r#"{"a":1} trailing"#,
            r#"{"a":1"#,
            "{\"a\":\"\u{FFFE}\"}",
        ]
        .iter()
        .map(|text| (*text).to_owned())
        .collect();
        let many: String = (0..40)
            .map(|index| format!("\"k{index}\":{index}"))
            .collect::<Vec<_>>()
            .join(",");
        texts.push(format!("{{{many}}}"));
        texts.push(format!("{{{many},\"k33\":0}}"));
        for depth in [1, 60, 120, 123, 124, 125, 126, 127, 128, 129] {
            let open = "{\"b\":".repeat(depth);
            texts.push(format!("{{\"a\":{open}1{}}}", "}".repeat(depth)));
            texts.push(format!(
                "{{\"a\":{}1{}}}",
                "[".repeat(depth),
                "]".repeat(depth)
            ));
        }
        texts
    }

    #[test]
    fn what_it_renders_is_byte_for_byte_what_the_tree_walk_renders() {
        let definition: Definition = serde_json::from_str("{}").unwrap();
        let renderer = DocumentRenderer::new(&definition);
        assert!(renderer.renders_fields_verbatim());
        let mut vouched = 0;
        for text in corpus() {
            let mut fields = b"kept".to_vec();
            let rendered = render_fields(&mut fields, text.as_bytes());
            let tree = through_the_tree(&renderer, &text);
            if !rendered {
                assert_eq!(fields, b"kept", "nothing written for {text:.60}");
                continue;
            }
            vouched += 1;
            let mut wrapped = Vec::new();
            renderer.record_of_fields(&mut wrapped, &fields[4..]);
            assert_eq!(
                Some(String::from_utf8(wrapped).unwrap()),
                tree.map(|tree| String::from_utf8(tree).unwrap()),
                "{text:.80}"
            );
        }
        assert!(
            vouched >= 12,
            "the fast path vouched for only {vouched} records"
        );
    }

    /// A small xorshift generator: the same records on every run.
    struct Random(u64);

    impl Random {
        fn below(&mut self, bound: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % bound
        }

        fn pick<'a>(&mut self, choices: &[&'a str]) -> &'a str {
            choices[self.below(choices.len() as u64) as usize]
        }

        fn value(&mut self, depth: usize) -> String {
            let scalar_only = depth > 4;
            match self.below(if scalar_only { 5 } else { 7 }) {
                0 => self
                    .pick(&[
                        "0",
                        "-0",
                        "7",
                        "-12",
                        "1.10",
                        "1E400",
                        "-2.5e-3",
                        "18446744073709551616",
                        "9223372036854775807",
                        "-9223372036854775809",
                        "0.000",
                    ])
                    .to_owned(),
                1 => self
                    .pick(&[
                        r#""""#,
                        r#""plain""#,
                        r#""<&>'\"""#,
                        r#""tab\tline\n""#,
                        r#""\u00e9\ud83d\ude00""#,
                        r#""]]>""#,
                        r#""\u0007""#,
                        r#""a\/b""#,
                    ])
                    .to_owned(),
                2 => self.pick(&["true", "false"]).to_owned(),
                3 => "null".to_owned(),
                4 => self.pick(&["1", r#""x""#]).to_owned(),
                5 => {
                    let items: Vec<String> =
                        (0..self.below(4)).map(|_| self.value(depth + 1)).collect();
                    format!("[{}]", items.join(","))
                }
                _ => self.object(depth + 1),
            }
        }

        fn object(&mut self, depth: usize) -> String {
            let fields: Vec<String> = (0..self.below(5))
                .map(|_| {
                    let key = self.pick(&[
                        "a",
                        "b",
                        "first name",
                        "1st",
                        "é",
                        "",
                        "x:y",
                        "xmlns",
                        "item",
                        r"\u0062",
                        r"k\u0001",
                    ]);
                    format!("\"{key}\":{}", self.value(depth))
                })
                .collect();
            format!("{{{}}}", fields.join(","))
        }
    }

    #[test]
    fn random_records_render_as_the_tree_walk_renders_them() {
        for definition in [r#"{}"#, r#"{"indent": 2}"#] {
            random_records_render_alike(definition);
        }
    }

    fn random_records_render_alike(definition: &str) {
        let definition: Definition = serde_json::from_str(definition).unwrap();
        let renderer = DocumentRenderer::new(&definition);
        let mut random = Random(0x9E37_79B9_7F4A_7C15);
        let (mut vouched, total) = (0, 5000);
        for _ in 0..total {
            let text = random.object(1);
            let mut fields = Vec::new();
            if !render_fields(&mut fields, text.as_bytes()) {
                continue;
            }
            vouched += 1;
            let mut wrapped = Vec::new();
            renderer.record_of_fields(&mut wrapped, &fields);
            assert_eq!(
                Some(String::from_utf8(wrapped).unwrap()),
                through_the_tree(&renderer, &text).map(|tree| String::from_utf8(tree).unwrap()),
                "{text}"
            );
        }
        assert!(vouched > total / 3, "vouched for {vouched} of {total}");
    }

    #[test]
    fn it_vouches_for_the_records_producers_send() {
        for text in [
            r#"{"stream":"bench-3","seq":12,"payload":"xxxxxxxxxxxxxxxx"}"#,
            r#"{"id":7,"amount":12.50,"ok":true,"tags":["a","b"],"customer":{"name":"Zoë"}}"#,
            r#"{"text":"record 1 of s <&> \"quoted\""}"#,
        ] {
            assert!(render_fields(&mut Vec::new(), text.as_bytes()), "{text}");
        }
    }
}

//! A typed definition's record content, in its canonical order: declared
//! fields in declaration order (nested objects' too), then the undeclared
//! ones inside [`UNDECLARED_ELEMENT`] when the definition keeps them. So a
//! record's element is the same whatever order its JSON keys came in, and
//! its schema can be an `xs:sequence`.

use quire_messages::fields::{Field, FieldKind, UNDECLARED_ELEMENT};
use serde_json::{Map, Value};

use super::{ElementName, write_element_name, write_field};

/// A top-level field's placement: `None` when it went into the record's
/// start tag as an attribute, else its element name (`None` for the field's
/// own name).
pub(super) type TopLevelName<'a> = &'a dyn Fn(&str, &Value) -> Option<Option<String>>;

/// Writes `object`'s fields as `fields` order them; `top_level_name`
/// gives a top-level field's element name (its rename) and says whether it
/// went into the start tag as an attribute (then it is skipped here).
pub(super) fn write_declared_fields(
    out: &mut Vec<u8>,
    fields: &[Field],
    keep_undeclared: bool,
    object: &Map<String, Value>,
    top_level_name: Option<TopLevelName<'_>>,
) {
    for field in fields {
        let Some(value) = object.get(&field.name) else {
            continue;
        };
        let name = match top_level_name {
            Some(lookup) => match lookup(&field.name, value) {
                // Written as an attribute.
                None => continue,
                Some(name) => name,
            },
            None => None,
        };
        let element = ElementName::Verbatim(name.as_deref().unwrap_or(&field.name));
        match (field.kind, value) {
            (FieldKind::Object, Value::Object(nested)) => {
                write_object(out, element, field, keep_undeclared, nested);
            }
            (FieldKind::Object, Value::Array(items)) => {
                for item in items {
                    match item {
                        Value::Object(nested) => {
                            write_object(out, element, field, keep_undeclared, nested);
                        }
                        other => write_field(out, element, other),
                    }
                }
            }
            _ => write_field(out, element, value),
        }
    }
    if keep_undeclared {
        let mut undeclared = object
            .iter()
            .filter(|(key, _)| !fields.iter().any(|field| &field.name == *key))
            .peekable();
        if undeclared.peek().is_some() {
            out.push(b'<');
            out.extend_from_slice(UNDECLARED_ELEMENT.as_bytes());
            out.push(b'>');
            for (key, value) in undeclared {
                write_field(out, ElementName::FieldKey(key), value);
            }
            out.extend_from_slice(b"</");
            out.extend_from_slice(UNDECLARED_ELEMENT.as_bytes());
            out.push(b'>');
        }
    }
}

fn write_object(
    out: &mut Vec<u8>,
    element: ElementName<'_>,
    field: &Field,
    keep_undeclared: bool,
    nested: &Map<String, Value>,
) {
    out.push(b'<');
    let name = write_element_name(out, element);
    out.push(b'>');
    let content_start = out.len();
    write_declared_fields(out, &field.fields, keep_undeclared, nested, None);
    if out.len() == content_start {
        out.pop();
        out.extend_from_slice(b"/>");
    } else {
        out.extend_from_slice(b"</");
        out.extend_from_within(name);
        out.push(b'>');
    }
}

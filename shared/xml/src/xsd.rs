//! The XML Schema (XSD 1.0) of a typed definition's documents: generated
//! from the definition alone, so the same definition gives the same bytes,
//! and a document points to it by a name derived from those bytes.
//!
//! What it says is what the renderer writes for records that pass
//! [`crate::TypedCheck`]: the root with its stream, partition and first
//! offset; the records, each with its declared fields in declaration order
//! (optional ones `minOccurs="0"` and nillable, repeated ones
//! `maxOccurs="unbounded"`, attribute fields as typed attributes), then the
//! kept undeclared fields inside [`UNDECLARED_ELEMENT`] as anything at all;
//! and the summary with its totals. With a namespace and no prefix every
//! element is in it (`elementFormDefault="qualified"`); with a prefix the
//! root, record, summary and total elements are in it and the fields'
//! elements in none, as the document writes them.

use std::fmt::Write as _;

use quick_xml::escape::escape;
use quire_messages::fields::{Field, FieldKind, UNDECLARED_ELEMENT};
use quire_messages::header::{HeaderSpec, HeaderType, HeaderValue};
use quire_messages::{Definition, SUMMARY_ELEMENT};
use sha2::{Digest, Sha256};

use crate::MAX_DIGITS;

/// The element of one total inside the summary.
pub const TOTAL_ELEMENT: &str = "total";

/// The schema of `definition`'s documents.
pub fn schema_for(definition: &Definition) -> String {
    let mut out = String::with_capacity(4096);
    out.push_str("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    out.push_str("<xs:schema xmlns:xs=\"http://www.w3.org/2001/XMLSchema\"");
    if let Some(namespace) = &definition.namespace {
        let _ = write!(out, " targetNamespace=\"{}\"", escape(namespace.as_str()));
        if definition.prefix.is_none() {
            out.push_str(" elementFormDefault=\"qualified\"");
        }
    }
    out.push_str(">\n");
    // Elements of the document's own shape: qualified even with a prefix.
    let form = if definition.prefix.is_some() {
        " form=\"qualified\""
    } else {
        ""
    };
    let _ = writeln!(out, "  <xs:element name=\"{}\">", definition.root);
    out.push_str("    <xs:complexType>\n      <xs:sequence>\n");
    if let Some(header) = &definition.header {
        write_header(&mut out, header, form);
    }
    let _ = writeln!(
        out,
        "        <xs:element name=\"{}\"{form} minOccurs=\"0\" maxOccurs=\"unbounded\">",
        definition.record
    );
    write_record_type(&mut out, definition, 10);
    out.push_str("        </xs:element>\n");
    let _ = writeln!(out, "        <xs:element name=\"{SUMMARY_ELEMENT}\"{form}>");
    write_summary_type(&mut out, form);
    out.push_str("        </xs:element>\n");
    out.push_str("      </xs:sequence>\n");
    out.push_str("      <xs:attribute name=\"stream\" type=\"xs:string\" use=\"required\"/>\n");
    out.push_str("      <xs:attribute name=\"partition\" type=\"xs:int\" use=\"required\"/>\n");
    out.push_str("      <xs:attribute name=\"first-offset\" type=\"xs:long\" use=\"required\"/>\n");
    out.push_str("    </xs:complexType>\n  </xs:element>\n</xs:schema>\n");
    out
}

/// The file name a document's `xsi:schemaLocation` names: the first 16
/// hex digits of the schema's SHA-256, so a changed definition gets a new
/// name and an unchanged one keeps its name.
pub fn schema_file_name(schema: &str) -> String {
    let digest = Sha256::digest(schema.as_bytes());
    format!("{}.xsd", hex::encode(&digest[..8]))
}

/// Whether `file` is a name [`schema_file_name`] gives (16 lowercase hex
/// digits and `.xsd`): what the API lets a path name.
pub fn is_schema_file_name(file: &str) -> bool {
    file.strip_suffix(".xsd").is_some_and(|digits| {
        digits.len() == 16
            && digits
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
    })
}

fn write_record_type(out: &mut String, definition: &Definition, indent: usize) {
    let pad = " ".repeat(indent);
    if !definition.is_typed() {
        // An untyped definition: any content, any attributes.
        let _ = writeln!(out, "{pad}<xs:complexType mixed=\"true\">");
        let _ = writeln!(
            out,
            "{pad}  <xs:sequence><xs:any processContents=\"skip\" minOccurs=\"0\" maxOccurs=\"unbounded\"/></xs:sequence>"
        );
        let _ = writeln!(out, "{pad}  <xs:anyAttribute processContents=\"skip\"/>");
        let _ = writeln!(out, "{pad}</xs:complexType>");
        return;
    }
    let is_attribute = |field: &Field| definition.attributes.contains(&field.name);
    let xml_name = |field: &Field| {
        definition
            .renames
            .get(&field.name)
            .cloned()
            .unwrap_or_else(|| field.name.clone())
    };
    let elements: Vec<(String, &Field)> = definition
        .fields
        .iter()
        .filter(|field| !is_attribute(field))
        .map(|field| (xml_name(field), field))
        .collect();
    let _ = writeln!(out, "{pad}<xs:complexType>");
    write_sequence(out, &elements, definition.undeclared.is_keep(), indent + 2);
    for field in definition.fields.iter().filter(|field| is_attribute(field)) {
        let use_ = if field.required {
            "required"
        } else {
            "optional"
        };
        let _ = write!(
            out,
            "{pad}  <xs:attribute name=\"{}\" use=\"{use_}\"",
            xml_name(field)
        );
        write_simple_type(out, field, indent + 2, "xs:attribute");
    }
    let _ = writeln!(out, "{pad}</xs:complexType>");
}

/// `<xs:sequence>` of `elements` in order, then the undeclared ones.
fn write_sequence(out: &mut String, elements: &[(String, &Field)], keep: bool, indent: usize) {
    let pad = " ".repeat(indent);
    let _ = writeln!(out, "{pad}<xs:sequence>");
    for (name, field) in elements {
        let min = if field.required { "1" } else { "0" };
        let max = if field.repeated { "unbounded" } else { "1" };
        let nillable = if field.required {
            ""
        } else {
            " nillable=\"true\""
        };
        let _ = write!(
            out,
            "{pad}  <xs:element name=\"{name}\" minOccurs=\"{min}\" maxOccurs=\"{max}\"{nillable}"
        );
        if field.kind == FieldKind::Object {
            out.push_str(">\n");
            let _ = writeln!(out, "{pad}    <xs:complexType>");
            let nested: Vec<(String, &Field)> = field
                .fields
                .iter()
                .map(|nested| (nested.name.clone(), nested))
                .collect();
            write_sequence(out, &nested, keep, indent + 6);
            let _ = writeln!(out, "{pad}    </xs:complexType>");
            let _ = writeln!(out, "{pad}  </xs:element>");
        } else {
            write_simple_type(out, field, indent + 2, "xs:element");
        }
    }
    if keep {
        let _ = writeln!(
            out,
            "{pad}  <xs:element name=\"{UNDECLARED_ELEMENT}\" minOccurs=\"0\"><xs:complexType mixed=\"true\"><xs:sequence><xs:any processContents=\"skip\" minOccurs=\"0\" maxOccurs=\"unbounded\"/></xs:sequence><xs:anyAttribute processContents=\"skip\"/></xs:complexType></xs:element>"
        );
    }
    let _ = writeln!(out, "{pad}</xs:sequence>");
}

/// Closes an open `<xs:element ...` or `<xs:attribute ...` with the
/// field's scalar type: ` type="xs:..."/>`, or an inline restriction
/// carrying its facets.
fn write_simple_type(out: &mut String, field: &Field, indent: usize, tag: &str) {
    let pad = " ".repeat(indent);
    let base = match field.kind {
        FieldKind::String => "xs:string",
        FieldKind::Integer => "xs:integer",
        FieldKind::Decimal => "xs:decimal",
        FieldKind::Boolean => "xs:boolean",
        FieldKind::Date => "xs:date",
        FieldKind::Datetime => "xs:dateTime",
        FieldKind::Object => unreachable!("objects are complex types"),
    };
    let mut facets = Vec::new();
    if field.kind.is_numeric() {
        facets.push(format!("<xs:totalDigits value=\"{MAX_DIGITS}\"/>"));
    }
    if let Some(limit) = field.max_length {
        facets.push(format!("<xs:maxLength value=\"{limit}\"/>"));
    }
    if let Some(pattern) = &field.pattern {
        facets.push(format!(
            "<xs:pattern value=\"{}\"/>",
            escape(pattern.as_str())
        ));
    }
    if let Some(scale) = field.scale {
        facets.push(format!("<xs:fractionDigits value=\"{scale}\"/>"));
    }
    if field.kind == FieldKind::Datetime {
        // XSD 1.0 has no explicitTimezone: the offset is required by pattern.
        facets.push("<xs:pattern value=\".+(Z|[+\\-]\\d{2}:\\d{2})\"/>".to_owned());
    }
    if facets.is_empty() {
        let _ = writeln!(out, " type=\"{base}\"/>");
        return;
    }
    let _ = writeln!(out, ">");
    let _ = writeln!(
        out,
        "{pad}  <xs:simpleType><xs:restriction base=\"{base}\">"
    );
    for facet in facets {
        let _ = writeln!(out, "{pad}    {facet}");
    }
    let _ = writeln!(out, "{pad}  </xs:restriction></xs:simpleType>");
    let _ = writeln!(out, "{pad}</{tag}>");
}

/// Exact decimal text of any size: not xs:decimal, which validators read
/// only to 18 digits (libxml2 to 24).
const DECIMAL_TEXT: &str = "<xs:simpleType><xs:restriction base=\"xs:string\"><xs:pattern value=\"-?[0-9]+(\\.[0-9]+)?\"/></xs:restriction></xs:simpleType>";

/// The header element: its declared children in order (those a document
/// may lack optional), then its totals.
fn write_header(out: &mut String, header: &HeaderSpec, form: &str) {
    let pad = " ".repeat(8);
    let _ = writeln!(out, "{pad}<xs:element name=\"{}\"{form}>", header.element);
    let _ = writeln!(out, "{pad}  <xs:complexType>");
    let _ = writeln!(out, "{pad}    <xs:sequence>");
    for field in &header.fields {
        let min = if field.value.is_some_and(HeaderValue::may_be_absent) {
            " minOccurs=\"0\""
        } else {
            ""
        };
        let _ = write!(out, "{pad}      <xs:element name=\"{}\"{min}", field.name);
        let type_ = match field.value.map(HeaderValue::header_type) {
            None | Some(HeaderType::String) => "xs:string",
            Some(HeaderType::Integer) => "xs:integer",
            Some(HeaderType::DateTime) => "xs:dateTime",
            Some(HeaderType::Decimal) => {
                let _ = writeln!(out, ">{DECIMAL_TEXT}</xs:element>");
                continue;
            }
        };
        let _ = writeln!(out, " type=\"{type_}\"/>");
    }
    if header.totals {
        write_total_element(out, form, 14);
    }
    let _ = writeln!(out, "{pad}    </xs:sequence>");
    let _ = writeln!(out, "{pad}  </xs:complexType>");
    let _ = writeln!(out, "{pad}</xs:element>");
}

fn write_summary_type(out: &mut String, form: &str) {
    let pad = " ".repeat(10);
    let _ = writeln!(out, "{pad}<xs:complexType>");
    let _ = writeln!(out, "{pad}  <xs:sequence>");
    write_total_element(out, form, 14);
    let _ = writeln!(out, "{pad}  </xs:sequence>");
    for (name, type_, use_) in [
        ("records", "xs:nonNegativeInteger", "required"),
        ("first-offset", "xs:long", "required"),
        ("last-offset", "xs:long", "required"),
        ("report-id", "xs:string", "required"),
        ("window-start", "xs:dateTime", "optional"),
        ("window-end", "xs:dateTime", "optional"),
        ("window-sequence", "xs:positiveInteger", "optional"),
    ] {
        let _ = writeln!(
            out,
            "{pad}  <xs:attribute name=\"{name}\" type=\"{type_}\" use=\"{use_}\"/>"
        );
    }
    let _ = writeln!(out, "{pad}</xs:complexType>");
}

/// The `total` element, as the summary and the header hold it.
fn write_total_element(out: &mut String, form: &str, indent: usize) {
    let pad = " ".repeat(indent - 4);
    let _ = writeln!(
        out,
        "{pad}    <xs:element name=\"{TOTAL_ELEMENT}\"{form} minOccurs=\"0\" maxOccurs=\"unbounded\"><xs:complexType>"
    );
    for (name, type_, use_) in [
        ("field", "xs:string", "required"),
        ("count", "xs:nonNegativeInteger", "required"),
    ] {
        let _ = writeln!(
            out,
            "{pad}      <xs:attribute name=\"{name}\" type=\"{type_}\" use=\"{use_}\"/>"
        );
    }
    // Sums are exact and of any size: decimal text, not xs:decimal, which
    // validators read only to 18 digits (libxml2 to 24).
    for (name, use_) in [
        ("sum", "required"),
        ("min", "optional"),
        ("max", "optional"),
    ] {
        let _ = writeln!(
            out,
            "{pad}      <xs:attribute name=\"{name}\" use=\"{use_}\"><xs:simpleType><xs:restriction base=\"xs:string\"><xs:pattern value=\"-?[0-9]+(\\.[0-9]+)?\"/></xs:restriction></xs:simpleType></xs:attribute>"
        );
    }
    let _ = writeln!(out, "{pad}    </xs:complexType></xs:element>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_schemas_get_are_the_names_paths_may_use() {
        let name = schema_file_name("<xs:schema/>");
        assert!(is_schema_file_name(&name), "{name}");
        for refused in [
            "",
            ".xsd",
            "0123456789abcdef",
            "0123456789ABCDEF.xsd",
            "0123456789abcde.xsd",
            "0123456789abcdef0.xsd",
            "../../definitions.xsd",
            "0123456789abcdeg.xsd",
        ] {
            assert!(!is_schema_file_name(refused), "{refused}");
        }
    }
}

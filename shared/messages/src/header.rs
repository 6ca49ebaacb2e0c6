//! A definition's header: one element written before the first record,
//! whose children a definition declares in order, each a value of the
//! document (its stream, report id, window, first and last log time, its
//! totals...) or a constant of the definition, as ISO 20022's group header
//! carries the number of transactions and their control sum ahead of them.
//!
//! What the header holds is known only when the document ends (its report
//! id is its cut's offset, its totals its last record's), so the writer
//! holds the document's first part until then (`quire_s3`'s
//! `MultipartWriter::hold_first_part`).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::definition::is_xml_name;

/// The most children a header may declare.
pub const MAX_HEADER_FIELDS: usize = 64;
/// The longest constant a header may carry, in bytes.
pub const MAX_HEADER_CONSTANT_BYTES: usize = 1024;

/// The header element and its children (see the module).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderSpec {
    /// The header element's name.
    #[serde(default = "default_element")]
    pub element: String,
    /// Its child elements, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<HeaderField>,
    /// Whether the header also holds the definition's totals, one
    /// `<total field count sum min max/>` each, as the summary does.
    #[serde(default, skip_serializing_if = "is_false")]
    pub totals: bool,
}

fn default_element() -> String {
    "header".to_owned()
}

fn is_false(flag: &bool) -> bool {
    !*flag
}

/// One child element of the header: `name` holding a document `value`
/// (`of` a totalled field for `count`, `sum`, `min`, `max`) or a
/// `constant`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderField {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<HeaderValue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constant: Option<String>,
}

/// A value of the document a header child can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderValue {
    Stream,
    ReportId,
    Partition,
    FirstOffset,
    LastOffset,
    Records,
    /// The log time of the document's first record (RFC 3339, in the
    /// window's zone for a windowed stream, else UTC); absent when the
    /// document holds no record.
    FirstLogTime,
    LastLogTime,
    WindowStart,
    WindowEnd,
    WindowSequence,
    /// Of a totalled field: how many records had a value.
    Count,
    /// Of a totalled field: the exact sum.
    Sum,
    /// Of a totalled field, as sent; absent while no value was counted.
    Min,
    Max,
}

/// The type a header value has in the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderType {
    String,
    Integer,
    Decimal,
    DateTime,
}

impl HeaderValue {
    pub fn header_type(self) -> HeaderType {
        match self {
            HeaderValue::Stream | HeaderValue::ReportId => HeaderType::String,
            HeaderValue::Partition
            | HeaderValue::FirstOffset
            | HeaderValue::LastOffset
            | HeaderValue::Records
            | HeaderValue::WindowSequence
            | HeaderValue::Count => HeaderType::Integer,
            HeaderValue::Sum | HeaderValue::Min | HeaderValue::Max => HeaderType::Decimal,
            HeaderValue::FirstLogTime
            | HeaderValue::LastLogTime
            | HeaderValue::WindowStart
            | HeaderValue::WindowEnd => HeaderType::DateTime,
        }
    }

    /// Whether a document may lack it (no record, no value counted).
    pub fn may_be_absent(self) -> bool {
        matches!(
            self,
            HeaderValue::FirstLogTime
                | HeaderValue::LastLogTime
                | HeaderValue::Min
                | HeaderValue::Max
        )
    }

    fn of_a_total(self) -> bool {
        matches!(
            self,
            HeaderValue::Count | HeaderValue::Sum | HeaderValue::Min | HeaderValue::Max
        )
    }

    fn of_a_window(self) -> bool {
        matches!(
            self,
            HeaderValue::WindowStart | HeaderValue::WindowEnd | HeaderValue::WindowSequence
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header {field} {name:?} is not a valid XML element name")]
    InvalidName { field: &'static str, name: String },
    #[error("header field {0:?} is named twice; each child element appears once")]
    Repeated(String),
    #[error("header field {0:?} needs exactly one of `value` or `constant`")]
    ValueOrConstant(String),
    #[error("header field {name:?}: `{value}` needs `of`, a field named in `totals`")]
    TotalWithoutField { name: String, value: &'static str },
    #[error("header field {name:?}: `of` {of:?} is not a field named in `totals`")]
    NotTotalled { name: String, of: String },
    #[error("header field {0:?}: `of` goes with count, sum, min or max only")]
    OfWithoutTotal(String),
    #[error("header field {0:?} names a window value, and the definition has no window")]
    NoWindow(String),
    #[error(
        "header field {name:?}: its constant is {bytes} bytes; at most {MAX_HEADER_CONSTANT_BYTES}"
    )]
    ConstantTooLong { name: String, bytes: usize },
    #[error(
        "header field {0:?}: its constant holds a control character, which XML 1.0 cannot carry"
    )]
    ConstantCharacter(String),
    #[error("the header declares {0} fields; at most {MAX_HEADER_FIELDS}")]
    TooManyFields(usize),
    #[error("the header asks for totals, and the definition names none in `totals`")]
    NoTotals,
    #[error("the header declares nothing: give it `fields` or `totals: true`")]
    Empty,
    #[error(
        "header element {0:?} would be confused with a record or the summary; choose another name"
    )]
    ElementTaken(String),
}

impl HeaderValue {
    fn name(self) -> &'static str {
        match self {
            HeaderValue::Count => "count",
            HeaderValue::Sum => "sum",
            HeaderValue::Min => "min",
            HeaderValue::Max => "max",
            _ => "value",
        }
    }
}

impl HeaderSpec {
    /// Checks the header against its definition's `totals`, whether it has
    /// a window, and the names its document already uses.
    pub fn validate(
        &self,
        totals: &[String],
        windowed: bool,
        taken: &[&str],
    ) -> Result<(), HeaderError> {
        if !is_xml_name(&self.element) {
            return Err(HeaderError::InvalidName {
                field: "element",
                name: self.element.clone(),
            });
        }
        if taken.contains(&self.element.as_str()) {
            return Err(HeaderError::ElementTaken(self.element.clone()));
        }
        if self.fields.is_empty() && !self.totals {
            return Err(HeaderError::Empty);
        }
        if self.fields.len() > MAX_HEADER_FIELDS {
            return Err(HeaderError::TooManyFields(self.fields.len()));
        }
        if self.totals && totals.is_empty() {
            return Err(HeaderError::NoTotals);
        }
        let mut names = BTreeSet::new();
        for field in &self.fields {
            let name = &field.name;
            if !is_xml_name(name)
                || name
                    .get(..3)
                    .is_some_and(|start| start.eq_ignore_ascii_case("xml"))
            {
                return Err(HeaderError::InvalidName {
                    field: "field",
                    name: name.clone(),
                });
            }
            // `total` children come after the declared ones, with the
            // same name in the schema: keep them apart.
            if !names.insert(name.as_str()) || (self.totals && name == "total") {
                return Err(HeaderError::Repeated(name.clone()));
            }
            match (&field.value, &field.constant) {
                (Some(value), None) => {
                    if value.of_a_window() && !windowed {
                        return Err(HeaderError::NoWindow(name.clone()));
                    }
                    match (&field.of, value.of_a_total()) {
                        (None, true) => {
                            return Err(HeaderError::TotalWithoutField {
                                name: name.clone(),
                                value: value.name(),
                            });
                        }
                        (Some(of), true) if !totals.contains(of) => {
                            return Err(HeaderError::NotTotalled {
                                name: name.clone(),
                                of: of.clone(),
                            });
                        }
                        (Some(_), false) => return Err(HeaderError::OfWithoutTotal(name.clone())),
                        _ => {}
                    }
                }
                (None, Some(constant)) => {
                    if field.of.is_some() {
                        return Err(HeaderError::OfWithoutTotal(name.clone()));
                    }
                    if constant.len() > MAX_HEADER_CONSTANT_BYTES {
                        return Err(HeaderError::ConstantTooLong {
                            name: name.clone(),
                            bytes: constant.len(),
                        });
                    }
                    if constant.chars().any(|character| {
                        character.is_control() && !matches!(character, '\t' | '\n' | '\r')
                    }) {
                        return Err(HeaderError::ConstantCharacter(name.clone()));
                    }
                }
                _ => return Err(HeaderError::ValueOrConstant(name.clone())),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(json: &str) -> HeaderSpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_header_of_values_totals_and_constants_is_valid() {
        let spec = header(
            r#"{"element": "GrpHdr", "fields": [
                {"name": "MsgId", "value": "report_id"},
                {"name": "NbOfTxs", "value": "records"},
                {"name": "CtrlSum", "value": "sum", "of": "amount"},
                {"name": "From", "value": "window_start"},
                {"name": "InitgPty", "constant": "ACME & Söhne"}
            ], "totals": true}"#,
        );
        spec.validate(&["amount".into()], true, &["report", "record", "summary"])
            .unwrap();
        assert_eq!(header(r#"{"totals": true}"#).element, "header");
    }

    #[test]
    fn every_mistake_is_refused_naming_its_field() {
        let totals = ["amount".to_owned()];
        let refused = |json: &str, windowed: bool| {
            header(json)
                .validate(&totals, windowed, &["report", "record", "summary"])
                .unwrap_err()
                .to_string()
        };
        assert!(refused(r#"{}"#, false).contains("declares nothing"));
        assert!(refused(r#"{"element": "1x", "totals": true}"#, false).contains("\"1x\""));
        assert!(refused(r#"{"element": "record", "totals": true}"#, false).contains("confused"));
        let twice =
            r#"{"fields": [{"name": "a", "value": "records"}, {"name": "a", "value": "stream"}]}"#;
        assert!(refused(twice, false).contains("named twice"));
        let both = r#"{"fields": [{"name": "a", "value": "records", "constant": "x"}]}"#;
        assert!(refused(both, false).contains("exactly one"));
        let sum = r#"{"fields": [{"name": "s", "value": "sum"}]}"#;
        assert!(refused(sum, false).contains("`sum` needs `of`"));
        let other = r#"{"fields": [{"name": "s", "value": "max", "of": "qty"}]}"#;
        assert!(refused(other, false).contains("\"qty\" is not a field named in `totals`"));
        let window = r#"{"fields": [{"name": "w", "value": "window_end"}]}"#;
        assert!(refused(window, false).contains("no window"));
        header(window).validate(&totals, true, &[]).unwrap();
        let control = r#"{"fields": [{"name": "c", "constant": "a\u0007b"}]}"#;
        assert!(refused(control, false).contains("control character"));
        let long = format!(
            r#"{{"fields": [{{"name": "c", "constant": "{}"}}]}}"#,
            "x".repeat(MAX_HEADER_CONSTANT_BYTES + 1)
        );
        assert!(refused(&long, false).contains("at most 1024"));
        let unknown =
            serde_json::from_str::<HeaderSpec>(r#"{"fields": [{"name": "a", "valu": "records"}]}"#);
        assert!(unknown.is_err());
        let no_totals = header(r#"{"totals": true}"#).validate(&[], false, &[]);
        assert_eq!(no_totals, Err(HeaderError::NoTotals));
    }
}

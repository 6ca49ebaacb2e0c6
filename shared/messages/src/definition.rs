//! A stream's report definition: how its records become XML.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::CURRENT_VERSION;
use crate::compression::Compression;
use crate::fields::{Field, FieldKind, FieldsError, Undeclared, check_fields};
use crate::header::{HeaderError, HeaderSpec};
use crate::key_template::{self, TemplateError};
use crate::window::{WindowError, WindowSpec};

/// How a stream's records are rendered. Published as a control message on
/// the stream's key; a document uses the definition in force at its first
/// record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    #[serde(default = "current_version")]
    pub v: u32,
    /// The document's root element.
    #[serde(default = "default_root")]
    pub root: String,
    /// The element of each record.
    #[serde(default = "default_record")]
    pub record: String,
    /// A default namespace for the document, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// A prefix for `namespace`: declared once on the root as
    /// `xmlns:{prefix}`, and written on the root, record, header, summary
    /// and total elements; the fields' elements are then in no namespace
    /// (XML Schema's unqualified local elements). Without it the namespace
    /// is the default one, and every element is in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Top-level fields written as attributes of the record element (when
    /// their value is a string, number, boolean or null) instead of children.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub attributes: BTreeSet<String>,
    /// Field name -> element or attribute name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub renames: BTreeMap<String, String>,
    /// Store the document gzip-compressed (`.xml.gz`, `application/gzip`),
    /// compressed while it streams. Absent means false; a definition that
    /// sets it is written as version [`Definition::GZIP_VERSION`], so a
    /// release that cannot compress refuses it by name instead of storing
    /// plain XML under a `.xml.gz` key.
    #[serde(default, skip_serializing_if = "is_false")]
    pub gzip: bool,
    /// Store the document Zstandard-compressed (`.xml.zst`,
    /// `application/zstd`), compressed while it streams; not with `gzip`.
    /// Written as version [`Definition::ZSTD_VERSION`].
    #[serde(default, skip_serializing_if = "is_false")]
    pub zstd: bool,
    /// Reports per time window of the log (see [`crate::window`]): a
    /// document ends at the first message of its partition at or past its
    /// window's end, and a window nothing closed gets a marker once a
    /// worker's clock passes its end plus `grace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowSpec>,
    /// The S3 key of each document (see [`crate::key_template`]), instead of
    /// `reports/{stream}/{partition}-{first_offset}.xml`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_template: Option<String>,
    /// Typed fields every record is checked against (see [`crate::fields`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<Field>,
    /// What a typed definition does with fields it does not declare.
    #[serde(default, skip_serializing_if = "Undeclared::is_keep")]
    pub undeclared: Undeclared,
    /// Declared numeric fields whose count, exact sum, minimum and maximum
    /// close each document.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub totals: Vec<String>,
    /// An element before the first record holding values of the document
    /// (its totals among them) and constants (see [`crate::header`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<HeaderSpec>,
    /// Pretty printing: each element on a line of its own, indented by
    /// this many spaces (1 to [`MAX_INDENT`]) per level. Only whitespace
    /// between elements is added, never inside a text, so the document
    /// means the same and validates against the same schema; the same
    /// records give the same bytes. Absent, a record is one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indent: Option<u8>,
}

/// The widest indentation a definition may ask for, in spaces per level.
pub const MAX_INDENT: u8 = 8;

fn is_false(flag: &bool) -> bool {
    !*flag
}

/// The element that closes every document with its record count, offset
/// range and report id; no record element may take its name.
pub const SUMMARY_ELEMENT: &str = "summary";

fn current_version() -> u32 {
    CURRENT_VERSION
}
fn default_root() -> String {
    "report".to_owned()
}
fn default_record() -> String {
    "record".to_owned()
}

impl Default for Definition {
    fn default() -> Self {
        Definition {
            v: CURRENT_VERSION,
            root: default_root(),
            record: default_record(),
            namespace: None,
            prefix: None,
            attributes: BTreeSet::new(),
            renames: BTreeMap::new(),
            gzip: false,
            zstd: false,
            window: None,
            key_template: None,
            fields: Vec::new(),
            undeclared: Undeclared::Keep,
            totals: Vec::new(),
            header: None,
            indent: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefinitionError {
    #[error("{field} {name:?} is not a valid XML element name")]
    InvalidName { field: &'static str, name: String },
    #[error("renames map both {first:?} and {second:?} to {target:?}; names must stay distinct")]
    RenameCollision {
        first: String,
        second: String,
        target: String,
    },
    #[error("record element {0:?} would be confused with the summary element; choose another name")]
    ReservedRecordName(String),
    #[error(
        "namespace {0:?} is not usable: it must be a non-empty URI without whitespace, control characters, quotes, '<' or '&'"
    )]
    InvalidNamespace(String),
    #[error(
        "{field} {name:?} is reserved: XML keeps `xmlns` and every name starting with `xml` (in any case) for itself; choose another name"
    )]
    ReservedName { field: &'static str, name: String },
    #[error(
        "namespace {0:?} is reserved by Namespaces in XML and cannot be a document's default namespace"
    )]
    ReservedNamespace(String),
    #[error(
        "attribute fields {first:?} and {second:?} would both be written as the attribute {name:?}; an element holds each attribute once"
    )]
    AttributeCollision {
        first: String,
        second: String,
        name: String,
    },
    #[error(transparent)]
    Window(#[from] WindowError),
    #[error(transparent)]
    KeyTemplate(#[from] TemplateError),
    #[error(transparent)]
    Fields(#[from] FieldsError),
    #[error(
        "attribute field {0:?} is declared as an object or repeated; only a single scalar can be an attribute"
    )]
    TypedAttribute(String),
    #[error("prefix {0:?} needs a namespace to stand for")]
    PrefixWithoutNamespace(String),
    #[error(transparent)]
    Header(#[from] HeaderError),
    #[error(
        "indent {0} is out of range: give 1 to {MAX_INDENT} spaces per level, or leave it out for one line per record"
    )]
    Indent(u8),
    #[error("gzip and zstd are both set; a report is stored with one compression: choose one")]
    TwoCompressions,
}

impl Definition {
    /// The first version with `gzip`: readers that know only version 1 must
    /// refuse a definition that compresses.
    pub const GZIP_VERSION: u32 = 2;
    /// The first version with `window` and `key_template`: readers that do
    /// not know them must refuse such a definition rather than report by
    /// arrival or store under the default keys.
    pub const WINDOW_VERSION: u32 = 3;
    /// The first version with `fields`, `undeclared`, `totals` and
    /// `prefix`: a release that cannot check, render and total typed
    /// fields refuses such a definition by name rather than render it
    /// untyped.
    pub const TYPED_VERSION: u32 = 4;
    /// The first version with `header`: a release that cannot hold a
    /// document's first part for its header refuses such a definition
    /// rather than write reports without it.
    pub const HEADER_VERSION: u32 = 5;
    /// The first version with `indent`: a release that cannot indent
    /// refuses such a definition by name rather than write it on one line.
    pub const INDENT_VERSION: u32 = 6;
    /// The first version with `zstd`: a release that cannot compress with
    /// Zstandard refuses such a definition by name rather than store plain
    /// XML under a `.xml.zst` key.
    pub const ZSTD_VERSION: u32 = 7;
    /// The newest definition version this release reads.
    pub const NEWEST_VERSION: u32 = Definition::ZSTD_VERSION;

    /// The version to publish this definition with: the oldest that holds
    /// everything it asks for, so definitions without gzip, windows or key
    /// templates stay readable by every release.
    pub fn required_version(&self) -> u32 {
        if self.zstd {
            Definition::ZSTD_VERSION
        } else if self.indent.is_some() {
            Definition::INDENT_VERSION
        } else if self.header.is_some() {
            Definition::HEADER_VERSION
        } else if self.is_typed()
            || !self.totals.is_empty()
            || !self.undeclared.is_keep()
            || self.prefix.is_some()
        {
            Definition::TYPED_VERSION
        } else if self.window.is_some() || self.key_template.is_some() {
            Definition::WINDOW_VERSION
        } else if self.gzip {
            Definition::GZIP_VERSION
        } else {
            CURRENT_VERSION
        }
    }

    /// How its reports are stored: gzip, Zstandard, or plain (`None`).
    pub fn compression(&self) -> Option<Compression> {
        if self.zstd {
            Some(Compression::Zstd)
        } else if self.gzip {
            Some(Compression::Gzip)
        } else {
            None
        }
    }

    /// Whether it declares typed fields.
    pub fn is_typed(&self) -> bool {
        !self.fields.is_empty()
    }

    /// Checks that the definition can only produce well-formed XML.
    pub fn validate(&self) -> Result<(), DefinitionError> {
        if let Some(indent) = self.indent
            && !(1..=MAX_INDENT).contains(&indent)
        {
            return Err(DefinitionError::Indent(indent));
        }
        if self.gzip && self.zstd {
            return Err(DefinitionError::TwoCompressions);
        }
        check_fields(&self.fields, self.undeclared, &self.totals)?;
        for field in &self.fields {
            let scalar = field.kind != FieldKind::Object && !field.repeated;
            if self.attributes.contains(&field.name) && !scalar {
                return Err(DefinitionError::TypedAttribute(field.name.clone()));
            }
        }
        if let Some(prefix) = &self.prefix {
            check_name("prefix", prefix)?;
            if self.namespace.is_none() {
                return Err(DefinitionError::PrefixWithoutNamespace(prefix.clone()));
            }
        }
        check_name("root", &self.root)?;
        check_name("record", &self.record)?;
        if self.record == SUMMARY_ELEMENT {
            return Err(DefinitionError::ReservedRecordName(self.record.clone()));
        }
        let mut targets: BTreeMap<&str, &str> = BTreeMap::new();
        for (field, target) in &self.renames {
            check_name("rename target", target)?;
            if let Some(first) = targets.insert(target, field) {
                return Err(DefinitionError::RenameCollision {
                    first: first.to_owned(),
                    second: field.clone(),
                    target: target.clone(),
                });
            }
        }
        if let Some(namespace) = &self.namespace {
            let unusable = namespace.is_empty()
                || namespace.chars().any(|character| {
                    character.is_whitespace() || matches!(character, '"' | '<' | '&' | '\'')
                });
            if unusable {
                return Err(DefinitionError::InvalidNamespace(namespace.clone()));
            }
        }
        if let Some(window) = &self.window {
            window.schedule()?;
        }
        if let Some(header) = &self.header {
            header.validate(
                &self.totals,
                self.window.is_some(),
                &[&self.root, &self.record, SUMMARY_ELEMENT],
            )?;
        }
        if let Some(template) = &self.key_template {
            key_template::validate(template, self.compression())?;
        }
        Ok(())
    }
}

fn check_name(field: &'static str, name: &str) -> Result<(), DefinitionError> {
    if is_xml_name(name) {
        Ok(())
    } else {
        Err(DefinitionError::InvalidName {
            field,
            name: name.to_owned(),
        })
    }
}

/// An XML 1.0 (5th edition) Name without a colon (an NCName), so that
/// definitions never need namespace prefixes.
pub fn is_xml_name(name: &str) -> bool {
    let mut characters = name.chars();
    let Some(first) = characters.next() else {
        return false;
    };
    is_xml_name_start_char(first) && characters.all(is_xml_name_char)
}

/// XML 1.0 (5th edition) NameStartChar, without `:`.
pub fn is_xml_name_start_char(character: char) -> bool {
    matches!(character,
        'A'..='Z' | '_' | 'a'..='z'
        | '\u{C0}'..='\u{D6}' | '\u{D8}'..='\u{F6}' | '\u{F8}'..='\u{2FF}'
        | '\u{370}'..='\u{37D}' | '\u{37F}'..='\u{1FFF}' | '\u{200C}'..='\u{200D}'
        | '\u{2070}'..='\u{218F}' | '\u{2C00}'..='\u{2FEF}' | '\u{3001}'..='\u{D7FF}'
        | '\u{F900}'..='\u{FDCF}' | '\u{FDF0}'..='\u{FFFD}' | '\u{10000}'..='\u{EFFFF}')
}

/// XML 1.0 (5th edition) NameChar, without `:`.
pub fn is_xml_name_char(character: char) -> bool {
    is_xml_name_start_char(character)
        || matches!(character, '-' | '.' | '0'..='9' | '\u{B7}' | '\u{300}'..='\u{36F}' | '\u{203F}'..='\u{2040}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_definition_is_valid() {
        Definition::default().validate().unwrap();
    }

    #[test]
    fn bad_names_and_colliding_renames_are_refused() {
        let definition = Definition {
            root: "1root".into(),
            ..Definition::default()
        };
        assert!(definition.validate().is_err());
        let definition = Definition {
            renames: BTreeMap::from([("a".into(), "x".into()), ("b".into(), "x".into())]),
            ..Definition::default()
        };
        assert!(matches!(
            definition.validate(),
            Err(DefinitionError::RenameCollision { .. })
        ));
        assert!(!is_xml_name("a:b"));
        assert!(!is_xml_name("a b"));
        assert!(is_xml_name("été"));
    }

    #[test]
    fn gzip_is_optional_and_raises_the_version_it_needs() {
        let old: Definition = crate::decode("definition", br#"{"v":1,"root":"orders"}"#).unwrap();
        assert!(!old.gzip);
        assert_eq!(old.required_version(), CURRENT_VERSION);
        let plain = serde_json::to_string(&Definition::default()).unwrap();
        assert!(
            !plain.contains("gzip"),
            "a definition without gzip is written as before: {plain}"
        );
        let compressed = Definition {
            gzip: true,
            ..Definition::default()
        };
        assert_eq!(compressed.required_version(), Definition::GZIP_VERSION);
        let published = Definition {
            v: compressed.required_version(),
            ..compressed
        };
        let read: Definition = crate::decode("definition", &crate::encode(&published)).unwrap();
        assert!(read.gzip);
        let newer = Definition::NEWEST_VERSION + 1;
        let body = format!(r#"{{"v":{newer}}}"#);
        let error = crate::decode::<Definition>("definition", body.as_bytes()).unwrap_err();
        assert!(
            error.to_string().contains(&format!("version {newer}")),
            "{error}"
        );
    }

    #[test]
    fn indent_is_optional_bounded_and_raises_the_version_it_needs() {
        let plain = serde_json::to_string(&Definition::default()).unwrap();
        assert!(!plain.contains("indent"), "{plain}");
        for indent in [1, 2, MAX_INDENT] {
            let indented = Definition {
                indent: Some(indent),
                ..Definition::default()
            };
            indented.validate().unwrap();
            assert_eq!(indented.required_version(), Definition::INDENT_VERSION);
        }
        for indent in [0, MAX_INDENT + 1, u8::MAX] {
            let error = Definition {
                indent: Some(indent),
                ..Definition::default()
            }
            .validate()
            .unwrap_err();
            assert!(
                error.to_string().contains(&format!("indent {indent}")),
                "{error}"
            );
        }
        assert!(serde_json::from_str::<Definition>(r#"{"indent": 256}"#).is_err());
        assert!(serde_json::from_str::<Definition>(r#"{"indent": -1}"#).is_err());
    }

    #[test]
    fn zstd_is_optional_excludes_gzip_and_raises_the_version_it_needs() {
        let plain = serde_json::to_string(&Definition::default()).unwrap();
        assert!(!plain.contains("zstd"), "{plain}");
        let zstd: Definition = serde_json::from_str(r#"{"zstd": true}"#).unwrap();
        zstd.validate().unwrap();
        assert_eq!(zstd.compression(), Some(Compression::Zstd));
        assert_eq!(zstd.required_version(), Definition::ZSTD_VERSION);
        let gzip: Definition = serde_json::from_str(r#"{"gzip": true}"#).unwrap();
        assert_eq!(gzip.compression(), Some(Compression::Gzip));
        assert_eq!(gzip.required_version(), Definition::GZIP_VERSION);
        assert_eq!(Definition::default().compression(), None);
        let both: Definition = serde_json::from_str(r#"{"gzip": true, "zstd": true}"#).unwrap();
        assert_eq!(both.validate(), Err(DefinitionError::TwoCompressions));
    }

    #[test]
    fn unknown_fields_in_a_definition_are_refused() {
        assert!(serde_json::from_str::<Definition>(r#"{"rot":"x"}"#).is_err());
        let parsed: Definition = serde_json::from_str(r#"{"root":"orders"}"#).unwrap();
        assert_eq!(parsed.record, "record");
    }
}

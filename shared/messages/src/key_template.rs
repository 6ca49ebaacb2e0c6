//! Key templates: where a stream's documents land in the bucket.
//!
//! A definition may replace the default layout (see [`crate::layout`]) with
//! a template such as
//! `reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml`
//! (a Hive-style layout). The API checks it with [`validate`] when a client
//! puts the definition, answering 422 with the error's message, so every
//! message names the problem and says what is allowed; the worker fills it in
//! with [`render`] when it opens a document, so a key never changes once its
//! document exists.
//!
//! A template is accepted when:
//! 1. it is not empty and at most [`MAX_TEMPLATE_BYTES`] bytes long;
//! 2. it starts with `reports/{stream}/`: a stream's documents stay in its
//!    own space, the folder named after it where retention and the take-over
//!    sweep look, and where whoever reads the bucket by prefix (Athena,
//!    Spark, a token scoped to a stream prefix) finds that stream's reports
//!    and no other's (checked after the syntax, so a typo is named first);
//! 3. it ends with `.xml`, or `.xml.gz` / `.xml.zst` when the definition
//!    stores gzip / Zstandard: the
//!    extension is how readers tell a document's media type;
//! 4. its placeholders are `{name}` with `name` one of [`PLACEHOLDERS`]; an
//!    unknown name, a `{` without its `}`, a stray `}` or a `{` inside a
//!    placeholder is refused;
//! 5. it contains `{partition}` and `{first_offset}`: where a document begins
//!    in the log is unique and known when it opens, so keys never collide
//!    (not even across streams) and never move;
//! 6. outside placeholders it holds only ASCII letters, digits and
//!    `/ . _ - =`: characters that need no escaping in S3 keys, URLs or
//!    shells;
//! 7. no path segment is empty (`//`), `.` or `..`, which tools and clients
//!    collapse or resolve, so such a key could not be addressed as written
//!    (a placeholder counts as content: none renders empty);
//! 8. its file name (after the last `/`) is exactly
//!    `{partition}-{first_offset}.xml` (`.xml.gz`), or one that can never
//!    render to `{5 digits}-{20 digits}.xml` (`.xml.gz`): that shape is how
//!    the take-over sweep knows a document's partition
//!    (`layout::report_key_belongs_to`), so no other file name may wear it
//!    (see `file_name.rs`: `could_look_like_a_partition_file`);
//! 9. the longest key it can render, with a stream name of
//!    [`StreamName::MAX_LENGTH`] bytes and the other placeholders at their
//!    fixed widths, fits in S3's 1024 bytes.
//!
//! Numbers are zero-padded to fixed widths (`{partition}` to 5 digits,
//! `{first_offset}` to 20, like the default layout) so that the keys of one
//! partition sort in log order.
//!
//! This module holds the rules and [`validate`]; `pieces.rs` reads a
//! template as text and placeholders (rule 4), `file_name.rs` is rule 8, and
//! `rendering.rs` fills a template in ([`render`]).

use crate::StreamName;
use crate::compression::{Compression, report_extension};
use crate::layout::REPORTS_PREFIX;

mod file_name;
mod pieces;
mod rendering;

use file_name::could_look_like_a_partition_file;
use pieces::{Piece, Pieces, Placeholder};
pub use rendering::render;

/// What every template starts with: a stream's documents stay under its own
/// name (rule 2 of the module's documentation).
pub const STREAM_SPACE_PREFIX: &str = "reports/{stream}/";

/// The placeholders a template may use.
pub const PLACEHOLDERS: [&str; 7] = [
    "stream",
    "yyyy",
    "mm",
    "dd",
    "hh",
    "partition",
    "first_offset",
];

/// Longest template accepted, in bytes.
pub const MAX_TEMPLATE_BYTES: usize = 512;

/// S3's limit on the length of a key, in bytes.
const MAX_KEY_BYTES: usize = 1024;

/// Why a template is refused. Each message names the problem and what is
/// allowed instead: the API returns it to the client as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "key_template is empty; give a key such as reports/{{stream}}/{{partition}}-{{first_offset}}.xml"
    )]
    Empty,
    #[error("key_template is {length} bytes long; at most {MAX_TEMPLATE_BYTES} are allowed")]
    TooLong { length: usize },
    #[error(
        "key_template must start with {STREAM_SPACE_PREFIX}: a stream's documents stay in its own space under {REPORTS_PREFIX}, where retention and the take-over sweep look, and where nobody reading another stream's prefix takes them for that stream's"
    )]
    OutsideStreamSpace,
    #[error(
        "key_template must end with {}, since the definition stores {}",
        report_extension(*.compression),
        stored_as(*.compression)
    )]
    WrongExtension { compression: Option<Compression> },
    #[error(
        "key_template has an unknown placeholder {{{name}}}; use {}",
        placeholder_list()
    )]
    UnknownPlaceholder { name: String },
    #[error(
        "key_template has a '{{' at offset {at} that is never closed; write placeholders as {{name}}"
    )]
    UnclosedBrace { at: usize },
    #[error(
        "key_template has a '{{' at offset {inner} inside the placeholder opened at offset {at}; placeholders do not nest"
    )]
    NestedBrace { at: usize, inner: usize },
    #[error(
        "key_template has a '}}' at offset {at} that closes no placeholder; write placeholders as {{name}}"
    )]
    StrayBrace { at: usize },
    #[error(
        "key_template must contain {{partition}} and {{first_offset}} (they keep every key unique and fixed when its document opens); it has no {missing}"
    )]
    MissingPlaceholder { missing: &'static str },
    #[error(
        "key_template contains {character:?} at offset {at}; outside placeholders only ASCII letters, digits and '/', '.', '_', '-', '=' are allowed"
    )]
    BadCharacter { character: char, at: usize },
    #[error(
        "key_template has an empty path segment (\"//\") at offset {at}; every segment between two '/' must hold something"
    )]
    EmptySegment { at: usize },
    #[error(
        "key_template has the path segment {segment:?} at offset {at}; segments \".\" and \"..\" are resolved away by many clients, so such keys could not be addressed"
    )]
    DotSegment { segment: &'static str, at: usize },
    #[error(
        "key_template has the file name {file_name:?}, which could render as {{5 digits}}-{{20 digits}}{}, the name the take-over sweep reads a document's partition from; end the template with {{partition}}-{{first_offset}}{} or a file name that cannot look like it (one starting with a letter, say)",
        report_extension(*.compression),
        report_extension(*.compression)
    )]
    LooksLikeAPartitionFile {
        file_name: String,
        compression: Option<Compression>,
    },
    #[error(
        "key_template can render keys of up to {longest} bytes (with a stream name of {} bytes); S3 keys are at most {MAX_KEY_BYTES}",
        StreamName::MAX_LENGTH
    )]
    KeyTooLong { longest: usize },
}

/// How a definition's documents are stored, in an error's words.
fn stored_as(compression: Option<Compression>) -> &'static str {
    match compression {
        None => "plain XML",
        Some(Compression::Gzip) => "gzip (gzip: true)",
        Some(Compression::Zstd) => "Zstandard (zstd: true)",
    }
}

/// `{stream}, {yyyy}, …`: the allowed placeholders, for messages.
fn placeholder_list() -> String {
    PLACEHOLDERS.map(|name| format!("{{{name}}}")).join(", ")
}

/// What a document's key is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyParts<'a> {
    pub stream: &'a str,
    /// `{yyyy}`, 4 digits zero-padded.
    pub year: i16,
    /// `{mm}`, 2 digits.
    pub month: i8,
    /// `{dd}`, 2 digits.
    pub day: i8,
    /// `{hh}`, 2 digits.
    pub hour: i8,
    /// `{partition}`: 5 digits zero-padded, as in the default layout.
    pub partition: i32,
    /// `{first_offset}`: 20 digits zero-padded, so keys sort in log order.
    pub first_offset: i64,
}

/// Checks a template; `compression` is how the definition stores its
/// documents (`.xml`, `.xml.gz` or `.xml.zst`). The rules, in the order they are checked, are in the
/// module's documentation.
pub fn validate(template: &str, compression: Option<Compression>) -> Result<(), TemplateError> {
    if template.is_empty() {
        return Err(TemplateError::Empty);
    }
    if template.len() > MAX_TEMPLATE_BYTES {
        return Err(TemplateError::TooLong {
            length: template.len(),
        });
    }
    let mut has_partition = false;
    let mut has_first_offset = false;
    let mut longest = 0;
    let mut segment = Segment::starting_at(0);
    for piece in Pieces::new(template) {
        let (at, piece) = piece?;
        match piece {
            Piece::Literal(text) => {
                for (index, character) in text.char_indices() {
                    let at = at + index;
                    if !is_literal_char(character) {
                        return Err(TemplateError::BadCharacter { character, at });
                    }
                    if character == '/' {
                        segment.close(at)?;
                        segment = Segment::starting_at(at + 1);
                    } else {
                        segment.push(character);
                    }
                }
                longest += text.len();
            }
            Piece::Placeholder(placeholder) => {
                has_partition |= placeholder == Placeholder::Partition;
                has_first_offset |= placeholder == Placeholder::FirstOffset;
                segment.has_other = true;
                longest += placeholder.max_width();
            }
        }
    }
    segment.close(template.len())?;

    if !template.starts_with(STREAM_SPACE_PREFIX) {
        return Err(TemplateError::OutsideStreamSpace);
    }
    if !template.ends_with(report_extension(compression)) {
        return Err(TemplateError::WrongExtension { compression });
    }
    let missing = match (has_partition, has_first_offset) {
        (true, true) => None,
        (false, true) => Some("{partition}"),
        (true, false) => Some("{first_offset}"),
        (false, false) => Some("{partition} or {first_offset}"),
    };
    if let Some(missing) = missing {
        return Err(TemplateError::MissingPlaceholder { missing });
    }
    let file_name = template
        .rsplit_once('/')
        .map_or(template, |(_, file_name)| file_name);
    if file_name
        != format!(
            "{{partition}}-{{first_offset}}{}",
            report_extension(compression)
        )
        && could_look_like_a_partition_file(file_name)
    {
        return Err(TemplateError::LooksLikeAPartitionFile {
            file_name: file_name.to_owned(),
            compression,
        });
    }
    if longest > MAX_KEY_BYTES {
        return Err(TemplateError::KeyTooLong { longest });
    }
    Ok(())
}

/// Whether `character` may appear outside placeholders.
fn is_literal_char(character: char) -> bool {
    character.is_ascii_alphanumeric() || matches!(character, '/' | '.' | '_' | '-' | '=')
}

/// The path segment being read, as much of it as rule 7 needs.
struct Segment {
    start: usize,
    dots: usize,
    has_other: bool,
}

impl Segment {
    fn starting_at(start: usize) -> Self {
        Segment {
            start,
            dots: 0,
            has_other: false,
        }
    }

    fn push(&mut self, character: char) {
        if character == '.' {
            self.dots += 1;
        } else {
            self.has_other = true;
        }
    }

    /// Ends the segment at `end` (its closing `/`, or the template's end).
    fn close(&self, end: usize) -> Result<(), TemplateError> {
        if self.has_other {
            return Ok(());
        }
        let at = self.start;
        match self.dots {
            0 => Err(TemplateError::EmptySegment { at: end }),
            1 => Err(TemplateError::DotSegment { segment: ".", at }),
            2 => Err(TemplateError::DotSegment { segment: "..", at }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const PLAIN: Option<Compression> = None;
    pub(super) const GZIP: Option<Compression> = Some(Compression::Gzip);

    /// The template's error, checking its message names `needle`.
    pub(super) fn refused(
        template: &str,
        compression: Option<Compression>,
        needle: &str,
    ) -> TemplateError {
        let error = validate(template, compression).expect_err(template);
        let message = error.to_string();
        assert!(message.starts_with("key_template "), "{message}");
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        error
    }

    #[test]
    fn empty_and_overlong_templates_are_refused() {
        assert_eq!(refused("", PLAIN, "empty"), TemplateError::Empty);
        let long = format!(
            "reports/{{stream}}/{}/{{partition}}-{{first_offset}}.xml",
            "a".repeat(MAX_TEMPLATE_BYTES)
        );
        assert_eq!(
            refused(&long, PLAIN, "at most 512"),
            TemplateError::TooLong { length: long.len() }
        );
        let longest = format!(
            "reports/{{stream}}/{}/{{partition}}-{{first_offset}}.xml",
            "a".repeat(MAX_TEMPLATE_BYTES - 48)
        );
        assert_eq!(longest.len(), MAX_TEMPLATE_BYTES);
        assert_eq!(validate(&longest, PLAIN), Ok(()));
    }

    #[test]
    fn templates_outside_their_streams_space_are_refused() {
        for template in [
            "{stream}/{partition}-{first_offset}.xml",
            "report/{partition}-{first_offset}.xml",
            "Reports/{partition}-{first_offset}.xml",
            "manifests/{partition}-{first_offset}.xml",
            // Under reports/, but not in the stream's own folder: another
            // stream's name, a shared folder, the stream further down, or
            // the stream's name as a mere part of the first segment.
            "reports/orders/{partition}-{first_offset}.xml",
            "reports/orders/{stream}/{partition}-{first_offset}.xml",
            "reports/{partition}-{first_offset}.xml",
            "reports/{yyyy}/{stream}/{partition}-{first_offset}.xml",
            "reports/x{stream}/{partition}-{first_offset}.xml",
            "reports/{stream}x/{partition}-{first_offset}.xml",
            "reports/{stream}{stream}/{partition}-{first_offset}.xml",
            "reports/{stream}-{partition}-{first_offset}.xml",
        ] {
            assert_eq!(
                refused(template, PLAIN, "must start with reports/{stream}/"),
                TemplateError::OutsideStreamSpace,
                "{template}"
            );
        }
        // A leading '/' is an empty first segment, named as such.
        assert_eq!(
            validate("/reports/{stream}/{partition}-{first_offset}.xml", PLAIN),
            Err(TemplateError::EmptySegment { at: 0 })
        );
        let message = TemplateError::OutsideStreamSpace.to_string();
        assert!(message.contains("take-over sweep"), "{message}");
        assert!(message.contains("own space"), "{message}");
    }

    #[test]
    fn the_extension_follows_the_compression() {
        let plain = "reports/{stream}/{partition}-{first_offset}.xml";
        let compressed = "reports/{stream}/{partition}-{first_offset}.xml.gz";
        let zstd = "reports/{stream}/{partition}-{first_offset}.xml.zst";
        let zstd_stored = Some(Compression::Zstd);
        assert_eq!(validate(plain, PLAIN), Ok(()));
        assert_eq!(validate(compressed, GZIP), Ok(()));
        assert_eq!(validate(zstd, zstd_stored), Ok(()));
        assert_eq!(
            refused(plain, GZIP, "must end with .xml.gz"),
            TemplateError::WrongExtension { compression: GZIP }
        );
        assert_eq!(
            refused(compressed, PLAIN, "must end with .xml,"),
            TemplateError::WrongExtension { compression: PLAIN }
        );
        assert_eq!(
            refused(
                compressed,
                zstd_stored,
                "must end with .xml.zst, since the definition stores Zstandard"
            ),
            TemplateError::WrongExtension {
                compression: zstd_stored
            }
        );
        assert_eq!(
            refused(zstd, GZIP, "must end with .xml.gz"),
            TemplateError::WrongExtension { compression: GZIP }
        );
        for template in [
            "reports/{stream}/{partition}-{first_offset}",
            "reports/{stream}/{partition}-{first_offset}.json",
            "reports/{stream}/{partition}-{first_offset}.XML",
            "reports/{stream}/{partition}-{first_offset}.xml/x",
        ] {
            assert_eq!(
                refused(template, PLAIN, "stores plain XML"),
                TemplateError::WrongExtension { compression: PLAIN }
            );
        }
    }

    #[test]
    fn partition_and_first_offset_are_required() {
        assert_eq!(
            refused(
                "reports/{stream}/{partition}.xml",
                PLAIN,
                "it has no {first_offset}"
            ),
            TemplateError::MissingPlaceholder {
                missing: "{first_offset}"
            }
        );
        assert_eq!(
            refused(
                "reports/{stream}/{first_offset}.xml",
                PLAIN,
                "it has no {partition}"
            ),
            TemplateError::MissingPlaceholder {
                missing: "{partition}"
            }
        );
        let error = refused(
            "reports/{stream}/{yyyy}.xml",
            PLAIN,
            "it has no {partition} or {first_offset}",
        );
        assert!(error.to_string().contains("unique"), "{error}");
        // Written as plain text, they are not placeholders.
        refused(
            "reports/{stream}/partition-first_offset.xml",
            PLAIN,
            "must contain {partition}",
        );
    }

    #[test]
    fn literal_characters_are_restricted() {
        for (template, character, at) in [
            ("reports/{stream} {partition}-{first_offset}.xml", ' ', 16),
            ("reports/%7B/{partition}-{first_offset}.xml", '%', 8),
            ("reports/é/{partition}-{first_offset}.xml", 'é', 8),
            ("reports/a+b/{partition}-{first_offset}.xml", '+', 9),
            ("reports/a\\b/{partition}-{first_offset}.xml", '\\', 9),
            ("reports/a\nb/{partition}-{first_offset}.xml", '\n', 9),
            ("reports/~/{partition}-{first_offset}.xml", '~', 8),
        ] {
            assert_eq!(
                refused(template, PLAIN, &format!("{character:?}")),
                TemplateError::BadCharacter { character, at }
            );
        }
        refused(
            "reports/a b/{partition}-{first_offset}.xml",
            PLAIN,
            "contains ' ' at offset 9; outside placeholders only",
        );
        let every_allowed = "reports/{stream}/AZaz09_-=.x/{partition}-{first_offset}.xml";
        assert_eq!(validate(every_allowed, PLAIN), Ok(()));
    }

    #[test]
    fn empty_and_dot_segments_are_refused() {
        assert_eq!(
            refused(
                "reports//{partition}-{first_offset}.xml",
                PLAIN,
                "empty path segment"
            ),
            TemplateError::EmptySegment { at: 8 }
        );
        assert_eq!(
            refused(
                "reports/{stream}//{partition}-{first_offset}.xml",
                PLAIN,
                "\"//\""
            ),
            TemplateError::EmptySegment { at: 17 }
        );
        assert_eq!(
            refused("reports/./{partition}-{first_offset}.xml", PLAIN, "\".\""),
            TemplateError::DotSegment {
                segment: ".",
                at: 8
            }
        );
        assert_eq!(
            refused(
                "reports/{stream}/../{partition}-{first_offset}.xml",
                PLAIN,
                "\"..\""
            ),
            TemplateError::DotSegment {
                segment: "..",
                at: 17
            }
        );
        // Dots beside other content, or placeholders, make a proper segment.
        for template in [
            "reports/{stream}/.{stream}/{partition}-{first_offset}.xml",
            "reports/{stream}/..{yyyy}/{partition}-{first_offset}.xml",
            "reports/{stream}/v1.2/{partition}-{first_offset}.xml",
            "reports/{stream}/.../{partition}-{first_offset}.xml",
            "reports/{stream}/{partition}/{first_offset}.xml",
        ] {
            assert_eq!(validate(template, PLAIN), Ok(()), "{template}");
        }
    }

    #[test]
    fn keys_longer_than_s3_allows_are_refused() {
        // Eight stream names: 8 + 128 + 1 + 7 * 128 + 1 + 5 + 1 + 20 + 4 bytes.
        let template = format!(
            "reports/{{stream}}/{}/{{partition}}-{{first_offset}}.xml",
            "{stream}".repeat(7)
        );
        assert_eq!(
            refused(&template, PLAIN, "1064 bytes"),
            TemplateError::KeyTooLong { longest: 1064 }
        );
        // Seven fit: 936 bytes.
        let template = format!(
            "reports/{{stream}}/{}/{{partition}}-{{first_offset}}.xml",
            "{stream}".repeat(6)
        );
        assert_eq!(validate(&template, PLAIN), Ok(()));
        // Exactly 1024 bytes: seven streams and 88 more literal bytes.
        let template = format!(
            "reports/{{stream}}/{}{}/{{partition}}-{{first_offset}}.xml",
            "{stream}".repeat(6),
            "a".repeat(88)
        );
        assert_eq!(validate(&template, PLAIN), Ok(()));
        let template = format!(
            "reports/{{stream}}/{}{}/{{partition}}-{{first_offset}}.xml",
            "{stream}".repeat(6),
            "a".repeat(89)
        );
        assert_eq!(
            refused(&template, PLAIN, "S3 keys are at most 1024"),
            TemplateError::KeyTooLong { longest: 1025 }
        );
    }
}

//! A template read as pieces: literal text and placeholders, each with its
//! byte offset (for the messages), for validation, rendering and the
//! file-name rule alike; and the placeholders themselves, with the width
//! each renders to.
//!
//! Rule 4 of the parent module is checked here: an unknown name, a `{`
//! without its `}`, a stray `}` and a `{` inside a placeholder end the
//! reading with their error.

use std::fmt;

use super::{KeyParts, TemplateError};
use crate::StreamName;

/// One of [`PLACEHOLDERS`](super::PLACEHOLDERS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placeholder {
    Stream,
    Year,
    Month,
    Day,
    Hour,
    Partition,
    FirstOffset,
}

impl Placeholder {
    pub(super) fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "stream" => Placeholder::Stream,
            "yyyy" => Placeholder::Year,
            "mm" => Placeholder::Month,
            "dd" => Placeholder::Day,
            "hh" => Placeholder::Hour,
            "partition" => Placeholder::Partition,
            "first_offset" => Placeholder::FirstOffset,
            _ => return None,
        })
    }

    /// The most bytes it renders to.
    pub(super) fn max_width(self) -> usize {
        match self {
            Placeholder::Stream => StreamName::MAX_LENGTH,
            Placeholder::Year => 4,
            Placeholder::Month | Placeholder::Day | Placeholder::Hour => 2,
            Placeholder::Partition => 5,
            Placeholder::FirstOffset => 20,
        }
    }

    /// Writes its part of `parts`, zero-padded to its fixed width (the one
    /// [`Self::max_width`] counts).
    pub(super) fn write(
        self,
        parts: &KeyParts<'_>,
        formatter: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        match self {
            Placeholder::Stream => formatter.write_str(parts.stream),
            Placeholder::Year => write!(formatter, "{:04}", parts.year),
            Placeholder::Month => write!(formatter, "{:02}", parts.month),
            Placeholder::Day => write!(formatter, "{:02}", parts.day),
            Placeholder::Hour => write!(formatter, "{:02}", parts.hour),
            Placeholder::Partition => write!(formatter, "{:05}", parts.partition),
            Placeholder::FirstOffset => write!(formatter, "{:020}", parts.first_offset),
        }
    }
}

/// A run of a template: text copied as is, or a placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Piece<'a> {
    Literal(&'a str),
    Placeholder(Placeholder),
}

/// A template's pieces with their byte offsets, in order. After a syntax
/// error it stops, leaving `rest` at the offending brace.
pub(super) struct Pieces<'a> {
    pub(super) rest: &'a str,
    at: usize,
    failed: bool,
}

impl<'a> Pieces<'a> {
    pub(super) fn new(template: &'a str) -> Self {
        Pieces {
            rest: template,
            at: 0,
            failed: false,
        }
    }

    /// Moves past the first `length` bytes, yielding `piece`.
    fn advance(&mut self, length: usize, piece: Piece<'a>) -> (usize, Piece<'a>) {
        let at = self.at;
        self.rest = &self.rest[length..];
        self.at += length;
        (at, piece)
    }

    /// Reads the placeholder `rest` starts with (at a `{`).
    fn placeholder(&mut self) -> Result<(usize, Piece<'a>), TemplateError> {
        let at = self.at;
        let body = &self.rest[1..];
        let end = body
            .find(['{', '}'])
            .ok_or(TemplateError::UnclosedBrace { at })?;
        if body[end..].starts_with('{') {
            return Err(TemplateError::NestedBrace {
                at,
                inner: at + 1 + end,
            });
        }
        let name = &body[..end];
        let placeholder =
            Placeholder::from_name(name).ok_or_else(|| TemplateError::UnknownPlaceholder {
                name: name.to_owned(),
            })?;
        Ok(self.advance(end + 2, Piece::Placeholder(placeholder)))
    }
}

impl<'a> Iterator for Pieces<'a> {
    type Item = Result<(usize, Piece<'a>), TemplateError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let item = match self.rest.find(['{', '}']) {
            None => Ok(self.advance(self.rest.len(), Piece::Literal(self.rest))),
            Some(0) if self.rest.starts_with('}') => Err(TemplateError::StrayBrace { at: self.at }),
            Some(0) => self.placeholder(),
            Some(brace) => Ok(self.advance(brace, Piece::Literal(&self.rest[..brace]))),
        };
        self.failed = item.is_err();
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key_template::tests::{PLAIN, refused};
    use crate::key_template::{PLACEHOLDERS, placeholder_list};

    #[test]
    fn placeholders_match_their_names() {
        for name in PLACEHOLDERS {
            assert!(Placeholder::from_name(name).is_some(), "{name}");
        }
        assert_eq!(
            placeholder_list(),
            "{stream}, {yyyy}, {mm}, {dd}, {hh}, {partition}, {first_offset}"
        );
    }

    #[test]
    fn unknown_placeholders_are_named() {
        let error = refused(
            "reports/{date}/{partition}-{first_offset}.xml",
            PLAIN,
            "unknown placeholder {date}; use {stream}, {yyyy}, {mm}, {dd}, {hh}, {partition}, {first_offset}",
        );
        assert_eq!(
            error,
            TemplateError::UnknownPlaceholder {
                name: "date".to_owned()
            }
        );
        for (template, name) in [
            ("reports/{}/{partition}-{first_offset}.xml", ""),
            ("reports/{Stream}/{partition}-{first_offset}.xml", "Stream"),
            (
                "reports/{ stream }/{partition}-{first_offset}.xml",
                " stream ",
            ),
            (
                "reports/{stream/x}/{partition}-{first_offset}.xml",
                "stream/x",
            ),
        ] {
            assert_eq!(
                refused(template, PLAIN, &format!("{{{name}}}")),
                TemplateError::UnknownPlaceholder {
                    name: name.to_owned()
                }
            );
        }
    }

    #[test]
    fn unbalanced_and_nested_braces_are_refused() {
        assert_eq!(
            refused(
                "reports/{partition}-{first_offset.xml",
                PLAIN,
                "never closed"
            ),
            TemplateError::UnclosedBrace { at: 20 }
        );
        assert_eq!(
            refused(
                "reports/{stream/{partition}-{first_offset}.xml",
                PLAIN,
                "do not nest"
            ),
            TemplateError::NestedBrace { at: 8, inner: 16 }
        );
        assert_eq!(
            refused(
                "reports/{{stream}}/{partition}-{first_offset}.xml",
                PLAIN,
                "do not nest"
            ),
            TemplateError::NestedBrace { at: 8, inner: 9 }
        );
        assert_eq!(
            refused(
                "reports/stream}/{partition}-{first_offset}.xml",
                PLAIN,
                "closes no placeholder"
            ),
            TemplateError::StrayBrace { at: 14 }
        );
        assert_eq!(
            refused(
                "reports/{partition}}-{first_offset}.xml",
                PLAIN,
                "'}' at offset 19"
            ),
            TemplateError::StrayBrace { at: 19 }
        );
    }
}

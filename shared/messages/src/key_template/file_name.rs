//! Rule 8 of the parent module: a template's file name either is
//! `{partition}-{first_offset}` with the extension, or can never render in
//! that shape, which is how the take-over sweep knows a document's
//! partition (`layout::report_key_belongs_to`).

use super::pieces::{Piece, Pieces, Placeholder};
use crate::StreamName;
use crate::compression::REPORT_EXTENSIONS;

/// One character of a partition's file name, as the take-over sweep reads
/// it: a digit, or exactly this character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NameChar {
    Digit,
    Exactly(u8),
}

impl NameChar {
    fn admits(self, byte: u8) -> bool {
        match self {
            NameChar::Digit => byte.is_ascii_digit(),
            NameChar::Exactly(expected) => byte == expected,
        }
    }
}

/// `{5 digits}-{20 digits}` and then `extension`: a file name the sweep takes
/// as a partition's document.
fn partition_file_shape(extension: &str) -> Vec<NameChar> {
    std::iter::repeat_n(NameChar::Digit, 5)
        .chain(std::iter::once(NameChar::Exactly(b'-')))
        .chain(std::iter::repeat_n(NameChar::Digit, 20))
        .chain(extension.bytes().map(NameChar::Exactly))
        .collect()
}

/// Whether the template file name `file_name` (its last segment, syntax
/// already checked) can render, for some stream and some values of its
/// placeholders, to `{5 digits}-{20 digits}` and a report extension
/// (`.xml`, `.xml.gz` or `.xml.zst`).
///
/// Why it matters: the take-over sweep, which has only keys to go on, aborts
/// the uploads whose file name is `{p:05}-{20 digits}.xml(.gz|.zst)` when it takes
/// partition p. A template such as `reports/{stream}/{partition}/00007-{first_offset}.xml`
/// would give a document of partition 3 the file name of partition 7, and
/// the worker taking partition 7 would abort that live upload (failing the
/// session of partition 3's owner, and with it every stream it serves).
/// Only `{partition}-{first_offset}` renders the document's own partition
/// there; any other file name must be unable to take that shape at all.
///
/// The check is an over-approximation, so it refuses rather than misses:
/// the date and number placeholders render digits only, at their fixed
/// widths; `{stream}` renders 1 to [`StreamName::MAX_LENGTH`] characters,
/// each of which may be a digit, `-`, `.` or a letter, so it is taken to
/// match any character of the shape. A walk over the pieces keeps the set of
/// positions of the shape the text so far can end at.
pub(super) fn could_look_like_a_partition_file(file_name: &str) -> bool {
    REPORT_EXTENSIONS.into_iter().any(|extension| {
        let shape = partition_file_shape(extension);
        let mut reachable = vec![false; shape.len() + 1];
        reachable[0] = true;
        for piece in Pieces::new(file_name) {
            let Ok((_, piece)) = piece else {
                // Unreachable after `validate`'s syntax check; refusing is
                // the safe answer should it ever happen.
                return true;
            };
            let mut next = vec![false; shape.len() + 1];
            for start in (0..=shape.len()).filter(|&start| reachable[start]) {
                let rest = &shape[start..];
                match piece {
                    Piece::Literal(text) => {
                        let fits = text.len() <= rest.len()
                            && text
                                .bytes()
                                .zip(rest)
                                .all(|(byte, expected)| expected.admits(byte));
                        if fits {
                            next[start + text.len()] = true;
                        }
                    }
                    Piece::Placeholder(Placeholder::Stream) => {
                        let longest = StreamName::MAX_LENGTH.min(rest.len());
                        for length in 1..=longest {
                            next[start + length] = true;
                        }
                    }
                    Piece::Placeholder(digits) => {
                        let width = digits.max_width();
                        if width <= rest.len()
                            && rest[..width].iter().all(|c| *c == NameChar::Digit)
                        {
                            next[start + width] = true;
                        }
                    }
                }
            }
            reachable = next;
        }
        reachable[shape.len()]
    })
}

#[cfg(test)]
mod tests {
    use crate::key_template::tests::{GZIP, PLAIN, refused};
    use crate::key_template::{TemplateError, validate};

    #[test]
    fn a_file_name_that_could_pass_for_a_partitions_is_refused() {
        // The sweep of partition 7 would take these documents of any
        // partition for its own and abort their live uploads.
        for (template, compression) in [
            (
                "reports/{stream}/{partition}/00007-{first_offset}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{partition}/00007-{first_offset}.xml.gz",
                GZIP,
            ),
            (
                "reports/{stream}/{partition}/{yyyy}7-{first_offset}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{partition}/{mm}{dd}7-{first_offset}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{partition}/{first_offset}/{stream}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{first_offset}/{stream}{partition}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{partition}/{stream}{first_offset}.xml",
                PLAIN,
            ),
            (
                "reports/{stream}/{partition}-{first_offset}/{stream}.xml.gz",
                GZIP,
            ),
            (
                "reports/{stream}/{partition}/00007-{first_offset}.xml.zst",
                Some(crate::compression::Compression::Zstd),
            ),
            (
                "reports/{stream}/{first_offset}/00007-000000000000000{partition}.xml",
                PLAIN,
            ),
        ] {
            let error = refused(template, compression, "the take-over sweep");
            assert!(
                matches!(error, TemplateError::LooksLikeAPartitionFile { .. }),
                "{template}: {error}"
            );
        }
        // The document's own partition in that shape, or a file name that
        // cannot take it: a letter where a digit must be, other lengths.
        for template in [
            "reports/{stream}/{partition}-{first_offset}.xml",
            "reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml",
            "reports/{stream}/{first_offset}-{partition}.xml",
            "reports/{stream}/{partition}/{first_offset}.xml",
            "reports/{stream}/p={partition}/o={first_offset}.xml",
            "reports/{stream}/{partition}/r{yyyy}7-{first_offset}.xml",
            "reports/{stream}/{partition}/{first_offset}-{yyyy}.xml",
            "reports/{stream}/{partition}/{yyyy}-{first_offset}.xml",
            "reports/{stream}/{partition}/{mm}{dd}{hh}-{first_offset}.xml",
            "reports/{stream}/{first_offset}/{stream}-{partition}.xml",
        ] {
            assert_eq!(validate(template, PLAIN), Ok(()), "{template}");
        }
        let error = refused(
            "reports/{stream}/{partition}/00007-{first_offset}.xml",
            PLAIN,
            "\"00007-{first_offset}.xml\"",
        );
        assert!(
            error.to_string().contains("{partition}-{first_offset}.xml"),
            "{error}"
        );
    }
}

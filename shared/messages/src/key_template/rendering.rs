//! Filling a template in: the key of a document, from the parts of
//! [`KeyParts`], each number zero-padded to its fixed width.

use std::fmt;

use super::KeyParts;
use super::pieces::{Piece, Pieces};

/// The key of a document; `template` must have passed
/// [`validate`](super::validate).
///
/// Rendering never fails: should an unchecked template hold a malformed or
/// unknown placeholder, the text from there on is copied as written.
pub fn render(template: &str, parts: &KeyParts<'_>) -> String {
    Rendered { template, parts }.to_string()
}

/// A template filled in, written piece by piece.
struct Rendered<'t, 'p> {
    template: &'t str,
    parts: &'p KeyParts<'p>,
}

impl fmt::Display for Rendered<'_, '_> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut pieces = Pieces::new(self.template);
        for piece in pieces.by_ref() {
            match piece {
                Ok((_, Piece::Literal(text))) => formatter.write_str(text)?,
                Ok((_, Piece::Placeholder(placeholder))) => {
                    placeholder.write(self.parts, formatter)?;
                }
                Err(_) => break,
            }
        }
        formatter.write_str(pieces.rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StreamName;
    use crate::key_template::tests::{GZIP, PLAIN};
    use crate::key_template::validate;

    const HIVE: &str = "reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml";

    fn parts(partition: i32, first_offset: i64) -> KeyParts<'static> {
        KeyParts {
            stream: "orders",
            year: 2026,
            month: 3,
            day: 29,
            hour: 5,
            partition,
            first_offset,
        }
    }

    #[test]
    fn the_hive_example_renders_as_documented() {
        assert_eq!(validate(HIVE, PLAIN), Ok(()));
        assert_eq!(
            render(HIVE, &parts(3, 42)),
            "reports/orders/dt=2026-03-29/00003-00000000000000000042.xml"
        );
        let hourly = "reports/{stream}/{yyyy}/{mm}/{dd}/{hh}/{partition}-{first_offset}.xml";
        assert_eq!(validate(hourly, PLAIN), Ok(()));
        assert_eq!(
            render(hourly, &parts(3, 42)),
            "reports/orders/2026/03/29/05/00003-00000000000000000042.xml"
        );
    }

    #[test]
    fn the_default_layout_is_a_valid_template() {
        let template = "reports/{stream}/{partition}-{first_offset}.xml.gz";
        assert_eq!(validate(template, GZIP), Ok(()));
        let stream = StreamName::new("orders").unwrap();
        assert_eq!(
            render(template, &parts(3, 42)),
            crate::layout::report_key(
                &stream,
                3,
                42,
                Some(crate::compression::Compression::Gzip),
                None
            )
        );
    }

    #[test]
    fn keys_are_unique_and_sort_in_log_order() {
        let first = render(HIVE, &parts(3, 42));
        assert_ne!(first, render(HIVE, &parts(4, 42)));
        assert_ne!(first, render(HIVE, &parts(3, 43)));
        assert_ne!(render(HIVE, &parts(1, 23)), render(HIVE, &parts(12, 3)));
        let offsets = [0, 9, 10, 99, 100, 1_000_000, 42_000_000_000, i64::MAX];
        let keys: Vec<String> = offsets
            .iter()
            .map(|&offset| render(HIVE, &parts(3, offset)))
            .collect();
        assert!(keys.is_sorted(), "{keys:#?}");
        assert!(keys.iter().all(|key| key.len() == keys[0].len()));
    }

    #[test]
    fn an_unchecked_template_renders_without_panicking() {
        assert_eq!(
            render("reports/{partition}/{date}/{stream}.xml", &parts(3, 42)),
            "reports/00003/{date}/{stream}.xml"
        );
        assert_eq!(render("", &parts(3, 42)), "");
    }
}

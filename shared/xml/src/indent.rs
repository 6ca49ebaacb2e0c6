//! Pretty printing: an element the renderer wrote on one line, laid out
//! again with each child element on a line of its own.
//!
//! It works on the renderer's own output, so every path that renders a
//! record (the tree walk, [`crate::render_fields`], a typed layout) is
//! indented by the same code and stays byte for byte the same. That output
//! is simple enough to lay out without parsing: `<` and `>` appear only as
//! tag delimiters (text and attribute values escape them), and an element
//! holds either text or elements, never both. Whitespace is added only
//! between a tag and the next tag, never beside text, so no string changes
//! and the document validates against the same schema (element-only
//! content allows whitespace).

/// What the last piece written was.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Last {
    Nothing,
    /// A start tag: its element is open.
    Opened,
    /// An end tag or an empty element.
    Closed,
    Text,
}

/// Lays out again the element written from `start` to the end of `out`
/// (and whatever text follows it, such as its line's `\n`), its start tag
/// indented by `level` steps of `width` spaces and each child one step
/// further, an element holding only text kept on one line.
pub(crate) fn indent_from(out: &mut Vec<u8>, start: usize, level: usize, width: usize) {
    let compact = out.split_off(start);
    out.reserve(compact.len() + compact.len() / 2);
    let mut depth = level;
    let mut last = Last::Nothing;
    let mut rest = compact.as_slice();
    while let Some(&first) = rest.first() {
        if first != b'<' {
            let text_end = rest
                .iter()
                .position(|&byte| byte == b'<')
                .unwrap_or(rest.len());
            out.extend_from_slice(&rest[..text_end]);
            rest = &rest[text_end..];
            last = Last::Text;
            continue;
        }
        let Some(tag_end) = rest.iter().position(|&byte| byte == b'>') else {
            // Not the renderer's output: keep it as it is.
            out.extend_from_slice(rest);
            return;
        };
        let tag = &rest[..=tag_end];
        rest = &rest[tag_end + 1..];
        if tag.get(1) == Some(&b'/') {
            depth = depth.saturating_sub(1);
            if last == Last::Closed {
                new_line(out, depth, width);
            }
            out.extend_from_slice(tag);
            last = Last::Closed;
        } else {
            match last {
                Last::Nothing => spaces(out, depth, width),
                Last::Opened | Last::Closed => new_line(out, depth, width),
                Last::Text => {}
            }
            out.extend_from_slice(tag);
            if tag.ends_with(b"/>") {
                last = Last::Closed;
            } else {
                depth += 1;
                last = Last::Opened;
            }
        }
    }
}

fn new_line(out: &mut Vec<u8>, depth: usize, width: usize) {
    out.push(b'\n');
    spaces(out, depth, width);
}

fn spaces(out: &mut Vec<u8>, depth: usize, width: usize) {
    out.resize(out.len() + depth * width, b' ');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indented(compact: &str, level: usize, width: usize) -> String {
        let mut out = b"kept".to_vec();
        out.extend_from_slice(compact.as_bytes());
        indent_from(&mut out, 4, level, width);
        let out = String::from_utf8(out).unwrap();
        out.strip_prefix("kept")
            .expect("what came before is kept")
            .to_owned()
    }

    #[test]
    fn children_go_on_lines_of_their_own_and_text_stays_as_it_was() {
        assert_eq!(
            indented(
                "<r a=\"1\"><t> two  words </t><e/><n><m>x</m><l xsi:nil=\"true\"/></n><s></s></r>\n",
                1,
                2
            ),
            concat!(
                "  <r a=\"1\">\n",
                "    <t> two  words </t>\n",
                "    <e/>\n",
                "    <n>\n",
                "      <m>x</m>\n",
                "      <l xsi:nil=\"true\"/>\n",
                "    </n>\n",
                "    <s></s>\n",
                "  </r>\n",
            )
        );
        assert_eq!(indented("<r/>\n", 1, 4), "    <r/>\n");
        assert_eq!(indented("<r>text</r>\n", 0, 2), "<r>text</r>\n");
    }

    #[test]
    fn what_is_not_the_renderers_output_is_kept() {
        assert_eq!(indented("<r><a", 1, 2), "  <r><a");
        assert_eq!(indented("", 1, 2), "");
    }
}

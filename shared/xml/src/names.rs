//! Field names -> XML names, injectively, and back.
//!
//! JSON keys can be anything; XML element and attribute names cannot. The
//! encoding follows .NET's `XmlConvert.EncodeName`: every character that may
//! not stand where it is becomes `_xHHHH_` (four upper-case hex digits, or
//! eight `_xHHHHHHHH_` above U+FFFF), so `a b` becomes `a_x0020_b`. Three
//! additions make it exact for every string, so [`decode_name`] always gives
//! back the key that was sent:
//!
//! - A literal `_` is written `_x005F_` when the output would otherwise read
//!   as an escape sequence at that point (`_x0041_` as a key becomes
//!   `_x005F_x0041_`). The check looks at the *output*: `_x0041` followed by
//!   a space encodes as `_x005F_x0041_x0020_`, because the space's own escape
//!   supplies the closing `_` (.NET misses that case).
//! - The empty key, which no XML name can spell, becomes `_x0000_`; U+0000
//!   itself (never renderable, XML 1.0 forbids it) takes the long form
//!   `_x00000000_`, so the two stay distinct.
//! - The key `xmlns` becomes `_x0078_mlns`: as an attribute it would declare
//!   a namespace instead of carrying a value.
//!
//! Names are NCNames (no `:`), so no record ever needs a namespace prefix.

use std::borrow::Cow;
use std::fmt::Write as _;

/// What an empty key is written as: `_x0000_` would otherwise decode to
/// U+0000, which XML 1.0 forbids, so the sequence is free to mean "empty".
const EMPTY_NAME_ENCODED: &str = "_x0000_";

/// The one attribute name with a meaning of its own (a namespace
/// declaration) that a valid NCName can spell.
const NAMESPACE_DECLARATION_NAME: &str = "xmlns";

/// The key encoded as an XML NCName, borrowed when it already is one (the
/// common case costs no allocation).
pub fn encode_name(name: &str) -> Cow<'_, str> {
    if name_is_its_own_encoding(name) {
        return Cow::Borrowed(name);
    }
    let mut encoded = String::with_capacity(name.len() + 8);
    push_encoded_name(&mut encoded, name);
    Cow::Owned(encoded)
}

/// Appends the key encoded as an XML NCName to `out` (the renderer's hot
/// path): a key that is its own encoding, the common case, is copied as it
/// is; only one that needs escapes is encoded into a string first.
pub(crate) fn write_encoded_name(out: &mut Vec<u8>, name: &str) {
    if name_is_its_own_encoding(name) {
        out.extend_from_slice(name.as_bytes());
        return;
    }
    let mut encoded = String::with_capacity(name.len() + 8);
    push_encoded_name(&mut encoded, name);
    out.extend_from_slice(encoded.as_bytes());
}

/// The inverse of [`encode_name`]: `decode_name(&encode_name(key)) == key`
/// for every string. Sequences that do not name a Unicode scalar value (or
/// an `_` not starting a sequence) are kept literally, so any XML name
/// decodes to something.
pub fn decode_name(name: &str) -> Cow<'_, str> {
    if name == EMPTY_NAME_ENCODED {
        return Cow::Borrowed("");
    }
    if !name.contains("_x") {
        return Cow::Borrowed(name);
    }
    let mut decoded = String::with_capacity(name.len());
    let mut remaining = name;
    while let Some(underscore_position) = remaining.find('_') {
        decoded.push_str(&remaining[..underscore_position]);
        let from_underscore = &remaining[underscore_position..];
        match parse_escape_sequence(from_underscore) {
            Some((character, sequence_length)) => {
                decoded.push(character);
                remaining = &from_underscore[sequence_length..];
            }
            None => {
                decoded.push('_');
                remaining = &from_underscore[1..];
            }
        }
    }
    decoded.push_str(remaining);
    Cow::Owned(decoded)
}

/// Reads `_xHHHH_` or `_xHHHHHHHH_` at the start of `text`: the character
/// and the sequence's length in bytes, if it is one and names a character.
fn parse_escape_sequence(text: &str) -> Option<(char, usize)> {
    let digit_count = escape_sequence_digit_count(text.as_bytes())?;
    let code_point = u32::from_str_radix(&text[2..2 + digit_count], 16).ok()?;
    let character = char::from_u32(code_point)?;
    Some((character, digit_count + 3))
}

/// How many hex digits the escape sequence at the start of `bytes` has (4 or
/// 8), if `bytes` starts with `_x`, that many hex digits and `_`.
fn escape_sequence_digit_count(bytes: &[u8]) -> Option<usize> {
    if !bytes.starts_with(b"_x") {
        return None;
    }
    [4, 8].into_iter().find(|&digit_count| {
        bytes.len() > 2 + digit_count
            && bytes[2..2 + digit_count].iter().all(u8::is_ascii_hexdigit)
            && bytes[2 + digit_count] == b'_'
    })
}

/// True when the key is a valid NCName that encoding leaves alone: no
/// escape-looking `_x` sequence and not `xmlns`.
fn name_is_its_own_encoding(name: &str) -> bool {
    if name.is_ascii() {
        return ascii_name_is_its_own_encoding(name.as_bytes());
    }
    let mut characters = name.chars();
    let Some(first) = characters.next() else {
        return false;
    };
    is_name_start_character(first)
        && characters.all(is_name_character)
        && !name.contains("_x")
        && name != NAMESPACE_DECLARATION_NAME
}

/// [`name_is_its_own_encoding`] for ASCII keys, the common case, without
/// decoding characters.
fn ascii_name_is_its_own_encoding(name: &[u8]) -> bool {
    let Some((&first, rest)) = name.split_first() else {
        return false;
    };
    let is_ascii_name_start = |byte: u8| byte.is_ascii_alphabetic() || byte == b'_';
    let is_ascii_name_byte =
        |byte: u8| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.');
    is_ascii_name_start(first)
        && rest.iter().all(|&byte| is_ascii_name_byte(byte))
        && !name.windows(2).any(|pair| pair == b"_x")
        && name != NAMESPACE_DECLARATION_NAME.as_bytes()
}

fn push_encoded_name(encoded: &mut String, name: &str) {
    if name.is_empty() {
        encoded.push_str(EMPTY_NAME_ENCODED);
        return;
    }
    if name == NAMESPACE_DECLARATION_NAME {
        push_escape_sequence(encoded, 'x');
        encoded.push_str(&name[1..]);
        return;
    }
    for (byte_position, character) in name.char_indices() {
        let allowed_here = if byte_position == 0 {
            is_name_start_character(character)
        } else {
            is_name_character(character)
        };
        let starts_escape_lookalike =
            character == '_' && underscore_would_read_as_escape(&name[byte_position + 1..]);
        if allowed_here && !starts_escape_lookalike {
            encoded.push(character);
        } else {
            push_escape_sequence(encoded, character);
        }
    }
}

fn push_escape_sequence(encoded: &mut String, character: char) {
    let code_point = u32::from(character);
    // U+0000 takes the long form so that `_x0000_` can mean the empty name.
    let result = if code_point > 0xFFFF || code_point == 0 {
        write!(encoded, "_x{code_point:08X}_")
    } else {
        write!(encoded, "_x{code_point:04X}_")
    };
    debug_assert!(result.is_ok(), "writing to a String cannot fail");
}

/// Whether a literal `_` followed by `after_underscore` (the rest of the key)
/// would be decoded as the start of an escape sequence. After the `_`, the
/// output holds `x` and hex digits exactly as in the key (they are name
/// characters, never escaped past the first position), and the closing `_`
/// is either a literal `_` of the key or the start of the next character's
/// escape sequence.
fn underscore_would_read_as_escape(after_underscore: &str) -> bool {
    let bytes = after_underscore.as_bytes();
    if bytes.first() != Some(&b'x') {
        return false;
    }
    [4, 8].into_iter().any(|digit_count| {
        let digits_end = 1 + digit_count;
        bytes.len() > digits_end
            && bytes[1..digits_end].iter().all(u8::is_ascii_hexdigit)
            && after_underscore[digits_end..]
                .chars()
                .next()
                .is_some_and(|next| next == '_' || !is_name_character(next))
    })
}

// The XML name grammar lives with the definitions, which validate names too.
pub(crate) use quire_messages::{
    is_xml_name_char as is_name_character, is_xml_name_start_char as is_name_start_character,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_encodes(key: &str, expected: &str) {
        assert_eq!(encode_name(key), expected, "encoding {key:?}");
        assert_eq!(decode_name(expected), key, "decoding {expected:?}");
        assert!(
            quire_messages::is_xml_name(expected),
            "{expected:?} is an NCName"
        );
    }

    #[test]
    fn valid_names_are_kept_and_borrowed() {
        for key in [
            "name", "_id", "été", "a-b.c", "x_1", "名前", "xml", "xmlnsfoo", "😀",
        ] {
            assert!(matches!(encode_name(key), Cow::Borrowed(_)), "{key:?}");
            assert_encodes(key, key);
        }
    }

    #[test]
    fn characters_that_cannot_stand_in_a_name_are_escaped() {
        assert_encodes("a b", "a_x0020_b");
        assert_encodes("a:b", "a_x003A_b");
        assert_encodes("1st", "_x0031_st");
        assert_encodes("-x", "_x002D_x");
        assert_encodes("a/b", "a_x002F_b");
        assert_encodes("price €", "price_x0020_€");
        assert_encodes("\u{F0000}", "_x000F0000_");
        assert_encodes("a\u{F0000}", "a_x000F0000_");
        assert_encodes("tab\there", "tab_x0009_here");
    }

    #[test]
    fn the_empty_name_and_nul_stay_distinct() {
        assert_encodes("", "_x0000_");
        assert_encodes("\0", "_x00000000_");
        assert_encodes("a\0", "a_x00000000_");
    }

    #[test]
    fn xmlns_never_becomes_a_namespace_declaration() {
        assert_encodes("xmlns", "_x0078_mlns");
    }

    #[test]
    fn underscores_that_would_read_as_escapes_are_escaped() {
        assert_encodes("_x0041_", "_x005F_x0041_");
        assert_encodes("a_x0020_b", "a_x005F_x0020_b");
        assert_encodes("_x0001F600_", "_x005F_x0001F600_");
        assert_encodes("_xd800_", "_x005F_xd800_");
        // The closing underscore comes from the next character's escape.
        assert_encodes("_x0041 ", "_x005F_x0041_x0020_");
        assert_encodes("_x00410041:", "_x005F_x00410041_x003A_");
        // Not escape lookalikes: kept as they are.
        assert_encodes("_x004", "_x004");
        assert_encodes("_x0041", "_x0041");
        assert_encodes("_x0041a", "_x0041a");
        assert_encodes("_xyz_", "_xyz_");
    }

    #[test]
    fn decoding_keeps_what_is_not_a_sequence() {
        assert_eq!(decode_name("plain"), "plain");
        assert_eq!(decode_name("a_x"), "a_x");
        assert_eq!(decode_name("_xD800_"), "_xD800_");
        assert_eq!(decode_name("_x110000_"), "_x110000_");
        assert_eq!(decode_name("a_x0062_c"), "abc");
        assert_eq!(decode_name("a_x0062_"), "ab");
    }
}

//! Reading records from a file of any size without loading it whole: one
//! record per line (NDJSON), or the elements of one JSON array, split by a
//! small scanner that tracks strings, escapes and nesting depth.
//!
//! Every record comes with the byte offset just past it, so a send can stop
//! anywhere and continue later from that offset (see `state`).

use std::io::{self, BufRead};

use serde::{Deserialize, Serialize};

/// A UTF-8 byte order mark, which some editors write at the start.
const BYTE_ORDER_MARK: &[u8] = b"\xEF\xBB\xBF";

/// How the records are laid out in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// One JSON value per line; blank lines are skipped.
    Ndjson,
    /// One JSON array whose elements are the records.
    Array,
}

/// One record: an NDJSON line as it is (trimmed), or an array element as
/// written but without the whitespace between its tokens (so it fits a line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub bytes: Vec<u8>,
    /// Offset, from the start of the file, of the first byte after the record.
    pub end_offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading the input: {0}")]
    Io(#[from] io::Error),
    #[error("not a JSON array at byte {offset}: {what}")]
    Malformed { offset: u64, what: String },
}

/// Where the array scanner stands between two bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayPosition {
    /// Before the opening `[`.
    BeforeArray,
    /// Just after `[`: an element or `]`.
    AfterOpen,
    /// Just after a `,`: an element must follow.
    AfterComma,
    /// Just after an element: `,` or `]`.
    AfterElement,
    /// After the closing `]`: only whitespace may follow.
    Closed,
}

/// Scans one element: nesting depth and whether we are inside a string.
#[derive(Debug, Default)]
struct ElementScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// A bare scalar (number, `true`, ...) ends at whitespace, `,` or `]`.
    bare: bool,
}

/// Yields the records of an NDJSON file or a JSON array, one at a time.
pub struct RecordReader<R: BufRead> {
    input: R,
    format: Format,
    offset: u64,
    position: ArrayPosition,
    finished: bool,
}

impl<R: BufRead> RecordReader<R> {
    /// Looks at the first non-whitespace byte to choose the format: `[`
    /// means a JSON array, anything else NDJSON. Nothing is consumed.
    pub fn detect(mut input: R) -> Result<(Self, Format), ReadError> {
        let format = detect_format(&mut input)?;
        let mut reader = Self::at_offset(input, format, 0);
        if reader.input.fill_buf()?.starts_with(BYTE_ORDER_MARK) {
            reader.input.consume(BYTE_ORDER_MARK.len());
            reader.offset = BYTE_ORDER_MARK.len() as u64;
        }
        Ok((reader, format))
    }

    /// A reader for `input` that is already positioned at `offset` bytes into
    /// the file, which is either 0 or the end of a record a previous reader
    /// returned.
    pub fn at_offset(input: R, format: Format, offset: u64) -> Self {
        let position = if offset == 0 {
            ArrayPosition::BeforeArray
        } else {
            ArrayPosition::AfterElement
        };
        Self {
            input,
            format,
            offset,
            position,
            finished: false,
        }
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The next record, or `None` at the end of the input.
    pub fn next_record(&mut self) -> Result<Option<Record>, ReadError> {
        if self.finished {
            return Ok(None);
        }
        let record = match self.format {
            Format::Ndjson => self.next_line()?,
            Format::Array => self.next_element()?,
        };
        if record.is_none() {
            self.finished = true;
        }
        Ok(record)
    }

    fn next_line(&mut self) -> Result<Option<Record>, ReadError> {
        let mut line = Vec::new();
        loop {
            line.clear();
            let read = self.input.read_until(b'\n', &mut line)?;
            if read == 0 {
                return Ok(None);
            }
            self.offset += read as u64;
            let trimmed = line.trim_ascii();
            if trimmed.is_empty() {
                continue;
            }
            return Ok(Some(Record {
                bytes: trimmed.to_vec(),
                end_offset: self.offset,
            }));
        }
    }

    fn malformed(&self, what: impl Into<String>) -> ReadError {
        ReadError::Malformed {
            offset: self.offset,
            what: what.into(),
        }
    }

    /// Moves past whitespace and the structural bytes between elements;
    /// returns true when an element starts at the current byte.
    fn skip_to_element(&mut self) -> Result<bool, ReadError> {
        loop {
            let buffer = self.input.fill_buf()?;
            let Some(&byte) = buffer.first() else {
                return match self.position {
                    ArrayPosition::Closed => Ok(false),
                    ArrayPosition::BeforeArray => Err(self.malformed("the input is empty")),
                    _ => Err(self.malformed("the input ends inside the array (no closing `]`)")),
                };
            };
            if byte.is_ascii_whitespace() {
                self.input.consume(1);
                self.offset += 1;
                continue;
            }
            let next_position = match (self.position, byte) {
                (ArrayPosition::BeforeArray, b'[') => ArrayPosition::AfterOpen,
                (ArrayPosition::BeforeArray, _) => {
                    return Err(self.malformed("expected `[`"));
                }
                (ArrayPosition::AfterOpen, b']') | (ArrayPosition::AfterElement, b']') => {
                    ArrayPosition::Closed
                }
                (ArrayPosition::AfterElement, b',') => ArrayPosition::AfterComma,
                (ArrayPosition::AfterElement, _) => {
                    return Err(self.malformed(format!(
                        "expected `,` or `]` after an element, found `{}`",
                        byte.escape_ascii()
                    )));
                }
                (ArrayPosition::AfterOpen | ArrayPosition::AfterComma, b',' | b']') => {
                    return Err(self.malformed(format!(
                        "expected an element, found `{}`",
                        byte.escape_ascii()
                    )));
                }
                (ArrayPosition::AfterOpen | ArrayPosition::AfterComma, _) => return Ok(true),
                (ArrayPosition::Closed, _) => {
                    return Err(self.malformed("data after the closing `]`"));
                }
            };
            self.position = next_position;
            self.input.consume(1);
            self.offset += 1;
        }
    }

    fn next_element(&mut self) -> Result<Option<Record>, ReadError> {
        if !self.skip_to_element()? {
            return Ok(None);
        }
        let mut element = Vec::new();
        let mut scan = ElementScan::default();
        loop {
            let buffer = self.input.fill_buf()?;
            if buffer.is_empty() {
                if scan.bare && !scan.in_string {
                    // A bare scalar cut by the end of input: the array is
                    // unclosed, which skip_to_element reports next time.
                    break;
                }
                return Err(self.malformed("the input ends inside an element"));
            }
            let (used, complete) = scan_element(&mut scan, buffer, &mut element);
            self.input.consume(used);
            self.offset += used as u64;
            if complete {
                break;
            }
        }
        self.position = ArrayPosition::AfterElement;
        Ok(Some(Record {
            bytes: element,
            end_offset: self.offset,
        }))
    }
}

/// Scans `buffer` as the continuation of one element, appending its bytes to
/// `element` without the whitespace between tokens: the API reads records
/// one per line, and a pretty-printed array's elements span lines (a JSON
/// string cannot hold a raw newline, so only that whitespace can). Returns
/// how many bytes of `buffer` belong to the element and whether it ended.
fn scan_element(scan: &mut ElementScan, buffer: &[u8], element: &mut Vec<u8>) -> (usize, bool) {
    for (index, &byte) in buffer.iter().enumerate() {
        if element.is_empty() {
            match byte {
                b'{' | b'[' => scan.depth = 1,
                b'"' => scan.in_string = true,
                _ => scan.bare = true,
            }
            element.push(byte);
            continue;
        }
        if scan.in_string {
            element.push(byte);
            if scan.escaped {
                scan.escaped = false;
            } else if byte == b'\\' {
                scan.escaped = true;
            } else if byte == b'"' {
                scan.in_string = false;
                if scan.depth == 0 {
                    // A string element ends with its closing quote.
                    return (index + 1, true);
                }
            }
            continue;
        }
        if scan.bare {
            if byte.is_ascii_whitespace() || byte == b',' || byte == b']' {
                return (index, true);
            }
            element.push(byte);
            continue;
        }
        if byte.is_ascii_whitespace() {
            continue;
        }
        element.push(byte);
        match byte {
            b'"' => scan.in_string = true,
            b'{' | b'[' => scan.depth += 1,
            b'}' | b']' => {
                scan.depth -= 1;
                if scan.depth == 0 {
                    return (index + 1, true);
                }
            }
            _ => {}
        }
    }
    (buffer.len(), false)
}

/// `[` as the first non-whitespace byte means a JSON array. Skips a UTF-8
/// byte order mark, which some editors write.
fn detect_format<R: BufRead>(input: &mut R) -> io::Result<Format> {
    let buffer = input.fill_buf()?;
    let first = buffer
        .iter()
        .skip(if buffer.starts_with(BYTE_ORDER_MARK) {
            BYTE_ORDER_MARK.len()
        } else {
            0
        })
        .find(|byte| !byte.is_ascii_whitespace());
    // A buffer of whitespace only is rare (a huge indent); NDJSON skips it.
    Ok(if first == Some(&b'[') {
        Format::Array
    } else {
        Format::Ndjson
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Cursor};

    fn read_all(text: &str) -> Result<(Format, Vec<String>), ReadError> {
        let (mut reader, format) = RecordReader::detect(Cursor::new(text.as_bytes().to_vec()))?;
        let mut records = Vec::new();
        while let Some(record) = reader.next_record()? {
            records.push(String::from_utf8(record.bytes).expect("utf-8"));
        }
        Ok((format, records))
    }

    /// A one-byte buffer makes every element cross buffer boundaries.
    fn read_all_tiny_buffer(text: &str) -> Vec<String> {
        let input = BufReader::with_capacity(1, Cursor::new(text.as_bytes().to_vec()));
        let (mut reader, _) = RecordReader::detect(input).expect("detect");
        let mut records = Vec::new();
        while let Some(record) = reader.next_record().expect("record") {
            records.push(String::from_utf8(record.bytes).expect("utf-8"));
        }
        records
    }

    #[test]
    fn array_elements_with_brackets_and_escaped_quotes_inside_strings() {
        let text = r#"[{"a":"]}[{,"},{"b":"say \"hi\" ]"},{"c":"\\"},{"d":[1,{"e":"}"}]}]"#;
        let expected = vec![
            r#"{"a":"]}[{,"}"#,
            r#"{"b":"say \"hi\" ]"}"#,
            r#"{"c":"\\"}"#,
            r#"{"d":[1,{"e":"}"}]}"#,
        ];
        let (format, records) = read_all(text).expect("read");
        assert_eq!(format, Format::Array);
        assert_eq!(records, expected);
        assert_eq!(read_all_tiny_buffer(text), expected);
    }

    #[test]
    fn array_with_whitespace_everywhere() {
        let text = "\n  [ \n\t{\"id\": 1} ,\r\n {\"id\" : 2}\n]\n\n";
        let (_, records) = read_all(text).expect("read");
        assert_eq!(records, vec![r#"{"id":1}"#, r#"{"id":2}"#]);
    }

    #[test]
    fn pretty_printed_elements_become_one_line_each() {
        let text = "[\n  {\n    \"a\": \"x y\\n\",\n    \"b\": [ 1, 2 ]\n  },\n  { }\n]\n";
        let (_, records) = read_all(text).expect("read");
        assert_eq!(records, vec![r#"{"a":"x y\n","b":[1,2]}"#, "{}"]);
    }

    #[test]
    fn empty_arrays_have_no_records() {
        for text in ["[]", "[ ]", " \n[\n]\n"] {
            let (format, records) = read_all(text).expect("read");
            assert_eq!(format, Format::Array, "{text:?}");
            assert!(records.is_empty(), "{text:?}");
        }
    }

    #[test]
    fn scalars_are_elements_too() {
        let (_, records) = read_all(r#"[1, "x,]", true ,null]"#).expect("read");
        assert_eq!(records, vec!["1", r#""x,]""#, "true", "null"]);
    }

    #[test]
    fn malformed_arrays_are_refused() {
        for text in [
            "[{\"a\":1}",
            "[{\"a\":1},]",
            "[,{}]",
            "[{}] x",
            "[{} {}]",
            "[{\"a\":\"x",
        ] {
            assert!(read_all(text).is_err(), "{text:?} should be refused");
        }
    }

    #[test]
    fn ndjson_lines_skip_blank_lines_and_trim() {
        let text = "{\"a\":\"[\"}\n\n  {\"b\":2}  \r\n{\"c\":3}";
        let (format, records) = read_all(text).expect("read");
        assert_eq!(format, Format::Ndjson);
        assert_eq!(records, vec![r#"{"a":"["}"#, r#"{"b":2}"#, r#"{"c":3}"#]);
    }

    #[test]
    fn empty_input_is_ndjson_without_records() {
        let (format, records) = read_all("").expect("read");
        assert_eq!(format, Format::Ndjson);
        assert!(records.is_empty());
    }

    #[test]
    fn end_offsets_let_a_reader_resume_mid_array() {
        let text = r#"[ {"id":1}, {"id":"2]"} ,{"id":3} ]"#;
        let (mut reader, format) = RecordReader::detect(Cursor::new(text.as_bytes())).unwrap();
        let first = reader.next_record().unwrap().unwrap();
        assert_eq!(&text[..first.end_offset as usize], r#"[ {"id":1}"#);

        let rest = &text.as_bytes()[first.end_offset as usize..];
        let mut resumed = RecordReader::at_offset(Cursor::new(rest), format, first.end_offset);
        let second = resumed.next_record().unwrap().unwrap();
        assert_eq!(second.bytes, br#"{"id":"2]"}"#);
        let third = resumed.next_record().unwrap().unwrap();
        assert_eq!(third.bytes, br#"{"id":3}"#);
        assert_eq!(third.end_offset as usize, text.len() - 2);
        assert!(resumed.next_record().unwrap().is_none());
        assert_eq!(resumed.offset() as usize, text.len());
    }

    #[test]
    fn end_offsets_let_a_reader_resume_ndjson() {
        let text = "{\"id\":1}\n{\"id\":2}\n";
        let (mut reader, format) = RecordReader::detect(Cursor::new(text.as_bytes())).unwrap();
        let first = reader.next_record().unwrap().unwrap();
        assert_eq!(first.end_offset, 9);
        let rest = &text.as_bytes()[9..];
        let mut resumed = RecordReader::at_offset(Cursor::new(rest), format, 9);
        assert_eq!(
            resumed.next_record().unwrap().unwrap().bytes,
            br#"{"id":2}"#
        );
        assert!(resumed.next_record().unwrap().is_none());
    }

    #[test]
    fn a_byte_order_mark_does_not_hide_the_array() {
        let mut input = b"\xEF\xBB\xBF".to_vec();
        input.extend_from_slice(b"[{}]");
        let (mut reader, format) = RecordReader::detect(Cursor::new(input)).unwrap();
        assert_eq!(format, Format::Array);
        assert_eq!(reader.next_record().unwrap().unwrap().bytes, b"{}");
    }
}

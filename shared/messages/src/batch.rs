//! Batch messages: the records of one request for one stream, in order,
//! packed into as few records-topic messages as a byte bound allows (the
//! API writes them, `quire-kind: batch`; the worker reads them through
//! `records::read`).
//!
//! The payload is a walk of frames, each a record's length (4 bytes, big
//! endian) and its JSON text byte for byte, so a reader finds every record
//! without parsing JSON to find where the next begins (a record's text may
//! hold newlines: the producer's bytes are kept as sent).
//!
//! ```text
//! | len(r0) u32 BE | r0 ... | len(r1) u32 BE | r1 ... | ...
//! ```
//!
//! A record's place in its batch (0, 1, ...) with the message's partition
//! and offset names it.

/// Bytes a frame adds to its record.
pub const FRAME_OVERHEAD: usize = 4;

/// The payloads of the batches that hold `records`, in order: each as
/// large as `max_bytes` allows (frames included), and a record that alone
/// passes it in a batch of its own (the caller bounds record sizes below
/// what the topic accepts).
pub fn pack<'a>(records: impl IntoIterator<Item = &'a [u8]>, max_bytes: usize) -> Vec<Vec<u8>> {
    let mut batches = Vec::new();
    let mut current: Vec<u8> = Vec::new();
    for record in records {
        let framed = FRAME_OVERHEAD + record.len();
        if !current.is_empty() && current.len() + framed > max_bytes {
            batches.push(std::mem::take(&mut current));
        }
        let length = u32::try_from(record.len()).expect("a record under 4 GiB");
        current.extend_from_slice(&length.to_be_bytes());
        current.extend_from_slice(record);
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

/// The records of a batch payload, in order; an `Err` (the payload ends
/// inside a frame) ends the walk.
pub fn records(payload: &[u8]) -> Records<'_> {
    Records { rest: payload }
}

/// See [`records`].
#[derive(Debug, Clone)]
pub struct Records<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Records<'a> {
    type Item = Result<&'a [u8], String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let Some((length, rest)) = self.rest.split_first_chunk::<FRAME_OVERHEAD>() else {
            let left = self.rest.len();
            self.rest = &[];
            return Some(Err(format!(
                "batch ends inside a frame's length ({left} bytes left)"
            )));
        };
        let length = u32::from_be_bytes(*length) as usize;
        if rest.len() < length {
            let left = rest.len();
            self.rest = &[];
            return Some(Err(format!(
                "batch ends inside a record of {length} bytes ({left} bytes left)"
            )));
        }
        let (record, rest) = rest.split_at(length);
        self.rest = rest;
        Some(Ok(record))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_back_in_order_byte_for_byte_across_batches() {
        let sent: Vec<Vec<u8>> = (0..100)
            .map(|seq| {
                format!("{{\"seq\": {seq},\n \"text\": \"{}\"}}", "x".repeat(seq)).into_bytes()
            })
            .collect();
        let batches = pack(sent.iter().map(Vec::as_slice), 1_000);
        assert!(batches.len() > 1, "the bound splits them");
        for batch in &batches {
            let alone = records(batch).count() == 1;
            assert!(batch.len() <= 1_000 || alone, "{} bytes", batch.len());
        }
        let read: Vec<&[u8]> = batches
            .iter()
            .flat_map(|batch| records(batch))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(read, sent.iter().map(Vec::as_slice).collect::<Vec<_>>());
    }

    #[test]
    fn a_record_past_the_bound_goes_alone_and_nothing_is_empty() {
        let big = vec![b'x'; 50];
        let small = b"{}".as_slice();
        let batches = pack([small, big.as_slice(), small], 20);
        assert_eq!(batches.len(), 3);
        assert!(pack(std::iter::empty(), 20).is_empty());
        let empty_record = pack([b"".as_slice()], 20);
        assert_eq!(
            records(&empty_record[0]).collect::<Vec<_>>(),
            [Ok(&b""[..])]
        );
    }

    #[test]
    fn a_truncated_batch_says_where_it_ends() {
        let batch = pack([b"{\"a\":1}".as_slice(), b"{\"b\":2}".as_slice()], 100).remove(0);
        for cut in [batch.len() - 1, 13, 2] {
            let read: Vec<_> = records(&batch[..cut]).collect();
            let last = read.last().unwrap();
            assert!(last.is_err(), "cut at {cut}: {read:?}");
            assert!(read[..read.len() - 1].iter().all(Result::is_ok));
        }
    }
}

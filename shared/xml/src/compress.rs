//! A document's bytes compressed while they stream, on their way from the
//! renderer to the writer: gzip or Zstandard, each deterministic, so the
//! same records fed in the same order give the same bytes on every replay.
//!
//! - gzip: flate2 on miniz_oxide (pure Rust) at [`GZIP_LEVEL`]; the header
//!   carries no time and no file name (mtime 0, OS "unknown").
//! - Zstandard: the reference libzstd (zstd-sys, linked statically, its
//!   version fixed by Cargo.lock) at [`ZSTD_LEVEL`], single-threaded, with
//!   the frame's content checksum, and no content size (a streamed
//!   document's is not known when its frame begins).
//!
//! A compressor hands out what it has emitted after each write, so the
//! writer receives compressed bytes a block at a time and never the whole
//! document. A document whose head is written last (a header's totals) gets
//! that head as a member (gzip) or frame (Zstandard) of its own, placed
//! ahead of the records' one: both formats read consecutive members or
//! frames as one text (RFC 1952 section 2.2, RFC 8878 section 3.1).

use std::io::Write;

use flate2::GzBuilder;
use flate2::write::GzEncoder;
use quire_messages::compression::Compression;

/// Deflate level of gzip reports: the fastest. XML of repeated element names
/// compresses several times over even at level 1, and the worker's CPU is
/// better spent rendering; a change of level changes the bytes of reports
/// rendered again after an upgrade (their manifests follow).
pub const GZIP_LEVEL: u32 = 1;

/// Zstandard level of zstd reports: 1, the fastest of the regular levels.
/// On quire's XML it compresses better than gzip at any level measured and
/// several times faster (`quire-bench writer` prints both), with a 512 KiB
/// window; level 3 was slower and, on record-shaped XML, no smaller.
pub const ZSTD_LEVEL: i32 = 1;

/// Memory one compressor holds, an upper estimate (neither library says):
/// - gzip: miniz_oxide's compressor (its 32 KiB window, hash chains, a
///   64 KiB code buffer and an 85 KiB output buffer, about 320 KiB), flate2's
///   32 KiB output buffer, and the two buffers compressed bytes pass through;
/// - Zstandard at level 1: libzstd's context (`ZSTD_estimateCStreamSize`
///   gives 569 KiB for it) and the stream's 128 KiB output buffer, and the
///   same two buffers.
pub fn state_bytes(compression: Compression) -> u64 {
    match compression {
        Compression::Gzip => 512 * 1024,
        Compression::Zstd => 1024 * 1024,
    }
}

/// One document's compressor.
pub struct Compressor {
    encoder: Encoder,
    /// XML bytes fed in so far.
    uncompressed: u64,
    /// The buffer handed out last, swapped back in so its capacity is reused.
    spare: Vec<u8>,
}

enum Encoder {
    Gzip(GzEncoder<Vec<u8>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl Encoder {
    fn new(compression: Compression) -> std::io::Result<Self> {
        Ok(match compression {
            // No mtime and no file name: the header is the same on every replay.
            Compression::Gzip => Encoder::Gzip(
                GzBuilder::new()
                    .mtime(0)
                    .operating_system(255)
                    .write(Vec::new(), flate2::Compression::new(GZIP_LEVEL)),
            ),
            Compression::Zstd => {
                let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), ZSTD_LEVEL)?;
                encoder.include_checksum(true)?;
                encoder.include_contentsize(false)?;
                Encoder::Zstd(encoder)
            }
        })
    }

    fn write_all(&mut self, xml: &[u8]) -> std::io::Result<()> {
        match self {
            Encoder::Gzip(encoder) => encoder.write_all(xml),
            Encoder::Zstd(encoder) => encoder.write_all(xml),
        }
    }

    fn sink(&mut self) -> &mut Vec<u8> {
        match self {
            Encoder::Gzip(encoder) => encoder.get_mut(),
            Encoder::Zstd(encoder) => encoder.get_mut(),
        }
    }

    fn finish(self) -> std::io::Result<Vec<u8>> {
        match self {
            Encoder::Gzip(encoder) => encoder.finish(),
            Encoder::Zstd(encoder) => encoder.finish(),
        }
    }
}

impl Compressor {
    /// A compressor at the start of a document.
    pub fn new(compression: Compression) -> std::io::Result<Self> {
        Ok(Compressor {
            encoder: Encoder::new(compression)?,
            uncompressed: 0,
            spare: Vec::new(),
        })
    }

    /// Feeds `xml` in; returns the compressed bytes ready to store (maybe none).
    pub fn compress(&mut self, xml: &[u8]) -> std::io::Result<&[u8]> {
        self.encoder.write_all(xml)?;
        self.uncompressed += xml.len() as u64;
        self.spare.clear();
        // The encoder's sink is a plain Vec: swapping it out between writes
        // only moves compressed bytes already emitted.
        std::mem::swap(self.encoder.sink(), &mut self.spare);
        Ok(&self.spare)
    }

    /// Ends the stream: the last compressed bytes and the trailer, and the
    /// XML bytes fed in.
    pub fn finish(self) -> std::io::Result<(Vec<u8>, u64)> {
        Ok((self.encoder.finish()?, self.uncompressed))
    }

    /// A whole member (gzip) or frame (Zstandard) of `xml` alone.
    pub fn whole(compression: Compression, xml: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut encoder = Encoder::new(compression)?;
        encoder.write_all(xml)?;
        encoder.finish()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn decompress(compression: Compression, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        match compression {
            Compression::Gzip => {
                flate2::read::MultiGzDecoder::new(bytes)
                    .read_to_end(&mut out)
                    .unwrap();
            }
            Compression::Zstd => {
                zstd::stream::read::Decoder::new(bytes)
                    .unwrap()
                    .read_to_end(&mut out)
                    .unwrap();
            }
        }
        out
    }

    /// A document of `count` records, fed a record at a time.
    fn stream(compression: Compression, records: &[Vec<u8>]) -> (Vec<u8>, u64) {
        let mut compressor = Compressor::new(compression).unwrap();
        let mut stored = Vec::new();
        for record in records {
            stored.extend_from_slice(compressor.compress(record).unwrap());
        }
        let (trailer, uncompressed) = compressor.finish().unwrap();
        stored.extend_from_slice(&trailer);
        (stored, uncompressed)
    }

    fn records(count: usize) -> Vec<Vec<u8>> {
        (0..count)
            .map(|index| {
                format!(
                    "<record seq=\"{index}\"><id>o-{}</id><note>{}</note></record>\n",
                    index * 7919 % 10007,
                    "x".repeat(index % 37)
                )
                .into_bytes()
            })
            .collect()
    }

    #[test]
    fn a_streamed_document_decompresses_to_its_xml_and_the_same_records_give_the_same_bytes() {
        let records = records(20_000);
        let xml: Vec<u8> = records.concat();
        for compression in Compression::ALL {
            let (stored, uncompressed) = stream(compression, &records);
            assert_eq!(uncompressed, xml.len() as u64);
            assert!(
                stored.len() * 4 < xml.len(),
                "{compression}: {} of {}",
                stored.len(),
                xml.len()
            );
            assert_eq!(decompress(compression, &stored), xml, "{compression}");
            assert_eq!(
                stream(compression, &records).0,
                stored,
                "{compression}: replay differs"
            );
        }
    }

    #[test]
    fn compressed_bytes_are_handed_out_while_the_document_streams() {
        let records = records(50_000);
        for compression in Compression::ALL {
            let mut compressor = Compressor::new(compression).unwrap();
            let mut handed_out = 0;
            for record in &records {
                handed_out += compressor.compress(record).unwrap().len();
            }
            let (trailer, _) = compressor.finish().unwrap();
            assert!(
                handed_out > trailer.len() * 4,
                "{compression}: {handed_out} bytes before the end, {} at it",
                trailer.len()
            );
        }
    }

    #[test]
    fn a_head_written_last_is_a_member_or_frame_read_before_the_records() {
        let records = records(1_000);
        let head = b"<?xml version=\"1.0\"?><report><header total=\"3\"/>".to_vec();
        for compression in Compression::ALL {
            let (body, _) = stream(compression, &records);
            let mut stored = Compressor::whole(compression, &head).unwrap();
            assert_eq!(
                stored,
                Compressor::whole(compression, &head).unwrap(),
                "{compression}: the same head compresses to the same bytes"
            );
            stored.extend_from_slice(&body);
            let mut expected = head.clone();
            expected.extend(records.concat());
            assert_eq!(decompress(compression, &stored), expected, "{compression}");
        }
    }

    /// gunzip itself reads a head member and the records' member as one
    /// document.
    #[test]
    fn gunzip_reads_every_member() {
        let records = records(2_000);
        let head = b"<?xml version=\"1.0\"?><report>".to_vec();
        let mut stored = Compressor::whole(Compression::Gzip, &head).unwrap();
        stored.extend_from_slice(&stream(Compression::Gzip, &records).0);
        let dir = std::env::temp_dir().join(format!("quire-gz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("members.xml.gz");
        std::fs::write(&file, &stored).unwrap();
        let gunzip = std::process::Command::new("gzip")
            .args(["-dc", file.to_str().unwrap()])
            .output()
            .expect("gzip is installed");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(gunzip.status.success());
        let mut expected = head;
        expected.extend(records.concat());
        assert_eq!(gunzip.stdout, expected);
    }

    #[test]
    fn the_formats_are_what_their_extensions_say() {
        let (gzip, _) = stream(Compression::Gzip, &records(10));
        assert_eq!(&gzip[..2], &[0x1f, 0x8b], "gzip magic");
        // RFC 1952: magic, CM=8, FLG (no FNAME/FCOMMENT/FEXTRA), MTIME, XFL, OS.
        assert_eq!(gzip[2], 8, "deflate");
        assert_eq!(gzip[3], 0, "no file name, comment or extra field");
        assert_eq!(&gzip[4..8], &[0, 0, 0, 0], "no modification time");
        assert_eq!(gzip[9], 255, "operating system unknown");
        let (zstd, _) = stream(Compression::Zstd, &records(10));
        assert_eq!(&zstd[..4], &[0x28, 0xb5, 0x2f, 0xfd], "zstd frame magic");
        // Frame header descriptor: the content checksum flag (bit 2) set,
        // no content size (bits 6-7 clear, single-segment bit 5 clear).
        let descriptor = zstd[4];
        assert_eq!(descriptor & 0b0000_0100, 0b0000_0100, "content checksum");
        assert_eq!(descriptor & 0b1110_0000, 0, "no content size");
    }
}

//! S3 additional checksums: computed by the writer for every part while the
//! document streams, sent with the part so the server verifies it before it
//! stores it, and combined into the object's checksum, which the completion
//! sends (CRC32C, a full-object checksum the server verifies too) or checks
//! against the server's answer (SHA-256, composite).
//!
//! S3 writes checksums as the base64 of their big-endian bytes; a composite
//! one is the checksum of the parts' checksums (their bytes, in part order)
//! followed by `-N`, N the number of parts.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use crc_fast::CrcAlgorithm::Crc32Iscsi;
use quire_config::ChecksumChoice;
use sha2::{Digest as _, Sha256};

/// One part's checksum, as computed from its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartChecksum {
    /// CRC-32C (Castagnoli, `CRC-32/ISCSI`), and the part's length, which
    /// combining it into the object's CRC needs.
    Crc32c {
        crc: u32,
        length: u64,
    },
    Sha256([u8; 32]),
}

impl PartChecksum {
    /// The checksum `choice` asks for, of `bytes`; `None` without one.
    pub(crate) fn of(choice: ChecksumChoice, bytes: &[u8]) -> Option<Self> {
        match choice {
            ChecksumChoice::Crc32c => Some(PartChecksum::Crc32c {
                crc: crc_fast::crc32_iscsi(bytes),
                length: bytes.len() as u64,
            }),
            ChecksumChoice::Sha256 => Some(PartChecksum::Sha256(Sha256::digest(bytes).into())),
            ChecksumChoice::None => None,
        }
    }

    /// [`PartChecksum::of`] on the blocking pool: hashing 8 MiB would hold a
    /// runtime worker (and the connections it drives) for milliseconds.
    pub(crate) async fn compute(choice: ChecksumChoice, part: &Bytes) -> Option<Self> {
        if choice == ChecksumChoice::None {
            return None;
        }
        let part = part.clone();
        match tokio::task::spawn_blocking(move || PartChecksum::of(choice, &part)).await {
            Ok(checksum) => checksum,
            // The blocking pool is shutting down: so is the process.
            Err(_) => None,
        }
    }

    /// The value S3 sends and stores: base64 of the big-endian bytes.
    pub(crate) fn base64(&self) -> String {
        match self {
            PartChecksum::Crc32c { crc, .. } => BASE64.encode(crc.to_be_bytes()),
            PartChecksum::Sha256(digest) => BASE64.encode(digest),
        }
    }
}

/// The checksum of a stored object, as the manifest, the event and the API
/// give it to readers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredChecksum {
    /// `CRC32C` or `SHA256`, as S3 names them.
    pub algorithm: &'static str,
    /// `FULL_OBJECT` (the checksum of the object's bytes) or `COMPOSITE`
    /// (of its parts' checksums).
    pub kind: &'static str,
    /// Base64, with `-N` for a composite checksum of N parts.
    pub value: String,
}

pub const FULL_OBJECT: &str = "FULL_OBJECT";
pub const COMPOSITE: &str = "COMPOSITE";

/// The object's checksum from its parts' checksums, in part order: the
/// CRC32C of the whole object (combined, not recomputed), or the composite
/// SHA-256. A single PutObject's SHA-256 is the object's own, a full-object
/// one. `None` when a part has none or the parts disagree on the algorithm.
pub(crate) fn object_checksum(parts: &[PartChecksum], single_put: bool) -> Option<StoredChecksum> {
    match parts.first()? {
        PartChecksum::Crc32c { .. } => {
            let mut crc = 0u64;
            for (index, part) in parts.iter().enumerate() {
                let PartChecksum::Crc32c {
                    crc: part_crc,
                    length,
                } = *part
                else {
                    return None;
                };
                crc = if index == 0 {
                    u64::from(part_crc)
                } else {
                    crc_fast::checksum_combine(Crc32Iscsi, crc, u64::from(part_crc), length)
                };
            }
            let crc = u32::try_from(crc).ok()?;
            Some(StoredChecksum {
                algorithm: "CRC32C",
                kind: FULL_OBJECT,
                value: BASE64.encode(crc.to_be_bytes()),
            })
        }
        PartChecksum::Sha256(digest) if single_put => Some(StoredChecksum {
            algorithm: "SHA256",
            kind: FULL_OBJECT,
            value: BASE64.encode(digest),
        }),
        PartChecksum::Sha256(_) => {
            let mut of_parts = Sha256::new();
            for part in parts {
                let PartChecksum::Sha256(digest) = part else {
                    return None;
                };
                of_parts.update(digest);
            }
            Some(StoredChecksum {
                algorithm: "SHA256",
                kind: COMPOSITE,
                value: format!("{}-{}", BASE64.encode(of_parts.finalize()), parts.len()),
            })
        }
    }
}

/// Whether the checksum a server answered with is `expected`: equal, or,
/// for a composite one, equal in value where the server leaves out `-N`.
pub(crate) fn answers_match(expected: &StoredChecksum, answered: &str) -> bool {
    answered == expected.value
        || (expected.kind == COMPOSITE
            && expected
                .value
                .rsplit_once('-')
                .is_some_and(|(value, _)| value == answered))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The combined CRC32C of the parts is the CRC32C of the whole, for
    /// parts of any sizes; the values are RFC 3720's check value and S3's
    /// base64 of its big-endian bytes.
    #[test]
    fn the_object_crc_combines_the_parts_crcs() {
        assert_eq!(crc_fast::crc32_iscsi(b"123456789"), 0xE306_9283);
        let whole: Vec<u8> = (0..100_000u32)
            .map(|index| (index * 7 % 251) as u8)
            .collect();
        for cuts in [vec![], vec![1], vec![8191, 8192], vec![3, 50_000, 99_999]] {
            let mut parts = Vec::new();
            let mut start = 0;
            for &cut in cuts.iter().chain(std::iter::once(&whole.len())) {
                parts.push(PartChecksum::of(ChecksumChoice::Crc32c, &whole[start..cut]).unwrap());
                start = cut;
            }
            let object = object_checksum(&parts, false).unwrap();
            let expected = BASE64.encode(crc_fast::crc32_iscsi(&whole).to_be_bytes());
            assert_eq!(
                (object.kind, object.value.as_str()),
                (FULL_OBJECT, expected.as_str()),
                "{cuts:?}"
            );
        }
    }

    #[test]
    fn a_composite_sha256_is_the_digest_of_the_parts_digests() {
        let parts = [b"first part".as_slice(), b"second"];
        let digests: Vec<PartChecksum> = parts
            .iter()
            .map(|part| PartChecksum::of(ChecksumChoice::Sha256, part).unwrap())
            .collect();
        let object = object_checksum(&digests, false).unwrap();
        let mut concatenated = Vec::new();
        for part in parts {
            concatenated.extend_from_slice(&Sha256::digest(part));
        }
        let expected = format!("{}-2", BASE64.encode(Sha256::digest(&concatenated)));
        assert_eq!((object.kind, object.value.clone()), (COMPOSITE, expected));
        assert!(answers_match(&object, &object.value));
        assert!(answers_match(
            &object,
            object.value.rsplit_once('-').unwrap().0
        ));
        assert!(!answers_match(&object, "AAAA-2"));
        let single = object_checksum(&digests[..1], true).unwrap();
        assert_eq!(single.value, BASE64.encode(Sha256::digest(b"first part")));
        assert_eq!(single.kind, FULL_OBJECT);
        assert!(object_checksum(&[], false).is_none());
        assert!(PartChecksum::of(ChecksumChoice::None, b"x").is_none());
    }
}

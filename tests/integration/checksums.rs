//! S3 additional checksums (issue 31), on the real S3 server: every part
//! and object the writer stores carries a checksum computed while it
//! streams, which the server verifies before it stores the bytes, and
//! answers when asked; a part whose bytes change on the way is refused by
//! the server and sent again, never stored corrupted.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use quire_config::ChecksumChoice;
use quire_s3::aws_sdk_s3::types::ChecksumMode;
use quire_s3::{RetryPolicy, UploadPolicy, WrittenObject};
use quire_tests::s3::{Fault, FaultProxy, TestBucket};
use sha2::{Digest, Sha256};

const MIB: usize = 1024 * 1024;
const PART_SIZE: usize = 8 * MIB;

fn policy(checksum: ChecksumChoice) -> UploadPolicy {
    let mut policy = UploadPolicy::for_max_object_size(64 * MIB as u64);
    policy.checksum = checksum;
    policy.retry = RetryPolicy {
        max_attempts: 3,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(50),
    };
    policy
}

/// `length` bytes that differ from part to part.
fn content(length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| (index * 31 % 251) as u8 ^ (index / PART_SIZE) as u8)
        .collect()
}

/// The checksum the server answers for `key` (HeadObject with checksum
/// mode on), of `algorithm`.
async fn answered(bucket: &TestBucket, key: &str, algorithm: &str) -> Option<String> {
    let head = bucket
        .client
        .head_object()
        .bucket(&bucket.name)
        .key(key)
        .checksum_mode(ChecksumMode::Enabled)
        .send()
        .await
        .expect("HeadObject");
    match algorithm {
        "CRC32C" => head.checksum_crc32_c().map(str::to_owned),
        _ => head.checksum_sha256().map(str::to_owned),
    }
}

/// What the object's checksum must be, computed here from its bytes as
/// stored (and its parts' boundaries, for a composite one).
fn expected(choice: ChecksumChoice, stored: &[u8], parts: &[&[u8]], single_put: bool) -> String {
    match choice {
        ChecksumChoice::Crc32c => BASE64.encode(crc_fast::crc32_iscsi(stored).to_be_bytes()),
        ChecksumChoice::Sha256 if single_put => BASE64.encode(Sha256::digest(stored)),
        ChecksumChoice::Sha256 => {
            let mut digests = Vec::new();
            for part in parts {
                digests.extend_from_slice(&Sha256::digest(part));
            }
            format!(
                "{}-{}",
                BASE64.encode(Sha256::digest(&digests)),
                parts.len()
            )
        }
        ChecksumChoice::None => unreachable!("no checksum expected"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_report_is_stored_with_a_checksum_the_server_verified_and_answers() {
    let bucket = TestBucket::create("checksums").await;
    let handle = bucket.handle();
    let head = b"<?xml version=\"1.0\"?>\n<head>known at the end</head>\n".to_vec();
    for choice in [
        ChecksumChoice::Crc32c,
        ChecksumChoice::Sha256,
        ChecksumChoice::None,
    ] {
        for (shape, length, held) in [
            ("single", 1000, false),
            ("parts", 2 * PART_SIZE + 3, false),
            ("held", 2 * PART_SIZE + 3, true),
        ] {
            let key = format!("reports/s/{choice:?}-{shape}.xml");
            let body = content(length);
            let mut writer = handle.writer(&key, &policy(choice)).unwrap();
            if held {
                writer.hold_first_part();
            }
            writer.append(&body).await.unwrap();
            let written: WrittenObject = if held {
                writer.finish_with_head(&head).await.expect("finish")
            } else {
                writer.finish().await.expect("finish")
            };
            let stored = bucket.read(&key).await.expect("stored");
            let whole: Vec<u8> = if held {
                head.iter().chain(&body).copied().collect()
            } else {
                body.clone()
            };
            assert!(stored == whole, "{key}: the bytes written");
            let Some(checksum) = written.checksum else {
                assert_eq!(choice, ChecksumChoice::None, "{key}: a checksum");
                continue;
            };
            assert_ne!(choice, ChecksumChoice::None, "{key}: no checksum asked");
            let first_part = if held {
                head.len() + PART_SIZE
            } else {
                PART_SIZE
            };
            let parts: Vec<&[u8]> = if written.single_put {
                vec![&stored[..]]
            } else {
                let mut parts = vec![&stored[..first_part]];
                parts.extend(stored[first_part..].chunks(PART_SIZE));
                parts
            };
            let want = expected(choice, &stored, &parts, written.single_put);
            assert_eq!(
                checksum.value, want,
                "{key}: the checksum of the stored bytes"
            );
            assert_eq!(
                checksum.kind,
                if choice == ChecksumChoice::Sha256 && !written.single_put {
                    "COMPOSITE"
                } else {
                    "FULL_OBJECT"
                },
                "{key}"
            );
            let answer = answered(&bucket, &key, checksum.algorithm)
                .await
                .unwrap_or_else(|| {
                    panic!(
                        "{key}: the server stores no {} checksum",
                        checksum.algorithm
                    )
                });
            let value_only = want.split('-').next().unwrap_or_default();
            assert!(
                answer == want || answer == value_only,
                "{key}: the server answers {answer}, not {want}"
            );
        }
    }
}

/// One bit of the first part flipped between the writer and the server,
/// with unsigned payloads (SigV4's payload hash would refuse it too; the
/// checksum is what guards the bytes when it does not sign them).
async fn write_through_a_bit_flip(checksum: ChecksumChoice) -> (Vec<u8>, Vec<u8>, u32, u64) {
    let bucket = TestBucket::create("checksums").await;
    let proxy = FaultProxy::start(&bucket.settings.endpoint, |seen| {
        (seen.ordinal == 1).then_some(Fault::FlipBit)
    })
    .await;
    let handle = bucket.handle_through(&proxy).await;
    let mut policy = policy(checksum);
    policy.sign_payload = false;
    let key = "reports/s/flipped.xml";
    let body = content(2 * PART_SIZE + 10);
    let mut writer = handle.writer(key, &policy).unwrap();
    writer.append(&body).await.unwrap();
    writer.finish().await.expect("finish");
    assert_eq!(proxy.faults_injected(), 1, "one bit flipped");
    let stored = bucket.read(key).await.expect("stored");
    (
        body,
        stored,
        proxy.upload_parts_seen(),
        handle.counters().snapshot().retries,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_corrupted_on_the_way_is_refused_by_the_server_and_sent_again() {
    let (body, stored, parts_seen, retries) =
        write_through_a_bit_flip(ChecksumChoice::Crc32c).await;
    assert!(stored == body, "the stored object is the document written");
    assert_eq!(
        (parts_seen, retries),
        (4, 1),
        "3 parts, the flipped one sent twice"
    );

    // Without a checksum the same flip is stored as it arrived: what the
    // checksum guards against.
    let (body, stored, parts_seen, retries) = write_through_a_bit_flip(ChecksumChoice::None).await;
    assert!(
        stored != body,
        "without a checksum the corrupted part is stored"
    );
    assert_eq!((parts_seen, retries), (3, 0));
}

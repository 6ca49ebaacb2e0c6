//! The buffered multipart writer, against the real S3 server: each test names
//! the behaviour it checks.

use std::process::Stdio;
use std::time::Duration;

use quire_s3::{
    MemoryPolicy, MemoryPool, RetryPolicy, S3Bucket, UploadPolicy, WriterError, WrittenObject,
};
use quire_tests::s3::{Fault, FaultProxy, TestBucket};
use quire_tests::sha256_hex;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const MIB: usize = 1024 * 1024;
/// Declared maximum for most tests: small enough that parts stay at 8 MiB.
const SMALL_MAXIMUM: u64 = 64 * MIB as u64;
const PART_SIZE: usize = 8 * MIB;

fn small_policy() -> UploadPolicy {
    UploadPolicy::for_max_object_size(SMALL_MAXIMUM)
}

/// Fast retries, so the fault tests do not wait for production backoffs.
fn quick_retry_policy(max_attempts: u32) -> UploadPolicy {
    let mut policy = small_policy();
    policy.retry = RetryPolicy {
        max_attempts,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(50),
    };
    policy
}

/// `length` bytes in the seed's shape: `(i)` then padding, one per line.
fn document(length: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(length + 64);
    let mut index = 0u64;
    while bytes.len() < length {
        bytes.extend_from_slice(format!("({index})").as_bytes());
        bytes.extend_from_slice(b".............................\n");
        index += 1;
    }
    bytes.truncate(length);
    bytes
}

/// Deletes the bucket, which the server refuses while it holds anything,
/// even a part that no listing shows. A server may store a part whose
/// request the client dropped after the abort, so the check waits a little
/// for such a part to land first.
async fn assert_nothing_left_behind(bucket: TestBucket) {
    tokio::time::sleep(Duration::from_millis(500)).await;
    bucket
        .delete()
        .await
        .expect("no part outlived the abort: the bucket is empty");
}

/// Appends `content` in slices whose sizes cycle through `append_sizes`.
async fn write_in_slices(
    bucket: &S3Bucket,
    key: &str,
    content: &[u8],
    append_sizes: &[usize],
) -> WrittenObject {
    let mut writer = bucket.writer(key, &small_policy()).expect("writer");
    let mut rest = content;
    for size in append_sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (slice, remainder) = rest.split_at((*size).min(rest.len()));
        writer.append(slice).await.expect("append");
        rest = remainder;
    }
    writer.finish().await.expect("finish")
}

/// Writes `length` bytes, reads them back, and checks bytes, size, SHA-256
/// and the part count.
async fn round_trip(length: usize, append_sizes: &[usize]) -> WrittenObject {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let key = format!("reports/stream/{length}.xml");
    let content = document(length);

    let written = write_in_slices(&handle, &key, &content, append_sizes).await;

    assert_eq!(written.bytes, length as u64);
    assert_eq!(written.key, key);
    assert_eq!(written.sha256_hex, sha256_hex(&content), "streamed SHA-256");
    let stored = bucket.read(&key).await.expect("the object exists");
    assert_eq!(stored.len(), length, "stored size");
    assert!(
        stored == content,
        "stored bytes differ from the written bytes"
    );
    assert_eq!(
        written.parts as usize,
        length.div_ceil(PART_SIZE).max(1),
        "parts of {PART_SIZE} bytes"
    );
    assert!(
        bucket.pending_uploads("").await.is_empty(),
        "no upload left pending"
    );
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_document_is_one_put_object_and_creates_no_multipart_upload() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let content = document(1000);

    let written = write_in_slices(&handle, "reports/s/small.xml", &content, &[37]).await;

    assert!(written.single_put, "one PutObject");
    assert_eq!(written.parts, 1);
    let counters = handle.counters().snapshot();
    assert_eq!(counters.single_puts, 1);
    assert_eq!(counters.parts_uploaded, 0, "no UploadPart was made");
    assert_eq!(counters.bytes_uploaded, 1000);
    assert!(bucket.pending_uploads("").await.is_empty());
    assert_eq!(bucket.read("reports/s/small.xml").await.unwrap(), content);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_document_is_an_empty_object() {
    let written = round_trip(0, &[1]).await;
    assert!(written.single_put);
    assert_eq!(
        written.sha256_hex,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_byte_document_reads_back_identical() {
    assert!(round_trip(1, &[1]).await.single_put);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_of_exactly_one_part_is_one_put_object() {
    let written = round_trip(PART_SIZE, &[65_536]).await;
    assert!(
        written.single_put,
        "exactly one part needs no multipart upload"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_part_and_one_byte_is_a_multipart_upload_of_two_parts() {
    let written = round_trip(PART_SIZE + 1, &[PART_SIZE, 1]).await;
    assert!(!written.single_put);
    assert_eq!(written.parts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_parts_from_odd_append_sizes_read_back_identical() {
    // Sizes that straddle part boundaries in every way: tiny, odd, larger
    // than a part.
    let append_sizes = [1, 37, 4093, 65_537, 1_000_003, PART_SIZE + 12_345, 3];
    let written = round_trip(3 * PART_SIZE + 777_777, &append_sizes).await;
    assert_eq!(written.parts, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_write_interface_writes_the_same_bytes() {
    let bucket = TestBucket::create("writer").await;
    let content = document(2 * PART_SIZE + 99);
    let mut writer = bucket
        .handle()
        .writer("reports/s/async.xml", &small_policy())
        .unwrap();
    for chunk in content.chunks(100_003) {
        writer.write_all(chunk).await.expect("write_all");
    }
    writer.flush().await.expect("flush reports no failure");
    let written = writer.finish().await.expect("finish");

    assert_eq!(written.parts, 3);
    assert_eq!(written.sha256_hex, sha256_hex(&content));
    assert!(bucket.read("reports/s/async.xml").await.unwrap() == content);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_payloads_store_the_same_bytes_in_single_puts_and_parts() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let mut policy = small_policy();
    policy.sign_payload = false;
    for length in [100, 2 * PART_SIZE + 3] {
        let key = format!("reports/s/unsigned-{length}.xml");
        let content = document(length);
        let mut writer = handle.writer(&key, &policy).unwrap();
        writer.append(&content).await.unwrap();
        let written = writer.finish().await.expect("finish");

        assert_eq!(written.single_put, length < PART_SIZE);
        assert_eq!(written.sha256_hex, sha256_hex(&content));
        assert!(bucket.read(&key).await.unwrap() == content);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_past_the_declared_maximum_fails_clearly_and_keeps_what_was_written() {
    let bucket = TestBucket::create("writer").await;
    let policy = UploadPolicy::for_max_object_size(100);
    let mut writer = bucket
        .handle()
        .writer("reports/s/max.xml", &policy)
        .unwrap();
    writer.append(&document(100)).await.unwrap();

    let error = writer.append(b"!").await.unwrap_err();

    assert!(
        matches!(error, WriterError::ObjectTooLarge { .. }),
        "{error}"
    );
    assert!(
        error.to_string().contains("declared maximum of 100 bytes"),
        "{error}"
    );
    let written = writer.finish().await.expect("finish");
    assert_eq!(written.bytes, 100);
    assert_eq!(bucket.size("reports/s/max.xml").await, Some(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_leaves_no_object_and_no_pending_upload() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let key = "reports/s/aborted.xml";
    let mut writer = handle.writer(key, &small_policy()).unwrap();
    writer.append(&document(2 * PART_SIZE + 5)).await.unwrap();
    assert_eq!(
        bucket.pending_uploads(key).await.len(),
        1,
        "the upload is under way"
    );

    writer.abort().await.expect("abort");

    assert!(bucket.pending_uploads(key).await.is_empty());
    assert_eq!(bucket.size(key).await, None, "no object");
    assert_eq!(handle.counters().snapshot().uploads_aborted, 1);
    assert_nothing_left_behind(bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_without_finish_aborts_the_upload_in_the_background() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let key = "reports/s/dropped.xml";
    let mut writer = handle.writer(key, &small_policy()).unwrap();
    writer.append(&document(PART_SIZE + 1)).await.unwrap();
    assert_eq!(bucket.pending_uploads(key).await.len(), 1);

    drop(writer);

    assert!(
        bucket
            .no_pending_upload_within(key, Duration::from_secs(20))
            .await,
        "the spawned abort did not happen"
    );
    assert_eq!(bucket.size(key).await, None, "no object");
    // The server may list the upload as gone a moment before the abort's
    // answer reaches the spawned task that counts it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while handle.counters().snapshot().uploads_aborted == 0 && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handle.counters().snapshot().uploads_aborted, 1);
    assert_nothing_left_behind(bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_take_over_sweep_aborts_the_upload_of_a_killed_writer_and_only_under_its_prefix() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let dead_key = "reports/dead-stream/00000000000000000007.xml";
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_abandoned-upload"))
        .arg(&bucket.name)
        .arg(dead_key)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the abandoned-upload child");
    let mut child_output = BufReader::new(child.stdout.take().unwrap()).lines();
    let first_line = tokio::time::timeout(Duration::from_secs(60), child_output.next_line())
        .await
        .expect("the child reports its part within 60 s")
        .expect("read the child's output");
    assert_eq!(first_line.as_deref(), Some("part uploaded"));
    // SIGKILL: no destructor, no abort.
    child.kill().await.expect("kill the child");
    // A live writer under another prefix, which the sweep must leave alone.
    let live_key = "reports/live-stream/00000000000000000001.xml";
    let mut live_writer = handle.writer(live_key, &small_policy()).unwrap();
    live_writer.append(&document(PART_SIZE + 1)).await.unwrap();
    assert_eq!(bucket.pending_uploads(dead_key).await.len(), 1);

    let aborted = handle
        .abort_pending_uploads("reports/dead-stream/")
        .await
        .expect("sweep");

    assert_eq!(aborted, 1);
    assert!(bucket.pending_uploads(dead_key).await.is_empty());
    assert_eq!(bucket.size(dead_key).await, None);
    assert_eq!(
        bucket.pending_uploads(live_key).await.len(),
        1,
        "other prefixes are not swept"
    );
    let written = live_writer
        .finish()
        .await
        .expect("the live writer finishes");
    assert_eq!(written.parts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_that_fails_once_with_503_is_retried_and_the_object_is_correct() {
    let bucket = TestBucket::create("writer").await;
    let proxy = FaultProxy::start(&bucket.settings.endpoint, |seen| {
        (seen.ordinal == 2).then_some(Fault::ServiceUnavailable)
    })
    .await;
    let handle = bucket.handle_through(&proxy).await;
    let content = document(3 * PART_SIZE + 10);
    let mut writer = handle
        .writer("reports/s/retried.xml", &quick_retry_policy(3))
        .unwrap();
    writer.append(&content).await.unwrap();

    let written = writer.finish().await.expect("the retry succeeds");

    assert_eq!(proxy.faults_injected(), 1);
    assert_eq!(proxy.upload_parts_seen(), 5, "4 parts and 1 retry");
    let counters = handle.counters().snapshot();
    assert_eq!(counters.retries, 1);
    assert_eq!(counters.parts_uploaded, 4);
    assert_eq!(written.sha256_hex, sha256_hex(&content));
    assert!(bucket.read("reports/s/retried.xml").await.unwrap() == content);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_whose_connection_is_reset_is_retried_and_the_object_is_correct() {
    let bucket = TestBucket::create("writer").await;
    let proxy = FaultProxy::start(&bucket.settings.endpoint, |seen| {
        (seen.ordinal == 1).then_some(Fault::ResetConnection)
    })
    .await;
    let handle = bucket.handle_through(&proxy).await;
    let content = document(PART_SIZE + 4096);
    let mut writer = handle
        .writer("reports/s/reset.xml", &quick_retry_policy(3))
        .unwrap();
    writer.append(&content).await.unwrap();

    let written = writer.finish().await.expect("the retry succeeds");

    assert_eq!(proxy.faults_injected(), 1);
    assert_eq!(handle.counters().snapshot().retries, 1);
    assert_eq!(written.parts, 2);
    assert!(bucket.read("reports/s/reset.xml").await.unwrap() == content);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_that_always_fails_ends_in_an_error_and_an_aborted_upload() {
    let bucket = TestBucket::create("writer").await;
    let proxy = FaultProxy::start(&bucket.settings.endpoint, |seen| {
        (seen.part_number == 2).then_some(Fault::ServiceUnavailable)
    })
    .await;
    let handle = bucket.handle_through(&proxy).await;
    let key = "reports/s/failed.xml";
    let mut writer = handle.writer(key, &quick_retry_policy(3)).unwrap();

    // The failure surfaces on a later append or on finish, whichever meets it.
    let mut outcome = Ok(());
    for chunk in document(4 * PART_SIZE + 1).chunks(MIB) {
        outcome = writer.append(chunk).await;
        if outcome.is_err() {
            break;
        }
    }
    let error = match outcome {
        Err(error) => error,
        Ok(()) => writer.finish().await.expect_err("part 2 never succeeds"),
    };

    match &error {
        WriterError::S3 {
            operation,
            attempts,
            status,
            ..
        } => {
            assert_eq!(*operation, "UploadPart");
            assert_eq!(*attempts, 3, "every attempt the policy allows");
            assert_eq!(*status, Some(503));
        }
        other => panic!("expected the part's S3 error, got {other}"),
    }
    assert_eq!(proxy.faults_injected(), 3);
    assert!(
        bucket.pending_uploads(key).await.is_empty(),
        "the upload was aborted before the error was returned"
    );
    assert_eq!(bucket.size(key).await, None, "no object");
    assert_eq!(handle.counters().snapshot().uploads_aborted, 1);
    drop(proxy);
    assert_nothing_left_behind(bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_one_gib_keeps_the_buffered_bytes_under_the_bound() {
    const GIB: usize = 1024 * MIB;
    let bucket = TestBucket::create("writer").await;
    let key = "reports/s/one-gib.xml";
    let policy = UploadPolicy::for_max_object_size(GIB as u64);
    let bound = policy.memory_bound();
    assert_eq!(bound, 5 * PART_SIZE as u64);
    let mut writer = bucket.handle().writer(key, &policy).unwrap();
    // The bytes are made on the fly from one 1 MiB block, appended in odd
    // slices; the test never holds the document.
    let block = document(MIB);
    let mut expected_hasher = Sha256::new();
    let mut written_so_far = 0usize;
    let mut highest_buffered_seen = 0u64;
    let mut slice_size = 1usize;
    while written_so_far < GIB {
        let offset = written_so_far % MIB;
        let length = slice_size.min(MIB - offset).min(GIB - written_so_far);
        let slice = &block[offset..offset + length];
        writer.append(slice).await.expect("append");
        expected_hasher.update(slice);
        written_so_far += length;
        highest_buffered_seen = highest_buffered_seen.max(writer.buffered_bytes());
        slice_size = (slice_size * 7 + 13) % 300_007 + 1;
    }
    let peak = writer.peak_buffered_bytes();

    let written = writer.finish().await.expect("finish");

    assert!(peak <= bound, "peak {peak} over the bound {bound}");
    assert!(
        highest_buffered_seen <= peak,
        "the peak covers every sample"
    );
    assert!(
        peak > PART_SIZE as u64,
        "parts were in flight while a buffer filled (peak {peak})"
    );
    assert_eq!(written.bytes, GIB as u64);
    assert_eq!(written.parts, 128);
    let expected = hex::encode(expected_hasher.finalize());
    assert_eq!(written.sha256_hex, expected);
    assert_eq!(bucket.size(key).await, Some(GIB as i64));
}

/// A pool whose budget leaves room for one part of buffers: once `hog`
/// holds it, every other writer of the pool must spill.
fn spilling_pool(handle: &S3Bucket, spill_dir: &std::path::Path) -> std::sync::Arc<MemoryPool> {
    let policy = MemoryPolicy {
        budget_bytes: 2 * PART_SIZE as u64,
        parts_in_flight: 1,
        part_size: PART_SIZE as u64,
        spill_dir: Some(spill_dir.to_owned()),
        spill_max_bytes: 64 * MIB as u64,
    };
    std::sync::Arc::new(MemoryPool::new(policy, handle.counters().clone()).expect("pool"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_past_the_memory_budget_spill_to_disk_and_read_back_identical() {
    let bucket = TestBucket::create("writer").await;
    let spill_dir = std::env::temp_dir().join(quire_tests::unique("quire-writer-spill"));
    let plain = bucket.handle();
    let pool = spilling_pool(&plain, &spill_dir);
    let handle = plain.with_memory(pool.clone());
    let hog_content = document(PART_SIZE - 5);
    let mut hog = handle.writer("reports/s/hog.xml", &small_policy()).unwrap();
    hog.append(&hog_content).await.unwrap();
    assert!(
        hog.spilled_bytes() == 0,
        "the first writer fits in the budget"
    );

    // Past the budget: a small document and one of several parts, in odd
    // slices, all through the spill.
    for (name, length) in [("small", 3 * MIB + 17), ("parts", 2 * PART_SIZE + 777_777)] {
        let key = format!("reports/s/spilled-{name}.xml");
        let content = document(length);
        let mut writer = handle.writer(&key, &small_policy()).unwrap();
        let mut spilled = 0;
        for slice in content.chunks(4093) {
            writer.append(slice).await.unwrap();
            spilled = spilled.max(writer.spilled_bytes());
        }
        assert!(spilled > 0, "{name}: spilled");
        assert!(
            pool.snapshot().buffered_bytes <= PART_SIZE as u64,
            "buffers stay within the budget less the in-flight reserve"
        );
        let written = writer.finish().await.expect("finish");
        assert_eq!(written.single_put, length < PART_SIZE, "{name}");
        assert_eq!(written.sha256_hex, sha256_hex(&content), "{name}");
        assert!(bucket.read(&key).await.unwrap() == content, "{name}");
    }
    let written = hog.finish().await.unwrap();
    assert_eq!(written.sha256_hex, sha256_hex(&hog_content));
    assert_eq!(pool.snapshot().spilled_bytes, 0);
    assert_eq!(pool.snapshot().in_flight_bytes, 0);
    assert_eq!(pool.snapshot().over_budget_bytes, 0);
    let left = std::fs::read_dir(&spill_dir).unwrap().count();
    std::fs::remove_dir_all(&spill_dir).unwrap();
    assert_eq!(left, 0, "spill files are removed once read back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_spilled_document_leaves_no_spill_file() {
    let bucket = TestBucket::create("writer").await;
    let spill_dir = std::env::temp_dir().join(quire_tests::unique("quire-writer-spill"));
    let plain = bucket.handle();
    let pool = spilling_pool(&plain, &spill_dir);
    let handle = plain.with_memory(pool.clone());
    let mut hog = handle.writer("reports/s/hog.xml", &small_policy()).unwrap();
    hog.append(&document(PART_SIZE)).await.unwrap();
    let mut writer = handle
        .writer("reports/s/aborted.xml", &small_policy())
        .unwrap();
    writer.append(&document(MIB)).await.unwrap();
    assert_eq!(writer.spilled_bytes(), MIB as u64);
    assert_eq!(std::fs::read_dir(&spill_dir).unwrap().count(), 1);
    writer.abort().await.unwrap();
    drop(hog);
    assert_eq!(std::fs::read_dir(&spill_dir).unwrap().count(), 0);
    assert_eq!(pool.snapshot().spilled_bytes, 0);
    assert_eq!(pool.snapshot().buffered_bytes, 0, "every buffer uncounted");
    std::fs::remove_dir_all(&spill_dir).unwrap();
}

/// Writes `content` with its first part held, then finishes with `head`:
/// the object is `head` then `content`, its SHA-256 that of those bytes.
async fn round_trip_with_head(
    handle: &S3Bucket,
    bucket: &TestBucket,
    key: &str,
    head: &[u8],
    content: &[u8],
) -> WrittenObject {
    let mut writer = handle.writer(key, &small_policy()).unwrap();
    writer.hold_first_part();
    for slice in content.chunks(65_537) {
        writer.append(slice).await.unwrap();
    }
    if content.len() > PART_SIZE {
        assert!(
            writer.held_bytes() >= PART_SIZE as u64 || writer.spilled_bytes() > 0,
            "{key}: the first part is held, in memory or spilled, and counted"
        );
    }
    let written = writer.finish_with_head(head).await.expect("finish");
    let mut whole = head.to_vec();
    whole.extend_from_slice(content);
    assert_eq!(written.bytes, whole.len() as u64, "{key}: size");
    assert_eq!(written.sha256_hex, sha256_hex(&whole), "{key}: SHA-256");
    assert!(
        bucket.read(key).await.expect("stored") == whole,
        "{key}: the head, then every byte appended"
    );
    assert!(
        bucket.pending_uploads("").await.is_empty(),
        "{key}: no upload left"
    );
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_first_part_goes_up_last_behind_a_head_known_at_the_end() {
    let bucket = TestBucket::create("writer").await;
    let handle = bucket.handle();
    let head = b"<header records=\"123456\" sum=\"98765.43\"/>\n";
    // Within one part: one PutObject of head and body.
    let small =
        round_trip_with_head(&handle, &bucket, "r/held-small.xml", head, &document(5000)).await;
    assert!(small.single_put);
    // Past one part: part 1 is the head and the held part, uploaded last.
    let parts = round_trip_with_head(
        &handle,
        &bucket,
        "r/held-parts.xml",
        head,
        &document(2 * PART_SIZE + 4321),
    )
    .await;
    assert!(!parts.single_put);
    assert_eq!(parts.parts, 3);
    // Exactly one part and a byte: the held part, and a last part of one byte.
    let edge = round_trip_with_head(
        &handle,
        &bucket,
        "r/held-edge.xml",
        head,
        &document(PART_SIZE + 1),
    )
    .await;
    assert_eq!(edge.parts, 2);
    // A head may be empty, and so may the document.
    round_trip_with_head(&handle, &bucket, "r/held-empty.xml", b"", b"").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_first_part_spills_when_the_pool_is_full_and_is_freed_after() {
    let bucket = TestBucket::create("writer").await;
    let spill_dir = std::env::temp_dir().join(quire_tests::unique("quire-writer-held"));
    let plain = bucket.handle();
    let pool = spilling_pool(&plain, &spill_dir);
    let handle = plain.with_memory(pool.clone());
    // Another document holds most of the budget: the held part spills.
    let mut hog = handle.writer("r/hog.xml", &small_policy()).unwrap();
    hog.append(&document(PART_SIZE - 5)).await.unwrap();
    let content = document(2 * PART_SIZE + 99);
    let mut writer = handle
        .writer("r/held-spilled.xml", &small_policy())
        .unwrap();
    writer.hold_first_part();
    let mut spilled = 0;
    for slice in content.chunks(4093) {
        writer.append(slice).await.unwrap();
        spilled = spilled.max(writer.spilled_bytes());
    }
    assert!(
        spilled >= PART_SIZE as u64,
        "the held part waits on disk: {spilled}"
    );
    assert_eq!(
        pool.snapshot().over_budget_bytes,
        0,
        "holding the first part keeps the writers within the budget"
    );
    let head = b"<h/>";
    let written = writer.finish_with_head(head).await.unwrap();
    let mut whole = head.to_vec();
    whole.extend_from_slice(&content);
    assert_eq!(written.sha256_hex, sha256_hex(&whole));
    assert!(bucket.read("r/held-spilled.xml").await.unwrap() == whole);
    hog.abort().await.unwrap();
    let snapshot = pool.snapshot();
    assert_eq!(snapshot.in_flight_bytes, 0, "{snapshot:?}");
    assert_eq!(snapshot.over_budget_bytes, 0, "{snapshot:?}");
    assert_eq!(snapshot.spilled_bytes, 0);
    let left = std::fs::read_dir(&spill_dir).unwrap().count();
    std::fs::remove_dir_all(&spill_dir).unwrap();
    assert_eq!(left, 0, "the held part's spill file is removed");
}

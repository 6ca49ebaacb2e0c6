//! The writer benchmark (issue 3): the seed's buffered-append table, on S3.
//!
//! - A million appends of the seed's strings (`(i)` and 30 characters of
//!   padding) into one object through our writer, against (1) the same bytes
//!   in one append, (2) object_store's buffered multipart writer with the
//!   same part size and concurrency, (3) the document built in memory then
//!   stored with one PutObject.
//! - A large document (1 GiB) through our writer, against the ceiling: the
//!   same bytes already in memory, sent as plain UploadPart calls of the same
//!   size with the same concurrency.
//!
//! Every scenario runs in a child process of its own (peak RSS is its own),
//! `--rounds` times; the table shows the median time. All scenarios write to
//! one bucket made for the run and deleted at its end.
//!
//! The headline compares defaults: our writer signs each part's bytes
//! (SigV4 payload signing, on over plain HTTP), as object_store does by
//! default and as the ceiling's plain calls do. The `_unsigned` rows send
//! `UNSIGNED-PAYLOAD` on every side, for the comparison without that
//! SHA-256 pass (what the writer does with `sign_payload: false`, e.g. over
//! HTTPS).
//!
//! The writer stores every part with an S3 additional checksum (CRC32C by
//! default); `large_writer_sha256` and `large_writer_no_checksum` are the
//! same document with SHA-256 part checksums and with none, and the
//! checksum lines give each against the one without.
//!
//! `xml_plain`, `xml_gzip` and `xml_zstd` store the same document of
//! rendered XML records (an 8 MiB run of distinct records, repeated, so no
//! compressor's window sees a repeat) through the worker's compressors
//! (`quire_xml::compress`) and our writer; the compression lines give each
//! one's throughput in XML bytes per second against the plain one's, and its
//! ratio (XML bytes over stored bytes).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use quire_config::ChecksumChoice;
use quire_messages::compression::Compression;
use quire_s3::aws_sdk_s3::Client;
use quire_s3::aws_sdk_s3::primitives::ByteStream;
use quire_s3::aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use quire_s3::{S3Bucket, UploadPolicy};
use quire_tests::s3::{TestBucket, s3_settings};
use quire_xml::compress::Compressor;
use tokio::io::AsyncWriteExt;

use crate::child::{self, ScenarioResult};

const MIB: usize = 1024 * 1024;

#[derive(clap::Args)]
pub struct WriterArgs {
    /// Appends of the seed's strings in the tiny-append scenarios.
    #[arg(long, default_value_t = 1_000_000)]
    appends: usize,
    /// Size of the large document, in MiB.
    #[arg(long, default_value_t = 1024)]
    large_mib: usize,
    /// Parts in flight, for our writer and every baseline.
    #[arg(long, default_value_t = quire_s3::DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// Runs of each scenario; the table shows the median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// What every scenario needs, passed to the children as arguments.
struct ScenarioParameters {
    bucket: String,
    appends: usize,
    large_bytes: usize,
    max_in_flight: usize,
}

impl ScenarioParameters {
    fn to_args(&self) -> Vec<String> {
        vec![
            self.bucket.clone(),
            self.appends.to_string(),
            self.large_bytes.to_string(),
            self.max_in_flight.to_string(),
        ]
    }

    fn from_args(args: &[String]) -> anyhow::Result<Self> {
        let [bucket, appends, large_bytes, max_in_flight] = args else {
            anyhow::bail!("writer scenarios take: BUCKET APPENDS LARGE_BYTES MAX_IN_FLIGHT");
        };
        Ok(ScenarioParameters {
            bucket: bucket.clone(),
            appends: appends.parse()?,
            large_bytes: large_bytes.parse()?,
            max_in_flight: max_in_flight.parse()?,
        })
    }

    /// The policy of every scenario: 8 MiB parts (the declared maximum is the
    /// large document), `max_in_flight` parts at once.
    fn policy(&self, sign_payload: bool) -> UploadPolicy {
        let mut policy = UploadPolicy::for_max_object_size(self.large_bytes.max(MIB) as u64);
        policy.max_in_flight = self.max_in_flight;
        policy.sign_payload = sign_payload;
        policy
    }
}

/// Scenario names; a `_unsigned` suffix sends `UNSIGNED-PAYLOAD`.
const SCENARIOS: &[(&str, &str)] = &[
    ("tiny_appends", "our writer, 1 append per string"),
    ("one_append", "our writer, all bytes in 1 append"),
    ("object_store", "object_store BufWriter, 1 write per string"),
    ("one_put", "built in memory, 1 PutObject"),
    ("large_writer", "our writer, large document, 64 KiB appends"),
    ("large_ceiling", "bytes in memory, plain UploadPart calls"),
    (
        "large_writer_held",
        "as large_writer, first part held for a header",
    ),
    (
        "large_writer_sha256",
        "as large_writer, SHA-256 part checksums (composite)",
    ),
    (
        "large_writer_no_checksum",
        "as large_writer, no S3 checksum",
    ),
    ("xml_plain", "our writer, XML records, not compressed"),
    ("xml_gzip", "as xml_plain, through the gzip compressor"),
    ("xml_zstd", "as xml_plain, through the zstd compressor"),
    ("tiny_appends_unsigned", "as tiny_appends, unsigned payload"),
    ("object_store_unsigned", "as object_store, unsigned payload"),
    ("large_writer_unsigned", "as large_writer, unsigned payload"),
    (
        "large_ceiling_unsigned",
        "as large_ceiling, unsigned payload",
    ),
];

pub async fn run(args: WriterArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    let bucket = TestBucket::create("bench-writer").await;
    let parameters = ScenarioParameters {
        bucket: bucket.name.clone(),
        appends: args.appends,
        large_bytes: args.large_mib * MIB,
        max_in_flight: args.max_in_flight,
    };
    let policy = parameters.policy(true);
    println!(
        "writer benchmark: {} appends; large document {} MiB; parts of {} MiB, {} in flight; {} round(s)",
        args.appends,
        args.large_mib,
        policy.part_size() / MIB as u64,
        args.max_in_flight,
        args.rounds
    );

    // Rounds interleave the scenarios, so a change in the machine's load
    // (the S3 server shares its two cores) weighs on every scenario alike.
    let mut results_by_scenario: Vec<Vec<ScenarioResult>> = vec![Vec::new(); SCENARIOS.len()];
    for _ in 0..args.rounds {
        for ((name, _), results) in SCENARIOS.iter().zip(&mut results_by_scenario) {
            results.push(child::spawn(
                &format!("writer.{name}"),
                &parameters.to_args(),
            )?);
        }
    }
    let summaries: Vec<Summary> = SCENARIOS
        .iter()
        .zip(results_by_scenario)
        .map(|((name, description), results)| Summary::of(name, description, results))
        .collect();

    println!();
    println!(
        "{:<22} {:<44} {:>9} {:>9} {:>9} {:>13}",
        "scenario", "what", "median s", "best s", "MiB/s", "peak RSS MiB"
    );
    for summary in &summaries {
        println!(
            "{:<22} {:<44} {:>9.3} {:>9.3} {:>9.1} {:>13.1}",
            summary.name,
            summary.description,
            summary.median_seconds,
            summary.best_seconds,
            summary.median_bytes_per_second / MIB as f64,
            summary.peak_rss_bytes as f64 / MIB as f64
        );
    }
    let find = |wanted: &str| -> &Summary {
        summaries
            .iter()
            .find(|summary| summary.name == wanted)
            .expect("every scenario ran")
    };
    // Every ratio is our throughput over the other's; the documents of a
    // pair have the same size, so it is their time over ours.
    let speedup = |ours: &str, theirs: &str, seconds: fn(&Summary) -> f64| {
        seconds(find(theirs)) / seconds(find(ours))
    };
    let median = |summary: &Summary| summary.median_seconds;
    let best = |summary: &Summary| summary.best_seconds;
    let peak_rss_mib = find("large_writer").peak_rss_bytes as f64 / MIB as f64;
    let rss_target_mib = (policy.memory_bound() as usize / MIB + 64) as f64;
    println!();
    println!(
        "targets: tiny_over_one >= 0.9, vs_object_store >= 1.0, vs_ceiling >= 0.85, peak_rss_mib <= {rss_target_mib:.0}"
    );
    for (label, seconds) in [("median", median as fn(&Summary) -> f64), ("best", best)] {
        println!(
            "{label} runs: tiny_over_one={:.2} vs_object_store={:.2} vs_ceiling={:.2}; \
             unsigned payload everywhere: vs_object_store={:.2} vs_ceiling={:.2}; \
             tiny appends vs built in memory + 1 PutObject={:.2}",
            speedup("tiny_appends", "one_append", seconds),
            speedup("tiny_appends", "object_store", seconds),
            speedup("large_writer", "large_ceiling", seconds),
            speedup("tiny_appends_unsigned", "object_store_unsigned", seconds),
            speedup("large_writer_unsigned", "large_ceiling_unsigned", seconds),
            speedup("tiny_appends", "one_put", seconds),
        );
    }
    // A header's cost: the first part held to the end (memory), and the
    // document read back once for its SHA-256 (time).
    let held = find("large_writer_held");
    let plain = find("large_writer");
    println!(
        "header (first part held): time vs large_writer={:.2} (median) {:.2} (best); peak RSS {:.0} MiB vs {:.0} MiB (+{:.0} MiB)",
        held.median_seconds / plain.median_seconds,
        held.best_seconds / plain.best_seconds,
        held.peak_rss_bytes as f64 / MIB as f64,
        plain.peak_rss_bytes as f64 / MIB as f64,
        (held.peak_rss_bytes as f64 - plain.peak_rss_bytes as f64) / MIB as f64,
    );
    // The S3 checksums' cost: the same document without one is the baseline.
    let none = find("large_writer_no_checksum");
    for (label, summary) in [
        ("crc32c (default)", plain),
        ("sha256", find("large_writer_sha256")),
    ] {
        println!(
            "checksum {label}: time vs no checksum={:.2} (median) {:.2} (best); {:.0} vs {:.0} MiB/s; peak RSS {:.0} vs {:.0} MiB",
            summary.median_seconds / none.median_seconds,
            summary.best_seconds / none.best_seconds,
            summary.median_bytes_per_second / MIB as f64,
            none.median_bytes_per_second / MIB as f64,
            summary.peak_rss_bytes as f64 / MIB as f64,
            none.peak_rss_bytes as f64 / MIB as f64,
        );
    }
    // Compression: XML bytes per second against the plain document's, and
    // the ratio of the same document (compressed again here, untimed: the
    // compressors are deterministic, so these are the bytes it stored).
    let plain_xml = find("xml_plain");
    let document = XmlDocument::new(parameters.large_bytes);
    for (label, compression) in [
        ("none", None),
        ("gzip", Some(Compression::Gzip)),
        ("zstd", Some(Compression::Zstd)),
    ] {
        let summary = find(match compression {
            None => "xml_plain",
            Some(Compression::Gzip) => "xml_gzip",
            Some(Compression::Zstd) => "xml_zstd",
        });
        let stored = document.stored_bytes(compression)?;
        println!(
            "compression {label}: time vs none={:.2} (median) {:.2} (best); {:.0} MiB/s of XML; ratio {:.2} ({} MiB of XML stored as {:.1} MiB); peak RSS {:.0} MiB",
            summary.median_seconds / plain_xml.median_seconds,
            summary.best_seconds / plain_xml.best_seconds,
            summary.median_bytes_per_second / MIB as f64,
            parameters.large_bytes as f64 / stored as f64,
            parameters.large_bytes / MIB,
            stored as f64 / MIB as f64,
            summary.peak_rss_bytes as f64 / MIB as f64,
        );
    }
    drop(bucket);
    // The headline: medians, defaults (payloads signed on every side).
    println!(
        "writer tiny_over_one={:.2} vs_object_store={:.2} vs_ceiling={:.2} peak_rss_mib={peak_rss_mib:.0}",
        speedup("tiny_appends", "one_append", median),
        speedup("tiny_appends", "object_store", median),
        speedup("large_writer", "large_ceiling", median),
    );
    Ok(())
}

/// One scenario's rounds, summed up.
struct Summary {
    name: &'static str,
    description: &'static str,
    median_seconds: f64,
    best_seconds: f64,
    /// Throughput of the median round.
    median_bytes_per_second: f64,
    /// The highest peak RSS of any round.
    peak_rss_bytes: u64,
}

impl Summary {
    fn of(name: &'static str, description: &'static str, mut results: Vec<ScenarioResult>) -> Self {
        results.sort_by(|left, right| left.seconds.total_cmp(&right.seconds));
        eprintln!(
            "  {name}: {}",
            results
                .iter()
                .map(|result| format!("{:.3}s", result.seconds))
                .collect::<Vec<_>>()
                .join(" ")
        );
        Summary {
            name,
            description,
            median_seconds: results[results.len() / 2].seconds,
            best_seconds: results[0].seconds,
            median_bytes_per_second: results[results.len() / 2].rate(),
            peak_rss_bytes: results
                .iter()
                .map(|result| result.peak_rss_bytes)
                .max()
                .unwrap_or(0),
        }
    }
}

pub async fn scenario(name: &str, args: &[String]) -> anyhow::Result<(f64, f64)> {
    let parameters = ScenarioParameters::from_args(args)?;
    let settings = s3_settings();
    let client = quire_s3::build_client(&settings).await;
    let key = format!("bench/{name}-{}.xml", uuid::Uuid::new_v4().simple());
    let (base_name, sign_payload) = match name.strip_suffix("_unsigned") {
        Some(base_name) => (base_name, false),
        None => (name, true),
    };
    let measured = match base_name {
        "tiny_appends" => tiny_appends(&client, &parameters, sign_payload, &key).await?,
        "one_append" => one_append(&client, &parameters, sign_payload, &key).await?,
        "object_store" => object_store_writer(&parameters, sign_payload, &key).await?,
        "one_put" if sign_payload => one_put(&client, &parameters, &key).await?,
        "large_writer" => {
            large_writer(
                &client,
                &parameters,
                sign_payload,
                false,
                ChecksumChoice::Crc32c,
                &key,
            )
            .await?
        }
        "large_writer_held" => {
            large_writer(
                &client,
                &parameters,
                sign_payload,
                true,
                ChecksumChoice::Crc32c,
                &key,
            )
            .await?
        }
        "large_writer_sha256" => {
            large_writer(
                &client,
                &parameters,
                sign_payload,
                false,
                ChecksumChoice::Sha256,
                &key,
            )
            .await?
        }
        "large_writer_no_checksum" => {
            large_writer(
                &client,
                &parameters,
                sign_payload,
                false,
                ChecksumChoice::None,
                &key,
            )
            .await?
        }
        "large_ceiling" => large_ceiling(&client, &parameters, sign_payload, &key).await?,
        "xml_plain" => large_xml(&client, &parameters, None, &key).await?,
        "xml_gzip" => large_xml(&client, &parameters, Some(Compression::Gzip), &key).await?,
        "xml_zstd" => large_xml(&client, &parameters, Some(Compression::Zstd), &key).await?,
        _ => anyhow::bail!("unknown writer scenario {name}"),
    };
    // Untimed: keep the server's disk small across rounds.
    client
        .delete_object()
        .bucket(&parameters.bucket)
        .key(&key)
        .send()
        .await
        .context("delete the scenario's object")?;
    Ok(measured)
}

/// The seed's strings, `(i)` followed by 30 characters of padding, one after
/// the other, with where each ends. Made before any clock starts.
struct SeedStrings {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl SeedStrings {
    fn new(count: usize) -> Self {
        let mut bytes = Vec::with_capacity(count * 40);
        let mut ends = Vec::with_capacity(count);
        for index in 0..count {
            bytes.extend_from_slice(format!("({index})").as_bytes());
            bytes.extend_from_slice(b"                             \n");
            ends.push(bytes.len());
        }
        SeedStrings { bytes, ends }
    }

    fn each(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let string = &self.bytes[start..end];
            start = end;
            string
        })
    }
}

fn bucket_handle(client: &Client, parameters: &ScenarioParameters) -> S3Bucket {
    S3Bucket::new(client.clone(), &parameters.bucket)
}

async fn tiny_appends(
    client: &Client,
    parameters: &ScenarioParameters,
    sign_payload: bool,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let strings = SeedStrings::new(parameters.appends);
    let bucket = bucket_handle(client, parameters);
    let started = Instant::now();
    let mut writer = bucket.writer(key, &parameters.policy(sign_payload))?;
    for string in strings.each() {
        writer.append(string).await?;
    }
    let written = writer.finish().await?;
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(written.bytes == strings.bytes.len() as u64);
    Ok((seconds, written.bytes as f64))
}

async fn one_append(
    client: &Client,
    parameters: &ScenarioParameters,
    sign_payload: bool,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let strings = SeedStrings::new(parameters.appends);
    let bucket = bucket_handle(client, parameters);
    let started = Instant::now();
    let mut writer = bucket.writer(key, &parameters.policy(sign_payload))?;
    writer.append(&strings.bytes).await?;
    let written = writer.finish().await?;
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(written.bytes == strings.bytes.len() as u64);
    Ok((seconds, written.bytes as f64))
}

/// object_store's BufWriter (its buffered multipart writer): the same server,
/// part size and concurrency, and payload signing as asked (its default is
/// to sign).
async fn object_store_writer(
    parameters: &ScenarioParameters,
    sign_payload: bool,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let settings = s3_settings();
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&settings.endpoint)
        .with_region(&settings.region)
        .with_bucket_name(&parameters.bucket)
        .with_access_key_id(std::env::var("AWS_ACCESS_KEY_ID")?)
        .with_secret_access_key(std::env::var("AWS_SECRET_ACCESS_KEY")?)
        .with_allow_http(true)
        .with_virtual_hosted_style_request(false)
        .with_unsigned_payload(!sign_payload)
        .build()?;
    let strings = SeedStrings::new(parameters.appends);
    let part_size = parameters.policy(sign_payload).part_size() as usize;
    let started = Instant::now();
    let mut writer = object_store::buffered::BufWriter::with_capacity(
        Arc::new(store),
        object_store::path::Path::from(key),
        part_size,
    )
    .with_max_concurrency(parameters.max_in_flight);
    for string in strings.each() {
        writer.write_all(string).await?;
    }
    writer.shutdown().await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((seconds, strings.bytes.len() as f64))
}

/// The document built in memory (appended to a growing Vec), then one
/// PutObject.
async fn one_put(
    client: &Client,
    parameters: &ScenarioParameters,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let strings = SeedStrings::new(parameters.appends);
    let started = Instant::now();
    let mut document = Vec::new();
    for string in strings.each() {
        document.extend_from_slice(string);
    }
    let length = document.len();
    client
        .put_object()
        .bucket(&parameters.bucket)
        .key(key)
        .content_length(length as i64)
        .body(ByteStream::from(document))
        .send()
        .await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((seconds, length as f64))
}

/// A 1 MiB block of seed strings: the large document is this block repeated.
fn large_document_block() -> Vec<u8> {
    let mut block = SeedStrings::new(MIB / 30).bytes;
    block.resize(MIB, b' ');
    block
}

async fn large_writer(
    client: &Client,
    parameters: &ScenarioParameters,
    sign_payload: bool,
    held: bool,
    checksum: ChecksumChoice,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    const APPEND_SIZE: usize = 64 * 1024;
    /// A header as a definition's would be: known only at the end.
    const HEAD: &[u8] = b"<?xml version=\"1.0\"?>\n<report><header><NbOfTxs>1</NbOfTxs></header>\n";
    let block = large_document_block();
    let bucket = bucket_handle(client, parameters);
    let started = Instant::now();
    let mut policy = parameters.policy(sign_payload);
    policy.checksum = checksum;
    if held {
        // The same parts, and room for the head.
        policy.max_object_size += HEAD.len() as u64;
    }
    let mut writer = bucket.writer(key, &policy)?;
    if held {
        writer.hold_first_part();
    }
    let mut written_so_far = 0;
    // The bytes are made on the fly from the block; the document is never
    // held whole.
    while written_so_far < parameters.large_bytes {
        let offset = written_so_far % MIB;
        let length = APPEND_SIZE
            .min(MIB - offset)
            .min(parameters.large_bytes - written_so_far);
        writer.append(&block[offset..offset + length]).await?;
        written_so_far += length;
    }
    let peak_buffered_bytes = writer.peak_buffered_bytes();
    let head: &[u8] = if held { HEAD } else { b"" };
    let written = writer.finish_with_head(head).await?;
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(written.bytes == (parameters.large_bytes + head.len()) as u64);
    eprintln!(
        "    large_writer{}: the writer's own peak of buffered bytes {} MiB (bound {} MiB)",
        if held { "_held" } else { "" },
        peak_buffered_bytes / MIB as u64,
        policy.memory_bound() / MIB as u64
    );
    Ok((seconds, written.bytes as f64))
}

/// A document of rendered XML records: an 8 MiB run of distinct records
/// (values from a fixed-seed generator), repeated up to its size; fed in
/// 64 KiB appends, as a worker appends a message's records.
struct XmlDocument {
    run: Vec<u8>,
    bytes: usize,
}

impl XmlDocument {
    const RUN_BYTES: usize = 8 * MIB;
    const APPEND_SIZE: usize = 64 * 1024;

    fn new(bytes: usize) -> Self {
        let mut run = Vec::with_capacity(Self::RUN_BYTES + 1024);
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut sequence = 0u64;
        while run.len() < Self::RUN_BYTES {
            let (id, customer, cents, note) =
                (next(), next() % 5000, next() % 10_000_000, next() % 40);
            run.extend_from_slice(
                format!(
                    "<record seq=\"{sequence}\"><id>ord-{id:016x}</id><customer>cust-{customer:04}</customer><amount>{}.{:02}</amount><currency>EUR</currency><note>{}</note></record>\n",
                    cents / 100,
                    cents % 100,
                    "n".repeat(note as usize)
                )
                .as_bytes(),
            );
            sequence += 1;
        }
        run.truncate(Self::RUN_BYTES);
        XmlDocument { run, bytes }
    }

    /// Its appends, in order.
    fn appends(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.bytes).step_by(Self::APPEND_SIZE).map(|start| {
            let offset = start % Self::RUN_BYTES;
            let length = Self::APPEND_SIZE
                .min(Self::RUN_BYTES - offset)
                .min(self.bytes - start);
            &self.run[offset..offset + length]
        })
    }

    /// Bytes stored under `compression`.
    fn stored_bytes(&self, compression: Option<Compression>) -> anyhow::Result<u64> {
        let Some(compression) = compression else {
            return Ok(self.bytes as u64);
        };
        let mut compressor = Compressor::new(compression)?;
        let mut stored = 0;
        for append in self.appends() {
            stored += compressor.compress(append)?.len() as u64;
        }
        Ok(stored + compressor.finish()?.0.len() as u64)
    }
}

/// The XML document through the compressor (if any) and our writer; its
/// units are XML bytes.
async fn large_xml(
    client: &Client,
    parameters: &ScenarioParameters,
    compression: Option<Compression>,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let document = XmlDocument::new(parameters.large_bytes);
    let bucket = bucket_handle(client, parameters);
    let policy = parameters.policy(true);
    let started = Instant::now();
    let mut writer = bucket.writer(key, &policy)?;
    let mut compressor = compression.map(Compressor::new).transpose()?;
    for append in document.appends() {
        match &mut compressor {
            None => writer.append(append).await?,
            Some(compressor) => {
                let compressed = compressor.compress(append)?;
                if !compressed.is_empty() {
                    writer.append(compressed).await?;
                }
            }
        }
    }
    if let Some(compressor) = compressor {
        writer.append(&compressor.finish()?.0).await?;
    }
    writer.finish().await?;
    Ok((
        started.elapsed().as_secs_f64(),
        parameters.large_bytes as f64,
    ))
}

/// The ceiling: the same bytes already in memory, sent as parts of the same
/// size with the same concurrency and payload signing, each part a plain
/// UploadPart call in a task of its own (as our writer's are).
async fn large_ceiling(
    client: &Client,
    parameters: &ScenarioParameters,
    sign_payload: bool,
    key: &str,
) -> anyhow::Result<(f64, f64)> {
    let block = large_document_block();
    let mut document = Vec::with_capacity(parameters.large_bytes);
    while document.len() < parameters.large_bytes {
        let length = MIB.min(parameters.large_bytes - document.len());
        document.extend_from_slice(&block[..length]);
    }
    let document = Bytes::from(document);
    let part_size = parameters.policy(sign_payload).part_size() as usize;

    let started = Instant::now();
    let upload_id = client
        .create_multipart_upload()
        .bucket(&parameters.bucket)
        .key(key)
        .send()
        .await?
        .upload_id
        .context("no upload id")?;
    let mut in_flight = tokio::task::JoinSet::new();
    let mut completed = Vec::new();
    for (index, start) in (0..document.len()).step_by(part_size).enumerate() {
        if in_flight.len() >= parameters.max_in_flight {
            completed.push(
                in_flight
                    .join_next()
                    .await
                    .expect("a part is in flight")??,
            );
        }
        let part = document.slice(start..(start + part_size).min(document.len()));
        let part_number = index as i32 + 1;
        let request = client
            .upload_part()
            .bucket(&parameters.bucket)
            .key(key)
            .upload_id(&upload_id)
            .part_number(part_number)
            .content_length(part.len() as i64)
            .body(ByteStream::from(part))
            .customize();
        let request = if sign_payload {
            request
        } else {
            request.disable_payload_signing()
        };
        in_flight.spawn(async move {
            let output = request.send().await?;
            anyhow::Ok(
                CompletedPart::builder()
                    .part_number(part_number)
                    .set_e_tag(output.e_tag)
                    .build(),
            )
        });
    }
    while let Some(part) = in_flight.join_next().await {
        completed.push(part??);
    }
    completed.sort_by_key(|part| part.part_number());
    client
        .complete_multipart_upload()
        .bucket(&parameters.bucket)
        .key(key)
        .upload_id(&upload_id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .set_parts(Some(completed))
                .build(),
        )
        .send()
        .await?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((seconds, document.len() as f64))
}

//! `quire cut`, `status`, `get`, `list` and `watch`.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::cli::{CutArgs, GetArgs, GlobalOptions, ListArgs, ReportArgs, WatchArgs};
use crate::client::{ApiClient, with_retries};
use crate::error::CliError;
use crate::output::Output;
use crate::send::human_bytes;

/// Page size `watch` asks for.
const WATCH_PAGE_SIZE: u32 = 1000;

/// Cuts under one `Idempotency-Key` for the whole invocation, so a cut
/// retried after a 429 or 503 (or a lost answer) is one cut.
pub async fn cut(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &CutArgs,
) -> Result<(), CliError> {
    let key = arguments
        .idempotency_key
        .clone()
        .unwrap_or_else(|| format!("quire-cut-{}", uuid::Uuid::new_v4().simple()));
    let answer = with_retries(arguments.retries, || client.cut(&arguments.stream, &key)).await?;
    Output::new(global.json).result(&answer, || text_field(&answer, "report_id").to_owned());
    Ok(())
}

pub async fn status(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &ReportArgs,
) -> Result<(), CliError> {
    let report = client.report(&arguments.report).await?;
    Output::new(global.json).result(&report, || describe_report(&report));
    Ok(())
}

pub async fn list(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &ListArgs,
) -> Result<(), CliError> {
    let reports = client
        .all_reports(
            &arguments.stream,
            arguments.page_size,
            arguments.window_start.as_deref(),
        )
        .await?;
    let output = Output::new(global.json);
    if output.is_json() {
        println!(
            "{}",
            json!({"stream": arguments.stream, "reports": reports})
        );
        return Ok(());
    }
    if reports.is_empty() {
        println!("no completed reports in stream {}", arguments.stream);
    }
    for report in &reports {
        println!("{}", describe_report(report));
    }
    Ok(())
}

pub async fn watch(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &WatchArgs,
) -> Result<(), CliError> {
    let output = Output::new(global.json);
    let mut seen: HashSet<String> = HashSet::new();
    let mut printed = 0u64;
    if !arguments.existing {
        for stream in &arguments.stream {
            for report in client.all_reports(stream, WATCH_PAGE_SIZE, None).await? {
                seen.insert(text_field(&report, "report_id").to_owned());
            }
        }
    }
    if !output.is_json() {
        eprintln!(
            "watching {} (polling every {:?}; ctrl-c stops)",
            arguments.stream.join(", "),
            arguments.interval
        );
    }
    loop {
        for stream in &arguments.stream {
            for report in client.all_reports(stream, WATCH_PAGE_SIZE, None).await? {
                let report_id = text_field(&report, "report_id").to_owned();
                if !seen.insert(report_id) {
                    continue;
                }
                output.result(&report, || describe_report(&report));
                printed += 1;
                if arguments.count.is_some_and(|count| printed >= count) {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(arguments.interval).await;
    }
}

pub async fn get(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &GetArgs,
) -> Result<(), CliError> {
    let Download {
        response,
        expected_sha256,
        expected_crc32c,
        source,
        label,
    } = open_download(client, arguments).await?;
    let content_length = response.content_length();
    let to_stdout = arguments.output == Path::new("-");

    let partial_path = partial_path(&arguments.output);
    let mut sink: Box<dyn Write> = if to_stdout {
        Box::new(std::io::stdout().lock())
    } else {
        let file = std::fs::File::create(&partial_path).map_err(|source| {
            CliError::io(format!("creating {}", partial_path.display()), source)
        })?;
        Box::new(std::io::BufWriter::with_capacity(1 << 20, file))
    };
    let bar = download_bar(content_length, global.json || to_stdout);
    let started = Instant::now();
    let mut hasher = Sha256::new();
    let mut crc32c = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    let mut written = 0u64;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|error| CliError::Http {
            url: label.clone(),
            source: error,
        })?;
        hasher.update(&chunk);
        crc32c.update(&chunk);
        if let Err(source) = sink.write_all(&chunk) {
            // `quire get R -o - | head` closes the pipe early: not an error.
            if to_stdout && source.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(CliError::io(
                format!("writing {}", arguments.output.display()),
                source,
            ));
        }
        written += chunk.len() as u64;
        bar.set_position(written);
    }
    sink.flush().map_err(|source| {
        CliError::io(format!("writing {}", arguments.output.display()), source)
    })?;
    drop(sink);
    bar.finish_and_clear();

    let actual_sha256 = hex::encode(hasher.finalize());
    let kept = if to_stdout {
        String::new()
    } else {
        format!(
            "; the bytes are kept in {} for inspection",
            partial_path.display()
        )
    };
    if let Some(length) = content_length
        && length != written
    {
        return Err(CliError::Integrity(format!(
            "report {} ended after {written} of its {length} bytes{kept}",
            arguments.report
        )));
    }
    let actual_crc32c = u32::try_from(crc32c.finalize())
        .map(|crc| base64::engine::general_purpose::STANDARD.encode(crc.to_be_bytes()))
        .unwrap_or_default();
    if let Some(expected) = &expected_crc32c
        && *expected != actual_crc32c
    {
        return Err(CliError::Integrity(format!(
            "CRC32C MISMATCH for report {}: S3 stores it with {expected}, the {written} bytes received give {actual_crc32c}{kept}",
            arguments.report
        )));
    }
    let verified = match &expected_sha256 {
        Some(expected) if *expected != actual_sha256 => {
            return Err(CliError::Integrity(format!(
                "SHA-256 MISMATCH for report {}: the API announced {expected}, the {written} bytes received hash to {actual_sha256}{kept}",
                arguments.report
            )));
        }
        Some(_) => true,
        None => {
            eprintln!("warning: the API announced no SHA-256: the download is not verified");
            false
        }
    };
    if !to_stdout {
        std::fs::rename(&partial_path, &arguments.output).map_err(|source| {
            CliError::io(
                format!(
                    "renaming {} to {}",
                    partial_path.display(),
                    arguments.output.display()
                ),
                source,
            )
        })?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let document = json!({
        "report_id": arguments.report,
        "path": arguments.output,
        "bytes": written,
        "sha256": actual_sha256,
        "crc32c": actual_crc32c,
        "verified": verified,
        "crc32c_verified": expected_crc32c.is_some(),
        "seconds": seconds,
        "source": source,
    });
    if to_stdout {
        // The document itself went to stdout; the summary must not mix with it.
        if global.json {
            eprintln!("{document}");
        }
        return Ok(());
    }
    Output::new(global.json).result(&document, || {
        format!(
            "wrote {} ({}) in {seconds:.1}s, sha256 {actual_sha256}{}{}",
            arguments.output.display(),
            human_bytes(written),
            if verified {
                " (verified)"
            } else {
                " (not verified)"
            },
            if expected_crc32c.is_some() {
                format!(", crc32c {actual_crc32c} (verified against S3's checksum)")
            } else {
                String::new()
            }
        )
    });
    Ok(())
}

/// Where a download's bytes come from, and what they must hash to.
struct Download {
    response: reqwest::Response,
    expected_sha256: Option<String>,
    /// The full-object CRC32C S3 stores the object with (base64), if any.
    expected_crc32c: Option<String>,
    /// `s3` (a presigned URL) or `api`.
    source: &'static str,
    /// Where the bytes come from, for messages (a presigned URL without its
    /// signature).
    label: String,
}

/// Straight from S3 when the API offers a presigned URL (unless
/// `--through-api`), else through the API. A presigned URL that does not
/// answer (an S3 endpoint this machine cannot reach, say) falls back to the
/// API, with a warning.
async fn open_download(client: &ApiClient, arguments: &GetArgs) -> Result<Download, CliError> {
    if !arguments.through_api
        && let Some(url) = client.download_url(&arguments.report).await?
    {
        match client.fetch_presigned(&url).await {
            Ok(response) => {
                return Ok(Download {
                    response,
                    expected_sha256: Some(url.sha256.trim().to_ascii_lowercase()),
                    expected_crc32c: url.checksum.as_ref().and_then(full_object_crc32c),
                    source: "s3",
                    label: url.redacted(),
                });
            }
            Err(problem) => {
                eprintln!(
                    "warning: the presigned S3 URL did not work ({problem}); downloading through the API"
                );
            }
        }
    }
    let response = client.report_content(&arguments.report).await?;
    let expected_sha256 = response
        .headers()
        .get("x-quire-sha256")
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim().to_ascii_lowercase());
    let expected_crc32c = response
        .headers()
        .get("x-quire-checksum-crc32c")
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim().to_owned());
    Ok(Download {
        response,
        expected_sha256,
        expected_crc32c,
        source: "api",
        label: client.url(&format!("/v1/reports/{}/content", arguments.report)),
    })
}

/// A full-object CRC32C, the one S3 checksum a reader computes from the
/// bytes alone (a composite one needs the parts' boundaries).
fn full_object_crc32c(checksum: &quire_messages::ObjectChecksum) -> Option<String> {
    (checksum.algorithm == "CRC32C" && checksum.kind == "FULL_OBJECT")
        .then(|| checksum.value.clone())
}

/// `report.xml` downloads to `report.xml.part` and is renamed once verified.
fn partial_path(output: &Path) -> PathBuf {
    let mut name = output.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

fn download_bar(length: Option<u64>, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(length, ProgressDrawTarget::stderr());
    let template = if length.is_some() {
        "{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}"
    } else {
        "{spinner} [{elapsed_precise}] {bytes} {bytes_per_sec}"
    };
    bar.set_style(
        ProgressStyle::with_template(template)
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn text_field<'a>(document: &'a Value, name: &str) -> &'a str {
    document.get(name).and_then(Value::as_str).unwrap_or("?")
}

/// One line per report: id, status, and the manifest's summary when completed.
fn describe_report(report: &Value) -> String {
    let report_id = text_field(report, "report_id");
    let status = text_field(report, "status");
    let Some(manifest) = report.get("manifest") else {
        return format!("{report_id}  {status}");
    };
    let number = |name: &str| manifest.get(name).and_then(Value::as_u64).unwrap_or(0);
    let window = match manifest.get("window_start").and_then(Value::as_str) {
        Some(start) => format!(
            "  window={start}..{} #{}",
            text_field(manifest, "window_end"),
            number("window_sequence")
        ),
        None => String::new(),
    };
    format!(
        "{report_id}  {status}  records={}  bytes={} ({})  offsets={}..{}{window}  key={}  sha256={}",
        number("records"),
        number("bytes"),
        human_bytes(number("bytes")),
        manifest
            .get("first_offset")
            .map(Value::to_string)
            .unwrap_or_default(),
        manifest
            .get("last_offset")
            .map(Value::to_string)
            .unwrap_or_default(),
        text_field(manifest, "key"),
        text_field(manifest, "sha256"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_described_on_one_line() {
        let pending = json!({"report_id": "o~0-5", "stream": "o", "status": "pending"});
        assert_eq!(describe_report(&pending), "o~0-5  pending");
        let completed = json!({
            "report_id": "o~0-5", "stream": "o", "status": "completed",
            "manifest": {"records": 3, "bytes": 2048, "first_offset": 1, "last_offset": 5,
                         "key": "reports/o/x.xml", "sha256": "ab"}
        });
        let line = describe_report(&completed);
        assert!(
            line.starts_with("o~0-5  completed  records=3  bytes=2048"),
            "{line}"
        );
        assert!(line.contains("key=reports/o/x.xml"), "{line}");
    }

    #[test]
    fn digests_print_as_lowercase_hex() {
        assert_eq!(
            hex::encode(Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            partial_path(Path::new("out.xml")),
            PathBuf::from("out.xml.part")
        );
    }
}

//! `quire send`: a file of any size, read on a blocking thread, sent in
//! NDJSON arrays one request after another, with a progress bar and a
//! progress file that `--resume` continues from.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tokio::sync::mpsc;

use crate::cli::{GlobalOptions, SendArgs};
use crate::client::{Accepted, ApiClient, is_retryable, retry_line, retry_pause, with_retries};
use crate::error::{CliError, EXIT_INTERRUPTED};
use crate::output::Output;
use crate::records::RecordReader;
use crate::state::SendProgress;

/// Read-ahead of the blocking reader.
const INPUT_BUFFER_BYTES: usize = 1 << 20;
/// Arrays read ahead while one is in flight.
const ARRAYS_READ_AHEAD: usize = 2;

/// One request's worth of records.
#[derive(Debug, Default)]
struct Batch {
    body: Vec<u8>,
    records: u64,
    /// Offset just past the batch's last record.
    end_offset: u64,
}

pub async fn run(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &SendArgs,
) -> Result<(), CliError> {
    let output = Output::new(global.json);
    let state_path = arguments
        .state_path
        .clone()
        .or_else(|| SendProgress::default_path(&arguments.file));
    let previous = match &state_path {
        Some(path) => SendProgress::load(path)?,
        None => None,
    };
    let (mut input, file_size) = open_input(&arguments.file)?;

    let (reader, mut progress) = match (arguments.resume, previous) {
        (false, Some(previous)) => {
            return Err(CliError::Usage(format!(
                "{} says an earlier send stopped after {} records (byte {}); pass --resume to continue from there, or delete it to send everything again",
                state_path
                    .as_deref()
                    .map(Path::display)
                    .map(|path| path.to_string())
                    .unwrap_or_default(),
                previous.records,
                previous.offset
            )));
        }
        (true, None) => {
            return Err(CliError::Usage(match &state_path {
                Some(path) => format!("nothing to resume: there is no {}", path.display()),
                None => "--resume with stdin needs --state PATH (the file the first run wrote)"
                    .to_owned(),
            }));
        }
        (true, Some(previous)) => {
            check_resumable(&previous, arguments, file_size)?;
            skip_to(&mut input, previous.offset, &arguments.file)?;
            let reader = RecordReader::at_offset(input, previous.format, previous.offset);
            (reader, previous)
        }
        (false, None) => {
            let (reader, format) = RecordReader::detect(input)?;
            let progress = SendProgress::new(&arguments.stream, &arguments.file, format, file_size);
            (reader, progress)
        }
    };

    // A resume cuts the input into the same arrays as the first run, so an
    // array sent again carries the same body under the same key.
    let (array_size, max_request_bytes) = match (progress.array_size, progress.max_request_bytes) {
        (Some(array_size), Some(max_request_bytes)) => {
            let asked_otherwise = arguments
                .array_size
                .is_some_and(|asked| asked != array_size)
                || arguments
                    .max_request_bytes
                    .is_some_and(|asked| asked != max_request_bytes);
            if asked_otherwise {
                eprintln!(
                    "resuming with the first run's arrays: --array {array_size} --max-request-bytes {max_request_bytes}"
                );
            }
            (array_size, max_request_bytes)
        }
        _ => array_bounds(client, arguments).await?,
    };
    if progress.run_id.is_empty() {
        // A progress file of an older release: its arrays had no keys.
        progress.run_id = SendProgress::new("", "", progress.format, None).run_id;
    }
    progress.array_size = Some(array_size);
    progress.max_request_bytes = Some(max_request_bytes);
    // Written before the first array goes out: a send killed before any
    // answer is resumed under the same run id, so that array is not doubled.
    if let Some(path) = &state_path {
        progress.save(path)?;
    }

    let bar = progress_bar(file_size, progress.offset, global.json);
    let started = Instant::now();
    let records_before = progress.records;
    let bytes_before = progress.offset;
    let mut arrays = 0u64;
    let (sender, mut batches) = mpsc::channel(ARRAYS_READ_AHEAD);
    let reading = tokio::task::spawn_blocking(move || {
        read_batches(reader, array_size, max_request_bytes, &sender)
    });

    let interrupted = stop_on_ctrl_c(bar.clone());
    while let Some(batch) = batches.recv().await {
        let outcome = match batch {
            Ok(batch) => send_batch(
                client,
                arguments,
                &batch,
                &progress.idempotency_key(progress.records),
                &bar,
                &interrupted,
            )
            .await
            .and_then(|accepted| {
                record_progress(&mut progress, &batch, &accepted, state_path.as_deref())
            }),
            Err(error) => Err(error),
        };
        // The array in flight was answered and recorded: stop between arrays.
        let outcome = outcome.and_then(|()| match interrupted.load(Ordering::SeqCst) {
            true => Err(CliError::Interrupted),
            false => Ok(()),
        });
        if let Err(error) = outcome {
            bar.abandon();
            // Dropping the receiver ends the reader at its next array.
            drop(batches);
            let _ = reading.await;
            return Err(stopped(error, &progress, arguments, state_path.as_deref()));
        }
        arrays += 1;
        bar.set_position(progress.offset);
        let elapsed = started.elapsed().as_secs_f64().max(1e-3);
        bar.set_message(format!(
            "{} records ({:.0}/s)",
            progress.records,
            (progress.records - records_before) as f64 / elapsed
        ));
    }
    let _ = reading.await;
    bar.finish_and_clear();

    if let Some(path) = &state_path {
        SendProgress::remove(path)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let records_sent = progress.records - records_before;
    let bytes_read = progress.offset.saturating_sub(bytes_before);
    output.result(
        &json!({
            "stream": arguments.stream,
            "records": records_sent,
            "records_total": progress.records,
            "arrays": arrays,
            "bytes": bytes_read,
            "seconds": seconds,
            "last_id": progress.last_id,
            "resumed": arguments.resume,
        }),
        || {
            format!(
                "sent {records_sent} records in {arrays} arrays to stream {} ({}, {:.1}s, {:.0} records/s){}",
                arguments.stream,
                human_bytes(bytes_read),
                seconds,
                records_sent as f64 / seconds.max(1e-3),
                if arguments.resume {
                    format!("; {} records in all", progress.records)
                } else {
                    String::new()
                }
            )
        },
    );
    Ok(())
}

/// The first ctrl-c lets the array in flight finish (so the progress file
/// says exactly what the API accepted); a second one quits at once.
fn stop_on_ctrl_c(bar: ProgressBar) -> Arc<AtomicBool> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&interrupted);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        flag.store(true, Ordering::SeqCst);
        bar.suspend(|| {
            eprintln!(
                "interrupted: finishing the array in flight (ctrl-c again quits at once, and that array may then be sent twice by --resume)"
            )
        });
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
    interrupted
}

type Input = BufReader<Box<dyn ReadSeek>>;

/// Stdin cannot seek; `skip_to` reads past what was sent instead.
trait ReadSeek: Read + Send {
    fn seek_to(&mut self, offset: u64) -> io::Result<()>;
}

impl ReadSeek for File {
    fn seek_to(&mut self, offset: u64) -> io::Result<()> {
        self.seek(SeekFrom::Start(offset)).map(|_| ())
    }
}

impl ReadSeek for io::Stdin {
    fn seek_to(&mut self, offset: u64) -> io::Result<()> {
        let skipped = io::copy(&mut self.take(offset), &mut io::sink())?;
        if skipped < offset {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("stdin ended after {skipped} bytes, before the {offset} already sent"),
            ));
        }
        Ok(())
    }
}

fn open_input(file: &str) -> Result<(Input, Option<u64>), CliError> {
    if file == "-" {
        let stdin: Box<dyn ReadSeek> = Box::new(io::stdin());
        return Ok((BufReader::with_capacity(INPUT_BUFFER_BYTES, stdin), None));
    }
    let opened =
        File::open(file).map_err(|source| CliError::io(format!("opening {file}"), source))?;
    let metadata = opened
        .metadata()
        .map_err(|source| CliError::io(format!("reading {file}'s size"), source))?;
    let size = metadata.is_file().then_some(metadata.len());
    let boxed: Box<dyn ReadSeek> = Box::new(opened);
    Ok((BufReader::with_capacity(INPUT_BUFFER_BYTES, boxed), size))
}

fn skip_to(input: &mut Input, offset: u64, file: &str) -> Result<(), CliError> {
    input
        .get_mut()
        .seek_to(offset)
        .map_err(|source| CliError::io(format!("moving to byte {offset} of {file}"), source))
}

/// The progress file must be this file's and this stream's, and the file
/// must still reach the offset.
fn check_resumable(
    previous: &SendProgress,
    arguments: &SendArgs,
    file_size: Option<u64>,
) -> Result<(), CliError> {
    if previous.stream != arguments.stream {
        return Err(CliError::Usage(format!(
            "the progress file is for stream {}, not {}",
            previous.stream, arguments.stream
        )));
    }
    if let (Some(before), Some(now)) = (previous.file_size, file_size)
        && now < before
    {
        return Err(CliError::Usage(format!(
            "{} is shorter ({now} bytes) than when it was first sent ({before} bytes): not the same file",
            arguments.file
        )));
    }
    Ok(())
}

/// Runs on a blocking thread: reads records into arrays and hands them over
/// until the input ends, an error, or the receiver is gone.
fn read_batches(
    mut reader: RecordReader<Input>,
    array_size: u64,
    max_request_bytes: u64,
    sender: &mpsc::Sender<Result<Batch, CliError>>,
) {
    let mut batch = Batch {
        body: Vec::new(),
        records: 0,
        end_offset: reader.offset(),
    };
    loop {
        let record = match reader.next_record() {
            Ok(Some(record)) => record,
            Ok(None) => break,
            Err(error) => {
                let _ = sender.blocking_send(Err(error.into()));
                return;
            }
        };
        let would_be = batch.body.len() as u64 + record.bytes.len() as u64 + 1;
        if batch.records > 0 && would_be > max_request_bytes {
            let full = std::mem::take(&mut batch);
            if sender.blocking_send(Ok(full)).is_err() {
                return;
            }
        }
        batch.body.extend_from_slice(&record.bytes);
        batch.body.push(b'\n');
        batch.records += 1;
        batch.end_offset = record.end_offset;
        if batch.records >= array_size {
            let full = std::mem::take(&mut batch);
            if sender.blocking_send(Ok(full)).is_err() {
                return;
            }
        }
    }
    if batch.records > 0 {
        let _ = sender.blocking_send(Ok(batch));
    }
}

/// Records per array and bytes per request where the API does not say
/// (an API older than `GET /v1/limits`).
const FALLBACK_ARRAY_SIZE: u64 = 1000;
const FALLBACK_REQUEST_BYTES: u64 = 8 * 1024 * 1024;
/// Most records per array, whatever the API allows (as `--array`).
const MAX_ARRAY_SIZE: u64 = 100_000;

/// How the input is cut into arrays: `--array` and `--max-request-bytes`
/// where given, otherwise as large as the API takes (`GET /v1/limits`).
/// A request costs the API about the same whatever its size, so full
/// arrays are what makes a send as fast as the API can ingest.
async fn array_bounds(client: &ApiClient, arguments: &SendArgs) -> Result<(u64, u64), CliError> {
    if let (Some(array_size), Some(max_request_bytes)) =
        (arguments.array_size, arguments.max_request_bytes)
    {
        return Ok((array_size, max_request_bytes));
    }
    let limits = match with_retries(arguments.retries, || client.limits()).await {
        Ok(limits) => Some(limits),
        Err(CliError::Api(api)) if api.status == reqwest::StatusCode::NOT_FOUND => None,
        Err(error) => return Err(error),
    };
    let array_size = arguments.array_size.unwrap_or(match limits {
        Some(limits) => limits.max_records_per_request.clamp(1, MAX_ARRAY_SIZE),
        None => FALLBACK_ARRAY_SIZE,
    });
    let max_request_bytes = arguments.max_request_bytes.unwrap_or(match limits {
        Some(limits) => limits.max_body_bytes.max(1),
        None => FALLBACK_REQUEST_BYTES,
    });
    Ok((array_size, max_request_bytes))
}

/// Sends one array under its `Idempotency-Key`; what [`is_retryable`]
/// covers (a 429 or 503, a 409 for the key's first request still in
/// progress, a lost connection) is retried with the same key after the
/// API's `Retry-After` or a growing pause (bounded), shown on the progress
/// bar, and not once ctrl-c was pressed (unlike [`with_retries`]).
async fn send_batch(
    client: &ApiClient,
    arguments: &SendArgs,
    batch: &Batch,
    idempotency_key: &str,
    bar: &ProgressBar,
    interrupted: &AtomicBool,
) -> Result<Accepted, CliError> {
    let mut attempt = 0u32;
    loop {
        let outcome = client
            .post_records(&arguments.stream, batch.body.clone(), idempotency_key)
            .await;
        match outcome {
            Err(error)
                if attempt < arguments.retries
                    && is_retryable(&error)
                    && !interrupted.load(Ordering::SeqCst) =>
            {
                attempt += 1;
                let pause = retry_pause(&error, attempt);
                bar.suspend(|| {
                    eprintln!("{}", retry_line(&error, attempt, arguments.retries, pause))
                });
                bar.set_message(format!(
                    "waiting {pause:?} before retry {attempt} of {}",
                    arguments.retries
                ));
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

fn record_progress(
    progress: &mut SendProgress,
    batch: &Batch,
    accepted: &Accepted,
    state_path: Option<&Path>,
) -> Result<(), CliError> {
    if accepted.count != batch.records {
        return Err(CliError::Integrity(format!(
            "the API accepted {} records of an array of {}",
            accepted.count, batch.records
        )));
    }
    progress.records += batch.records;
    progress.offset = batch.end_offset;
    progress.last_id = accepted.ids.last().cloned();
    if let Some(path) = state_path {
        progress.save(path)?;
    }
    Ok(())
}

/// Wraps an error with how far the send got and the command that continues it.
fn stopped(
    error: CliError,
    progress: &SendProgress,
    arguments: &SendArgs,
    state_path: Option<&Path>,
) -> CliError {
    let mut lines = Vec::new();
    if let CliError::Api(api) = &error
        && let Some(index) = api.details.get("index").and_then(|index| index.as_u64())
    {
        lines.push(format!(
            "the refused record is record number {} of the input (counting from 1)",
            progress.records + index + 1
        ));
    }
    lines.push(format!(
        "{} records were accepted (the input up to byte {}){}",
        progress.records,
        progress.offset,
        match &error {
            CliError::Interrupted => "",
            CliError::Api(api) if api.code == "publish_outcome_unknown" => {
                "; the array that failed may have been published (its commit did not finish): look at the stream before resuming"
            }
            _ => "; the array that failed was not",
        }
    ));
    let resume_command = match state_path {
        Some(path) => {
            let state = match &arguments.state_path {
                Some(explicit) => format!(" --state {}", explicit.display()),
                None => String::new(),
            };
            lines.push(format!("progress saved in {}", path.display()));
            Some(format!(
                "quire send --stream {} {} --resume{state}",
                arguments.stream, arguments.file
            ))
        }
        None => None,
    };
    match &resume_command {
        Some(command) => lines.push(format!("to continue: {command}")),
        None => lines.push(format!(
            "stdin without --state: to continue, send the input from byte {} again",
            progress.offset
        )),
    }
    CliError::Stopped {
        source: Box::new(error),
        progress: lines.join("\n"),
        resume: json!({
            "records": progress.records,
            "offset": progress.offset,
            "state_file": state_path.map(PathBuf::from),
            "resume_command": resume_command,
        }),
    }
}

fn progress_bar(file_size: Option<u64>, position: u64, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = match file_size {
        Some(size) => ProgressBar::with_draw_target(Some(size), ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        ),
        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bytes} {bytes_per_sec} {msg}")
                .expect("a valid template"),
        ),
    };
    bar.set_position(position);
    bar.reset_eta();
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

pub fn human_bytes(bytes: u64) -> String {
    indicatif::HumanBytes(bytes).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn batches_of(text: &str, array_size: u64, max_request_bytes: u64) -> Vec<Batch> {
        let boxed: Box<dyn ReadSeek> = Box::new(FakeFile(Cursor::new(text.as_bytes().to_vec())));
        let (reader, _) = RecordReader::detect(BufReader::new(boxed)).unwrap();
        let (sender, mut receiver) = mpsc::channel(1000);
        read_batches(reader, array_size, max_request_bytes, &sender);
        drop(sender);
        let mut batches = Vec::new();
        while let Ok(batch) = receiver.try_recv() {
            batches.push(batch.unwrap());
        }
        batches
    }

    struct FakeFile(Cursor<Vec<u8>>);

    impl Read for FakeFile {
        fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
            self.0.read(buffer)
        }
    }

    impl ReadSeek for FakeFile {
        fn seek_to(&mut self, offset: u64) -> io::Result<()> {
            self.0.set_position(offset);
            Ok(())
        }
    }

    #[test]
    fn arrays_hold_at_most_array_size_records_as_ndjson() {
        let batches = batches_of(r#"[{"a":1},{"a":2},{"a":3}]"#, 2, 1 << 20);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].body, b"{\"a\":1}\n{\"a\":2}\n");
        assert_eq!(batches[0].records, 2);
        assert_eq!(batches[0].end_offset, 16);
        assert_eq!(batches[1].body, b"{\"a\":3}\n");
        assert_eq!(batches[1].end_offset, 24);
    }

    #[test]
    fn arrays_also_stop_before_the_byte_limit() {
        let batches = batches_of("{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n", 1000, 17);
        let sizes: Vec<u64> = batches.iter().map(|batch| batch.records).collect();
        assert_eq!(sizes, vec![2, 1]);
    }
}

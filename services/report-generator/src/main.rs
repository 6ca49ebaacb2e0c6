//! `report-generator [--config FILE] [--drain]`: serve until SIGTERM, or
//! drain everything queued and exit 0. Kafka and S3 failures restart the
//! session (see `supervisor.rs`); the process exits non-zero only on errors
//! a restart cannot cure.
//!
//! `report-generator partitions status|grow --to N`: the partition layout,
//! and the procedure that grows it (`quire_log::grow`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use report_generator::{Application, Mode};

/// jemalloc instead of glibc malloc: the worker allocates and frees many
/// small buffers per record (messages, field slices, XML chunks) from one
/// thread while tokio's and the S3 client's threads free them, the pattern
/// glibc's arenas handle worst. Purging is set for a long-running service:
/// a background thread returns dirty pages after one second, so a burst's
/// memory goes back to the system (the memory test holds the worker to its
/// budget with this setting).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's start-up options (its `malloc_conf` symbol, prefixed as the
/// crate builds it); `_RJEM_MALLOC_CONF` in the environment still overrides.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf =
    MallocConf(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);
// SAFETY: the pointer is to a static C string, never written.
unsafe impl Sync for MallocConf {}

#[derive(Parser)]
#[command(about = "quire's report generator: record arrays from Kafka into XML reports on S3")]
struct Cli {
    /// A configuration file (TOML) layered over the defaults; QUIRE_...
    /// environment variables override both.
    #[arg(long, env = "QUIRE_CONFIG")]
    config: Option<PathBuf>,
    /// Report everything queued, then exit 0.
    #[arg(long)]
    drain: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// The partition layout of the records topic: what quire routes streams
    /// by, and the topics' live partition counts.
    #[command(subcommand)]
    Partitions(Partitions),
}

#[derive(Subcommand)]
enum Partitions {
    /// Prints the layout in force and the topics' partition counts.
    Status,
    /// Grows the records and watermark topics to `--to` partitions and moves
    /// every stream whose partition changes, losing and splitting no report
    /// (README: "Growing the partitions"). Run it with the API's and the
    /// workers' configuration, while they run; running it again resumes it.
    Grow {
        /// The new partition count (more than the layout's).
        #[arg(long)]
        to: i32,
        /// How long to wait for the workers to process the move markers
        /// (e.g. 10m, 90s).
        #[arg(long, default_value = "10m", value_parser = parse_duration)]
        timeout: Duration,
        /// How long to wait after freezing the moving streams before
        /// marking their partitions; by default what the configuration's
        /// api.kafka_check_interval_ms, api.publish_timeout_ms and
        /// kafka.transaction_timeout_ms require.
        #[arg(long, value_parser = parse_duration)]
        settle: Option<Duration>,
    },
}

/// `90s`, `10m`, `1500ms`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, "s"), |at| text.split_at(at));
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 90s, 10m or 1500ms"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "s" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number * 60)),
        _ => Err(format!(
            "{text:?} is not a duration like 90s, 10m or 1500ms"
        )),
    }
}

/// The `partitions` subcommands.
async fn partitions(settings: quire_config::Settings, command: Partitions) -> anyhow::Result<()> {
    match command {
        Partitions::Status => {
            let kafka = &settings.kafka;
            let records = quire_queue::describe_topic(kafka, &kafka.topics.records).await?;
            let watermarks = quire_queue::describe_topic(kafka, &kafka.topics.watermarks).await?;
            let recorded = quire_log::read_layout(kafka, &kafka.topics.watermarks).await?;
            let resolved = quire_log::resolve_layout(
                recorded,
                &records,
                watermarks.partitions,
                kafka.partitions,
            );
            println!(
                "records topic {} (id {}): {} partitions",
                records.name, records.id, records.partitions
            );
            println!(
                "watermark topic {}: {} partitions",
                watermarks.name, watermarks.partitions
            );
            match resolved {
                Ok(resolved) => {
                    let layout = resolved.layout;
                    let recorded = if resolved.unrecorded {
                        " (not recorded yet: the first service to start records it)"
                    } else {
                        ""
                    };
                    match layout.moving_to {
                        Some(target) => println!(
                            "layout: {} partitions, growing to {target} (the moving streams are frozen: run `partitions grow --to {target}` to finish){recorded}",
                            layout.partitions
                        ),
                        None => println!(
                            "layout: streams are routed among {} partitions{recorded}",
                            layout.partitions
                        ),
                    }
                }
                Err(error) => println!("layout: {error}"),
            }
            Ok(())
        }
        Partitions::Grow {
            to,
            timeout,
            settle,
        } => {
            let options = quire_log::grow::GrowOptions {
                to,
                timeout,
                settle: settle.unwrap_or_else(|| quire_log::grow::settle_time(&settings)),
            };
            let mut say = |text: &str| println!("grow: {text}");
            let grown = quire_log::grow::grow(&settings, &options, &mut say).await?;
            println!(
                "grow: done: {} -> {} partitions ({} move markers)",
                grown.from,
                grown.to,
                grown.markers.len()
            );
            Ok(())
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = quire_config::load(cli.config.as_deref())?;
    if let Some(Command::Partitions(command)) = cli.command {
        quire_config::init_telemetry(settings.log.format, "warn");
        return partitions(settings, command).await;
    }
    quire_config::init_telemetry(
        settings.log.format,
        "info,librdkafka=warn,rdkafka=warn,aws=warn",
    );
    let grace = settings.worker.shutdown_grace;
    let mode = if cli.drain { Mode::Drain } else { Mode::Serve };
    let application = Application::build(settings, mode)
        .await
        .context("the report generator could not start")?;
    // Sessions until stopped or drained; Kafka and S3 failures rebuild the
    // session, errors a restart cannot cure end here, non-zero.
    let summary = application.run_until(terminated(grace)).await?;
    tracing::info!(
        arrays = summary.arrays,
        records = summary.records,
        reports = summary.reports,
        dead_letters = summary.dead_letters,
        "report generator exiting"
    );
    Ok(())
}

/// Resolves on SIGTERM or ctrl-c: the loop then finishes the array in hand,
/// commits and aborts what is open. If that takes longer than the grace
/// period, the process exits non-zero rather than hang.
async fn terminated(grace: Duration) {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "stop requested: finishing the array in hand"
    );
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        tracing::error!("grace period over before the worker stopped; exiting");
        std::process::exit(2);
    });
}

//! `report-generator [--config FILE] [--drain]`: serve until SIGTERM, or
//! drain everything queued and exit 0. Kafka and S3 failures restart the
//! session (see `supervisor.rs`); the process exits non-zero only on errors
//! a restart cannot cure.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = quire_config::load(cli.config.as_deref())?;
    quire_config::init_telemetry(
        settings.log.format,
        "info,librdkafka=warn,rdkafka=warn,aws=warn",
    );
    let grace = Duration::from_millis(settings.worker.shutdown_grace_ms);
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

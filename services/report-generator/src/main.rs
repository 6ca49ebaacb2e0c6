//! `report-generator [--config FILE] [--drain]`: serve until SIGTERM, or
//! drain everything queued and exit 0. Kafka and S3 failures restart the
//! session (see `supervisor.rs`); the process exits non-zero only on errors
//! a restart cannot cure.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use report_generator::{Mode, Monitor, supervisor};

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
    let stop = Arc::new(AtomicBool::new(false));
    spawn_signal_handler(
        Arc::clone(&stop),
        Duration::from_millis(settings.worker.shutdown_grace_ms),
    );
    let mode = if cli.drain { Mode::Drain } else { Mode::Serve };
    let monitor = Monitor::new(&settings.worker);
    monitor.serve(&settings.worker.metrics_listen).await?;
    // Report retention (s3.report_retention_days): a bucket lifecycle rule
    // where the server has them, else a periodic sweep. It only logs errors.
    let retention = quire_s3::start_retention(&settings.s3, Arc::clone(&stop)).await;
    // Sessions until stopped or drained; Kafka and S3 failures rebuild the
    // session, errors a restart cannot cure end here, non-zero.
    let summary = supervisor::run(&settings, mode, &stop, &monitor).await;
    // A drain ends without raising the stop flag.
    retention.abort();
    let summary = summary?;
    tracing::info!(
        arrays = summary.arrays,
        records = summary.records,
        reports = summary.reports,
        dead_letters = summary.dead_letters,
        "report generator exiting"
    );
    Ok(())
}

/// SIGTERM or ctrl-c raise the stop flag: the loop finishes the array in
/// hand, commits and aborts what is open. If that takes longer than the
/// grace period, the process exits non-zero rather than hang.
fn spawn_signal_handler(stop: Arc<AtomicBool>, grace: Duration) {
    tokio::spawn(async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler");
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!(
            grace_ms = grace.as_millis() as u64,
            "stop requested: finishing the array in hand"
        );
        stop.store(true, Ordering::Release);
        tokio::time::sleep(grace).await;
        tracing::error!("grace period over before the worker stopped; exiting");
        std::process::exit(2);
    });
}

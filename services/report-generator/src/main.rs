//! `report-generator [--config FILE] [--drain]`: serve until SIGTERM, or
//! drain everything queued and exit 0. Kafka and S3 failures restart the
//! session (see `supervisor.rs`); the process exits non-zero only on errors
//! a restart cannot cure.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use report_generator::{Application, Mode};

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

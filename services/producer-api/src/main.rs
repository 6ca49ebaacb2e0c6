//! `producer-api [--config FILE]`: serve the producer API until SIGTERM or
//! ctrl-c.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use producer_api::Application;

#[derive(Parser)]
#[command(about = "quire's producer API: record arrays in over HTTP, reports out")]
struct Cli {
    /// A configuration file (TOML) layered over the defaults; QUIRE_...
    /// environment variables override both.
    #[arg(long, env = "QUIRE_CONFIG")]
    config: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let settings = quire_config::load(cli.config.as_deref())?;
    quire_config::init_telemetry(
        settings.log.format,
        "info,librdkafka=warn,rdkafka=warn,aws=warn",
    );
    let application = Application::build(settings)
        .await
        .context("the producer api could not start")?;
    application
        .run_until_stopped()
        .await
        .context("the producer api stopped on an error")?;
    Ok(())
}

//! Logging set-up: human-readable by default, JSON on a switch, `RUST_LOG`
//! overrides the default level filter.

use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Installs the global tracing subscriber. `default_filter` applies when
/// `RUST_LOG` is unset (e.g. `"info,rdkafka=warn"`). Calling it twice is
/// harmless: the second call keeps the first subscriber.
pub fn init_telemetry(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _already_installed = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

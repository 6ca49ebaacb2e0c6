//! What can go wrong, how it is shown, and the exit code it gives.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Map, Value, json};

use crate::records::ReadError;
use crate::state::StateError;

/// Exit code for errors (the API refused, the network failed, a file).
pub const EXIT_ERROR: i32 = 1;
/// Exit code for a command line that cannot be run as given.
pub const EXIT_USAGE: i32 = 2;

/// Exit code after ctrl-c (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: i32 = 130;

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("interrupted")]
    Interrupted,
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Api(Box<ApiError>),
    #[error("cannot reach the API at {url}: {}", error_chain(source))]
    Http { url: String, source: reqwest::Error },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{0}")]
    Integrity(String),
    /// A definition refused by the local check (the API's own), before
    /// anything was sent.
    #[error("{0}")]
    Invalid(String),
    /// Another error, with what a send had done before it and how to go on.
    #[error("{source}\n{progress}")]
    Stopped {
        source: Box<CliError>,
        progress: String,
        resume: Value,
    },
}

/// The API's JSON error (`{"error": {"code", "message", ...details}}`).
#[derive(Debug, thiserror::Error)]
#[error(
    "the API answered {status}: {code}: {message}{}",
    format_details(details)
)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    pub details: Map<String, Value>,
    pub retry_after: Option<Duration>,
}

/// reqwest's own message hides the cause ("connection refused") in its sources.
fn error_chain(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn format_details(details: &Map<String, Value>) -> String {
    if details.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = details
        .iter()
        .map(|(key, value)| match value {
            Value::String(text) => format!("{key}={text}"),
            other => format!("{key}={other}"),
        })
        .collect();
    format!(" ({})", parts.join(", "))
}

impl CliError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_) => EXIT_USAGE,
            Self::Interrupted => EXIT_INTERRUPTED,
            Self::Stopped { source, .. } => source.exit_code(),
            _ => EXIT_ERROR,
        }
    }

    /// The error as one JSON document, for `--json`.
    pub fn to_json(&self) -> Value {
        let mut error = match self {
            Self::Api(api) => {
                let mut fields = api.details.clone();
                fields.insert("code".to_owned(), json!(api.code));
                fields.insert("message".to_owned(), json!(api.message));
                fields.insert("status".to_owned(), json!(api.status.as_u16()));
                Value::Object(fields)
            }
            Self::Stopped { source, resume, .. } => {
                let mut inner = source.to_json()["error"].clone();
                inner["progress"] = resume.clone();
                inner
            }
            Self::Usage(message) => json!({"code": "usage", "message": message}),
            Self::Interrupted => json!({"code": "interrupted", "message": "interrupted"}),
            Self::Http { .. } => json!({"code": "unreachable", "message": self.to_string()}),
            Self::Integrity(message) => json!({"code": "integrity", "message": message}),
            Self::Invalid(message) => json!({"code": "invalid_definition", "message": message}),
            Self::Io { .. } | Self::Read(_) | Self::State(_) => {
                json!({"code": "local", "message": self.to_string()})
            }
        };
        if let Value::Object(fields) = &mut error {
            fields
                .entry("message")
                .or_insert_with(|| json!(self.to_string()));
        }
        json!({ "error": error })
    }
}

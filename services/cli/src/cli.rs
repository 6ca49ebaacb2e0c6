//! The command line: global options and one subcommand per task.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use quire_config::Secret;

/// Where `deploy/local/services up` runs the producer API.
pub const DEFAULT_API_URL: &str = "http://127.0.0.1:18080";

#[derive(Debug, Parser)]
#[command(
    name = "quire",
    version,
    about = "Send records to quire, cut reports, and fetch them, over the producer API",
    after_help = "Exit codes: 0 success, 1 error (the API's code and message are shown), 2 usage, 130 interrupted (send saves its progress first)."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalOptions,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct GlobalOptions {
    /// The producer API's base URL.
    #[arg(long = "api", env = "QUIRE_API_URL", default_value = DEFAULT_API_URL, global = true)]
    pub api_url: String,
    /// Bearer token for the API (sent as `Authorization: Bearer TOKEN`).
    #[arg(long, env = "QUIRE_API_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<Secret>,
    /// A PEM file of the certificate authority (or self-signed certificate)
    /// that an `https://` API presents, trusted beside the system's roots.
    #[arg(long, env = "QUIRE_API_CA_CERT", global = true)]
    pub ca_cert: Option<PathBuf>,
    /// Send the token over plain `http://` to a host that is not loopback
    /// (refused by default: anyone on the path could read it).
    #[arg(long, global = true)]
    pub allow_plain_http: bool,
    /// Machine-readable output: JSON on stdout (one document per line), errors as JSON on stderr.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Send the records of an NDJSON file or a JSON array, in arrays, resumably.
    Send(SendArgs),
    /// Cut a report of a stream now; prints the report id.
    Cut(CutArgs),
    /// Whether a report is pending or completed, with its manifest.
    Status(ReportArgs),
    /// Download a report's content to a file, checking its SHA-256.
    Get(GetArgs),
    /// List a stream's completed reports (all pages).
    List(ListArgs),
    /// Print each new completed report of the streams as it appears. Polls
    /// `GET /v1/streams/{stream}/reports` every `--interval`.
    Watch(WatchArgs),
    /// Make API tokens (the API itself holds only their digests).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Show a stream's definition, put one from a file after checking it
    /// here, or print the XML Schema a definition gives its reports.
    #[command(subcommand)]
    Define(DefineCommand),
}

#[derive(Debug, Subcommand)]
pub enum DefineCommand {
    /// Print the stream's definition in force (as the API stored it).
    Show(DefineShowArgs),
    /// Check a definition file with the API's own check, then put it
    /// (nothing is sent when the check fails).
    Put(DefinePutArgs),
    /// Check a definition file, or read a stream's definition from the
    /// API, and print the XSD its reports point to (without sending
    /// anything: the same bytes the worker stores).
    Schema(DefineSchemaArgs),
}

#[derive(Debug, Args)]
pub struct DefineShowArgs {
    /// The stream.
    #[arg(long, short = 's')]
    pub stream: String,
}

#[derive(Debug, Args)]
pub struct DefinePutArgs {
    /// The stream.
    #[arg(long, short = 's')]
    pub stream: String,
    /// The definition, a JSON file; `-` reads stdin.
    pub file: String,
    /// Check only: say what the API would publish, send nothing.
    #[arg(long)]
    pub check: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["file", "stream"])))]
pub struct DefineSchemaArgs {
    /// A definition file (`-` reads stdin).
    pub file: Option<String>,
    /// Or the stream whose definition in force to read from the API.
    #[arg(long, short = 's')]
    pub stream: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a new random token; prints it (for the client, e.g.
    /// QUIRE_API_TOKEN) and its `api.tokens` line (for the API, e.g.
    /// QUIRE_API__TOKENS). The token is shown once: it is never stored.
    New(NewTokenArgs),
}

#[derive(Debug, Args)]
pub struct NewTokenArgs {
    /// The token's name in the API's table, logs and errors.
    #[arg(long)]
    pub name: String,
    /// `read`, `write` or `read+write`.
    #[arg(long, default_value = "read+write")]
    pub scopes: String,
    /// Stream-name prefixes the token reaches, joined by `+`; `*` for all.
    #[arg(long, default_value = "*")]
    pub streams: String,
}

#[derive(Debug, Args)]
pub struct SendArgs {
    /// The stream to send to.
    #[arg(long, short = 's')]
    pub stream: String,
    /// NDJSON (one object per line) or one JSON array; `-` reads stdin.
    pub file: String,
    /// Records per request (default: as many as the API takes, from
    /// `GET /v1/limits`; 1000 from an API that does not say).
    #[arg(long = "array", value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub array_size: Option<u64>,
    /// Also start a new request before its body passes this many bytes
    /// (default: the API's `max_body_bytes`; 8 MiB from an API that does
    /// not say).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_request_bytes: Option<u64>,
    /// Continue from where the progress file says the last run stopped.
    #[arg(long)]
    pub resume: bool,
    /// The progress file (default `FILE.quire-progress`; needed with `-` to be resumable).
    #[arg(long = "state")]
    pub state_path: Option<PathBuf>,
    /// Retries of an array the API refused with 429 or 503 (it published
    /// nothing) or that got no answer (connection refused, reset or closed:
    /// the same Idempotency-Key makes a published one a replay), each after
    /// the API's Retry-After or a doubling pause (at most 30s).
    #[arg(long, default_value_t = 8)]
    pub retries: u32,
}

#[derive(Debug, Args)]
pub struct CutArgs {
    /// The stream.
    #[arg(long, short = 's')]
    pub stream: String,
    /// The cut's Idempotency-Key (default: a new one per invocation). Run
    /// the same cut again with the same key to get its report id without a
    /// second cut.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Retries of a cut the API refused with 429 or 503, or that got no
    /// answer (same key, so never a second cut).
    #[arg(long, default_value_t = 8)]
    pub retries: u32,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The report id (`{stream}~{partition}-{offset}`), as `quire cut` printed it.
    pub report: String,
}

#[derive(Debug, Args)]
pub struct GetArgs {
    /// The report id.
    pub report: String,
    /// Where to write the document (`-` for stdout).
    #[arg(long, short = 'o')]
    pub output: PathBuf,
    /// Download through the API even when it offers a presigned S3 URL
    /// (by default the document comes straight from S3 when it does).
    #[arg(long)]
    pub through_api: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// The stream.
    #[arg(long, short = 's')]
    pub stream: String,
    /// Reports asked for per page (1-1000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub page_size: u32,
    /// Only the reports of the time window starting then (RFC 3339 with an
    /// offset, as `window_start` in manifests).
    #[arg(long)]
    pub window_start: Option<String>,
}

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// The stream(s) to watch (repeat for several).
    #[arg(long, short = 's', required = true)]
    pub stream: Vec<String>,
    /// Time between two polls, e.g. `2s`, `500ms`, `1m`.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Also print the reports that were already there when the watch started.
    #[arg(long)]
    pub existing: bool,
    /// Exit after this many reports were printed.
    #[arg(long)]
    pub count: Option<u64>,
}

/// `500ms`, `2s`, `1m` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|character: char| !character.is_ascii_digit()) {
        Some(split) => text.split_at(split),
        None => (text, "s"),
    };
    let amount: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration like 500ms, 2s or 1m"))?;
    let duration = match unit {
        "ms" => Duration::from_millis(amount),
        "s" => Duration::from_secs(amount),
        "m" => Duration::from_secs(amount * 60),
        _ => return Err(format!("`{text}`: the unit must be ms, s or m")),
    };
    if duration.is_zero() {
        return Err("the interval must be more than zero".to_owned());
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(arguments: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("quire").chain(arguments.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn send_takes_its_defaults() {
        let cli = parse(&["send", "--stream", "orders", "orders.ndjson"]).unwrap();
        let Command::Send(send) = cli.command else {
            panic!("not send")
        };
        assert_eq!(send.stream, "orders");
        assert_eq!(send.file, "orders.ndjson");
        assert_eq!(send.array_size, None, "from the API's limits");
        assert_eq!(send.max_request_bytes, None, "from the API's limits");
        assert!(!send.resume);
        assert_eq!(send.state_path, None);
        assert!(!cli.global.json);
    }

    #[test]
    fn global_options_go_anywhere() {
        let cli = parse(&[
            "send",
            "-s",
            "orders",
            "-",
            "--array",
            "50",
            "--resume",
            "--state",
            "p.json",
            "--json",
            "--api",
            "http://h:1",
            "--token",
            "tok-secret-42",
        ])
        .unwrap();
        assert!(cli.global.json);
        assert_eq!(cli.global.api_url, "http://h:1");
        assert_eq!(
            cli.global.token.as_ref().map(Secret::expose),
            Some("tok-secret-42")
        );
        assert!(
            !format!("{cli:?}").contains("tok-secret-42"),
            "the token shows in Debug"
        );
        let Command::Send(send) = cli.command else {
            panic!("not send")
        };
        assert_eq!(send.file, "-");
        assert_eq!(send.array_size, Some(50));
        assert!(send.resume);
        assert_eq!(send.state_path, Some(PathBuf::from("p.json")));
    }

    #[test]
    fn usage_errors_are_refused() {
        assert!(
            parse(&["send", "orders.ndjson"]).is_err(),
            "--stream is required"
        );
        assert!(parse(&["send", "-s", "o", "f", "--array", "0"]).is_err());
        assert!(parse(&["get", "orders~0-1"]).is_err(), "-o is required");
        assert!(parse(&["watch"]).is_err(), "--stream is required");
        assert!(parse(&["list", "-s", "o", "--page-size", "1001"]).is_err());
        assert_eq!(
            parse(&["frobnicate"]).unwrap_err().exit_code(),
            2,
            "usage errors exit 2"
        );
    }

    #[test]
    fn cut_takes_an_optional_key() {
        let cli = parse(&["cut", "-s", "orders", "--idempotency-key", "k-1"]).unwrap();
        let Command::Cut(cut) = cli.command else {
            panic!("not cut")
        };
        assert_eq!(cut.idempotency_key.as_deref(), Some("k-1"));
        let cli = parse(&["cut", "-s", "orders"]).unwrap();
        let Command::Cut(cut) = cli.command else {
            panic!("not cut")
        };
        assert_eq!(cut.idempotency_key, None);
        assert_eq!(cut.retries, 8);
    }

    #[test]
    fn other_commands_parse() {
        let cli = parse(&["get", "orders~0-7", "-o", "out.xml"]).unwrap();
        assert!(
            matches!(cli.command, Command::Get(GetArgs { ref report, .. }) if report == "orders~0-7")
        );
        let cli = parse(&[
            "watch",
            "-s",
            "a",
            "-s",
            "b",
            "--interval",
            "500ms",
            "--count",
            "3",
        ])
        .unwrap();
        let Command::Watch(watch) = cli.command else {
            panic!("not watch")
        };
        assert_eq!(watch.stream, vec!["a", "b"]);
        assert_eq!(watch.interval, Duration::from_millis(500));
        assert_eq!(watch.count, Some(3));
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("fast").is_err());
    }
}

//! Running one scenario in a child process and reading back its result.
//!
//! The parent re-executes this binary as `quire-bench scenario NAME ARGS...`;
//! the child runs the scenario and prints one JSON line with its figures and
//! its own peak resident memory (VmHWM), so scenarios never inflate each
//! other's peak.

use std::process::Command;

use serde::{Deserialize, Serialize};

/// What a scenario measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioResult {
    pub name: String,
    /// Seconds the measured work took.
    pub seconds: f64,
    /// Units of work done (messages, bytes...), for rates.
    pub units: f64,
    /// The child's peak resident memory in bytes.
    pub peak_rss_bytes: u64,
}

impl ScenarioResult {
    pub fn rate(&self) -> f64 {
        self.units / self.seconds
    }
}

const RESULT_PREFIX: &str = "SCENARIO-RESULT ";

/// Runs `name` with `args` in a child process and returns its result.
pub fn spawn(name: &str, args: &[String]) -> anyhow::Result<ScenarioResult> {
    let output = Command::new(std::env::current_exe()?)
        .arg("scenario")
        .arg(name)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "scenario {name} failed: {}",
        output.status
    );
    let stdout = String::from_utf8(output.stdout)?;
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix(RESULT_PREFIX))
        .ok_or_else(|| anyhow::anyhow!("scenario {name} printed no result"))?;
    Ok(serde_json::from_str(line)?)
}

/// The current process's peak resident set size, from /proc/self/status.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                line.strip_prefix("VmHWM:").and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
            })
        })
        .map_or(0, |kib| kib * 1024)
}

/// Entry point of a child: dispatches to the scenario and prints its result.
pub async fn run_scenario(name: &str, args: &[String]) -> anyhow::Result<()> {
    let (seconds, units) = match name.split_once('.') {
        Some(("writer", scenario)) => crate::writer::scenario(scenario, args).await?,
        _ => anyhow::bail!("unknown scenario {name}"),
    };
    let result = ScenarioResult {
        name: name.to_owned(),
        seconds,
        units,
        peak_rss_bytes: peak_rss_bytes(),
    };
    println!("{RESULT_PREFIX}{}", serde_json::to_string(&result)?);
    Ok(())
}

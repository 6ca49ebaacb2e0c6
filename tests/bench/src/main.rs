//! quire's benchmarks. Each subcommand measures a claim against its baseline
//! in the same run, prints a table, and ends with one machine-readable line.
//!
//! Run against the local stack: `eval "$(deploy/local/stack env)"`, then
//! `cargo run --release -p quire-bench -- <queue|writer|pipeline|rebalance|takeover|records>`.

mod child;
mod pipeline;
mod queue;
mod rebalance;
mod records;
mod takeover;
mod writer;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "quire benchmarks: ratios against baselines measured in the same run")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The seed's array enqueue/dequeue table, on Kafka.
    Queue(queue::QueueArgs),
    /// The seed's buffered-append table, on S3 multipart uploads.
    Writer(writer::WriterArgs),
    /// Records through HTTP into completed XML reports in S3, against plain librdkafka.
    Pipeline(pipeline::PipelineArgs),
    /// Documents rendered again per rebalance, three workers, one scaled in and out.
    Rebalance(rebalance::RebalanceArgs),
    /// Take-over read time after 100,000 watermark writes, before and after compaction.
    Takeover(takeover::TakeoverArgs),
    /// Per-record CPU of the API's check and the worker's rendering, fast paths against what they replace.
    Records(records::RecordsArgs),
    /// One scenario in a child process of its own (used by the others, so
    /// each peak resident memory is that scenario's alone).
    #[command(hide = true)]
    Scenario {
        name: String,
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Queue(args) => runtime.block_on(queue::run(args)),
        Command::Writer(args) => runtime.block_on(writer::run(args)),
        Command::Pipeline(args) => runtime.block_on(pipeline::run(args)),
        Command::Rebalance(args) => runtime.block_on(rebalance::run(args)),
        Command::Takeover(args) => runtime.block_on(takeover::run(args)),
        Command::Records(args) => records::run(args),
        Command::Scenario { name, args } => runtime.block_on(child::run_scenario(&name, &args)),
    }
}

use std::process::ExitCode;

use clap::Parser;
use quire_cli::cli::Cli;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits 2.
    let cli = Cli::parse();
    let json = cli.global.json;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("quire: cannot start the async runtime: {error}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(quire_cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            if json {
                eprintln!("{}", error.to_json());
            } else {
                eprintln!("quire: {error}");
            }
            ExitCode::from(error.exit_code() as u8)
        }
    }
}

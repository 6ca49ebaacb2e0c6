//! `quire`, a command line for people over the producer API's HTTP routes:
//! send records (streamed, resumable), cut reports, fetch them, and
//! show, check and put stream definitions.

pub mod cli;
pub mod client;
pub mod define;
pub mod error;
pub mod output;
pub mod records;
pub mod reports;
pub mod send;
pub mod state;
pub mod token;

use cli::{Cli, Command, DefineCommand};
use client::ApiClient;
use error::CliError;

/// Runs one command to its end.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    if let Command::Token(command) = &cli.command {
        return token::run(&cli.global, command);
    }
    // A schema of a file needs no API (nor its URL checks).
    if let Command::Define(DefineCommand::Schema(arguments)) = &cli.command
        && arguments.file.is_some()
    {
        return define::schema(None, arguments).await;
    }
    let client = ApiClient::new(&cli.global)?;
    match &cli.command {
        Command::Token(_) => unreachable!("answered above"),
        Command::Send(arguments) => send::run(&client, &cli.global, arguments).await,
        Command::Cut(arguments) => reports::cut(&client, &cli.global, arguments).await,
        Command::Status(arguments) => reports::status(&client, &cli.global, arguments).await,
        Command::Get(arguments) => reports::get(&client, &cli.global, arguments).await,
        Command::List(arguments) => reports::list(&client, &cli.global, arguments).await,
        Command::Watch(arguments) => reports::watch(&client, &cli.global, arguments).await,
        Command::Define(DefineCommand::Show(arguments)) => {
            define::show(&client, &cli.global, arguments).await
        }
        Command::Define(DefineCommand::Put(arguments)) => {
            define::put(&client, &cli.global, arguments).await
        }
        Command::Define(DefineCommand::Schema(arguments)) => {
            define::schema(Some(&client), arguments).await
        }
    }
}

//! `quire token new`: a random token and the `api.tokens` line that lets
//! the API recognise it by its SHA-256 digest alone.

use quire_config::ApiToken;
use serde_json::json;

use crate::cli::{GlobalOptions, TokenCommand};
use crate::error::CliError;
use crate::output::Output;

/// Random bytes in a token: 256 bits, beyond any guessing.
const TOKEN_BYTES: usize = 32;
/// Tokens start with this, so secret scanners and people recognise them.
const PREFIX: &str = "quire_";

pub fn run(global: &GlobalOptions, command: &TokenCommand) -> Result<(), CliError> {
    match command {
        TokenCommand::New(arguments) => {
            let token = new_token()?;
            let line: ApiToken = format!(
                "{}:{}:{}:{}",
                arguments.name,
                hex::encode(ApiToken::digest_of(&token)),
                arguments.scopes,
                arguments.streams
            )
            .parse()
            .map_err(|error: quire_config::TokenLineError| CliError::Usage(error.to_string()))?;
            Output::new(global.json).result(
                &json!({"token": token, "line": line.to_string(), "name": line.name}),
                || {
                    format!(
                        "token (give it to the client, e.g. QUIRE_API_TOKEN; shown only now):\n  {token}\napi.tokens line (give it to the API, e.g. QUIRE_API__TOKENS):\n  {line}"
                    )
                },
            );
            Ok(())
        }
    }
}

fn new_token() -> Result<String, CliError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut bytes).map_err(|error| CliError::Io {
        context: "cannot read random bytes for a token".to_owned(),
        source: std::io::Error::other(error.to_string()),
    })?;
    Ok(format!("{PREFIX}{}", hex::encode(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_token_is_random_and_its_line_names_its_digest() {
        let first = new_token().unwrap();
        let second = new_token().unwrap();
        assert_ne!(first, second);
        assert!(first.starts_with(PREFIX) && first.len() == PREFIX.len() + 64);
        let line: ApiToken = format!("ops:{}:read:*", hex::encode(ApiToken::digest_of(&first)))
            .parse()
            .unwrap();
        assert!(!line.to_string().contains(&first[PREFIX.len()..]));
    }
}

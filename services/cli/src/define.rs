//! `quire define show`, `put` and `schema`: a stream's definition, read,
//! checked and put, and the XML Schema a typed one gives its reports.
//!
//! `put` and `schema` run the API's own check ([`quire_xml::read_definition`])
//! on the file first, so a definition the API would refuse is refused here,
//! naming the same problem, before anything is sent.

use std::io::Read;

use serde_json::{Value, json};

use crate::cli::{DefinePutArgs, DefineSchemaArgs, DefineShowArgs, GlobalOptions};
use crate::client::ApiClient;
use crate::error::CliError;
use crate::output::Output;

pub async fn show(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &DefineShowArgs,
) -> Result<(), CliError> {
    let stored = client.definition(&arguments.stream).await?;
    Output::new(global.json).result(&stored, || pretty(&stored["definition"]));
    Ok(())
}

pub async fn put(
    client: &ApiClient,
    global: &GlobalOptions,
    arguments: &DefinePutArgs,
) -> Result<(), CliError> {
    let body = read_file(&arguments.file)?;
    let definition = check(&arguments.file, &body)?;
    let output = Output::new(global.json);
    if arguments.check {
        let answer = json!({
            "stream": arguments.stream,
            "definition": definition,
            "schema_file": quire_xml::DocumentRenderer::new(&definition).schema_file(),
        });
        output.result(&answer, || {
            format!(
                "{}: a valid definition (version {}); nothing was sent",
                arguments.file, definition.v
            )
        });
        return Ok(());
    }
    let stored = client.put_definition(&arguments.stream, body).await?;
    output.result(&stored, || {
        format!(
            "stream {}: definition {} in force (version {})",
            arguments.stream,
            stored["id"].as_str().unwrap_or("?"),
            stored["definition"]["v"]
        )
    });
    Ok(())
}

pub async fn schema(
    client: Option<&ApiClient>,
    arguments: &DefineSchemaArgs,
) -> Result<(), CliError> {
    let (name, definition) = match (&arguments.file, &arguments.stream) {
        (Some(file), _) => (file.clone(), check(file, &read_file(file)?)?),
        (None, Some(stream)) => {
            let client = client.expect("a client for --stream");
            let stored = client.definition(stream).await?;
            let body = serde_json::to_vec(&stored["definition"]).expect("JSON serialises");
            (format!("stream {stream}"), check(stream, &body)?)
        }
        (None, None) => unreachable!("clap requires a file or --stream"),
    };
    if !definition.is_typed() {
        return Err(CliError::Invalid(format!(
            "{name}: a definition without `fields` has no schema (its reports are untyped)"
        )));
    }
    print!("{}", quire_xml::schema_for(&definition));
    Ok(())
}

/// The API's check, naming the file.
fn check(name: &str, body: &[u8]) -> Result<quire_messages::Definition, CliError> {
    quire_xml::read_definition(body).map_err(|error| {
        CliError::Invalid(match error {
            quire_xml::ReadDefinitionError::Json(error) => {
                format!("{name}: not JSON: {error}")
            }
            quire_xml::ReadDefinitionError::Invalid(problem) => {
                format!("{name}: the definition is not valid: {problem}")
            }
        })
    })
}

/// The file (or stdin for `-`), at most [`quire_xml::MAX_DEFINITION_BYTES`].
fn read_file(file: &str) -> Result<Vec<u8>, CliError> {
    let limit = quire_xml::MAX_DEFINITION_BYTES;
    let mut body = Vec::new();
    let read = if file == "-" {
        std::io::stdin()
            .take(limit as u64 + 1)
            .read_to_end(&mut body)
    } else {
        std::fs::File::open(file)
            .and_then(|opened| opened.take(limit as u64 + 1).read_to_end(&mut body))
    };
    read.map_err(|source| CliError::Io {
        context: format!("cannot read {file}"),
        source,
    })?;
    if body.len() > limit {
        return Err(CliError::Invalid(format!(
            "{file}: a definition holds at most {limit} bytes"
        )));
    }
    Ok(body)
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_check_names_the_file_and_the_problem() {
        let error = check(
            "ledger.json",
            br#"{"fields": [{"name": "amount", "type": "money"}]}"#,
        )
        .unwrap_err();
        let message = error.to_string();
        assert!(
            message.starts_with("ledger.json: the definition is not valid"),
            "{message}"
        );
        assert!(message.contains("money"), "{message}");
        assert_eq!(error.exit_code(), 1);
        let error = check("ledger.json", b"{\"root\":").unwrap_err();
        assert!(error.to_string().contains("not JSON"), "{error}");
    }

    #[test]
    fn a_file_past_the_limit_is_refused_before_it_is_parsed() {
        let path = std::env::temp_dir().join(format!("quire-define-{}.json", std::process::id()));
        let padding = " ".repeat(quire_xml::MAX_DEFINITION_BYTES);
        std::fs::write(&path, format!("{{{padding}}}")).unwrap();
        let error = read_file(path.to_str().unwrap()).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(error.to_string().contains("at most"), "{error}");
    }
}

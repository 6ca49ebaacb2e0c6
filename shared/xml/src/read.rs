//! A definition as a client sends it: parsed, checked with the one check
//! the renderer obeys, and given the version its fields need. The producer
//! API reads every `PUT` body with it; `quire define put` reads a file with
//! it before it sends anything, so a definition refused here is refused
//! there, for the same reason, in the same words.

use quire_messages::Definition;

use crate::check_definition;

/// The largest definition body read: a definition with the most fields it
/// may declare fits many times over.
pub const MAX_DEFINITION_BYTES: usize = 64 * 1024;

/// Why a definition body was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReadDefinitionError {
    /// Not JSON at all (syntax, or the body ended early).
    #[error("{0}")]
    Json(serde_json::Error),
    /// JSON, but not a definition quire can render.
    #[error("{0}")]
    Invalid(String),
}

/// Parses and checks a definition body: unknown fields, bad XML names,
/// colliding renames, bad typed fields and versions newer than this
/// release reads are refused. The answer carries the version its fields
/// need, whatever `v` the body held.
///
/// # Errors
///
/// [`ReadDefinitionError::Json`] for a body that is not JSON,
/// [`ReadDefinitionError::Invalid`] naming the problem otherwise.
pub fn read_definition(body: &[u8]) -> Result<Definition, ReadDefinitionError> {
    let mut definition: Definition = serde_json::from_slice(body).map_err(|error| {
        if error.is_data() {
            ReadDefinitionError::Invalid(error.to_string())
        } else {
            ReadDefinitionError::Json(error)
        }
    })?;
    if definition.v > Definition::NEWEST_VERSION {
        return Err(ReadDefinitionError::Invalid(format!(
            "version {} is newer than this release writes ({})",
            definition.v,
            Definition::NEWEST_VERSION
        )));
    }
    // Refused here is everything the renderer would not write as asked;
    // what is in the log already renders as it always did.
    check_definition(&definition)
        .map_err(|error| ReadDefinitionError::Invalid(error.to_string()))?;
    definition.v = definition.required_version();
    Ok(definition)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_definition_gets_the_version_its_fields_need() {
        let plain = read_definition(br#"{"root": "orders"}"#).unwrap();
        assert_eq!(plain.v, 1);
        let typed =
            read_definition(br#"{"v": 1, "fields": [{"name": "id", "type": "integer"}]}"#).unwrap();
        assert_eq!(typed.v, Definition::TYPED_VERSION);
    }

    #[test]
    fn refusals_name_their_problem() {
        let newer = format!(r#"{{"v": {}}}"#, Definition::NEWEST_VERSION + 1);
        for (body, named) in [
            (newer.as_str(), "newer than this release"),
            (r#"{"rot": "orders"}"#, "rot"),
            (r#"{"root": "a b"}"#, "a b"),
            (
                r#"{"fields": [{"name": "amount", "type": "decimal"}], "totals": ["amont"]}"#,
                "amont",
            ),
            (r#"{"fields": [{"name": "x", "type": "money"}]}"#, "money"),
        ] {
            match read_definition(body.as_bytes()) {
                Err(ReadDefinitionError::Invalid(message)) => {
                    assert!(message.contains(named), "{body}: {message}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(
            read_definition(b"{\"root\": "),
            Err(ReadDefinitionError::Json(_))
        ));
    }
}

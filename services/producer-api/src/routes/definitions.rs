//! A stream's report definition: published as a control message on the
//! stream's key (the log is what decides documents), with a readable copy in
//! the bucket for `GET`.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use quire_messages::{Definition, MessageKind, StreamName};
use quire_queue::MessageId;
use serde::{Deserialize, Serialize};

use crate::body::read_body;
use crate::errors::ApiError;
use crate::routes::{SchemaPath, StreamPath};
use crate::state::Publishing;
use crate::storage::Storage;
use crate::storage::definition_key;
use crate::validation::without_position;

/// The answer of `PUT` and the readable copy `GET` returns.
#[derive(Debug, Serialize, Deserialize)]
pub struct StoredDefinition {
    pub stream: StreamName,
    /// The control message's `partition-offset`: documents whose first
    /// record comes after it use this definition.
    pub id: String,
    pub definition: Definition,
}

impl StoredDefinition {
    /// Partition and offset of `id`, to order two copies.
    pub(crate) fn position(&self) -> Option<(i32, i64)> {
        let (partition, offset) = self.id.split_once('-')?;
        Some((partition.parse().ok()?, offset.parse().ok()?))
    }
}

/// `PUT /v1/streams/{stream}/definition`.
pub async fn put_definition(
    State(state): State<Publishing>,
    State(storage): State<Storage>,
    StreamPath(stream): StreamPath,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    if let Some((content_type, media_type)) = crate::body::media_type(&headers)
        && media_type != "application/json"
    {
        return Err(ApiError::UnsupportedMediaType {
            found: content_type,
        });
    }
    // Bounded like the records route's: a definition sent slowly holds
    // its connection no longer than api.body_read_timeout_ms.
    let timeout = state.limits.body_read_timeout;
    let body = tokio::time::timeout(
        timeout,
        read_body(body, &headers, quire_xml::MAX_DEFINITION_BYTES),
    )
    .await
    .map_err(|_elapsed| ApiError::BodyTimeout {
        limit_ms: timeout.as_millis() as u64,
    })??;
    let definition = parse_definition(&body)?;
    state.control_limits.check(
        &crate::auth::principal(&headers, state.tokens_enabled),
        stream.as_str(),
    )?;
    let partition = state.placement.place(&stream)?;
    let message = state.records_topic.control_message(
        MessageKind::Definition,
        &stream,
        partition,
        quire_messages::encode(&definition),
    );
    let ids = state.publish(vec![message]).await?;
    let landed: MessageId = *ids
        .first()
        .ok_or_else(|| ApiError::Internal("kafka returned no id for the definition".into()))?;
    state.metrics.definition_published();
    tracing::info!(%stream, id = %landed, "definition published");
    let stored = StoredDefinition {
        stream,
        id: landed.to_string(),
        definition,
    };
    state.definitions.published(&stored);
    keep_readable_copy(&storage, &stored).await?;
    Ok((StatusCode::ACCEPTED, Json(stored)).into_response())
}

/// Parses and validates a definition with the check `quire define put`
/// runs too ([`quire_xml::read_definition`]).
fn parse_definition(body: &[u8]) -> Result<Definition, ApiError> {
    quire_xml::read_definition(body).map_err(|error| match error {
        quire_xml::ReadDefinitionError::Json(error) => ApiError::InvalidJson {
            message: without_position(&error),
            line: error.line(),
            column: error.column(),
        },
        quire_xml::ReadDefinitionError::Invalid(message) => ApiError::InvalidDefinition(message),
    })
}

/// Writes `definitions/{stream}.json` unless the copy there is of a later
/// control message (another PUT overtook this one). The log stays the truth;
/// if this write fails the definition is still in force, and the error says
/// so.
async fn keep_readable_copy(storage: &Storage, stored: &StoredDefinition) -> Result<(), ApiError> {
    let key = definition_key(&stored.stream);
    let copy_failed = |source| ApiError::DefinitionCopyFailed {
        id: stored.id.clone(),
        source,
    };
    let existing = storage.get_small(&key).await.map_err(copy_failed)?;
    let newer_exists = existing
        .and_then(|bytes| serde_json::from_slice::<StoredDefinition>(&bytes).ok())
        .and_then(|existing| existing.position())
        .zip(stored.position())
        .is_some_and(|(existing, ours)| existing > ours);
    if newer_exists {
        return Ok(());
    }
    let body = serde_json::to_vec_pretty(stored).expect("a definition always serialises");
    storage.put_json(&key, body).await.map_err(copy_failed)
}

/// `GET /v1/streams/{stream}/definition`: the readable copy, as stored.
pub async fn get_definition(
    State(storage): State<Storage>,
    StreamPath(stream): StreamPath,
) -> Result<Response, ApiError> {
    let key = definition_key(&stream);
    let Some(bytes) = storage.get_small(&key).await? else {
        return Err(ApiError::DefinitionNotFound {
            stream: stream.to_string(),
        });
    };
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        bytes,
    )
        .into_response())
}

/// `GET /v1/streams/{stream}/schemas/{file}`: the XML Schema a typed
/// definition's reports point to, as the worker stored it beside them.
pub async fn get_schema(
    State(storage): State<Storage>,
    SchemaPath(stream, file): SchemaPath,
) -> Result<Response, ApiError> {
    let key = quire_xml::schema_key(stream.as_str(), &file);
    let Some(bytes) = storage.get_small(&key).await? else {
        return Err(ApiError::SchemaNotFound {
            stream: stream.to_string(),
            file,
        });
    };
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(quire_messages::layout::XSD_CONTENT_TYPE),
        )],
        bytes,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use quire_messages::CURRENT_VERSION;

    use super::*;

    #[test]
    fn a_valid_definition_is_parsed_with_defaults() {
        let definition =
            parse_definition(br#"{"root":"orders","attributes":["id"],"renames":{"a b":"ab"}}"#)
                .unwrap();
        assert_eq!(definition.root, "orders");
        assert_eq!(definition.record, "record");
        assert_eq!(definition.v, CURRENT_VERSION);
    }

    #[test]
    fn gzip_is_optional_and_a_gzip_definition_is_published_as_version_2() {
        let plain = parse_definition(br#"{"root":"orders"}"#).unwrap();
        assert!(!plain.gzip);
        assert_eq!(plain.v, CURRENT_VERSION);
        let compressed = parse_definition(br#"{"v":1,"gzip":true}"#).unwrap();
        assert!(compressed.gzip);
        assert_eq!(compressed.v, Definition::GZIP_VERSION);
        let explicit_false = parse_definition(br#"{"v":2,"gzip":false}"#).unwrap();
        assert_eq!(explicit_false.v, CURRENT_VERSION);
    }

    #[test]
    fn a_window_or_key_template_is_published_as_version_3() {
        let windowed =
            parse_definition(br#"{"window":{"every":"1h","time_zone":"Europe/Paris"}}"#).unwrap();
        assert_eq!(windowed.v, Definition::WINDOW_VERSION);
        let window = windowed.window.unwrap();
        assert_eq!((window.grace.as_str(), window.skip_empty), ("30s", false));
        let keyed = parse_definition(
            br#"{"gzip":true,"key_template":"reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml.gz"}"#,
        )
        .unwrap();
        assert_eq!(keyed.v, Definition::WINDOW_VERSION);
    }

    #[test]
    fn unknown_fields_bad_names_and_newer_versions_are_422() {
        for body in [
            &br#"{"rot":"orders"}"#[..],
            br#"{"root":"1orders"}"#,
            br#"{"record":"summary"}"#,
            br#"{"renames":{"a":"x","b":"x"}}"#,
            br#"{"v":99}"#,
            // Newer than Definition::NEWEST_VERSION (7, zstd's).
            br#"{"v":8,"gzip":true}"#,
            br#"{"gzip":true,"zstd":true}"#,
            br#"{"zstd":true,"key_template":"reports/{stream}/{partition}-{first_offset}.xml.gz"}"#,
            br#"{"zstd":"yes"}"#,
            br#"{"indent":0}"#,
            br#"{"indent":9}"#,
            br#"{"indent":"  "}"#,
            br#"{"fields":[{"name":"amount","type":"money"}]}"#,
            br#"{"fields":[{"name":"amount","type":"decimal"}],"totals":["missing"]}"#,
            br#"{"prefix":"q"}"#,
            br#"{"gzip":"yes"}"#,
            br#"{"window":{"every":"7m"}}"#,
            br#"{"window":{"every":"1d","time_zone":"Europe/Pariss"}}"#,
            br#"{"window":{"every":"1d","zone":"UTC"}}"#,
            br#"{"key_template":"reports/{stream}.xml"}"#,
            br#"{"header":{}}"#,
            br#"{"header":{"fields":[{"name":"n","value":"sum"}]}}"#,
            br#"{"header":{"fields":[{"name":"n","value":"records","constant":"x"}]}}"#,
            br#"{"header":{"element":"xmlhead","totals":true},"fields":[{"name":"a","type":"integer"}],"totals":["a"]}"#,
        ] {
            let error = parse_definition(body).unwrap_err();
            assert!(
                matches!(error, ApiError::InvalidDefinition(_)),
                "{}: {error:?}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(error.status(), StatusCode::UNPROCESSABLE_ENTITY);
        }
    }

    #[test]
    fn broken_json_is_400() {
        let error = parse_definition(br#"{"root": "#).unwrap_err();
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn copies_are_ordered_by_their_message_position() {
        let copy = |id: &str| StoredDefinition {
            stream: StreamName::new("s").unwrap(),
            id: id.to_owned(),
            definition: Definition::default(),
        };
        assert!(copy("3-10").position() > copy("3-9").position());
        assert_eq!(copy("garbage").position(), None);
    }
}

//! Every error the API answers with, and the one place that maps each kind to
//! an HTTP status code.
//!
//! The body is always JSON:
//! `{"error": {"code": "...", "message": "...", ...details}}`. The message is
//! a sentence a person can act on; `code` is stable for programs; details
//! (record index, field path, limits) are extra members next to them.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use quire_messages::StreamNameError;
use quire_queue::QueueError;
use serde_json::{Map, Value, json};

use crate::log_reader::LogError;
use crate::storage::StorageError;

/// `U+0001`: how a character that cannot be shown is named to a person.
fn code_point(character: char) -> String {
    format!("U+{:04X}", u32::from(character))
}

/// What a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid stream name: {0}")]
    InvalidStreamName(#[from] StreamNameError),

    #[error("{0}; report ids are returned by POST /v1/streams/{{stream}}/reports")]
    InvalidReportId(String),

    #[error("invalid path: {0}")]
    InvalidPath(String),

    #[error("invalid query parameter: {0}")]
    InvalidQuery(String),

    #[error("the request body could not be read: {0}")]
    BodyUnreadable(String),

    #[error(
        "the request body did not arrive whole within {limit_ms} ms (api.body_read_timeout_ms); nothing was published"
    )]
    BodyTimeout { limit_ms: u64 },

    #[error("the request body is not valid JSON: {message} (line {line}, column {column})")]
    InvalidJson {
        message: String,
        line: usize,
        column: usize,
    },

    #[error(
        "line {line} of the NDJSON body (record {index}) is not valid JSON: {message}; send one JSON object per line"
    )]
    InvalidNdjsonLine {
        index: usize,
        line: usize,
        message: String,
    },

    #[error(
        "the body is not a JSON array; send [{{...}}, {{...}}] with Content-Type application/json, or one object per line with application/x-ndjson"
    )]
    NotAnArray,

    #[error("the definition is not valid: {0}")]
    InvalidDefinition(String),

    #[error("{0}")]
    Unauthorized(AuthFailure),

    #[error("{}", forbidden_message(token, *scope, stream, *has_scope, reaches))]
    Forbidden {
        /// The token's name in `api.tokens` (never the token).
        token: String,
        scope: quire_config::Scope,
        stream: String,
        has_scope: bool,
        /// The token's prefixes as configured (`orders-+billing-`, `*`).
        reaches: String,
    },

    #[error("no route {method} {path}; the API lives under /v1 (see README.md)")]
    RouteNotFound { method: String, path: String },

    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },

    #[error(
        "the request body is larger than {limit} bytes (api.max_body_bytes); split the records over several requests"
    )]
    BodyTooLarge { limit: usize },

    #[error(
        "the request holds {count} records, more than the {limit} allowed (api.max_records_per_request); split it over several requests"
    )]
    TooManyRecords { count: usize, limit: usize },

    #[error(
        "record {index} is {bytes} bytes, more than the {limit} allowed for one record (api.max_record_bytes); nothing was published"
    )]
    RecordTooLarge {
        index: usize,
        bytes: usize,
        limit: usize,
    },

    #[error(
        "unsupported Content-Type {found}; send application/json (an array of objects) or application/x-ndjson (one object per line)"
    )]
    UnsupportedMediaType { found: String },

    #[error(
        "record {index} is {found}, not a JSON object; every record must be a JSON object; nothing was published"
    )]
    NotAnObject { index: usize, found: &'static str },

    #[error("record {index} cannot be read: {message}; nothing was published")]
    InvalidRecord { index: usize, message: String },

    #[error(
        "record {index} does not fit the stream's definition: field `{}` must be {}, found {}; nothing was published",
        error.path, error.expected, error.found
    )]
    WrongType {
        index: usize,
        error: quire_xml::TypeError,
    },

    #[error(
        "record {index} names the key `{path}` twice; JSON readers disagree on which value counts, so name each key once; nothing was published"
    )]
    DuplicateKey { index: usize, path: String },

    #[error("record {index}: {forbidden}; nothing was published")]
    ForbiddenCharacter {
        index: usize,
        /// The renderer's own finding, as `check_record` reports it.
        forbidden: quire_xml::ForbiddenCharacter,
    },

    #[error("report {id} was never issued{reason}")]
    ReportNotFound { id: String, reason: &'static str },

    #[error(
        "stream {stream} has no definition set through this API, so its reports use the default one; PUT /v1/streams/{stream}/definition sets one"
    )]
    DefinitionNotFound { stream: String },

    #[error(
        "stream {stream} has no schema {file}; a worker stores it before the first report that points to it"
    )]
    SchemaNotFound { stream: String, file: String },

    #[error(
        "report {id} is still pending: its document is not complete yet; GET /v1/reports/{id} says when it is"
    )]
    ReportPending { id: String },

    #[error(
        "report {id} is complete, but its document s3 key {key} is missing from the bucket; it was deleted after the report completed"
    )]
    ReportContentGone { id: String, key: String },

    #[error(
        "report {id} was completed and has expired: report retention (s3.report_retention_days) deleted its document and its manifest, so it can no longer be read"
    )]
    ReportExpired { id: String },

    #[error(
        "report {id} is no more: its manifest describes a document that its key no longer holds, because a replay of the log cut the stream elsewhere (a worker restarted with other rollover settings after a crash); its records are in the stream's other reports (GET /v1/streams/{{stream}}/reports)"
    )]
    ReportSuperseded { id: String },

    #[error(
        "this API hands out no download URLs (api.download_url_expiry_ms is 0); GET /v1/reports/{id}/content serves the document"
    )]
    DownloadUrlsOff { id: String },

    #[error(
        "invalid Idempotency-Key header: {0}; a key is 1 to 255 visible ASCII characters, e.g. a UUID"
    )]
    InvalidIdempotencyKey(String),

    #[error(
        "this Idempotency-Key was already used for a different request (another body, method or path); use a new key for a new request"
    )]
    IdempotencyKeyReused,

    #[error(
        "the first request with this Idempotency-Key is still being handled, or its commit's outcome is being read from the log; nothing is published twice: retry after Retry-After seconds to get its answer"
    )]
    IdempotencyKeyInProgress,

    #[error(
        "the API holds as many request bytes as it may (api.max_in_flight_bytes = {limit}); nothing was published; retry after Retry-After seconds"
    )]
    TooBusy { limit: usize },

    #[error(
        "too many cuts and definition changes for this {scope} (api.control_requests_per_minute_per_{scope}); nothing was published; retry after Retry-After seconds"
    )]
    RateLimited {
        scope: &'static str,
        retry_after_secs: u64,
    },

    #[error("kafka is not reachable ({0}); nothing was published; retry after Retry-After seconds")]
    KafkaUnavailable(String),

    #[error(
        "stream {stream} is moving to another partition (quire's partitions are being grown); nothing was published; retry after Retry-After seconds"
    )]
    PartitionsMoving { stream: String },

    #[error(
        "the partition layout could not be read from kafka recently ({0}); nothing was published; retry after Retry-After seconds"
    )]
    LayoutUnknown(String),

    #[error(
        "the records log's identity could not be read from the bucket ({0}); nothing was published; retry after Retry-After seconds"
    )]
    LogUnknown(String),

    #[error(
        "report {id} was cut from a records log that no longer exists (the records topic was deleted and created again) and was never completed"
    )]
    ReportLogGone { id: String },

    #[error(
        "the stored answers of Idempotency-Keys could not be read from kafka ({0}); nothing was published"
    )]
    KeyLogUnavailable(String),

    #[error("{0}")]
    Publish(#[from] QueueError),

    #[error("{0}")]
    Log(#[from] LogError),

    #[error("{0}")]
    Storage(#[from] StorageError),

    #[error(
        "the definition was published (message {id}) and is in force, but its readable copy could not be written: {source}; PUT it again to refresh the copy"
    )]
    DefinitionCopyFailed { id: String, source: StorageError },

    #[error("internal error: {0}")]
    Internal(String),
}

/// Why a request was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    #[error(
        "this endpoint needs an `Authorization: Bearer <token>` header with a token whose digest is in api.tokens"
    )]
    Missing,
    #[error("the bearer token is not one of the tokens in api.tokens")]
    Rejected,
}

fn forbidden_message(
    token: &str,
    scope: quire_config::Scope,
    stream: &str,
    has_scope: bool,
    reaches: &str,
) -> String {
    if has_scope {
        format!(
            "the token {token:?} does not reach stream {stream:?}: it reaches the streams {reaches}"
        )
    } else {
        format!(
            "the token {token:?} lacks the {scope} scope that this route needs (stream {stream:?})"
        )
    }
}

impl ApiError {
    /// The one table from error kinds to HTTP status codes and the stable
    /// codes programs match on.
    fn kind(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            ApiError::InvalidStreamName(_) => (S::BAD_REQUEST, "invalid_stream_name"),
            ApiError::InvalidReportId(_) => (S::BAD_REQUEST, "invalid_report_id"),
            ApiError::InvalidPath(_) => (S::BAD_REQUEST, "invalid_path"),
            ApiError::InvalidQuery(_) => (S::BAD_REQUEST, "invalid_query"),
            ApiError::BodyUnreadable(_) => (S::BAD_REQUEST, "body_unreadable"),
            ApiError::InvalidJson { .. } | ApiError::InvalidNdjsonLine { .. } => {
                (S::BAD_REQUEST, "invalid_json")
            }
            ApiError::NotAnArray => (S::BAD_REQUEST, "not_an_array"),
            ApiError::InvalidIdempotencyKey(_) => (S::BAD_REQUEST, "invalid_idempotency_key"),
            ApiError::Storage(StorageError::BadContinuation) => (S::BAD_REQUEST, "invalid_query"),
            ApiError::Unauthorized(_) => (S::UNAUTHORIZED, "unauthorized"),
            ApiError::Forbidden { .. } => (S::FORBIDDEN, "forbidden"),
            ApiError::RouteNotFound { .. } => (S::NOT_FOUND, "not_found"),
            ApiError::ReportNotFound { .. } => (S::NOT_FOUND, "report_not_found"),
            ApiError::DefinitionNotFound { .. } => (S::NOT_FOUND, "definition_not_found"),
            ApiError::SchemaNotFound { .. } => (S::NOT_FOUND, "schema_not_found"),
            ApiError::DownloadUrlsOff { .. } => (S::NOT_FOUND, "download_urls_off"),
            ApiError::MethodNotAllowed { .. } => (S::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::ReportPending { .. } => (S::CONFLICT, "report_pending"),
            ApiError::IdempotencyKeyInProgress => (S::CONFLICT, "idempotency_key_in_progress"),
            ApiError::TooBusy { .. } => (S::TOO_MANY_REQUESTS, "too_busy"),
            ApiError::RateLimited { .. } => (S::TOO_MANY_REQUESTS, "rate_limited"),
            ApiError::BodyTimeout { .. } => (S::REQUEST_TIMEOUT, "body_timeout"),
            ApiError::ReportContentGone { .. } => (S::GONE, "report_content_gone"),
            ApiError::ReportLogGone { .. } => (S::GONE, "report_log_gone"),
            ApiError::ReportExpired { .. } => (S::GONE, "report_expired"),
            ApiError::ReportSuperseded { .. } => (S::GONE, "report_superseded"),
            ApiError::BodyTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, "body_too_large"),
            ApiError::TooManyRecords { .. } => (S::PAYLOAD_TOO_LARGE, "too_many_records"),
            ApiError::RecordTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, "record_too_large"),
            ApiError::UnsupportedMediaType { .. } => {
                (S::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type")
            }
            ApiError::NotAnObject { .. } => (S::UNPROCESSABLE_ENTITY, "record_not_an_object"),
            ApiError::InvalidRecord { .. } => (S::UNPROCESSABLE_ENTITY, "invalid_record"),
            ApiError::WrongType { .. } => (S::UNPROCESSABLE_ENTITY, "wrong_type"),
            ApiError::ForbiddenCharacter { .. } => (S::UNPROCESSABLE_ENTITY, "forbidden_character"),
            ApiError::DuplicateKey { .. } => (S::UNPROCESSABLE_ENTITY, "duplicate_key"),
            ApiError::InvalidDefinition(_) => (S::UNPROCESSABLE_ENTITY, "invalid_definition"),
            ApiError::IdempotencyKeyReused => (S::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
            // Not 503: the array may be committed, and clients retry a 503.
            ApiError::Publish(QueueError::CommitOutcomeUnknown { .. }) => {
                (S::INTERNAL_SERVER_ERROR, "publish_outcome_unknown")
            }
            ApiError::Publish(
                QueueError::TopicMismatch(_) | QueueError::ProtectedProperty { .. },
            ) => (S::INTERNAL_SERVER_ERROR, "publish_failed"),
            ApiError::Internal(_) => (S::INTERNAL_SERVER_ERROR, "internal"),
            ApiError::Publish(QueueError::ProducerFatal(_)) => {
                (S::SERVICE_UNAVAILABLE, "producer_unavailable")
            }
            ApiError::Publish(QueueError::EnqueuerStopped) => {
                (S::SERVICE_UNAVAILABLE, "shutting_down")
            }
            ApiError::Publish(_) => (S::SERVICE_UNAVAILABLE, "publish_failed"),
            ApiError::KafkaUnavailable(_) => (S::SERVICE_UNAVAILABLE, "kafka_unavailable"),
            ApiError::PartitionsMoving { .. } => (S::SERVICE_UNAVAILABLE, "partitions_moving"),
            ApiError::LayoutUnknown(_) => (S::SERVICE_UNAVAILABLE, "layout_unknown"),
            ApiError::LogUnknown(_) => (S::SERVICE_UNAVAILABLE, "log_unknown"),
            ApiError::KeyLogUnavailable(_) => (S::SERVICE_UNAVAILABLE, "idempotency_lookup_failed"),
            ApiError::Log(error) if error.is_not_yet_stable() => {
                (S::SERVICE_UNAVAILABLE, "report_not_yet_readable")
            }
            ApiError::Log(_) => (S::SERVICE_UNAVAILABLE, "kafka_unavailable"),
            ApiError::Storage(_) => (S::SERVICE_UNAVAILABLE, "storage_unavailable"),
            ApiError::DefinitionCopyFailed { .. } => {
                (S::SERVICE_UNAVAILABLE, "definition_copy_failed")
            }
        }
    }

    /// The HTTP status code (see `kind`).
    pub fn status(&self) -> StatusCode {
        self.kind().0
    }

    /// A stable name for programs (see `kind`).
    pub fn code(&self) -> &'static str {
        self.kind().1
    }

    /// The `message` a client reads. A server-side error's own text names
    /// what only operators should see (broker addresses, the bucket, S3
    /// keys and endpoints, librdkafka's words): it goes to the log whole,
    /// and the client gets what happened and what to do, per code.
    fn public_message(&self) -> String {
        let fixed = match self.code() {
            "publish_outcome_unknown" => {
                "kafka did not confirm the commit, so the records may or may not be published; retry with the same Idempotency-Key to learn which"
            }
            "publish_failed" => "publishing failed; nothing was published",
            "internal" => "internal error",
            "producer_unavailable" => {
                "the API's kafka producer is being recreated; nothing was published; retry after Retry-After seconds"
            }
            "shutting_down" => {
                "the API is shutting down; nothing was published; retry after Retry-After seconds"
            }
            "kafka_unavailable" => {
                "kafka is not reachable; nothing was published; retry after Retry-After seconds"
            }
            "idempotency_lookup_failed" => {
                "the stored answers of Idempotency-Keys could not be read; nothing was published; retry after Retry-After seconds"
            }
            "report_not_yet_readable" => {
                "the report's marker is not readable yet; retry after Retry-After seconds"
            }
            "storage_unavailable" => {
                "the report store does not answer; retry after Retry-After seconds"
            }
            "layout_unknown" => {
                "the partition layout could not be read from kafka recently; nothing was published; retry after Retry-After seconds"
            }
            "log_unknown" => {
                "the records log's identity could not be read from the report store; nothing was published; retry after Retry-After seconds"
            }
            _ => {
                return match self {
                    ApiError::PartitionsMoving { stream } => format!(
                        "stream {stream} is moving to another partition (quire's partitions are being grown); nothing was published; retry after Retry-After seconds"
                    ),
                    ApiError::ReportContentGone { id, .. } => format!(
                        "report {id} is complete, but its document is missing from the bucket; it was deleted after the report completed"
                    ),
                    ApiError::DefinitionCopyFailed { id, .. } => format!(
                        "the definition was published (message {id}) and is in force, but its readable copy could not be written; PUT it again to refresh the copy"
                    ),
                    server_side if server_side.is_server_side() => {
                        "the request failed (the API's log has the details)".to_owned()
                    }
                    client_side => client_side.to_string(),
                };
            }
        };
        format!("{fixed} (the API's log has the details)")
    }

    /// Members added next to `code` and `message`, for programs.
    fn details(&self) -> Map<String, Value> {
        let details = match self {
            ApiError::InvalidJson { line, column, .. } => json!({"line": line, "column": column}),
            ApiError::InvalidNdjsonLine { index, line, .. } => {
                json!({"index": index, "line": line})
            }
            ApiError::BodyTooLarge { limit } | ApiError::TooBusy { limit } => {
                json!({"limit": limit})
            }
            ApiError::TooManyRecords { count, limit } => json!({"count": count, "limit": limit}),
            ApiError::BodyTimeout { limit_ms } => json!({"limit_ms": limit_ms}),
            ApiError::RecordTooLarge {
                index,
                bytes,
                limit,
            } => json!({"index": index, "bytes": bytes, "limit": limit}),
            ApiError::NotAnObject { index, found } => json!({"index": index, "found": found}),
            ApiError::InvalidRecord { index, .. } => json!({"index": index}),
            ApiError::WrongType { index, error } => json!({
                "index": index,
                "path": error.path,
                "expected": error.expected,
                "found": error.found,
            }),
            ApiError::DuplicateKey { index, path } => json!({"index": index, "path": path}),
            ApiError::ForbiddenCharacter { index, forbidden } => json!({
                "index": index,
                "path": forbidden.path,
                "character": code_point(forbidden.character),
                "in": match forbidden.place {
                    quire_xml::FieldPart::Name => "name",
                    quire_xml::FieldPart::Value => "value",
                },
            }),
            ApiError::PartitionsMoving { stream } => json!({"stream": stream}),
            ApiError::ReportNotFound { id, .. }
            | ApiError::ReportLogGone { id }
            | ApiError::ReportPending { id }
            | ApiError::DownloadUrlsOff { id }
            | ApiError::ReportExpired { id }
            | ApiError::ReportSuperseded { id }
            | ApiError::ReportContentGone { id, .. } => json!({"report_id": id}),
            ApiError::DefinitionNotFound { stream } => json!({"stream": stream}),
            ApiError::SchemaNotFound { stream, file } => json!({"stream": stream, "file": file}),
            ApiError::Forbidden {
                scope,
                stream,
                has_scope,
                ..
            } => {
                if *has_scope {
                    json!({"stream": stream})
                } else {
                    json!({"missing_scope": scope.as_str(), "stream": stream})
                }
            }
            ApiError::DefinitionCopyFailed { id, .. } => json!({"id": id}),
            _ => json!({}),
        };
        match details {
            Value::Object(members) => members,
            _ => Map::new(),
        }
    }

    /// Whether the problem is on our side (logged as such), not the caller's.
    fn is_server_side(&self) -> bool {
        self.status().is_server_error()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if matches!(self, ApiError::PartitionsMoving { .. }) {
            // An operator's growth under way, not a failure: the request log
            // counts these 503s by code.
            tracing::debug!(code = self.code(), error = %self, "request refused");
        } else if self.is_server_side() {
            // Server-side messages carry Kafka and S3 errors, never request
            // bodies or tokens, so they can be logged whole.
            tracing::error!(code = self.code(), error = %self, "request failed");
        }
        let mut body = Map::new();
        body.insert("code".to_owned(), Value::from(self.code()));
        body.insert("message".to_owned(), Value::from(self.public_message()));
        body.extend(self.details());
        let mut response = (status, axum::Json(json!({ "error": body }))).into_response();
        let headers = response.headers_mut();
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"quire\""),
            );
        }
        // Every answer that published nothing and may succeed later says when
        // to try again.
        if status == StatusCode::SERVICE_UNAVAILABLE
            || status == StatusCode::TOO_MANY_REQUESTS
            || matches!(self, ApiError::IdempotencyKeyInProgress)
        {
            let wait = match &self {
                ApiError::RateLimited {
                    retry_after_secs, ..
                } => HeaderValue::from(*retry_after_secs),
                // A growth's freeze lasts tens of seconds.
                ApiError::PartitionsMoving { .. } => HeaderValue::from_static("5"),
                _ => HeaderValue::from_static("1"),
            };
            headers.insert(header::RETRY_AFTER, wait);
        }
        response.extensions_mut().insert(ErrorCode(self.code()));
        response
    }
}

/// The error code of a response, for the request log and metrics.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

#[cfg(test)]
mod tests {
    use super::*;
    use quire_queue::{KafkaError, RDKafkaErrorCode};

    async fn body_of(error: ApiError) -> (StatusCode, Value) {
        let response = error.into_response();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn a_forbidden_character_names_record_field_and_character() {
        let (status, body) = body_of(ApiError::ForbiddenCharacter {
            index: 3,
            forbidden: quire_xml::ForbiddenCharacter {
                path: "a.b[1]".into(),
                character: '\u{1}',
                place: quire_xml::FieldPart::Value,
            },
        })
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        let error = &body["error"];
        assert_eq!(error["code"], "forbidden_character");
        assert_eq!(error["index"], 3);
        assert_eq!(error["path"], "a.b[1]");
        assert_eq!(error["character"], "U+0001");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("record 3"), "{message}");
        assert!(message.contains("a.b[1]"), "{message}");
        assert!(message.contains("nothing was published"), "{message}");
    }

    /// What only operators should see (a broker address, an S3 key) is not
    /// in the answer; the code and what to do are.
    #[tokio::test]
    async fn server_side_answers_name_no_address_or_key() {
        for error in [
            ApiError::KafkaUnavailable("127.0.0.1:19092/bootstrap: Connect failed".into()),
            ApiError::Internal("s3 endpoint http://10.1.2.3:7070 refused".into()),
            ApiError::ReportContentGone {
                id: "s~1-2".into(),
                key: "reports/secret-bucket-layout/s~1-2.xml".into(),
            },
        ] {
            let logged = error.to_string();
            let code = error.code();
            let (_, body) = body_of(error).await;
            let message = body["error"]["message"].as_str().unwrap();
            for hidden in ["127.0.0.1", "10.1.2.3", "reports/"] {
                assert!(!message.contains(hidden), "{code}: {message}");
            }
            assert_eq!(body["error"]["code"], code);
            assert_ne!(message, logged, "{code}: the log keeps the whole text");
        }
    }

    #[tokio::test]
    async fn limits_are_413_with_the_limit_named() {
        let (status, body) = body_of(ApiError::TooManyRecords {
            count: 11,
            limit: 10,
        })
        .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body["error"]["limit"], 10);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("api.max_records_per_request")
        );
        let (status, _) = body_of(ApiError::BodyTooLarge { limit: 5 }).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn each_kind_has_its_status() {
        let cases: Vec<(ApiError, u16, &str)> = vec![
            (
                ApiError::InvalidStreamName(StreamNameError::BadCharacter('/')),
                400,
                "invalid_stream_name",
            ),
            (
                ApiError::InvalidReportId("bad".into()),
                400,
                "invalid_report_id",
            ),
            (ApiError::NotAnArray, 400, "not_an_array"),
            (
                ApiError::Unauthorized(AuthFailure::Missing),
                401,
                "unauthorized",
            ),
            (
                ApiError::ReportNotFound {
                    id: "s~1-2".into(),
                    reason: "",
                },
                404,
                "report_not_found",
            ),
            (
                ApiError::ReportPending { id: "s~1-2".into() },
                409,
                "report_pending",
            ),
            (
                ApiError::DownloadUrlsOff { id: "s~1-2".into() },
                404,
                "download_urls_off",
            ),
            (
                ApiError::ReportExpired { id: "s~1-2".into() },
                410,
                "report_expired",
            ),
            (
                ApiError::ReportSuperseded { id: "s~1-2".into() },
                410,
                "report_superseded",
            ),
            (
                ApiError::UnsupportedMediaType {
                    found: "text/plain".into(),
                },
                415,
                "unsupported_media_type",
            ),
            (
                ApiError::NotAnObject {
                    index: 0,
                    found: "an array",
                },
                422,
                "record_not_an_object",
            ),
            (
                ApiError::InvalidDefinition("x".into()),
                422,
                "invalid_definition",
            ),
            (
                ApiError::Publish(QueueError::TransactionAborted(KafkaError::Canceled)),
                503,
                "publish_failed",
            ),
            (
                ApiError::Publish(QueueError::ProducerFatal(KafkaError::MessageProduction(
                    RDKafkaErrorCode::Fatal,
                ))),
                503,
                "producer_unavailable",
            ),
            (ApiError::Internal("x".into()), 500, "internal"),
            (
                ApiError::InvalidIdempotencyKey("x".into()),
                400,
                "invalid_idempotency_key",
            ),
            (
                ApiError::IdempotencyKeyReused,
                422,
                "idempotency_key_reused",
            ),
            (
                ApiError::IdempotencyKeyInProgress,
                409,
                "idempotency_key_in_progress",
            ),
            (ApiError::TooBusy { limit: 1 }, 429, "too_busy"),
            (
                ApiError::KafkaUnavailable("down".into()),
                503,
                "kafka_unavailable",
            ),
            (
                ApiError::Publish(QueueError::CommitOutcomeUnknown {
                    source: KafkaError::Canceled,
                    ids: Vec::new(),
                }),
                500,
                "publish_outcome_unknown",
            ),
        ];
        for (error, status, code) in cases {
            assert_eq!(error.status().as_u16(), status, "{error:?}");
            assert_eq!(error.code(), code, "{error:?}");
        }
    }

    #[tokio::test]
    async fn answers_that_published_nothing_say_when_to_retry() {
        for error in [
            ApiError::TooBusy { limit: 1 },
            ApiError::KafkaUnavailable("down".into()),
            ApiError::IdempotencyKeyInProgress,
        ] {
            let response = error.into_response();
            assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        }
        let unknown = ApiError::Publish(QueueError::CommitOutcomeUnknown {
            source: KafkaError::Canceled,
            ids: Vec::new(),
        })
        .into_response();
        assert!(unknown.headers().get(header::RETRY_AFTER).is_none());
    }

    #[tokio::test]
    async fn unauthorized_asks_for_a_bearer_token() {
        let response = ApiError::Unauthorized(AuthFailure::Rejected).into_response();
        assert_eq!(
            response.headers()[header::WWW_AUTHENTICATE],
            "Bearer realm=\"quire\""
        );
    }
}

//! `POST /v1/streams/{stream}/records`: ingest an array of records.

use std::time::Instant;

use axum::Extension;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use quire_queue::{MessageId, OutMessage};
use serde::{Serialize, Serializer};

use crate::body::read_body;
use crate::errors::ApiError;
use crate::idempotency::{KeyedRequest, StoredResponse};
use crate::routes::StreamPath;
use crate::state::Publishing;
use crate::validation::Limits;
use crate::validation::{BodyFormat, parse_records};

/// `{"count": n, "ids": ["partition-offset", ...]}`, one id per record in order.
#[derive(Debug, Serialize)]
pub struct RecordsAccepted {
    pub count: usize,
    pub ids: Vec<DisplayedId>,
}

/// A message id written as `partition-offset`, without a String per id.
#[derive(Debug)]
pub struct DisplayedId(pub MessageId);

impl Serialize for DisplayedId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

/// All or nothing: every record is checked before any is published, and
/// the array is published in one transaction (possibly shared with other
/// requests' arrays by group commit).
pub async fn post_records(
    State(state): State<Publishing>,
    StreamPath(stream): StreamPath,
    keyed: Option<Extension<KeyedRequest>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let format = BodyFormat::from_headers(&headers)?;
    let body = read_body(body, &headers, state.limits.max_body_bytes).await?;
    let records = parse_records(&body, format, &state.limits)?;
    if records.is_empty() {
        return Ok(Json(RecordsAccepted {
            count: 0,
            ids: Vec::new(),
        })
        .into_response());
    }
    let partition = state.placement.place(&stream)?;
    let messages: Vec<OutMessage> = records
        .iter()
        .map(|record| {
            state
                .records_topic
                .record_message(&stream, partition, record)
        })
        .collect();
    let count = messages.len();
    let enqueued_at = Instant::now();
    let answer = move |ids: Vec<MessageId>| {
        if ids.len() != count {
            return Err(ApiError::Internal(format!(
                "kafka returned {} ids for {count} records",
                ids.len()
            )));
        }
        let body = serde_json::to_vec(&RecordsAccepted {
            count,
            ids: ids.into_iter().map(DisplayedId).collect(),
        })
        .map_err(|error| ApiError::Internal(error.to_string()))?;
        Ok(StoredResponse {
            status: StatusCode::OK,
            headers: vec![("content-type", HeaderValue::from_static("application/json"))],
            body: body.into(),
        })
    };
    let response = state
        .publish_answered(messages, keyed.map(|Extension(keyed)| keyed), answer)
        .await;
    if response.status().is_success() {
        state.metrics.array_accepted(count, enqueued_at.elapsed());
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_written_partition_dash_offset() {
        let accepted = RecordsAccepted {
            count: 2,
            ids: vec![
                DisplayedId(MessageId {
                    partition: 3,
                    offset: 41,
                }),
                DisplayedId(MessageId {
                    partition: 3,
                    offset: 42,
                }),
            ],
        };
        assert_eq!(
            serde_json::to_string(&accepted).unwrap(),
            r#"{"count":2,"ids":["3-41","3-42"]}"#
        );
    }
}

/// `GET /v1/limits`: the bounds a records request must keep, so a client
/// can fill its arrays up to them (`quire send` does) instead of guessing.
#[derive(Debug, Serialize)]
pub struct RecordLimits {
    pub max_body_bytes: usize,
    pub max_record_bytes: usize,
    pub max_records_per_request: usize,
}

pub async fn get_limits(State(limits): State<Limits>) -> Json<RecordLimits> {
    Json(RecordLimits {
        max_body_bytes: limits.max_body_bytes,
        max_record_bytes: limits.max_record_bytes,
        max_records_per_request: limits.max_records_per_request,
    })
}

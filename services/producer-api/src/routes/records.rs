//! `POST /v1/streams/{stream}/records`: ingest an array of records.

use std::time::Instant;

use axum::Extension;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use quire_queue::MessageId;
use serde::{Serialize, Serializer};

use crate::body::read_body;
use crate::errors::ApiError;
use crate::idempotency::{KeyedRequest, StoredResponse};
use crate::publish::Batches;
use crate::routes::StreamPath;
use crate::state::Publishing;
use crate::validation::Limits;
use crate::validation::{BodyFormat, check_types, parse_records};

/// `{"count": n, "ids": ["partition-offset-index", ...]}`, one id per
/// record in order.
#[derive(Debug, Serialize)]
pub struct RecordsAccepted {
    pub count: usize,
    pub ids: Vec<RecordId>,
}

/// A record's id: the partition and offset of the batch message that
/// carries it, and its place in that batch (0-based); written
/// `partition-offset-index`, without a String per id. (Before batches, ids
/// were `partition-offset`, one message per record; answers stored under an
/// `Idempotency-Key` then are replayed as they were.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordId {
    pub message: MessageId,
    pub index: usize,
}

impl Serialize for RecordId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&format_args!("{}-{}", self.message, self.index))
    }
}

/// The records' ids, in order, from their batch messages' ids (one per
/// message, in order, as the publisher returns them) and how many records
/// each message carries; `Err` when there are not as many ids as messages.
pub fn record_ids(messages: &[MessageId], counts: &[usize]) -> Result<Vec<RecordId>, String> {
    if messages.len() != counts.len() {
        return Err(format!(
            "kafka returned {} ids for {} batch messages",
            messages.len(),
            counts.len()
        ));
    }
    Ok(messages
        .iter()
        .zip(counts)
        .flat_map(|(&message, &count)| (0..count).map(move |index| RecordId { message, index }))
        .collect())
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
    if let Some(check) = state.definitions.check_for(&stream).await {
        check_types(&records, &check)?;
    }
    if records.is_empty() {
        return Ok(Json(RecordsAccepted {
            count: 0,
            ids: Vec::new(),
        })
        .into_response());
    }
    let partition = state.placement.place(&stream)?;
    let count = records.len();
    let Batches { messages, counts } = state
        .records_topic
        .batch_messages(&stream, partition, &records);
    let batches = messages.len();
    let enqueued_at = Instant::now();
    let answer = move |ids: Vec<MessageId>| {
        let ids = record_ids(&ids, &counts).map_err(ApiError::Internal)?;
        if ids.len() != count {
            return Err(ApiError::Internal(format!(
                "{} ids for {count} records",
                ids.len()
            )));
        }
        let body = serde_json::to_vec(&RecordsAccepted { count, ids })
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
        state
            .metrics
            .array_accepted(count, batches, enqueued_at.elapsed());
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(partition: i32, offset: i64) -> MessageId {
        MessageId { partition, offset }
    }

    #[test]
    fn ids_are_written_partition_dash_offset_dash_index() {
        let accepted = RecordsAccepted {
            count: 3,
            ids: record_ids(&[at(3, 41), at(3, 43)], &[2, 1]).unwrap(),
        };
        assert_eq!(
            serde_json::to_string(&accepted).unwrap(),
            r#"{"count":3,"ids":["3-41-0","3-41-1","3-43-0"]}"#
        );
    }

    #[test]
    fn each_record_is_named_by_its_batch_message_and_its_place_in_it() {
        let ids = record_ids(&[at(0, 7), at(0, 9), at(0, 12)], &[3, 1, 2]).unwrap();
        let written: Vec<String> = ids
            .iter()
            .map(|id| {
                serde_json::to_value(id)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(
            written,
            ["0-7-0", "0-7-1", "0-7-2", "0-9-0", "0-12-0", "0-12-1"]
        );
        assert_eq!(record_ids(&[], &[]).unwrap(), []);
        let error = record_ids(&[at(0, 7)], &[3, 1]).unwrap_err();
        assert!(error.contains("1 ids for 2 batch messages"), "{error}");
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

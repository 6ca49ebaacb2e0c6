//! Reports: cut now, status, content (streamed from S3), and a stream's list.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::{StreamExt, TryStreamExt};
use quire_messages::{CutMarker, Manifest, MessageKind, ReportId, StreamName};
use quire_queue::MessageId;
use serde::{Deserialize, Serialize};

use crate::errors::ApiError;
use crate::idempotency::{KeyedRequest, StoredResponse};
use crate::log_reader::CutLookup;
use crate::routes::{ReportPath, StreamPath};
use crate::state::{Publishing, Reports};
use crate::storage::{DocumentCheck, OpenedDocument};

/// Where a report stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportStatus {
    Pending,
    Completed,
}

/// `GET /v1/reports/{id}` and the items of a list.
#[derive(Debug, Serialize)]
pub struct ReportView {
    pub report_id: ReportId,
    pub stream: StreamName,
    pub status: ReportStatus,
    /// The manifest (key, offsets, records, bytes, sha256, trigger, times),
    /// once completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Manifest>,
    /// Where the document is downloaded, once completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

impl ReportView {
    fn pending(id: ReportId) -> Self {
        ReportView {
            stream: id.stream.clone(),
            report_id: id,
            status: ReportStatus::Pending,
            manifest: None,
            content: None,
        }
    }

    fn completed(id: ReportId, manifest: Manifest) -> Self {
        ReportView {
            stream: id.stream.clone(),
            content: Some(content_path(&id)),
            report_id: id,
            status: ReportStatus::Completed,
            manifest: Some(manifest),
        }
    }
}

fn report_path(id: &ReportId) -> String {
    format!("/v1/reports/{id}")
}

fn content_path(id: &ReportId) -> String {
    format!("/v1/reports/{id}/content")
}

/// `POST /v1/streams/{stream}/reports`: publishes an explicit cut marker on
/// the stream's key. Every record accepted for the stream before this call
/// is in this report or an earlier one.
pub async fn post_cut(
    State(state): State<Publishing>,
    StreamPath(stream): StreamPath,
    keyed: Option<Extension<KeyedRequest>>,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    state.control_limits.check(
        &crate::auth::principal(&headers, state.tokens_enabled),
        stream.as_str(),
    )?;
    let partition = state.placement.place(&stream)?;
    // The report id carries the log's tag: known before anything is sent.
    let log = state.placement.identity()?;
    let marker = state.records_topic.control_message(
        MessageKind::Cut,
        &stream,
        partition,
        quire_messages::encode(&CutMarker::explicit()),
    );
    let response = state
        .publish_answered(
            vec![marker],
            keyed.map(|Extension(keyed)| keyed),
            move |ids| cut_answer(&log, &stream, &ids),
        )
        .await;
    if response.status().is_success() {
        state.metrics.cut_published();
    }
    Ok(response)
}

/// 202 with the report's id (the cut marker's place in the log, and the
/// log's tag).
fn cut_answer(
    log: &quire_log::LogIdentity,
    stream: &StreamName,
    ids: &[MessageId],
) -> Result<StoredResponse, ApiError> {
    let landed = ids
        .first()
        .ok_or_else(|| ApiError::Internal("kafka returned no id for the cut marker".into()))?;
    let id = log.report_id(stream.clone(), landed.partition, landed.offset);
    tracing::info!(report_id = %id, "report cut");
    let location = HeaderValue::try_from(report_path(&id))
        .map_err(|error| ApiError::Internal(error.to_string()))?;
    let body = serde_json::to_vec(&ReportView::pending(id))
        .map_err(|error| ApiError::Internal(error.to_string()))?;
    Ok(StoredResponse {
        status: StatusCode::ACCEPTED,
        headers: vec![
            ("content-type", HeaderValue::from_static("application/json")),
            ("location", location),
        ],
        body: body.into(),
    })
}

/// `GET /v1/reports/{id}`.
pub async fn get_report(
    State(state): State<Reports>,
    ReportPath(id): ReportPath,
) -> Result<Json<ReportView>, ApiError> {
    Ok(Json(report_state(&state, id).await?))
}

/// What the bucket holds of a report: its manifest, checked against the
/// object at the manifest's key.
enum Stored {
    /// A manifest that describes the object at its key.
    Completed(Manifest),
    NoManifest,
    /// A manifest whose object is gone (retention deletes documents before
    /// manifests).
    DocumentGone(Manifest),
    /// A manifest whose key holds another object: never served.
    Superseded,
}

async fn stored(state: &Reports, id: &ReportId) -> Result<Stored, ApiError> {
    let Some(manifest) = state.storage.manifest(id).await? else {
        return Ok(Stored::NoManifest);
    };
    Ok(match state.storage.check_document(&manifest).await? {
        DocumentCheck::Described => Stored::Completed(manifest),
        DocumentCheck::Missing => Stored::DocumentGone(manifest),
        DocumentCheck::Replaced { bytes, e_tag } => {
            warn_superseded(id, &manifest, bytes, e_tag.as_deref());
            Stored::Superseded
        }
    })
}

/// A manifest that is not served, in the log: what it says and what was found.
fn warn_superseded(id: &ReportId, manifest: &Manifest, bytes: Option<i64>, e_tag: Option<&str>) {
    tracing::warn!(
        report_id = %id,
        key = %manifest.key,
        manifest_bytes = manifest.bytes,
        manifest_e_tag = ?manifest.e_tag,
        found_bytes = ?bytes,
        found_e_tag = ?e_tag,
        "manifest describes an object its key no longer holds (a replay cut the log elsewhere); not served"
    );
}

/// Where a report stands:
/// - completed: its manifest describes the object at its key (one GET of
///   the manifest, one HEAD of the document; no Kafka);
/// - 410 `report_content_gone`: the manifest is there, its document is not;
/// - pending: no manifest describes it, the log holds its cut marker, and
///   the stream's watermark has not reached the marker (`reported.rs`);
/// - 410 `report_expired`: no manifest, but the watermark has passed the
///   marker, so the report was completed and retention deleted it;
/// - 410 `report_superseded`: a manifest names it, but its key holds
///   another document (a replay that cut elsewhere) and nothing will
///   complete it again;
/// - 404: never issued.
async fn report_state(state: &Reports, id: ReportId) -> Result<ReportView, ApiError> {
    let superseded = match stored(state, &id).await? {
        Stored::Completed(manifest) => return Ok(ReportView::completed(id, manifest)),
        Stored::DocumentGone(manifest) => return Err(content_gone(&id, manifest)),
        Stored::Superseded => true,
        Stored::NoManifest => false,
    };
    // An id of another log (the records topic was deleted and created
    // again since) names a position in a log that is gone: never read the
    // new log there.
    let log = state.placement.identity()?;
    if !log.names_this_log(id.log.as_ref()) {
        return Err(ApiError::ReportLogGone { id: id.to_string() });
    }
    match state.log.find_cut(&id).await? {
        // Not reported yet. A marker's superseded manifest is rewritten by
        // the replay when it reports the marker.
        CutLookup::Issued if !state.reported.is_reported(&id, &log).await => {
            Ok(ReportView::pending(id))
        }
        // Reported, and no manifest described it: unless one was written
        // between the first look and the watermark, retention deleted it.
        CutLookup::Issued => match stored(state, &id).await? {
            Stored::Completed(manifest) => Ok(ReportView::completed(id, manifest)),
            Stored::DocumentGone(manifest) => Err(content_gone(&id, manifest)),
            Stored::Superseded => Err(ApiError::ReportSuperseded { id: id.to_string() }),
            Stored::NoManifest => Err(ApiError::ReportExpired { id: id.to_string() }),
        },
        CutLookup::NotIssued(_) if superseded => {
            Err(ApiError::ReportSuperseded { id: id.to_string() })
        }
        CutLookup::NotIssued(reason) => Err(ApiError::ReportNotFound {
            id: id.to_string(),
            reason,
        }),
    }
}

fn content_gone(id: &ReportId, manifest: Manifest) -> ApiError {
    ApiError::ReportContentGone {
        id: id.to_string(),
        key: manifest.key,
    }
}

/// Query of `GET /v1/reports/{id}/content`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentQuery {
    /// `true`: answer 307 to a presigned S3 URL of the document instead of
    /// streaming it (when the API hands out download URLs).
    pub redirect: Option<bool>,
}

/// A completed report's manifest, or why there is none (pending: 409).
async fn completed_manifest(state: &Reports, id: ReportId) -> Result<Manifest, ApiError> {
    let view = report_state(state, id).await?;
    view.manifest.ok_or_else(|| ApiError::ReportPending {
        id: view.report_id.to_string(),
    })
}

/// The name a download is saved under: the report id (whose characters are
/// fixed), never the key a definition shaped.
fn download_name(id: &ReportId, key: &str) -> String {
    let extension = quire_messages::compression::report_extension(
        quire_messages::compression::Compression::of_key(key),
    );
    format!("{id}{extension}")
}

/// A presigned URL of a completed report's document (`manifest` comes from
/// [`completed_manifest`], which checked that the object at its key is the
/// one it describes; 410 otherwise, as for the content route).
async fn download_url(
    state: &Reports,
    downloads: &crate::storage::DownloadUrls,
    id: &ReportId,
    manifest: &Manifest,
) -> Result<crate::storage::DownloadUrl, ApiError> {
    let content_type = quire_messages::layout::report_content_type(&manifest.key);
    let url = downloads
        .presign(
            &manifest.key,
            content_type,
            &download_name(id, &manifest.key),
        )
        .await?;
    state.metrics.download_url_issued();
    Ok(url)
}

/// `GET /v1/reports/{id}/url`'s answer.
#[derive(Debug, Serialize)]
pub struct DownloadView {
    pub report_id: ReportId,
    /// A GET of this URL answers the document, straight from S3, until
    /// `expires_at`; anyone holding it can, without a token.
    pub url: String,
    /// RFC 3339, UTC.
    pub expires_at: String,
    pub expires_in_s: u64,
    /// The manifest's size and SHA-256 of the stored object: check the
    /// download against them.
    pub bytes: u64,
    pub sha256: String,
    /// The S3 additional checksum the object is stored with: a GET of the
    /// URL with `x-amz-checksum-mode: ENABLED` answers it too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checksum: Option<quire_messages::ObjectChecksum>,
}

/// `GET /v1/reports/{id}/url`: a presigned S3 GET URL of the document, so a
/// large report downloads without passing through the API.
pub async fn get_report_url(
    State(state): State<Reports>,
    ReportPath(id): ReportPath,
) -> Result<Response, ApiError> {
    let Some(downloads) = state.downloads.as_ref() else {
        return Err(ApiError::DownloadUrlsOff { id: id.to_string() });
    };
    let manifest = completed_manifest(&state, id.clone()).await?;
    let url = download_url(&state, downloads, &id, &manifest).await?;
    let view = DownloadView {
        expires_at: aws_sdk_s3::primitives::DateTime::from(url.expires_at)
            .fmt(aws_sdk_s3::primitives::DateTimeFormat::DateTime)
            .map_err(|error| ApiError::Internal(error.to_string()))?,
        expires_in_s: downloads.expiry().as_secs(),
        report_id: id,
        url: url.url,
        bytes: manifest.bytes,
        sha256: manifest.sha256,
        checksum: manifest.checksum,
    };
    let mut response = Json(view).into_response();
    // The URL is a credential for as long as it lives: no cache keeps it.
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// `GET /v1/reports/{id}/content`: the document as stored (XML, or the gzip
/// file of a `.xml.gz` report), streamed from S3 as it arrives (never held in
/// memory whole). With `?redirect=true`, and when the API hands out download
/// URLs, a 307 to a presigned S3 URL of it instead; without them, the
/// document is served as usual.
pub async fn get_report_content(
    State(state): State<Reports>,
    ReportPath(id): ReportPath,
    query: Result<Query<ContentQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|rejection| ApiError::InvalidQuery(rejection.body_text()))?;
    let mut manifest = completed_manifest(&state, id.clone()).await?;
    if query.redirect == Some(true)
        && let Some(downloads) = state.downloads.as_ref()
    {
        let url = download_url(&state, downloads, &id, &manifest).await?;
        let location = HeaderValue::try_from(url.url)
            .map_err(|error| ApiError::Internal(error.to_string()))?;
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::TEMPORARY_REDIRECT;
        let headers = response.headers_mut();
        headers.insert(header::LOCATION, location);
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Ok(digest) = HeaderValue::try_from(manifest.sha256.as_str()) {
            headers.insert("x-quire-sha256", digest);
        }
        insert_checksum_header(headers, &manifest);
        return Ok(response);
    }
    // Streamed only while it is the object the manifest describes (its
    // ETag): replaced since the check, the report is looked at once more.
    let mut looked_again = false;
    let object = loop {
        match state
            .storage
            .open_document(&manifest.key, manifest.e_tag.as_deref())
            .await?
        {
            OpenedDocument::Object(object) => break object,
            OpenedDocument::Missing => return Err(content_gone(&id, manifest)),
            OpenedDocument::Replaced if !looked_again => {
                looked_again = true;
                manifest = completed_manifest(&state, id.clone()).await?;
            }
            OpenedDocument::Replaced => {
                warn_superseded(&id, &manifest, None, None);
                return Err(ApiError::ReportSuperseded { id: id.to_string() });
            }
        }
    };
    // A compressed report is served as the file it is (`application/gzip`
    // or `application/zstd`, no Content-Encoding), so clients that decode Content-Encoding on their
    // own still receive the bytes the manifest's SHA-256 covers.
    let content_type = quire_messages::layout::report_content_type(&manifest.key);
    let chunks = futures::stream::unfold(object.body, |mut body| async move {
        body.next().await.map(|chunk| (chunk, body))
    });
    let mut response = Response::new(Body::from_stream(chunks));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // A report is data, never active content: a definition may name the
    // XHTML namespace and a `script` field, and a browser opening the
    // document inline would run it. So it is downloaded under a name of
    // quire's own making (the report id, whose characters are fixed), not
    // sniffed, and sandboxed should it be rendered anyway.
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("sandbox"),
    );
    if let Ok(disposition) = HeaderValue::try_from(format!(
        "attachment; filename=\"{}\"",
        download_name(&id, &manifest.key)
    )) {
        headers.insert(header::CONTENT_DISPOSITION, disposition);
    }
    if let Some(length) = object
        .content_length
        .and_then(|length| u64::try_from(length).ok())
    {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    if let Ok(digest) = HeaderValue::try_from(manifest.sha256.as_str()) {
        headers.insert("x-quire-sha256", digest);
    }
    insert_checksum_header(headers, &manifest);
    Ok(response)
}

/// `x-quire-checksum-crc32c` or `x-quire-checksum-sha256`: the S3 checksum
/// the object is stored with (base64, `-N` for a composite one).
fn insert_checksum_header(headers: &mut axum::http::HeaderMap, manifest: &Manifest) {
    let Some(checksum) = &manifest.checksum else {
        return;
    };
    let name = match checksum.algorithm.as_str() {
        "CRC32C" => "x-quire-checksum-crc32c",
        "SHA256" => "x-quire-checksum-sha256",
        _ => return,
    };
    if let Ok(value) = HeaderValue::try_from(checksum.value.as_str()) {
        headers.insert(name, value);
    }
}

/// Query of `GET /v1/streams/{stream}/reports`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Reports per page, 1-1000 (default 100).
    pub limit: Option<u32>,
    /// The `continuation` of the previous page.
    pub continuation: Option<String>,
    /// Only the reports of the time window starting then (RFC 3339 with an
    /// offset, as `window_start` in manifests): a windowed stream's index.
    pub window_start: Option<String>,
}

const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;
/// Manifests fetched at once while building a page.
const MANIFEST_FETCHES: usize = 16;

/// `{"stream": ..., "reports": [...], "continuation": "..." | null}`.
#[derive(Debug, Serialize)]
pub struct ReportPage {
    pub stream: StreamName,
    pub reports: Vec<ReportView>,
    /// Pass as `?continuation=` for the next page; null on the last one.
    pub continuation: Option<String>,
}

/// `GET /v1/streams/{stream}/reports`: the stream's completed reports, from
/// their manifests, a page at a time. Pending reports have no manifest yet
/// and are not listed; neither is a manifest whose key no longer holds the
/// document it describes (deleted by retention, or replaced by a replay
/// that cut elsewhere: one HEAD per manifest listed). Within a page, reports
/// are in log order, and a page may hold fewer than `limit`. With
/// `?window_start=`, only that window's reports, from the window index.
pub async fn list_reports(
    State(state): State<Reports>,
    StreamPath(stream): StreamPath,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<ReportPage>, ApiError> {
    let Query(query) = query.map_err(|rejection| ApiError::InvalidQuery(rejection.body_text()))?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::InvalidQuery(format!(
            "limit is {limit}; it must be between 1 and {MAX_PAGE}"
        )));
    }
    let prefix = match &query.window_start {
        Some(start) => {
            let start_ms = quire_messages::window::parse_time(start)
                .map_err(|reason| ApiError::InvalidQuery(format!("window_start: {reason}")))?;
            quire_messages::layout::window_index_prefix(&stream, start_ms)
        }
        None => quire_messages::layout::manifest_prefix(&stream),
    };
    let page = state
        .storage
        .list_keys(&prefix, limit as i32, query.continuation)
        .await?;
    let storage = &state.storage;
    let manifests: Vec<Option<Manifest>> = futures::stream::iter(page.keys)
        .map(|key| async move {
            let Some(bytes) = storage.get_small(&key).await? else {
                // Listed, then deleted: skip it.
                return Ok::<_, crate::storage::StorageError>(None);
            };
            let manifest = storage.decode_manifest(&key, &bytes)?;
            Ok(match storage.check_document(&manifest).await? {
                DocumentCheck::Described => Some(manifest),
                DocumentCheck::Missing => None,
                DocumentCheck::Replaced { bytes, e_tag } => {
                    warn_superseded(&manifest.report_id, &manifest, bytes, e_tag.as_deref());
                    None
                }
            })
        })
        .buffered(MANIFEST_FETCHES)
        .try_collect()
        .await?;
    let mut reports: Vec<ReportView> = manifests
        .into_iter()
        .flatten()
        .map(|manifest| ReportView::completed(manifest.report_id.clone(), manifest))
        .collect();
    // Keys sort as text ("~3-10" before "~3-9"); a page reads in log order.
    reports.sort_by_key(|report| (report.report_id.partition, report.report_id.offset));
    Ok(Json(ReportPage {
        stream,
        reports,
        continuation: page.continuation,
    }))
}

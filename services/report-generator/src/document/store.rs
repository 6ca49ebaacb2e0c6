//! What a document stores besides its object: its schema, its tags and its
//! manifest, in that order, all before the transaction that announces it.

use quire_messages::window::Window;
use quire_messages::{Manifest, layout};
use quire_s3::{S3Bucket, UploadPolicy};

use crate::WorkerError;

/// Stores a typed definition's schema once per worker process (the same
/// key always holds the same bytes: its name is their digest, so a replay
/// or another worker writing it again changes nothing).
pub(super) async fn put_schema(
    bucket: &S3Bucket,
    key: &str,
    schema: &str,
) -> Result<(), WorkerError> {
    static STORED: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let place = format!("{}/{key}", bucket.name());
    let stored = |place: &str| {
        STORED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(place)
    };
    if stored(&place) {
        return Ok(());
    }
    let policy = UploadPolicy::for_max_object_size(schema.len() as u64);
    let mut writer = bucket.typed_writer(key, Some(layout::XSD_CONTENT_TYPE), &policy)?;
    writer.append(schema.as_bytes()).await?;
    writer.finish().await?;
    STORED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert(place);
    Ok(())
}

/// The tags of a report's object, for lifecycle rules and people to select
/// reports by: `quire-stream`, `quire-report-id` (its `~` written `/`,
/// which S3 tags allow), `quire-partition`, `quire-records`,
/// `quire-first-offset`, `quire-last-offset`, and `quire-window-start` for
/// a windowed stream. Stream names and window starts hold only characters
/// S3 tags allow.
pub fn report_tags(manifest: &Manifest) -> Vec<(&'static str, String)> {
    let mut tags = vec![
        ("quire-stream", manifest.stream.to_string()),
        (
            "quire-report-id",
            manifest.report_id.to_string().replace('~', "/"),
        ),
        ("quire-partition", manifest.partition.to_string()),
        ("quire-records", manifest.records.to_string()),
        ("quire-first-offset", manifest.first_offset.to_string()),
        ("quire-last-offset", manifest.last_offset.to_string()),
    ];
    if let Some(start) = &manifest.window_start {
        tags.push(("quire-window-start", start.clone()));
    }
    tags
}

/// Writes the manifest through the same writer as documents, so it gets the
/// same per-attempt timeouts, retries and counters (a single PutObject: a
/// manifest is far below one part).
/// A windowed report's manifest is also copied into the window index
/// (`layout::window_index_key`), after the manifest itself.
pub(super) async fn put_manifest(
    bucket: &S3Bucket,
    manifest: &Manifest,
    window: Option<Window>,
) -> Result<(), WorkerError> {
    let body = serde_json::to_vec_pretty(manifest).expect("manifests serialise");
    let policy = UploadPolicy::for_max_object_size(body.len() as u64);
    let keys =
        std::iter::once(layout::manifest_key(&manifest.report_id)).chain(window.map(|window| {
            layout::window_index_key(&manifest.stream, window.start_ms, &manifest.report_id)
        }));
    for key in keys {
        let mut writer = bucket.typed_writer(key, Some(layout::JSON_CONTENT_TYPE), &policy)?;
        writer.append(&body).await?;
        writer.finish().await?;
    }
    Ok(())
}

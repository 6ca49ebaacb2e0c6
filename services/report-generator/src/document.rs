//! One open report document: rendered XML streamed into a multipart upload.

use std::time::Instant;

use quire_messages::{CURRENT_VERSION, Definition, Manifest, ReportId, StreamName, Trigger};
use quire_s3::{MultipartWriter, S3Bucket, UploadPolicy, WrittenObject};
use quire_xml::{DocumentRenderer, RenderError, Summary};

use crate::WorkerError;

/// A document being written. Its key is fixed when it opens
/// (`reports/{stream}/{partition}-{first_offset}.xml`) and its bytes depend
/// only on the log: records, the definition in force at its first record,
/// and the marker that cuts it.
pub struct OpenDocument {
    pub stream: StreamName,
    pub partition: i32,
    pub first_offset: i64,
    pub first_record_time_ms: Option<i64>,
    pub records: u64,
    /// Wall-clock time it opened: only for the age rollover decision, never
    /// written into the document.
    pub opened_at: Instant,
    /// A rollover marker this worker published for it and has not read back yet.
    pub cut_requested: Option<Trigger>,
    renderer: DocumentRenderer,
    writer: MultipartWriter,
    /// One record's rendering, reused; appended to the writer only once the
    /// record rendered completely, so a record that fails leaves no trace.
    scratch: Vec<u8>,
}

impl OpenDocument {
    pub async fn open(
        bucket: &S3Bucket,
        policy: &UploadPolicy,
        stream: &StreamName,
        partition: i32,
        first_offset: i64,
        definition: &Definition,
    ) -> Result<Self, WorkerError> {
        let key = quire_messages::report_key(stream, partition, first_offset, definition.gzip);
        let renderer = DocumentRenderer::new(definition);
        let mut writer = bucket.writer(key, policy)?;
        let mut scratch = Vec::with_capacity(4096);
        renderer.start(&mut scratch, stream.as_str(), partition, first_offset);
        writer.append(&scratch).await?;
        scratch.clear();
        Ok(OpenDocument {
            stream: stream.clone(),
            partition,
            first_offset,
            first_record_time_ms: None,
            records: 0,
            opened_at: Instant::now(),
            cut_requested: None,
            renderer,
            writer,
            scratch,
        })
    }

    /// Appends one record. `Ok(Err(_))` is a record that cannot be rendered
    /// (for the dead-letter topic); the document is unchanged then.
    pub async fn append(
        &mut self,
        record: &serde_json::Value,
        time_ms: Option<i64>,
    ) -> Result<Result<(), RenderError>, WorkerError> {
        self.scratch.clear();
        if let Err(error) = self.renderer.record(&mut self.scratch, record) {
            return Ok(Err(error));
        }
        self.writer.append(&self.scratch).await?;
        if self.records == 0 {
            self.first_record_time_ms = time_ms;
        }
        self.records += 1;
        Ok(Ok(()))
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.writer.bytes_written()
    }

    /// Bytes held in memory (buffer and parts in flight).
    pub fn buffered_bytes(&self) -> u64 {
        self.writer.buffered_bytes()
    }

    /// Ends the document at the marker `report_id` (with its log time), stores
    /// it, and writes its manifest. Returns the manifest.
    pub async fn complete(
        mut self,
        bucket: &S3Bucket,
        report_id: &ReportId,
        cut_time_ms: Option<i64>,
        trigger: Trigger,
    ) -> Result<Manifest, WorkerError> {
        self.scratch.clear();
        let report_id_text = report_id.to_string();
        self.renderer.finish(
            &mut self.scratch,
            &Summary {
                records: self.records,
                first_offset: self.first_offset,
                last_offset: report_id.offset,
                report_id: &report_id_text,
            },
        );
        self.writer.append(&self.scratch).await?;
        let WrittenObject {
            key,
            bytes,
            sha256_hex,
            ..
        } = self.writer.finish().await?;
        let manifest = Manifest {
            v: CURRENT_VERSION,
            report_id: report_id.clone(),
            stream: self.stream,
            key,
            partition: self.partition,
            first_offset: self.first_offset,
            last_offset: report_id.offset,
            records: self.records,
            bytes,
            sha256: sha256_hex,
            trigger,
            first_record_time_ms: self.first_record_time_ms,
            cut_time_ms,
        };
        put_manifest(bucket, &manifest).await?;
        Ok(manifest)
    }

    /// Abandons the document: its multipart upload is aborted; the next owner
    /// of the partition renders it again from the log.
    pub async fn abort(self) {
        let key = self.writer.key().to_owned();
        if let Err(error) = self.writer.abort().await {
            tracing::warn!(key, error = %error, "abort of an open document failed; the take-over sweep will retry");
        }
    }
}

async fn put_manifest(bucket: &S3Bucket, manifest: &Manifest) -> Result<(), WorkerError> {
    let body = serde_json::to_vec_pretty(manifest).expect("manifests serialise");
    bucket
        .client()
        .put_object()
        .bucket(bucket.name())
        .key(manifest.report_id.manifest_key())
        .content_type("application/json")
        .body(body.into())
        .send()
        .await
        .map_err(|error| {
            WorkerError::S3(format!(
                "writing manifest {}: {}",
                manifest.report_id.manifest_key(),
                quire_s3::aws_sdk_s3::error::DisplayErrorContext(&error)
            ))
        })?;
    Ok(())
}

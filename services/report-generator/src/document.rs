//! One open report document: rendered XML streamed into a multipart upload,
//! through a compressor when the stream's definition asks for gzip or zstd
//! (`encoding`), then stored with its schema, tags and manifest (`store`).
//!
//! Compression keeps "same key, same bytes": both compressors are
//! deterministic (`quire_xml::compress`), so the same records fed in the
//! same order compress to the same bytes on every replay.

mod encoding;
mod store;

use encoding::Encoding;

use std::time::Instant;

use quire_messages::layout;
use quire_messages::{CURRENT_VERSION, Manifest, ObjectChecksum, ReportId, StreamName, Trigger};
use std::sync::Arc;

use quire_messages::window::Window;
use quire_s3::{MemoryPool, MultipartWriter, S3Bucket, UploadPolicy, WrittenObject};
use quire_xml::{DocumentRenderer, HeaderValues, RenderError, Summary, SummaryWindow, Totals};

use crate::WorkerError;
use crate::decide::DocumentStats;
use crate::pipeline::{Document, DocumentSpec, DocumentStore};

/// A document being written. Its key is fixed when it opens
/// (`reports/{stream}/{partition}-{first_offset}.xml`, `.xml.gz` or
/// `.xml.zst` under a compressing definition) and its bytes depend only on the log: records, the definition
/// in force at its first record, and the marker that cuts it.
pub struct OpenDocument {
    pub stream: StreamName,
    pub partition: i32,
    pub first_offset: i64,
    pub first_record_time_ms: Option<i64>,
    /// Offset and log time of the last record appended: where an inline
    /// rollover that starts the next document before a record ends this one.
    pub last_record_offset: Option<i64>,
    pub last_record_time_ms: Option<i64>,
    pub records: u64,
    /// Wall-clock time it opened: only for the age rollover decision, never
    /// written into the document.
    pub opened_at: Instant,
    /// A rollover marker this worker published for it and has not read back yet.
    pub cut_requested: Option<Trigger>,
    /// Its time window, for a windowed stream.
    pub window: Option<DocumentWindow>,
    renderer: DocumentRenderer,
    /// Between the renderer and the writer: plain, or compressed.
    encoding: Encoding,
    writer: MultipartWriter,
    /// One record's rendering, reused; appended to the writer only once the
    /// record rendered completely, so a record that fails leaves no trace.
    scratch: Vec<u8>,
    /// The definition's totals, staged like `scratch` and counted on append.
    totals: Option<Totals>,
    /// A typed definition's schema: its key and bytes, stored before the
    /// document's manifest so every report's schema is there when it is
    /// announced.
    schema: Option<(String, String)>,
}

/// The time window a document belongs to, and its place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentWindow {
    pub window: Window,
    /// 1 for the window's first document, then 2, ...
    pub sequence: u32,
    /// The window's start and end in RFC 3339 with the zone's offset.
    pub start: String,
    pub end: String,
}

/// A record to append.
#[derive(Clone, Copy)]
pub enum RecordInput<'a> {
    /// Parsed from its text.
    Parsed(&'a serde_json::Value),
    /// Its fields' elements already written by `quire_xml::render_fields`
    /// from `text`.
    Rendered { text: &'a [u8], fields: &'a [u8] },
}

impl OpenDocument {
    /// Opens the document at `key` (see `layout::document_key`). A key
    /// outside the default layout (a definition's key template) is one the
    /// take-over sweep cannot tell the partition of, so an upload a dead
    /// owner left on it is aborted here, when its document opens again.
    pub async fn open(
        bucket: &S3Bucket,
        policy: &UploadPolicy,
        spec: DocumentSpec,
    ) -> Result<Self, WorkerError> {
        let DocumentSpec {
            stream,
            partition,
            first_offset,
            definition,
            key,
            window,
        } = spec;
        let definition = &definition;
        if !layout::report_key_belongs_to(&key, partition) {
            let aborted = bucket
                .abort_pending_uploads_where(&key, |pending| pending == key)
                .await?;
            if aborted > 0 {
                tracing::info!(key, aborted, "earlier upload of a templated key aborted");
            }
        }
        let renderer = DocumentRenderer::new(definition);
        let schema = renderer.schema_file().map(|file| {
            (
                quire_xml::schema_key(stream.as_str(), file),
                quire_xml::schema_for(definition),
            )
        });
        let totals = Totals::new(definition);
        let mut encoding = Encoding::for_definition(definition, bucket.memory(), &key)?;
        let content_type = layout::content_type_for_key(&key);
        let mut writer = bucket.typed_writer(key, content_type, policy)?;
        let scratch = Vec::with_capacity(4096);
        if renderer.has_header() {
            // The root and the header are written last, before the first
            // part (see `complete`).
            writer.hold_first_part();
        } else {
            let mut start = Vec::with_capacity(512);
            renderer.start(&mut start, stream.as_str(), partition, first_offset);
            encoding.write(&mut writer, &start).await?;
        }
        Ok(OpenDocument {
            stream,
            partition,
            first_offset,
            first_record_time_ms: None,
            last_record_offset: None,
            last_record_time_ms: None,
            records: 0,
            opened_at: Instant::now(),
            cut_requested: None,
            window,
            renderer,
            encoding,
            writer,
            scratch,
            totals,
            schema,
        })
    }

    /// Renders `record` into the document's scratch after what is rendered
    /// and not yet appended, nothing written yet: its size, or why it cannot
    /// be rendered (then nothing of it is kept). Whether the message's
    /// records fit is the pipeline's decision (`decide::fit`);
    /// [`append_rendered`](Self::append_rendered) writes them.
    pub fn render(&mut self, record: RecordInput<'_>) -> Result<usize, RenderError> {
        let rendered = render_record(&self.renderer, &mut self.scratch, record)?;
        if let Some(totals) = &mut self.totals {
            match record {
                RecordInput::Parsed(value) => totals.stage(value),
                // It rendered, so its text parses.
                RecordInput::Rendered { text, .. } => {
                    if let Ok(value) = serde_json::from_slice(text) {
                        totals.stage(&value);
                    }
                }
            }
        }
        Ok(rendered)
    }

    /// Forgets what is rendered and not yet appended.
    pub fn discard_rendered(&mut self) {
        self.scratch.clear();
        if let Some(totals) = &mut self.totals {
            totals.discard();
        }
    }

    /// Appends what [`render`](Self::render) rendered since the last
    /// append, as the `records` records of the message at `offset`.
    pub async fn append_rendered(
        &mut self,
        offset: i64,
        time_ms: Option<i64>,
        records: u64,
    ) -> Result<(), WorkerError> {
        self.encoding.write(&mut self.writer, &self.scratch).await?;
        self.scratch.clear();
        if let Some(totals) = &mut self.totals {
            totals.commit();
        }
        if self.records == 0 {
            self.first_record_time_ms = time_ms;
        }
        self.records += records;
        self.last_record_offset = Some(offset);
        self.last_record_time_ms = time_ms;
        Ok(())
    }

    /// Bytes of the stored object so far (compressed under compression, less what
    /// the compressor still holds): what the byte rollover bounds, as it
    /// bounds the object's size.
    pub fn bytes(&self) -> u64 {
        self.writer.bytes_written()
    }

    /// Memory held: the writer's buffer capacity and parts in flight, and
    /// the compressor's state (all counted in the worker's pool).
    pub fn held_bytes(&self) -> u64 {
        self.writer.held_bytes() + self.encoding.held_bytes()
    }

    /// Whether it holds a compressor (see [`compressed_documents_to_cut`]).
    pub fn is_compressed(&self) -> bool {
        self.encoding.is_compressed()
    }

    /// Bytes of the document waiting in the spill directory.
    pub fn spilled_bytes(&self) -> u64 {
        self.writer.spilled_bytes()
    }

    /// Everything the document holds for S3, in memory or spilled: what the
    /// memory cuts weigh (a cut frees both).
    pub fn buffered_bytes(&self) -> u64 {
        self.held_bytes() + self.spilled_bytes()
    }

    /// Ends the document at the marker `report_id` (with its log time), stores
    /// it, and writes its manifest. Returns the manifest.
    pub async fn complete(
        mut self,
        bucket: &S3Bucket,
        report_id: &ReportId,
        cut_time_ms: Option<i64>,
        trigger: Trigger,
        log: &str,
        tag_report: bool,
    ) -> Result<Manifest, WorkerError> {
        self.scratch.clear();
        let report_id_text = report_id.to_string();
        let summary_window = self.window.as_ref().map(|window| SummaryWindow {
            start: &window.start,
            end: &window.end,
            sequence: window.sequence,
        });
        let totals = self.totals.as_ref().map(Totals::totals).unwrap_or_default();
        self.renderer.finish_with_totals(
            &mut self.scratch,
            &Summary {
                records: self.records,
                first_offset: self.first_offset,
                last_offset: report_id.offset,
                report_id: &report_id_text,
            },
            summary_window.as_ref(),
            &totals,
        );
        self.encoding.write(&mut self.writer, &self.scratch).await?;
        // A header's document: the declaration, the root and the header,
        // filled in now, go before the first part.
        let mut head = Vec::new();
        if self.renderer.has_header() {
            let first_log_time = self.first_record_time_ms.map(quire_xml::log_time_text);
            let last_log_time = self.last_record_time_ms.map(quire_xml::log_time_text);
            let summary = Summary {
                records: self.records,
                first_offset: self.first_offset,
                last_offset: report_id.offset,
                report_id: &report_id_text,
            };
            self.renderer.start(
                &mut head,
                self.stream.as_str(),
                self.partition,
                self.first_offset,
            );
            self.renderer.header(
                &mut head,
                &HeaderValues {
                    stream: self.stream.as_str(),
                    partition: self.partition,
                    summary: &summary,
                    window: summary_window.as_ref(),
                    first_log_time: first_log_time.as_deref(),
                    last_log_time: last_log_time.as_deref(),
                    totals: &totals,
                },
            );
        }
        let (head, uncompressed_bytes) = self.encoding.finish(&mut self.writer, head).await?;
        let WrittenObject {
            key,
            bytes,
            sha256_hex,
            e_tag,
            checksum,
            ..
        } = self.writer.finish_with_head(&head).await?;
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
            e_tag,
            uncompressed_bytes,
            trigger,
            first_record_time_ms: self.first_record_time_ms,
            cut_time_ms,
            window_start: self.window.as_ref().map(|window| window.start.clone()),
            window_end: self.window.as_ref().map(|window| window.end.clone()),
            window_sequence: self.window.as_ref().map(|window| window.sequence),
            log: Some(log.to_owned()),
            checksum: checksum.map(|checksum| ObjectChecksum {
                algorithm: checksum.algorithm.to_owned(),
                kind: checksum.kind.to_owned(),
                value: checksum.value,
            }),
        };
        if tag_report {
            // Before the manifest, so before the transaction that announces
            // the report; a replay sets the same tags.
            bucket
                .tag_object(&manifest.key, &store::report_tags(&manifest))
                .await?;
        }
        if let Some((key, schema)) = &self.schema {
            store::put_schema(bucket, key, schema).await?;
        }
        store::put_manifest(
            bucket,
            &manifest,
            self.window.as_ref().map(|window| window.window),
        )
        .await?;
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

/// Renders `record` at the end of `scratch` with `renderer`: the bytes it
/// added, or why it cannot be rendered (`scratch` is then as it was). Under
/// compression a record's compressed bytes are not known yet; its XML is an upper
/// bound of them (deflate and Zstandard add a few bytes per block at worst, which the
/// caller's closing room covers).
pub fn render_record(
    renderer: &DocumentRenderer,
    scratch: &mut Vec<u8>,
    record: RecordInput<'_>,
) -> Result<usize, RenderError> {
    let start = scratch.len();
    let rendered = render_record_at_end(renderer, scratch, record);
    if rendered.is_err() {
        scratch.truncate(start);
    }
    rendered.map(|()| scratch.len() - start)
}

fn render_record_at_end(
    renderer: &DocumentRenderer,
    scratch: &mut Vec<u8>,
    record: RecordInput<'_>,
) -> Result<(), RenderError> {
    let parsed;
    let value = match record {
        RecordInput::Rendered { fields, .. } if renderer.renders_fields_verbatim() => {
            renderer.record_of_fields(scratch, fields);
            None
        }
        // Attributes or renames: the tree walk decides where each
        // field goes. The text parsed whole once already.
        RecordInput::Rendered { text, .. } => match serde_json::from_slice(text) {
            Ok(value) => {
                parsed = value;
                Some(&parsed)
            }
            Err(_) => {
                return Err(RenderError::NotAnObject {
                    found: "text that does not parse",
                });
            }
        },
        RecordInput::Parsed(value) => Some(value),
    };
    if let Some(value) = value {
        renderer.record(scratch, value)?;
    }
    Ok(())
}

impl Document for OpenDocument {
    fn stream(&self) -> &StreamName {
        &self.stream
    }

    fn stats(&self) -> DocumentStats {
        DocumentStats {
            first_offset: self.first_offset,
            records: self.records,
            bytes: self.bytes(),
            last_record_offset: self.last_record_offset,
            last_record_time_ms: self.last_record_time_ms,
        }
    }

    fn window(&self) -> Option<&DocumentWindow> {
        self.window.as_ref()
    }

    fn render(&mut self, record: RecordInput<'_>) -> Result<usize, RenderError> {
        OpenDocument::render(self, record)
    }

    fn discard_rendered(&mut self) {
        OpenDocument::discard_rendered(self);
    }
}

/// The worker's documents: rendered XML streamed into S3 multipart uploads.
pub struct S3Documents {
    pub bucket: S3Bucket,
    pub policy: UploadPolicy,
    /// Whether each report is tagged (`s3.tag_reports`).
    pub tag_reports: bool,
}

impl DocumentStore for S3Documents {
    type Document = OpenDocument;

    async fn open(&self, spec: DocumentSpec) -> Result<OpenDocument, WorkerError> {
        OpenDocument::open(&self.bucket, &self.policy, spec).await
    }

    async fn append(
        &self,
        document: &mut OpenDocument,
        offset: i64,
        time_ms: Option<i64>,
        records: u64,
    ) -> Result<(), WorkerError> {
        document.append_rendered(offset, time_ms, records).await
    }

    async fn complete(
        &self,
        document: OpenDocument,
        report_id: &ReportId,
        cut_time_ms: Option<i64>,
        trigger: Trigger,
        log: &str,
    ) -> Result<Manifest, WorkerError> {
        let manifest = document
            .complete(
                &self.bucket,
                report_id,
                cut_time_ms,
                trigger,
                log,
                self.tag_reports,
            )
            .await?;
        Ok(manifest)
    }

    async fn abort(&self, document: OpenDocument) {
        document.abort().await;
    }
}

/// The compressed documents to cut early so that at most
/// `max_compressed` (`worker.max_gzip_documents`, which bounds gzip and
/// zstd compressors together) stay open once the cuts land, largest first;
/// returned as (partition, stream).
///
/// Why cuts: a compressor's state (counted in the memory budget:
/// `quire_xml::compress::state_bytes`) cannot spill, and it cannot be
/// dropped and rebuilt mid-document without changing the document's bytes
/// (same key, same bytes), so thousands of compressed streams would
/// otherwise hold thousands of them. A document that has to open still
/// opens (the log decides where documents start): past the bound, the
/// largest open compressed documents are cut by marker, like the memory
/// cuts, and the bound holds again once the markers land. Documents whose
/// cut is already requested count as leaving.
pub fn compressed_documents_to_cut<'a>(
    documents: impl IntoIterator<Item = &'a OpenDocument>,
    max_compressed: usize,
) -> Vec<(i32, StreamName)> {
    let candidates = documents
        .into_iter()
        .filter(|document| document.is_compressed())
        .map(|document| CompressedCandidate {
            bytes: document.buffered_bytes(),
            leaving: document.cut_requested.is_some(),
            id: (document.partition, document.stream.clone()),
        });
    past_the_bound(candidates, max_compressed)
}

/// An open compressed document, for [`past_the_bound`].
struct CompressedCandidate<Id> {
    bytes: u64,
    /// Its cut is requested already.
    leaving: bool,
    id: Id,
}

/// Which of `open` to cut so that at most `max` stay once every requested
/// cut lands: the largest of those not leaving yet.
fn past_the_bound<Id>(open: impl Iterator<Item = CompressedCandidate<Id>>, max: usize) -> Vec<Id> {
    let mut staying: Vec<CompressedCandidate<Id>> =
        open.filter(|document| !document.leaving).collect();
    let excess = staying.len().saturating_sub(max);
    if excess == 0 {
        return Vec::new();
    }
    staying.sort_by_key(|document| std::cmp::Reverse(document.bytes));
    staying
        .into_iter()
        .take(excess)
        .map(|document| document.id)
        .collect()
}

/// The memory every document of a worker session shares: the budget
/// (`worker.memory_budget_bytes`), the limit on parts in flight across the
/// worker (`worker.parts_in_flight_total`, reserved out of the budget) and
/// the replica's spill directory, emptied here of what a crashed process
/// left. A budget too small for the parts in flight, or a spill directory
/// that cannot be made or written, is a configuration error.
pub fn memory_pool(
    settings: &quire_config::WorkerSettings,
    policy: &UploadPolicy,
    counters: &Arc<quire_s3::WriterCounters>,
) -> Result<Arc<MemoryPool>, WorkerError> {
    let memory_policy = quire_s3::MemoryPolicy {
        budget_bytes: settings.memory_budget_bytes,
        parts_in_flight: settings.parts_in_flight_total.get(),
        part_size: policy.part_size(),
        spill_dir: Some(settings.replica_spill_dir()),
        spill_max_bytes: settings.spill_max_bytes,
    };
    memory_policy.validate().map_err(|reason| {
        WorkerError::Config(format!(
            "worker.memory_budget_bytes / worker.parts_in_flight_total: {reason}"
        ))
    })?;
    let pool = MemoryPool::new(memory_policy, counters.clone())
        .map_err(|reason| WorkerError::Config(format!("worker.spill_dir: {reason}")))?;
    tracing::info!(
        budget_bytes = settings.memory_budget_bytes,
        parts_in_flight_total = settings.parts_in_flight_total,
        spill_dir = %settings.replica_spill_dir().display(),
        spill_max_bytes = settings.spill_max_bytes,
        "memory pool ready"
    );
    Ok(Arc::new(pool))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_compressor_bound_the_largest_documents_not_yet_leaving_are_cut() {
        let candidate =
            |id: u32, bytes: u64, leaving: bool| CompressedCandidate { bytes, leaving, id };
        let open = || {
            vec![
                candidate(1, 100, false),
                candidate(2, 900, true),
                candidate(3, 500, false),
                candidate(4, 300, false),
                candidate(5, 700, false),
            ]
        };
        assert!(
            past_the_bound(open().into_iter(), 4).is_empty(),
            "4 stay once 2 leaves"
        );
        assert_eq!(past_the_bound(open().into_iter(), 2), vec![5, 3]);
        assert_eq!(past_the_bound(open().into_iter(), 0), vec![5, 3, 4, 1]);
        assert!(past_the_bound(Vec::<CompressedCandidate<u32>>::new().into_iter(), 1).is_empty());
    }
}

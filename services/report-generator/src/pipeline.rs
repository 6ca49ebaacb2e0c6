//! One assigned record partition, as the worker runs it: its streams'
//! watermarks, definitions and windows (`partition.rs`), its open documents,
//! how far it is read, and the operation the loop needs for each message,
//! [`PartitionPipeline::process`]. What to do is decided by `decide.rs`'s
//! pure functions; this module applies it: documents opened, appended and
//! completed through a [`DocumentStore`] (S3 for the worker, memory for the
//! property tests), events, dead letters and handovers into the array's
//! outbox.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;

use quire_config::TopicNames;
use quire_messages::records::{LogMessage, RecordTexts};
use quire_messages::window::{CivilHour, Schedule, Window};
use quire_messages::{
    Definition, Manifest, ReportId, StreamName, Trigger, events, layout, records, watermarks,
};
use quire_queue::InMessage;
use quire_xml::RenderError;

use crate::WorkerError;
use crate::decide::{
    self, CutLimits, Decision, DocumentStats, Fit, IgnoredMarker, Skip, WindowMarker,
};
use crate::document::{DocumentWindow, RecordInput};
use crate::partition::{PartitionState, StreamWindow};
use crate::watermarks::Loaded;
use crate::worker::outbox::{Outbox, on_topic};
use letters::{Letter, every_record_a_letter, render_all};

mod letters;
mod moves;
#[cfg(test)]
mod properties;

/// What every partition's pipeline of a session shares.
pub struct Context<S> {
    pub topics: TopicNames,
    pub store: S,
    pub limits: CutLimits,
    /// The records log this session reads: its topic id (stamped on
    /// watermarks and manifests) and its tag (in report ids and keys).
    pub log: quire_log::LogIdentity,
}

/// A document being written, as the pipeline decides about it.
pub trait Document: Send {
    fn stream(&self) -> &StreamName;
    fn stats(&self) -> DocumentStats;
    fn window(&self) -> Option<&DocumentWindow>;
    /// Renders `record` after what is rendered and not yet appended
    /// (nothing is written yet): its size, or why it cannot be rendered
    /// (nothing of it kept). [`DocumentStore::append`] writes what is
    /// rendered.
    fn render(&mut self, record: RecordInput<'_>) -> Result<usize, RenderError>;
    /// Forgets what is rendered and not yet appended.
    fn discard_rendered(&mut self);
}

/// A document to open: its key and its rendering are fixed from here on.
pub struct DocumentSpec {
    pub stream: StreamName,
    pub partition: i32,
    pub first_offset: i64,
    pub definition: Definition,
    pub key: String,
    pub window: Option<DocumentWindow>,
}

/// Where documents are written: the effects the pipeline applies.
pub trait DocumentStore: Sync {
    type Document: Document;

    fn open(
        &self,
        spec: DocumentSpec,
    ) -> impl Future<Output = Result<Self::Document, WorkerError>> + Send;

    /// Appends what [`Document::render`] rendered since the last append, as
    /// the `records` records of the message at `offset`.
    fn append(
        &self,
        document: &mut Self::Document,
        offset: i64,
        time_ms: Option<i64>,
        records: u64,
    ) -> impl Future<Output = Result<(), WorkerError>> + Send;

    /// Ends the document as the report `report_id` (cut at `cut_time_ms`,
    /// log time), stores it and its manifest.
    fn complete(
        &self,
        document: Self::Document,
        report_id: &ReportId,
        cut_time_ms: Option<i64>,
        trigger: Trigger,
        log: &str,
    ) -> impl Future<Output = Result<Manifest, WorkerError>> + Send;

    /// Abandons the document: the next owner renders it again.
    fn abort(&self, document: Self::Document) -> impl Future<Output = ()> + Send;
}

/// The open documents of a partition, by stream, with the window ends of
/// the windowed ones: kept together, so a windowed document is in
/// `window_ends` exactly while it is open.
struct OpenDocuments<D> {
    by_stream: BTreeMap<StreamName, D>,
    window_ends: BTreeSet<(i64, StreamName)>,
}

impl<D: Document> OpenDocuments<D> {
    fn new() -> Self {
        OpenDocuments {
            by_stream: BTreeMap::new(),
            window_ends: BTreeSet::new(),
        }
    }

    fn insert(&mut self, document: D) {
        let stream = document.stream().clone();
        if let Some(window) = document.window() {
            self.window_ends
                .insert((window.window.end_ms, stream.clone()));
        }
        let replaced = self.by_stream.insert(stream, document);
        debug_assert!(replaced.is_none(), "one open document per stream");
    }

    fn remove(&mut self, stream: &StreamName) -> Option<D> {
        let document = self.by_stream.remove(stream)?;
        if let Some(window) = document.window() {
            self.window_ends
                .remove(&(window.window.end_ms, stream.clone()));
        }
        Some(document)
    }

    /// The open document whose window ended first, if it ended by `time_ms`.
    fn pop_ended(&mut self, time_ms: i64) -> Option<D> {
        let (end, stream) = self.window_ends.first()?.clone();
        if !decide::window_closed(end, time_ms) {
            return None;
        }
        self.remove(&stream)
    }

    fn first_offset(&self, stream: &StreamName) -> Option<i64> {
        self.by_stream
            .get(stream)
            .map(|document| document.stats().first_offset)
    }

    fn window_of(&self, stream: &StreamName) -> Option<Window> {
        self.by_stream
            .get(stream)
            .and_then(|document| document.window())
            .map(|window| window.window)
    }
}

/// What one transaction carries for a partition (see
/// [`PartitionPipeline::commit_point`]).
pub struct CommitPoint {
    /// The offset to commit: never past an open document.
    pub offset: i64,
    /// Whether it moved since the last commit.
    pub moved: bool,
    /// For the watermark topic: a move processed, the streams' watermarks,
    /// the dead-letter mark.
    pub watermarks: Vec<LogMessage>,
}

/// One assigned record partition: its state is its own, and the loop
/// drives it through a few operations.
pub struct PartitionPipeline<S: DocumentStore> {
    state: PartitionState,
    open: OpenDocuments<S::Document>,
    /// Where each record's fields are rendered from its text
    /// (`quire_xml::render_fields`), reused from record to record.
    fields: Vec<u8>,
}

impl<S: DocumentStore> PartitionPipeline<S> {
    /// A partition taken over, from what its watermark partition holds, of
    /// the records log `log` (its Kafka topic id).
    pub fn take(partition: i32, loaded: Loaded, log: Arc<str>) -> Self {
        PartitionPipeline {
            state: PartitionState::from_watermarks(partition, loaded.streams, log)
                .with_dead_letters_through(loaded.dead_letters_through),
            open: OpenDocuments::new(),
            fields: Vec::new(),
        }
    }

    pub fn partition(&self) -> i32 {
        self.state.partition
    }

    pub fn documents(&self) -> impl Iterator<Item = &S::Document> {
        self.open.by_stream.values()
    }

    pub fn documents_mut(&mut self) -> impl Iterator<Item = &mut S::Document> {
        self.open.by_stream.values_mut()
    }

    pub fn document_mut(&mut self, stream: &StreamName) -> Option<&mut S::Document> {
        self.open.by_stream.get_mut(stream)
    }

    /// Its open documents, to abort (the partition is revoked, or the
    /// session ends).
    pub fn into_documents(self) -> impl Iterator<Item = S::Document> {
        self.open.by_stream.into_values()
    }

    /// Each windowed stream's progress with its open document's window: what
    /// the timed window markers look at.
    pub fn windows(
        &mut self,
    ) -> impl Iterator<Item = (&StreamName, &mut StreamWindow, Option<Window>)> {
        let open = &self.open;
        self.state
            .streams
            .iter_mut()
            .filter_map(move |(stream, state)| {
                let window = state.window.as_mut()?;
                Some((stream, window, open.window_of(stream)))
            })
    }

    /// One message of the partition, in order: windowed documents whose
    /// window ended by its log time are completed first, then the message
    /// is decided and applied.
    pub async fn process(
        &mut self,
        context: &Context<S>,
        message: &InMessage,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        self.state.observe_time(message.timestamp_ms);
        let result = match self.close_ended_windows(context, outbox).await {
            Ok(()) => self.apply(context, message, outbox).await,
            Err(error) => Err(error),
        };
        self.state.mark_read(message.offset);
        result
    }

    /// What this array's transaction carries for the partition, `None` when
    /// nothing was read yet. Marks the watermarks and the dead-letter mark
    /// written (the transaction commits them, or the session ends and the
    /// next one loads what was committed).
    pub fn commit_point(&mut self) -> Option<CommitPoint> {
        let offset = self.safe_offset()?;
        let partition = self.state.partition;
        let mut messages = Vec::new();
        if let Some(moved) = self.state.take_moved() {
            messages.push(watermarks::moved(partition, &moved));
        }
        for (stream, watermark) in self.state.watermarks_to_write(offset) {
            messages.push(watermarks::stream_watermark(partition, &stream, &watermark));
        }
        if let Some(through) = self.state.dead_letters.take_unwritten() {
            messages.push(watermarks::dead_letter_mark(
                partition,
                through,
                self.state.log(),
            ));
        }
        Some(CommitPoint {
            offset,
            moved: self.state.committed != Some(offset),
            watermarks: messages,
        })
    }

    /// The transaction committed `offset` for this partition.
    pub fn committed(&mut self, offset: i64) {
        self.state.committed = Some(offset);
    }

    /// The offset to commit: never past an open document (its first offset),
    /// never past what was read.
    fn safe_offset(&self) -> Option<i64> {
        let oldest_open = self
            .open
            .by_stream
            .values()
            .map(|document| document.stats().first_offset)
            .min();
        self.state.safe_offset(oldest_open)
    }

    async fn apply(
        &mut self,
        context: &Context<S>,
        message: &InMessage,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let payload = message.payload.as_deref().unwrap_or_default();
        let incoming = records::read(message.key.as_deref(), &message.headers, payload);
        let decision = decide::decide(
            incoming,
            |stream| self.state.already_reported(stream, message.offset),
            |stream| self.open.first_offset(stream),
        );
        match decision {
            Decision::Released => outbox.released += 1,
            Decision::Skip(Skip::Reported) => {}
            Decision::Skip(Skip::StaleMarker) => {
                tracing::debug!(
                    partition = self.state.partition,
                    offset = message.offset,
                    "stale rollover marker ignored"
                );
            }
            Decision::DeadLetter(reason) => {
                let letter = Letter {
                    index: None,
                    body: payload,
                    reason,
                };
                self.dead_letters(context, message, vec![letter], outbox);
            }
            Decision::Define(stream, definition) => {
                self.state
                    .change_definition(&stream, message.offset, definition);
            }
            Decision::Handover(stream, arrived) => self.handover(&stream, message, arrived),
            Decision::Move(marker) => {
                self.partition_move(context, message, marker, outbox)
                    .await?;
            }
            Decision::Append(stream, texts) => {
                self.append(context, &stream, message, texts, outbox)
                    .await?;
            }
            Decision::WindowMarker(stream, window) => {
                self.window_marker(context, &stream, message, window, outbox)
                    .await?;
            }
            Decision::CutAt(stream, trigger) => {
                let document = match self.open.remove(&stream) {
                    Some(document) => document,
                    // A cut with nothing new: an empty report, keyed by the marker.
                    None => {
                        self.open_document(context, &stream, message.offset, message.timestamp_ms)
                            .await?
                    }
                };
                self.complete(
                    context,
                    document,
                    message.offset,
                    message.timestamp_ms,
                    trigger,
                    outbox,
                )
                .await?;
            }
        }
        Ok(())
    }

    /// A message's records (one, or a batch's), rendered into their stream's
    /// document (opened if none is) and appended together where
    /// [`decide::fit`] and [`decide::rollover`] say: they depend only on the
    /// log's content, so a replay cuts at the same messages, and a document
    /// never ends inside a batch. A document whose marker (age, memory,
    /// drain) is still in flight obeys the same limits; the marker then
    /// names a document that is no longer open and is ignored. Records that
    /// cannot be rendered are dead letters, each named by its place.
    async fn append(
        &mut self,
        context: &Context<S>,
        stream: &StreamName,
        message: &InMessage,
        texts: RecordTexts<'_>,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let mut fields = std::mem::take(&mut self.fields);
        let letters = loop {
            if !self.open.by_stream.contains_key(stream) {
                let document = self
                    .open_document(context, stream, message.offset, message.timestamp_ms)
                    .await?;
                self.open.insert(document);
            }
            let document = self.open.by_stream.get_mut(stream).expect("opened above");
            let (rendered, letters) = render_all(document, texts.clone(), &mut fields);
            // Decided before any await: nothing borrowed from the document
            // is held across one.
            match decide::fit(&document.stats(), rendered, &context.limits) {
                Fit::Append => {
                    context
                        .store
                        .append(
                            document,
                            message.offset,
                            message.timestamp_ms,
                            rendered.records,
                        )
                        .await?;
                    outbox.records += rendered.records;
                    break letters;
                }
                Fit::Nothing { abort } => {
                    if abort && let Some(document) = self.open.remove(stream) {
                        context.store.abort(document).await;
                    }
                    break letters;
                }
                Fit::TooLarge { reason, abort } => {
                    document.discard_rendered();
                    if abort && let Some(document) = self.open.remove(stream) {
                        context.store.abort(document).await;
                    }
                    break every_record_a_letter(&texts, &reason);
                }
                Fit::CutBefore { last_offset } => {
                    document.discard_rendered();
                    let document = self.open.remove(stream).expect("open");
                    self.complete_inline(context, document, last_offset, Trigger::Bytes, outbox)
                        .await?;
                }
            }
        };
        self.fields = fields;
        self.dead_letters(context, message, letters, outbox);
        let rollover = self
            .open
            .by_stream
            .get(stream)
            .and_then(|document| decide::rollover(&document.stats(), &context.limits));
        if let Some(trigger) = rollover {
            let document = self.open.remove(stream).expect("open");
            self.complete_inline(context, document, message.offset, trigger, outbox)
                .await?;
        }
        Ok(())
    }

    /// Ends `document` at its record at `last_offset` (a rollover decided
    /// from the log, no marker): the report's id names that record.
    async fn complete_inline(
        &mut self,
        context: &Context<S>,
        document: S::Document,
        last_offset: i64,
        trigger: Trigger,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let cut_time_ms = document.stats().last_record_time_ms;
        self.complete(context, document, last_offset, cut_time_ms, trigger, outbox)
            .await
    }

    /// Completes `document` as the report ending at `last_offset` (its
    /// marker, or its last record for an inline rollover), queues its event,
    /// and moves the stream's watermark there.
    async fn complete(
        &mut self,
        context: &Context<S>,
        document: S::Document,
        last_offset: i64,
        cut_time_ms: Option<i64>,
        trigger: Trigger,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let stream = document.stream().clone();
        let window = document.window().map(|window| window.window);
        let report_id = context
            .log
            .report_id(stream.clone(), self.state.partition, last_offset);
        let manifest = context
            .store
            .complete(
                document,
                &report_id,
                cut_time_ms,
                trigger,
                &context.log.records.id,
            )
            .await?;
        tracing::info!(report = %report_id, records = manifest.records, bytes = manifest.bytes, trigger = ?trigger, "report completed");
        outbox.messages.push(on_topic(
            &context.topics.report_events,
            events::report_completed(&manifest),
        ));
        outbox.reports.push(trigger);
        let open_first_offset = self.open.first_offset(&stream);
        self.state
            .report_completed(&stream, last_offset, open_first_offset);
        if let Some(window) = window {
            self.state.window_document_completed(&stream, window);
            self.settle_windows(&stream);
        }
        Ok(())
    }

    /// Settles the windows of `stream` that ended by the partition's log time.
    fn settle_windows(&mut self, stream: &StreamName) {
        let open = self.open.window_of(stream);
        self.state.settle_windows(stream, open);
    }

    /// Opens `stream`'s document at `first_offset` with the definition in
    /// force now.
    ///
    /// A windowed stream's document belongs to the window of its first
    /// message's log time (never one before the windows already done or
    /// started), and is its window's next document in sequence. Its key,
    /// under a key template, takes its date and hour from the window's start
    /// in the window's zone, or from the first message's log time in UTC.
    async fn open_document(
        &mut self,
        context: &Context<S>,
        stream: &StreamName,
        first_offset: i64,
        time_ms: Option<i64>,
    ) -> Result<S::Document, WorkerError> {
        let definition = self.state.stream(stream).definition.clone();
        let time_ms = time_ms.unwrap_or_default();
        let Some(spec) = &definition.window else {
            let hour = quire_messages::window::utc_civil_hour(time_ms);
            return Self::open_at(
                context,
                self.state.partition,
                stream,
                first_offset,
                definition,
                hour,
                None,
            )
            .await;
        };
        let (schedule, floor, documents) = match self.state.window_progress(
            stream,
            &definition,
            time_ms,
        ) {
            Some(progress) => {
                let floor = progress.floor_ms();
                let window = progress.schedule.window_of(time_ms.max(floor));
                (
                    Arc::clone(&progress.schedule),
                    floor,
                    progress.documents_in(window),
                )
            }
            // A message from before a definition change, read again by a
            // replay: its own schedule, outside the progress kept.
            None => match spec.schedule() {
                Ok(schedule) => (Arc::new(schedule), i64::MIN, 0),
                Err(error) => {
                    return Err(WorkerError::Config(format!(
                        "stream {stream}: a definition in the log has an invalid window: {error}"
                    )));
                }
            },
        };
        let window = schedule.window_of(time_ms.max(floor));
        let (hour, window) = in_window(&schedule, window, documents);
        Self::open_at(
            context,
            self.state.partition,
            stream,
            first_offset,
            definition,
            hour,
            Some(window),
        )
        .await
    }

    /// The one place a document's key is made and its document opened (no
    /// `&self`: nothing of the pipeline is held across the S3 calls).
    async fn open_at(
        context: &Context<S>,
        partition: i32,
        stream: &StreamName,
        first_offset: i64,
        definition: Definition,
        hour: CivilHour,
        window: Option<DocumentWindow>,
    ) -> Result<S::Document, WorkerError> {
        let key = layout::document_key(
            stream,
            partition,
            first_offset,
            &definition,
            hour,
            context.log.tag.as_ref(),
        );
        context
            .store
            .open(DocumentSpec {
                stream: stream.clone(),
                partition,
                first_offset,
                definition,
                key,
                window,
            })
            .await
    }

    /// Completes, at their last record, the windowed documents of the
    /// partition whose window ended by the partition's log time (see
    /// [`decide::window_closed`]). Decided from the log alone, so every
    /// replay cuts at the same record.
    async fn close_ended_windows(
        &mut self,
        context: &Context<S>,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        let Some(now) = self.state.time_ms else {
            return Ok(());
        };
        while let Some(document) = self.open.pop_ended(now) {
            // A document without records (none stays open: a dead letter
            // aborts the document opened for it) would end where it began.
            let stats = document.stats();
            let last = stats.last_record_offset.unwrap_or(stats.first_offset);
            self.complete_inline(context, document, last, Trigger::Window, outbox)
                .await?;
        }
        Ok(())
    }

    /// A marker closing `window` of `stream` (see [`decide::window_marker`]):
    /// a window without documents gets its empty report here, keyed by the
    /// marker.
    async fn window_marker(
        &mut self,
        context: &Context<S>,
        stream: &StreamName,
        message: &InMessage,
        window: Window,
        outbox: &mut Outbox,
    ) -> Result<(), WorkerError> {
        self.settle_windows(stream);
        let time_ms = message.timestamp_ms.unwrap_or_default();
        let progress = self.state.stream(stream).window.as_mut();
        let progress = progress.map(|progress| {
            // Read back: this worker may publish it again if it is needed.
            progress.requested.remove(&window.start_ms);
            &*progress
        });
        match decide::window_marker(progress, window, time_ms) {
            WindowMarker::EmptyReport => {}
            WindowMarker::Ignore(IgnoredMarker::Done) => return Ok(()),
            WindowMarker::Ignore(IgnoredMarker::Early) => {
                tracing::warn!(
                    %stream,
                    offset = message.offset,
                    window_end_ms = window.end_ms,
                    log_time_ms = time_ms,
                    "window marker landed before its window ended by log time; ignored (another is published later)"
                );
                return Ok(());
            }
            WindowMarker::Ignore(ignored) => {
                tracing::debug!(%stream, offset = message.offset, ?ignored, "window marker ignored");
                return Ok(());
            }
        }
        let state = self.state.stream(stream);
        let progress = state.window.as_ref().expect("decided on its progress");
        let (hour, in_window) =
            in_window(&progress.schedule, window, progress.documents_in(window));
        let definition = state.definition.clone();
        let document = Self::open_at(
            context,
            self.state.partition,
            stream,
            message.offset,
            definition,
            hour,
            Some(in_window),
        )
        .await?;
        self.complete(
            context,
            document,
            message.offset,
            message.timestamp_ms,
            Trigger::Window,
            outbox,
        )
        .await
    }

    /// Publishes, in this array's transaction, the dead letters of a message
    /// (the message itself, or records of it that cannot be rendered),
    /// unless an earlier read of the partition published them already (the
    /// partition's dead-letter mark covers the message): one dead letter per
    /// (partition, offset, place in the batch), whatever the restarts. A
    /// message's letters all go in one array.
    fn dead_letters(
        &mut self,
        context: &Context<S>,
        message: &InMessage,
        letters: Vec<Letter<'_>>,
        outbox: &mut Outbox,
    ) {
        if letters.is_empty() {
            return;
        }
        if self.state.dead_letters.covers(message.offset) {
            tracing::debug!(
                partition = message.partition,
                offset = message.offset,
                "dead letter already published by an earlier read; not again"
            );
            return;
        }
        for letter in letters {
            tracing::warn!(
                partition = message.partition,
                offset = message.offset,
                index = letter.index,
                reason = letter.reason,
                "record sent to the dead-letter topic"
            );
            let published = events::dead_letter(
                message.partition,
                message.offset,
                letter.index,
                message.key.as_deref(),
                &letter.reason,
                letter.body,
            );
            outbox
                .messages
                .push(on_topic(&context.topics.dead_letters, published));
            outbox.dead_letters += 1;
        }
        self.state.dead_letters.published(message.offset);
    }
}

/// A document of `window` under `schedule` that follows `documents` of it:
/// the hour its key is dated by (the window's start in its zone) and its
/// place in the window.
fn in_window(schedule: &Schedule, window: Window, documents: u32) -> (CivilHour, DocumentWindow) {
    let hour = schedule.civil_hour(window.start_ms);
    let window = DocumentWindow {
        window,
        sequence: documents + 1,
        start: schedule.format(window.start_ms),
        end: schedule.format(window.end_ms),
    };
    (hour, window)
}

//! What the worker knows about one assigned record partition.

mod window;

use std::collections::HashMap;
use std::sync::Arc;

use quire_messages::window::Window;
use quire_messages::{
    CURRENT_VERSION, Definition, PartitionMoved, StreamName, Watermark, WindowAfterChange,
    WindowProgress,
};

pub use window::StreamWindow;

/// One stream's state on its partition.
#[derive(Debug, Clone, Default)]
pub struct StreamState {
    /// The last offset (marker included) in a completed report: replays skip
    /// the stream's records and markers at or below it.
    pub watermark: Option<i64>,
    /// The definition in force at the last message read.
    pub definition: Definition,
    /// The definition last persisted with the watermark (in force at the
    /// partition's committed offset).
    persisted_definition: Option<Definition>,
    /// Definition changes read but not yet behind the committed offset.
    unpersisted_changes: Vec<UnpersistedChange>,
    /// Loaded from the watermark: the window progress an earlier worker had
    /// after each definition change past its committed offset, taken when
    /// this one reads the change again.
    progress_after_changes: Vec<WindowAfterChange>,
    /// The watermark moved since it was last written.
    watermark_moved: bool,
    /// A windowed stream's progress through its windows.
    pub window: Option<StreamWindow>,
}

/// A definition change read but not yet behind the committed offset.
#[derive(Debug, Clone)]
struct UnpersistedChange {
    offset: i64,
    definition: Definition,
    /// The stream's window progress just before the change (which may
    /// reset it): what a watermark written at a commit before the change
    /// persists, since a replay from there reads the change again.
    window_before: Option<WindowProgress>,
}

/// What a partition's pipeline (`pipeline.rs`) knows of its streams and how
/// far it is read; the pipeline holds the open documents and tells this the
/// facts of them it needs (an open document's first offset, its window).
pub struct PartitionState {
    pub partition: i32,
    pub streams: HashMap<StreamName, StreamState>,
    /// The offset after the last message read (processed) on this partition.
    pub next_to_read: Option<i64>,
    /// The offset last committed for this partition by this worker.
    pub committed: Option<i64>,
    /// The latest log time read on this partition (ms): windows that ended
    /// by then are closed.
    pub time_ms: Option<i64>,
    /// The Kafka topic id of the records log, written into every watermark.
    log: Arc<str>,
    /// A move marker processed and not yet recorded on the watermark topic.
    moved: Option<PartitionMoved>,
    /// The partition's dead-letter mark: see [`DeadLetterMark`].
    pub dead_letters: DeadLetterMark,
}

/// The highest offset of a partition whose dead letter is published, so a
/// replay (a restart, a rebalance: anything that reads a message again from
/// the committed offset, which stays at an open document) publishes none
/// twice. It is the partition's, not a stream's: messages without a valid
/// stream have dead letters too.
///
/// One mark per partition is enough because a partition is read in order
/// from its committed offset, and every message read in an array has its
/// dead letter in that array's transaction, which also writes the mark
/// (key `quire:dead-letters` on the watermark partition): once a transaction
/// with mark M commits, every message at or below M that needs a dead letter
/// has one, committed by it or an earlier transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeadLetterMark {
    /// Published: committed, or in the transaction under way.
    through: Option<i64>,
    /// Last written to the watermark partition.
    persisted: Option<i64>,
}

impl DeadLetterMark {
    /// The mark a new owner loaded from the watermark partition.
    pub fn loaded(through: Option<i64>) -> Self {
        DeadLetterMark {
            through,
            persisted: through,
        }
    }

    /// Whether the message at `offset` had its dead letter published already.
    pub fn covers(&self, offset: i64) -> bool {
        self.through.is_some_and(|through| offset <= through)
    }

    /// The message at `offset` is dead-lettered in the array under way.
    pub fn published(&mut self, offset: i64) {
        self.through = Some(self.through.map_or(offset, |through| through.max(offset)));
    }

    /// The mark to write in the next transaction, if it moved since it was
    /// last written; marks it written (the caller commits it, or the session
    /// ends and the next one loads what was committed).
    pub fn take_unwritten(&mut self) -> Option<i64> {
        if self.through == self.persisted {
            return None;
        }
        self.persisted = self.through;
        self.through
    }
}

impl PartitionState {
    /// The state a new owner starts from: the partition's watermarks (of the
    /// records log `log`, the Kafka topic id every watermark written is
    /// stamped with).
    pub fn from_watermarks(
        partition: i32,
        watermarks: HashMap<StreamName, Watermark>,
        log: Arc<str>,
    ) -> Self {
        let streams = watermarks
            .into_iter()
            .map(|(stream, watermark)| {
                let definition = watermark.definition.clone().unwrap_or_default();
                (
                    stream,
                    StreamState {
                        watermark: watermark.offset,
                        definition,
                        persisted_definition: watermark.definition,
                        unpersisted_changes: Vec::new(),
                        progress_after_changes: watermark.window_after_changes,
                        watermark_moved: false,
                        window: watermark.window.and_then(StreamWindow::restored),
                    },
                )
            })
            .collect();
        PartitionState {
            partition,
            streams,
            next_to_read: None,
            committed: None,
            time_ms: None,
            log,
            moved: None,
            dead_letters: DeadLetterMark::default(),
        }
    }

    /// `stream` left this partition at the move marker at `offset` (its
    /// document, if one was open, is completed there): nothing of it up to
    /// the marker is read again, and its windows are its new partition's.
    pub fn moved_away(&mut self, stream: &StreamName, offset: i64) {
        self.report_completed(stream, offset, None);
        let state = self.stream(stream);
        state.window = None;
        state.watermark_moved = true;
    }

    /// `stream` arrived on this partition with the handover at `offset`:
    /// its window progress continues from `window`, and a replay passes
    /// the handover by (a document of it open here from an earlier layout,
    /// opened at `open_first_offset`, keeps the watermark below it).
    pub fn arrived(
        &mut self,
        stream: &StreamName,
        offset: i64,
        window: Option<WindowProgress>,
        open_first_offset: Option<i64>,
    ) {
        self.report_completed(stream, offset, open_first_offset);
        let state = self.stream(stream);
        state.window = window.and_then(StreamWindow::restored);
        state.watermark_moved = true;
    }

    /// The move marker processed, to record with the next commit.
    pub fn record_moved(&mut self, moved: PartitionMoved) {
        self.moved = Some(moved);
    }

    /// The move marker to record now, once.
    pub fn take_moved(&mut self) -> Option<PartitionMoved> {
        self.moved.take()
    }

    /// The Kafka topic id of the records log this partition is of.
    pub fn log(&self) -> &str {
        &self.log
    }

    /// With the dead-letter mark loaded from the watermark partition.
    pub fn with_dead_letters_through(mut self, through: Option<i64>) -> Self {
        self.dead_letters = DeadLetterMark::loaded(through);
        self
    }

    /// Notes the log time of a message read.
    pub fn observe_time(&mut self, time_ms: Option<i64>) {
        if let Some(time_ms) = time_ms {
            self.time_ms = Some(self.time_ms.map_or(time_ms, |seen| seen.max(time_ms)));
        }
    }

    /// The stream's window progress under `definition`, started at the
    /// window of `time_ms` if the stream has none yet. `None` for an
    /// unwindowed definition, or one whose schedule differs from the
    /// progress kept (a replay reading messages from before a definition
    /// change: the change itself resets the progress).
    pub fn window_progress(
        &mut self,
        stream: &StreamName,
        definition: &Definition,
        time_ms: i64,
    ) -> Option<&mut StreamWindow> {
        let spec = definition.window.as_ref()?;
        let state = self.stream(stream);
        if state.window.is_none() {
            let schedule = spec.schedule().ok()?;
            state.window = StreamWindow::starting_at(spec, schedule.window_of(time_ms));
            state.watermark_moved = true;
        }
        state
            .window
            .as_mut()
            .filter(|window| window.progress.spec == *spec)
    }

    /// A windowed document of `stream` for `window` was completed.
    pub fn window_document_completed(&mut self, stream: &StreamName, window: Window) {
        let state = self.stream(stream);
        if let Some(progress) = &mut state.window {
            progress.document_completed(window);
            state.watermark_moved = true;
        }
    }

    /// Settles the windows of `stream` that ended by the partition's log
    /// time (see [`StreamWindow::settle`]); `open` is the window of the
    /// stream's open document.
    pub fn settle_windows(&mut self, stream: &StreamName, open: Option<Window>) {
        let Some(time_ms) = self.time_ms else {
            return;
        };
        let state = self.stream(stream);
        if let Some(progress) = &mut state.window
            && progress.settle(time_ms, open)
        {
            state.watermark_moved = true;
        }
    }

    pub fn stream(&mut self, stream: &StreamName) -> &mut StreamState {
        self.streams.entry(stream.clone()).or_default()
    }

    /// Whether a record or marker at `offset` is already in a completed report.
    pub fn already_reported(&self, stream: &StreamName, offset: i64) -> bool {
        self.streams
            .get(stream)
            .and_then(|state| state.watermark)
            .is_some_and(|watermark| offset <= watermark)
    }

    pub fn change_definition(&mut self, stream: &StreamName, offset: i64, definition: Definition) {
        let state = self.stream(stream);
        let same_schedule = match (&state.window, &definition.window) {
            (Some(window), Some(spec)) => window.progress.spec == *spec,
            (None, _) => true,
            (Some(_), None) => false,
        };
        let window_before = state.window.as_ref().map(|window| window.progress.clone());
        let read_before = state
            .progress_after_changes
            .iter()
            .position(|after| after.offset == offset);
        if let Some(position) = read_before {
            // Read again by a replay: the progress the first read left,
            // with the documents completed since (whose messages are
            // skipped now).
            let after = state.progress_after_changes.remove(position);
            state
                .progress_after_changes
                .retain(|later| later.offset > offset);
            state.window = after.window.and_then(StreamWindow::restored);
            state.watermark_moved = true;
        } else if !same_schedule {
            // Another schedule starts afresh at its first message; windows
            // of the old one not reported yet are not reported.
            state.window = None;
            state.watermark_moved = true;
        }
        state.definition = definition.clone();
        state.unpersisted_changes.push(UnpersistedChange {
            offset,
            definition,
            window_before,
        });
    }

    /// A report of `stream` ending at `marker_offset` was completed. The
    /// watermark never passes the stream's open document: an empty window's
    /// report may be keyed by a marker that landed after a later window's
    /// document opened (the window's progress keeps that report from being
    /// made twice). `open_first_offset`: the first offset of the stream's
    /// open document.
    pub fn report_completed(
        &mut self,
        stream: &StreamName,
        marker_offset: i64,
        open_first_offset: Option<i64>,
    ) {
        let open_before = open_first_offset.is_some_and(|first| first <= marker_offset);
        let state = self.stream(stream);
        if !open_before {
            state.watermark = Some(
                state
                    .watermark
                    .map_or(marker_offset, |mark| mark.max(marker_offset)),
            );
        }
        state.watermark_moved = true;
    }

    pub fn mark_read(&mut self, offset: i64) {
        self.next_to_read = Some(
            self.next_to_read
                .map_or(offset + 1, |next| next.max(offset + 1)),
        );
    }

    /// The offset to commit: never past an open document (`oldest_open`,
    /// the first offset of the oldest), never past what was read. None when
    /// nothing was read yet.
    pub fn safe_offset(&self, oldest_open: Option<i64>) -> Option<i64> {
        match (oldest_open, self.next_to_read) {
            (Some(open), Some(read)) => Some(open.min(read)),
            (Some(open), None) => Some(open),
            (None, read) => read,
        }
    }

    /// The watermark records to write in the transaction that commits
    /// `committed_offset`: streams whose watermark moved, and streams whose
    /// definition in force at that offset differs from the persisted one.
    /// Marks them persisted (the caller commits them, or the worker stops).
    pub fn watermarks_to_write(&mut self, committed_offset: i64) -> Vec<(StreamName, Watermark)> {
        let partition = self.partition;
        let mut records = Vec::new();
        for (stream, state) in &mut self.streams {
            let mut in_force_at_commit = state.persisted_definition.clone();
            let unpersisted = state.unpersisted_changes.len();
            state.unpersisted_changes.retain(|change| {
                if change.offset < committed_offset {
                    in_force_at_commit = Some(change.definition.clone());
                    false
                } else {
                    true
                }
            });
            // The progress at the committed offset is the one before the
            // first change past it; a replay from there reads each change
            // again and takes the progress after it.
            let latest = state.window.as_ref().map(|window| window.progress.clone());
            let window = match state.unpersisted_changes.first() {
                Some(change) => change.window_before.clone(),
                None => latest.clone(),
            };
            // Changes past what this worker read keep what the worker that
            // read them left.
            let window_after_changes = state
                .unpersisted_changes
                .iter()
                .enumerate()
                .map(|(index, change)| WindowAfterChange {
                    offset: change.offset,
                    window: match state.unpersisted_changes.get(index + 1) {
                        Some(next) => next.window_before.clone(),
                        None => latest.clone(),
                    },
                })
                .chain(state.progress_after_changes.iter().cloned())
                .collect();
            let definition_changed = in_force_at_commit != state.persisted_definition;
            // A change now behind the commit: the watermark last written may
            // hold the progress from before it (and after it, for a replay
            // that no longer reads it), even when the definition is the same.
            let change_passed = state.unpersisted_changes.len() < unpersisted;
            if !(state.watermark_moved || definition_changed || change_passed) {
                continue;
            }
            state.watermark_moved = false;
            state.persisted_definition = in_force_at_commit.clone();
            records.push((
                stream.clone(),
                Watermark {
                    v: CURRENT_VERSION,
                    partition,
                    offset: state.watermark,
                    definition: in_force_at_commit,
                    window,
                    window_after_changes,
                    log: Some(self.log.to_string()),
                    dead_letters_through: None,
                },
            ));
        }
        records.sort_by(|a, b| a.0.cmp(&b.0));
        records
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(name: &str) -> StreamName {
        StreamName::new(name).unwrap()
    }

    #[test]
    fn the_safe_offset_never_passes_what_was_read() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        assert_eq!(state.safe_offset(None), None);
        state.mark_read(9);
        assert_eq!(state.safe_offset(None), Some(10));
    }

    #[test]
    fn a_definition_is_persisted_only_once_the_commit_passes_it() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        let renamed = Definition {
            root: "orders".into(),
            ..Definition::default()
        };
        state.change_definition(&orders, 5, renamed.clone());
        assert!(
            state.watermarks_to_write(5).is_empty(),
            "offset 5 is not behind a commit at 5"
        );
        let written = state.watermarks_to_write(6);
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].1.definition, Some(renamed));
        assert!(state.watermarks_to_write(7).is_empty(), "written once");
    }

    fn windowed(skip_empty: bool) -> Definition {
        Definition {
            window: Some(quire_messages::window::WindowSpec {
                every: "10s".into(),
                time_zone: "UTC".into(),
                grace: "1s".into(),
                skip_empty,
            }),
            ..Definition::default()
        }
    }

    fn window(start_s: i64) -> Window {
        Window {
            start_ms: start_s * 1000,
            end_ms: (start_s + 10) * 1000,
        }
    }

    #[test]
    fn a_window_is_done_once_its_documents_are_and_an_empty_one_waits_for_its_marker() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        let definition = windowed(false);
        // The first message, at 5 s: windows start at [0, 10).
        let progress = state.window_progress(&orders, &definition, 5_000).unwrap();
        assert_eq!(progress.progress.next_ms, 0);
        state.window_document_completed(&orders, window(0));
        state.observe_time(Some(12_000));
        state.settle_windows(&orders, None);
        let progress = state.stream(&orders).window.clone().unwrap();
        assert_eq!(
            progress.progress.next_ms, 10_000,
            "[0, 10) had a document: done"
        );
        // [10, 20) has nothing; a document of [20, 30) completes first.
        state.window_document_completed(&orders, window(20));
        state.observe_time(Some(31_000));
        state.settle_windows(&orders, None);
        let progress = state.stream(&orders).window.clone().unwrap();
        assert_eq!(
            progress.progress.next_ms, 10_000,
            "the empty window waits for its marker"
        );
        assert!(!progress.reported(window(10)));
        assert!(progress.reported(window(20)) && progress.reported(window(0)));
        // Its marker's empty report: then both are done.
        state.window_document_completed(&orders, window(10));
        state.settle_windows(&orders, None);
        let progress = state.stream(&orders).window.clone().unwrap();
        assert_eq!(progress.progress.next_ms, 30_000);
        assert!(progress.progress.started.is_empty());
        // Persisted with the watermark, and restored from it.
        let written = state.watermarks_to_write(0);
        let restored = PartitionState::from_watermarks(
            0,
            HashMap::from([(orders.clone(), written[0].1.clone())]),
            Arc::from("log"),
        );
        assert_eq!(
            restored.streams[&orders].window.as_ref().unwrap().progress,
            progress.progress
        );
    }

    #[test]
    fn a_commit_before_a_change_of_schedule_persists_the_progress_the_change_reset() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        state
            .window_progress(&orders, &windowed(false), 5_000)
            .unwrap();
        state.window_document_completed(&orders, window(0));
        let before = state.stream(&orders).window.clone().unwrap().progress;
        state.change_definition(&orders, 20, Definition::default());
        assert!(state.stream(&orders).window.is_none(), "reset when read");
        // Committed at 15 (an open document holds it back): a replay from
        // 15 reads the change again, so the progress before it is kept.
        let written = state.watermarks_to_write(15);
        assert_eq!(written[0].1.window.as_ref(), Some(&before));
        assert_eq!(
            written[0].1.definition, None,
            "the change is not in force at 15"
        );
        assert_eq!(
            written[0].1.window_after_changes,
            [WindowAfterChange {
                offset: 20,
                window: None
            }]
        );
        // The replay reads the change again and takes what followed it.
        let mut replay = PartitionState::from_watermarks(
            0,
            HashMap::from([(orders.clone(), written[0].1.clone())]),
            Arc::from("log"),
        );
        assert_eq!(
            replay
                .stream(&orders)
                .window
                .as_ref()
                .map(|window| &window.progress),
            Some(&before),
            "messages before the change see the progress before it"
        );
        replay.change_definition(&orders, 20, Definition::default());
        assert!(replay.stream(&orders).window.is_none());
        // Once the commit passes the change, the reset is persisted.
        let written = state.watermarks_to_write(21);
        assert_eq!(written[0].1.window, None);
        assert_eq!(written[0].1.definition, Some(Definition::default()));
        assert!(written[0].1.window_after_changes.is_empty());
    }

    #[test]
    fn skip_empty_passes_quiet_windows_without_markers() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        state
            .window_progress(&orders, &windowed(true), 5_000)
            .unwrap();
        state.observe_time(Some(95_000));
        state.settle_windows(&orders, None);
        let progress = state.stream(&orders).window.clone().unwrap();
        assert_eq!(progress.progress.next_ms, 90_000);
    }

    #[test]
    fn another_schedule_starts_afresh() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        state
            .window_progress(&orders, &windowed(false), 5_000)
            .unwrap();
        state.change_definition(&orders, 7, windowed(false));
        assert!(
            state.stream(&orders).window.is_some(),
            "same schedule: kept"
        );
        state.change_definition(&orders, 8, windowed(true));
        assert!(
            state.stream(&orders).window.is_none(),
            "another schedule: reset"
        );
        state
            .window_progress(&orders, &windowed(true), 50_000)
            .unwrap();
        assert!(
            state
                .window_progress(&orders, &windowed(false), 60_000)
                .is_none(),
            "a message read again from before the change does not take the new progress"
        );
        assert_eq!(
            state
                .stream(&orders)
                .window
                .as_ref()
                .unwrap()
                .progress
                .next_ms,
            50_000
        );
    }

    #[test]
    fn a_dead_letter_mark_is_written_once_per_move_and_covers_what_it_passed() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        assert!(!state.dead_letters.covers(0));
        assert_eq!(
            state.dead_letters.take_unwritten(),
            None,
            "nothing dead-lettered"
        );
        state.dead_letters.published(7);
        state.dead_letters.published(4);
        assert!(state.dead_letters.covers(7) && state.dead_letters.covers(3));
        assert!(!state.dead_letters.covers(8));
        assert_eq!(state.dead_letters.take_unwritten(), Some(7));
        assert_eq!(state.dead_letters.take_unwritten(), None, "written once");
        // A new owner starts from what was committed.
        let mut restored = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"))
            .with_dead_letters_through(Some(7));
        assert!(restored.dead_letters.covers(7));
        assert_eq!(
            restored.dead_letters.take_unwritten(),
            None,
            "loaded is written"
        );
    }

    #[test]
    fn a_completed_report_moves_the_watermark_and_skips_replays() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        state.report_completed(&orders, 41, None);
        assert!(state.already_reported(&orders, 41));
        assert!(!state.already_reported(&orders, 42));
        assert!(!state.already_reported(&stream("other"), 1));
        let written = state.watermarks_to_write(42);
        assert_eq!(written[0].1.offset, Some(41));
        assert_eq!(
            written[0].1.log.as_deref(),
            Some("log"),
            "stamped with its log"
        );
    }

    #[test]
    fn a_stream_moved_away_is_skipped_up_to_its_marker_and_one_that_arrived_keeps_its_windows() {
        let mut old = PartitionState::from_watermarks(3, HashMap::new(), Arc::from("log"));
        let orders = stream("orders");
        old.window_progress(&orders, &windowed(false), 5_000)
            .unwrap();
        old.window_document_completed(&orders, window(0));
        let progress = old.stream(&orders).window.clone().unwrap().progress;
        old.moved_away(&orders, 50);
        assert!(old.already_reported(&orders, 50) && !old.already_reported(&orders, 51));
        assert!(
            old.stream(&orders).window.is_none(),
            "its windows go with it"
        );
        let mut new = PartitionState::from_watermarks(13, HashMap::new(), Arc::from("log"));
        new.change_definition(&orders, 7, windowed(false));
        new.arrived(&orders, 7, Some(progress.clone()), None);
        assert!(
            new.already_reported(&orders, 7),
            "a replay applies the handover once"
        );
        let arrived = new.stream(&orders).window.clone().unwrap();
        assert_eq!(arrived.progress, progress);
        assert_eq!(
            arrived.documents_in(window(0)),
            1,
            "the window's next document is its second"
        );
    }
}

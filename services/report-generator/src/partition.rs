//! What the worker knows about one assigned record partition.

use std::collections::{BTreeMap, HashMap};

use quire_messages::{CURRENT_VERSION, Definition, StreamName, Watermark};

use crate::document::OpenDocument;

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
    unpersisted_changes: Vec<(i64, Definition)>,
    /// The watermark moved since it was last written.
    watermark_moved: bool,
}

/// An assigned partition: its streams, its open documents, how far it is read.
pub struct PartitionState {
    pub partition: i32,
    pub streams: HashMap<StreamName, StreamState>,
    pub open: BTreeMap<StreamName, OpenDocument>,
    /// The offset after the last message read (processed) on this partition.
    pub next_to_read: Option<i64>,
    /// The offset last committed for this partition by this worker.
    pub committed: Option<i64>,
}

impl PartitionState {
    /// The state a new owner starts from: the partition's watermarks.
    pub fn from_watermarks(partition: i32, watermarks: HashMap<StreamName, Watermark>) -> Self {
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
                        watermark_moved: false,
                    },
                )
            })
            .collect();
        PartitionState {
            partition,
            streams,
            open: BTreeMap::new(),
            next_to_read: None,
            committed: None,
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
        state.definition = definition.clone();
        state.unpersisted_changes.push((offset, definition));
    }

    pub fn report_completed(&mut self, stream: &StreamName, marker_offset: i64) {
        let state = self.stream(stream);
        state.watermark = Some(marker_offset);
        state.watermark_moved = true;
    }

    pub fn mark_read(&mut self, offset: i64) {
        self.next_to_read = Some(
            self.next_to_read
                .map_or(offset + 1, |next| next.max(offset + 1)),
        );
    }

    /// The offset to commit: never past an open document (its first offset),
    /// never past what was read. None when nothing was read yet.
    pub fn safe_offset(&self) -> Option<i64> {
        let oldest_open = self
            .open
            .values()
            .map(|document| document.first_offset)
            .min();
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
            state.unpersisted_changes.retain(|(offset, definition)| {
                if *offset < committed_offset {
                    in_force_at_commit = Some(definition.clone());
                    false
                } else {
                    true
                }
            });
            let definition_changed = in_force_at_commit != state.persisted_definition;
            if !(state.watermark_moved || definition_changed) {
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
        let mut state = PartitionState::from_watermarks(0, HashMap::new());
        assert_eq!(state.safe_offset(), None);
        state.mark_read(9);
        assert_eq!(state.safe_offset(), Some(10));
    }

    #[test]
    fn a_definition_is_persisted_only_once_the_commit_passes_it() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new());
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

    #[test]
    fn a_completed_report_moves_the_watermark_and_skips_replays() {
        let mut state = PartitionState::from_watermarks(0, HashMap::new());
        let orders = stream("orders");
        state.report_completed(&orders, 41);
        assert!(state.already_reported(&orders, 41));
        assert!(!state.already_reported(&orders, 42));
        assert!(!state.already_reported(&stream("other"), 1));
        let written = state.watermarks_to_write(42);
        assert_eq!(written[0].1.offset, Some(41));
    }
}

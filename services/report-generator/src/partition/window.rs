//! A windowed stream's place in its schedule, as its partition's state
//! keeps it (see `PartitionState::window_progress`).

use std::collections::BTreeSet;
use std::sync::Arc;

use quire_messages::window::{Schedule, Window};
use quire_messages::{StartedWindow, WindowProgress};

/// Where a windowed stream is in its schedule.
#[derive(Debug, Clone)]
pub struct StreamWindow {
    pub schedule: Arc<Schedule>,
    /// Persisted with the watermark.
    pub progress: WindowProgress,
    /// Windows (by start) whose marker this worker published and has not
    /// read back yet: published once each.
    pub requested: BTreeSet<i64>,
}

impl StreamWindow {
    /// Progress that starts at `first`, the window of the stream's first
    /// windowed message; earlier windows are not reported.
    pub(super) fn starting_at(
        spec: &quire_messages::window::WindowSpec,
        first: Window,
    ) -> Option<Self> {
        let schedule = spec.schedule().ok()?;
        Some(StreamWindow {
            schedule: Arc::new(schedule),
            progress: WindowProgress {
                spec: spec.clone(),
                next_ms: first.start_ms,
                started: Vec::new(),
            },
            requested: BTreeSet::new(),
        })
    }

    pub(super) fn restored(progress: WindowProgress) -> Option<Self> {
        let schedule = progress.spec.schedule().ok()?;
        Some(StreamWindow {
            schedule: Arc::new(schedule),
            progress,
            requested: BTreeSet::new(),
        })
    }

    /// Documents of `window` completed so far.
    pub fn documents_in(&self, window: Window) -> u32 {
        self.progress
            .started
            .iter()
            .find(|started| started.start_ms == window.start_ms)
            .map_or(0, |started| started.documents)
    }

    /// The earliest window a new document may belong to: log times that
    /// went backwards (a leader whose clock is behind) never reopen a
    /// window already done or passed.
    pub fn floor_ms(&self) -> i64 {
        self.progress
            .started
            .iter()
            .map(|started| started.start_ms)
            .max()
            .unwrap_or(self.progress.next_ms)
            .max(self.progress.next_ms)
    }

    /// Whether `window` is done or already has documents: a marker naming
    /// it reports nothing.
    pub fn reported(&self, window: Window) -> bool {
        window.start_ms < self.progress.next_ms || self.documents_in(window) > 0
    }

    pub(super) fn document_completed(&mut self, window: Window) {
        if window.start_ms < self.progress.next_ms {
            return;
        }
        match self
            .progress
            .started
            .iter_mut()
            .find(|started| started.start_ms == window.start_ms)
        {
            Some(started) => started.documents += 1,
            None => {
                self.progress.started.push(StartedWindow {
                    start_ms: window.start_ms,
                    end_ms: window.end_ms,
                    documents: 1,
                });
                self.progress
                    .started
                    .sort_by_key(|started| started.start_ms);
            }
        }
    }

    /// Marks done every window that ended by log time `time_ms` and needs
    /// nothing more: those with documents, and (under `skip_empty`) those
    /// without. A window without documents otherwise waits for its marker
    /// (its empty report), and so do the windows after it. `open` is the
    /// stream's open document's window, never done here (it is completed
    /// first). Returns whether anything changed.
    pub(super) fn settle(&mut self, time_ms: i64, open: Option<Window>) -> bool {
        let before = self.progress.next_ms;
        if self.schedule.skip_empty() {
            let current = self.schedule.window_of(time_ms).start_ms;
            let bound = open.map_or(current, |window| window.start_ms.min(current));
            if bound > self.progress.next_ms {
                self.progress.next_ms = bound;
            }
        } else {
            loop {
                let window = self.schedule.window_of(self.progress.next_ms);
                if window.end_ms > time_ms || open == Some(window) || self.documents_in(window) == 0
                {
                    break;
                }
                self.progress.next_ms = window.end_ms;
            }
        }
        let next = self.progress.next_ms;
        self.progress
            .started
            .retain(|started| started.start_ms >= next);
        self.progress.next_ms != before
    }
}

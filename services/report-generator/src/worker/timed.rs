//! The decisions the clock and the process make, not the log: the age
//! rollover, the memory budget, the bound on gzip compressors and the
//! markers of windows nothing closed. Each is published as a marker in the
//! array's transaction and cuts where it lands in the log, like any other
//! cut (ARCHITECTURE.md, "every cut is decided by the log").

use quire_messages::window::Window;
use quire_messages::{CutMarker, StreamName, Trigger, records};

use super::Worker;
use super::outbox::{Outbox, on_topic};
use crate::document::OpenDocument;
use crate::partition::StreamWindow;

/// The most window markers one array's transaction publishes: a stream idle
/// for many windows gets its empty reports over several arrays.
const WINDOW_MARKERS_PER_ARRAY: usize = 200;

/// The worker's clock, in ms since the epoch: only for deciding when to
/// publish a window's marker, never written into a report.
fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

impl Worker {
    /// Age rollover (on a timer: every array, even an empty one) and the
    /// memory budget for all open documents together. The budget itself is
    /// kept by the writers' pool (buffers grow within it and spill past
    /// it); these cuts bound what is held, memory and spill together, so the
    /// spill drains once the markers land. Gzip documents past
    /// `worker.max_gzip_documents` are cut the same way.
    pub(super) fn decide_timed_rollovers(&mut self, outbox: &mut Outbox) {
        let settings = &self.settings;
        let topics = &self.context.topics;
        // Compressors past worker.max_gzip_documents (they cannot spill).
        let open = self
            .partitions
            .values()
            .flat_map(|pipeline| pipeline.documents());
        for (partition, stream) in
            crate::document::compressed_documents_to_cut(open, settings.max_gzip_documents.get())
        {
            if let Some(document) = self
                .partitions
                .get_mut(&partition)
                .and_then(|pipeline| pipeline.document_mut(&stream))
            {
                tracing::info!(partition, %stream, max_gzip_documents = settings.max_gzip_documents, "compressed documents past their bound: cutting");
                request_cut(&topics.records, document, Trigger::Memory, outbox);
            }
        }
        let max_age = settings.rollover_age;
        let mut buffered: Vec<(u64, (i32, StreamName))> = Vec::new();
        let mut total: u64 = 0;
        for pipeline in self.partitions.values_mut() {
            for document in pipeline.documents_mut() {
                if document.opened_at.elapsed() >= max_age {
                    request_cut(&topics.records, document, Trigger::Age, outbox);
                }
                let bytes = document.buffered_bytes();
                total += bytes;
                if document.cut_requested.is_none() {
                    buffered.push((bytes, (document.partition, document.stream.clone())));
                }
            }
        }
        for (bytes, (partition, stream)) in
            memory_cuts(buffered, total, settings.memory_budget_bytes)
        {
            if let Some(document) = self
                .partitions
                .get_mut(&partition)
                .and_then(|pipeline| pipeline.document_mut(&stream))
            {
                tracing::info!(partition, %stream, bytes, "memory budget reached: cutting");
                request_cut(&topics.records, document, Trigger::Memory, outbox);
            }
        }
    }

    /// Publishes the markers of windows that a worker's clock says ended
    /// more than their grace ago and that no message of the log closed (see
    /// [`due_windows`]). Each marker once, until read back; at most
    /// [`WINDOW_MARKERS_PER_ARRAY`] in one transaction.
    pub(super) fn publish_window_markers(&mut self, outbox: &mut Outbox) {
        let now = wall_clock_ms();
        let topics = &self.context.topics;
        let mut budget = WINDOW_MARKERS_PER_ARRAY;
        for pipeline in self.partitions.values_mut() {
            let partition = pipeline.partition();
            for (stream, progress, open) in pipeline.windows() {
                for window in due_windows(progress, open, now) {
                    if budget == 0 {
                        return;
                    }
                    if !progress.requested.insert(window.start_ms) {
                        continue;
                    }
                    budget -= 1;
                    outbox.window_markers += 1;
                    let marker = records::cut(stream, &CutMarker::window(window));
                    outbox
                        .messages
                        .push(on_topic(&topics.records, marker).to_partition(partition));
                }
            }
        }
    }

    /// Drain mode, caught up: cut every open document.
    pub(super) fn cut_everything_open(&mut self, outbox: &mut Outbox) {
        let topics = &self.context.topics;
        for pipeline in self.partitions.values_mut() {
            for document in pipeline.documents_mut() {
                request_cut(&topics.records, document, Trigger::Drain, outbox);
            }
        }
    }
}

/// Which documents the memory budget cuts, from each one's buffered bytes
/// and the `total` of every open document: none while the total fits
/// `budget`; past it, the largest until the rest fits in half the budget,
/// so the worker does not cut again at the next array.
fn memory_cuts<Id>(mut buffered: Vec<(u64, Id)>, total: u64, budget: u64) -> Vec<(u64, Id)> {
    if total <= budget {
        return Vec::new();
    }
    buffered.sort_by_key(|(bytes, _)| std::cmp::Reverse(*bytes));
    let mut left = total;
    let mut cuts = Vec::new();
    for (bytes, id) in buffered {
        if left <= budget / 2 {
            break;
        }
        left = left.saturating_sub(bytes);
        cuts.push((bytes, id));
    }
    cuts
}

/// The windows of a stream whose marker is due at `now` (the worker's
/// clock): its open document's window (`open`), and (unless the definition
/// skips empty windows) each window without documents, so an idle stream is
/// still reported; each once its end plus the grace has passed.
fn due_windows(progress: &StreamWindow, open: Option<Window>, now: i64) -> Vec<Window> {
    let grace = progress.schedule.grace_ms();
    let mut due = Vec::new();
    if let Some(window) = open
        && window.end_ms.saturating_add(grace) <= now
    {
        due.push(window);
    }
    if !progress.schedule.skip_empty() {
        let mut window = progress.schedule.window_of(progress.progress.next_ms);
        let mut looked = 0;
        while window.end_ms.saturating_add(grace) <= now && looked < WINDOW_MARKERS_PER_ARRAY {
            if Some(window) != open && !progress.reported(window) {
                due.push(window);
            }
            window = progress.schedule.next(window);
            looked += 1;
        }
    }
    due
}

/// Publishes, in this array's transaction, a marker that cuts `document`
/// where it lands (once per document).
fn request_cut(
    records_topic: &str,
    document: &mut OpenDocument,
    trigger: Trigger,
    outbox: &mut Outbox,
) {
    if document.cut_requested.is_some() {
        return;
    }
    document.cut_requested = Some(trigger);
    let marker = records::cut(
        &document.stream,
        &CutMarker::rollover(trigger, document.first_offset),
    );
    outbox
        .messages
        .push(on_topic(records_topic, marker).to_partition(document.partition));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_budget_the_largest_documents_are_cut_until_half_of_it_is_left() {
        let buffered = vec![(100, 'a'), (400, 'b'), (300, 'c'), (200, 'd')];
        assert!(memory_cuts(buffered.clone(), 1_000, 1_000).is_empty());
        assert_eq!(
            memory_cuts(buffered, 1_000, 800),
            [(400, 'b'), (300, 'c')],
            "1000 - 400 - 300 = 300 fits in 400"
        );
    }
}

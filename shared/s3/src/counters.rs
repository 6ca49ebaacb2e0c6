//! Counters of what the writers did, shared by every writer and sweep of a
//! bucket handle; the report generator exports them as `quire_worker_*`
//! metrics (its `UploadCounters` collector).

use std::sync::atomic::{AtomicU64, Ordering};

/// Totals across every writer and sweep that share this value (usually one
/// per process, behind an `Arc`). Relaxed atomics: each counter is a total on
/// its own, no reader needs two of them to agree at one instant.
#[derive(Debug, Default)]
pub struct WriterCounters {
    bytes_uploaded: AtomicU64,
    parts_uploaded: AtomicU64,
    single_puts: AtomicU64,
    retries: AtomicU64,
    uploads_aborted: AtomicU64,
    documents_completed: AtomicU64,
    parts_in_flight: AtomicU64,
    /// Gauges of the memory pools that share these counters (two's
    /// complement deltas: a pool adds and subtracts).
    memory_buffered: AtomicU64,
    memory_in_flight: AtomicU64,
    spilled: AtomicU64,
    /// The budget of the pool reporting here; 0: none.
    memory_budget: AtomicU64,
    spill_refused_disk_full: AtomicU64,
    spill_write_failures: AtomicU64,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountersSnapshot {
    /// Bytes the server acknowledged, in parts and in single PutObjects.
    pub bytes_uploaded: u64,
    /// UploadPart calls that succeeded.
    pub parts_uploaded: u64,
    /// Documents smaller than one part, stored with one PutObject.
    pub single_puts: u64,
    /// Attempts that failed with a retryable error and were tried again.
    pub retries: u64,
    /// Multipart uploads aborted, by writers and by take-over sweeps.
    pub uploads_aborted: u64,
    /// Documents completed (multipart or single put).
    pub documents_completed: u64,
    /// Parts uploading right now.
    pub parts_in_flight: u64,
    /// Capacity of the writers' buffers and spare part buffers, now.
    pub memory_buffered_bytes: u64,
    /// Bytes of parts (and single PutObjects) uploading now.
    pub memory_in_flight_bytes: u64,
    /// Bytes in spill files now.
    pub spilled_bytes: u64,
    /// How far buffered + in-flight memory is past the pool's budget (only
    /// when the spill is full or failing).
    pub memory_over_budget_bytes: u64,
    /// Spills refused because the spill filesystem had no room for them
    /// (its free space less a margin); the bytes stayed in memory.
    pub spill_refused_disk_full: u64,
    /// Spills whose file could not be opened or written (ENOSPC, EMFILE,
    /// EIO, ...), or whose filesystem's free space could not be read; the
    /// bytes stayed in memory.
    pub spill_write_failures: u64,
}

impl WriterCounters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            bytes_uploaded: self.bytes_uploaded.load(Ordering::Relaxed),
            parts_uploaded: self.parts_uploaded.load(Ordering::Relaxed),
            single_puts: self.single_puts.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            uploads_aborted: self.uploads_aborted.load(Ordering::Relaxed),
            documents_completed: self.documents_completed.load(Ordering::Relaxed),
            parts_in_flight: self.parts_in_flight.load(Ordering::Relaxed),
            memory_buffered_bytes: self.memory_buffered.load(Ordering::Relaxed),
            memory_in_flight_bytes: self.memory_in_flight.load(Ordering::Relaxed),
            spilled_bytes: self.spilled.load(Ordering::Relaxed),
            memory_over_budget_bytes: {
                let budget = self.memory_budget.load(Ordering::Relaxed);
                let held = self.memory_buffered.load(Ordering::Relaxed)
                    + self.memory_in_flight.load(Ordering::Relaxed);
                if budget == 0 {
                    0
                } else {
                    held.saturating_sub(budget)
                }
            },
            spill_refused_disk_full: self.spill_refused_disk_full.load(Ordering::Relaxed),
            spill_write_failures: self.spill_write_failures.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn part_uploaded(&self, bytes: u64) {
        self.parts_uploaded.fetch_add(1, Ordering::Relaxed);
        self.bytes_uploaded.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn single_put(&self, bytes: u64) {
        self.single_puts.fetch_add(1, Ordering::Relaxed);
        self.bytes_uploaded.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn retried(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn upload_aborted(&self) {
        self.uploads_aborted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn document_completed(&self) {
        self.documents_completed.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn part_started(&self) {
        self.parts_in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn part_ended(&self) {
        self.parts_in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn memory_changed(&self, buffered_delta: i64, in_flight_delta: i64) {
        if buffered_delta != 0 {
            self.memory_buffered
                .fetch_add(buffered_delta as u64, Ordering::Relaxed);
        }
        if in_flight_delta != 0 {
            self.memory_in_flight
                .fetch_add(in_flight_delta as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_memory_budget(&self, budget: u64) {
        self.memory_budget.store(budget, Ordering::Relaxed);
    }

    pub(crate) fn spill_changed(&self, delta: i64) {
        self.spilled.fetch_add(delta as u64, Ordering::Relaxed);
    }

    pub(crate) fn spill_refused_disk_full(&self) {
        self.spill_refused_disk_full.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn spill_write_failed(&self) {
        self.spill_write_failures.fetch_add(1, Ordering::Relaxed);
    }
}

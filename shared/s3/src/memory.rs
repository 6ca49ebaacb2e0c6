//! Memory shared by every writer of a process: one budget for the buffers
//! being filled and the spare part buffers, a fixed reserve for the parts in
//! flight (a limit on parts uploading at once across every writer), and a
//! bounded spill directory on local disk for what the budget cannot hold.
//!
//! Accounting (every figure is capacity, not length: what is really held):
//! - **buffered**: the capacity of every writer's buffer, plus the spare part
//!   buffers kept for reuse. A buffer grows with its document (doubling, up
//!   to one part), and only while buffered stays within
//!   `budget - parts_in_flight x part_size`; spares are dropped first to make
//!   room. A writer that cannot grow spills its buffer to disk and reuses it.
//! - **in flight**: the parts being uploaded (and a spilled part read back
//!   for its upload), at most `parts_in_flight` of them across every writer,
//!   so at most `parts_in_flight x part_size` bytes.
//! - **spilled**: bytes in spill files, at most `spill_max_bytes`, and never
//!   more than the spill filesystem has free less a margin (its free space is
//!   read with statvfs at most once a second, less what was spilled since).
//!   A spill that does not fit, or whose write fails (ENOSPC, EMFILE, EIO, a
//!   file-size limit...), does not happen: the bytes stay in memory, past the
//!   budget, counted as over budget; the refusal is counted
//!   ([`crate::CountersSnapshot::spill_refused_disk_full`],
//!   [`crate::CountersSnapshot::spill_write_failures`]) and warned about, at
//!   most once per [`spill::SPILL_WARNING_PERIOD`]. A full or failing disk slows the
//!   writers down; it never fails a document.
//!
//! The spill is only a buffer: a document's bytes in it are rendered again
//! from the log by the next owner after a crash. Files are named by process,
//! pool and sequence, deleted when their part is read back or their writer
//! ends, and the directory is emptied when the pool is built (stale files of
//! a crashed process). No file descriptor is held between two operations on
//! a spill file: each write opens the file to append and closes it, each
//! read-back opens it to read, so thousands of open documents hold none.
//!
//! This module keeps the memory's accounting; [`spill`] keeps the spill
//! directory's (its bound, its filesystem's room, the warnings) and the
//! spill files.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::{Bytes, BytesMut};
use tokio::sync::Semaphore;

use crate::counters::WriterCounters;

mod spill;
use spill::SpillDir;
pub(crate) use spill::{SpillFile, SpillRefusal};

/// The smallest buffer a writer allocates: enough for a few records, so a
/// document of a few lines holds a few KiB, not a part.
pub(crate) const SMALLEST_BUFFER: usize = 16 * 1024;

/// How a process's writers share memory and disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPolicy {
    /// The most bytes every writer together holds: buffers, spares, and the
    /// parts in flight. `u64::MAX`: no budget.
    pub budget_bytes: u64,
    /// The most parts (and single PutObjects) uploading at once, across every
    /// writer of the pool.
    pub parts_in_flight: usize,
    /// The part size of the writers; a part in flight holds at most this.
    pub part_size: u64,
    /// Where buffered bytes go when the budget is reached; `None`: nowhere
    /// (the budget is then only exceeded, and counted as such).
    pub spill_dir: Option<PathBuf>,
    /// The most bytes in spill files at once.
    pub spill_max_bytes: u64,
}

impl MemoryPolicy {
    /// No budget, no spill, and a limit on parts in flight too high to bind:
    /// what a writer gets when nobody shares memory with it.
    pub fn unlimited() -> Self {
        MemoryPolicy {
            budget_bytes: u64::MAX,
            parts_in_flight: Semaphore::MAX_PERMITS,
            part_size: crate::policy::MINIMUM_PART_SIZE,
            spill_dir: None,
            spill_max_bytes: 0,
        }
    }

    /// The part of the budget buffers may hold: the rest is reserved for the
    /// parts in flight.
    pub fn buffer_limit(&self) -> u64 {
        if self.budget_bytes == u64::MAX {
            // No budget: nothing to reserve from.
            return u64::MAX;
        }
        let reserve = (self.parts_in_flight as u64).saturating_mul(self.part_size);
        self.budget_bytes.saturating_sub(reserve)
    }

    /// Refuses a budget that cannot hold the parts in flight and one buffer
    /// of a part besides.
    pub fn validate(&self) -> Result<(), String> {
        if self.parts_in_flight == 0 {
            return Err("parts in flight must be at least 1".into());
        }
        let least = (self.parts_in_flight as u64 + 1).saturating_mul(self.part_size);
        if self.budget_bytes < least {
            return Err(format!(
                "a memory budget of {} bytes cannot hold {} parts of {} bytes in flight and one being filled (at least {least})",
                self.budget_bytes, self.parts_in_flight, self.part_size
            ));
        }
        Ok(())
    }
}

/// The memory and spill of every writer built from one [`crate::S3Bucket`]
/// (see [`crate::S3Bucket::with_memory`]).
#[derive(Debug)]
pub struct MemoryPool {
    policy: MemoryPolicy,
    buffer_limit: u64,
    buffered: AtomicU64,
    in_flight: AtomicU64,
    pub(crate) parts: Arc<Semaphore>,
    spares: Mutex<Vec<BytesMut>>,
    spill: SpillDir,
    counters: Arc<WriterCounters>,
}

/// The pool's figures at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Capacity of the writers' buffers and of the spare part buffers.
    pub buffered_bytes: u64,
    /// Bytes of the parts uploading now.
    pub in_flight_bytes: u64,
    /// Bytes in spill files.
    pub spilled_bytes: u64,
    /// How far buffered + in flight is past the budget (spill full or failing).
    pub over_budget_bytes: u64,
}

impl MemoryPool {
    /// A pool under `policy`. Empties (or creates) the spill directory: any
    /// file there is a stale spill of a process that ended without cleaning.
    /// Fails when the directory cannot be created, emptied or written.
    pub fn new(policy: MemoryPolicy, counters: Arc<WriterCounters>) -> Result<Self, String> {
        let spill = SpillDir::new(&policy, counters.clone())?;
        let buffer_limit = policy.buffer_limit();
        if policy.budget_bytes != u64::MAX {
            counters.set_memory_budget(policy.budget_bytes);
        }
        let permits = policy.parts_in_flight.clamp(1, Semaphore::MAX_PERMITS);
        Ok(MemoryPool {
            buffer_limit,
            buffered: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            parts: Arc::new(Semaphore::new(permits)),
            spares: Mutex::new(Vec::new()),
            spill,
            counters,
            policy,
        })
    }

    /// A pool without budget or spill, for writers that share nothing.
    pub fn unlimited(counters: Arc<WriterCounters>) -> Self {
        MemoryPool::new(MemoryPolicy::unlimited(), counters).expect("no spill dir to prepare")
    }

    pub fn policy(&self) -> &MemoryPolicy {
        &self.policy
    }

    pub fn snapshot(&self) -> MemorySnapshot {
        let buffered_bytes = self.buffered.load(Ordering::Relaxed);
        let in_flight_bytes = self.in_flight.load(Ordering::Relaxed);
        MemorySnapshot {
            buffered_bytes,
            in_flight_bytes,
            spilled_bytes: self.spill.spilled_bytes(),
            over_budget_bytes: (buffered_bytes + in_flight_bytes)
                .saturating_sub(self.policy.budget_bytes),
        }
    }

    /// Memory held now: buffers, spares and parts in flight.
    pub fn held_bytes(&self) -> u64 {
        self.buffered.load(Ordering::Relaxed) + self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts `bytes` more of buffers if that stays within the buffer limit,
    /// dropping spare buffers first if they are in the way.
    pub(crate) fn try_reserve_buffer(&self, bytes: u64) -> bool {
        loop {
            let held = self.buffered.load(Ordering::Relaxed);
            if held.saturating_add(bytes) <= self.buffer_limit {
                if self
                    .buffered
                    .compare_exchange_weak(held, held + bytes, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    self.counters.memory_changed(bytes as i64, 0);
                    return true;
                }
                continue;
            }
            if !self.drop_one_spare() {
                return false;
            }
        }
    }

    /// Counts `bytes` more of buffers whatever the limit: memory that cannot
    /// go to disk (a compressor's state, or a buffer with the spill full).
    pub fn force_reserve_buffer(&self, bytes: u64) {
        self.buffered.fetch_add(bytes, Ordering::Relaxed);
        self.counters.memory_changed(bytes as i64, 0);
    }

    pub fn release_buffer(&self, bytes: u64) {
        self.buffered.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.memory_changed(-(bytes as i64), 0);
    }

    /// Moves `bytes` of a buffer that became a part from buffered to in flight.
    pub(crate) fn buffer_to_in_flight(&self, bytes: u64) {
        self.buffered.fetch_sub(bytes, Ordering::Relaxed);
        self.in_flight.fetch_add(bytes, Ordering::Relaxed);
        self.counters.memory_changed(-(bytes as i64), bytes as i64);
    }

    pub(crate) fn add_in_flight(&self, bytes: u64) {
        self.in_flight.fetch_add(bytes, Ordering::Relaxed);
        self.counters.memory_changed(0, bytes as i64);
    }

    pub(crate) fn release_in_flight(&self, bytes: u64) {
        self.in_flight.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.memory_changed(0, -(bytes as i64));
    }

    /// A spare part buffer, already counted as buffered, if one is kept.
    pub(crate) fn take_spare(&self) -> Option<BytesMut> {
        self.spares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    /// Keeps an uploaded part's memory for the next part, if nothing else
    /// refers to it any more, it is a whole part, and the budget has room
    /// (a fresh 8 MiB allocation costs 2,048 page faults as it fills, a
    /// reused one none). At most `parts_in_flight + 1` spares are kept.
    pub(crate) fn give_back(&self, part: Bytes) {
        let Ok(mut buffer) = part.try_into_mut() else {
            return;
        };
        if (buffer.capacity() as u64) < self.policy.part_size {
            return;
        }
        buffer.clear();
        let mut spares = self.spares.lock().unwrap_or_else(PoisonError::into_inner);
        if spares.len() > self.policy.parts_in_flight.min(64) {
            return;
        }
        let capacity = buffer.capacity() as u64;
        let held = self.buffered.load(Ordering::Relaxed);
        if held.saturating_add(capacity) > self.buffer_limit {
            return;
        }
        self.force_reserve_buffer(capacity);
        spares.push(buffer);
    }

    fn drop_one_spare(&self) -> bool {
        let spare = self
            .spares
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        match spare {
            Some(spare) => {
                self.release_buffer(spare.capacity() as u64);
                true
            }
            None => false,
        }
    }

    /// Counts `bytes` more in spill files, if a spill directory is set, and
    /// both `spill_max_bytes` and the spill filesystem have room for them.
    /// A refusal for lack of disk is counted and warned about (`key` names
    /// the document that keeps its bytes in memory).
    pub(crate) fn try_reserve_spill(&self, bytes: u64, key: &str) -> Result<(), SpillRefusal> {
        self.spill.try_reserve(bytes, key)
    }

    /// A spill write of the document at `key` failed (its reservation is
    /// already released): counted, warned about, and no more spilling until
    /// the spill filesystem's free space is read again.
    pub(crate) fn spill_write_failed(&self, key: &str, error: &std::io::Error) {
        self.spill.write_failed(key, error);
    }

    pub(crate) fn release_spill(&self, bytes: u64) {
        self.spill.release(bytes);
    }

    /// A new spill file's path (not created yet).
    pub(crate) fn next_spill_path(&self) -> Option<PathBuf> {
        self.spill.next_path()
    }
}

impl Drop for MemoryPool {
    fn drop(&mut self) {
        let spares = std::mem::take(
            self.spares
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for spare in spares {
            self.release_buffer(spare.capacity() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn pool(budget: u64, spill: Option<PathBuf>) -> Arc<MemoryPool> {
        Arc::new(
            MemoryPool::new(
                MemoryPolicy {
                    budget_bytes: budget,
                    parts_in_flight: 2,
                    part_size: 1024,
                    spill_dir: spill,
                    spill_max_bytes: 4096,
                },
                Arc::default(),
            )
            .unwrap(),
        )
    }

    #[test]
    fn buffers_grow_only_within_the_budget_less_the_in_flight_reserve() {
        let pool = pool(4096, None);
        assert_eq!(pool.policy().buffer_limit(), 2048);
        assert!(pool.try_reserve_buffer(2000));
        assert!(!pool.try_reserve_buffer(100));
        pool.release_buffer(2000);
        assert!(pool.try_reserve_buffer(2048));
        assert_eq!(pool.snapshot().over_budget_bytes, 0);
        pool.force_reserve_buffer(4096);
        assert_eq!(pool.snapshot().over_budget_bytes, 2048);
    }

    #[test]
    fn an_unlimited_pool_never_refuses_a_buffer() {
        let pool = MemoryPool::unlimited(Arc::default());
        assert_eq!(pool.policy().buffer_limit(), u64::MAX);
        assert!(pool.try_reserve_buffer(1 << 40));
        assert_eq!(pool.snapshot().over_budget_bytes, 0);
    }

    #[test]
    fn spares_make_way_for_growth() {
        let pool = pool(4096, None);
        pool.give_back(Bytes::from(vec![0u8; 1024]));
        assert_eq!(pool.snapshot().buffered_bytes, 1024);
        assert!(pool.try_reserve_buffer(2048), "the spare is dropped for it");
        assert!(pool.take_spare().is_none());
        assert_eq!(pool.snapshot().buffered_bytes, 2048);
    }

    #[test]
    fn a_budget_that_cannot_hold_the_parts_in_flight_is_refused() {
        let mut policy = MemoryPolicy::unlimited();
        policy.budget_bytes = 8 * 1024 * 1024;
        policy.parts_in_flight = 4;
        assert!(policy.validate().is_err());
        policy.budget_bytes = 40 * 1024 * 1024;
        policy.validate().unwrap();
    }
}

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
//! - **spilled**: bytes in spill files, at most `spill_max_bytes`. With the
//!   spill full (or failing), a buffer grows past the budget rather than lose
//!   data or stop the pipeline; that excess is counted as over budget.
//!
//! The spill is only a buffer: a document's bytes in it are rendered again
//! from the log by the next owner after a crash. Files are named by process
//! and sequence, deleted when their part is read back or their writer ends,
//! and the directory is emptied when the pool is built (stale files of a
//! crashed process).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::{Bytes, BytesMut};
use tokio::sync::Semaphore;

use crate::counters::WriterCounters;

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
    spilled: AtomicU64,
    pub(crate) parts: Arc<Semaphore>,
    spares: Mutex<Vec<BytesMut>>,
    spill_sequence: AtomicU64,
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
        if let Some(dir) = &policy.spill_dir {
            prepare_spill_dir(dir)?;
        }
        let buffer_limit = policy.buffer_limit();
        if policy.budget_bytes != u64::MAX {
            counters.set_memory_budget(policy.budget_bytes);
        }
        let permits = policy.parts_in_flight.clamp(1, Semaphore::MAX_PERMITS);
        Ok(MemoryPool {
            buffer_limit,
            buffered: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            spilled: AtomicU64::new(0),
            parts: Arc::new(Semaphore::new(permits)),
            spares: Mutex::new(Vec::new()),
            spill_sequence: AtomicU64::new(0),
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
            spilled_bytes: self.spilled.load(Ordering::Relaxed),
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

    /// Counts `bytes` more in spill files, if a spill directory is set and
    /// has room for them.
    pub(crate) fn try_reserve_spill(&self, bytes: u64) -> bool {
        if self.policy.spill_dir.is_none() {
            return false;
        }
        loop {
            let held = self.spilled.load(Ordering::Relaxed);
            if held.saturating_add(bytes) > self.policy.spill_max_bytes {
                return false;
            }
            if self
                .spilled
                .compare_exchange_weak(held, held + bytes, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.counters.spill_changed(bytes as i64);
                return true;
            }
        }
    }

    /// Counts `bytes` more in spill files whatever the limit: the tail of a
    /// spilled part joining its file just before the part is read back.
    pub(crate) fn force_reserve_spill(&self, bytes: u64) {
        self.spilled.fetch_add(bytes, Ordering::Relaxed);
        self.counters.spill_changed(bytes as i64);
    }

    pub(crate) fn release_spill(&self, bytes: u64) {
        self.spilled.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.spill_changed(-(bytes as i64));
    }

    /// A new spill file's path (not created yet).
    pub(crate) fn next_spill_path(&self) -> Option<PathBuf> {
        let dir = self.policy.spill_dir.as_ref()?;
        let sequence = self.spill_sequence.fetch_add(1, Ordering::Relaxed);
        Some(dir.join(format!("{}-{sequence}.spill", std::process::id())))
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

/// Creates the spill directory, removes what a previous process left there,
/// and checks that a file can be written in it.
fn prepare_spill_dir(dir: &Path) -> Result<(), String> {
    let failed = |what: &str, error: std::io::Error| {
        format!("spill directory {}: {what}: {error}", dir.display())
    };
    std::fs::create_dir_all(dir).map_err(|error| failed("cannot be created", error))?;
    let entries = std::fs::read_dir(dir).map_err(|error| failed("cannot be read", error))?;
    let mut removed = 0u64;
    for entry in entries {
        let entry = entry.map_err(|error| failed("cannot be read", error))?;
        let path = entry.path();
        let outcome = if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        outcome.map_err(|error| failed("a stale spill file cannot be removed", error))?;
        removed += 1;
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "stale spill files removed");
    }
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    std::fs::write(&probe, b"quire").map_err(|error| failed("is not writable", error))?;
    std::fs::remove_file(&probe).map_err(|error| failed("is not writable", error))?;
    Ok(())
}

/// One writer's spill file: the bytes of its current part that did not fit
/// in memory, in order, ahead of its buffer. Deleted (and uncounted) when
/// dropped.
#[derive(Debug)]
pub(crate) struct SpillFile {
    pub(crate) path: PathBuf,
    file: std::fs::File,
    pub(crate) len: u64,
    pool: Arc<MemoryPool>,
}

impl SpillFile {
    pub(crate) fn create(pool: &Arc<MemoryPool>) -> std::io::Result<SpillFile> {
        let path = pool
            .next_spill_path()
            .ok_or_else(|| std::io::Error::other("no spill directory"))?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok(SpillFile {
            path,
            file,
            len: 0,
            pool: pool.clone(),
        })
    }

    /// Appends `data`, whose room the caller reserved with
    /// [`MemoryPool::try_reserve_spill`]. Written to the page cache: the
    /// kernel decides when it reaches the disk, and a crash loses nothing
    /// the log does not hold. On failure the file is unchanged in length as
    /// far as this writer knows, and the reservation is released.
    pub(crate) fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        if let Err(error) = self.file.write_all(data) {
            self.pool.release_spill(data.len() as u64);
            // Whatever part of it reached the file is cut off again.
            let _ = self.file.set_len(self.len);
            use std::io::Seek;
            let _ = self.file.seek(std::io::SeekFrom::Start(self.len));
            return Err(error);
        }
        self.len += data.len() as u64;
        Ok(())
    }

    /// Reads the whole file into `into` (appending), on the calling thread.
    pub(crate) fn read_into(&mut self, into: &mut BytesMut) -> std::io::Result<()> {
        use std::io::{Read, Seek};
        self.file.seek(std::io::SeekFrom::Start(0))?;
        let start = into.len();
        let wanted = usize::try_from(self.len).map_err(std::io::Error::other)?;
        into.resize(start + wanted, 0);
        self.file.read_exact(&mut into[start..])?;
        Ok(())
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        self.pool.release_spill(self.len);
        if let Err(error) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), %error, "a spill file could not be removed; the next start empties the directory");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(budget: u64, spill: Option<PathBuf>) -> Arc<MemoryPool> {
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

    #[test]
    fn spill_files_are_bounded_counted_and_removed_and_stale_ones_cleaned() {
        let dir = std::env::temp_dir().join(format!("quire-spill-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("stale.spill"), b"old").unwrap();
        let pool = pool(4096, Some(dir.clone()));
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "stale files removed"
        );

        let mut file = SpillFile::create(&pool).unwrap();
        assert!(pool.try_reserve_spill(3000));
        file.append(&[7u8; 3000]).unwrap();
        assert!(!pool.try_reserve_spill(2000), "the spill is bounded");
        let mut read = BytesMut::new();
        file.read_into(&mut read).unwrap();
        assert_eq!(&read[..], &[7u8; 3000][..]);
        assert_eq!(pool.snapshot().spilled_bytes, 3000);
        let path = file.path.clone();
        drop(file);
        assert!(!path.exists());
        assert_eq!(pool.snapshot().spilled_bytes, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

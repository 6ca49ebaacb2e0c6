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
//!   most once per [`SPILL_WARNING_PERIOD`]. A full or failing disk slows the
//!   writers down; it never fails a document.
//!
//! The spill is only a buffer: a document's bytes in it are rendered again
//! from the log by the next owner after a crash. Files are named by process,
//! pool and sequence, deleted when their part is read back or their writer
//! ends, and the directory is emptied when the pool is built (stale files of
//! a crashed process). No file descriptor is held between two operations on
//! a spill file: each write opens the file to append and closes it, each
//! read-back opens it to read, so thousands of open documents hold none.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::sync::Semaphore;

use crate::counters::WriterCounters;

/// The smallest buffer a writer allocates: enough for a few records, so a
/// document of a few lines holds a few KiB, not a part.
pub(crate) const SMALLEST_BUFFER: usize = 16 * 1024;

/// How long a reading of the spill filesystem's free space stands (less what
/// the pool spills meanwhile) before statvfs is asked again: spills come a
/// buffer at a time, not per append, but a backlog makes many.
const SPACE_READING_LIFETIME: Duration = Duration::from_secs(1);

/// The free space the spill leaves on its filesystem: 1/32 of its size, at
/// most 64 MiB. Room for whoever else writes there between two readings, and
/// for the filesystem's own overhead (every file takes whole blocks).
const SPACE_MARGIN_MAX: u64 = 64 * 1024 * 1024;
const SPACE_MARGIN_SHARE: u64 = 32;

/// At most one warning about refused spills per period; the refusals in
/// between are counted, and the next warning says how many.
pub const SPILL_WARNING_PERIOD: Duration = Duration::from_secs(10);

/// Distinguishes the spill files of the pools of one process (a worker
/// builds one per session), so a file of an earlier pool is never appended to.
static POOL_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// Why a spill did not happen. The bytes stay in memory either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpillRefusal {
    /// No spill directory, or `spill_max_bytes` reached: the configured
    /// bound (not counted as a failure).
    Full,
    /// The spill filesystem has no room for it: its free space less the
    /// margin, as last read, less what was spilled since (and none at all
    /// for the rest of a reading after a write failed).
    DiskFull,
    /// Opening or writing the file failed, or the free space could not be
    /// read.
    WriteFailed,
}

impl SpillRefusal {
    fn as_str(self) -> &'static str {
        match self {
            SpillRefusal::Full => "full",
            SpillRefusal::DiskFull => "disk_full",
            SpillRefusal::WriteFailed => "write_failed",
        }
    }
}

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
    /// This pool's number among the pools of the process (spill file names).
    pool_number: u64,
    /// Room left on the spill filesystem, as last read, less what was
    /// spilled since.
    space: Mutex<Option<SpaceReading>>,
    warnings: Mutex<WarningGate>,
    counters: Arc<WriterCounters>,
}

/// A reading of the spill filesystem's room.
#[derive(Debug, Clone, Copy)]
struct SpaceReading {
    at: Instant,
    /// Bytes the spill may still take: free space less the margin, less what
    /// was spilled since the reading.
    room: u64,
    /// The reading failed (statvfs, or a write since): no room until the next.
    failed: bool,
}

/// When the last warning about refused spills was logged, and how many
/// refusals went unlogged since.
#[derive(Debug, Default)]
struct WarningGate {
    last: Option<Instant>,
    unlogged: u64,
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
            pool_number: POOL_SEQUENCE.fetch_add(1, Ordering::Relaxed),
            space: Mutex::new(None),
            warnings: Mutex::new(WarningGate::default()),
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

    /// Counts `bytes` more in spill files, if a spill directory is set, and
    /// both `spill_max_bytes` and the spill filesystem have room for them.
    /// A refusal for lack of disk is counted and warned about here (`key`
    /// names the document that keeps its bytes in memory).
    pub(crate) fn try_reserve_spill(&self, bytes: u64, key: &str) -> Result<(), SpillRefusal> {
        let Some(dir) = &self.policy.spill_dir else {
            return Err(SpillRefusal::Full);
        };
        loop {
            let held = self.spilled.load(Ordering::Relaxed);
            if held.saturating_add(bytes) > self.policy.spill_max_bytes {
                return Err(SpillRefusal::Full);
            }
            if self
                .spilled
                .compare_exchange_weak(held, held + bytes, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.counters.spill_changed(bytes as i64);
                break;
            }
        }
        if let Err((refusal, detail)) = self.take_disk_room(dir, bytes) {
            self.release_spill(bytes);
            self.spill_refused(refusal, key, detail.as_deref());
            return Err(refusal);
        }
        Ok(())
    }

    /// Takes `bytes` of the spill filesystem's room, reading its free space
    /// again when the last reading is older than [`SPACE_READING_LIFETIME`].
    fn take_disk_room(&self, dir: &Path, bytes: u64) -> Result<(), (SpillRefusal, Option<String>)> {
        let mut space = self.space.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let fresh = space
            .as_ref()
            .is_some_and(|reading| now.duration_since(reading.at) < SPACE_READING_LIFETIME);
        if !fresh {
            let reading = match spill_room(dir) {
                Ok(room) => SpaceReading {
                    at: now,
                    room,
                    failed: false,
                },
                Err(error) => {
                    *space = Some(SpaceReading {
                        at: now,
                        room: 0,
                        failed: true,
                    });
                    return Err((
                        SpillRefusal::WriteFailed,
                        Some(format!("free space unreadable: {error}")),
                    ));
                }
            };
            *space = Some(reading);
        }
        let reading = space.as_mut().expect("read above");
        if reading.room < bytes {
            let refusal = if reading.failed {
                SpillRefusal::WriteFailed
            } else {
                SpillRefusal::DiskFull
            };
            return Err((refusal, None));
        }
        reading.room -= bytes;
        Ok(())
    }

    /// A spill write of the document at `key` failed (its reservation is
    /// already released): counted, warned about, and no more spilling until
    /// the free space is read again.
    pub(crate) fn spill_write_failed(&self, key: &str, error: &std::io::Error) {
        *self.space.lock().unwrap_or_else(PoisonError::into_inner) = Some(SpaceReading {
            at: Instant::now(),
            room: 0,
            failed: true,
        });
        self.spill_refused(SpillRefusal::WriteFailed, key, Some(&error.to_string()));
    }

    /// Counts a refusal and logs it, at most once per [`SPILL_WARNING_PERIOD`].
    fn spill_refused(&self, refusal: SpillRefusal, key: &str, detail: Option<&str>) {
        match refusal {
            SpillRefusal::Full => return,
            SpillRefusal::DiskFull => self.counters.spill_refused_disk_full(),
            SpillRefusal::WriteFailed => self.counters.spill_write_failed(),
        }
        let unlogged = {
            let mut gate = self.warnings.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if gate
                .last
                .is_some_and(|last| now.duration_since(last) < SPILL_WARNING_PERIOD)
            {
                gate.unlogged += 1;
                return;
            }
            gate.last = Some(now);
            std::mem::take(&mut gate.unlogged)
        };
        tracing::warn!(
            key,
            reason = refusal.as_str(),
            error = detail,
            refused_since_last_warning = unlogged,
            spill_dir = %self.policy.spill_dir.as_deref().unwrap_or(Path::new("")).display(),
            "spill refused: holding the bytes in memory past the budget"
        );
    }

    pub(crate) fn release_spill(&self, bytes: u64) {
        self.spilled.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.spill_changed(-(bytes as i64));
    }

    /// A new spill file's path (not created yet).
    pub(crate) fn next_spill_path(&self) -> Option<PathBuf> {
        let dir = self.policy.spill_dir.as_ref()?;
        let sequence = self.spill_sequence.fetch_add(1, Ordering::Relaxed);
        Some(dir.join(format!(
            "{}-{}-{sequence}.spill",
            std::process::id(),
            self.pool_number
        )))
    }
}

/// What the spill may still take of the filesystem holding `dir`: the space
/// available to this user less [`spill_margin`].
fn spill_room(dir: &Path) -> std::io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    let available = stat.f_bavail.saturating_mul(stat.f_frsize);
    let size = stat.f_blocks.saturating_mul(stat.f_frsize);
    Ok(available.saturating_sub(spill_margin(size)))
}

/// The free space the spill leaves on a filesystem of `size` bytes.
fn spill_margin(size: u64) -> u64 {
    (size / SPACE_MARGIN_SHARE).min(SPACE_MARGIN_MAX)
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
    if let Err(error) = std::fs::write(&probe, b"quire") {
        let _ = std::fs::remove_file(&probe);
        if is_out_of_space(&error) {
            // Full now (of someone else's files: ours were just removed) is
            // not a configuration error: spills are refused until it has room.
            tracing::warn!(dir = %dir.display(), %error, "spill directory full at start: spilling refused until it has room");
            return Ok(());
        }
        return Err(failed("is not writable", error));
    }
    std::fs::remove_file(&probe).map_err(|error| failed("is not writable", error))?;
    Ok(())
}

fn is_out_of_space(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// One writer's spill file: the bytes of its current part that did not fit
/// in memory, in order, ahead of its buffer. Created by its first write;
/// deleted (and uncounted) when dropped. It holds no file descriptor: each
/// write opens the file to append and closes it again.
#[derive(Debug)]
pub(crate) struct SpillFile {
    pub(crate) path: PathBuf,
    pub(crate) len: u64,
    created: bool,
    pool: Arc<MemoryPool>,
}

impl SpillFile {
    /// A spill file of `pool`'s directory, named but not created yet;
    /// `None` without a spill directory.
    pub(crate) fn new(pool: &Arc<MemoryPool>) -> Option<SpillFile> {
        Some(SpillFile {
            path: pool.next_spill_path()?,
            len: 0,
            created: false,
            pool: pool.clone(),
        })
    }

    /// Appends `data`, whose room the caller reserved with
    /// [`MemoryPool::try_reserve_spill`]. Written to the page cache: the
    /// kernel decides when it reaches the disk, and a crash loses nothing
    /// the log does not hold. On failure the reservation is released and
    /// the file cut back to what it held, so its length is still [`Self::len`].
    pub(crate) fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        let written = self.write(data);
        match &written {
            Ok(()) => self.len += data.len() as u64,
            Err(_) => self.pool.release_spill(data.len() as u64),
        }
        written
    }

    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        // The first write creates the file, and only a new one: a file of
        // that name is no one else's to append to.
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create_new(!self.created)
            .open(&self.path)?;
        self.created = true;
        if let Err(error) = file.write_all(data) {
            // Whatever part of it reached the file is cut off again.
            let _ = file.set_len(self.len);
            return Err(error);
        }
        Ok(())
    }

    /// Reads the whole file into `into` (appending), on the calling thread.
    pub(crate) fn read_into(&self, into: &mut BytesMut) -> std::io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let mut file = std::fs::File::open(&self.path)?;
        let start = into.len();
        let wanted = usize::try_from(self.len).map_err(std::io::Error::other)?;
        into.resize(start + wanted, 0);
        file.read_exact(&mut into[start..])?;
        Ok(())
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        self.pool.release_spill(self.len);
        if !self.created {
            return;
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                tracing::warn!(path = %self.path.display(), %error, "a spill file could not be removed; the next start empties the directory");
            }
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

    fn test_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("quire-spill-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn spill_files_are_bounded_counted_and_removed_and_stale_ones_cleaned() {
        let dir = test_dir("bounded");
        std::fs::write(dir.join("stale.spill"), b"old").unwrap();
        let pool = pool(4096, Some(dir.clone()));
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "stale files removed"
        );

        let mut file = SpillFile::new(&pool).unwrap();
        assert!(!file.path.exists(), "created by its first write");
        assert_eq!(pool.try_reserve_spill(3000, "doc"), Ok(()));
        file.append(&[7u8; 3000]).unwrap();
        assert_eq!(
            pool.try_reserve_spill(2000, "doc"),
            Err(SpillRefusal::Full),
            "the spill is bounded"
        );
        let mut read = BytesMut::new();
        file.read_into(&mut read).unwrap();
        assert_eq!(&read[..], &[7u8; 3000][..]);
        assert_eq!(pool.snapshot().spilled_bytes, 3000);
        let path = file.path.clone();
        drop(file);
        assert!(!path.exists());
        assert_eq!(pool.snapshot().spilled_bytes, 0);
        let counted = pool.counters.snapshot();
        assert_eq!(
            (
                counted.spill_refused_disk_full,
                counted.spill_write_failures
            ),
            (0, 0),
            "the configured bound is not a failure"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Thousands of open documents may each have a spill file: none of them
    /// holds a file descriptor between two writes.
    #[test]
    fn spill_files_hold_no_file_descriptor_between_writes() {
        let dir = test_dir("descriptors");
        let pool = Arc::new(
            MemoryPool::new(
                MemoryPolicy {
                    spill_dir: Some(dir.clone()),
                    spill_max_bytes: u64::MAX,
                    ..MemoryPolicy::unlimited()
                },
                Arc::default(),
            )
            .unwrap(),
        );
        let mut files = Vec::new();
        for number in 0..200u8 {
            let mut file = SpillFile::new(&pool).unwrap();
            for _ in 0..2 {
                pool.try_reserve_spill(100, "doc").unwrap();
                file.append(&[number; 100]).unwrap();
            }
            files.push(file);
        }
        let open_here = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .filter(|target| target.starts_with(&dir))
            .count();
        assert_eq!(open_here, 0, "descriptors held open in the spill directory");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 200);
        let mut read = BytesMut::new();
        files[9].read_into(&mut read).unwrap();
        assert_eq!(&read[..], &[9u8; 200][..]);
        drop(files);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        assert_eq!(pool.snapshot().spilled_bytes, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The spill never takes more than its filesystem has free (less the
    /// margin), even when `spill_max_bytes` would allow it: what does not
    /// fit is refused, counted, and stays in memory.
    #[test]
    fn the_spill_takes_no_more_than_its_filesystem_has_free() {
        let dir = test_dir("free-space");
        let pool = Arc::new(
            MemoryPool::new(
                MemoryPolicy {
                    spill_dir: Some(dir.clone()),
                    spill_max_bytes: u64::MAX,
                    ..MemoryPolicy::unlimited()
                },
                Arc::default(),
            )
            .unwrap(),
        );
        let free = spill_room(&dir).unwrap();
        assert_eq!(
            pool.try_reserve_spill(free.saturating_add(1 << 30), "doc"),
            Err(SpillRefusal::DiskFull)
        );
        assert_eq!(pool.snapshot().spilled_bytes, 0, "nothing stays reserved");
        assert_eq!(pool.counters.snapshot().spill_refused_disk_full, 1);
        // What was spilled since the reading counts against it: two halves
        // of the room fit, a third does not, before anything is written.
        let room = pool.space.lock().unwrap().expect("a reading").room;
        let half = room / 2;
        assert_eq!(pool.try_reserve_spill(half, "doc"), Ok(()));
        assert_eq!(pool.try_reserve_spill(half, "doc"), Ok(()));
        assert_eq!(
            pool.try_reserve_spill(half.max(1), "doc"),
            Err(SpillRefusal::DiskFull)
        );
        pool.release_spill(2 * half);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn after_a_failed_write_the_spill_is_refused_until_the_next_reading() {
        let dir = test_dir("write-failed");
        let pool = pool(1 << 20, Some(dir.clone()));
        pool.spill_write_failed("doc", &std::io::Error::other("no space left on device"));
        assert_eq!(
            pool.try_reserve_spill(10, "doc"),
            Err(SpillRefusal::WriteFailed),
            "no write is tried again right away"
        );
        assert_eq!(pool.counters.snapshot().spill_write_failures, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_margin_is_a_share_of_the_filesystem_up_to_a_cap() {
        assert_eq!(spill_margin(16 * 1024 * 1024), 512 * 1024);
        assert_eq!(spill_margin(1 << 40), SPACE_MARGIN_MAX);
        assert_eq!(spill_margin(0), 0);
    }
}

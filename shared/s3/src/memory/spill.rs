//! The spill: a bounded directory on local disk for the bytes the memory
//! budget cannot hold (see the parent module for the accounting).
//!
//! [`SpillDir`] owns the directory's accounting: the bytes in spill files
//! (at most `spill_max_bytes`), the room left on its filesystem (free space
//! less a margin, read with statvfs at most once per
//! [`SPACE_READING_LIFETIME`], less what was spilled since), the warnings
//! about refused spills, and the names of the files. [`SpillFile`] is one
//! writer's file. A spill that does not fit, or whose write fails, does not
//! happen: the caller keeps the bytes in memory.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::{MemoryPolicy, MemoryPool};
use crate::counters::WriterCounters;

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

/// The spill directory of one pool, and what is in it.
#[derive(Debug)]
pub(super) struct SpillDir {
    /// `None`: nowhere to spill (every spill is refused as [`SpillRefusal::Full`]).
    dir: Option<PathBuf>,
    max_bytes: u64,
    /// Bytes reserved in spill files.
    spilled: AtomicU64,
    sequence: AtomicU64,
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

impl SpillDir {
    /// The spill of `policy`. Empties (or creates) its directory: any file
    /// there is a stale spill of a process that ended without cleaning.
    /// Fails when the directory cannot be created, emptied or written.
    pub(super) fn new(
        policy: &MemoryPolicy,
        counters: Arc<WriterCounters>,
    ) -> Result<Self, String> {
        if let Some(dir) = &policy.spill_dir {
            prepare_spill_dir(dir)?;
        }
        Ok(SpillDir {
            dir: policy.spill_dir.clone(),
            max_bytes: policy.spill_max_bytes,
            spilled: AtomicU64::new(0),
            sequence: AtomicU64::new(0),
            pool_number: POOL_SEQUENCE.fetch_add(1, Ordering::Relaxed),
            space: Mutex::new(None),
            warnings: Mutex::new(WarningGate::default()),
            counters,
        })
    }

    /// Bytes in spill files now.
    pub(super) fn spilled_bytes(&self) -> u64 {
        self.spilled.load(Ordering::Relaxed)
    }

    /// Counts `bytes` more in spill files, if a spill directory is set, and
    /// both `spill_max_bytes` and the spill filesystem have room for them.
    /// A refusal for lack of disk is counted and warned about here (`key`
    /// names the document that keeps its bytes in memory).
    pub(super) fn try_reserve(&self, bytes: u64, key: &str) -> Result<(), SpillRefusal> {
        let Some(dir) = &self.dir else {
            return Err(SpillRefusal::Full);
        };
        loop {
            let held = self.spilled.load(Ordering::Relaxed);
            if held.saturating_add(bytes) > self.max_bytes {
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
            self.release(bytes);
            self.refused(refusal, key, detail.as_deref());
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
    pub(super) fn write_failed(&self, key: &str, error: &std::io::Error) {
        *self.space.lock().unwrap_or_else(PoisonError::into_inner) = Some(SpaceReading {
            at: Instant::now(),
            room: 0,
            failed: true,
        });
        self.refused(SpillRefusal::WriteFailed, key, Some(&error.to_string()));
    }

    /// Counts a refusal and logs it, at most once per [`SPILL_WARNING_PERIOD`].
    fn refused(&self, refusal: SpillRefusal, key: &str, detail: Option<&str>) {
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
            spill_dir = %self.dir.as_deref().unwrap_or(Path::new("")).display(),
            "spill refused: holding the bytes in memory past the budget"
        );
    }

    pub(super) fn release(&self, bytes: u64) {
        self.spilled.fetch_sub(bytes, Ordering::Relaxed);
        self.counters.spill_changed(-(bytes as i64));
    }

    /// A new spill file's path (not created yet).
    pub(super) fn next_path(&self) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed);
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
    use crate::memory::tests::pool;

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
        let room = pool.spill.space.lock().unwrap().expect("a reading").room;
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

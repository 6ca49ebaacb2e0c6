//! The part being filled, and the memory a writer holds.
//!
//! A [`PartBuffer`] takes the document's bytes until a part is full: into a
//! buffer that grows with the document (doubling from [`SMALLEST_BUFFER`] up
//! to one part) while the writer's [`MemoryPool`] has room; past that, the
//! buffer's bytes spill to a file of the pool's spill directory and the
//! buffer is reused; with the spill full or failing, the buffer grows past
//! the budget (counted as such) rather than lose data or fail. A full part
//! leaves it under a permit of the pool's limit on parts in flight, with its
//! memory counted as in flight ([`InFlightMemory`]) until its upload ends.
//!
//! Every byte of capacity the buffer holds is counted in the pool, and
//! released when the buffer is dropped.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use tokio::sync::{AcquireError, OwnedSemaphorePermit};

use crate::memory::{MemoryPool, SMALLEST_BUFFER, SpillFile};

type PermitWait = Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, AcquireError>> + Send>>;

/// The current part of a document, and the accounting of the memory its
/// writer holds (see the module).
pub(super) struct PartBuffer {
    pool: Arc<MemoryPool>,
    part_size: usize,
    /// The end of the part being filled (its start is in `spill`, if any).
    /// A writer that was never written to holds no memory; the buffer grows
    /// with the document, within the pool's budget.
    buffer: BytesMut,
    /// The buffer's capacity, as counted in the pool.
    counted: u64,
    /// The most bytes the buffer may hold: the part size less the spilled
    /// bytes of the current part.
    limit: usize,
    /// The start of the current part, when the pool had no memory for it.
    spill: Option<SpillFile>,
    /// Parts taken out so far.
    parts_taken: u32,
    /// Whether this writer already said it went past the budget.
    warned_over_budget: bool,
    /// The wait for a permit of the pool's limit on parts in flight.
    permit_wait: Option<PermitWait>,
    footprint: Footprint,
}

/// The bytes of a writer's parts in flight, and the most it has held.
struct Footprint {
    /// Bytes of the parts in flight, released by each part's
    /// [`InFlightMemory`] as its upload ends.
    in_flight: Arc<AtomicU64>,
    /// In-flight bytes right after the last part was taken. Between two
    /// parts, parts only end, none starts, so this is the most that was in
    /// flight while the current buffer filled.
    in_flight_when_buffer_started: u64,
    peak: u64,
}

/// Where an append's bytes can go now.
enum Room {
    /// Into the buffer (it has room for at least one byte of them).
    Buffer,
    /// This many were written straight to the spill file.
    Spilled(usize),
}

impl PartBuffer {
    pub(super) fn new(pool: Arc<MemoryPool>, part_size: usize) -> Self {
        PartBuffer {
            pool,
            part_size,
            buffer: BytesMut::new(),
            counted: 0,
            limit: part_size,
            spill: None,
            parts_taken: 0,
            warned_over_budget: false,
            permit_wait: None,
            footprint: Footprint {
                in_flight: Arc::new(AtomicU64::new(0)),
                in_flight_when_buffer_started: 0,
                peak: 0,
            },
        }
    }

    /// The size of every part but the last.
    pub(super) fn part_size(&self) -> usize {
        self.part_size
    }

    /// Whether `length` more bytes fit in the buffer as it is: no growth, no
    /// spill. The test of the appends' fast path.
    #[inline]
    pub(super) fn has_room_for(&self, length: usize) -> bool {
        length <= self.buffer.capacity().min(self.limit) - self.buffer.len()
    }

    /// Copies `data` into the buffer; [`Self::has_room_for`] said it fits.
    #[inline]
    pub(super) fn push(&mut self, data: &[u8]) {
        debug_assert!(self.has_room_for(data.len()));
        self.buffer.extend_from_slice(data);
    }

    /// Bytes of the current part so far (spilled, then buffered).
    pub(super) fn unsent(&self) -> usize {
        self.part_size - self.limit + self.buffer.len()
    }

    /// Whether the current part is whole: it must leave before more bytes
    /// come in.
    pub(super) fn is_full(&self) -> bool {
        self.unsent() == self.part_size
    }

    /// Bytes the writer holds now: the buffer being filled plus the parts in
    /// flight.
    pub(super) fn buffered_bytes(&self) -> u64 {
        self.buffer.len() as u64 + self.footprint.in_flight.load(Ordering::Relaxed)
    }

    /// Memory the writer holds now: its buffer's capacity plus the parts in
    /// flight. What the pool's budget counts.
    pub(super) fn held_bytes(&self) -> u64 {
        self.counted + self.footprint.in_flight.load(Ordering::Relaxed)
    }

    /// Bytes of the current part waiting in a spill file.
    pub(super) fn spilled_bytes(&self) -> u64 {
        self.spill.as_ref().map_or(0, |spill| spill.len)
    }

    /// The most bytes the writer has held at once. Checked at every part
    /// boundary; an upper bound, as it pairs the fullest buffer with the
    /// in-flight bytes as they stood when that buffer started filling.
    pub(super) fn peak_bytes(&self) -> u64 {
        self.footprint
            .peak
            .max(self.footprint.in_flight_when_buffer_started + self.buffer.len() as u64)
    }

    /// Takes a prefix of `data` (not empty) into the current part (not full),
    /// making room for it (see [`Self::make_room`]), and returns its length.
    /// `key` names the document in the warnings about memory and spill.
    pub(super) fn accept(&mut self, data: &[u8], key: &str) -> usize {
        debug_assert!(!data.is_empty() && !self.is_full());
        let wanted = (self.part_size - self.unsent()).min(data.len());
        match self.make_room(&data[..wanted], key) {
            Room::Buffer => {
                let room = self.buffer.capacity().min(self.limit) - self.buffer.len();
                let accepted = room.min(wanted);
                debug_assert!(accepted > 0);
                self.buffer.extend_from_slice(&data[..accepted]);
                accepted
            }
            Room::Spilled(written) => written,
        }
    }

    /// Makes room for (a prefix of) `data`, which fits in the current part:
    /// a spare part buffer for a fresh part, else a larger buffer if the pool
    /// has the memory, else the buffer's bytes (and, if the buffer is too
    /// small for them, `data`) go to the spill file; with the spill full,
    /// its disk out of room or its write failing, the buffer grows past the
    /// budget (counted as over budget) rather than lose data or fail.
    fn make_room(&mut self, data: &[u8], key: &str) -> Room {
        let needed = self.buffer.len() + data.len();
        if needed <= self.buffer.capacity() {
            return Room::Buffer;
        }
        if self.buffer.is_empty()
            && self.spill.is_none()
            && self.parts_taken > 0
            && let Some(spare) = self.pool.take_spare()
        {
            // A document past its first part will fill this one too.
            self.pool.release_buffer(self.counted);
            self.counted = spare.capacity() as u64;
            self.buffer = spare;
            return Room::Buffer;
        }
        let doubled = (self.buffer.capacity() * 2).max(SMALLEST_BUFFER);
        let target = doubled.max(needed).min(self.limit);
        if self.grow_buffer(target, false) || (target > needed && self.grow_buffer(needed, false)) {
            return Room::Buffer;
        }
        if let Some(room) = self.spill_buffer(data, key) {
            return room;
        }
        if !self.warned_over_budget {
            self.warned_over_budget = true;
            tracing::warn!(
                key,
                spilled_bytes = self.pool.snapshot().spilled_bytes,
                "memory budget reached and the spill is full or refused: holding the document in memory past the budget"
            );
        }
        // The spill may have taken the buffer's bytes before it refused
        // `data`: size the buffer for what it holds now. Doubling still, so
        // that appends past the budget stay linear.
        let needed = self.buffer.len() + data.len();
        let doubled = (self.buffer.capacity() * 2).max(SMALLEST_BUFFER);
        self.grow_buffer(doubled.max(needed).min(self.limit), true);
        Room::Buffer
    }

    /// Replaces the buffer by one of `capacity` bytes (its bytes copied), if
    /// the pool has the memory or `force` is set.
    fn grow_buffer(&mut self, capacity: usize, force: bool) -> bool {
        let delta = capacity.saturating_sub(self.buffer.capacity()) as u64;
        if delta == 0 {
            return true;
        }
        if force {
            self.pool.force_reserve_buffer(delta);
        } else if !self.pool.try_reserve_buffer(delta) {
            return false;
        }
        let mut grown = BytesMut::with_capacity(capacity);
        grown.extend_from_slice(&self.buffer);
        let old_capacity = self.counted;
        self.buffer = grown;
        // What was reserved is the growth; the allocator may give more.
        let actual = self.buffer.capacity() as u64;
        let counted = old_capacity + delta;
        if actual > counted {
            self.pool.force_reserve_buffer(actual - counted);
        }
        self.counted = actual.max(counted);
        true
    }

    /// Moves the buffer's bytes to the spill file (keeping the buffer for the
    /// next bytes), or, when the buffer cannot hold `data` even empty, writes
    /// `data` there too. `None` when the spill took nothing more: it is full,
    /// its filesystem has no room, or a write failed (the pool counts and
    /// warns); whatever did not reach the file is still in memory.
    fn spill_buffer(&mut self, data: &[u8], key: &str) -> Option<Room> {
        let through = self.buffer.capacity().min(self.part_size) < data.len();
        let bytes = self.buffer.len() + if through { data.len() } else { 0 };
        self.pool.try_reserve_spill(bytes as u64, key).ok()?;
        let pool = &self.pool;
        let spill = self.spill.get_or_insert_with(|| {
            SpillFile::new(pool).expect("a spill reservation needs a spill directory")
        });
        let buffered = self.buffer.len();
        let mut failure = None;
        if buffered > 0 {
            match spill.append(&self.buffer) {
                Ok(()) => self.buffer.clear(),
                Err(error) => {
                    // The rest of the reservation was for `data`.
                    self.pool.release_spill((bytes - buffered) as u64);
                    failure = Some(error);
                }
            }
        }
        if through
            && failure.is_none()
            && let Err(error) = spill.append(data)
        {
            failure = Some(error);
        }
        let spilled = spill.len as usize;
        self.limit = self.part_size - spilled;
        if let Some(error) = failure {
            self.pool.spill_write_failed(key, &error);
            if spilled == 0 {
                self.spill = None;
            }
            return None;
        }
        Some(if through {
            Room::Spilled(data.len())
        } else {
            Room::Buffer
        })
    }

    /// The current part, taken out once a permit of the pool's limit on
    /// parts in flight is free (see [`Self::take`]).
    pub(super) fn poll_take(
        &mut self,
        context: &mut Context<'_>,
    ) -> Poll<(PartBody, InFlightMemory)> {
        let parts = &self.pool.parts;
        let wait = self
            .permit_wait
            .get_or_insert_with(|| Box::pin(parts.clone().acquire_owned()));
        let permit = ready!(wait.as_mut().poll(context));
        self.permit_wait = None;
        let permit = permit.expect("the pool's semaphore is never closed");
        Poll::Ready(self.take(permit))
    }

    /// The current part, taken out of the buffer: the buffer itself (no
    /// copy), or the spill file and the buffer behind it. The buffer's bytes
    /// never join the file (a full disk cannot fail the part): the upload
    /// task appends them to the file's bytes as it reads them back. The
    /// memory the part holds is counted as in flight from here on, under
    /// `permit`, until the [`InFlightMemory`] is dropped.
    pub(super) fn take(&mut self, permit: OwnedSemaphorePermit) -> (PartBody, InFlightMemory) {
        self.footprint.peak = self.peak_bytes();
        let counted = self.counted;
        self.pool.buffer_to_in_flight(counted);
        self.counted = 0;
        let buffer = std::mem::take(&mut self.buffer).freeze();
        self.limit = self.part_size;
        self.parts_taken += 1;
        let (body, pool_bytes) = match self.spill.take() {
            None => (PartBody::Memory(buffer), counted),
            Some(spill) => {
                // Reading it back needs the whole part's memory, from the
                // in-flight reserve, while the buffer's bytes wait beside it.
                let read_back = spill.len + buffer.len() as u64;
                self.pool.add_in_flight(read_back);
                let body = PartBody::Spilled {
                    spill,
                    tail: buffer,
                };
                (body, counted + read_back)
            }
        };
        let part_bytes = body.len();
        let in_flight = &self.footprint.in_flight;
        in_flight.fetch_add(part_bytes, Ordering::Relaxed);
        self.footprint.in_flight_when_buffer_started = in_flight.load(Ordering::Relaxed);
        let memory = InFlightMemory {
            pool: self.pool.clone(),
            pool_bytes,
            writer_in_flight: in_flight.clone(),
            part_bytes,
            _permit: permit,
        };
        (body, memory)
    }
}

impl PartBuffer {
    /// The current part (full), taken out to be held until the document
    /// ends (see `MultipartWriter::hold_first_part`): no permit of the
    /// pool's parts in flight, as it does not upload yet; its memory stays
    /// counted as a buffer's, where it lies (in memory if the pool had room
    /// for it as it filled, in the spill file otherwise), until the
    /// [`HeldPart`] is dropped.
    pub(super) fn take_held(&mut self) -> HeldPart {
        self.footprint.peak = self.peak_bytes();
        let counted = std::mem::take(&mut self.counted);
        let buffer = std::mem::take(&mut self.buffer).freeze();
        self.limit = self.part_size;
        self.parts_taken += 1;
        let body = match self.spill.take() {
            None => PartBody::Memory(buffer),
            Some(spill) => PartBody::Spilled {
                spill,
                tail: buffer,
            },
        };
        HeldPart {
            pool: self.pool.clone(),
            counted,
            body: Some(body),
        }
    }
}

/// A document's first part, held until its end (see
/// [`PartBuffer::take_held`]).
pub(super) struct HeldPart {
    pool: Arc<MemoryPool>,
    /// The buffer capacity it holds, as the pool counts it.
    counted: u64,
    body: Option<PartBody>,
}

impl HeldPart {
    /// Memory it holds, as the pool counts it.
    pub(super) fn held_bytes(&self) -> u64 {
        self.counted
    }

    /// Bytes of it in a spill file.
    pub(super) fn spilled_bytes(&self) -> u64 {
        match &self.body {
            Some(PartBody::Spilled { spill, .. }) => spill.len,
            _ => 0,
        }
    }

    /// Bytes of it.
    pub(super) fn len(&self) -> u64 {
        self.body.as_ref().map_or(0, PartBody::len)
    }

    /// `head` then its bytes, in memory (the spill file read back), once.
    /// That memory stays counted in the pool until this is dropped: keep
    /// it until the part is uploaded.
    pub(super) async fn with_head(&mut self, head: &[u8]) -> Result<Bytes, String> {
        let body = self.body.take().expect("a held part is loaded once");
        let read_back = body.len() + head.len() as u64;
        self.pool.force_reserve_buffer(read_back);
        self.counted += read_back;
        let part = body.load().await?;
        let mut whole = BytesMut::with_capacity(head.len() + part.len());
        whole.extend_from_slice(head);
        whole.extend_from_slice(&part);
        Ok(whole.freeze())
    }
}

impl Drop for HeldPart {
    fn drop(&mut self) {
        self.pool.release_buffer(self.counted);
    }
}

impl Drop for PartBuffer {
    /// The buffer's memory leaves the pool's count with the writer (a spill
    /// file removes itself).
    fn drop(&mut self) {
        self.pool.release_buffer(self.counted);
    }
}

/// What an upload sends: a part (or a whole small document) in memory, or
/// its start spilled to a file, read back by the upload's task, and its end
/// still in memory.
pub(super) enum PartBody {
    Memory(Bytes),
    Spilled { spill: SpillFile, tail: Bytes },
}

impl PartBody {
    pub(super) fn len(&self) -> u64 {
        match self {
            PartBody::Memory(part) => part.len() as u64,
            PartBody::Spilled { spill, tail } => spill.len + tail.len() as u64,
        }
    }

    /// The bytes, in memory. A spill file is read on the blocking pool and
    /// deleted once read; a failed read-back is returned as its detail
    /// (those bytes are gone: the document is rendered again from the log).
    pub(super) async fn load(self) -> Result<Bytes, String> {
        let (spill, tail) = match self {
            PartBody::Memory(bytes) => return Ok(bytes),
            PartBody::Spilled { spill, tail } => (spill, tail),
        };
        let read = tokio::task::spawn_blocking(move || {
            let mut part = BytesMut::with_capacity(spill.len as usize + tail.len());
            spill.read_into(&mut part).map(|()| {
                part.extend_from_slice(&tail);
                part
            })
        })
        .await;
        match read {
            Ok(Ok(part)) => Ok(part.freeze()),
            Ok(Err(error)) => Err(format!("cannot read back: {error}")),
            Err(error) => Err(format!("reading back ended without a result: {error}")),
        }
    }
}

/// A part's memory, for as long as its upload holds it: counted as in flight
/// in the pool and in its writer's footprint, under a permit of the pool's
/// limit on parts in flight. All of it is released when this is dropped.
pub(super) struct InFlightMemory {
    pool: Arc<MemoryPool>,
    /// What the pool counts: the buffer's capacity, and a spilled part's
    /// read-back.
    pool_bytes: u64,
    writer_in_flight: Arc<AtomicU64>,
    /// What the writer counts: the part's length.
    part_bytes: u64,
    _permit: OwnedSemaphorePermit,
}

impl InFlightMemory {
    /// Offers the part's memory, once stored, to the pool for the next part
    /// (kept only if nothing else refers to it; see
    /// [`MemoryPool::give_back`]).
    pub(super) fn give_back(&self, part: Bytes) {
        self.pool.give_back(part);
    }
}

impl Drop for InFlightMemory {
    fn drop(&mut self) {
        self.writer_in_flight
            .fetch_sub(self.part_bytes, Ordering::Relaxed);
        self.pool.release_in_flight(self.pool_bytes);
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;
    use crate::MemoryPolicy;
    use crate::counters::WriterCounters;
    use crate::policy::MINIMUM_PART_SIZE;

    const PART: usize = MINIMUM_PART_SIZE as usize;

    /// A pool of `budget` bytes, one part in flight, parts of [`PART`].
    fn pool(budget: u64, spill_dir: Option<std::path::PathBuf>) -> Arc<MemoryPool> {
        Arc::new(
            MemoryPool::new(
                MemoryPolicy {
                    budget_bytes: budget,
                    parts_in_flight: 1,
                    part_size: PART as u64,
                    spill_dir,
                    spill_max_bytes: u64::MAX,
                },
                Arc::new(WriterCounters::default()),
            )
            .unwrap(),
        )
    }

    /// Appends `data` whole, as the writer does between two parts.
    fn append(part: &mut PartBuffer, mut data: &[u8]) {
        while !data.is_empty() {
            if part.has_room_for(data.len()) {
                part.push(data);
                return;
            }
            let accepted = part.accept(data, "doc");
            data = &data[accepted..];
        }
    }

    async fn take(part: &mut PartBuffer) -> (PartBody, InFlightMemory) {
        poll_fn(|context| part.poll_take(context)).await
    }

    #[test]
    fn the_buffer_grows_with_the_document_and_the_pool_counts_its_capacity() {
        let pool = pool(u64::MAX, None);
        let mut part = PartBuffer::new(pool.clone(), PART);
        assert_eq!(part.held_bytes(), 0, "no memory before the first byte");
        append(&mut part, &[1; 100]);
        assert_eq!(part.held_bytes(), SMALLEST_BUFFER as u64);
        append(&mut part, &[2; SMALLEST_BUFFER]);
        assert_eq!(part.held_bytes(), 2 * SMALLEST_BUFFER as u64, "doubled");
        assert_eq!(pool.snapshot().buffered_bytes, part.held_bytes());
        assert_eq!(part.unsent(), 100 + SMALLEST_BUFFER);
        assert_eq!(part.buffered_bytes(), part.unsent() as u64);
        drop(part);
        assert_eq!(
            pool.snapshot().buffered_bytes,
            0,
            "released with the buffer"
        );
    }

    #[tokio::test]
    async fn a_part_taken_counts_as_in_flight_until_its_memory_is_dropped() {
        let pool = pool(u64::MAX, None);
        let mut part = PartBuffer::new(pool.clone(), PART);
        append(&mut part, &vec![3; PART]);
        assert!(part.is_full());
        assert!(!part.has_room_for(1), "a whole part takes no more");
        let capacity = part.held_bytes();
        assert!(capacity >= PART as u64);

        let (body, memory) = take(&mut part).await;
        assert_eq!(body.len(), PART as u64);
        assert_eq!(part.unsent(), 0);
        let counted = pool.snapshot();
        assert_eq!(
            (counted.buffered_bytes, counted.in_flight_bytes),
            (0, capacity)
        );
        assert_eq!(
            part.buffered_bytes(),
            PART as u64,
            "in flight, for the writer"
        );
        assert_eq!(part.peak_bytes(), PART as u64);
        assert_eq!(
            pool.parts.available_permits(),
            0,
            "the part holds the permit"
        );

        drop(memory);
        let counted = pool.snapshot();
        assert_eq!((counted.buffered_bytes, counted.in_flight_bytes), (0, 0));
        assert_eq!(part.held_bytes(), 0);
        assert_eq!(pool.parts.available_permits(), 1);
        let Ok(bytes) = body.load().await else {
            panic!("a part in memory loads")
        };
        assert!(bytes.iter().all(|&byte| byte == 3));
    }

    #[tokio::test]
    async fn past_its_first_part_a_document_reuses_a_spare_part_buffer() {
        let pool = pool(u64::MAX, None);
        let mut part = PartBuffer::new(pool.clone(), PART);
        append(&mut part, &vec![4; PART]);
        let (body, memory) = take(&mut part).await;
        let bytes = body.load().await.unwrap();
        memory.give_back(bytes);
        drop(memory);
        let spare = pool.snapshot().buffered_bytes;
        assert!(spare >= PART as u64, "the part's buffer is kept as a spare");

        append(&mut part, b"next part");
        assert_eq!(part.held_bytes(), spare, "the spare, not a fresh 16 KiB");
        assert_eq!(pool.snapshot().buffered_bytes, spare, "counted once");
        assert!(pool.take_spare().is_none());
    }

    /// With the budget taken by others, every byte goes to the spill file,
    /// and the part read back is every byte, in order.
    #[tokio::test]
    async fn past_the_budget_the_part_spills_and_reads_back_in_order() {
        let dir = std::env::temp_dir().join(format!("quire-part-spill-{}", std::process::id()));
        let pool = pool(2 * PART as u64, Some(dir.clone()));
        pool.force_reserve_buffer(PART as u64);
        let mut part = PartBuffer::new(pool.clone(), PART);
        let mut expected = Vec::new();
        for chunk in 0..64u32 {
            let bytes: Vec<u8> = (0..4096u32).map(|at| ((chunk + at) % 251) as u8).collect();
            append(&mut part, &bytes);
            expected.extend_from_slice(&bytes);
        }
        assert_eq!(part.spilled_bytes(), expected.len() as u64);
        assert_eq!(part.held_bytes(), 0, "nothing held in memory");
        assert_eq!(part.unsent(), expected.len());
        assert_eq!(pool.snapshot().over_budget_bytes, 0);

        let (body, memory) = take(&mut part).await;
        assert_eq!(part.spilled_bytes(), 0, "the file left with the part");
        assert_eq!(
            pool.snapshot().in_flight_bytes,
            expected.len() as u64,
            "its read-back is counted in flight"
        );
        let bytes = body.load().await.expect("read back");
        assert!(bytes[..] == expected[..], "every byte, in order");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "file deleted");
        assert_eq!(pool.snapshot().spilled_bytes, 0);
        drop(memory);
        assert_eq!(pool.snapshot().in_flight_bytes, 0);
        pool.release_buffer(PART as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

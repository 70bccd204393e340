//! A host arena's segment (see `arena.rs`): a sealed `memfd` of a header page, two small areas and two slots,
//! mapped read-write by the rank that made it ([`Mapping::create`]) and read-only by the peers
//! it was passed to ([`Mapping::open`]), which check everything that could make an access fault
//! before they map it: the size, and the seals that keep it.
//!
//! The header: magic, version, the owner's rank and the slot size, its process id and where a
//! probe value lies in its memory (and the value); then, each on a cache line of its own, the
//! input word, the reduced word, and the owner's asleep count (its threads sleeping on a peer's
//! word); the descriptors beside each slot and of the current call, and the owner's token for
//! the segment (by which a rank of the same process finds the segment's copy record:
//! `busy.rs`). Two small areas follow the header (each a word, a descriptor and 4 KiB of data,
//! for small all_reduces: `dist-core/src/collectives/small.rs`), then, from the next page, the
//! slots.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};

use super::busy::{self, Busy};
use super::shared_map::{SharedMap, check_sealed};

/// The header's length; the small areas follow it, then the slots.
pub(crate) const HEADER: usize = 4096;
/// The first small area (`small_*` below; the second follows [`SMALL_STRIDE`] bytes later):
/// its word (u32) at 0, the descriptor at 16, then [`SMALL_DATA`] data bytes from 32, so that
/// the word, the descriptor and the first 32 bytes of data share one cache line.
const SMALL_AT: usize = HEADER;
const SMALL_STRIDE: usize = 4160;
const SMALL_META: usize = 16;
const SMALL_FIRST: usize = 32;
/// The data bytes of a small area.
pub(crate) const SMALL_DATA: usize = 4096;
/// Where the slots start: the page after the small areas.
pub(crate) const SLOTS_AT: usize = 16384;
const _: () = assert!(SMALL_FIRST + SMALL_DATA <= SMALL_STRIDE && SMALL_STRIDE.is_multiple_of(64));
const _: () = assert!(SMALL_AT + 2 * SMALL_STRIDE <= SLOTS_AT);
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_RANK: usize = 12;
const OFF_SLOT: usize = 16;
/// The owner's process id, the address of its probe value and that value (for direct reads
/// of its memory: `arena.rs`).
pub(crate) const OFF_PID: usize = 24;
pub(crate) const OFF_PROBE_ADDR: usize = 32;
pub(crate) const OFF_PROBE_VALUE: usize = 40;
/// The words, by [`dist_core::transport::ArenaWord`] as index.
pub(crate) const OFF_WORDS: [usize; 2] = [64, 128];
pub(crate) const OFF_ASLEEP: usize = 192;
/// The descriptor beside slot 0 (slot 1's follows), then the current call's.
pub(crate) const OFF_META: usize = 256;
pub(crate) const OFF_CALL: usize = 288;
/// The sequence lock of the current call's descriptor (odd while it is being written).
pub(crate) const OFF_CALL_SEQ: usize = 304;
/// The owner's token for the segment, which a rank of the same process finds its record by
/// (`busy.rs`).
const OFF_TOKEN: usize = 312;

/// `dist-are` in ASCII, little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"dist-are");
pub(crate) const VERSION: u32 = 4;
/// The slot sizes a peer may offer: powers of two in this range.
pub(crate) const MIN_SLOT: u64 = 4 << 10;
pub(crate) const MAX_SLOT: u64 = 64 << 20;

fn required_seals() -> SealFlags {
    // FUTURE_WRITE (Linux): no mapping made after the seal may write (the owner maps its own
    // before sealing), so a peer holding the descriptor can only read the segment. Shared
    // memory is off on other systems.
    #[cfg(target_os = "linux")]
    let future_write = SealFlags::FUTURE_WRITE;
    #[cfg(not(target_os = "linux"))]
    let future_write = SealFlags::empty();
    SealFlags::SHRINK | SealFlags::GROW | future_write | SealFlags::SEAL
}

/// A shared mapping of an arena segment: read-write for its owner, read-only for a peer.
pub(crate) struct Mapping {
    map: SharedMap,
    slot: usize,
    /// Where this process writes the segment (its owner's mapping, or a peer's of a segment
    /// made in this process): the byte ranges of its slots that this process's threads are
    /// copying now, shared by every mapping of it here (`busy.rs`), which every copy enters.
    /// `None` for a segment of another process.
    busy: Option<Arc<Busy>>,
}

/// Why a slot access was refused (nothing was copied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not within the slots, or a write to a peer's read-only mapping.
    OutOfRange,
    /// Another thread of this process is copying overlapping bytes of the segment's slots
    /// now (a write beside any access, or a read beside a write).
    Busy,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("slot", &self.slot)
            .field("writable", &self.map.writable())
            .finish()
    }
}

impl Mapping {
    /// A new segment with slots of `slot` bytes (a power of two within the limits), its header
    /// written, sealed and mapped read-write; with the descriptor to pass to the peers.
    /// `probe` is the address and value of a `u64` that lives as long as the arena, which a
    /// peer reads directly to learn whether it can read this process's memory.
    pub(crate) fn create(
        slot: u64,
        rank: usize,
        probe: (u64, u64),
    ) -> io::Result<(OwnedFd, Mapping)> {
        if !slot.is_power_of_two() || !(MIN_SLOT..=MAX_SLOT).contains(&slot) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("arena slots of {slot} bytes"),
            ));
        }
        let fd = rustix::fs::memfd_create(
            "dist-shm-arena",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let len = SLOTS_AT as u64 + 2 * slot;
        rustix::fs::ftruncate(&fd, len)?;
        // Mapped writable before the seals: after them no writable mapping can be made.
        let (token, busy) = busy::for_new_file(&fd)?;
        let m = Mapping::map(&fd, len as usize, slot as usize, Some(busy))?;
        rustix::fs::fcntl_add_seals(&fd, required_seals())?;
        m.store_u64(OFF_TOKEN, token, Ordering::Relaxed);
        m.store_u64(OFF_SLOT, slot, Ordering::Relaxed);
        m.store_u32(OFF_RANK, rank as u32, Ordering::Relaxed);
        m.store_u32(OFF_PID, std::process::id(), Ordering::Relaxed);
        m.store_u64(OFF_PROBE_ADDR, probe.0, Ordering::Relaxed);
        m.store_u64(OFF_PROBE_VALUE, probe.1, Ordering::Relaxed);
        m.store_u32(OFF_VERSION, VERSION, Ordering::Relaxed);
        m.store_u64(OFF_MAGIC, MAGIC, Ordering::Release);
        Ok((fd, m))
    }

    /// Maps, read-only, the segment rank `peer` passed, after checking that it is a sealed
    /// file of a header and two slots of `slot` bytes whose header says so and names `peer`.
    pub(crate) fn open(fd: &OwnedFd, slot: u64, peer: usize) -> Result<Mapping, String> {
        if !slot.is_power_of_two() || !(MIN_SLOT..=MAX_SLOT).contains(&slot) {
            return Err(format!("arena slots of {slot} bytes"));
        }
        let want = SLOTS_AT as u64 + 2 * slot;
        check_sealed(fd, want, required_seals(), "arena segment")?;
        let mut m = Mapping::map(fd, want as usize, slot as usize, None)
            .map_err(|e| format!("mmap: {e}"))?;
        let (magic, version, rank, hslot) = (
            m.load_u64(OFF_MAGIC),
            m.load_u32(OFF_VERSION),
            m.load_u32(OFF_RANK),
            m.load_u64(OFF_SLOT),
        );
        if magic != MAGIC || version != VERSION || rank as usize != peer || hslot != slot {
            return Err(format!(
                "arena header: magic {magic:#x}, version {version}, rank {rank}, slots of \
                 {hslot} bytes (expected {MAGIC:#x}, {VERSION}, {peer}, {slot})"
            ));
        }
        // A segment made in this process (a peer rank of it): its copies are guarded with
        // the owner's record.
        m.busy = busy::for_file(fd, m.load_u64(OFF_TOKEN)).map_err(|e| format!("fstat: {e}"))?;
        Ok(m)
    }

    /// Maps the segment: read-write for its owner, given its new record (`own`), else
    /// read-only and unguarded (`open` then looks for the owner's record).
    fn map(fd: &impl AsFd, len: usize, slot: usize, own: Option<Arc<Busy>>) -> io::Result<Mapping> {
        // SAFETY: `len` is the file's size, which its seals keep: `create` maps the file it
        // made and seals it before any peer sees it (nothing resizes it in between); `open`
        // maps only after `check_sealed`. (Tests: `arena_tests::segments_round_trip`,
        // `hostile_segments_are_refused`.)
        let map = unsafe { SharedMap::new(fd, len, own.is_some())? };
        Ok(Mapping {
            map,
            slot,
            busy: own,
        })
    }

    /// Loads the header's 64-bit word at `off` (a multiple of 8 below [`HEADER`]): a relaxed
    /// atomic load on the owner's writable mapping, a volatile one on a peer's read-only
    /// mapping ([`SharedMap::load_u64`]), then an acquire fence, so that what the owner wrote
    /// before its release store is visible.
    pub(crate) fn load_u64(&self, off: usize) -> u64 {
        assert!(off + 8 <= HEADER, "header offset {off}");
        self.map.load_u64(off)
    }

    /// Loads the header's 32-bit word at `off` (a multiple of 4 below [`HEADER`]), as
    /// [`Mapping::load_u64`].
    pub(crate) fn load_u32(&self, off: usize) -> u32 {
        assert!(off + 4 <= HEADER, "header offset {off}");
        self.map.load_u32(off)
    }

    /// Stores `v` in the header's 64-bit word at `off` with `order`, on the owner's writable
    /// mapping only: false (nothing stored) on a peer's read-only one.
    pub(crate) fn store_u64(&self, off: usize, v: u64, order: Ordering) -> bool {
        if !self.map.writable() {
            return false;
        }
        self.word64(off).store(v, order);
        true
    }

    /// Stores `v` in the header's 32-bit word at `off`, as [`Mapping::store_u64`].
    pub(crate) fn store_u32(&self, off: usize, v: u32, order: Ordering) -> bool {
        if !self.map.writable() {
            return false;
        }
        self.word32(off).store(v, order);
        true
    }

    /// Adds `delta` (wrapping) to the header's 32-bit word at `off`, on the owner's writable
    /// mapping only (false, nothing changed, on a peer's).
    pub(crate) fn add_u32(&self, off: usize, delta: u32) -> bool {
        if !self.map.writable() {
            return false;
        }
        self.word32(off).fetch_add(delta, Ordering::Relaxed);
        true
    }

    /// Sleeps while the header's 32-bit word at `off` holds `seen`, at most `limit` (the
    /// futex only reads the word: any mapping).
    pub(crate) fn wait(&self, off: usize, seen: u32, limit: std::time::Duration) -> io::Result<()> {
        assert!(off + 4 <= HEADER, "header offset {off}");
        super::ring::wait_on(self.map.u32_ptr(off), seen, limit)
    }

    /// Wakes every process sleeping on the header's 32-bit word at `off`.
    pub(crate) fn wake(&self, off: usize) {
        super::ring::wake_all(self.word32(off));
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= HEADER, "header offset {off}");
        self.map.u64_at(off)
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= HEADER, "header offset {off}");
        self.map.u32_at(off)
    }

    /// Whether `len` bytes at `offset` of slot `slot` lie within the slots.
    fn within(&self, slot: usize, offset: usize, len: usize) -> bool {
        slot < 2 && offset.checked_add(len).is_some_and(|end| end <= self.slot)
    }

    /// Copies `data` into slot `slot` at `offset`; refused (nothing copied) if it does not
    /// fit, the mapping is read-only, or another thread is copying overlapping bytes now.
    pub(crate) fn write(&self, slot: usize, offset: usize, data: &[u8]) -> Result<(), Refused> {
        if !self.map.writable() || !self.within(slot, offset, data.len()) {
            return Err(Refused::OutOfRange);
        }
        let start = slot * self.slot + offset;
        let busy = self.busy.as_ref().ok_or(Refused::OutOfRange)?;
        let _entered = busy
            .enter(start, start + data.len(), true)
            .ok_or(Refused::Busy)?;
        // SAFETY: the range is within slot `slot` (checked above), inside the live mapping of
        // `len` bytes; the mapping is writable and shared memory outside every Rust object, so
        // it cannot overlap `data`. Only this process writes the segment (every other mapping
        // is read-only, sealed so), and while `_entered` lives no other thread of it copies
        // overlapping bytes of the segment through any of its mappings in this process (they
        // share `busy`: `busy.rs`), so no two of its threads race on these bytes. (Tests:
        // `arena_tests::segments_round_trip`, `out_of_range_accesses_are_refused`,
        // `overlapping_accesses_from_two_threads_are_refused`,
        // `racing_copies_never_see_a_mix`; split pieces over several threads on real
        // segments: the multi-rank `shm_arena` test's `threads3` variant.)
        //
        // A peer in another process may read these bytes meanwhile (it breaks the protocol, or
        // this process's safe `HostArena::write` ignores it): the copy's stores are volatile
        // on a mapping outside every Rust allocation (`copy::write_shared`), and so are the
        // peer's loads (`read` below), so that gives the peer wrong bytes, never a data race.
        unsafe {
            let at = self.map.ptr().add(SLOTS_AT + start);
            super::copy::write_shared(at, data);
        }
        Ok(())
    }

    /// Copies slot `slot`'s bytes at `offset` into `dst`; refused (nothing copied) if out of
    /// range or, where this process writes the segment, while another of its threads writes
    /// overlapping bytes.
    pub(crate) fn read(&self, slot: usize, offset: usize, dst: &mut [u8]) -> Result<(), Refused> {
        if !self.within(slot, offset, dst.len()) {
            return Err(Refused::OutOfRange);
        }
        let start = slot * self.slot + offset;
        // A segment of another process: no thread of this one writes it, nothing to enter.
        let _entered = match &self.busy {
            Some(busy) => Some(
                busy.enter(start, start + dst.len(), false)
                    .ok_or(Refused::Busy)?,
            ),
            None => None,
        };
        // SAFETY: as in `write`, for reading: the range is within the mapping, and where this
        // process writes the segment no thread of it writes these bytes meanwhile (`busy`).
        // The owner in another process may write them meanwhile only if it breaks the
        // protocol (or its own safe `HostArena::write` ignores it): the copy's loads are
        // volatile on a mapping outside every Rust allocation (`copy::read_shared`), so that
        // is no data race; the copy is then of whatever bytes are there (plain bytes, valid
        // for every element type), never a reference into the mapping. (Tests as for
        // `write`, and `copy::tests`.)
        unsafe {
            let at = self.map.ptr().add(SLOTS_AT + start);
            super::copy::read_shared(at, dst);
        }
        Ok(())
    }

    /// Writes `data` (at most [`SMALL_DATA`] bytes) and `meta` into small area `area` (0 or
    /// 1), then stores `seq` as its word with a release store; refused (nothing written) on a
    /// peer's read-only mapping, where it does not fit, or while another thread of this process
    /// copies the area's bytes. The data goes in as a slot's bytes do ([`Mapping::write`]), the
    /// descriptor and the word as atomic stores of aligned words.
    pub(crate) fn small_put(
        &self,
        area: usize,
        seq: u32,
        meta: [u8; 16],
        data: &[u8],
    ) -> Result<(), Refused> {
        if !self.map.writable() || area >= 2 || data.len() > SMALL_DATA {
            return Err(Refused::OutOfRange);
        }
        let at = SMALL_AT + area * SMALL_STRIDE;
        let busy = self.busy.as_ref().ok_or(Refused::OutOfRange)?;
        let start = self.small_key(area);
        let entered = busy
            .enter(start, start + data.len(), true)
            .ok_or(Refused::Busy)?;
        // SAFETY: as in `write`: the range is within small area `area` (checked above: `data`
        // fits its SMALL_DATA bytes), inside the live writable mapping, outside every Rust
        // allocation; only this process writes the segment, and while `entered` lives no other
        // thread of it copies these bytes (the record `busy`, under the area's own key past
        // the slots'). A peer of another process reading them meanwhile (outside the protocol)
        // reads wrong bytes, never a data race: the stores are volatile (`copy::write_shared`).
        // (Tests: `small_tests`, `collectives::tests::small` through the multi-rank
        // `shm_arena` case.)
        unsafe {
            super::copy::write_shared(self.map.ptr().add(at + SMALL_FIRST), data);
        }
        drop(entered);
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("eight bytes"));
        self.map
            .u64_at(at + SMALL_META)
            .store(word(&meta[..8]), Ordering::Relaxed);
        self.map
            .u64_at(at + SMALL_META + 8)
            .store(word(&meta[8..]), Ordering::Relaxed);
        self.map.u32_at(at).store(seq, Ordering::Release);
        Ok(())
    }

    /// The key of small area `area`'s bytes in the record of copies in progress (`busy.rs`):
    /// past the slots', which count from the first slot's byte 0.
    fn small_key(&self, area: usize) -> usize {
        2 * self.slot + area * SMALL_STRIDE
    }

    /// Small area `area`'s word (a load, then an acquire fence; 0 for an area past the two).
    pub(crate) fn small_seq(&self, area: usize) -> u32 {
        if area >= 2 {
            return 0;
        }
        self.map.load_u32(SMALL_AT + area * SMALL_STRIDE)
    }

    /// The descriptor in small area `area` (zeros for an area past the two).
    pub(crate) fn small_meta(&self, area: usize) -> [u8; 16] {
        let mut out = [0u8; 16];
        if area < 2 {
            let at = SMALL_AT + area * SMALL_STRIDE + SMALL_META;
            out[..8].copy_from_slice(&self.map.load_u64(at).to_le_bytes());
            out[8..].copy_from_slice(&self.map.load_u64(at + 8).to_le_bytes());
        }
        out
    }

    /// Copies small area `area`'s data bytes from `offset` into `dst`, as a slot's bytes are
    /// copied ([`Mapping::read`]); refused (nothing copied) out of range or, where this process
    /// writes the segment, while another of its threads writes the area.
    pub(crate) fn small_read(
        &self,
        area: usize,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), Refused> {
        let end = offset.checked_add(dst.len());
        if area >= 2 || end.is_none_or(|e| e > SMALL_DATA) {
            return Err(Refused::OutOfRange);
        }
        let start = self.small_key(area) + offset;
        let _entered = match &self.busy {
            Some(busy) => Some(
                busy.enter(start, start + dst.len(), false)
                    .ok_or(Refused::Busy)?,
            ),
            None => None,
        };
        // SAFETY: as in `read`: the range is within small area `area`'s data (checked above),
        // inside the live mapping; where this process writes the segment no thread of it writes
        // these bytes meanwhile (`busy`); the owner in another process writes them meanwhile
        // only outside the protocol, and the loads are volatile (`copy::read_shared`): wrong
        // bytes at worst, plain bytes valid for every type, no reference into the mapping.
        // (Tests: `small_tests`, `collectives::tests::small` through the multi-rank
        // `shm_arena` case.)
        unsafe {
            let at = SMALL_AT + area * SMALL_STRIDE + SMALL_FIRST + offset;
            super::copy::read_shared(self.map.ptr().add(at), dst);
        }
        Ok(())
    }

    /// The accesses in progress on this mapping's segment, where this process writes it (for
    /// tests that hold one open).
    #[cfg(test)]
    pub(crate) fn busy(&self) -> Option<&Busy> {
        self.busy.as_deref()
    }
}

#[cfg(test)]
#[path = "small_tests.rs"]
mod small_tests;

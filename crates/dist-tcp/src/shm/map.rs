//! A ring's segment: a sealed `memfd` of a fixed size, mapped shared. The producer makes it
//! ([`Segment::create`]); the consumer maps the descriptor it was passed ([`Segment::open`])
//! only after checking, on the descriptor itself, everything that could make an access fault:
//! its size, and the seals that keep that size for good. No name is ever made in a file system.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{MemfdFlags, SealFlags};

use super::shared_map::{SharedMap, check_sealed};

/// The header in front of the ring's bytes: magic, version, capacity, then the producer's
/// position, the consumer's (with its waiting flag), and the producer's futex word, each on a
/// cache line of its own.
pub(crate) const HEADER: usize = 256;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_CAP: usize = 16;
pub(crate) const OFF_TAIL: usize = 64;
pub(crate) const OFF_HEAD: usize = 128;
pub(crate) const OFF_RX_WAITING: usize = 136;
pub(crate) const OFF_SPACE_SEQ: usize = 192;
pub(crate) const OFF_TX_WAITING: usize = 196;

/// `dist-shm` in ASCII, little-endian.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"dist-shm");
/// The layout's version.
pub(crate) const VERSION: u32 = 1;
/// The smallest and largest ring a peer may offer.
pub(crate) const MIN_CAP: u64 = 4 << 10;
pub(crate) const MAX_CAP: u64 = 64 << 20;

/// The seals a segment must carry before a consumer maps it: its size can never change (a
/// segment that shrinks under a mapping makes accesses past its end fault with `SIGBUS`).
fn required_seals() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// A shared mapping of a segment (read-write on both sides: the consumer writes its position).
pub(crate) struct Segment {
    map: SharedMap,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("len", &self.map.len())
            .finish()
    }
}

impl Segment {
    /// A new segment of `HEADER + cap` bytes with its header written, sealed, and mapped; with
    /// the descriptor to pass to the consumer. `cap` is a power of two within the limits.
    pub(crate) fn create(cap: u64) -> io::Result<(OwnedFd, Segment)> {
        if !cap.is_power_of_two() || !(MIN_CAP..=MAX_CAP).contains(&cap) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a ring of {cap} bytes: not a power of two from {MIN_CAP} to {MAX_CAP}"),
            ));
        }
        let fd = rustix::fs::memfd_create(
            "dist-shm-ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let len = HEADER as u64 + cap;
        rustix::fs::ftruncate(&fd, len)?;
        rustix::fs::fcntl_add_seals(&fd, required_seals())?;
        let seg = Segment::map(&fd, len as usize)?;
        seg.u64_at(OFF_CAP)
            .store(cap, std::sync::atomic::Ordering::Relaxed);
        seg.u32_at(OFF_VERSION)
            .store(VERSION, std::sync::atomic::Ordering::Relaxed);
        // Last: the consumer checks the magic after mapping; the descriptor is passed only
        // after this returns (a system call away, which orders these stores before its read).
        seg.u64_at(OFF_MAGIC)
            .store(MAGIC, std::sync::atomic::Ordering::Release);
        Ok((fd, seg))
    }

    /// Maps a segment a peer passed, after checking that it is a sealed file of exactly
    /// `HEADER + cap` bytes (`cap` as the peer's offer said, within the limits) and that its
    /// header says so too. The error says what was wrong.
    pub(crate) fn open(fd: &OwnedFd, cap: u64) -> Result<Segment, String> {
        if !cap.is_power_of_two() || !(MIN_CAP..=MAX_CAP).contains(&cap) {
            return Err(format!(
                "offered ring of {cap} bytes: not a power of two from {MIN_CAP} to {MAX_CAP}"
            ));
        }
        let want = HEADER as u64 + cap;
        check_sealed(fd, want, required_seals(), "segment")?;
        let seg = Segment::map(fd, want as usize).map_err(|e| format!("mmap: {e}"))?;
        let ord = std::sync::atomic::Ordering::Acquire;
        let (magic, version, hcap) = (
            seg.u64_at(OFF_MAGIC).load(ord),
            seg.u32_at(OFF_VERSION).load(ord),
            seg.u64_at(OFF_CAP).load(ord),
        );
        if magic != MAGIC || version != VERSION || hcap != cap {
            return Err(format!(
                "segment header: magic {magic:#x}, version {version}, capacity {hcap} \
                 (expected {MAGIC:#x}, {VERSION}, {cap})"
            ));
        }
        Ok(seg)
    }

    fn map(fd: &impl AsFd, len: usize) -> io::Result<Segment> {
        // SAFETY: `len` is the file's size, which its seals keep: set by `create` before it
        // maps, checked by `open` (`check_sealed`) before it maps. (Tests:
        // `open_refuses_what_could_fault_or_lie`, `open_checks_the_seals_before_the_size`.)
        let map = unsafe { SharedMap::new(fd, len, true)? };
        Ok(Segment { map })
    }

    /// The header's 64-bit word at `off` (a multiple of 8 below [`HEADER`]).
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= HEADER, "header offset {off}");
        self.map.u64_at(off)
    }

    /// The header's 32-bit word at `off` (a multiple of 4 below [`HEADER`]).
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= HEADER, "header offset {off}");
        self.map.u32_at(off)
    }

    /// The first byte of the ring (after the header); `len() - HEADER` bytes follow.
    pub(crate) fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is longer than HEADER (`create` and `open` check cap ≥ MIN_CAP).
        // (Test: `open_refuses_what_could_fault_or_lie`.)
        unsafe { self.map.ptr().add(HEADER) }
    }

    /// The mapping's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

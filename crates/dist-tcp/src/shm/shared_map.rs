//! What a ring's segment (`map.rs`) and a host arena's (`arena_map.rs`) are both made of: a
//! sealed `memfd` checked before it is mapped ([`check_sealed`]), and its shared mapping
//! ([`SharedMap`]), unmapped on drop, whose header words are reached as atomics.

use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use rustix::fs::SealFlags;
use rustix::mm::{MapFlags, ProtFlags};

/// Checks, on a descriptor a peer passed, what could make an access to its mapping fault: that
/// it carries every seal in `required` (so, with `SHRINK | GROW`, its size can never change),
/// then, sealed, that it is a regular file of exactly `want` bytes. In that order: a size
/// checked before the seals could change in between (a file shrunk under a mapping makes
/// accesses past its end fault with `SIGBUS`). `what` names the segment in the error.
pub(crate) fn check_sealed(
    fd: &impl AsFd,
    want: u64,
    required: SealFlags,
    what: &str,
) -> Result<(), String> {
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("get seals: {e}"))?;
    if !seals.contains(required) {
        return Err(format!(
            "{what} is not sealed with {required:?} ({seals:?})"
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| format!("fstat: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
        || st.st_size as u64 != want
    {
        return Err(format!(
            "{what} is not a file of {want} bytes (size {})",
            st.st_size
        ));
    }
    Ok(())
}

/// A shared mapping of `len` bytes of a file, read-only or read-write, unmapped on drop.
pub(crate) struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value, touched only through atomics
// (`u64_at`, `u32_at`, writable mappings only), volatile word loads (`load_u64`, `load_u32` on
// read-only ones), futex waits by address and raw byte copies through `ptr` by its owners (a ring's one producer
// or consumer, an arena's checked copies), never through references to its bytes, so moving or
// sharing the value between threads races on nothing Rust relies on. (Tests:
// `two_threads_move_checked_bytes`, `segments_round_trip`, a sleeper on another thread.)
unsafe impl Send for SharedMap {}
// SAFETY: as for `Send`: `&SharedMap` gives only atomic access and raw pointers. (Tests: as
// for `Send`.)
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps the first `len` bytes of `fd`, shared, writable if `writable`.
    ///
    /// # Safety
    ///
    /// The file is at least `len` bytes long and stays so for the mapping's life: its seals
    /// keep its size (set by the creator before any peer sees it, checked by [`check_sealed`]
    /// on a descriptor a peer passed), so every byte of the mapping stays backed.
    pub(crate) unsafe fn new(fd: &impl AsFd, len: usize, writable: bool) -> std::io::Result<Self> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh mapping chosen by the kernel (null hint), so it overlaps no Rust
        // object; its bytes stay backed (the caller's contract). It is owned by the returned
        // value and unmapped only by its `Drop`. (Tests: `ring_tests`, `arena_tests`.)
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0)? };
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap gave null"))?;
        Ok(SharedMap { ptr, len, writable })
    }

    /// The address of the `size`-byte word at `off`, checked: a multiple of `size`, within
    /// the mapping.
    fn word(&self, off: usize, size: usize) -> *mut u8 {
        assert!(
            off.is_multiple_of(size) && off.checked_add(size).is_some_and(|e| e <= self.len),
            "word offset {off} of a mapping of {} bytes",
            self.len
        );
        // SAFETY: `off + size <= len` (checked above), so the result is within the mapping.
        // (Test: `out_of_range_accesses_are_refused`.)
        unsafe { self.ptr.as_ptr().add(off) }
    }

    /// The 64-bit word at `off` (a multiple of 8, within the mapping) of a writable mapping;
    /// a read-only one (a peer's arena) is read with [`SharedMap::load_u64`] instead, since
    /// `from_ptr` needs memory valid for writes. Asking it of a read-only mapping is a bug of
    /// this crate's and panics.
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.atomic_u64(off)
            .expect("an atomic over a read-only mapping")
    }

    /// The atomic of [`SharedMap::u64_at`], or `None` on a read-only mapping.
    fn atomic_u64(&self, off: usize) -> Option<&AtomicU64> {
        if !self.writable {
            return None;
        }
        let p = self.word(off, 8);
        // SAFETY: the mapping is page aligned and `p` (checked by `word`) an aligned u64
        // within it, mapped readable and writable (checked above) and live for the borrow of
        // `self`. The other process may change it at any time, which atomics allow; nothing
        // in this process reads it non-atomically. (Tests: `ring_tests`, `arena_tests`.)
        Some(unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    /// The 32-bit word at `off` (a multiple of 4, within the mapping) of a writable mapping,
    /// as [`SharedMap::u64_at`].
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.atomic_u32(off)
            .expect("an atomic over a read-only mapping")
    }

    /// The atomic of [`SharedMap::u32_at`], or `None` on a read-only mapping.
    fn atomic_u32(&self, off: usize) -> Option<&AtomicU32> {
        if !self.writable {
            return None;
        }
        let p = self.word(off, 4);
        // SAFETY: as in `atomic_u64`, for an aligned u32.
        Some(unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    /// Loads the 64-bit word at `off` (a multiple of 8, within the mapping), then an acquire
    /// fence (what the owner wrote before its release store is then visible): a relaxed
    /// atomic load on a writable mapping, a volatile load on a read-only one.
    pub(crate) fn load_u64(&self, off: usize) -> u64 {
        let v = if self.writable {
            self.u64_at(off).load(Ordering::Relaxed)
        } else {
            let p = self.word(off, 8);
            // SAFETY: `p` is an aligned u64 within the mapping (`word`), readable and live for
            // the borrow of `self`. A read-only mapping is a peer's segment: memory outside
            // every Rust allocation, written only by another process (or, for ranks as threads
            // of one process, through that rank's own writable mapping, never this one), so a
            // volatile load sees some value a write left, never undefined behaviour; any u64
            // is valid. (Tests: `arena_tests::segments_round_trip`, `shared_map::tests`.)
            unsafe { std::ptr::read_volatile(p.cast::<u64>()) }
        };
        fence(Ordering::Acquire);
        v
    }

    /// Loads the 32-bit word at `off` (a multiple of 4, within the mapping), as
    /// [`SharedMap::load_u64`].
    pub(crate) fn load_u32(&self, off: usize) -> u32 {
        let v = if self.writable {
            self.u32_at(off).load(Ordering::Relaxed)
        } else {
            let p = self.word(off, 4);
            // SAFETY: as in `load_u64`, for an aligned u32.
            unsafe { std::ptr::read_volatile(p.cast::<u32>()) }
        };
        fence(Ordering::Acquire);
        v
    }

    /// The address of the 32-bit word at `off` (a multiple of 4, within the mapping), for a
    /// futex wait, which only reads it (any mapping).
    pub(crate) fn u32_ptr(&self, off: usize) -> *const u32 {
        self.word(off, 4).cast_const().cast()
    }

    /// The mapping's first byte; [`SharedMap::len`] bytes follow.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping may be written.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, unmapped only here; the
        // atomics borrow `self` and the raw pointers handed out are used only while their
        // owner holds this value, so nothing refers to the mapping after this. (Tests: every
        // ring and arena test maps and drops; `hostile_segments_are_refused`.)
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn maps() -> (SharedMap, SharedMap) {
        let fd = rustix::fs::memfd_create("test", rustix::fs::MemfdFlags::empty()).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        // SAFETY: the file is 4096 bytes and nothing resizes it while the maps live.
        unsafe {
            (
                SharedMap::new(&fd, 4096, true).unwrap(),
                SharedMap::new(&fd, 4096, false).unwrap(),
            )
        }
    }

    /// A read-only mapping's words are read without an atomic over it, and a futex wait on
    /// one returns (its value differs, then a timeout).
    #[test]
    fn read_only_words_are_loaded_and_waited_on() {
        let (w, r) = maps();
        w.u64_at(8).store(0x1122_3344_5566_7788, Ordering::Release);
        w.u32_at(4).store(7, Ordering::Release);
        assert_eq!(r.load_u64(8), 0x1122_3344_5566_7788);
        assert_eq!((r.load_u32(4), w.load_u32(4)), (7, 7));
        let p = r.u32_ptr(4);
        super::super::ring::wait_on(p, 6, std::time::Duration::from_millis(1)).unwrap();
        super::super::ring::wait_on(p, 7, std::time::Duration::from_millis(1)).unwrap();
    }

    /// An atomic over a read-only mapping (which `from_ptr` does not allow) is refused; a
    /// writable mapping gives one.
    #[test]
    fn no_atomic_over_a_read_only_mapping() {
        let (w, r) = maps();
        assert!(r.atomic_u32(4).is_none() && r.atomic_u64(8).is_none());
        assert!(w.atomic_u32(4).is_some() && w.atomic_u64(8).is_some());
    }
}

//! What a ring's segment (`map.rs`) and a host arena's (`arena_map.rs`) are both made of: a
//! sealed `memfd` checked before it is mapped ([`check_sealed`]), and its shared mapping
//! ([`SharedMap`]), unmapped on drop, whose header words are reached as atomics.

use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

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
// (`u64_at`, `u32_at`) and raw byte copies through `ptr` by its owners (a ring's one producer
// or consumer, an arena's checked copies), never through references to its bytes, so moving or
// sharing the value between threads races on nothing Rust relies on.
unsafe impl Send for SharedMap {}
// SAFETY: as for `Send`: `&SharedMap` gives only atomic access and raw pointers.
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

    /// The 64-bit word at `off`: a multiple of 8, within the mapping.
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off.checked_add(8).is_some_and(|e| e <= self.len),
            "word offset {off} of a mapping of {} bytes",
            self.len
        );
        // SAFETY: the mapping is page aligned and `off` (checked above) is an aligned u64
        // within it, live for the borrow of `self`. The other process may change it at any
        // time, which atomics allow; nothing reads it non-atomically.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(off).cast()) }
    }

    /// The 32-bit word at `off`: a multiple of 4, within the mapping.
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off.checked_add(4).is_some_and(|e| e <= self.len),
            "word offset {off} of a mapping of {} bytes",
            self.len
        );
        // SAFETY: as in `u64_at`, for an aligned u32.
        unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(off).cast()) }
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
        // owner holds this value, so nothing refers to the mapping after this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

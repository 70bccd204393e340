//! Copies between this process's memory and a shared mapping that another process may write
//! at the same time (a ring's bytes, an arena's slots): volatile accesses on the shared side,
//! plain ones on the private side.
//!
//! Why volatile: a shared mapping made with `mmap` lies outside every Rust allocation, and a
//! volatile access to such memory is an externally observable event (as for device memory),
//! not a Rust memory access that can take part in a data race. A plain copy
//! (`copy_nonoverlapping`) into or out of it is a non-atomic access, and a peer that writes the
//! same bytes meanwhile (by breaking the protocol) would make it a data race, which Rust does
//! not define. With volatile accesses such a peer can only make the copied bytes wrong, and
//! plain bytes are valid for every element type. The ordering of the protocol still comes from
//! the atomics around each copy (a release store after a producer's copy, an acquire load
//! before a consumer's): the compiler moves no memory access, volatile or not, across them.
//!
//! Speed: volatile accesses are never merged or widened by the compiler, so the word width is
//! what this file chooses, once per process, from what the processor has:
//! - on x86-64 with fast string moves (`ERMS` in CPUID), a copy from [`Choice::string_min`]
//!   bytes up (16 KiB where the processor has 64-byte words, 4 KiB otherwise) is one
//!   `rep movsb`, as glibc's `memcpy` does at such sizes: the processor moves whole cache lines
//!   and, writing whole lines, skips reading them first. The instruction's effect is defined
//!   byte by byte (each byte of the source range read once and written once to the same offset
//!   of the destination range; with fast strings other processors may see the stores in
//!   another order, as they may a loop's), so the asm block does what a loop of volatile byte
//!   accesses does, and is sound for the same reason;
//! - below that, or without fast strings, words of 64 bytes (AVX-512), 32 (AVX2) or 16 (every
//!   x86-64 processor; 8-byte words elsewhere), four to a turn, the stores aligned and the loads
//!   not, the first and last word of the range copied unaligned (overlapping the aligned
//!   middle) so that no byte is copied alone once the range holds a word.
//!
//! Measured on a lent 16-core Xeon with AVX-512 and fast strings (2026-12-07,
//! `docs/results/2026-12-07-1xH200-a9b6a28/`), one core, a hot buffer, against `memcpy`: 64-byte
//! words 1.0-1.36x memcpy's rate from 2 to 16 KiB, and 0.76-0.91x at 1 MiB, where `rep movsb`
//! matches memcpy (0.99-1.01x from 8 KiB to 32 MiB) but is 0.6x at 2 KiB; the 16-byte words
//! this file used before were 0.4x at 2 KiB. Below 1 KiB every method pays a few nanoseconds
//! over memcpy a call.

use std::ptr::{read_unaligned, read_volatile, write_unaligned, write_volatile};

/// A word read or written at any address: a volatile access to it is one unaligned access.
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct Unaligned<T: Copy>(T);

/// Defines a pair of copy routines (`$read`: shared to private, `$write`: private to shared)
/// over words of type `$word`, compiled with the target feature `$feature`. Each takes a range
/// of at least one word.
macro_rules! word_copies {
    ($read:ident, $write:ident, $word:ty, $feature:literal) => {
        /// Copies `n >= size_of::<word>()` bytes from shared `src` to private `d`.
        ///
        /// # Safety
        /// As for [`read_shared`](super::read_shared), with `d` valid for `n` bytes of writes
        /// and `n` at least one word; the processor has `$feature`.
        #[cfg_attr(target_arch = "x86_64", target_feature(enable = $feature))]
        #[allow(unused_unsafe)]
        pub(super) unsafe fn $read(src: *const u8, d: *mut u8, n: usize) {
            const W: usize = std::mem::size_of::<$word>();
            debug_assert!(n >= W);
            // Bytes before `d`'s first `W`-aligned address.
            let head = (W - d as usize % W) % W;
            // SAFETY: every access lies within `src..src + n` (the mapping, caller's contract)
            // or `d..d + n` (the caller's buffer): the first and last words start at 0 and
            // `n - W` (`n >= W`), the loop's at `i` with `i + W <= n`. Shared-side accesses are
            // volatile and unaligned (`Unaligned`, alignment 1); private-side stores in the
            // loop are at `d + i`, `W`-aligned (`i` starts at `head` and moves by `W`), of
            // plain bytes (every bit pattern is a valid word). The two ranges cannot overlap:
            // the shared one is outside every Rust allocation. (Tests:
            // `copy::tests::copies_every_alignment_and_length`, every ring and arena test.)
            unsafe {
                let first = read_volatile(src.cast::<Unaligned<$word>>());
                write_unaligned(d.cast::<$word>(), first.0);
                let mut i = if head == 0 { W } else { head };
                while i + 4 * W <= n {
                    let s = src.add(i).cast::<Unaligned<$word>>();
                    let (a, b, c, e) = (
                        read_volatile(s),
                        read_volatile(s.add(1)),
                        read_volatile(s.add(2)),
                        read_volatile(s.add(3)),
                    );
                    let t = d.add(i).cast::<$word>();
                    t.write(a.0);
                    t.add(1).write(b.0);
                    t.add(2).write(c.0);
                    t.add(3).write(e.0);
                    i += 4 * W;
                }
                while i + W <= n {
                    let w = read_volatile(src.add(i).cast::<Unaligned<$word>>());
                    d.add(i).cast::<$word>().write(w.0);
                    i += W;
                }
                if i < n {
                    let last = read_volatile(src.add(n - W).cast::<Unaligned<$word>>());
                    write_unaligned(d.add(n - W).cast::<$word>(), last.0);
                }
            }
        }

        /// Copies `n >= size_of::<word>()` bytes from private `s` to shared `dst`.
        ///
        /// # Safety
        /// As for [`write_shared`](super::write_shared), with `s` valid for `n` bytes of
        /// reads and `n` at least one word; the processor has `$feature`.
        #[cfg_attr(target_arch = "x86_64", target_feature(enable = $feature))]
        #[allow(unused_unsafe)]
        pub(super) unsafe fn $write(dst: *mut u8, s: *const u8, n: usize) {
            const W: usize = std::mem::size_of::<$word>();
            debug_assert!(n >= W);
            let head = (W - dst as usize % W) % W;
            // SAFETY: as in the read routine, the other way: the shared-side stores are
            // volatile, the loop's at `W`-aligned addresses, the first and last unaligned
            // (`Unaligned`); the private-side loads are plain and unaligned, within `s..s + n`.
            unsafe {
                write_volatile(
                    dst.cast::<Unaligned<$word>>(),
                    Unaligned(read_unaligned(s.cast::<$word>())),
                );
                let mut i = if head == 0 { W } else { head };
                while i + 4 * W <= n {
                    let f = s.add(i).cast::<$word>();
                    let (a, b, c, e) = (
                        read_unaligned(f),
                        read_unaligned(f.add(1)),
                        read_unaligned(f.add(2)),
                        read_unaligned(f.add(3)),
                    );
                    let t = dst.add(i).cast::<$word>();
                    write_volatile(t, a);
                    write_volatile(t.add(1), b);
                    write_volatile(t.add(2), c);
                    write_volatile(t.add(3), e);
                    i += 4 * W;
                }
                while i + W <= n {
                    write_volatile(
                        dst.add(i).cast::<$word>(),
                        read_unaligned(s.add(i).cast::<$word>()),
                    );
                    i += W;
                }
                if i < n {
                    write_volatile(
                        dst.add(n - W).cast::<Unaligned<$word>>(),
                        Unaligned(read_unaligned(s.add(n - W).cast::<$word>())),
                    );
                }
            }
        }
    };
}

/// The word routines.
mod words {
    #[allow(unused_imports)]
    use super::{Unaligned, read_unaligned, read_volatile, write_unaligned, write_volatile};

    word_copies!(read8, write8, u64, "sse2");
    #[cfg(target_arch = "x86_64")]
    word_copies!(read16, write16, std::arch::x86_64::__m128i, "sse2");
    #[cfg(target_arch = "x86_64")]
    word_copies!(read32, write32, std::arch::x86_64::__m256i, "avx2");
    #[cfg(target_arch = "x86_64")]
    word_copies!(read64, write64, std::arch::x86_64::__m512i, "avx512f");
}

/// The smallest copy that is one `rep movsb` where the processor has fast string moves and
/// 64-byte words: below it the words are faster (on the 16-core Xeon measured, 1.0-1.36x
/// memcpy's rate from 2 to 16 KiB, where `rep movsb` starts up slower).
pub(crate) const STRING_MIN_WIDE: usize = 16 << 10;
/// The same with narrower words: glibc's `memcpy` switches to `rep movsb` at 2 KiB per
/// 16 bytes of its vector width (4 KiB with 32-byte vectors).
pub(crate) const STRING_MIN: usize = 4 << 10;

/// How this process copies, chosen once from the processor's features.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Method {
    /// 8-byte words (no 16-byte words on this architecture).
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    Words8,
    /// 16-byte words.
    Words16,
    /// 32-byte words (AVX2).
    Words32,
    /// 64-byte words (AVX-512).
    Words64,
}

/// The copy routines this process uses: the widest words the processor has, and whether
/// long ranges are one `rep movsb`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub(crate) words: Method,
    pub(crate) strings: bool,
}

impl Choice {
    /// The shortest copy made with one `rep movsb` (none without fast strings).
    pub(crate) fn string_min(self) -> Option<usize> {
        match (self.strings, self.words) {
            (false, _) => None,
            (true, Method::Words64) => Some(STRING_MIN_WIDE),
            (true, _) => Some(STRING_MIN),
        }
    }
}

/// This process's [`Choice`], found on first use.
pub(crate) fn choice() -> Choice {
    static CHOICE: std::sync::OnceLock<Choice> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Choice {
    // 64-byte words only with AVX2 beside AVX-512: a copy of 32 to 63 bytes takes the
    // 32-byte routine.
    let words = if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx2")
    {
        Method::Words64
    } else if std::arch::is_x86_feature_detected!("avx2") {
        Method::Words32
    } else {
        Method::Words16
    };
    // CPUID leaf 7, EBX bit 9: enhanced REP MOVSB/STOSB.
    let strings = std::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 9) != 0;
    Choice { words, strings }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Choice {
    Choice {
        words: Method::Words8,
        strings: false,
    }
}

/// Copies `n` bytes from `src` to `d` one by one, reading volatile (`n` below a word).
///
/// # Safety
/// As for the word routines, for any `n`.
unsafe fn read_bytes(src: *const u8, d: *mut u8, n: usize) {
    for i in 0..n {
        // SAFETY: `i < n`, within both ranges (caller's contract); a volatile byte load.
        unsafe { *d.add(i) = read_volatile(src.add(i)) };
    }
}

/// Copies `n` bytes from `s` to `dst` one by one, writing volatile (`n` below a word).
///
/// # Safety
/// As for the word routines, for any `n`.
unsafe fn write_bytes(dst: *mut u8, s: *const u8, n: usize) {
    for i in 0..n {
        // SAFETY: `i < n`, within both ranges (caller's contract); a volatile byte store.
        unsafe { write_volatile(dst.add(i), *s.add(i)) };
    }
}

/// One `rep movsb`: copies `n` bytes from `src` to `dst`.
///
/// # Safety
/// `src..src + n` is readable and `dst..dst + n` writable; the ranges do not overlap; one of
/// them lies in a shared mapping outside every Rust allocation, the other is not reached
/// through a Rust reference other than the caller's exclusive one while the copy runs.
#[cfg(target_arch = "x86_64")]
unsafe fn move_string(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the instruction reads `src..src + n` and writes `dst..dst + n` (the direction
    // flag is clear on entry to every asm block, by Rust's rules, so the ranges run upwards
    // from the pointers; this one leaves it so), each byte read once and written once by its
    // definition, which is what a loop of volatile byte accesses does; the ranges are valid
    // (caller's contract). It touches no stack and no flags. (Test:
    // `copy::tests::long_copies_by_every_method`, whose lengths reach both thresholds.)
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") dst => _,
            inout("rsi") src => _,
            options(nostack, preserves_flags),
        );
    }
}

/// Copies `dst.len()` bytes from `src` (shared memory) into `dst`.
///
/// # Safety
/// `src..src + dst.len()` lies within one live shared mapping (made with `mmap`, so outside
/// every Rust allocation) that this process may read; nothing of it is reached through a Rust
/// reference while the copy runs.
pub(crate) unsafe fn read_shared(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller's contract, and `dst` is a buffer of `dst.len()` bytes that nothing
    // else reaches while this `&mut` lives.
    unsafe { read_with(choice(), src, dst.as_mut_ptr(), dst.len()) }
}

/// Copies `src` into shared memory at `dst`.
///
/// # Safety
/// `dst..dst + src.len()` lies within one live shared mapping (made with `mmap`, so outside
/// every Rust allocation) that this process may write; nothing of it is reached through a Rust
/// reference while the copy runs.
pub(crate) unsafe fn write_shared(dst: *mut u8, src: &[u8]) {
    // SAFETY: the caller's contract, and `src` is a buffer of `src.len()` bytes.
    unsafe { write_with(choice(), dst, src.as_ptr(), src.len()) }
}

/// [`read_shared`] by the given method.
///
/// # Safety
/// As for [`read_shared`], `d` valid for `n` bytes of writes; the processor has what `c`
/// names (a [`choice`], or a narrower one).
unsafe fn read_with(c: Choice, src: *const u8, d: *mut u8, n: usize) {
    // SAFETY: the caller's contract; each routine is called only with `n` at least its word
    // and only with a feature the choice found (or a narrower one, which every processor with
    // the wider has).
    unsafe {
        #[cfg(target_arch = "x86_64")]
        {
            if c.string_min().is_some_and(|min| n >= min) {
                return move_string(d, src, n);
            }
            if n >= 64 && c.words == Method::Words64 {
                return words::read64(src, d, n);
            }
            if n >= 32 && matches!(c.words, Method::Words32 | Method::Words64) {
                return words::read32(src, d, n);
            }
            if n >= 16 {
                return words::read16(src, d, n);
            }
        }
        let _ = c;
        if n >= 8 {
            words::read8(src, d, n)
        } else {
            read_bytes(src, d, n)
        }
    }
}

/// [`write_shared`] by the given method.
///
/// # Safety
/// As for [`write_shared`], `s` valid for `n` bytes of reads; the processor has what `c`
/// names.
unsafe fn write_with(c: Choice, dst: *mut u8, s: *const u8, n: usize) {
    // SAFETY: as in `read_with`.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        {
            if c.string_min().is_some_and(|min| n >= min) {
                return move_string(dst, s, n);
            }
            if n >= 64 && c.words == Method::Words64 {
                return words::write64(dst, s, n);
            }
            if n >= 32 && matches!(c.words, Method::Words32 | Method::Words64) {
                return words::write32(dst, s, n);
            }
            if n >= 16 {
                return words::write16(dst, s, n);
            }
        }
        let _ = c;
        if n >= 8 {
            words::write8(dst, s, n)
        } else {
            write_bytes(dst, s, n)
        }
    }
}

#[cfg(test)]
mod tests;

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
//! Speed: both ways copy 16-byte words (the widest that every x86-64 processor has; 8-byte
//! words elsewhere), four to a turn, with the stores aligned and the loads not (a store that
//! crosses a cache line costs more than such a load): a volatile unaligned load of shared memory
//! into aligned private memory, or a plain unaligned load of private memory into an aligned
//! volatile store. Volatile accesses are never merged or widened by the compiler, so the word
//! width is what this routine chooses. Measured against `copy_nonoverlapping` on the 2-core
//! development machine (best of many, 4 KiB to 4 MiB, aligned and misaligned sides): within
//! its noise, except 65 KiB reads, about a tenth slower.

use std::ptr::{read_unaligned, read_volatile, write_volatile};

#[cfg(target_arch = "x86_64")]
type Word = std::arch::x86_64::__m128i;
#[cfg(not(target_arch = "x86_64"))]
type Word = u64;

/// A word read from any address: a volatile read of it is one unaligned load.
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct Unaligned(Word);

const W: usize = std::mem::size_of::<Word>();

/// Copies `dst.len()` bytes from `src` (shared memory) into `dst`.
///
/// # Safety
/// `src..src + dst.len()` lies within one live shared mapping (made with `mmap`, so outside
/// every Rust allocation) that this process may read; nothing of it is reached through a Rust
/// reference while the copy runs.
pub(crate) unsafe fn read_shared(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let d = dst.as_mut_ptr();
    let head = d.align_offset(W).min(n);
    let mut i = 0;
    // SAFETY: every `src.add(i..i + k)` read stays below `src + n` (the loop bounds), within
    // the mapping (caller's contract), read as bytes or `Unaligned` words (alignment 1). Every
    // `d.add(..)` write stays within `dst`, a `&mut [u8]` of `n` bytes; the word writes are at
    // `W`-aligned addresses (after `head` bytes `d + i` is aligned, and `i` moves by multiples
    // of `W`), of plain bytes (any bit pattern is a valid `Word`). The shared side
    // is outside every Rust allocation, so it cannot overlap `dst`. (Tests:
    // `copy::tests::copies_every_alignment_and_length`, and every ring and arena test.)
    unsafe {
        while i < head {
            *d.add(i) = read_volatile(src.add(i));
            i += 1;
        }
        while i + 4 * W <= n {
            let s = src.add(i).cast::<Unaligned>();
            let (a, b, c, e) = (
                read_volatile(s),
                read_volatile(s.add(1)),
                read_volatile(s.add(2)),
                read_volatile(s.add(3)),
            );
            let t = d.add(i).cast::<Word>();
            t.write(a.0);
            t.add(1).write(b.0);
            t.add(2).write(c.0);
            t.add(3).write(e.0);
            i += 4 * W;
        }
        while i + W <= n {
            let w = read_volatile(src.add(i).cast::<Unaligned>());
            d.add(i).cast::<Word>().write(w.0);
            i += W;
        }
        while i < n {
            *d.add(i) = read_volatile(src.add(i));
            i += 1;
        }
    }
}

/// Copies `src` into shared memory at `dst`.
///
/// # Safety
/// `dst..dst + src.len()` lies within one live shared mapping (made with `mmap`, so outside
/// every Rust allocation) that this process may write; nothing of it is reached through a Rust
/// reference while the copy runs.
pub(crate) unsafe fn write_shared(dst: *mut u8, src: &[u8]) {
    let n = src.len();
    let s = src.as_ptr();
    let head = dst.align_offset(W).min(n);
    let mut i = 0;
    // SAFETY: as in `read_shared`, the other way: the volatile word writes are at `W`-aligned
    // addresses within the mapping (caller's contract), the unaligned plain reads within `src`.
    // (Tests: `copy::tests::copies_every_alignment_and_length`, and every ring and arena test.)
    unsafe {
        while i < head {
            write_volatile(dst.add(i), *s.add(i));
            i += 1;
        }
        while i + 4 * W <= n {
            let f = s.add(i).cast::<Word>();
            let (a, b, c, e) = (
                read_unaligned(f),
                read_unaligned(f.add(1)),
                read_unaligned(f.add(2)),
                read_unaligned(f.add(3)),
            );
            let t = dst.add(i).cast::<Word>();
            write_volatile(t, a);
            write_volatile(t.add(1), b);
            write_volatile(t.add(2), c);
            write_volatile(t.add(3), e);
            i += 4 * W;
        }
        while i + W <= n {
            write_volatile(
                dst.add(i).cast::<Word>(),
                read_unaligned(s.add(i).cast::<Word>()),
            );
            i += W;
        }
        while i < n {
            write_volatile(dst.add(i), *s.add(i));
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{read_shared, write_shared};

    /// Every length up to a few turns of four words, at every alignment of both sides, into and
    /// out of a real shared mapping; the bytes around each copy stay untouched.
    #[test]
    fn copies_every_alignment_and_length() {
        let fd =
            rustix::fs::memfd_create("dist-copy-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        // SAFETY: the file was just made 4096 bytes long and nothing resizes it.
        let map = unsafe { super::super::shared_map::SharedMap::new(&fd, 4096, true).unwrap() };
        let base = map.ptr();
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 1) as u8).collect();
        for len in 0..160 {
            for at in 0..17 {
                for from in 0..17 {
                    let mut back = vec![0u8; len + 34];
                    // SAFETY: `at + len + 1 <= 4096`, within the live mapping; the test
                    // holds no reference into it.
                    unsafe {
                        std::ptr::write_bytes(base, 0xee, 512);
                        write_shared(base.add(at), &src[from..from + len]);
                        read_shared(base.add(at), &mut back[from..from + len]);
                        assert_eq!(*base.add(at + len), 0xee, "len {len} at {at}");
                        if at > 0 {
                            assert_eq!(*base.add(at - 1), 0xee, "len {len} at {at}");
                        }
                    }
                    assert_eq!(back[from..from + len], src[from..from + len]);
                    assert!(back[..from].iter().all(|&b| b == 0));
                    assert!(back[from + len..].iter().all(|&b| b == 0));
                }
            }
        }
    }
}

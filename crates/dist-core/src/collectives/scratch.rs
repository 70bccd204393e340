//! Memory for the collectives: the per-thread scratch buffer, byte views of typed slices, and
//! the cutting of a buffer into segments and disjoint pairs of them.

use std::cell::RefCell;

use crate::types::Element;

thread_local! {
    /// Scratch space reused across calls, so that no collective allocates per step (nor, once
    /// warm, per call). `u64` backing keeps it aligned for every element type.
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a scratch slice of `len` elements.
pub(super) fn with_scratch<T: Element, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let bytes = len * std::mem::size_of::<T>();
    let words = bytes.div_ceil(8);
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < words {
                v.resize(words, 0);
            }
            let b: &mut [u8] = bytemuck::cast_slice_mut(&mut v[..words]);
            f(bytemuck::cast_slice_mut(&mut b[..bytes]))
        }
        // Only if a collective runs inside another on one thread: use fresh memory.
        Err(_) => {
            let mut v = vec![0u64; words];
            let b: &mut [u8] = bytemuck::cast_slice_mut(&mut v[..]);
            f(bytemuck::cast_slice_mut(&mut b[..bytes]))
        }
    })
}

pub(super) fn bytes<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

pub(super) fn bytes_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

/// Two disjoint ranges of one slice, the first shared and the second mutable.
pub(super) fn split_pair<T>(
    x: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    // `a` before `b` (an empty `a` at `b`'s start counts as before it).
    if a.end <= b.start {
        let (lo, hi) = x.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = x.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// The element range of segment `i` when `count` elements are cut into `n` near-equal parts.
pub(super) fn segment(count: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    // 128-bit so that huge counts times n cannot overflow.
    let at = |k: usize| (k as u128 * count as u128 / n as u128) as usize;
    at(i)..at(i + 1)
}

/// `data` cut into `n` near-equal segments, in order (segment `i` is `segment(len, n, i)`).
pub(super) fn segments<T>(data: &mut [T], n: usize) -> Vec<&mut [T]> {
    let len = data.len();
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    for i in 0..n {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(segment(len, n, i).len());
        out.push(head);
        rest = tail;
    }
    out
}

/// Two distinct segments: `a` shared and `b` mutable.
pub(super) fn seg_pair<'s, T>(
    segs: &'s mut [&mut [T]],
    a: usize,
    b: usize,
) -> (&'s [T], &'s mut [T]) {
    debug_assert_ne!(a, b, "one segment twice");
    if a < b {
        let (lo, hi) = segs.split_at_mut(b);
        (&*lo[a], &mut *hi[0])
    } else {
        let (lo, hi) = segs.split_at_mut(a);
        (&*hi[0], &mut *lo[b])
    }
}

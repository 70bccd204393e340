//! Recursive halving and doubling (Rabenseifner's all_reduce) for large buffers on many ranks:
//! a reduce-scatter by recursive halving, then an all-gather by recursive doubling. Each rank
//! takes ⌈log₂ n⌉ steps in each half (plus one before and one after where `n` is not a power of
//! two) and talks to at most ⌊log₂ n⌋ + 1 partners, where the ring takes 2 (n − 1) steps; both
//! move about 2 (n − 1) / n of the buffer per rank.
//!
//! Determinism: every block of the result is reduced on one rank only (the one that owns it
//! after the halving) and copied from there to every other, so every rank ends with the same
//! bits whatever the reduce op and element type.

use std::ops::Range;

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::call::{Call, finish};
use super::consts::COLLECTIVE_TAG;
use super::scratch::{bytes, bytes_mut, split_pair, with_scratch};

/// How `n` ranks map onto the largest power of two `p <= n` (the fold of recursive doubling):
/// of the first `2 (n - p)` ranks, each even one hands its data to the odd one above it and
/// sits the middle part out; every other rank is one of the `p` virtual ranks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Fold {
    /// The power of two.
    pub(super) p: usize,
    /// How many ranks sit out, `n - p`.
    pub(super) rem: usize,
}

impl Fold {
    pub(super) fn new(n: usize) -> Fold {
        let p = 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
        Fold { p, rem: n - p }
    }

    /// Whether `rank` takes part in a fold (an even one hands its data over, an odd one takes).
    pub(super) fn folds(&self, rank: usize) -> bool {
        rank < 2 * self.rem
    }

    /// The virtual rank of `rank`, or `None` for one that sits the middle part out.
    pub(super) fn virt(&self, rank: usize) -> Option<usize> {
        if self.folds(rank) {
            (rank % 2 == 1).then_some(rank / 2)
        } else {
            Some(rank - self.rem)
        }
    }

    /// The real rank of virtual rank `v`.
    pub(super) fn real(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }
}

/// The element range of blocks `lo..hi` when `len` elements are cut into `p` blocks.
fn blocks(len: usize, p: usize, lo: usize, hi: usize) -> Range<usize> {
    let at = |k: usize| (k as u128 * len as u128 / p as u128) as usize;
    at(lo)..at(hi)
}

/// Element range `k` of pieces of `piece` elements over `len` elements (empty past the end).
fn part(k: usize, piece: usize, len: usize) -> Range<usize> {
    let lo = (k * piece).min(len);
    lo..(lo + piece).min(len)
}

/// How many messages carry `len` elements in pieces of `piece`: at least one (possibly empty),
/// so that both sides of an exchange always agree.
fn pieces(len: usize, piece: usize) -> usize {
    len.div_ceil(piece).max(1)
}

/// One step of the halving: sends `out` to `peer` while receiving the peer's part of the same
/// place as `acc` and reducing it in (`acc = acc op theirs`), in pieces of `tmp.len() / 2`
/// elements, each received into one half of `tmp` while the previous one is reduced. An empty
/// `out` (or `acc`) only receives (or only sends). `peer` does the same with the roles swapped,
/// so both agree on every message's size.
fn exchange_reduce<T: Element, L: Link>(
    c: &Call<'_, L>,
    peer: usize,
    out: Option<&[T]>,
    mut acc: Option<&mut [T]>,
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let piece = (tmp.len() / 2).max(1);
    let sn = out.map_or(0, |o| pieces(o.len(), piece));
    let alen = acc.as_ref().map_or(0, |a| a.len());
    let rn = if acc.is_some() {
        pieces(alen, piece)
    } else {
        0
    };
    let (t0, t1) = tmp.split_at_mut(tmp.len() / 2);
    let mut bufs = [t0, t1];
    // The piece received but not yet reduced, in `bufs[(k - 1) % 2]`.
    let mut pending: Option<Range<usize>> = None;
    for k in 0..sn.max(rn) {
        let [b0, b1] = &mut bufs;
        let (into, other) = if k % 2 == 0 { (b0, b1) } else { (b1, b0) };
        let posted = if k < rn {
            let r = part(k, piece, alen);
            Some((
                c.post(COLLECTIVE_TAG, bytes_mut(&mut into[..r.len()]), peer)?,
                r,
            ))
        } else {
            None
        };
        if let Some(o) = out
            && k < sn
        {
            let data = bytes(&o[part(k, piece, o.len())]);
            match &posted {
                Some((p, _)) => c.send_beside(data, peer, p)?,
                None => c.send(data, peer)?,
            }
        }
        if let (Some(r), Some(a)) = (pending.take(), acc.as_deref_mut()) {
            c.reduce(&mut a[r.clone()], &other[..r.len()], op)?;
        }
        if let Some((p, r)) = posted {
            c.wait(p)?;
            pending = Some(r);
        }
    }
    if let (Some(r), Some(a)) = (pending, acc) {
        let last = &bufs[(rn - 1) % 2];
        c.reduce(&mut a[r.clone()], &last[..r.len()], op)?;
    }
    Ok(())
}

/// The all-gather by recursive doubling, over `region`: the blocks `first..first + 2 * mask` of
/// the buffer's `len` elements cut into `f.p` blocks (all of them at the top, `mask = f.p / 2`), of which
/// virtual rank `v` holds its own, reduced. At each level the rank holds the half of the
/// region on its side of `mask` and trades it for the other half with its partner `v ^ mask`.
///
/// Every level's receive is posted before any is sent (this level's, then the inner levels'
/// on the way down; the sends go on the way back up, innermost first): a partner's blocks
/// land in place whenever they come. Posted one step at a time, a receive came after its
/// message whenever the partner was ahead, which on a crowded host was most of the time: the
/// message then waited in the socket, and was copied into fresh memory once its grace passed.
fn gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    f: Fold,
    len: usize,
    v: usize,
    region: &mut [T],
    first: usize,
    mask: usize,
) -> Result<()> {
    if mask == 0 {
        return Ok(());
    }
    let at = |k: usize| blocks(len, f.p, 0, k).end;
    let (lower, upper) = region.split_at_mut(at(first + mask) - at(first));
    let (mine, theirs, mine_first) = if v & mask == 0 {
        (lower, upper, first)
    } else {
        (upper, lower, first + mask)
    };
    let partner = f.real(v ^ mask);
    let theirs = c.post(COLLECTIVE_TAG, bytes_mut(theirs), partner)?;
    gather(c, f, len, v, mine, mine_first, mask / 2)?;
    c.send_beside(bytes(mine), partner, &theirs)?;
    c.wait(theirs)
}

/// all_reduce of `data` by recursive halving and doubling. `data` is already premultiplied for
/// `PreMulSum`; `Avg` is applied here. Works for any number of elements (blocks may be empty)
/// and any world size.
pub(super) fn all_reduce_halving<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (me, n, len) = (c.me, c.n, data.len());
    let f = Fold::new(n);
    // Pieces of the ring's size, or less for a small buffer; every rank computes the same.
    let piece = c.ring_piece::<T>().min(len.div_ceil(2)).max(1);
    with_scratch::<T, _>(2 * piece, |tmp| {
        // Fold in: the even rank's whole buffer goes into the odd one's.
        if f.folds(me) {
            if me % 2 == 0 {
                exchange_reduce(c, me + 1, Some(&*data), None, op, tmp)?;
            } else {
                exchange_reduce(c, me - 1, None, Some(&mut *data), op, tmp)?;
            }
        }
        if let Some(v) = f.virt(me) {
            // Reduce-scatter: this rank keeps the half of its blocks on its side of `mask` and
            // gives the other half to its partner, until it holds block `v` reduced.
            let (mut lo, mut hi) = (0, f.p);
            let mut mask = f.p / 2;
            while mask > 0 {
                let partner = f.real(v ^ mask);
                let mid = lo + mask;
                let (keep, give) = if v & mask == 0 {
                    ((lo, mid), (mid, hi))
                } else {
                    ((mid, hi), (lo, mid))
                };
                let (out, acc) = split_pair(
                    data,
                    blocks(len, f.p, give.0, give.1),
                    blocks(len, f.p, keep.0, keep.1),
                );
                exchange_reduce(c, partner, Some(out), Some(acc), op, tmp)?;
                (lo, hi) = keep;
                mask >>= 1;
            }
            finish(&mut data[blocks(len, f.p, v, v + 1)], op, n);
            gather(c, f, len, v, data, 0, f.p / 2)?;
        }
        // Fold out: the odd rank hands the result back.
        if f.folds(me) {
            if me % 2 == 1 {
                c.send(bytes(data), me - 1)?;
            } else {
                c.recv(bytes_mut(data), me + 1)?;
            }
        }
        Ok(())
    })
}

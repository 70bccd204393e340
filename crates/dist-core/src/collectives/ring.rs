//! The rings: reduce-scatter (in place, and out of place), all-gather, and the ring all_reduce
//! (one ring, or two at once in opposite directions). A ring step moves its segment in pieces;
//! each piece is one straight-line exchange: post the receive, send, reduce the previous piece
//! while this one travels, wait.

use std::ops::Range;

use crate::backend::Tag;
use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::call::{Call, finish, premul};
use super::consts::{COLLECTIVE_TAG, SECOND_RING_TAG, TWO_RINGS_MIN};
use super::lanes::{two_lanes, two_rings};
use super::scratch::{bytes, bytes_mut, seg_pair, segments, split_pair, with_scratch};

/// One ring through all ranks: this rank's position on it, its neighbours and the tag its
/// messages travel on. Segment `i` of a ring's data belongs to position `i`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ring {
    pub(super) pos: usize,
    pub(super) right: usize,
    pub(super) left: usize,
    pub(super) tag: Tag,
    reversed: bool,
}

impl Ring {
    /// Ranks in order: position `r` is rank `r`, sending to `r + 1`.
    pub(super) fn forward(me: usize, n: usize) -> Ring {
        Ring {
            pos: me,
            right: (me + 1) % n,
            left: (me + n - 1) % n,
            tag: COLLECTIVE_TAG,
            reversed: false,
        }
    }

    /// Ranks in reverse order, on the second ring's tag: position `p` is rank `(n - p) % n`,
    /// sending to rank `r - 1`. Beside a forward ring it uses each connection's other direction.
    pub(super) fn backward(me: usize, n: usize) -> Ring {
        Ring {
            pos: (n - me) % n,
            right: (me + n - 1) % n,
            left: (me + 1) % n,
            tag: SECOND_RING_TAG,
            reversed: true,
        }
    }

    /// The position of `rank` on this ring of `n` ranks.
    pub(super) fn position_of(&self, rank: usize, n: usize) -> usize {
        if self.reversed { (n - rank) % n } else { rank }
    }
}

/// `buf`'s `n` blocks of `k` elements, each cut in two: the first parts in block order for a
/// forward ring, and the second parts ordered for a backward ring (its position `p` gets block
/// `(n - p) % n`, the block of the rank at that position). With these, rank `r` owns (or ends
/// with) both halves of block `r`.
pub(super) fn halves<T>(buf: &mut [T], n: usize, k: usize) -> (Vec<&mut [T]>, Vec<&mut [T]>) {
    let h = k / 2;
    let (mut first, mut second) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for block in segments(buf, n) {
        let (a, b) = block.split_at_mut(h);
        first.push(a);
        second.push(b);
    }
    let backward = (0..n)
        .map(|p| std::mem::take(&mut second[(n - p) % n]))
        .collect();
    (first, backward)
}

/// Element range `k` of pieces of `piece` elements over `len` elements (empty past the end).
fn part(k: usize, piece: usize, len: usize) -> Range<usize> {
    let lo = (k * piece).min(len);
    lo..(lo + piece).min(len)
}

/// Ring reduce-scatter in place over `segs`, the ring's `n` segments: afterwards the rank at
/// position `p` holds the full reduction of segment `(p + off) % n`. `tmp` holds two pieces
/// (2 × the ring piece, or twice the longest segment if that is less).
pub(super) fn ring_reduce_scatter<T: Element, L: Link>(
    c: &Call<'_, L>,
    ring: Ring,
    segs: &mut [&mut [T]],
    op: ReduceOp,
    off: usize,
    tmp: &mut [T],
) -> Result<()> {
    let (p, n) = (ring.pos, c.n);
    // Each step's segment moves in pieces, each received into one of two scratch buffers in
    // turn; a piece is reduced while the next one travels, still in cache from its arrival.
    let piece = c.ring_piece::<T>().min(tmp.len() / 2).max(1);
    let (tmp0, tmp1) = tmp.split_at_mut(tmp.len() / 2);
    let mut bufs = [tmp0, tmp1];
    // The piece received but not yet reduced: its segment, its range there, and its buffer.
    let mut pending: Option<(usize, Range<usize>, usize)> = None;
    let mut cur = 0;
    // Every step moves as many pieces as the longest segment needs, on every rank: a rank and
    // its neighbour must agree on the number of messages, and their segments can differ by an
    // element (a step of 4,097 elements next to one of 4,096 in 128-element pieces: 33 pieces
    // against 32, and the 33rd message met the next step's first).
    let longest = segs.iter().map(|s| s.len()).max().unwrap_or(0);
    let pieces = longest.div_ceil(piece).max(1);
    for s in 0..n - 1 {
        let si = (p + off + 2 * n - 1 - s) % n;
        let ri = (p + off + 2 * n - 2 - s) % n;
        let (slen, rlen) = (segs[si].len(), segs[ri].len());
        for k in 0..pieces {
            let (sp, rp) = (part(k, piece, slen), part(k, piece, rlen));
            // A piece about to be sent must be reduced first (a step's first piece can be the
            // previous step's last).
            if let Some((pi, pr, pb)) = pending.clone()
                && pi == si
                && pr.start < sp.end
                && sp.start < pr.end
            {
                c.reduce(&mut segs[pi][pr.clone()], &bufs[pb][..pr.len()], op)?;
                pending = None;
            }
            let [b0, b1] = &mut bufs;
            let (into, other) = if cur == 0 { (b0, b1) } else { (b1, b0) };
            let r = c.post(ring.tag, bytes_mut(&mut into[..rp.len()]), ring.left)?;
            match pending.take() {
                Some((pi, pr, _)) => {
                    let (out, acc) = if pi == si {
                        split_pair(&mut *segs[si], sp, pr)
                    } else {
                        let (o, a) = seg_pair(segs, si, pi);
                        (&o[sp], &mut a[pr])
                    };
                    c.send_beside(bytes(out), ring.right, &r)?;
                    c.reduce(acc, &other[..acc.len()], op)?;
                }
                None => c.send_beside(bytes(&segs[si][sp]), ring.right, &r)?,
            }
            c.wait(r)?;
            pending = Some((ri, rp, cur));
            cur ^= 1;
        }
    }
    if let Some((pi, pr, pb)) = pending {
        c.reduce(&mut segs[pi][pr.clone()], &bufs[pb][..pr.len()], op)?;
    }
    Ok(())
}

/// Ring reduce-scatter out of place: `input` is this rank's contribution as the ring's `n`
/// segments, all of `acc.len()` elements, and is only read; afterwards `acc` holds the full
/// reduction of segment `pos` (premultiplied for `PreMulSum`, not yet averaged). `acc` also
/// carries, piece by piece, the partial sums between steps: a piece is sent before the next
/// step's piece of the same place is reduced into it. `tmp` as for [`ring_reduce_scatter`].
pub(super) fn ring_reduce_scatter_out<T: Element, L: Link>(
    c: &Call<'_, L>,
    ring: Ring,
    input: &[&[T]],
    acc: &mut [T],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let (p, n, len) = (ring.pos, c.n, acc.len());
    let piece = c.ring_piece::<T>().min(tmp.len() / 2).max(1);
    let (tmp0, tmp1) = tmp.split_at_mut(tmp.len() / 2);
    let mut bufs = [tmp0, tmp1];
    // acc[range] = this rank's part of segment `seg` there, op the partial sum in `buf`.
    let fold = |acc: &mut [T], seg: usize, range: Range<usize>, buf: &[T]| {
        acc.copy_from_slice(&input[seg][range]);
        premul(acc, op);
        c.reduce(acc, buf, op)
    };
    // The first step sends this rank's own part of the segment before its own.
    acc.copy_from_slice(input[(p + n - 1) % n]);
    premul(acc, op);
    let pieces = len.div_ceil(piece).max(1);
    // The piece received but not yet folded: its segment, its range and its buffer.
    let mut pending: Option<(usize, Range<usize>, usize)> = None;
    let mut cur = 0;
    for s in 0..n - 1 {
        let ri = (p + 2 * n - 2 - s) % n;
        for k in 0..pieces {
            let r = part(k, piece, len);
            // A step's first piece can be the previous step's last: fold it before sending.
            if let Some((pi, pr, pb)) = pending.clone()
                && pr.start < r.end
                && r.start < pr.end
            {
                fold(&mut acc[pr.clone()], pi, pr.clone(), &bufs[pb][..pr.len()])?;
                pending = None;
            }
            let [b0, b1] = &mut bufs;
            let (into, other) = if cur == 0 { (b0, b1) } else { (b1, b0) };
            let posted = c.post(ring.tag, bytes_mut(&mut into[..r.len()]), ring.left)?;
            match pending.take() {
                Some((pi, pr, _)) => {
                    let (out, dst) = split_pair(acc, r.clone(), pr.clone());
                    c.send_beside(bytes(out), ring.right, &posted)?;
                    fold(dst, pi, pr.clone(), &other[..pr.len()])?;
                }
                None => c.send_beside(bytes(&acc[r.clone()]), ring.right, &posted)?,
            }
            c.wait(posted)?;
            pending = Some((ri, r, cur));
            cur ^= 1;
        }
    }
    if let Some((pi, pr, pb)) = pending {
        fold(&mut acc[pr.clone()], pi, pr.clone(), &bufs[pb][..pr.len()])?;
    }
    Ok(())
}

/// Ring all-gather in place over `segs`: the rank at position `p` holds segment
/// `(p + off) % n`; afterwards all do.
pub(super) fn ring_all_gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    ring: Ring,
    segs: &mut [&mut [T]],
    off: usize,
) -> Result<()> {
    let (p, n) = (ring.pos, c.n);
    for s in 0..n - 1 {
        let si = (p + off + n - s) % n;
        let ri = (p + off + 2 * n - s - 1) % n;
        let (out, inb) = seg_pair(segs, si, ri);
        c.send_recv_on(ring.tag, bytes(out), ring.right, bytes_mut(inb), ring.left)?;
    }
    Ok(())
}

/// all_reduce of `data` around one ring: reduce-scatter, then all-gather.
fn ring_lane<T: Element, L: Link>(
    c: &Call<'_, L>,
    ring: Ring,
    data: &mut [T],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let mut segs = segments(data, c.n);
    ring_reduce_scatter(c, ring, &mut segs, op, 1, tmp)?;
    finish(segs[(ring.pos + 1) % c.n], op, c.n);
    ring_all_gather(c, ring, &mut segs, 1)
}

/// all_reduce of a large buffer: one ring, or with two lanes two at once.
pub(super) fn all_reduce_ring<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    // Two scratch pieces per ring (see ring_reduce_scatter).
    let scratch = 2 * c.ring_piece::<T>().min(data.len());
    // Two rings at once, in opposite directions, each on its own thread with half the data:
    // every connection carries data both ways, and two cores reduce. With two ranks both rings
    // would share the one connection, so there it runs one.
    if two_rings(c, std::mem::size_of_val(data), TWO_RINGS_MIN) {
        return with_scratch::<T, _>(2 * scratch, |tmp| {
            let (tmp_a, tmp_b) = tmp.split_at_mut(scratch);
            let (a, b) = data.split_at_mut(data.len() / 2);
            two_lanes(
                c,
                |c| ring_lane(c, Ring::forward(c.me, c.n), a, op, tmp_a),
                |c| ring_lane(c, Ring::backward(c.me, c.n), b, op, tmp_b),
            )
        });
    }
    with_scratch::<T, _>(scratch, |tmp| {
        ring_lane(c, Ring::forward(c.me, c.n), data, op, tmp)
    })
}

/// reduce of a large buffer: ring reduce-scatter, then each segment straight to the root.
pub(super) fn reduce_ring<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let scratch = 2 * c.ring_piece::<T>().min(data.len());
    with_scratch::<T, _>(scratch, |tmp| {
        ring_reduce_scatter(c, Ring::forward(me, n), &mut segments(data, n), op, 1, tmp)
    })?;
    let owned = |r: usize| (r + 1) % n;
    let len = data.len();
    let seg = |r: usize| super::scratch::segment(len, n, owned(r));
    if me == root {
        for r in (0..n).filter(|r| *r != root) {
            c.recv(bytes_mut(&mut data[seg(r)]), r)?;
        }
        finish(data, op, n);
    } else {
        c.send(bytes(&data[seg(me)]), root)?;
    }
    Ok(())
}

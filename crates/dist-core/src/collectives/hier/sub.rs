//! The phases of the hierarchical collectives: broadcast, reduce, and the ring's gather and
//! reduce-scatter, each among a list of ranks (a host's ranks, or one rank per host) that this
//! rank is one of, over the call's messages. Positions are indices into the list.

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::super::call::Call;
use super::super::consts::{BROADCAST_CHAIN_MIN, CHAIN_CHUNK};
use super::super::scratch::{bytes, bytes_mut, seg_pair, split_pair};
use super::super::tree::binomial;

/// This rank's position in `members`; an error if it is not there.
pub(super) fn position<L: Link>(c: &Call<'_, L>, members: &[usize]) -> Result<usize> {
    members
        .iter()
        .position(|&r| r == c.me)
        .ok_or_else(|| c.invalid(format!("rank {} is not among {members:?}", c.me)))
}

/// broadcast of `data` from `members[root]` to every member: a binomial tree up to
/// [`BROADCAST_CHAIN_MIN`] bytes, a chain in chunks of [`CHAIN_CHUNK`] above (each member
/// receives every byte once either way).
pub(super) fn broadcast<T: Element, L: Link>(
    c: &Call<'_, L>,
    members: &[usize],
    root: usize,
    data: &mut [T],
) -> Result<()> {
    let m = members.len();
    if m < 2 {
        return Ok(());
    }
    let v = (position(c, members)? + m - root) % m;
    let real = |x: usize| members[(x + root) % m];
    if std::mem::size_of_val(data) > BROADCAST_CHAIN_MIN {
        return chain(c, (v, m), real, data);
    }
    let (parent, children) = binomial(v, m);
    if let Some(p) = parent {
        c.recv(bytes_mut(data), real(p))?;
    }
    for ch in children {
        c.send(bytes(data), real(ch))?;
    }
    Ok(())
}

/// The chain of [`broadcast`]: the member `v` places after the root (of `m`) receives chunk
/// i + 1 from the one before while it passes chunk i to the one after.
fn chain<T: Element, L: Link>(
    c: &Call<'_, L>,
    (v, m): (usize, usize),
    real: impl Fn(usize) -> usize,
    data: &mut [T],
) -> Result<()> {
    let per = (CHAIN_CHUNK / std::mem::size_of::<T>()).max(1);
    let len = data.len();
    let chunks = len.div_ceil(per);
    let chunk = |i: usize| i * per..((i + 1) * per).min(len);
    let (prev, next) = (real(v + m - 1), real(v + 1));
    if v == 0 {
        for i in 0..chunks {
            c.send(bytes(&data[chunk(i)]), next)?;
        }
        return Ok(());
    }
    c.recv(bytes_mut(&mut data[chunk(0)]), prev)?;
    let last = v == m - 1;
    for i in 0..chunks {
        match (last, i + 1 < chunks) {
            (false, true) => {
                let (out, inb) = split_pair(data, chunk(i), chunk(i + 1));
                c.send_recv(bytes(out), next, bytes_mut(inb), prev)?;
            }
            (false, false) => c.send(bytes(&data[chunk(i)]), next)?,
            (true, true) => c.recv(bytes_mut(&mut data[chunk(i + 1)]), prev)?,
            (true, false) => {}
        }
    }
    Ok(())
}

/// reduce of every member's `data` into `members[root]`'s, up a binomial tree (`tmp`: scratch
/// of at least `data.len()`); no `Avg` scaling. Elsewhere `data` ends as scratch.
pub(super) fn reduce<T: Element, L: Link>(
    c: &Call<'_, L>,
    members: &[usize],
    root: usize,
    data: &mut [T],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let m = members.len();
    if m < 2 {
        return Ok(());
    }
    let v = (position(c, members)? + m - root) % m;
    let real = |x: usize| members[(x + root) % m];
    let (parent, mut children) = binomial(v, m);
    // Smallest subtrees first: they finish first.
    children.reverse();
    let tmp = &mut tmp[..data.len()];
    for ch in children {
        c.recv(bytes_mut(tmp), real(ch))?;
        c.reduce(data, tmp, op)?;
    }
    match parent {
        Some(p) => c.send(bytes(data), real(p)),
        None => Ok(()),
    }
}

/// Ring all-gather among `members`: member `p` holds `segs[p]` (segments of any sizes, the
/// same on every member); afterwards every member holds all.
pub(super) fn ring_gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    members: &[usize],
    segs: &mut [&mut [T]],
) -> Result<()> {
    let m = members.len();
    let p = position(c, members)?;
    let (right, left) = (members[(p + 1) % m], members[(p + m - 1) % m]);
    for s in 0..m - 1 {
        let (out, inb) = seg_pair(segs, (p + m - s) % m, (p + 2 * m - s - 1) % m);
        c.send_recv(bytes(out), right, bytes_mut(inb), left)?;
    }
    Ok(())
}

/// Ring reduce-scatter among `members`: every member's `segs` hold its contribution (segments
/// of any sizes, the same on every member); afterwards member `p`'s `segs[p]` holds the
/// reduction of every member's (no `Avg` scaling), the other segments partial sums. `tmp`:
/// scratch of at least the longest segment. Member `p` sends every segment but its own, once.
pub(super) fn ring_reduce_scatter<T: Element, L: Link>(
    c: &Call<'_, L>,
    members: &[usize],
    segs: &mut [&mut [T]],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let m = members.len();
    let p = position(c, members)?;
    let (right, left) = (members[(p + 1) % m], members[(p + m - 1) % m]);
    for s in 0..m - 1 {
        // The left member sends what this one sends one step later: segment p - s - 2 arrives
        // while p - s - 1 leaves, and the last step brings segment p.
        let send = (p + 2 * m - s - 1) % m;
        let recv = (p + 2 * m - s - 2) % m;
        let (out, acc) = seg_pair(segs, send, recv);
        let inb = &mut tmp[..acc.len()];
        c.send_recv(bytes(out), right, bytes_mut(inb), left)?;
        c.reduce(acc, inb, op)?;
    }
    Ok(())
}

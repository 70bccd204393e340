//! The small-message algorithms: recursive doubling (all_reduce) and binomial trees
//! (broadcast, reduce).

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::call::{Call, finish};
use super::scratch::{bytes, bytes_mut, with_scratch};

/// Recursive doubling over the largest power of two `p <= n`; the first `2 (n - p)` ranks pair
/// up first (odd ranks take their even neighbour's data) and get the result back at the end.
pub(super) fn all_reduce_doubling<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    with_scratch::<T, _>(data.len(), |tmp| {
        let virt = if me < 2 * rem {
            if me % 2 == 0 {
                c.send(bytes(data), me + 1)?;
                None
            } else {
                c.recv(bytes_mut(tmp), me - 1)?;
                c.reduce(data, tmp, op)?;
                Some(me / 2)
            }
        } else {
            Some(me - rem)
        };
        if let Some(v) = virt {
            let mut mask = 1;
            while mask < p {
                let pv = v ^ mask;
                let partner = if pv < rem { pv * 2 + 1 } else { pv + rem };
                c.send_recv(bytes(data), partner, bytes_mut(tmp), partner)?;
                // a op b == b op a exactly for these ops, so both partners hold the same bits.
                c.reduce(data, tmp, op)?;
                mask <<= 1;
            }
        }
        if me < 2 * rem {
            if me % 2 == 1 {
                c.send(bytes(data), me - 1)?;
            } else {
                c.recv(bytes_mut(data), me + 1)?;
            }
        }
        Ok(())
    })?;
    finish(data, op, n);
    Ok(())
}

/// The parent and children of virtual rank `v` in a binomial tree over `n` ranks rooted at 0,
/// children largest subtree first.
pub(super) fn binomial(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let parent = (v > 0).then(|| v & (v - 1));
    let limit = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let mut children = Vec::new();
    let mut m = limit >> 1;
    while m > 0 {
        if v + m < n {
            children.push(v + m);
        }
        m >>= 1;
    }
    (parent, children)
}

/// broadcast down a binomial tree rooted at `root`.
pub(super) fn broadcast_tree<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let n = c.n;
    let v = (c.me + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let (parent, children) = binomial(v, n);
    if let Some(p) = parent {
        c.recv(bytes_mut(data), real(p))?;
    }
    for ch in children {
        c.send(bytes(data), real(ch))?;
    }
    Ok(())
}

/// reduce up a binomial tree rooted at `root`.
pub(super) fn reduce_tree<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = c.n;
    let v = (c.me + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let (parent, mut children) = binomial(v, n);
    // Smallest subtrees first: they finish first.
    children.reverse();
    with_scratch::<T, _>(data.len(), |tmp| {
        for ch in children {
            c.recv(bytes_mut(tmp), real(ch))?;
            c.reduce(data, tmp, op)?;
        }
        Ok(())
    })?;
    match parent {
        Some(p) => c.send(bytes(data), real(p)),
        None => {
            finish(data, op, n);
            Ok(())
        }
    }
}

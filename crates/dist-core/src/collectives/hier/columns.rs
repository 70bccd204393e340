//! all_reduce above the arena's limit where every host holds the same number of the group's
//! ranks, P ≥ 2: the buffer cut into P shares, one per position in a host.
//!
//! | phase | between | what moves |
//! | --- | --- | --- |
//! | 1 | the ranks of each host | ring reduce-scatter of the P shares: the rank at position j holds its host's sum of share j |
//! | 2 | the ranks at position j of every host (a column) | ring all_reduce of share j (reduce-scatter, then all-gather, of H parts) |
//! | 3 | the ranks of each host | ring all-gather of the P shares |
//!
//! Each host's link carries 2(H − 1)/H of the buffer, as through the leaders alone
//! (`host::all_reduce_hosts`), but every rank of the host sends and receives its share's part
//! of it, P rings at once, and the phases inside the host move each share once each way
//! instead of the whole buffer being reduced on the arena and sent back from the leader.

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::super::call::{Call, finish};
use super::super::scratch::{segment, segments, with_scratch};
use super::Layout;
use super::sub;

/// The number of ranks of every host, where all hold the same number, 2 or more.
pub(in super::super) fn even(l: &Layout) -> Option<usize> {
    let p = l.ranks.first()?.len();
    (p >= 2 && l.ranks.iter().all(|r| r.len() == p)).then_some(p)
}

/// all_reduce of `data` (already pre-multiplied for `PreMulSum`) by columns; `l` even (see
/// [`even`]).
pub(in super::super) fn all_reduce<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let Some(p) = even(l) else {
        return Err(c.invalid("the hosts hold unequal numbers of ranks".to_string()));
    };
    let local = l.local().to_vec();
    let j = l.pos_in_host(l.me);
    let column: Vec<usize> = l.ranks.iter().map(|r| r[j]).collect();
    let h = column.len();
    let len = data.len();
    let share = segment(len, p, j);
    let longest = (0..p).map(|i| segment(len, p, i).len()).max().unwrap_or(0);
    with_scratch::<T, _>(longest, |tmp| {
        {
            let mut shares = segments(data, p);
            sub::ring_reduce_scatter(c, &local, &mut shares, op, tmp)?;
        }
        {
            let mut parts = segments(&mut data[share], h);
            sub::ring_reduce_scatter(c, &column, &mut parts, op, tmp)?;
            sub::ring_gather(c, &column, &mut parts)?;
        }
        let mut shares = segments(data, p);
        sub::ring_gather(c, &local, &mut shares)
    })?;
    finish(data, op, c.n);
    Ok(())
}

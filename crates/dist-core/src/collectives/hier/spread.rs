//! The collectives across hosts that every rank ends with a part of: all_gather,
//! reduce_scatter and the barrier, each through the hosts' leaders.
//!
//! | collective | inside each host, before | between the leaders | inside each host, after |
//! | --- | --- | --- | --- |
//! | all_gather | each rank's block to the leader | ring all-gather of the hosts' packed blocks | the whole output from the leader (tree, or chain above 256 KiB) |
//! | reduce_scatter | every rank's input, reduced to the leader (binomial tree) | ring reduce-scatter of the hosts' packed blocks | each rank's reduced block from the leader |
//! | barrier | an empty message to the leader | dissemination barrier | an empty message from the leader |
//!
//! In the leaders' rings each leader sends every other host's blocks once and receives them
//! once: the bytes that cross the hosts' links are what the other hosts need, once per host.

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::super::call::{Call, finish, premul};
use super::super::scratch::{bytes, bytes_mut, with_scratch};
use super::Layout;
use super::sub;

/// `packed` (every host's blocks of `k` elements, host by host) cut into one segment per host.
fn host_segments<'p, T>(l: &Layout, packed: &'p mut [T], k: usize) -> Vec<&'p mut [T]> {
    let mut out = Vec::with_capacity(l.hosts());
    let mut rest = packed;
    for ranks in &l.ranks {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(ranks.len() * k);
        out.push(head);
        rest = tail;
    }
    out
}

/// all_gather of every rank's `input` (`k` elements) into `output` (this rank's block already
/// in place).
pub(in super::super) fn all_gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    let k = input.len();
    let local = l.local();
    let leader = local[0];
    if c.me != leader {
        c.send(bytes(input), leader)?;
        return sub::broadcast(c, local, 0, output);
    }
    let leaders = l.reps(None);
    with_scratch::<T, _>(output.len(), |packed| {
        let mine = l.packed_start(l.mine());
        for (i, &q) in local.iter().enumerate() {
            let block = &mut packed[(mine + i) * k..(mine + i + 1) * k];
            if q == c.me {
                block.copy_from_slice(input);
            } else {
                c.recv(bytes_mut(block), q)?;
            }
        }
        sub::ring_gather(c, &leaders, &mut host_segments(l, packed, k))?;
        let mut at = 0;
        for ranks in &l.ranks {
            for &q in ranks {
                output[q * k..(q + 1) * k].copy_from_slice(&packed[at * k..(at + 1) * k]);
                at += 1;
            }
        }
        Ok(())
    })?;
    sub::broadcast(c, local, 0, output)
}

/// reduce_scatter of every rank's `input` (`k * n` elements) into `output` (`k`).
pub(in super::super) fn reduce_scatter<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let k = output.len();
    let local = l.local();
    let leader = local[0];
    // The packed input, and scratch as long for the reductions.
    with_scratch::<T, _>(2 * input.len(), |scratch| {
        let (packed, tmp) = scratch.split_at_mut(input.len());
        let mut at = 0;
        for ranks in &l.ranks {
            for &q in ranks {
                packed[at * k..(at + 1) * k].copy_from_slice(&input[q * k..(q + 1) * k]);
                at += 1;
            }
        }
        premul(packed, op);
        sub::reduce(c, local, 0, packed, op, tmp)?;
        if c.me != leader {
            return c.recv(bytes_mut(output), leader);
        }
        let mine = l.mine();
        let mut segs = host_segments(l, packed, k);
        sub::ring_reduce_scatter(c, &l.reps(None), &mut segs, op, tmp)?;
        for (i, &q) in local.iter().enumerate() {
            let block = &segs[mine][i * k..(i + 1) * k];
            if q == c.me {
                output.copy_from_slice(block);
            } else {
                c.send(bytes(block), q)?;
            }
        }
        Ok(())
    })?;
    finish(output, op, c.n);
    Ok(())
}

/// The barrier: every rank of a host tells its leader, the leaders run the dissemination
/// barrier among themselves, and each tells its host's ranks.
pub(in super::super) fn barrier<L: Link>(c: &Call<'_, L>, l: &Layout) -> Result<()> {
    let local = l.local();
    let leader = local[0];
    if c.me != leader {
        c.send(&[], leader)?;
        return c.recv(&mut [], leader);
    }
    for &q in &local[1..] {
        c.recv(&mut [], q)?;
    }
    let leaders = l.reps(None);
    let (h, m) = (l.mine(), leaders.len());
    let mut d = 1;
    while d < m {
        c.send_recv(&[], leaders[(h + d) % m], &mut [], leaders[(h + m - d) % m])?;
        d *= 2;
    }
    for &q in &local[1..] {
        c.send(&[], q)?;
    }
    Ok(())
}

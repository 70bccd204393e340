//! Each collective from its arguments to its algorithm: the checks of its arguments, and the
//! choice by size, world size and lanes (the table in the [module docs](super)).

use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::call::{Call, What, finish, premul, run};
use super::chain::broadcast_chain;
use super::consts::{
    ALL_GATHER_TWO_RINGS_MIN, BARRIER_DOUBLING_MIN, BROADCAST_CHAIN_MIN, BROADCAST_TWO_CHAINS_MIN,
    REDUCE_RING_MIN, TWO_RINGS_MIN,
};
use super::desc::Kind;
use super::halving::{Fold, all_reduce_halving};
use super::lanes::{two_lanes, two_rings};
use super::pairwise::exchange;
use super::ring::{
    Ring, all_reduce_ring, halves, reduce_ring, ring_all_gather, ring_reduce_scatter_out,
};
use super::scratch::{bytes_mut, segments, with_scratch};
use super::select::{
    AllReduceAlgorithm, all_reduce_algorithm, broadcast_by_halving, reduce_by_halving,
};
use super::tree::{all_reduce_doubling, broadcast_tree, reduce_tree};

fn what(kind: Kind, count: usize, op: Option<ReduceOp>, root: usize) -> What {
    What {
        kind,
        count,
        op,
        root,
    }
}

/// all_reduce in place: on the host arena where the group agreed to use one, up to the
/// group's [`Tuning::arena_max`](crate::Tuning::arena_max) bytes, and above it where every
/// rank of the group is on one host and they read each other's buffers directly
/// ([`Group::arena_direct_min`](crate::Group::arena_direct_min)), or where the group spans
/// hosts some of which hold several of its ranks (the hosts' path, `hier::all_reduce_spans`);
/// else by size and world size
/// ([`all_reduce_algorithm`]), or as the group forces. A limit of 0 keeps every all_reduce off
/// the arena.
fn all_reduce_on<T: Element, L: Link>(c: &Call<'_, L>, data: &mut [T], op: ReduceOp) -> Result<()> {
    c.check_op::<T>(op)?;
    premul(data, op);
    if c.n == 1 {
        return Ok(());
    }
    let bytes = std::mem::size_of_val(data);
    let arena_max = c.g.tuning().arena_max();
    if c.g.forced_all_reduce().is_none()
        && arena_max > 0
        && let Some(a) = c.g.link().arena()
        && (bytes <= arena_max || c.g.arena_in_use() != Some(false))
        && super::host::agreed(c, a)?
    {
        // Every rank votes on its first all_reduce whatever its size (the vote's condition
        // depends on nothing a rank sees alone); the host layout is the same everywhere once
        // the vote agreed.
        let local = a.local();
        // Above the limit, only where the ranks read each other's buffers directly.
        let direct = super::host::direct_for(c, a, bytes);
        if local.len() == c.n && (bytes <= arena_max || direct) {
            return super::host::all_reduce_host(c, a, local, data, op);
        }
        if bytes > arena_max
            && let Some(l) = super::hier::all_reduce_columns_layout(c.g)
        {
            return super::hier::all_reduce_columns(c, &l, data, op);
        }
        if bytes <= arena_max || super::hier::all_reduce_spans(c.g) {
            return super::host::all_reduce_hosts(c, a, data, op);
        }
    }
    let algorithm =
        c.g.forced_all_reduce()
            .unwrap_or_else(|| all_reduce_algorithm(c.n, data.len(), bytes, c.g.tuning().lanes));
    match algorithm {
        AllReduceAlgorithm::Doubling => all_reduce_doubling(c, data, op),
        AllReduceAlgorithm::Ring => all_reduce_ring(c, data, op),
        AllReduceAlgorithm::Halving => all_reduce_halving(c, data, op),
    }
}

/// reduce in place: on the host arena's small areas where the group's ranks share one host and
/// the buffer fits them (`collectives/small_ops.rs`); else by size: binomial tree for small buffers; for large, the ring then a
/// gather at the root, or on many ranks ([`reduce_by_halving`]) recursive halving and doubling.
fn reduce_on<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    c.check_root(root)?;
    c.check_op::<T>(op)?;
    premul(data, op);
    if c.n == 1 || super::small_ops::reduce(c, data, op, root)? {
        return Ok(());
    }
    if let Some(l) = super::hier::layout(c)? {
        return super::hier::reduce(c, &l, data, op, root);
    }
    if std::mem::size_of_val(data) <= REDUCE_RING_MIN || data.len() < c.n {
        reduce_tree(c, data, op, root)
    } else if reduce_by_halving(c.n) {
        all_reduce_halving(c, data, op)
    } else {
        reduce_ring(c, data, op, root)
    }
}

pub(crate) fn all_reduce<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let w = what(Kind::AllReduce, data.len(), Some(op), 0);
    run::<_, T, _>(g, t, w, |c| all_reduce_on(c, data, op))
}

pub(crate) fn all_reduce_into<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let w = what(Kind::AllReduce, input.len(), Some(op), 0);
    run::<_, T, _>(g, t, w, |c| {
        c.check_len("output", output.len(), input.len())?;
        output.copy_from_slice(input);
        all_reduce_on(c, output, op)
    })
}

pub(crate) fn broadcast<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let w = what(Kind::Broadcast, data.len(), None, root);
    run::<_, T, _>(g, t, w, |c| {
        c.check_root(root)?;
        if c.n == 1 || super::small_ops::broadcast(c, data, root)? {
            return Ok(());
        }
        if let Some(l) = super::hier::layout(c)? {
            return super::hier::broadcast(c, &l, data, root);
        }
        let size = std::mem::size_of_val(data);
        let fwd = Ring::forward(c.me, c.n);
        if size <= BROADCAST_CHAIN_MIN {
            broadcast_tree(c, data, root)
        } else if broadcast_by_halving(c.n, size) {
            // The root's bytes or'ed with every other rank's zeros: the root's bytes.
            let raw = bytes_mut(data);
            if c.me != root {
                raw.fill(0);
            }
            all_reduce_halving(c, raw, ReduceOp::BitOr)
        } else if two_rings(c, size, BROADCAST_TWO_CHAINS_MIN) {
            // Two chains at once in opposite directions, half the data each: every connection
            // carries data both ways.
            let bwd = Ring::backward(c.me, c.n);
            let (a, b) = data.split_at_mut(data.len() / 2);
            two_lanes(
                c,
                |c| broadcast_chain(c, fwd, a, root),
                |c| broadcast_chain(c, bwd, b, root),
            )
        } else {
            broadcast_chain(c, fwd, data, root)
        }
    })
}

pub(crate) fn reduce<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let w = what(Kind::Reduce, data.len(), Some(op), root);
    run::<_, T, _>(g, t, w, |c| reduce_on(c, data, op, root))
}

pub(crate) fn reduce_into<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let w = what(Kind::Reduce, input.len(), Some(op), root);
    run::<_, T, _>(g, t, w, |c| {
        c.check_len("output", output.len(), input.len())?;
        output.copy_from_slice(input);
        reduce_on(c, output, op, root)
    })
}

pub(crate) fn all_gather<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    let w = what(Kind::AllGather, input.len(), None, 0);
    run::<_, T, _>(g, t, w, |c| {
        let k = input.len();
        c.check_len("output", output.len(), c.blocks("output", k)?)?;
        output[c.me * k..(c.me + 1) * k].copy_from_slice(input);
        if c.n == 1 || super::small_ops::all_gather(c, input, output)? {
            return Ok(());
        }
        if let Some(l) = super::hier::layout(c)? {
            return super::hier::all_gather(c, &l, input, output);
        }
        // Blocks of exactly k: `segment` of n*k over n is block i. With two rings, the first
        // half of every block goes around one, the second half around the other, in the
        // opposite direction.
        let (fwd, bwd) = (Ring::forward(c.me, c.n), Ring::backward(c.me, c.n));
        if two_rings(c, std::mem::size_of_val(output), ALL_GATHER_TWO_RINGS_MIN) {
            let (mut a, mut b) = halves(output, c.n, k);
            return two_lanes(
                c,
                |c| ring_all_gather(c, fwd, &mut a, 0),
                |c| ring_all_gather(c, bwd, &mut b, 0),
            );
        }
        ring_all_gather(c, fwd, &mut segments(output, c.n), 0)
    })
}

pub(crate) fn gather<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    let w = what(Kind::Gather, input.len(), None, root);
    run::<_, T, _>(g, t, w, |c| {
        c.check_root(root)?;
        match super::hier::layout(c)? {
            Some(l) => super::hier::gather(c, &l, input, output, root),
            None => super::pairwise::gather(c, input, output, root),
        }
    })
}

pub(crate) fn scatter<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    let w = what(Kind::Scatter, output.len(), None, root);
    run::<_, T, _>(g, t, w, |c| {
        c.check_root(root)?;
        match super::hier::layout(c)? {
            Some(l) => super::hier::scatter(c, &l, input, output, root),
            None => super::pairwise::scatter(c, input, output, root),
        }
    })
}

pub(crate) fn reduce_scatter<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let w = what(Kind::ReduceScatter, output.len(), Some(op), 0);
    run::<_, T, _>(g, t, w, |c| {
        c.check_op::<T>(op)?;
        let k = output.len();
        c.check_len("input", input.len(), c.blocks("input", k)?)?;
        if c.n == 1 {
            output.copy_from_slice(input);
            premul(output, op);
            return Ok(());
        }
        if let Some(l) = super::hier::layout(c)? {
            return super::hier::reduce_scatter(c, &l, input, output, op);
        }
        // Out of place: `input` is only read; `output` carries the partial sums between steps
        // and ends with block `me`. With two lanes, the first half of every block goes around
        // a forward ring and the second half around a backward one (see `halves`).
        let (fwd, bwd) = (Ring::forward(c.me, c.n), Ring::backward(c.me, c.n));
        let scratch = 2 * c.ring_piece::<T>().min(k);
        let blocks: Vec<&[T]> = (0..c.n).map(|i| &input[i * k..(i + 1) * k]).collect();
        if two_rings(c, std::mem::size_of_val(input), TWO_RINGS_MIN) {
            let h = k / 2;
            let first: Vec<&[T]> = blocks.iter().map(|b| &b[..h]).collect();
            let second: Vec<&[T]> = (0..c.n).map(|p| &blocks[(c.n - p) % c.n][h..]).collect();
            let (out_a, out_b) = output.split_at_mut(h);
            with_scratch::<T, _>(2 * scratch, |tmp| {
                let (tmp_a, tmp_b) = tmp.split_at_mut(scratch);
                two_lanes(
                    c,
                    |c| ring_reduce_scatter_out(c, fwd, &first, out_a, op, tmp_a),
                    |c| ring_reduce_scatter_out(c, bwd, &second, out_b, op, tmp_b),
                )
            })?;
        } else {
            with_scratch::<T, _>(scratch, |tmp| {
                ring_reduce_scatter_out(c, fwd, &blocks, output, op, tmp)
            })?;
        }
        finish(output, op, c.n);
        Ok(())
    })
}

pub(crate) fn all_to_all<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    let w = what(Kind::AllToAll, input.len(), None, 0);
    run::<_, T, _>(g, t, w, |c| {
        let n = c.n;
        if !input.len().is_multiple_of(n) {
            return Err(c.invalid(format!(
                "input has {} elements, not a multiple of the world size {n}",
                input.len()
            )));
        }
        c.check_len("output", output.len(), input.len())?;
        let k = input.len() / n;
        let counts = vec![k; n];
        exchange(c, input, &counts, output, &counts)
    })
}

pub(crate) fn all_to_all_v<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    send_counts: &[usize],
    output: &mut [T],
    recv_counts: &[usize],
) -> Result<()> {
    run::<_, T, _>(g, t, what(Kind::AllToAllV, 0, None, 0), |c| {
        let n = c.n;
        c.check_len("send_counts", send_counts.len(), n)?;
        c.check_len("recv_counts", recv_counts.len(), n)?;
        c.check_len("input", input.len(), c.total("send_counts", send_counts)?)?;
        c.check_len("output", output.len(), c.total("recv_counts", recv_counts)?)?;
        exchange(c, input, send_counts, output, recv_counts)
    })
}

/// The barrier. Where the group's ranks share one host, on the host arena's small areas (each
/// rank writes its word and waits for every other's: `collectives/small_ops.rs`); else where
/// the world is a power of two, or from [`BARRIER_DOUBLING_MIN`] ranks, by
/// recursive doubling of empty messages over the partners of all_reduce's recursive doubling
/// and halving (`me XOR 2^k` among the largest power of two, the extra ranks folded in before
/// and out after), so that a lazily connected job's barrier opens no connection its
/// all_reduces would not; otherwise the dissemination barrier (round k: signal rank + 2^k, wait
/// for rank - 2^k), which takes ⌈log₂ n⌉ rounds against the fold's ⌊log₂ n⌋ + 2. Either way a
/// rank leaves only once every rank has entered.
pub(crate) fn barrier<L: Link>(g: &Group<L>, t: Duration) -> Result<()> {
    run::<_, u8, ()>(g, t, what(Kind::Barrier, 0, None, 0), |c| {
        if super::small_ops::barrier(c)? {
            return Ok(());
        }
        if let Some(l) = super::hier::layout(c)? {
            return super::hier::barrier(c, &l);
        }
        if c.n.is_power_of_two() || c.n >= BARRIER_DOUBLING_MIN {
            return barrier_doubling(c);
        }
        let mut d = 1;
        while d < c.n {
            c.send_recv(&[], (c.me + d) % c.n, &mut [], (c.me + c.n - d) % c.n)?;
            d *= 2;
        }
        Ok(())
    })
}

/// The barrier by recursive doubling (see [`barrier`]): an extra rank's signal reaches its
/// partner before the partner's first exchange, each exchange joins two halves that have each
/// heard from all their ranks, and the extra ranks leave on their partner's signal after the
/// last one.
fn barrier_doubling<L: Link>(c: &Call<'_, L>) -> Result<()> {
    let fold = Fold::new(c.n);
    if fold.folds(c.me) && c.me.is_multiple_of(2) {
        c.send(&[], c.me + 1)?;
        return c.recv(&mut [], c.me + 1);
    }
    if fold.folds(c.me) {
        c.recv(&mut [], c.me - 1)?;
    }
    if let Some(v) = fold.virt(c.me) {
        let mut mask = 1;
        while mask < fold.p {
            let partner = fold.real(v ^ mask);
            c.send_recv(&[], partner, &mut [], partner)?;
            mask <<= 1;
        }
    }
    if fold.folds(c.me) {
        c.send(&[], c.me - 1)?;
    }
    Ok(())
}

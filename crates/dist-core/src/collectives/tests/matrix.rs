//! Every collective × element type × reduce op × world size 1–9 × algorithm (recursive
//! doubling, one ring in pieces, two rings, binomial trees, chains, pairwise), over the
//! in-memory link, each result compared element by element with a sequential reference.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use half::{bf16, f16};

use super::super::{
    ALL_GATHER_TWO_RINGS_MIN, ALL_REDUCE_RING_MIN, BROADCAST_CHAIN_MIN, BROADCAST_TWO_CHAINS_MIN,
    CHAIN_CHUNK, COLLECTIVE_TAG, REDUCE_RING_MIN, SECOND_RING_TAG, TWO_RINGS_MIN,
};
use crate::testing::{Delivery, MemLink, run_group, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Tuning};

pub(super) const TIMEOUT: Duration = Duration::from_secs(60);

pub(super) fn ops_for<E: Element>() -> Vec<ReduceOp> {
    let mut v = vec![
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(2.0),
    ];
    if !E::DTYPE.is_float() {
        v.extend([ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor]);
    }
    v
}

/// Rank `r`'s element `i` for `op`: small integers, so that every sum and product is exact in
/// every type and in any order (products: at most 2^9).
fn input<E: Element>(op: ReduceOp, r: usize, i: usize) -> E {
    let x = match op {
        ReduceOp::Prod => 1 + usize::from((r + i).is_multiple_of(3)),
        _ => (r * 7 + i * 3) % 5,
    };
    E::from_f64(x as f64)
}

pub(super) fn inputs<E: Element>(op: ReduceOp, r: usize, len: usize) -> Vec<E> {
    (0..len).map(|i| input(op, r, i)).collect()
}

/// The reduction of every rank's `inputs(op, r, len)`, folded in rank order.
pub(super) fn reduced<E: Element>(op: ReduceOp, n: usize, len: usize) -> Vec<E> {
    let prep = |r: usize| {
        let mut x = inputs::<E>(op, r, len);
        if let ReduceOp::PreMulSum(s) = op {
            E::scale(&mut x, Some(s), 1);
        }
        x
    };
    let mut acc = prep(0);
    for r in 1..n {
        E::reduce_into(op, &mut acc, &prep(r)).unwrap();
    }
    if op == ReduceOp::Avg {
        E::scale(&mut acc, None, n);
    }
    acc
}

/// `got == want`, or an error naming the first difference (after telling every rank, so
/// that none waits for this one).
pub(super) fn same<E: Element>(
    g: &Group<MemLink>,
    what: &str,
    got: &[E],
    want: &[E],
) -> Result<()> {
    if got == want {
        return Ok(());
    }
    let i = (0..got.len().min(want.len()))
        .find(|i| got[*i] != want[*i])
        .unwrap_or(got.len().min(want.len()));
    let reason = format!(
        "{what} on rank {} of {}: element {i} is {:?}, expected {:?} ({} vs {} elements)",
        g.rank(),
        g.world_size(),
        got.get(i),
        want.get(i),
        got.len(),
        want.len()
    );
    g.abort(COLLECTIVE_TAG, &reason, None)?;
    Err(DistError::InvalidArgument {
        rank: g.rank(),
        op: what.into(),
        reason,
    })
}

/// The reducing collectives of `count` elements with every op of `E`.
pub(super) fn reducing<E: Element>(g: &Group<MemLink>, count: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let zero = E::from_f64(0.0);
    for op in ops_for::<E>() {
        let what = |c: &str| format!("{c}({} x {count}, {op})", E::DTYPE);
        let mine = inputs::<E>(op, me, count);
        let want = reduced::<E>(op, n, count);
        let mut x = mine.clone();
        g.all_reduce(&mut x, op)?;
        same(g, &what("all_reduce"), &x, &want)?;
        let mut out = vec![zero; count];
        g.all_reduce_into(&mine, &mut out, op)?;
        same(g, &what("all_reduce_into"), &out, &want)?;
        let root = (count + 1) % n;
        let mut x = mine.clone();
        g.reduce(&mut x, op, root)?;
        if me == root {
            same(g, &what("reduce"), &x, &want)?;
        }
        g.reduce_into(&mine, &mut out, op, root)?;
        if me == root {
            same(g, &what("reduce_into"), &out, &want)?;
        }
        same(
            g,
            &what("reduce_into's input"),
            &mine,
            &inputs::<E>(op, me, count),
        )?;
        let k = count.div_ceil(n);
        let input = inputs::<E>(op, me, k * n);
        let mut out = vec![zero; k];
        g.reduce_scatter(&input, &mut out, op)?;
        let want = reduced::<E>(op, n, k * n);
        same(
            g,
            &what("reduce_scatter"),
            &out,
            &want[me * k..(me + 1) * k],
        )?;
    }
    Ok(())
}

/// The collectives that move without reducing, `count` elements (or blocks of about that).
fn moving<E: Element>(g: &Group<MemLink>, count: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let zero = E::from_f64(0.0);
    let val = |r: usize, i: usize| input::<E>(ReduceOp::Sum, r, i);
    let what = |c: &str| format!("{c}({} x {count})", E::DTYPE);
    let root = count % n;
    let mut x: Vec<E> = if me == root {
        inputs(ReduceOp::Sum, root, count)
    } else {
        vec![zero; count]
    };
    g.broadcast(&mut x, root)?;
    same(
        g,
        &what("broadcast"),
        &x,
        &inputs(ReduceOp::Sum, root, count),
    )?;
    let mine = inputs::<E>(ReduceOp::Sum, me, count);
    let all: Vec<E> = (0..n * count).map(|j| val(j / count, j % count)).collect();
    let mut out = vec![zero; n * count];
    g.all_gather(&mine, &mut out)?;
    same(g, &what("all_gather"), &out, &all)?;
    let mut out = vec![zero; n * count];
    g.gather(&mine, (me == root).then_some(&mut out[..]), root)?;
    if me == root {
        same(g, &what("gather"), &out, &all)?;
    }
    let mut got = vec![zero; count];
    g.scatter((me == root).then_some(&all[..]), &mut got, root)?;
    same(
        g,
        &what("scatter"),
        &got,
        &all[me * count..(me + 1) * count],
    )?;
    // all_to_all: block j of rank r's input is its element range j*k.., for rank j.
    let k = count.div_ceil(n);
    let input = inputs::<E>(ReduceOp::Sum, me, k * n);
    let mut out = vec![zero; k * n];
    g.all_to_all(&input, &mut out)?;
    let want: Vec<E> = (0..k * n).map(|j| val(j / k, me * k + j % k)).collect();
    same(g, &what("all_to_all"), &out, &want)?;
    // all_to_all_v: rank `from` sends `cnt(from, to)` elements (some none) to rank `to`.
    let cnt = |from: usize, to: usize| (from * 3 + to + count) % 4;
    let send: Vec<usize> = (0..n).map(|j| cnt(me, j)).collect();
    let recv: Vec<usize> = (0..n).map(|j| cnt(j, me)).collect();
    let input: Vec<E> = (0..n)
        .flat_map(|j| (0..cnt(me, j)).map(move |i| (j, i)))
        .map(|(j, i)| val(me, 100 * j + i))
        .collect();
    let want: Vec<E> = (0..n)
        .flat_map(|j| (0..cnt(j, me)).map(move |i| (j, i)))
        .map(|(j, i)| val(j, 100 * me + i))
        .collect();
    let mut out = vec![zero; want.len()];
    g.all_to_all_v(&input, &send, &mut out, &recv)?;
    same(g, &what("all_to_all_v"), &out, &want)?;
    g.barrier()
}

/// Runs `f` on every rank of groups of 1 to 9 ranks with `tuning`; panics with the first
/// rank's error.
pub(super) fn on_every_world_size(
    sizes: impl IntoIterator<Item = usize>,
    tuning: Tuning,
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) {
    for n in sizes {
        let results = run_group(n, |_| tuning, TIMEOUT, |g| f(&g));
        for (r, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                panic!("{n} ranks, rank {r}: {e}");
            }
        }
    }
}

/// Small messages: recursive doubling, binomial trees, one-piece rings, pairwise; counts below
/// and above the world size.
fn small<E: Element>() {
    on_every_world_size(1..=9, Tuning::default(), |g| {
        for count in [1, 5, 37] {
            reducing::<E>(g, count)?;
            moving::<E>(g, count)?;
        }
        Ok(())
    });
}

/// Past the doubling's limit: the ring all_reduce and the ring reduce_scatter, several pieces
/// per step (4 KiB pieces).
fn ring<E: Element>() {
    let size = std::mem::size_of::<E>();
    let piece = Tuning {
        ring_piece_kb: 4,
        lanes: 1,
        ..Tuning::default()
    };
    on_every_world_size(1..=9, piece, |g| {
        reducing::<E>(g, ALL_REDUCE_RING_MIN / size + 13)
    });
}

macro_rules! every_type {
    ($($t:ty: $small:ident, $ring:ident;)*) => {$(
        #[test]
        fn $small() {
            small::<$t>();
        }

        #[test]
        fn $ring() {
            ring::<$t>();
        }
    )*};
}

every_type! {
    f32: small_f32, ring_f32;
    f64: small_f64, ring_f64;
    f16: small_f16, ring_f16;
    bf16: small_bf16, ring_bf16;
    i8: small_i8, ring_i8;
    u8: small_u8, ring_u8;
    i32: small_i32, ring_i32;
    u32: small_u32, ring_u32;
    i64: small_i64, ring_i64;
    u64: small_u64, ring_u64;
}

/// Pieces that do not divide the segments (1 and 3 KiB), so that a step's first piece is the
/// previous step's last; the ring reduce (past its tree's limit) and the pipelined chain of
/// broadcast over several chunks.
#[test]
fn ring_pieces_ring_reduce_and_chains() {
    for kb in [1, 3] {
        let t = Tuning {
            ring_piece_kb: kb,
            lanes: 1,
            ..Tuning::default()
        };
        on_every_world_size(1..=9, t, |g| {
            let n = g.world_size();
            // A few elements more than the ring needs, so that segments are uneven.
            reducing::<f32>(g, ALL_REDUCE_RING_MIN / 4 + 2 * n + 1)
        });
    }
    let t = Tuning {
        ring_piece_kb: 24,
        lanes: 1,
        ..Tuning::default()
    };
    on_every_world_size(1..=9, t, |g| {
        reducing_some::<i64>(g, REDUCE_RING_MIN / 8 + 3, 5)?;
        broadcast_only(g, BROADCAST_CHAIN_MIN + 1)?;
        broadcast_only(g, 2 * CHAIN_CHUNK + 5)
    });
}

/// broadcast of `count` bytes from each root in turn.
pub(super) fn broadcast_only(g: &Group<MemLink>, count: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    for root in 0..n {
        let mut x = if me == root {
            inputs::<u8>(ReduceOp::Sum, root, count)
        } else {
            vec![0u8; count]
        };
        g.broadcast(&mut x, root)?;
        same(
            g,
            "broadcast",
            &x,
            &inputs::<u8>(ReduceOp::Sum, root, count),
        )?;
    }
    Ok(())
}

/// Counts messages on the second ring's tag.
fn count_second_ring(links: &[MemLink]) -> Arc<AtomicU64> {
    let seen = Arc::new(AtomicU64::new(0));
    let s = seen.clone();
    links[0].set_faults(move |m| {
        if m.tag == SECOND_RING_TAG {
            s.fetch_add(1, Ordering::Relaxed);
        }
        Delivery::Now
    });
    seen
}

/// Runs `f` on groups of `n` ranks with two lanes; returns how many messages went round the
/// second ring.
fn with_two_lanes(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) -> u64 {
    let links = MemLink::mesh(n);
    let second = count_second_ring(&links);
    let t = Tuning {
        ring_piece_kb: 64,
        lanes: 2,
        ..Tuning::default()
    };
    for (r, res) in run_links(links, |l| f(&Group::form(l, t, TIMEOUT)?))
        .into_iter()
        .enumerate()
    {
        if let Err(e) = res {
            panic!("{n} ranks, rank {r}: {e}");
        }
    }
    second.load(Ordering::Relaxed)
}

/// Two lanes: all_reduce and reduce_scatter from 2 MiB, all_gather from 16 MiB, broadcast
/// from 32 MiB run two rings (chains) at once, in opposite directions, from three ranks up;
/// below the thresholds, and with two ranks, one.
#[test]
fn two_lanes_where_they_pay() {
    for n in [2, 3, 5] {
        let second = with_two_lanes(n, |g| {
            let k = TWO_RINGS_MIN / 4 / n + 3;
            reducing_some::<f32>(g, TWO_RINGS_MIN / 4 + 5, k)?;
            reducing_some::<i32>(g, TWO_RINGS_MIN / 4 + 1, k)?;
            moving_large(
                g,
                ALL_GATHER_TWO_RINGS_MIN / n + 1,
                BROADCAST_TWO_CHAINS_MIN + 1,
            )
        });
        assert_eq!(
            second > 0,
            n >= 3,
            "{n} ranks: {second} second-ring messages"
        );
        // Below every threshold: one ring, even with two lanes.
        let second = with_two_lanes(n, |g| {
            reducing_some::<f32>(g, TWO_RINGS_MIN / 4 - 1, 5)?;
            moving_large(g, 1000, BROADCAST_CHAIN_MIN + 1)
        });
        assert_eq!(second, 0, "{n} ranks below the thresholds");
    }
    // Up to nine ranks, the all_reduce.
    for n in [4, 9] {
        let second = with_two_lanes(n, |g| {
            reducing_some::<f32>(g, TWO_RINGS_MIN / 4 + 2 * n + 1, 7)
        });
        assert!(second > 0, "{n} ranks: no second ring");
    }
}

/// all_reduce of `count`, reduce of `count` (to the last rank) and reduce_scatter of `k` per
/// rank, with Sum, Avg and (integers) BitXor.
fn reducing_some<E: Element>(g: &Group<MemLink>, count: usize, k: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let mut ops = vec![ReduceOp::Sum, ReduceOp::Avg];
    if !E::DTYPE.is_float() {
        ops.push(ReduceOp::BitXor);
    }
    for op in ops {
        let mut x = inputs::<E>(op, me, count);
        g.all_reduce(&mut x, op)?;
        same(g, "all_reduce", &x, &reduced::<E>(op, n, count))?;
        let mut x = inputs::<E>(op, me, count);
        g.reduce(&mut x, op, n - 1)?;
        if me == n - 1 {
            same(g, "reduce", &x, &reduced::<E>(op, n, count))?;
        }
        let mut out = vec![E::from_f64(0.0); k];
        g.reduce_scatter(&inputs::<E>(op, me, k * n), &mut out, op)?;
        let want = reduced::<E>(op, n, k * n);
        same(g, "reduce_scatter", &out, &want[me * k..(me + 1) * k])?;
    }
    Ok(())
}

/// all_gather of `k` per rank and broadcast of `count` bytes from the last rank.
fn moving_large(g: &Group<MemLink>, k: usize, count: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let mut out = vec![0u8; k * n];
    g.all_gather(&inputs::<u8>(ReduceOp::Sum, me, k), &mut out)?;
    let all: Vec<u8> = (0..n * k)
        .map(|j| input(ReduceOp::Sum, j / k, j % k))
        .collect();
    same(g, "all_gather", &out, &all)?;
    let root = n - 1;
    let mut x = if me == root {
        inputs::<u8>(ReduceOp::Sum, root, count)
    } else {
        vec![0u8; count]
    };
    g.broadcast(&mut x, root)?;
    same(
        g,
        "broadcast",
        &x,
        &inputs::<u8>(ReduceOp::Sum, root, count),
    )
}

/// Messages delivered late, on one tag but not the other (so the two rings' messages overtake
/// each other), or a pseudo-random few of them: every result is still right.
#[test]
fn late_and_reordered_messages_change_no_result() {
    for n in [3, 5, 8] {
        let links = MemLink::mesh(n);
        links[0].set_faults(|m| match (m.tag == COLLECTIVE_TAG, m.nth % 7) {
            (true, 0 | 3) => Delivery::After(Duration::from_millis(2)),
            (false, 5) => Delivery::After(Duration::from_millis(1)),
            _ => Delivery::Now,
        });
        let t = Tuning {
            ring_piece_kb: 256,
            lanes: 2,
            ..Tuning::default()
        };
        let results = run_links(links, |l| {
            let g = Group::form(l, t, TIMEOUT)?;
            reducing_some::<f32>(&g, TWO_RINGS_MIN / 4 + 9, 1000)?;
            reducing::<u32>(&g, 300)?;
            moving::<f64>(&g, 41)
        });
        for (r, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                panic!("{n} ranks, rank {r}: {e}");
            }
        }
    }
}

/// Rank 0's tuning is the group's, whatever the others asked for; one out of range on rank 0
/// is an error there, and the group does not form.
#[test]
fn rank_0_decides_the_tuning() {
    let tuning = |r: usize| Tuning {
        ring_piece_kb: 8 + r as u32,
        lanes: 1 + (r as u32 % 2),
        ..Tuning::default()
    };
    let got = run_group(4, tuning, TIMEOUT, |g| Ok(g.tuning()));
    for t in got {
        assert_eq!(t.unwrap(), tuning(0));
    }
    let bad = Tuning {
        ring_piece_kb: 0,
        lanes: 1,
        ..Tuning::default()
    };
    let got = run_group(1, |_| bad, TIMEOUT, |g| Ok(g.tuning()));
    let e = got.into_iter().next().unwrap().unwrap_err();
    assert!(
        matches!(e, DistError::InvalidArgument { rank: 0, .. }) && e.to_string().contains("0 KiB"),
        "{e}"
    );
}

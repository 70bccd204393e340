//! Recursive halving and doubling over the in-memory link: every element type × reduce op ×
//! world size 1–9 and 12, 15, 16, 17, 33, 64 (forced, in pieces), its choice by size on many
//! ranks (all_reduce, reduce, broadcast), the partners it talks to, and its mismatches and
//! failures.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::super::{
    ALL_REDUCE_RING_MIN, AllReduceAlgorithm, BROADCAST_CHAIN_MIN, CHAIN_CHUNK, COLLECTIVE_TAG,
    HALVING_MIN_RANKS, REDUCE_RING_MIN, RING_SHARE_MIN, TWO_RINGS_MAX_RANKS, TWO_RINGS_MIN,
    all_reduce_algorithm, broadcast_by_halving, reduce_by_halving,
};
use super::faults::expect_mismatch;
use super::matrix::{
    TIMEOUT, broadcast_only, inputs, on_every_world_size, ops_for, reduced, reducing, same,
};
use crate::testing::{Delivery, MemLink, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Tuning};

/// The world sizes: every one up to 9, powers of two and one past them, and folds of several
/// ranks (12: 4 of 8 virtual ranks are folded pairs; 15: 7).
const SIZES: [usize; 15] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 33, 64];

/// 1 KiB pieces, so that each halving step of the larger counts moves several.
const SMALL_PIECES: Tuning = Tuning {
    ring_piece_kb: 1,
    lanes: 1,
    arena_max_kb: (super::super::HOST_ARENA_MAX >> 10) as u32,
};

/// all_reduce and all_reduce_into of `count` elements with every op of `E`.
fn all_reduces<E: Element>(g: &Group<MemLink>, count: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    for op in ops_for::<E>() {
        let what = |c: &str| format!("{c}({} x {count}, {op}) by halving", E::DTYPE);
        let want = reduced::<E>(op, n, count);
        let mut x = inputs::<E>(op, me, count);
        g.all_reduce(&mut x, op)?;
        same(g, &what("all_reduce"), &x, &want)?;
        let mut out = vec![E::from_f64(0.0); count];
        g.all_reduce_into(&inputs::<E>(op, me, count), &mut out, op)?;
        same(g, &what("all_reduce_into"), &out, &want)?;
    }
    Ok(())
}

/// Forced halving: counts of one element, fewer elements than ranks (empty blocks), and enough
/// for several uneven pieces per step.
fn forced<E: Element>() {
    on_every_world_size(SIZES, SMALL_PIECES, |g| {
        g.force_all_reduce(Some(AllReduceAlgorithm::Halving));
        for count in [1, 5, 1000 + g.world_size()] {
            all_reduces::<E>(g, count)?;
        }
        Ok(())
    });
}

macro_rules! every_type {
    ($($t:ty: $name:ident;)*) => {$(
        #[test]
        fn $name() {
            forced::<$t>();
        }
    )*};
}

every_type! {
    f32: halving_f32;
    f64: halving_f64;
    f16: halving_f16;
    bf16: halving_bf16;
    i8: halving_i8;
    u8: halving_u8;
    i32: halving_i32;
    u32: halving_u32;
    i64: halving_i64;
    u64: halving_u64;
}

/// The rule: the ring below `HALVING_MIN_RANKS`, halving from there, doubling for small
/// messages; broadcast by halving only while the chain's fill dominates.
#[test]
fn the_choice_by_size_and_ranks() {
    use AllReduceAlgorithm::*;
    let big = ALL_REDUCE_RING_MIN + 4;
    for lanes in [1, 2] {
        assert_eq!(
            all_reduce_algorithm(4, 1, ALL_REDUCE_RING_MIN, lanes),
            Doubling
        );
        assert_eq!(all_reduce_algorithm(4, big / 4, big, lanes), Ring);
        assert_eq!(all_reduce_algorithm(4, 8 << 20, 32 << 20, lanes), Ring);
        let m = HALVING_MIN_RANKS;
        assert_eq!(all_reduce_algorithm(m - 1, big / 4, big, lanes), Ring);
        assert_eq!(all_reduce_algorithm(m, big / 4, big, lanes), Halving);
        assert_eq!(all_reduce_algorithm(1024, 1 << 18, 1 << 20, lanes), Halving);
        assert_eq!(all_reduce_algorithm(1024, 1000, big, lanes), Doubling);
        // A share per rank of RING_SHARE_MIN or more: the ring again.
        let share = RING_SHARE_MIN;
        assert_eq!(
            all_reduce_algorithm(16, 1 << 20, 16 * share - 4, 1),
            Halving
        );
        assert_eq!(all_reduce_algorithm(16, 1 << 22, 16 * share, 1), Ring);
        assert_eq!(all_reduce_algorithm(16, 1 << 24, 64 << 20, lanes), Ring);
        assert_eq!(
            all_reduce_algorithm(1024, 1 << 26, 256 << 20, lanes),
            Halving
        );
        assert_eq!(
            all_reduce_algorithm(1024, 1 << 27, 1024 * share, lanes),
            Ring
        );
        assert_eq!(
            all_reduce_algorithm(TWO_RINGS_MAX_RANKS, 1 << 20, 4 << 20, lanes),
            Halving
        );
    }
    // Two rings at once, below TWO_RINGS_MAX_RANKS, from TWO_RINGS_MIN.
    let m = HALVING_MIN_RANKS;
    assert_eq!(
        all_reduce_algorithm(m, TWO_RINGS_MIN / 4, TWO_RINGS_MIN, 2),
        Ring
    );
    assert_eq!(
        all_reduce_algorithm(m, TWO_RINGS_MIN / 4, TWO_RINGS_MIN, 1),
        Halving
    );
    assert_eq!(all_reduce_algorithm(m, big / 4, big, 2), Halving);
    assert!(!broadcast_by_halving(m - 1, 1 << 20));
    assert!(broadcast_by_halving(m, 1 << 20));
    assert!(!broadcast_by_halving(m, (m - 1) * CHAIN_CHUNK));
    assert!(broadcast_by_halving(1024, 64 << 20));
    assert!(!reduce_by_halving(m - 1) && reduce_by_halving(m));
}

/// On many ranks, by size (no forcing): the large all_reduce, reduce and broadcast run on the
/// halving (checked by their partners in `partners_are_logarithmic`), and are right.
#[test]
fn many_ranks_choose_halving_by_size() {
    on_every_world_size([8, 9, 12, 17], Tuning::default(), |g| {
        let n = g.world_size();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let count = ALL_REDUCE_RING_MIN / 4 + 2 * n + 1;
            let mut x = inputs::<f32>(op, g.rank(), count);
            g.all_reduce(&mut x, op)?;
            same(g, "all_reduce", &x, &reduced::<f32>(op, n, count))?;
            let count = REDUCE_RING_MIN / 8 + 3;
            let root = n / 2;
            let mut x = inputs::<i64>(op, g.rank(), count);
            g.reduce(&mut x, op, root)?;
            if g.rank() == root {
                same(g, "reduce", &x, &reduced::<i64>(op, n, count))?;
            }
        }
        broadcast_only(g, BROADCAST_CHAIN_MIN + 1)?;
        // Every collective, the small ones included, on these world sizes.
        reducing::<u32>(g, 300)
    });
}

/// Runs `f` on a group of `n` ranks and returns, for each rank, the ranks it exchanged
/// collective messages with (sent to or received from).
fn partners(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) -> Vec<BTreeSet<usize>> {
    let links = MemLink::mesh(n);
    let seen = Arc::new(Mutex::new(vec![BTreeSet::new(); n]));
    let s = seen.clone();
    links[0].set_faults(move |m| {
        if m.tag == COLLECTIVE_TAG {
            let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
            s[m.src].insert(m.dst);
            s[m.dst].insert(m.src);
        }
        Delivery::Now
    });
    for (r, res) in run_links(links, |l| f(&Group::form(l, Tuning::default(), TIMEOUT)?))
        .into_iter()
        .enumerate()
    {
        if let Err(e) = res {
            panic!("{n} ranks, rank {r}: {e}");
        }
    }
    let s = seen.lock().unwrap_or_else(|p| p.into_inner());
    s.clone()
}

/// ⌊log₂ n⌋ + 1 partners at most for a large all_reduce, reduce or broadcast on many ranks
/// (the ring's 2 (n − 1) steps would take 2, the chain's 2, but they need every rank in turn);
/// the same partners serve all three.
#[test]
fn partners_are_logarithmic() {
    for n in [16usize, 17, 33, 64] {
        let bound = n.ilog2() as usize + 1;
        let got = partners(n, |g| {
            let mut x = vec![1.0f32; (1 << 20) / 4];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(g, "all_reduce", &x[..1], &[n as f32])?;
            g.reduce(&mut x, ReduceOp::Max, 3)?;
            let mut b = vec![g.rank() as u8; 1 << 20];
            g.broadcast(&mut b, 5)?;
            same(g, "broadcast", &b[..3], &[5, 5, 5])
        });
        for (r, p) in got.iter().enumerate() {
            assert!(
                !p.is_empty() && p.len() <= bound,
                "{n} ranks, rank {r}: {} partners {p:?}, more than {bound}",
                p.len()
            );
        }
        // The ring, forced, for comparison: two partners each, but 2 (n - 1) steps.
        let ring = partners(n, |g| {
            g.force_all_reduce(Some(AllReduceAlgorithm::Ring));
            g.all_reduce(&mut vec![1u32; 1 << 16], ReduceOp::Sum)
        });
        assert!(ring.iter().all(|p| p.len() == 2), "{n} ranks: {ring:?}");
    }
}

/// The barrier, where the world is a power of two or from `BARRIER_DOUBLING_MIN` ranks, talks
/// only to the partners a small all_reduce talks to (so that a lazily connected job's barrier
/// dials no peer of its own), and holds every rank until the last has entered: two ranks enter
/// 30 ms late, and every rank counts the entries after it. Fails with the dissemination barrier
/// everywhere (rank + 2^k is no doubling partner).
#[test]
fn the_barrier_keeps_to_the_small_all_reduces_partners() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for n in [2usize, 4, 8, 16, 64, 65, 100, 128] {
        let small = partners(n, |g| g.all_reduce(&mut [1u64], ReduceOp::Sum));
        let entered = AtomicUsize::new(0);
        let barrier = partners(n, |g| {
            if g.rank() == n - 1 || g.rank() == n / 2 {
                std::thread::sleep(Duration::from_millis(30));
            }
            entered.fetch_add(1, Ordering::SeqCst);
            g.barrier()?;
            let seen = entered.load(Ordering::SeqCst);
            assert!(
                seen >= n,
                "{n} ranks: rank {} left with {seen} entered",
                g.rank()
            );
            Ok(())
        });
        for (r, (b, s)) in barrier.iter().zip(&small).enumerate() {
            assert!(
                b.is_subset(s),
                "{n} ranks, rank {r}: barrier {b:?}, all_reduce {s:?}"
            );
        }
    }
}

/// A count that differs on one rank is named on every rank, past the halving's threshold.
#[test]
fn another_count_is_named_by_halving() {
    let k = ALL_REDUCE_RING_MIN / 4 + 100;
    let want = [
        format!("count {k} vs {}", k + 1),
        format!("count {} vs {k}", k + 1),
    ];
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    expect_mismatch([8, 9, 12, 16], &want, |g| {
        let n = if g.rank() == g.world_size() - 1 {
            k + 1
        } else {
            k
        };
        g.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
    });
    // Forced on few ranks too, and the element type.
    expect_mismatch(
        2..=7,
        &["element type i32 vs f32", "element type f32 vs i32"],
        |g| {
            g.force_all_reduce(Some(AllReduceAlgorithm::Halving));
            if g.rank() == 1 {
                g.all_reduce(&mut vec![1i32; 3000], ReduceOp::Sum)
            } else {
                g.all_reduce(&mut vec![1.0f32; 3000], ReduceOp::Sum)
            }
        },
    );
}

/// A rank that dies in the middle of a halving all_reduce (as it sends its fifth collective
/// message): every other rank fails promptly with an error naming it, and its next collective
/// at once.
#[test]
fn a_rank_that_dies_mid_halving_is_named_everywhere() {
    for (n, victim) in [(3, 0), (9, 8), (16, 5), (17, 0)] {
        let links = MemLink::mesh(n);
        // The tuning goes first, from each rank to its children in the tree.
        let fifth = 4 + crate::group::forming_tree(victim, n).1.len() as u64;
        links[0].set_faults(move |m| {
            if m.src == victim && m.nth == fifth {
                Delivery::Die
            } else {
                Delivery::Now
            }
        });
        let t = Instant::now();
        let results = run_links(links, |l| {
            let g = Group::form(l, SMALL_PIECES, Duration::from_secs(30))?;
            g.force_all_reduce(Some(AllReduceAlgorithm::Halving));
            let mut data = vec![1.0f32; 20_000];
            let e = loop {
                if let Err(e) = g.all_reduce(&mut data, ReduceOp::Sum) {
                    break e;
                }
            };
            let again = Instant::now();
            let next = g.all_reduce(&mut [1u8], ReduceOp::Sum).unwrap_err();
            assert!(again.elapsed() < Duration::from_secs(1), "{next}");
            Ok(e)
        });
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        for (r, res) in results
            .into_iter()
            .enumerate()
            .filter(|(r, _)| *r != victim)
        {
            let e = res.unwrap();
            let names = match &e {
                DistError::PeerGone { peer, .. } => *peer == victim,
                DistError::Aborted { origin, reason, .. } => {
                    *origin == victim && reason.contains(&format!("peer {victim} gone"))
                }
                _ => false,
            };
            assert!(names, "{n} ranks, rank {r}: not naming rank {victim}: {e}");
        }
    }
}

/// A rank whose messages stop arriving: the others time out by their deadline (or hear of the
/// first timeout as an abort), and the group stays failed.
#[test]
fn a_stalled_rank_ends_the_halving_by_the_deadline() {
    for n in [5, 16] {
        let stalled = 2;
        let links = MemLink::mesh(n);
        links[0].set_faults(move |m| {
            if m.src == stalled && m.tag == COLLECTIVE_TAG && m.nth >= 6 {
                Delivery::Never
            } else {
                Delivery::Now
            }
        });
        let timeout = Duration::from_millis(400);
        let t = Instant::now();
        let results = run_links(links, |l| {
            let g = Group::form(l, SMALL_PIECES, timeout)?;
            g.force_all_reduce(Some(AllReduceAlgorithm::Halving));
            let mut x = vec![1.0f64; 5000];
            loop {
                if let Err(e) = g.all_reduce(&mut x, ReduceOp::Sum) {
                    let next = g.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                    assert!(matches!(next, DistError::Aborted { .. }), "{next}");
                    return Ok(e);
                }
            }
        });
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let mut timeouts = 0;
        for (r, res) in results.into_iter().enumerate() {
            match res.unwrap() {
                DistError::Timeout { op, .. } => {
                    timeouts += 1;
                    assert!(op.contains("all_reduce(f64 x 5000, sum) #"), "{op}");
                }
                DistError::Aborted { .. } => {}
                e => panic!("{n} ranks, rank {r}: {e}"),
            }
        }
        assert!(timeouts >= 1, "{n} ranks: nobody timed out");
    }
}

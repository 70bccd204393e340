//! barrier, broadcast, reduce and all_gather on the in-memory host arena's small areas
//! (`collectives/small_ops.rs`): which calls take them (this rank's input word counts the
//! rounds), results across every interleaving of them with all_reduces of every path and with
//! sub-groups' calls, at many ranks, ranks drifting apart; and the faults: a barrier that lets
//! nobody through early, mismatched calls, a dead rank, a rank that never comes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::matrix::{TIMEOUT, inputs, ops_for, reduced, same};
use crate::arena::ArenaWord;
use crate::collectives::collective_path;
use crate::collectives::{HOST_SMALL_MAX, Kind};
use crate::link::Link;
use crate::testing::{MemLink, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Subgroups, Tuning};

/// Slots of 16 KiB: small areas of 4 KiB, the path's whole limit.
const SLOT: usize = 16 << 10;
const SMALL: usize = SLOT / 4;
const _: () = assert!(SMALL == HOST_SMALL_MAX);

/// Runs `f` on every rank of a group of `n` ranks on one host, once it has agreed on its arena
/// (on its first all_reduce: before it, the other collectives run over messages).
fn on_one_host(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) {
    on_one_host_fresh(n, |g| {
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        f(g)
    });
}

/// [`on_one_host`], `f` from the group's first call.
fn on_one_host_fresh(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) {
    let links = MemLink::mesh_on_hosts(&vec![3; n], SLOT);
    let results = run_links(links, |l| f(&Group::form(l, Tuning::default(), TIMEOUT)?));
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("{n} ranks, rank {r}: {e}");
        }
    }
}

/// This rank's input word: the pieces it has published on the arena.
fn pieces(g: &Group<MemLink>) -> u32 {
    let a = g.link().arena().expect("an arena");
    a.load(g.rank(), ArenaWord::Input)
}

/// The pieces `f` publishes on this rank's arena, and whether its small area holds the last.
fn rounds_of(g: &Group<MemLink>, f: impl FnOnce() -> Result<()>) -> Result<(u32, bool)> {
    let before = pieces(g);
    f()?;
    let after = pieces(g);
    let a = g.link().arena().expect("an arena");
    let small = a.small_seq(g.rank(), (after.wrapping_sub(1) % 2) as usize) == after;
    Ok((after.wrapping_sub(before), small && after != before))
}

/// Up to the small areas' bytes a rank, each collective is one round on the small areas; past
/// them it goes over messages (no piece); the perf tool's path says the same. Before the
/// group's first all_reduce (which agrees on the arena) they all go over messages.
#[test]
fn small_calls_take_one_round_on_the_small_areas() {
    let n = 3;
    on_one_host_fresh(n, |g| {
        let me = g.rank();
        assert_eq!(rounds_of(g, || g.barrier())?, (0, false), "first barrier");
        let mut x = [me as u8; 4];
        assert_eq!(rounds_of(g, || g.broadcast(&mut x, 1))?, (0, false));
        assert_eq!(collective_path(g, Kind::Barrier, 0, 0), "dissemination");
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(rounds_of(g, || g.barrier())?, (1, true), "barrier");
        for bytes in [0, 1, 8, SMALL, SMALL + 1] {
            let small = bytes <= SMALL;
            let want = if small { (1, true) } else { (0, false) };
            let mut x = vec![me as u8; bytes];
            assert_eq!(rounds_of(g, || g.broadcast(&mut x, 1))?, want, "{bytes}");
            same(g, "broadcast", &x, &vec![1u8; bytes])?;
            let mut x = vec![1u8; bytes];
            assert_eq!(
                rounds_of(g, || g.reduce(&mut x, ReduceOp::Sum, 2))?,
                want,
                "{bytes}"
            );
            if me == 2 {
                assert_eq!(x, vec![n as u8; bytes]);
            }
            let input = vec![me as u8 + 1; bytes];
            let mut out = vec![0u8; n * bytes];
            assert_eq!(rounds_of(g, || g.all_gather(&input, &mut out))?, want);
            let all: Vec<u8> = (0..n).flat_map(|r| vec![r as u8 + 1; bytes]).collect();
            same(g, "all_gather", &out, &all)?;
            let path = |kind| collective_path(g, kind, bytes, bytes);
            for kind in [Kind::Broadcast, Kind::Reduce, Kind::AllGather] {
                assert_eq!(path(kind) == "arena-small", small, "{kind:?} {bytes}");
            }
            assert_eq!(rounds_of(g, || g.barrier())?, (1, true), "barrier");
        }
        assert_eq!(collective_path(g, Kind::Barrier, 0, 0), "arena-small");
        Ok(())
    });
}

/// With the arena off (a limit of 0), none of them touches it.
#[test]
fn an_arena_limit_of_zero_keeps_them_off_the_areas() {
    let links = MemLink::mesh_on_hosts(&[0; 3], SLOT);
    let results = run_links(links, |l| {
        let t = Tuning {
            arena_max_kb: 0,
            ..Tuning::default()
        };
        let g = Group::form(l, t, TIMEOUT)?;
        g.barrier()?;
        g.broadcast(&mut [1u32; 2], 0)?;
        g.all_reduce(&mut [1u32; 2], ReduceOp::Sum)?;
        Ok((pieces(&g), collective_path(&g, Kind::Barrier, 0, 0)))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (pieces, path) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((pieces, path.as_str()), (0, "dissemination"), "rank {r}");
    }
}

/// No rank leaves a small barrier before every rank has entered it: each rank counts itself in
/// before the barrier and finds every rank counted after it; one rank in turn comes late.
#[test]
fn a_small_barrier_lets_nobody_through_early() {
    for n in [2, 3, 5, 8] {
        let entered: Vec<AtomicUsize> = (0..40).map(|_| AtomicUsize::new(0)).collect();
        on_one_host(n, |g| {
            g.barrier()?;
            for (round, count) in entered.iter().enumerate() {
                if g.rank() == round % n {
                    std::thread::sleep(Duration::from_millis(if round < 4 { 20 } else { 1 }));
                }
                count.fetch_add(1, Ordering::SeqCst);
                let before = pieces(g);
                g.barrier()?;
                assert_eq!(pieces(g), before + 1, "round {round}: not on the areas");
                let seen = count.load(Ordering::SeqCst);
                assert_eq!(seen, n, "{n} ranks, round {round}, rank {}", g.rank());
            }
            Ok(())
        });
    }
}

/// Every small collective after every other (and all_reduces on the slots, and calls over
/// messages past the limit), roots changing, inputs new every round, ranks drifting apart (one
/// yields, one stalls now and then): every result is right on every rank, so no area was read
/// after its owner wrote it again, whichever collective wrote it.
fn interleaved(n: usize, rounds: usize) {
    on_one_host(n, |g| {
        let me = g.rank();
        for round in 0..rounds {
            let v = |r: usize, i: usize| ((r + 1) * 1000 + round * 7 + i) as u32;
            let mine = |len: usize| (0..len).map(|i| v(me, i)).collect::<Vec<u32>>();
            let root = (round / 7) % n;
            let len = [2, 1, 0, SMALL / 4, 5, SMALL / 4 + 1, 3][round % 7];
            let before = pieces(g);
            let case = (round * 5 + round / 7) % 6;
            match case {
                0 => {
                    let mut x = mine(len);
                    g.all_reduce(&mut x, ReduceOp::Sum)?;
                    let want: Vec<u32> = (0..len).map(|i| (0..n).map(|r| v(r, i)).sum()).collect();
                    same(g, &format!("round {round}: all_reduce {len}"), &x, &want)?;
                }
                1 => g.barrier()?,
                2 => {
                    let mut x = mine(len);
                    g.broadcast(&mut x, root)?;
                    let want: Vec<u32> = (0..len).map(|i| v(root, i)).collect();
                    same(g, &format!("round {round}: broadcast {len}"), &x, &want)?;
                }
                3 => {
                    let mut x = mine(len);
                    g.reduce(&mut x, ReduceOp::Max, root)?;
                    if me == root {
                        let want: Vec<u32> = (0..len).map(|i| v(n - 1, i)).collect();
                        assert_eq!(x, want, "round {round}: reduce {len} to {root}");
                    }
                }
                4 => {
                    let x = mine(len);
                    let mut out = vec![0u32; n * len];
                    g.all_gather(&x, &mut out)?;
                    let want: Vec<u32> = (0..n)
                        .flat_map(|r| (0..len).map(move |i| v(r, i)))
                        .collect();
                    same(g, &format!("round {round}: all_gather {len}"), &out, &want)?;
                }
                _ => {
                    // Several pieces of the slots.
                    let mut x = mine(3 * SLOT / 8 + round);
                    g.all_reduce(&mut x, ReduceOp::Sum)?;
                    let want: Vec<u32> = (0..x.len())
                        .map(|i| (0..n).map(|r| v(r, i)).sum())
                        .collect();
                    same(g, &format!("round {round}: slots"), &x, &want)?;
                }
            }
            // A small call is one round on the areas.
            if case == 1 || (case < 5 && len * 4 <= SMALL) {
                assert_eq!(
                    pieces(g),
                    before + 1,
                    "round {round}: case {case}, {len} u32"
                );
            }
            if me == 1 {
                std::thread::yield_now();
            } else if me == n - 1 && round % 11 == 5 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Ok(())
    });
}

#[test]
fn interleaved_small_collectives_are_right() {
    for n in [2, 3, 4, 5] {
        interleaved(n, 120);
    }
}

#[test]
fn interleaved_small_collectives_at_many_ranks() {
    interleaved(16, 60);
    interleaved(33, 24);
}

/// reduce on the small areas: every op of a float and an integer type, at counts up to the
/// areas' limit and past it: the root's result is the all_reduce's, bitwise.
#[test]
fn small_reduce_is_the_all_reduce_on_the_root() {
    fn check<E: Element>(g: &Group<MemLink>, n: usize) -> Result<()> {
        let per = SMALL / std::mem::size_of::<E>();
        for op in ops_for::<E>() {
            for count in [1, 3, per, per + 1] {
                let root = count % n;
                let mut x = inputs::<E>(op, g.rank(), count);
                g.reduce(&mut x, op, root)?;
                let mut y = inputs::<E>(op, g.rank(), count);
                g.all_reduce(&mut y, op)?;
                let want = reduced::<E>(op, n, count);
                same(g, "all_reduce", &y, &want)?;
                if g.rank() == root {
                    let bits = |v: &[E]| v.iter().map(|e| e.to_f64().to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&x), bits(&y), "{op:?} {count}");
                }
            }
        }
        Ok(())
    }
    for n in [2, 3, 6] {
        on_one_host(n, |g| {
            check::<f32>(g, n)?;
            check::<i32>(g, n)
        });
    }
}

/// A parent group's small calls between its sub-groups' (which run over messages): both right,
/// the parent's still on its areas.
#[test]
fn sub_groups_calls_between_the_parents_small_ones() {
    let n = 6;
    on_one_host(n, |g| {
        let me = g.rank();
        let half = g
            .split(Some((me % 2) as u32), me as i64)?
            .expect("a member");
        let (hr, hn) = (half.rank(), half.world_size());
        for round in 0..30u32 {
            let before = pieces(g);
            g.barrier()?;
            half.barrier()?;
            let mut x = [round + me as u32; 3];
            g.broadcast(&mut x, (round as usize) % n)?;
            same(g, "parent broadcast", &x, &[round + round % n as u32; 3])?;
            let mut y = [round + hr as u32; 2];
            half.broadcast(&mut y, 0)?;
            assert_eq!(y, [round; 2]);
            let mut out = vec![0u32; hn];
            half.all_gather(&[me as u32], &mut out)?;
            let want: Vec<u32> = (0..hn).map(|i| (2 * i + me % 2) as u32).collect();
            assert_eq!(out, want);
            let mut z = [1u64; 2];
            g.all_reduce(&mut z, ReduceOp::Sum)?;
            same(g, "parent all_reduce", &z, &[n as u64; 2])?;
            assert_eq!(pieces(g), before + 3, "round {round}: the parent's calls");
        }
        Ok(())
    });
}

fn errors_of(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) -> Vec<Result<()>> {
    run_links(MemLink::mesh_on_hosts(&vec![0; n], SLOT), |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(3))?;
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        f(&g)
    })
}

/// Mismatched calls on the small areas, or one of them beside a call on the slots or over
/// messages: an error on every rank (a mismatch, or the abort it sent), promptly.
#[test]
fn mismatched_small_collectives_are_reported() {
    type Call = fn(&Group<MemLink>) -> Result<()>;
    let cases: [(&str, Call, Call); 7] = [
        (
            "barrier / broadcast",
            |g| g.barrier(),
            |g| g.broadcast(&mut [1u8; 4], 0),
        ),
        (
            "broadcast root",
            |g| g.broadcast(&mut [1u8; 4], 0),
            |g| g.broadcast(&mut [1u8; 4], 1),
        ),
        (
            "all_gather / all_reduce",
            |g| g.all_gather(&[1u8; 4], &mut [0u8; 12]),
            |g| g.all_reduce(&mut [1u8; 4], ReduceOp::Sum),
        ),
        (
            "reduce op",
            |g| g.reduce(&mut [1u32; 4], ReduceOp::Sum, 0),
            |g| g.reduce(&mut [1u32; 4], ReduceOp::Max, 0),
        ),
        (
            "barrier / all_reduce on the slots",
            |g| g.barrier(),
            |g| g.all_reduce(&mut vec![1u8; SMALL + 1], ReduceOp::Sum),
        ),
        (
            "broadcast count past the limit",
            |g| g.broadcast(&mut vec![1u8; SMALL], 0),
            |g| g.broadcast(&mut vec![1u8; SMALL + 1], 0),
        ),
        (
            "barrier / broadcast over messages",
            |g| g.barrier(),
            |g| g.broadcast(&mut vec![1u8; SMALL + 1], 0),
        ),
    ];
    for (what, mine, odd) in cases {
        let t = Instant::now();
        // Then a barrier: a broadcast's root on the small areas waits for nobody, and finds a
        // mismatch at its next call.
        let results = errors_of(3, |g| {
            let r = if g.rank() == 1 { odd(g) } else { mine(g) };
            r.and_then(|()| g.barrier())
        });
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{what}: {:?} {results:?}",
            t.elapsed()
        );
        for (r, res) in results.iter().enumerate() {
            assert!(
                matches!(
                    res,
                    Err(DistError::CollectiveMismatch { .. } | DistError::Aborted { .. })
                ),
                "{what}, rank {r}: {res:?}"
            );
        }
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(DistError::CollectiveMismatch { .. }))),
            "{what}: {results:?}"
        );
    }
}

/// A rank that dies while the others wait in a small barrier or broadcast: they fail naming
/// it, well before the deadline.
#[test]
fn a_dead_rank_ends_the_small_waits() {
    type Call = fn(&Group<MemLink>) -> Result<()>;
    let calls: [Call; 3] = [
        |g| g.barrier(),
        |g| g.broadcast(&mut [1u32; 3], 3),
        |g| g.all_gather(&[1u32; 3], &mut [0u32; 12]),
    ];
    for call in calls {
        let t = Instant::now();
        let results = errors_of(4, |g| {
            if g.rank() == 3 {
                g.link().kill();
                return Ok(());
            }
            call(g)
        });
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        for (r, res) in results.iter().enumerate().take(3) {
            let e = res.as_ref().unwrap_err();
            assert!(super::names(e, 3), "rank {r}: {e}");
        }
    }
}

/// A rank that never comes to a barrier: the others time out by the deadline, naming it.
#[test]
fn a_rank_that_never_comes_to_a_small_barrier_is_named() {
    let results = errors_of(3, |g| {
        if g.rank() == 2 {
            return Ok(());
        }
        g.barrier()
    });
    assert!(
        results[..2]
            .iter()
            .any(|r| matches!(r, Err(DistError::Timeout { peer: 2, .. }))),
        "{results:?}"
    );
}

/// A broadcast's root on the small areas waits for nobody: it leaves while a non-root has not
/// even entered the call; the rank that comes late still gets the root's bytes.
#[test]
fn a_small_broadcasts_root_waits_for_nobody() {
    let entered = std::sync::atomic::AtomicBool::new(false);
    on_one_host(3, |g| {
        g.barrier()?;
        let mut x = [g.rank() as u32 + 7; 4];
        if g.rank() == 2 {
            std::thread::sleep(Duration::from_millis(300));
            entered.store(true, Ordering::SeqCst);
        }
        g.broadcast(&mut x, 0)?;
        if g.rank() == 0 {
            assert!(
                !entered.load(Ordering::SeqCst),
                "the root waited for rank 2"
            );
        }
        assert_eq!(x, [7; 4], "rank {}", g.rank());
        g.barrier()
    });
}

/// Broadcasts from one root back to back (the root runs ahead as far as the protocol lets it),
/// then an all_reduce whose pieces split into shares on the slots, a small one, and a broadcast
/// from another root, one non-root stalling now and then: every value right on every rank, so
/// no rank wrote an area or slot a peer was still reading after a broadcast.
#[test]
fn runs_of_broadcasts_then_the_slots_never_overwrite_unread_bytes() {
    for n in [2, 3, 5] {
        on_one_host(n, |g| {
            let me = g.rank();
            for round in 0..40usize {
                let v = |r: usize, i: usize| ((r + 1) * 100_000 + round * 13 + i) as u32;
                for b in 0..4 {
                    let mut x: Vec<u32> = (0..9).map(|i| v(me, i + b)).collect();
                    g.broadcast(&mut x, round % n)?;
                    let want: Vec<u32> = (0..9).map(|i| v(round % n, i + b)).collect();
                    assert_eq!(
                        x, want,
                        "{n} ranks, rank {me}, round {round}, broadcast {b}"
                    );
                }
                let len = if round % 2 == 0 { 3 * SLOT / 4 } else { 5 };
                let mut y: Vec<u32> = (0..len).map(|i| v(me, i)).collect();
                g.all_reduce(&mut y, ReduceOp::Sum)?;
                let want: Vec<u32> = (0..len).map(|i| (0..n).map(|r| v(r, i)).sum()).collect();
                same(g, &format!("round {round}: all_reduce {len}"), &y, &want)?;
                let mut z: Vec<u32> = (0..3).map(|i| v(me, i)).collect();
                g.broadcast(&mut z, (round + 1) % n)?;
                assert_eq!(z, (0..3).map(|i| v((round + 1) % n, i)).collect::<Vec<_>>());
                if me == n - 1 && round % 5 == 2 {
                    std::thread::sleep(Duration::from_millis(2));
                } else if me == 1 {
                    std::thread::yield_now();
                }
            }
            Ok(())
        });
    }
}

/// Runs `f` on every rank of a group of `n` ranks on one host whose arena words start at
/// `start` (as after that many pieces) and whose small areas' words start at `areas`, once it
/// has agreed on its arena (its first all_reduce, the piece `start`).
fn on_one_host_from(
    n: usize,
    start: u32,
    areas: [u32; 2],
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) {
    on_one_host_fresh(n, |g| {
        let l = g.link();
        l.scribble_arena(ArenaWord::Input, start);
        l.scribble_arena(ArenaWord::Reduced, start);
        for (area, &word) in areas.iter().enumerate() {
            l.scribble_arena_small(area, word);
        }
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        f(g)
    });
}

/// After a small broadcast, its root writes its area for the next piece only once every peer
/// has started the broadcast (so is done reading the piece before it, which wrote that area),
/// also where the broadcast is the last piece before the count wraps at 2³²: a non-root that
/// comes 300 ms late still finds the root's area as the piece before left it.
#[test]
fn a_broadcasts_root_waits_before_its_next_piece_across_the_wrap() {
    for start in [0, u32::MAX - 1] {
        on_one_host_from(3, start, [0, 0], |g| {
            let me = g.rank();
            // Piece start: the first all_reduce (area start % 2, word start + 1); piece
            // start + 1: the broadcast; piece start + 2 writes area start % 2 again.
            let area = (start % 2) as usize;
            let mut x = [me as u32 + 5; 3];
            if me == 2 {
                std::thread::sleep(Duration::from_millis(300));
                let a = g.link().arena().expect("an arena");
                assert_eq!(
                    a.small_seq(0, area),
                    start.wrapping_add(1),
                    "from {start}: the root wrote its next piece before rank 2 started the broadcast"
                );
            }
            g.broadcast(&mut x, 0)?;
            assert_eq!(x, [5; 3]);
            let mut out = [0u32; 3];
            g.all_gather(&[me as u32], &mut out)?;
            same(g, "all_gather", &out, &[0, 1, 2])?;
            let mut y = vec![me as u32; 3 * SLOT / 8];
            g.all_reduce(&mut y, ReduceOp::Sum)?;
            same(g, "all_reduce", &y, &vec![3; 3 * SLOT / 8])?;
            assert_eq!(pieces(g), start.wrapping_add(5));
            Ok(())
        });
    }
}

/// Every small collective after every other across the wrap of the piece count at 2³².
#[test]
fn interleaved_small_collectives_across_the_wrap() {
    for n in [2, 3, 5] {
        let start = u32::MAX - 40;
        on_one_host_from(n, start, [0, 0], |g| {
            let me = g.rank();
            for round in 0..90u32 {
                let root = (round as usize) % n;
                let mut x = [round + me as u32; 2];
                match round % 4 {
                    0 => {
                        g.broadcast(&mut x, root)?;
                        same(g, "broadcast", &x, &[round + root as u32; 2])?;
                    }
                    1 => {
                        let mut y = vec![me as u32 + round; 3 * SLOT / 8];
                        g.all_reduce(&mut y, ReduceOp::Sum)?;
                        let want = (0..n as u32).map(|r| r + round).sum::<u32>();
                        same(g, "split all_reduce", &y, &vec![want; 3 * SLOT / 8])?;
                    }
                    2 => {
                        let mut out = vec![0u32; 2 * n];
                        g.all_gather(&x, &mut out)?;
                        let want: Vec<u32> = (0..n as u32).flat_map(|r| [round + r; 2]).collect();
                        same(g, "all_gather", &out, &want)?;
                    }
                    _ => g.broadcast(&mut x, (root + 1) % n)?,
                }
                if me == n - 1 && round % 9 == 4 {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            Ok(())
        });
    }
}

/// Small areas last written 2³¹ pieces ago or more (a long run of all_reduces on the slots, say)
/// while a peer comes late: late, not corrupt.
#[test]
fn an_area_unwritten_for_long_is_late_not_corrupt() {
    // As if pieces 0 and 1 took the small areas, then 2³¹ + 2 pieces the slots.
    let start = (1u32 << 31) + 2;
    on_one_host_from(3, start, [1, 2], |g| {
        for late in [1, 2, 0] {
            if g.rank() == late {
                std::thread::sleep(Duration::from_millis(100));
            }
            g.barrier()?;
        }
        let mut x = [g.rank() as u32; 2];
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        same(g, "all_reduce", &x, &[3; 2])
    });
}

/// A mismatched small broadcast (one rank's count past the areas' limit: it waits for messages
/// that never come), then a collective over messages only whose root only sends, then a call on
/// the arena, where the root finds the mismatch: its abort names the broadcast, so the rank
/// still in the broadcast ends promptly too, not at its deadline.
#[test]
fn a_mismatched_broadcast_then_calls_over_messages_ends_every_rank() {
    for n in [3, 4] {
        let odd = n - 1;
        let t = Instant::now();
        let results = errors_of(n, |g| {
            let count = if g.rank() == odd { SMALL + 1 } else { SMALL };
            g.broadcast(&mut vec![1u8; count], 0)?;
            let input = vec![1u32; n * (SMALL + 1)];
            let mine = (g.rank() == 0).then_some(&input[..]);
            g.scatter(mine, &mut vec![0u32; SMALL + 1], 0)?;
            g.barrier()
        });
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{n} ranks: {:?} {results:?}",
            t.elapsed()
        );
        for (r, res) in results.iter().enumerate() {
            assert!(
                matches!(
                    res,
                    Err(DistError::CollectiveMismatch { .. } | DistError::Aborted { .. })
                ),
                "{n} ranks, rank {r}: {res:?}"
            );
        }
    }
}

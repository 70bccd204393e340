//! all_reduce on the host arena with each rank's part split over several threads
//! (`HostArena::threads`, `collectives/parts.rs`): the same bits as one thread, every op and
//! type, and a dead rank still named.

use std::time::{Duration, Instant};

use half::bf16;

use super::super::host::{ARENA_PART_MIN, ARENA_THREADS_MIN};
use super::super::scratch::segment;
use super::matrix::{TIMEOUT, inputs, ops_for, reduced, same};
use crate::testing::{ArenaAccess, MemLink, run_links};
use crate::{Backend, Collectives, Element, Group, ReduceOp, Result, Tuning};

/// Slots of 1 MiB: calls of a few MiB run several pieces.
const SLOT: usize = 1 << 20;

/// `n` ranks on one host, each splitting its part over `threads`, every all_reduce on the
/// arena whatever its size; `f`'s results by rank.
fn on_one_host<R: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(&Group<MemLink>) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    let links = MemLink::mesh_on_hosts(&vec![0; n], SLOT);
    for l in &links {
        l.set_arena_threads(threads);
    }
    run_links(links, |l| f(&Group::form(l, every_size(), TIMEOUT)?))
}

/// The group's tuning with the arena taking every size.
fn every_size() -> Tuning {
    Tuning {
        arena_max_kb: Tuning::MAX_ARENA_KB,
        ..Tuning::default()
    }
}

/// Floats whose sum depends on its order: a split that reduced out of rank order, or twice,
/// would show in the bits. With four threads a rank's writes into its slots run on more than
/// one thread where its piece is two parts or more, and on one thread otherwise; the results
/// are bitwise those of one thread and of the rank-order sum, for shares of unequal length,
/// several pieces, and calls too small to split.
#[test]
fn split_arena_pieces_give_the_same_bits() {
    let value = |r: usize, i: usize| 1.0f32 / ((r * 13 + i * 5) % 89 + 1) as f32;
    let one_part = ARENA_PART_MIN / 4 + 1;
    for n in [2, 3, 5, 8] {
        let counts = [one_part, SLOT / 4 * 3 + 5, 2 * (SLOT / 4) + 7];
        let mut by_threads = Vec::new();
        for threads in [1, 4] {
            let results = on_one_host(n, threads, |g| {
                g.link().trace_arena(true);
                let mut out = Vec::new();
                for count in counts {
                    let mut x: Vec<f32> = (0..count).map(|i| value(g.rank(), i)).collect();
                    g.all_reduce(&mut x, ReduceOp::Sum)?;
                    out.push(x.iter().map(|f| f.to_bits()).collect::<Vec<_>>());
                }
                Ok((
                    out,
                    threads_of(g.link().trace_arena(false).iter().filter(|a| a.write)),
                ))
            });
            let mut ranks = Vec::new();
            for (r, res) in results.into_iter().enumerate() {
                let (bits, used) = res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}"));
                match threads {
                    1 => assert_eq!(used, 1, "{n} ranks, rank {r}"),
                    _ => assert!(used >= 2, "{n} ranks, rank {r}: writes on {used} thread"),
                }
                ranks.push(bits);
            }
            by_threads.push(ranks);
        }
        for (c, &count) in counts.iter().enumerate() {
            let mut want: Vec<f32> = (0..count).map(|i| value(0, i)).collect();
            for r in 1..n {
                for (i, w) in want.iter_mut().enumerate() {
                    *w += value(r, i);
                }
            }
            let want: Vec<u32> = want.iter().map(|f| f.to_bits()).collect();
            for (t, ranks) in by_threads.iter().enumerate() {
                for (r, bits) in ranks.iter().enumerate() {
                    assert!(
                        bits[c] == want,
                        "{n} ranks, run {t}, rank {r}, {count} floats"
                    );
                }
            }
        }
    }
}

/// The distinct threads of `accesses`.
fn threads_of<'a>(accesses: impl Iterator<Item = &'a ArenaAccess>) -> usize {
    let mut seen = Vec::new();
    for a in accesses {
        if !seen.contains(&a.thread) {
            seen.push(a.thread);
        }
    }
    seen.len()
}

/// One traced piece of a slot's length (the second of two all_reduces of ones, `n` ranks,
/// `threads` a rank): each rank's arena accesses during it, with its own share's byte range,
/// after checking every rank's result.
fn traced_piece(
    n: usize,
    threads: usize,
) -> Vec<(usize, Vec<ArenaAccess>, std::ops::Range<usize>)> {
    let count = SLOT / 4;
    let results = on_one_host(n, threads, |g| {
        let mut x = vec![1.0f32; count];
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        g.link().trace_arena(true);
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok((g.rank(), g.link().trace_arena(false), x))
    });
    results
        .into_iter()
        .map(|res| {
            let (r, trace, x) = res.unwrap_or_else(|e| panic!("{n} ranks: {e}"));
            assert!(
                x.iter().all(|&v| v == (n * n) as f32),
                "{n} ranks, {threads} threads, rank {r}"
            );
            let share = segment(count, n, r);
            (r, trace, share.start * 4..share.end * 4)
        })
        .collect()
}

/// One piece, four threads a rank: its input's copy into the slot, the reads of its share for
/// the reduction, the reduced share's writes and the copies of the other shares each run on
/// more than one thread; the copies out read only outside the rank's own share, each range
/// from the share's owner.
#[test]
fn every_step_of_a_piece_runs_on_several_threads() {
    for n in [2, 5, 8] {
        let count = SLOT / 4;
        for (r, trace, share) in traced_piece(n, 4) {
            let first_read = trace.iter().position(|a| !a.write).expect("reads");
            let (copy_in, rest) = trace.split_at(first_read);
            let reduce = rest
                .iter()
                .filter(|a| !a.write && share.contains(&a.offset));
            let reduced = rest.iter().filter(|a| a.write);
            let copy_out: Vec<_> = rest
                .iter()
                .filter(|a| !a.write && !share.contains(&a.offset))
                .collect();
            for (step, threads) in [
                ("copy in", threads_of(copy_in.iter())),
                ("reduction", threads_of(reduce)),
                ("reduced share", threads_of(reduced)),
                ("copy out", threads_of(copy_out.iter().copied())),
            ] {
                assert!(
                    threads >= 2,
                    "{n} ranks, rank {r}: {step} on {threads} thread"
                );
            }
            for a in copy_out {
                let owner = (0..n).find(|&q| segment(count, n, q).contains(&(a.offset / 4)));
                assert_eq!(owner, Some(a.owner), "{n} ranks, rank {r}: {a:?}");
                assert!(
                    a.offset + a.len <= segment(count, n, a.owner).end * 4,
                    "{a:?}"
                );
            }
        }
    }
}

/// In a piece split into shares a rank writes into its slot only the shares its peers reduce,
/// then its reduced share: every byte of the piece once, none of its own share's input (which
/// it reduces from its buffer), on one thread or four.
#[test]
fn a_rank_copies_in_only_what_its_peers_reduce() {
    for threads in [1, 4] {
        for n in [2, 3, 5] {
            let count = SLOT / 4;
            for (r, trace, share) in traced_piece(n, threads) {
                let first_read = trace.iter().position(|a| !a.write).expect("reads");
                let at = format!("{n} ranks, {threads} threads, rank {r}");
                for a in &trace[..first_read] {
                    assert!(
                        a.offset + a.len <= share.start || a.offset >= share.end,
                        "{at}: input copied into its own share {share:?}: {a:?}"
                    );
                }
                for a in trace[first_read..].iter().filter(|a| a.write) {
                    assert!(
                        share.start <= a.offset && a.offset + a.len <= share.end,
                        "{at}: a write outside its share {share:?} after the inputs: {a:?}"
                    );
                }
                let mut times = vec![0u8; count * 4];
                for a in trace.iter().filter(|a| a.write) {
                    for t in &mut times[a.offset..a.offset + a.len] {
                        *t += 1;
                    }
                }
                assert!(
                    times.iter().all(|&t| t == 1),
                    "{at}: a byte written twice or never"
                );
            }
        }
    }
}

/// A piece smaller than `ARENA_THREADS_MIN` stays on the calling thread, every step of it; one
/// of that size splits.
#[test]
fn small_pieces_stay_on_one_thread() {
    for (count, split) in [
        (ARENA_THREADS_MIN / 4 - 1, false),
        (ARENA_THREADS_MIN / 4, true),
    ] {
        let results = on_one_host(3, 4, |g| {
            let mut x = vec![1.0f32; count];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            g.link().trace_arena(true);
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(threads_of(g.link().trace_arena(false).iter()))
        });
        for (r, res) in results.into_iter().enumerate() {
            let threads = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(
                threads >= 2,
                split,
                "{count} floats, rank {r}: {threads} threads"
            );
        }
    }
}

/// Every op of a few types, in place and into another buffer, with three threads a rank.
fn every_op_split<E: Element>() {
    let per = SLOT / std::mem::size_of::<E>();
    for n in [3, 4] {
        let results = on_one_host(n, 3, |g| {
            for op in ops_for::<E>() {
                for count in [2 * per / 3, per + 11] {
                    let what = format!("all_reduce({}, {count}, {op:?})", E::DTYPE.name());
                    let mut x = inputs::<E>(op, g.rank(), count);
                    g.all_reduce(&mut x, op)?;
                    same(g, &what, &x, &reduced::<E>(op, n, count))?;
                    let input = inputs::<E>(op, g.rank(), count);
                    let mut out = vec![E::from_f64(0.0); count];
                    g.all_reduce_into(&input, &mut out, op)?;
                    same(g, &what, &out, &reduced::<E>(op, n, count))?;
                }
            }
            Ok(())
        });
        for (r, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                panic!("{n} ranks, rank {r}: {e}");
            }
        }
    }
}

#[test]
fn split_arena_pieces_every_op() {
    every_op_split::<f32>();
    every_op_split::<bf16>();
    every_op_split::<i64>();
    every_op_split::<u8>();
}

/// A rank that dies in the middle of a split piece, after its input and before its reduced
/// share (the others then wait for it after their own reduction, before their split copy
/// out): every survivor names it, promptly.
#[test]
fn a_dead_rank_is_named_with_split_pieces() {
    let links = MemLink::mesh_on_hosts(&[0; 4], SLOT);
    for l in &links {
        l.set_arena_threads(4);
    }
    // The first all_reduce is piece 0 (reduced word 1); the second's pieces 1, 2, 3: rank 3
    // dies instead of publishing its reduced share of piece 2.
    links[3].set_arena_dies_at_reduced(3);
    let results = run_links(links, |l| {
        let g = Group::form(l, every_size(), Duration::from_secs(3))?;
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        let t = Instant::now();
        let r = g.all_reduce(&mut vec![1i32; 3 * SLOT / 4], ReduceOp::Sum);
        Ok((r, t.elapsed()))
    });
    // Rank 3, dead, hears from nobody: its own call ends by its deadline, not checked.
    for (r, res) in results.into_iter().enumerate().take(3) {
        let (res, took) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let e = res.unwrap_err();
        assert!(super::names(&e, 3), "rank {r}: {e}");
        assert!(took < Duration::from_secs(1), "rank {r}: {took:?}");
    }
}

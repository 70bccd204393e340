//! all_reduce among ranks that read each other's buffers directly (`collectives/direct.rs`),
//! over the in-memory host arena (the ranks are threads; the reads are the same system call as
//! between processes): every element type × reduce op × world size 1–9 around the sizes where
//! it starts, results bitwise alike and the same as the arena's copies; the agreement (a rank
//! that cannot read its peers keeps the group on the copies); and the faults: reads refused,
//! a wild address, a dead rank, a rank that never comes, a mismatched call.

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::super::HOST_SPLIT_MIN;
use super::super::direct::{HEADER, PART_MIN};
use super::super::scratch::segment;
use super::matrix::{TIMEOUT, inputs, ops_for, reduced, same};
use crate::link::Link;
use crate::testing::{DirectFault, MemLink, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Tuning};

/// Slots of the arena's copies (several pieces for the larger counts), and of the direct
/// reads' results (several rounds for the larger counts).
const SLOT: usize = 16 << 10;

/// Slots that take a round of over two [`PART_MIN`] parts of a share (split over threads),
/// or a whole share of the smaller calls.
const BIG_SLOT: usize = 1 << 20;

/// Runs `f` on `n` ranks of one host whose arenas (of slots of `slot` bytes) propose direct
/// reads from `min` bytes, with
/// no limit on the arena's sizes; panics naming the rank on an error. Returns each rank's
/// count of direct reads.
fn direct_on_one_host(
    n: usize,
    min: usize,
    slot: usize,
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) -> Vec<usize> {
    let links = MemLink::mesh_on_hosts(&vec![3; n], slot);
    for l in &links {
        // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces, each
        // allocated and unwritten until every rank's call has returned (set_arena_direct's
        // contract): a call that succeeds returns only once every read of its buffer is done, and
        // where a rank fails its buffer is `kept`.
        unsafe { l.set_arena_direct(Some(min)) };
    }
    let tuning = Tuning {
        arena_max_kb: 64,
        ..Tuning::default()
    };
    let results = run_links(links, |l| {
        let g = Group::form(l, tuning, TIMEOUT)?;
        f(&g)?;
        Ok(g.link().direct_reads())
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}")))
        .collect()
}

/// Counts (of `E`) on either side of where the direct reads start, over the arena's limit,
/// and with shares of unequal length.
fn counts<E: Element>() -> Vec<usize> {
    let size = std::mem::size_of::<E>();
    let split = HOST_SPLIT_MIN / size;
    vec![
        3,
        split,
        split + 1,
        split + 7,
        (100 << 10) / size + 3,
        (300 << 10) / size + 1,
    ]
}

fn every_op<E: Element>() {
    for n in 1..=9 {
        let reads = direct_on_one_host(n, 0, SLOT, |g| {
            for op in ops_for::<E>() {
                for count in counts::<E>() {
                    let mut x = inputs::<E>(op, g.rank(), count);
                    g.all_reduce(&mut x, op)?;
                    let what = format!("all_reduce({}, {count}, {op:?})", E::DTYPE.name());
                    same(g, &what, &x, &reduced::<E>(op, n, count))?;
                }
            }
            if n > 1 {
                assert_eq!(g.arena_direct_min(), Some(0), "rank {}", g.rank());
            }
            Ok(())
        });
        if n > 1 {
            assert!(reads.iter().all(|&r| r > 0), "{n} ranks: {reads:?}");
        }
    }
}

macro_rules! every_type {
    ($($t:ty: $name:ident;)*) => {$(
        #[test]
        fn $name() {
            every_op::<$t>();
        }
    )*};
}

every_type! {
    f32: direct_all_reduce_f32;
    f64: direct_all_reduce_f64;
    f16: direct_all_reduce_f16;
    bf16: direct_all_reduce_bf16;
    i8: direct_all_reduce_i8;
    u8: direct_all_reduce_u8;
    i32: direct_all_reduce_i32;
    i64: direct_all_reduce_i64;
    u32: direct_all_reduce_u32;
    u64: direct_all_reduce_u64;
}

/// Floats whose sum depends on the order: bitwise alike on every rank, the rank-order
/// reference, and the arena's copies' result (the same input run both ways); calls of both
/// kinds and other collectives between them keep the arena's count in step. Each rank's share
/// of the direct call spans three of the reduction's 128 KiB chunks, so the order is checked
/// in chunks after the first too.
#[test]
fn direct_results_are_bitwise_those_of_the_copies() {
    let value = |r: usize, i: usize| 1.0f32 / ((r * 31 + i * 7) % 97 + 1) as f32;
    for n in [2, 3, 5, 8] {
        let count = n * (300 << 10) / 4 + 5;
        let reads = direct_on_one_host(n, 128 << 10, BIG_SLOT, |g| {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut want: Vec<f32> = (0..count).map(|i| value(0, i)).collect();
            for r in 1..n {
                for (i, w) in want.iter_mut().enumerate() {
                    *w += value(r, i);
                }
            }
            // Direct (over the 128 KiB the arenas proposed).
            let mut x: Vec<f32> = (0..count).map(|i| value(g.rank(), i)).collect();
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(g, "direct sum", &bits(&x), &bits(&want))?;
            let mut b = vec![g.rank() as u8; 10];
            g.broadcast(&mut b, 1)?;
            // The arena's copies (the first 60 KiB: split, under the 128 KiB).
            let part = (60 << 10) / 4;
            let mut y: Vec<f32> = (0..part).map(|i| value(g.rank(), i)).collect();
            g.all_reduce(&mut y, ReduceOp::Sum)?;
            same(g, "copied sum", &bits(&y), &bits(&want[..part]))?;
            g.all_reduce(&mut x[..], ReduceOp::Max)?;
            same(g, "direct max", &bits(&x), &bits(&want))
        });
        assert!(reads.iter().all(|&r| r > 0), "{n} ranks: {reads:?}");
    }
}

/// The direct reads are the reduction's only: a rank reads from each peer's buffer just its
/// own share (in rounds of a slot's worth), and copies every other share's result out of its
/// owner's slot, each byte once. (Before, the results too were read from the owners' buffers:
/// every byte outside the rank's share was a direct read.)
#[test]
fn results_come_through_the_slots() {
    for n in [2, 3, 5] {
        let count = n * 10_000 + 3;
        let links = MemLink::mesh_on_hosts(&vec![0; n], SLOT);
        for l in &links {
            // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces,
            // each allocated and unwritten until every rank's call has returned (set_arena_direct's
            // contract): a call that succeeds returns only once every read of its buffer is done,
            // and where a rank fails its buffer is `kept`.
            unsafe { l.set_arena_direct(Some(0)) };
        }
        let results = run_links(links, |l| {
            let g = Group::form(l, Tuning::default(), TIMEOUT)?;
            g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
            let before = g.link().direct_read_bytes();
            g.link().trace_arena(true);
            let mut x = inputs::<u32>(ReduceOp::Sum, g.rank(), count);
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            let trace = g.link().trace_arena(false);
            same(&g, "sum", &x, &reduced::<u32>(ReduceOp::Sum, n, count))?;
            Ok((g.link().direct_read_bytes() - before, trace))
        });
        for (r, res) in results.into_iter().enumerate() {
            let (direct, trace) = res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}"));
            let share = segment(count, n, r).len() * 4;
            assert_eq!(direct, (n - 1) * share, "{n} ranks, rank {r}: direct bytes");
            // The peers' headers (their buffers' addresses), then their results.
            let from_slots: usize = trace
                .iter()
                .filter(|a| !a.write && a.owner != r && a.offset >= HEADER)
                .map(|a| a.len)
                .sum();
            assert_eq!(
                from_slots,
                count * 4 - share,
                "{n} ranks, rank {r}: slot bytes"
            );
            let written: usize = trace
                .iter()
                .filter(|a| a.write && a.offset >= HEADER)
                .map(|a| a.len)
                .sum();
            assert_eq!(written, share, "{n} ranks, rank {r}: results written");
        }
    }
}

/// Shares whose last round some ranks have nothing in (the shorter shares are whole rounds,
/// the longer one element more), and a read refused in a later round than the first: the
/// results right, and the error named as in the first round, every rank failing.
#[test]
fn uneven_last_rounds_and_late_failures() {
    let per_round = (SLOT - HEADER) / 4;
    for (n, rounds) in [(3, 2), (4, 3)] {
        // Shares of `rounds * per_round` elements, the last rank's one more.
        let count = n * rounds * per_round + 1;
        assert_eq!(segment(count, n, n - 1).len(), rounds * per_round + 1);
        assert_eq!(segment(count, n, 0).len(), rounds * per_round);
        let links = MemLink::mesh_on_hosts(&vec![0; n], SLOT);
        for l in &links {
            // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces,
            // each allocated and unwritten until every rank's call has returned (set_arena_direct's
            // contract): a call that succeeds returns only once every read of its buffer is done,
            // and where a rank fails its buffer is `kept`.
            unsafe { l.set_arena_direct(Some(0)) };
        }
        let results = run_links(links, |l| {
            let g = Group::form(l, Tuning::default(), TIMEOUT)?;
            for _ in 0..2 {
                let mut x = inputs::<u32>(ReduceOp::Sum, g.rank(), count);
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                same(&g, "sum", &x, &reduced::<u32>(ReduceOp::Sum, n, count))?;
            }
            Ok(())
        });
        for (r, res) in results.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}"));
        }
    }
    // Rank 1 of 3, one thread, reads once from each peer a round (a part of one chunk): its
    // third read, the first of the second round, is refused.
    let results = run_links(MemLink::mesh_on_hosts(&[0; 3], SLOT), |l| {
        // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces, each
        // allocated and unwritten until every rank's call has returned (set_arena_direct's
        // contract): a call that succeeds returns only once every read of its buffer is done, and
        // where a rank fails its buffer is `kept`.
        unsafe { l.set_arena_direct(Some(0)) };
        let g = Group::form(l, Tuning::default(), Duration::from_secs(3))?;
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        if g.rank() == 1 {
            g.link()
                .set_arena_direct_fault(DirectFault::RefusedAfter(2));
        }
        g.all_reduce(kept(1u32, 3 * 2 * per_round), ReduceOp::Sum)
    });
    match results[1].as_ref().unwrap_err() {
        DistError::Io {
            rank: 1, context, ..
        } => assert!(context.contains("direct read of"), "{context}"),
        e => panic!("rank 1: {e}"),
    }
    for r in [0, 2] {
        assert!(results[r].is_err(), "rank {r}: {:?}", results[r]);
    }
}

/// Slots with room for the buffer's address but not for an element after it: the group does
/// not read directly (the arena's copies or messages run instead; before, every direct call
/// of 8-byte elements failed as the caller's error).
#[test]
fn slots_too_small_for_a_result_read_nothing_directly() {
    let count = (HOST_SPLIT_MIN / 8) + 5;
    let results = run_links(MemLink::mesh_on_hosts(&[0; 3], HEADER + 4), |l| {
        // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces, each
        // allocated and unwritten until every rank's call has returned (set_arena_direct's
        // contract): a call that succeeds returns only once every read of its buffer is done, and
        // where a rank fails its buffer is `kept`.
        unsafe { l.set_arena_direct(Some(0)) };
        let g = Group::form(l, Tuning::default(), TIMEOUT)?;
        let mut x = inputs::<u64>(ReduceOp::Sum, g.rank(), count);
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        same(&g, "sum", &x, &reduced::<u64>(ReduceOp::Sum, 3, count))?;
        Ok(g.link().direct_reads())
    });
    for (r, res) in results.into_iter().enumerate() {
        let reads = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(reads, 0, "rank {r}");
    }
}

/// A rank that splits its part over several threads (`HostArena::threads`): its reads
/// run on more than one thread where its share is at least two parts of `PART_MIN`, and the
/// results are bitwise those of one thread (each element still reduced by one rank, in rank
/// order), shares of unequal length and calls too small to split among them.
#[test]
fn split_direct_reads_give_the_same_bits() {
    let value = |r: usize, i: usize| 1.0f32 / ((r * 13 + i * 5) % 89 + 1) as f32;
    for n in [2, 3, 5] {
        let big = n * (2 * PART_MIN + 40_000) / 4 + 3;
        let mut got = Vec::new();
        for threads in [1, 4] {
            let links = MemLink::mesh_on_hosts(&vec![0; n], BIG_SLOT);
            for l in &links {
                // SAFETY: the direct reads read only the buffers the ranks pass to their
                // all_reduces, each allocated and unwritten until every rank's call has returned
                // (set_arena_direct's contract).
                unsafe { l.set_arena_direct(Some(0)) };
                l.set_arena_threads(threads);
            }
            let results = run_links(links, |l| {
                let g = Group::form(l, Tuning::default(), TIMEOUT)?;
                let mut out = Vec::new();
                for count in [(100 << 10) / 4 + 1, big, big * 2 + 1] {
                    let mut x: Vec<f32> = (0..count).map(|i| value(g.rank(), i)).collect();
                    g.all_reduce(&mut x, ReduceOp::Sum)?;
                    out.push(x.iter().map(|f| f.to_bits()).collect::<Vec<_>>());
                }
                Ok((out, g.link().direct_read_threads()))
            });
            for (r, res) in results.into_iter().enumerate() {
                let (bits, used) = res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}"));
                match threads {
                    1 => assert_eq!(used, 1, "{n} ranks, rank {r}"),
                    _ => assert!(used >= 2, "{n} ranks, rank {r}: reads on {used} thread"),
                }
                got.push((threads, r, bits));
            }
        }
        let (one, split) = got.split_at(n);
        for ((_, r, a), (_, _, b)) in one.iter().zip(split) {
            assert!(a == b, "{n} ranks, rank {r}: split results differ");
            assert!(a == &one[0].2, "{n} ranks, rank {r}: differs from rank 0");
        }
    }
}

/// The group reads directly only if every rank can, from the largest size any proposed; a
/// rank that cannot keeps every rank on the arena's copies (and over messages above the
/// arena's limit), with the same results.
#[test]
fn direct_reads_are_agreed_by_every_rank() {
    for (mins, agreed) in [
        (
            vec![Some(64 << 10), Some(256 << 10), Some(0)],
            Some(256 << 10),
        ),
        (vec![Some(0), None, Some(0)], None),
    ] {
        let links = MemLink::mesh_on_hosts(&[0; 3], SLOT);
        for (l, m) in links.iter().zip(&mins) {
            // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces,
            // each allocated and unwritten until every rank's call has returned (set_arena_direct's
            // contract): a call that succeeds returns only once every read of its buffer is done,
            // and where a rank fails its buffer is `kept`.
            unsafe { l.set_arena_direct(*m) };
        }
        let results = run_links(links, |l| {
            let g = Group::form(l, Tuning::default(), TIMEOUT)?;
            for count in [(100 << 10) / 8, (300 << 10) / 8, (3 << 20) / 8] {
                let mut x = inputs::<u64>(ReduceOp::Sum, g.rank(), count);
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                same(&g, "sum", &x, &reduced::<u64>(ReduceOp::Sum, 3, count))?;
            }
            Ok((g.arena_direct_min(), g.link().direct_reads()))
        });
        for (r, res) in results.into_iter().enumerate() {
            let (min, reads) = res.unwrap_or_else(|e| panic!("{mins:?}, rank {r}: {e}"));
            assert_eq!(min, agreed, "{mins:?}, rank {r}");
            assert_eq!(
                reads > 0,
                agreed.is_some(),
                "{mins:?}, rank {r}: {reads} reads"
            );
        }
    }
}

/// A buffer of `n` copies of `v` that stays allocated for the rest of the test process: a
/// failing rank's call returns while its peers may still read its buffer directly, and the
/// test arena's contract (`MemLink::set_arena_direct`) wants every buffer a peer may read to
/// stay allocated and unwritten until every rank's call has returned. Leaked on purpose: a
/// few hundred KiB over the failure tests.
fn kept<T: Clone + 'static>(v: T, n: usize) -> &'static mut [T] {
    Box::leak(vec![v; n].into_boxed_slice())
}

/// The errors of a direct all_reduce of `count` u32 on `n` ranks whose arenas read directly,
/// `setup` run on every link first, `f` after the first all_reduce (which agrees).
fn direct_errors(
    n: usize,
    setup: impl Fn(&MemLink),
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) -> Vec<Result<()>> {
    let links = MemLink::mesh_on_hosts(&vec![0; n], BIG_SLOT);
    for l in &links {
        // SAFETY: the direct reads read only the buffers the ranks pass to their all_reduces, each
        // allocated and unwritten until every rank's call has returned (set_arena_direct's
        // contract): a call that succeeds returns only once every read of its buffer is done, and
        // where a rank fails its buffer is `kept`.
        unsafe { l.set_arena_direct(Some(0)) };
        setup(l);
    }
    run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(3))?;
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        f(&g)
    })
}

/// Reads the system refuses, or that go to an address not mapped: an I/O error naming the
/// rank, the call, the peer and the bytes; the others fail too (the reader's words stop), and
/// no rank reports a result.
#[test]
fn failed_direct_reads_are_named() {
    // One thread (a share of two chunks: four reads), and a call that rank 1 splits over 4 (a
    // share of over 4 parts); the reads all refused or wild, or only those after the first two
    // (parts that fail beside parts that succeed).
    let cases = [(1, 120_000), (4, 3 * PART_MIN + 100)];
    let faults = [
        DirectFault::Refused,
        DirectFault::WildAddress,
        DirectFault::RefusedAfter(2),
    ];
    for (fault, (threads, count)) in faults.into_iter().flat_map(|f| cases.map(|c| (f, c))) {
        let t = Instant::now();
        let results = direct_errors(
            3,
            |l| {
                l.set_arena_threads(threads);
                if l.rank() == 1 {
                    l.set_arena_direct_fault(fault);
                }
            },
            |g| {
                let r = g.all_reduce(kept(1u32, count), ReduceOp::Sum);
                let used = g.link().direct_read_threads();
                if g.rank() == 1 && threads > 1 {
                    assert!(used >= 2, "{fault:?}: rank 1 read on {used} thread");
                }
                r
            },
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        match results[1].as_ref().unwrap_err() {
            DistError::Io {
                rank: 1, context, ..
            } => {
                assert!(context.contains("all_reduce"), "{fault:?}: {context}");
                assert!(context.contains("direct read of"), "{fault:?}: {context}");
                assert!(context.contains("bytes of rank"), "{fault:?}: {context}");
            }
            e => panic!("{fault:?}, rank 1: {e}"),
        }
        for r in [0, 2] {
            assert!(results[r].is_err(), "{fault:?}, rank {r}: {:?}", results[r]);
        }
    }
}

/// A rank that dies before the call, or one that never comes: the others fail naming it.
#[test]
fn a_dead_or_absent_rank_is_named() {
    let t = Instant::now();
    let results = direct_errors(
        4,
        |_| {},
        |g| {
            if g.rank() == 3 {
                g.link().kill();
                return Ok(());
            }
            g.all_reduce(kept(1i32, 30_000), ReduceOp::Sum)
        },
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    for (r, res) in results.iter().enumerate().take(3) {
        let e = res.as_ref().unwrap_err();
        assert!(super::names(e, 3), "rank {r}: {e}");
    }
    let results = direct_errors(
        3,
        |_| {},
        |g| {
            if g.rank() == 2 {
                return Ok(());
            }
            g.all_reduce(kept(1.0f32, 30_000), ReduceOp::Sum)
        },
    );
    assert!(
        results[..2]
            .iter()
            .any(|r| matches!(r, Err(DistError::Timeout { peer: 2, .. }))),
        "{results:?}"
    );
}

/// Calls of different counts: mismatches, not hangs or wrong reads.
#[test]
fn mismatched_direct_calls_are_reported() {
    let results = direct_errors(
        3,
        |_| {},
        |g| {
            let count = if g.rank() == 1 { 40_000 } else { 40_001 };
            g.all_reduce(kept(1u8, count), ReduceOp::Sum)
        },
    );
    for (r, res) in results.iter().enumerate() {
        assert!(
            matches!(
                res,
                Err(DistError::CollectiveMismatch { .. } | DistError::Aborted { .. })
            ),
            "rank {r}: {res:?}"
        );
    }
}

/// A rank that fails after its peers' last read of its buffer was due (here its deadline
/// passes while a descheduled peer has yet to read its share), and whose abort notice is slow
/// to come: the peer that read it late fails too, rather than return a result read from a
/// buffer whose owner left (which its caller could have changed by then, in another
/// process). Here the caller changes its buffer only after a barrier that both ranks reach
/// once their calls returned (`set_arena_direct`'s contract: the ranks are threads of one
/// process), so the late read sees the unchanged bytes: rank 1 must fail all the same.
/// Without the closing piece (every peer's `Input` after the last round, which rank 0 never
/// publishes) rank 1 returns `Ok`.
#[test]
fn a_rank_that_leaves_early_fails_its_late_reader() {
    // One round: the late read is the last of the call.
    let links = MemLink::mesh_on_hosts(&[0; 2], BIG_SLOT);
    for l in &links {
        // SAFETY: the group's direct reads read only the buffers this test's ranks pass to
        // all_reduce, which each rank changes only after the barrier below, once both calls
        // have returned (set_arena_direct's contract).
        unsafe { l.set_arena_direct(Some(0)) };
    }
    // Rank 1's read of rank 0's buffer for its share's reduction waits 2.5 s.
    links[1].set_arena_direct_fault(DirectFault::Slow {
        after: 0,
        by: Duration::from_millis(2500),
    });
    // Its abort notice comes late (here never): rank 1 learns of rank 0's failure only from
    // rank 0's words.
    links[0].lose_aborts();
    let both_done = std::sync::Barrier::new(2);
    let count = (100 << 10) / 4;
    let results = run_links(links, |l| {
        let timeout = if l.rank() == 0 {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(10)
        };
        let g = Group::form(l, Tuning::default(), timeout)?;
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        let mut x = inputs::<u32>(ReduceOp::Sum, g.rank(), count);
        let r = g.all_reduce(&mut x, ReduceOp::Sum);
        let ok = match &r {
            Ok(()) => Some(x == reduced::<u32>(ReduceOp::Sum, 2, count)),
            Err(_) => None,
        };
        // The buffer stays allocated and unchanged until both calls have returned; only then
        // does the caller reuse it.
        both_done.wait();
        x.fill(u32::MAX);
        Ok((r.map_err(|e| e.to_string()), ok))
    });
    let (r0, _) = results[0].as_ref().unwrap();
    assert!(r0.is_err(), "rank 0 was to time out: {r0:?}");
    let (r1, right) = results[1].as_ref().unwrap();
    assert!(
        r1.is_err(),
        "rank 1 returned {r1:?} (its result right: {right:?}) after reading a buffer its owner \
         had left"
    );
}

/// A peer whose published buffer address would overflow with its length: an error naming it
/// as a corrupt arena, never a panic or a read.
#[test]
fn a_hostile_buffer_address_is_a_corrupt_arena() {
    let results = direct_errors(
        3,
        |l| {
            if l.rank() == 2 {
                l.set_arena_direct_fault(DirectFault::HostileHeader);
            }
        },
        |g| g.all_reduce(kept(1u32, 40_000), ReduceOp::Sum),
    );
    for r in [0, 1] {
        let e = results[r].as_ref().unwrap_err();
        let named = match e {
            DistError::PeerGone { peer, cause, .. } => *peer == 2 && cause.contains("corrupt"),
            DistError::Aborted { origin, reason, .. } => *origin == 2 || reason.contains("corrupt"),
            _ => false,
        };
        assert!(named, "rank {r}: {e}");
    }
}

//! The small all_reduce on the in-memory host arena (`collectives/small.rs`): every element
//! type × reduce op × world size at counts up to the small areas' limit and just past it, results
//! as the rank-order reference on every rank; back-to-back calls of sizes alternating across the
//! limit (no area or slot read after it was written again); which calls take the path; and the
//! faults: mismatched calls, a corrupt area word, a dead rank, a late rank.

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::super::small::{Backoff, small_reached};
use super::matrix::{TIMEOUT, inputs, ops_for, reduced, same};
use crate::testing::{MemLink, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Tuning};

/// Slots of 16 KiB: small areas of 4 KiB (a quarter of a slot), the path's whole limit.
const SLOT: usize = 16 << 10;
/// The small areas' bytes with [`SLOT`].
const SMALL: usize = SLOT / 4;

fn on_one_host(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) {
    let links = MemLink::mesh_on_hosts(&vec![7; n], SLOT);
    let results = run_links(links, |l| f(&Group::form(l, Tuning::default(), TIMEOUT)?));
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("{n} ranks, rank {r}: {e}");
        }
    }
}

fn every_op<E: Element>() {
    let per = SMALL / std::mem::size_of::<E>();
    for n in [2, 3, 4, 7] {
        on_one_host(n, |g| {
            for op in ops_for::<E>() {
                for count in [0, 1, 3, per - 1, per, per + 1] {
                    let mut x = inputs::<E>(op, g.rank(), count);
                    g.all_reduce(&mut x, op)?;
                    let what = format!("all_reduce({}, {count}, {op:?})", E::DTYPE.name());
                    same(g, &what, &x, &reduced::<E>(op, n, count))?;
                    let input = inputs::<E>(op, g.rank(), count);
                    let mut out = vec![E::from_f64(0.0); count];
                    g.all_reduce_into(&input, &mut out, op)?;
                    same(g, &what, &out, &reduced::<E>(op, n, count))?;
                }
            }
            Ok(())
        });
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
    f32: small_all_reduce_f32;
    f64: small_all_reduce_f64;
    f16: small_all_reduce_f16;
    bf16: small_all_reduce_bf16;
    i8: small_all_reduce_i8;
    u8: small_all_reduce_u8;
    i32: small_all_reduce_i32;
    i64: small_all_reduce_i64;
    u32: small_all_reduce_u32;
    u64: small_all_reduce_u64;
}

/// Floats whose sums depend on the order: bitwise the rank-order sum on every rank.
#[test]
fn small_sums_are_bitwise_in_rank_order() {
    for n in [3, 5, 8] {
        on_one_host(n, |g| {
            for count in [1, 2, 7, 8, SMALL / 4] {
                let value = |r: usize, i: usize| 1.0f32 / ((r * 31 + i * 7) % 97 + 1) as f32;
                let mut x: Vec<f32> = (0..count).map(|i| value(g.rank(), i)).collect();
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                let mut want: Vec<f32> = (0..count).map(|i| value(0, i)).collect();
                for r in 1..n {
                    for (i, w) in want.iter_mut().enumerate() {
                        *w += value(r, i);
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                same(g, &format!("sum of {count}"), &bits(&x), &bits(&want))?;
            }
            Ok(())
        });
    }
}

/// Calls up to the small areas' bytes touch no slot; one byte more goes through the slots.
#[test]
fn only_calls_within_the_small_areas_take_the_path() {
    on_one_host(3, |g| {
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        for (count, small) in [(1, true), (SMALL, true), (SMALL + 1, false)] {
            g.link().trace_arena(true);
            let mut x = vec![1u8; count];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(g, "all_reduce", &x, &vec![3u8; count])?;
            let slots = g.link().trace_arena(false);
            assert_eq!(slots.is_empty(), small, "{count} bytes: {slots:?}");
        }
        Ok(())
    });
}

/// Back-to-back calls whose sizes alternate across the limit (small, pieces of one slot, a
/// split piece, several pieces), each rank's inputs new every call: a rank that read an area or
/// slot after its owner wrote it again would get another call's bytes. Ranks run at different
/// paces (one yields between calls, one stalls now and then) so that they drift apart as far
/// as the protocol lets them.
#[test]
fn sizes_alternating_across_the_limit_never_read_a_rewritten_area() {
    let counts = [
        2usize,
        SMALL / 4 + 1,
        9,
        SMALL / 4,
        3 * SLOT / 4,
        1,
        SLOT / 2 + 3,
        0,
        5,
    ];
    for n in [2, 4, 5] {
        on_one_host(n, |g| {
            let me = g.rank();
            for round in 0..60usize {
                let count = counts[round % counts.len()];
                let value = |r: usize, i: usize| ((r + 1) * 1000 + round * 7 + i) as u32;
                let mut x: Vec<u32> = (0..count).map(|i| value(me, i)).collect();
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                let want: Vec<u32> = (0..count)
                    .map(|i| (0..n).map(|r| value(r, i)).sum())
                    .collect();
                same(g, &format!("round {round}, {count} u32"), &x, &want)?;
                if me == 1 {
                    std::thread::yield_now();
                } else if me == n - 1 && round % 7 == 3 {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            Ok(())
        });
    }
}

/// A rank that comes late (past the spin, into the sleep on its input word): the others wait
/// for it and get the right result.
#[test]
fn a_late_rank_is_waited_for() {
    on_one_host(4, |g| {
        for round in 0..3 {
            if g.rank() == round {
                std::thread::sleep(Duration::from_millis(30));
            }
            let mut x = [g.rank() as u64 + 1; 3];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(g, "late rank", &x, &[10u64; 3])?;
        }
        Ok(())
    });
}

/// A rank that lags between its small area's word and its input word: its peers finish the
/// small call and wait in the next one (on the slots) on an input word two pieces behind, which
/// is late, not corrupt.
#[test]
fn a_rank_lagging_after_its_small_area_is_late_not_corrupt() {
    on_one_host(3, |g| {
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        if g.rank() == 0 {
            g.link().set_arena_small_lag(Duration::from_millis(20));
        }
        for round in 0..3u32 {
            let mut x = [round + g.rank() as u32; 2];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(g, "small", &x, &[3 * round + 3; 2])?;
            let mut y = vec![1u32; SMALL / 4 + 1];
            g.all_reduce(&mut y, ReduceOp::Sum)?;
            same(g, "pieces", &y, &vec![3u32; SMALL / 4 + 1])?;
        }
        Ok(())
    });
}

fn errors_of(n: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) -> Vec<Result<()>> {
    run_links(MemLink::mesh_on_hosts(&vec![0; n], SLOT), |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(3))?;
        // The first all_reduce agrees on the arena; the faults come after.
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        f(&g)
    })
}

/// Mismatched calls: another count (both small, or one past the limit), another op, another
/// collective: an error on every rank (a mismatch, or the abort it sent), promptly.
#[test]
fn mismatched_small_calls_are_reported() {
    type Call = fn(&Group<MemLink>) -> Result<()>;
    let cases: [(&str, Call, Call); 4] = [
        (
            "count",
            |g| g.all_reduce(&mut [1u8; 5], ReduceOp::Sum),
            |g| g.all_reduce(&mut [1u8; 6], ReduceOp::Sum),
        ),
        (
            "count past the limit",
            |g| g.all_reduce(&mut vec![1u8; SMALL], ReduceOp::Sum),
            |g| g.all_reduce(&mut vec![1u8; SMALL + 1], ReduceOp::Sum),
        ),
        (
            "op",
            |g| g.all_reduce(&mut [1u32; 4], ReduceOp::Sum),
            |g| g.all_reduce(&mut [1u32; 4], ReduceOp::Max),
        ),
        (
            "collective",
            |g| g.all_reduce(&mut [1u8; 4], ReduceOp::Sum),
            |g| g.broadcast(&mut [1u8; 4], 0),
        ),
    ];
    for (what, mine, odd) in cases {
        let t = Instant::now();
        let results = errors_of(3, |g| if g.rank() == 1 { odd(g) } else { mine(g) });
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{what}: {:?}",
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

/// The words a waiting rank accepts: its target; the area's word before the piece (not yet),
/// however far behind, and where it equals the target (2³² pieces ago), not as arrived; nothing
/// else.
#[test]
fn small_words_allowed() {
    assert_eq!(small_reached(7, 7, 5), Some(true));
    assert_eq!(small_reached(5, 7, 5), Some(false));
    assert_eq!(small_reached(0, 7, 0), Some(false));
    assert_eq!(small_reached(0, 0, u32::MAX - 1), Some(true));
    assert_eq!(small_reached(u32::MAX - 1, 0, u32::MAX - 1), Some(false));
    // An area left alone for 2³¹ pieces or more is late, not corrupt.
    let far = 7u32.wrapping_sub(1 << 31);
    assert_eq!(small_reached(far, 7, far), Some(false));
    assert_eq!(
        small_reached(far.wrapping_sub(2), 7, far.wrapping_sub(2)),
        Some(false)
    );
    // Exactly 2³² pieces ago: the word alone cannot say it has arrived.
    assert_eq!(small_reached(7, 7, 7), Some(false));
    for v in [1, 3, 6, 8, 9, 1000, far] {
        assert_eq!(small_reached(v, 7, 5), None, "{v}");
    }
}

/// A rank whose small area words jump ahead (once it is done with its last call): the others
/// report a corrupt arena naming it. The words are written once the others are past the
/// barrier, and the others call only once they are written (messages say so), so their first
/// look at the corrupt rank's area finds them, spin or not.
#[test]
fn a_corrupt_small_word_is_an_error_naming_the_peer() {
    let (past, scribbled, done) = (
        crate::Tag::user(7),
        crate::Tag::user(8),
        crate::Tag::user(9),
    );
    // Rank 1 plays the corrupt peer, out of the call, connected until rank 0 has its error.
    let results = errors_of(3, |g| {
        g.barrier()?;
        if g.rank() == 1 {
            for peer in [0, 2] {
                g.recv_tagged(&mut [0u8; 1], peer, past)?;
            }
            for area in 0..2 {
                g.link().scribble_arena_small(area, 1001);
            }
            for peer in [0, 2] {
                g.send_tagged(&[1u8], peer, scribbled)?;
            }
            return g.recv_tagged(&mut [0u8; 1], 0, done);
        }
        g.send_tagged(&[1u8], 1, past)?;
        g.recv_tagged(&mut [0u8; 1], 1, scribbled)?;
        let r = g.all_reduce(&mut [1.0f64; 4], ReduceOp::Sum);
        if g.rank() == 0 {
            g.send_tagged(&[1u8], 1, done)?;
        }
        r
    });
    for r in [0, 2] {
        let e = results[r].as_ref().unwrap_err();
        let named = match e {
            DistError::PeerGone { peer, cause, .. } => {
                *peer == 1 && cause.contains("corrupt") && cause.contains("small area")
            }
            // The other caller found it first and told this one.
            DistError::Aborted {
                culprit, reason, ..
            } => *culprit == Some(1) && reason.contains("corrupt"),
            _ => false,
        };
        assert!(named, "rank {r}: {e}");
    }
}

/// A rank that dies while the others wait on its small area: they fail naming it, well before
/// the deadline.
#[test]
fn a_dead_rank_is_named_promptly() {
    let t = Instant::now();
    let results = errors_of(4, |g| {
        if g.rank() == 3 {
            g.link().kill();
            return Ok(());
        }
        g.all_reduce(&mut [1i32; 30], ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    for (r, res) in results.iter().enumerate().take(3) {
        let e = res.as_ref().unwrap_err();
        assert!(super::names(e, 3), "rank {r}: {e}");
    }
}

/// A rank that never comes: the others time out by the deadline, naming it.
#[test]
fn a_rank_that_never_comes_is_named_by_the_timeout() {
    let t = Instant::now();
    let results = errors_of(3, |g| {
        if g.rank() == 2 {
            return Ok(());
        }
        g.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        results[..2]
            .iter()
            .any(|r| matches!(r, Err(DistError::Timeout { peer: 2, .. }))),
        "{results:?}"
    );
}

/// The spin's backoff: after a spin that ran out, 1, 2, 4, … 64 calls skip it; a spin that
/// paid ends the backoff.
#[test]
fn spins_that_run_out_back_off_up_to_64_calls() {
    let b = Backoff::new();
    let skipped = |b: &Backoff| (0..100).take_while(|_| b.skip()).count();
    assert_eq!(skipped(&b), 0);
    for want in [1, 2, 4, 8, 16, 32, 64, 64] {
        b.spun(false);
        assert_eq!(skipped(&b), want);
    }
    b.spun(true);
    assert_eq!(skipped(&b), 0);
    b.spun(false);
    assert_eq!(skipped(&b), 1);
}

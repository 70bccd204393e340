//! all_reduce over the in-memory host arena: every element type × reduce op × world size 1–9 ×
//! counts around the split threshold and the piece boundaries, results bitwise alike on every
//! rank; and the faults: a rank that never publishes, an abort, a corrupt word, a dead rank, a
//! mismatched call, an incomplete arena (every rank falls back to messages).

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::super::arena_wait::word_reached;
use super::super::{HOST_SPLIT_MIN, host_split_min};
use super::matrix::{TIMEOUT, inputs, ops_for, reduced, same};
use crate::arena::ArenaWord;
use crate::link::Link;
use crate::testing::{MemLink, run_links};
use crate::{Backend, Collectives, DistError, Element, Group, ReduceOp, Result, Tuning};

/// Small slots, so that a few KiB make many pieces.
const SLOT: usize = 1 << 10;

fn on_one_host(n: usize, slot: usize, f: impl Fn(&Group<MemLink>) -> Result<()> + Sync) {
    let links = MemLink::mesh_on_hosts(&vec![7; n], slot);
    let results = run_links(links, |l| f(&Group::form(l, Tuning::default(), TIMEOUT)?));
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("{n} ranks, rank {r}: {e}");
        }
    }
}

/// Counts around one piece, two, the split threshold of `n` ranks, for slots of `slot` bytes.
fn counts<E: Element>(slot: usize, n: usize) -> Vec<usize> {
    let per = slot / std::mem::size_of::<E>();
    let split = host_split_min(n).min(slot) / std::mem::size_of::<E>();
    vec![
        0,
        1,
        5,
        per - 1,
        per,
        per + 1,
        2 * per + 3,
        split,
        split + 1,
        3 * per + 7,
    ]
}

fn every_op<E: Element>(slot: usize) {
    for n in 1..=9 {
        on_one_host(n, slot, |g| {
            for op in ops_for::<E>() {
                for count in counts::<E>(slot, n) {
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
            every_op::<$t>(SLOT);
        }
    )*};
}

every_type! {
    f32: host_all_reduce_f32;
    f64: host_all_reduce_f64;
    f16: host_all_reduce_f16;
    bf16: host_all_reduce_bf16;
    i8: host_all_reduce_i8;
    u8: host_all_reduce_u8;
    i32: host_all_reduce_i32;
    i64: host_all_reduce_i64;
    u32: host_all_reduce_u32;
    u64: host_all_reduce_u64;
}

/// Slots larger than the split threshold: small buffers reduced whole, large ones split, on
/// either side of it; floats whose sums depend on the order come out bitwise alike on every
/// rank, and as the rank-order reference.
#[test]
fn split_threshold_and_bitwise_equal_results() {
    let slot = 4 * HOST_SPLIT_MIN;
    for n in [2, 3, 5, 8] {
        on_one_host(n, slot, |g| {
            let per = host_split_min(n) / 4;
            for count in [per, per + 1, slot / 4 + 9, 3 * slot / 4] {
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
                same(
                    g,
                    &format!("sum of {count} floats"),
                    &bits(&x),
                    &bits(&want),
                )?;
            }
            Ok(())
        });
    }
}

/// Another collective between arena all_reduces keeps the pieces' count in step, and a later
/// all_reduce of another size starts where the last ended.
#[test]
fn other_collectives_between_arena_all_reduces() {
    on_one_host(4, SLOT, |g| {
        for count in [3usize, 700, 2, 5000] {
            let mut x = inputs::<u32>(ReduceOp::Sum, g.rank(), count);
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(
                g,
                "all_reduce",
                &x,
                &reduced::<u32>(ReduceOp::Sum, 4, count),
            )?;
            let mut b = vec![g.rank() as u8; 10];
            g.broadcast(&mut b, 2)?;
            same(g, "broadcast", &b, &[2u8; 10])?;
        }
        assert_eq!(g.arena_in_use(), Some(true));
        Ok(())
    });
}

fn errors_of(
    links: Vec<MemLink>,
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) -> Vec<Result<()>> {
    run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(3))?;
        // The first all_reduce agrees on the arena; the faults come after.
        g.all_reduce(&mut [1u8], ReduceOp::Sum)?;
        f(&g)
    })
}

/// A rank that never comes to the all_reduce: the others time out by the deadline naming it.
#[test]
fn a_rank_that_never_publishes_is_named_by_the_timeout() {
    let t = Instant::now();
    let results = errors_of(MemLink::mesh_on_hosts(&[0; 3], SLOT), |g| {
        if g.rank() == 2 {
            return Ok(());
        }
        g.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    for r in [0, 1] {
        match results[r].as_ref().unwrap_err() {
            DistError::Timeout { peer, op, .. } => {
                assert_eq!(*peer, 2, "rank {r}: {op}");
                assert!(op.contains("host arena"), "{op}");
                assert!(op.contains("at 1, waited for 2"), "{op}");
            }
            DistError::Aborted { .. } => {}
            e => panic!("rank {r}: {e}"),
        }
    }
    assert!(
        results[..2]
            .iter()
            .any(|r| matches!(r, Err(DistError::Timeout { peer: 2, .. }))),
        "{results:?}"
    );
}

/// A rank whose word jumps ahead beyond what the protocol allows: the others report a corrupt
/// arena naming it.
#[test]
fn a_corrupt_word_is_an_error_naming_the_peer() {
    // Input: behind by one or two, or up to one ahead; Reduced: behind by one, or there.
    assert_eq!(word_reached(4, 5, 2, 1), Some(false));
    assert_eq!(word_reached(3, 5, 2, 1), Some(false));
    assert_eq!(word_reached(2, 5, 2, 1), None);
    assert_eq!(word_reached(5, 5, 1, 0), Some(true));
    assert_eq!(word_reached(6, 5, 2, 1), Some(true));
    assert_eq!(word_reached(7, 5, 2, 1), None);
    assert_eq!(word_reached(6, 5, 1, 0), None);
    assert_eq!(word_reached(3, 5, 1, 0), None);
    assert_eq!(word_reached(u32::MAX, 0, 1, 0), Some(false));
    assert_eq!(word_reached(u32::MAX - 1, 0, 2, 1), Some(false));
    assert_eq!(word_reached(0, 0, 2, 1), Some(true));
    assert_eq!(word_reached(0, u32::MAX, 2, 1), Some(true));
    assert_eq!(word_reached(1, u32::MAX, 2, 1), None);
    assert_eq!(word_reached(1 << 31, 0, 2, 1), None);
    // A peer whose input word jumps ahead.
    for word in [ArenaWord::Input] {
        let links = MemLink::mesh_on_hosts(&[0; 3], SLOT);
        // Rank 1 plays the corrupt peer: it scribbles on its word and stays connected, out of
        // the call, until rank 0 has its error (run in the call, its own view of the scribbled
        // word would make it blame the others first, at random).
        let done = crate::Tag::user(9);
        let results = errors_of(links, |g| {
            if g.rank() == 1 {
                g.link().scribble_arena(word, 1000);
                g.barrier()?;
                return g.recv_tagged(&mut [0u8; 1], 0, done);
            }
            g.barrier()?;
            let r = g.all_reduce(&mut vec![1.0f64; 4000], ReduceOp::Sum);
            if g.rank() == 0 {
                g.send_tagged(&[1u8], 1, done)?;
            }
            r
        });
        for r in [0, 2] {
            let e = results[r].as_ref().unwrap_err();
            let named = match e {
                DistError::PeerGone { peer, cause, .. } => *peer == 1 && cause.contains("corrupt"),
                DistError::Aborted { origin, reason, .. } => {
                    *origin == 1 && reason.contains("corrupt")
                }
                _ => false,
            };
            assert!(named, "{word:?}, rank {r}: {e}");
        }
    }
}

/// A rank that dies while the others wait on its word: they fail naming it, well before the
/// deadline.
#[test]
fn a_dead_rank_is_named_promptly() {
    let t = Instant::now();
    let results = errors_of(MemLink::mesh_on_hosts(&[0; 4], SLOT), |g| {
        if g.rank() == 3 {
            g.link().kill();
            return Ok(());
        }
        g.all_reduce(&mut vec![1i32; 3000], ReduceOp::Sum)
    });
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    for (r, res) in results.iter().enumerate().take(3) {
        let e = res.as_ref().unwrap_err();
        assert!(super::names(e, 3), "rank {r}: {e}");
    }
}

/// An abort from a rank outside the all_reduce ends the others' waits.
#[test]
fn an_abort_ends_the_waits() {
    let results = errors_of(MemLink::mesh_on_hosts(&[0; 3], SLOT), |g| {
        if g.rank() == 0 {
            g.abort(crate::collectives::COLLECTIVE_TAG, "given up", None)?;
            return Ok(());
        }
        g.all_reduce(&mut [1u32; 9], ReduceOp::Sum)
    });
    for r in [1, 2] {
        match results[r].as_ref().unwrap_err() {
            DistError::Aborted { origin, reason, .. } => {
                assert_eq!((*origin, reason.as_str()), (0, "given up"))
            }
            e => panic!("rank {r}: {e}"),
        }
    }
}

/// Calls that differ (a count, or another collective over messages) are mismatches on every
/// rank, not hangs.
#[test]
fn mismatched_calls_are_reported() {
    let results = errors_of(MemLink::mesh_on_hosts(&[0; 3], SLOT), |g| {
        let count = if g.rank() == 1 { 5 } else { 6 };
        g.all_reduce(&mut vec![1u8; count], ReduceOp::Sum)
    });
    for (r, res) in results.iter().enumerate() {
        assert!(
            matches!(
                res,
                Err(DistError::CollectiveMismatch { .. } | DistError::Aborted { .. })
            ),
            "rank {r}: {res:?}"
        );
    }
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(DistError::CollectiveMismatch { .. })))
    );
    let t = Instant::now();
    let results = errors_of(MemLink::mesh_on_hosts(&[0; 3], SLOT), |g| {
        if g.rank() == 2 {
            g.broadcast(&mut [1u8; 4], 0)
        } else {
            g.all_reduce(&mut [1u8; 4], ReduceOp::Sum)
        }
    });
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
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

/// Jobs of several hosts (in any order of ranks, hosts of one rank among them): all_reduce
/// within each host on the arena, between the hosts' leaders over messages, back on the arena;
/// every op, several element types, counts over several pieces.
#[test]
fn hierarchical_all_reduce_over_several_hosts() {
    fn check<E: Element>(g: &Group<MemLink>, n: usize) -> Result<()> {
        for op in ops_for::<E>() {
            for count in counts::<E>(SLOT, n) {
                let mut x = inputs::<E>(op, g.rank(), count);
                g.all_reduce(&mut x, op)?;
                let what = format!("all_reduce({}, {count}, {op:?})", E::DTYPE.name());
                same(g, &what, &x, &reduced::<E>(op, n, count))?;
            }
        }
        Ok(())
    }
    for hosts in [
        vec![0, 0, 1, 1],
        vec![0, 0, 1, 1, 1],
        vec![2, 1, 1, 2, 0, 2, 1],
        vec![0, 0, 0, 1],
        vec![5, 5, 5, 5, 9, 9, 9, 9, 7],
    ] {
        let n = hosts.len();
        let results = run_links(MemLink::mesh_on_hosts(&hosts, SLOT), |l| {
            let g = Group::form(l, Tuning::default(), TIMEOUT)?;
            check::<f32>(&g, n)?;
            check::<i64>(&g, n)?;
            check::<u8>(&g, n)?;
            assert_eq!(g.arena_in_use(), Some(true));
            Ok(())
        });
        for (r, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                panic!("hosts {hosts:?}, rank {r}: {e}");
            }
        }
    }
}

/// One rank whose arena is incomplete: every rank falls back to messages, and the results are
/// right. So does a job in which no two ranks share a host.
#[test]
fn an_incomplete_arena_or_no_shared_host_falls_back_to_messages() {
    for (hosts, incomplete) in [(vec![0; 4], Some(2)), (vec![0, 1, 2, 3], None)] {
        let links = MemLink::mesh_on_hosts(&hosts, SLOT);
        if let Some(r) = incomplete {
            links[r].set_arena_incomplete();
        }
        let n = hosts.len();
        let results = run_links(links, |l| {
            let g = Group::form(l, Tuning::default(), TIMEOUT)?;
            let mut x = inputs::<i64>(ReduceOp::Sum, g.rank(), 3000);
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            same(
                &g,
                "all_reduce",
                &x,
                &reduced::<i64>(ReduceOp::Sum, n, 3000),
            )?;
            Ok(g.arena_in_use())
        });
        for res in results {
            assert_eq!(res.unwrap(), Some(false));
        }
    }
}

/// The group's arena limit (rank 0's tuning, whatever the others'): an all_reduce above it
/// runs over messages (the ranks, all of one host, agree on the arena on it, as it could run
/// there if they read each other's buffers directly: here they cannot); one at it runs on the
/// arena; a limit of 0 keeps every all_reduce off it and out of the agreement. Results are
/// right either way.
#[test]
fn the_groups_arena_limit_decides() {
    for (limit_kb, small_on_arena) in [(1u32, Some(true)), (0, None)] {
        let results = run_links(MemLink::mesh_on_hosts(&[0; 3], SLOT), |l| {
            let local = Tuning {
                // Only rank 0's counts: the others ask for no limit at all.
                arena_max_kb: if l.rank() == 0 {
                    limit_kb
                } else {
                    Tuning::MAX_ARENA_KB
                },
                ..Tuning::default()
            };
            let g = Group::form(l, local, TIMEOUT)?;
            let mut seen = Vec::new();
            for count in [257usize, 256] {
                let mut x = inputs::<u32>(ReduceOp::Sum, g.rank(), count);
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                same(
                    &g,
                    "all_reduce",
                    &x,
                    &reduced::<u32>(ReduceOp::Sum, 3, count),
                )?;
                seen.push(g.arena_in_use());
            }
            Ok(seen)
        });
        for res in results {
            assert_eq!(
                res.unwrap(),
                vec![small_on_arena, small_on_arena],
                "limit {limit_kb} KiB"
            );
        }
    }
}

/// The limit a link proposes by its host's ranks and cores.
#[test]
fn arena_limits_by_ranks_and_cores() {
    use super::super::host_arena_limit;
    let all = (Tuning::MAX_ARENA_KB as usize) << 10;
    assert_eq!(host_arena_limit(4, 4, 2), 1 << 20);
    assert_eq!(host_arena_limit(17, 17, 16), 1 << 20);
    assert_eq!(host_arena_limit(4, 4, 4), 1 << 20);
    assert_eq!(host_arena_limit(7, 7, 13), 1 << 20);
    assert_eq!(host_arena_limit(8, 8, 32), all);
    assert_eq!(host_arena_limit(16, 16, 16), all);
    // Two cores or more a rank: the arena splits each rank's part over them, at every size.
    assert_eq!(host_arena_limit(2, 2, 32), all);
    assert_eq!(host_arena_limit(7, 7, 14), all);
    assert_eq!(host_arena_limit(4, 8, 16), 1 << 20);
    // A job over several hosts keeps the limit of fewer ranks.
    assert_eq!(host_arena_limit(16, 32, 32), 1 << 20);
}

/// A second group over the same link (a clone of it) is refused while the first lives: its
/// messages would share the first's tags (and, with equal descriptors, be taken by it
/// silently). Once the first is dropped a new one forms; the arena stays with the first group
/// that claimed it, so the new one runs its all_reduces over messages, with right results.
/// (Before, the second group formed and shared the first's tags.)
#[test]
fn a_second_group_over_one_link_is_refused_while_the_first_lives() {
    let results = run_links(MemLink::mesh_on_hosts(&[0; 3], SLOT), |l| {
        let first = Group::form(l.clone(), Tuning::default(), TIMEOUT)?;
        let refused = match Group::form(l.clone(), Tuning::default(), TIMEOUT) {
            Err(DistError::InvalidArgument { reason, .. }) => reason,
            other => panic!("rank {}: {other:?}", l.rank()),
        };
        let check = |g: &Group<MemLink>| -> Result<()> {
            for count in [5usize, 3000] {
                let mut x = inputs::<i32>(ReduceOp::Sum, g.rank(), count);
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                same(
                    g,
                    "all_reduce",
                    &x,
                    &reduced::<i32>(ReduceOp::Sum, 3, count),
                )?;
            }
            Ok(())
        };
        check(&first)?;
        let on_arena = first.arena_in_use();
        drop(first);
        let next = Group::form(l, Tuning::default(), TIMEOUT)?;
        check(&next)?;
        Ok((refused, on_arena, next.arena_in_use()))
    });
    for res in results {
        let (refused, first, next) = res.unwrap();
        assert!(
            refused.contains("a group already runs over this link"),
            "{refused}"
        );
        assert_eq!((first, next), (Some(true), Some(false)));
    }
}

/// A form that fails gives the link back: the next one over it forms (a claim kept by a
/// failed form would refuse it). The link stays aborted by the failure, as after any: the new
/// group's collectives fail with it.
#[test]
fn a_failed_form_gives_the_link_back() {
    let l = MemLink::mesh(1).pop().unwrap();
    let bad = Tuning {
        ring_piece_kb: 0,
        ..Tuning::default()
    };
    match Group::form(l.clone(), bad, TIMEOUT) {
        Err(DistError::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("ring piece"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let g = Group::form(l, Tuning::default(), TIMEOUT).unwrap();
    match g.all_reduce(&mut [3u32; 4], ReduceOp::Sum) {
        Err(DistError::Aborted { reason, .. }) => {
            assert!(reason.contains("ring piece"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

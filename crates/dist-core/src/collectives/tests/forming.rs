//! Forming a group over the in-memory link: rank 0's tuning goes down the binomial tree of
//! the ranks, and a failure or abort on the way reaches every rank within a bound.

use std::sync::Mutex;
use std::time::Duration;

use crate::testing::{Delivery, MemLink, run_links};
use crate::{Backend, Collectives, DistError, Group, ReduceOp, Tuning};

/// Every rank gets rank 0's tuning from its parent in the tree (`me` less its highest set bit,
/// as dist-tcp's lazy formation tree), one message each, so rank 0 sends ⌈log₂ n⌉ of them, not
/// n − 1 (each rank's own tuning differs, so a rank that kept its own would show). Fails with
/// rank 0 sending to every rank.
#[test]
fn the_tuning_goes_down_the_tree() {
    for n in [1, 2, 3, 7, 8, 9, 16, 33] {
        let links = MemLink::mesh(n);
        let seen: std::sync::Arc<Mutex<Vec<(usize, usize)>>> = Default::default();
        let log = seen.clone();
        links[0].set_faults(move |m| {
            if m.tag == crate::collectives::GROUP_TAG {
                log.lock().unwrap().push((m.src, m.dst));
            }
            Delivery::Now
        });
        let results = run_links(links, |l| {
            use crate::transport::Link;
            let own = Tuning {
                ring_piece_kb: 64 + 4 * l.rank() as u32,
                ..Tuning::default()
            };
            Ok(Group::form(l, own, Duration::from_secs(10))?.tuning())
        });
        for (r, t) in results.into_iter().enumerate() {
            assert_eq!(t.unwrap().ring_piece_kb, 64, "n {n}, rank {r}");
        }
        let mut sent = seen.lock().unwrap().clone();
        sent.sort_unstable_by_key(|&(_, dst)| dst);
        let expected: Vec<(usize, usize)> = (1..n).map(|r| (r - (1 << r.ilog2()), r)).collect();
        assert_eq!(sent, expected, "n {n}");
        let from_0 = sent.iter().filter(|(src, _)| *src == 0).count();
        assert_eq!(from_0, (n as f64).log2().ceil() as usize, "n {n}");
    }
}

/// A rank that dies while passing the tuning on (rank 1 of 8, as it sends to its child 3): its
/// children (3, 5) fail their wait on it and tell the ranks they reach, so every rank, rank 3's
/// child 7 included, fails at once naming rank 1, well before the 10 s timeout. Fails with
/// rank 0 sending to every rank (no rank passes it on, so rank 1 never dies).
#[test]
fn a_rank_dying_on_the_way_down_is_named_below_it() {
    let t = std::time::Instant::now();
    let links = MemLink::mesh(8);
    links[0].set_faults(|m| {
        if m.tag == crate::collectives::GROUP_TAG && m.src == 1 && m.dst == 3 {
            Delivery::Die
        } else {
            Delivery::Now
        }
    });
    let results = run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(10))?;
        g.all_reduce(&mut [1u32; 4], ReduceOp::Sum)
    });
    let took = t.elapsed();
    for (r, res) in results.into_iter().enumerate() {
        match (r, res) {
            (1, Err(_)) => {}
            (_, Err(DistError::Aborted { origin: 1, .. }))
            | (_, Err(DistError::PeerGone { peer: 1, .. })) => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// An abort heard before rank 0's tuning (a peer that gave up at once): the group forms, and
/// its first collective fails with that abort; with no abort, a late tuning is waited for.
#[test]
fn an_abort_before_the_tuning_fails_the_first_collective() {
    for abort in [true, false] {
        let links = MemLink::mesh(3);
        // Rank 0's tuning arrives late.
        links[0].set_faults(|m| {
            if m.tag == crate::collectives::GROUP_TAG {
                Delivery::After(Duration::from_millis(50))
            } else {
                Delivery::Now
            }
        });
        let results = run_links(links, |l| {
            use crate::transport::Link;
            if abort && l.rank() == 2 {
                l.abort(crate::Tag::system(2), None, "rank 2 gave up", None);
            }
            let g = Group::form(l, Tuning::default(), Duration::from_secs(10))?;
            g.all_reduce(&mut [1u32; 4], ReduceOp::Sum)
        });
        for (r, res) in results.into_iter().enumerate() {
            match (abort, res) {
                (
                    true,
                    Err(DistError::Aborted {
                        origin: 2, reason, ..
                    }),
                ) => {
                    assert_eq!(reason, "rank 2 gave up", "rank {r}")
                }
                (false, Ok(())) => {}
                (_, other) => panic!("abort {abort}, rank {r}: {other:?}"),
            }
        }
    }
}

/// Rank 0 cannot form the group (its own tuning is out of range): it says so to every rank,
/// which then fails its first collective with rank 0's reason at once. Before, rank 0 returned
/// its error alone and every other rank waited for the tuning until its deadline (10 s here).
#[test]
fn rank_0_failing_to_form_tells_every_rank() {
    let t = std::time::Instant::now();
    let results = crate::testing::run_group(
        3,
        |r| Tuning {
            ring_piece_kb: if r == 0 { 0 } else { 256 },
            lanes: 1,
            ..Tuning::default()
        },
        Duration::from_secs(10),
        |g| g.all_reduce(&mut [1u32; 4], ReduceOp::Sum),
    );
    let took = t.elapsed();
    for (r, res) in results.into_iter().enumerate() {
        match (r, res) {
            (0, Err(DistError::InvalidArgument { reason, .. })) => {
                assert!(reason.contains("ring piece"), "{reason}")
            }
            (
                _,
                Err(DistError::Aborted {
                    origin: 0, reason, ..
                }),
            ) => {
                assert!(reason.contains("ring piece"), "rank {r}: {reason}")
            }
            (_, other) => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A notice naming a later call does not end a rank's wait for its tuning: rank 1, the root of
/// the first call (a broadcast, which it only sends), forms, finishes that call and fails the
/// second on its own (a root out of range) while rank 2's tuning, and rank 1's message of the
/// first call to rank 0, are held back 200 ms; rank 2 waits for its tuning, both finish the
/// first call, and fail the second with rank 1's notice. Fails without a forming rank counting
/// as in call 1: rank 2's wait ended on the notice, which it passed on naming no call, and that
/// ended call 1 on rank 0, still in it.
#[test]
fn a_notice_for_a_later_call_does_not_end_forming() {
    let links = MemLink::mesh(3);
    links[0].set_faults(|m| {
        let late = (m.tag == crate::collectives::GROUP_TAG && m.dst == 2)
            || (m.tag == crate::collectives::COLLECTIVE_TAG && m.src == 1 && m.dst == 0);
        if late {
            Delivery::After(Duration::from_millis(200))
        } else {
            Delivery::Now
        }
    });
    let results = run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(10))?;
        let mut b = [g.rank() as u8; 8];
        let first = g.broadcast(&mut b, 1);
        if first.is_err() || b != [1; 8] {
            return Err(DistError::InvalidArgument {
                rank: g.rank(),
                op: "the first call".into(),
                reason: format!("{first:?}, {b:?}"),
            });
        }
        let root = if g.rank() == 1 { 99 } else { 1 };
        g.broadcast(&mut b, root)
    });
    for (r, res) in results.into_iter().enumerate() {
        match (r, res) {
            (1, Err(DistError::InvalidRank { given: 99, .. })) => {}
            (_, Err(DistError::Aborted { origin: 1, .. })) => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
    }
}

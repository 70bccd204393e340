//! Mismatched calls and failures over the in-memory link: every rank gets an error that names
//! the rank at fault and how, within a bound, and the group stays failed afterwards.

use std::time::{Duration, Instant};

use super::super::SECOND_RING_TAG;
use crate::testing::{Delivery, MemLink, run_links};
use crate::transport::Link;
use crate::{Backend, Collectives, DistError, Group, ReduceOp, Result, Transport, Tuning, Within};

/// Runs `f` on every rank of a group of `n` over `links` (faults set on them beforehand), and
/// returns each rank's error (a rank that got none fails the test).
fn errors(
    links: Vec<MemLink>,
    tuning: Tuning,
    timeout: Duration,
    f: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) -> Vec<DistError> {
    let n = links.len();
    run_links(links, |l| {
        let g = Group::form(l, tuning, timeout)?;
        // A rank that only sends in the bad call learns of it at its next collective.
        f(&g)?;
        for _ in 0..2 {
            g.all_reduce(&mut [1u8; 3], ReduceOp::Sum)?;
        }
        Ok(())
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| match res {
        Err(e) => e,
        Ok(()) => panic!("{n} ranks: rank {r} saw no error"),
    })
    .collect()
}

/// Every rank's error is a mismatch or an abort containing one of `expect`, within 10 s.
pub(super) fn expect_mismatch(
    sizes: impl IntoIterator<Item = usize>,
    expect: &[&str],
    bad: impl Fn(&Group<MemLink>) -> Result<()> + Sync,
) {
    for n in sizes {
        let t = Instant::now();
        for (r, e) in errors(
            MemLink::mesh(n),
            Tuning::default(),
            Duration::from_secs(30),
            &bad,
        )
        .into_iter()
        .enumerate()
        {
            let text = e.to_string();
            assert!(
                matches!(
                    e,
                    DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
                ),
                "{n} ranks, rank {r}: {text}"
            );
            assert!(
                text.starts_with(&format!("rank {r}: ")) && expect.iter().any(|x| text.contains(x)),
                "{n} ranks, rank {r}: expected one of {expect:?} in: {text}"
            );
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }
}

fn last(g: &Group<MemLink>) -> bool {
    g.rank() == g.world_size() - 1
}

#[test]
fn another_count_is_named_on_every_rank() {
    expect_mismatch(2..=9, &["count 100 vs 101", "count 101 vs 100"], |g| {
        let n = if last(g) { 101 } else { 100 };
        g.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
    });
    // Past the ring's and the two rings' thresholds (the ring: a size mismatch, explained
    // from the queued message's descriptor).
    let k = (4 << 20) / 4;
    let want = [
        format!("count {k} vs {}", k + 1),
        format!("count {} vs {k}", k + 1),
    ];
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    expect_mismatch([2, 3, 5], &want, |g| {
        let n = if last(g) { k + 1 } else { k };
        g.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
    });
}

#[test]
fn another_type_op_root_or_collective_is_named() {
    expect_mismatch(
        2..=9,
        &["element type i32 vs f32", "element type f32 vs i32"],
        |g| {
            if last(g) {
                g.all_reduce(&mut [1i32; 64], ReduceOp::Sum)
            } else {
                g.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum)
            }
        },
    );
    expect_mismatch(
        2..=9,
        &["reduce op max vs sum", "reduce op sum vs max"],
        |g| {
            let op = if last(g) {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            g.all_reduce(&mut [1u32; 1000], op)
        },
    );
    expect_mismatch(2..=9, &["root", "it called"], |g| {
        let root = if last(g) { g.world_size() - 1 } else { 0 };
        g.broadcast(&mut [7u64; 32], root)
    });
    expect_mismatch(2..=9, &["it called"], |g| {
        let n = g.world_size();
        if last(g) {
            g.all_gather(&[1.0f32; 16], &mut vec![0f32; 16 * n])
        } else {
            g.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
        }
    });
    expect_mismatch(2..=9, &["barrier"], |g| {
        if last(g) {
            g.barrier()
        } else {
            g.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
        }
    });
}

/// A rank that skips a collective: the others' error, at their deadline, says where every
/// rank is ("rank 2 finished #4 all_reduce"), from the flight records.
#[test]
fn a_skipped_collective_is_a_timeout_that_says_who_is_behind() {
    for n in [2, 3, 5] {
        let skipper = n - 1;
        let results = run_links(MemLink::mesh(n), |l| {
            let g = Group::form(l, Tuning::default(), Duration::from_secs(30))?;
            g.barrier()?;
            let mut x = [1.0f32; 8];
            for _ in 0..3 {
                g.all_reduce(&mut x, ReduceOp::Sum)?;
            }
            if g.rank() == skipper {
                // Waits (bounded) for the others' error to reach it as an abort.
                return g.within(Duration::from_secs(20)).recv_tagged(
                    &mut [0u8; 1],
                    0,
                    crate::Tag::system(77),
                );
            }
            g.within(Duration::from_millis(300))
                .all_reduce(&mut x, ReduceOp::Sum)
        });
        for (r, res) in results.into_iter().enumerate() {
            let e = res.unwrap_err();
            let text = e.to_string();
            if r == skipper {
                assert!(matches!(e, DistError::Aborted { .. }), "{text}");
                continue;
            }
            let want = format!("rank {skipper} finished #4 all_reduce");
            assert!(
                text.contains(&want) || matches!(e, DistError::Aborted { .. }),
                "{n} ranks, rank {r}: no '{want}' in: {text}"
            );
        }
    }
}

/// A rank that dies in the middle of a collective (as it sends its tenth message): every
/// other rank fails promptly with an error naming it, and its next collective fails at once.
#[test]
fn a_rank_that_dies_mid_collective_is_named_everywhere() {
    for (n, lanes, count) in [
        (2, 1, 1 << 16),
        (4, 1, 1 << 16),
        (5, 2, 1 << 20),
        (9, 1, 100),
    ] {
        let victim = n - 1;
        let links = MemLink::mesh(n);
        links[0].set_faults(move |m| {
            if m.src == victim && m.nth == 9 {
                Delivery::Die
            } else {
                Delivery::Now
            }
        });
        let t = Instant::now();
        let tuning = Tuning {
            ring_piece_kb: 16,
            lanes,
            ..Tuning::default()
        };
        let results = run_links(links, |l| {
            let g = Group::form(l, tuning, Duration::from_secs(30))?;
            let mut data = vec![1.0f32; count];
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
            let text = e.to_string();
            let names = match &e {
                DistError::PeerGone { peer, .. } => *peer == victim,
                DistError::Aborted { origin, reason, .. } => {
                    *origin == victim && reason.contains(&format!("peer {victim} gone"))
                }
                _ => false,
            };
            assert!(
                names,
                "{n} ranks, rank {r}: expected an error naming rank {victim}: {text}"
            );
        }
    }
}

/// A rank that stalls (its messages stop arriving after its twentieth): the others time out
/// by their deadline, the first to do so aborts the rest, and the group stays failed.
#[test]
fn a_stalled_rank_ends_in_timeouts_and_aborts_by_the_deadline() {
    for n in [2, 3, 6] {
        let stalled = 1;
        let links = MemLink::mesh(n);
        links[0].set_faults(move |m| {
            if m.src == stalled && m.nth >= 20 {
                Delivery::Never
            } else {
                Delivery::Now
            }
        });
        let timeout = Duration::from_millis(400);
        let t = Instant::now();
        let results = run_links(links, |l| {
            let g = Group::form(l, Tuning::default(), timeout)?;
            let mut x = vec![1.0f64; 5000];
            loop {
                if let Err(e) = g.all_reduce(&mut x, ReduceOp::Sum) {
                    let next = g.broadcast(&mut x, 0).unwrap_err();
                    assert!(matches!(next, DistError::Aborted { .. }), "{next}");
                    return Ok(e);
                }
            }
        });
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let mut timeouts = 0;
        for (r, res) in results.into_iter().enumerate() {
            let e = res.unwrap();
            match &e {
                DistError::Timeout { op, .. } => {
                    timeouts += 1;
                    assert!(
                        op.contains("all_reduce(f64 x 5000, sum) #") && op.contains('['),
                        "{e}"
                    );
                }
                DistError::Aborted { .. } => {}
                _ => panic!("{n} ranks, rank {r}: {e}"),
            }
        }
        assert!(timeouts >= 1, "{n} ranks: nobody timed out");
    }
}

/// A lane whose peer dies ends the other lane too (here and on every rank): the call reports
/// the cause, not the other lane's echo of it.
#[test]
fn one_failing_lane_stops_the_other_and_reports_the_cause() {
    let n = 4;
    let victim = 2;
    let links = MemLink::mesh(n);
    // The victim dies on its first message of the second ring.
    links[0].set_faults(move |m| {
        if m.src == victim && m.tag == SECOND_RING_TAG {
            Delivery::Die
        } else {
            Delivery::Now
        }
    });
    let tuning = Tuning {
        ring_piece_kb: 64,
        lanes: 2,
        ..Tuning::default()
    };
    let results = run_links(links, |l| {
        let g = Group::form(l, tuning, Duration::from_secs(30))?;
        g.all_reduce(&mut vec![1.0f32; 1 << 20], ReduceOp::Sum)
    });
    for (r, res) in results.into_iter().enumerate() {
        let e = res.unwrap_err();
        let text = e.to_string();
        if r == victim {
            assert!(matches!(e, DistError::PeerGone { .. }), "{text}");
            continue;
        }
        // Either it saw the victim go itself, or heard of it: never an abort of its own lane.
        assert!(super::names(&e, victim), "rank {r}: {text}");
    }
}

/// An argument refused on one rank aborts the call on the others (who would otherwise wait for
/// it), and bad arguments refuse before any message moves.
#[test]
fn a_bad_argument_on_one_rank_aborts_the_others() {
    let errs = errors(
        MemLink::mesh(3),
        Tuning::default(),
        Duration::from_secs(30),
        |g| {
            if g.rank() == 1 {
                g.all_reduce(&mut [1.0f32; 8], ReduceOp::BitXor)
            } else {
                g.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
            }
        },
    );
    assert!(
        errs[1].to_string().contains("bxor is not defined for f32"),
        "{}",
        errs[1]
    );
    for r in [0, 2] {
        assert!(
            matches!(&errs[r], DistError::Aborted { origin: 1, .. }),
            "rank {r}: {}",
            errs[r]
        );
    }
}

/// An abort names its call: a rank that fails call 2 on its own has done its part of call 1,
/// so a rank that hears of it while still before (or in) call 1 finishes call 1, with the
/// right data, and fails at call 2 with that abort. (Before, any abort ended every later
/// wait: the slow rank's call 1 failed with an abort for a call it had not reached.)
/// The same where a layer above refuses call 2 before it starts ([`Transport::refuse_next_call`],
/// as dist-hybrid's reduce does for a root without output).
#[test]
fn an_abort_for_a_later_call_lets_an_earlier_one_finish() {
    for (n, refused_above) in (2..=5).flat_map(|n| [(n, false), (n, true)]) {
        let results = run_links(MemLink::mesh(n), |l| {
            let g = Group::form(l, Tuning::default(), Duration::from_secs(30))?;
            let mut data = [g.rank() as u32 + 10; 6];
            if g.rank() == 1 {
                // Call 1: the root's part is its sends. Call 2: refused here (a root out of
                // range), which this rank alone sees.
                g.broadcast(&mut data, 1)?;
                let mut x = [0u32; 2];
                if refused_above {
                    let e = DistError::InvalidRank {
                        rank: 1,
                        op: "broadcast(u32 x 2)".into(),
                        given: n + 3,
                        world_size: n,
                    };
                    g.refuse_next_call(&e.to_string());
                    return Err(e);
                }
                return g.broadcast(&mut x, n + 3).map(|()| data);
            }
            // Every other rank starts call 1 only once rank 1's notice for call 2 is here.
            let until = Instant::now() + Duration::from_secs(10);
            while g.link().abort_notice().is_none() {
                assert!(Instant::now() < until, "{n} ranks: no abort notice came");
                std::thread::yield_now();
            }
            if let Err(e) = g.broadcast(&mut data, 1) {
                panic!("{n} ranks, rank {}: call 1 failed: {e}", g.rank());
            }
            assert_eq!(data, [11; 6], "{n} ranks, rank {}", g.rank());
            let mut x = [0u32; 2];
            g.broadcast(&mut x, 1).map(|()| data)
        });
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Err(DistError::InvalidRank { given, .. }) if r == 1 => assert_eq!(given, n + 3),
                Err(DistError::Aborted {
                    origin: 1, reason, ..
                }) if r != 1 => {
                    assert!(reason.contains("broadcast"), "{reason}")
                }
                other => panic!("{n} ranks, rank {r}: {other:?}"),
            }
        }
    }
}

/// The notice for a later call arrives while a rank waits in call 1 for a message still on
/// its way (held back by the link): the link's own wait goes on ([`Link::enter_call`]) and
/// call 1 finishes with the right data. (Without the call the group tells the link, the wait
/// ended at once with the abort.)
#[test]
fn a_wait_in_an_earlier_call_outlasts_a_notice_for_a_later_one() {
    let links = MemLink::mesh(2);
    links[0].set_faults(|e| {
        if e.src == 1 && e.tag == crate::collectives::COLLECTIVE_TAG {
            Delivery::After(Duration::from_secs(1))
        } else {
            Delivery::Now
        }
    });
    let results = run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(30))?;
        let mut data = [g.rank() as u32 + 10; 6];
        if g.rank() == 1 {
            g.broadcast(&mut data, 1)?;
            return g.broadcast(&mut [0u32; 2], 7).map(|()| data);
        }
        let started = Instant::now();
        if let Err(e) = g.broadcast(&mut data, 1) {
            panic!("rank 0: call 1 failed: {e}");
        }
        // It waited for the held message (the notice came long before it).
        assert!(started.elapsed() >= Duration::from_millis(900));
        assert!(g.link().abort_notice().is_some());
        assert_eq!(data, [11; 6]);
        g.broadcast(&mut [0u32; 2], 1).map(|()| data)
    });
    assert!(
        matches!(results[0], Err(DistError::Aborted { origin: 1, .. })),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(results[1], Err(DistError::InvalidRank { given: 7, .. })),
        "{:?}",
        results[1]
    );
}

/// A send that fails because its peer died after aborting (it found the peer gone while the
/// notice had come meanwhile) is reported as that abort, the cause, as a receive's failure
/// is. (Before, only receive errors were explained: the send said "peer gone".)
#[test]
fn a_send_to_a_peer_that_aborted_and_left_reports_the_abort() {
    let links = MemLink::mesh(2);
    let victim = links[1].clone();
    links[0].set_faults(move |e| {
        if e.src == 0 && e.tag == crate::collectives::COLLECTIVE_TAG {
            // While rank 0's send is on its way: rank 1 fails this call on its own, tells
            // everyone, and exits.
            victim.abort(e.tag, Some(1), "rank 1 gave up on its own", None);
            victim.kill();
        }
        Delivery::Now
    });
    let results = run_links(links, |l| {
        let g = Group::form(l, Tuning::default(), Duration::from_secs(30))?;
        if g.rank() == 0 {
            g.broadcast(&mut [5u32; 3], 0)
        } else {
            Ok(())
        }
    });
    match &results[0] {
        Err(DistError::Aborted {
            origin: 1, reason, ..
        }) => assert!(reason.contains("gave up on its own"), "{reason}"),
        other => panic!("rank 0: {other:?}"),
    }
}

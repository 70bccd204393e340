//! Sub-groups over the in-memory link: split's and new_group's meaning, their errors on every
//! rank, nesting, groups that share ranks used at once, and failures said in group ranks.

use std::time::Duration;

use super::*;
use crate::testing::{MemLink, run_group};
use crate::{Backend, Collectives, DistError, Group, ReduceOp, Tag, Tuning};

const T: Duration = Duration::from_secs(20);

fn ok<R: std::fmt::Debug>(out: Vec<crate::Result<R>>) -> Vec<R> {
    out.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// Every member's parent rank, in group rank order, by an all_gather over the group.
fn parents<L: crate::transport::Link>(
    sub: &Group<L>,
    parent_rank: usize,
) -> crate::Result<Vec<u64>> {
    let mut all = vec![0u64; sub.world_size()];
    sub.all_gather(&[parent_rank as u64], &mut all)?;
    Ok(all)
}

#[test]
fn split_orders_by_key_then_parent_rank_and_leaves_uncolored_ranks_out() {
    // 7 ranks: colors r % 3, except rank 6 which passes none; keys reverse the order for color
    // 0, tie for color 1 (parent order), and are arbitrary for color 2.
    let keys = [5i64, 0, 9, 4, 0, -2, 3];
    let got = ok(run_group(
        7,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            let color = (me != 6).then_some(me as u32 % 3);
            let key = if me % 3 == 0 { -(me as i64) } else { keys[me] };
            let Some(sub) = g.split(color, key)? else {
                return Ok(None);
            };
            let order = parents(&sub, me)?;
            assert_eq!(order[sub.rank()], me as u64);
            Ok(Some((sub.rank(), sub.world_size(), order)))
        },
    ));
    assert_eq!(got[6], None);
    let want = |r: usize| match r % 3 {
        0 => vec![3, 0],
        1 => vec![1, 4],
        _ => vec![5, 2],
    };
    for (r, g) in got.iter().enumerate().take(6) {
        let (sub_rank, size, order) = g.clone().unwrap();
        assert_eq!(size, 2, "rank {r}");
        assert_eq!(order, want(r), "rank {r}");
        assert_eq!(order[sub_rank], r as u64);
    }
}

#[test]
fn new_group_numbers_by_position_in_the_list() {
    let got = ok(run_group(
        5,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            let Some(sub) = g.new_group(&[4, 1, 2])? else {
                return Ok(None);
            };
            // Point-to-point in group ranks: a ring of sub-ranks.
            let (n, r) = (sub.world_size(), sub.rank());
            sub.send_tagged(&[me as u8], (r + 1) % n, Tag::user(1))?;
            let mut from = [0u8];
            sub.recv_tagged(&mut from, (r + n - 1) % n, Tag::user(1))?;
            let mut sum = [me as u32];
            sub.all_reduce(&mut sum, ReduceOp::Sum)?;
            Ok(Some((r, parents(&sub, me)?, from[0], sum[0])))
        },
    ));
    assert_eq!(got[0], None);
    assert_eq!(got[3], None);
    for (me, sub_rank, from) in [(4, 0, 2), (1, 1, 4), (2, 2, 1)] {
        let (r, order, f, sum) = got[me].clone().unwrap();
        assert_eq!((r, f, sum), (sub_rank, from, 7), "rank {me}");
        assert_eq!(order, [4, 1, 2]);
    }
}

#[test]
fn new_group_errors_reach_every_rank_and_leave_the_parent_usable() {
    type ListOf = fn(usize) -> Vec<usize>;
    let cases: [(&str, ListOf); 5] = [
        ("rank 1 is in the list twice", |_| vec![0, 1, 1]),
        ("rank 4 is out of range", |_| vec![0, 4]),
        ("empty", |_| vec![]),
        ("ranks 2, 3 passed a different list", |r| {
            if r < 2 { vec![0, 1] } else { vec![1, 0] }
        }),
        ("rank 3 passed an invalid list", |r| {
            if r == 3 { vec![0, 0] } else { vec![0, 1] }
        }),
    ];
    for (want, list) in cases {
        let got = run_group(
            4,
            |_| Tuning::default(),
            T,
            |g| {
                let e = g.new_group(&list(g.rank())).unwrap_err();
                let mut x = [1u8];
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                assert_eq!(x, [4]);
                Ok(e)
            },
        );
        for (r, e) in ok(got).into_iter().enumerate() {
            // The rank with the bad list names its own problem; the others name that rank.
            let mine = want.contains("invalid list") && r == 3;
            match &e {
                DistError::InvalidArgument { rank, op, reason } => {
                    assert_eq!((*rank, op.as_str()), (r, "new_group"));
                    if mine {
                        assert!(reason.contains("rank 0 is in the list twice"), "{e}");
                    } else if want.contains("different") && r >= 2 {
                        assert!(reason.contains("ranks 0, 1 passed a different"), "{e}");
                    } else {
                        assert!(reason.contains(want), "rank {r}: {e}");
                    }
                }
                other => panic!("rank {r}: {other}"),
            }
        }
    }
}

#[test]
fn split_against_new_group_is_an_error_on_every_rank() {
    let got = ok(run_group(
        3,
        |_| Tuning::default(),
        T,
        |g| {
            let r = if g.rank() == 1 {
                g.new_group(&[0, 1, 2]).map(|_| ())
            } else {
                g.split(Some(0), 0).map(|_| ())
            };
            Ok(r.unwrap_err().to_string())
        },
    ));
    assert!(got[0].contains("rank 1 called new_group where this rank called split"));
    assert!(got[1].contains("rank 0 called split where this rank called new_group"));
    assert!(got[2].contains("rank 1 called new_group"));
}

#[test]
fn nested_splits_get_ids_of_their_own_and_work_at_every_level() {
    let got = ok(run_group(
        8,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            let half = g.split(Some(me as u32 / 4), 0)?.unwrap();
            // Pairs inside each half, in reverse order.
            let pair = half
                .split(Some(half.rank() as u32 / 2), -(half.rank() as i64))?
                .unwrap();
            // The same halves again, as a second split of the root.
            let again = g.split(Some(me as u32 / 4), 0)?.unwrap();
            let ids = [half.link().id(), pair.link().id(), again.link().id()];
            let mut sums = [me as u64, me as u64, me as u64];
            half.all_reduce(&mut sums[0..1], ReduceOp::Sum)?;
            pair.all_reduce(&mut sums[1..2], ReduceOp::Sum)?;
            again.all_reduce(&mut sums[2..3], ReduceOp::Max)?;
            Ok((ids, sums, pair.link().members().to_vec(), pair.rank()))
        },
    ));
    for (me, (ids, sums, members, pair_rank)) in got.iter().enumerate() {
        assert!(
            ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
            "{ids:?}"
        );
        let base = me / 4 * 4;
        assert_eq!(sums[0], (base..base + 4).sum::<usize>() as u64);
        let pair_base = me / 2 * 2;
        assert_eq!(sums[1], (2 * pair_base + 1) as u64);
        assert_eq!(sums[2], (base + 3) as u64);
        assert_eq!(members, &[pair_base + 1, pair_base]);
        assert_eq!(*pair_rank, 1 - me % 2);
        // Equal on every member.
        for other in &got[base..base + 4] {
            assert_eq!(other.0[0], ids[0]);
            assert_eq!(other.0[2], ids[2]);
        }
        assert_eq!(got[me ^ 1].0[1], ids[1]);
    }
}

#[test]
fn rows_and_columns_run_at_once_from_two_threads() {
    // 6 ranks as 2 rows x 3 columns; each rank's row and column collectives run on two
    // threads at once, many times, with results checked exactly.
    let got = ok(run_group(
        6,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            let (row, col) = (me / 3, me % 3);
            let rows = g.split(Some(row as u32), col as i64)?.unwrap();
            let cols = g.split(Some(100 + col as u32), row as i64)?.unwrap();
            // Each thread ends by splitting its group again (the two splits run at once) and
            // returns the new group's id.
            let run = |sub: &Group<SubLink<MemLink>>, mates: Vec<usize>| -> crate::Result<u32> {
                for round in 0..30u64 {
                    let count = [1usize, 1000, 40_000][round as usize % 3];
                    let mut x = vec![me as u64 * 1000 + round; count];
                    sub.all_reduce(&mut x, ReduceOp::Sum)?;
                    let want: u64 = mates.iter().map(|&m| m as u64 * 1000 + round).sum();
                    assert!(x.iter().all(|&v| v == want), "round {round}");
                    let mut all = vec![0u64; mates.len()];
                    sub.all_gather(&[me as u64 + round], &mut all)?;
                    let want: Vec<u64> = mates.iter().map(|&m| m as u64 + round).collect();
                    assert_eq!(all, want);
                }
                let again = sub.split(Some(0), 0)?.unwrap();
                let mut x = [me as u64];
                again.all_reduce(&mut x, ReduceOp::Sum)?;
                assert_eq!(x[0], mates.iter().sum::<usize>() as u64);
                Ok(again.link().id())
            };
            let (a, b) = std::thread::scope(|s| {
                let a = s.spawn(|| run(&rows, (0..3).map(|c| row * 3 + c).collect()));
                let b = s.spawn(|| run(&cols, (0..2).map(|r| r * 3 + col).collect()));
                (a.join().unwrap(), b.join().unwrap())
            });
            let ids = [rows.link().id(), cols.link().id(), a?, b?];
            Ok(ids)
        },
    ));
    for (me, ids) in got.iter().enumerate() {
        for i in 0..4 {
            for j in i + 1..4 {
                assert_ne!(ids[i], ids[j], "rank {me}: {ids:?}");
            }
        }
        // Equal on the members: the row's on its row, the column's on its column.
        let (row, col) = (me / 3, me % 3);
        for c in 0..3 {
            assert_eq!((got[row * 3 + c][0], got[row * 3 + c][2]), (ids[0], ids[2]));
        }
        for r in 0..2 {
            assert_eq!((got[r * 3 + col][1], got[r * 3 + col][3]), (ids[1], ids[3]));
        }
    }
    assert_eq!(got.len(), 6);
}

#[test]
fn a_mismatch_in_a_group_names_group_ranks_and_aborts_every_group() {
    // Every rank has left the split before the mismatch: a rank still inside it would hear of
    // the abort there instead.
    let all_out = std::sync::Barrier::new(4);
    let got = ok(run_group(
        4,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            // Groups {0, 2} and {1, 3}; in {1, 3} (group ranks 0, 1) the counts disagree.
            let sub = g.split(Some(me as u32 % 2), 0)?.unwrap();
            all_out.wait();
            let mut x = vec![1u32; if me == 3 { 2 } else { 1 }];
            let first = if me % 2 == 1 {
                Some(sub.all_reduce(&mut x, ReduceOp::Sum).unwrap_err())
            } else {
                None
            };
            // Every later collective fails, on the root and in the other group too.
            let later = g.barrier().unwrap_err();
            let other = sub.barrier().unwrap_err();
            Ok((first, later, other))
        },
    ));
    for (me, (first, later, other)) in got.into_iter().enumerate() {
        if let Some(e) = first {
            match &e {
                DistError::CollectiveMismatch { rank, peer, .. }
                | DistError::Aborted {
                    rank, origin: peer, ..
                } => assert_eq!((*rank, *peer), (me / 2, 1 - me / 2), "{e}"),
                other => panic!("rank {me}: {other}"),
            }
        }
        assert!(
            matches!(later, DistError::Aborted { .. }),
            "rank {me}: {later}"
        );
        assert!(
            matches!(other, DistError::Aborted { .. }),
            "rank {me}: {other}"
        );
    }
}

#[test]
fn a_dead_member_is_named_by_its_group_rank() {
    let got = run_group(
        4,
        |_| Tuning::default(),
        Duration::from_secs(5),
        |g| {
            let me = g.rank();
            let sub = g.new_group(&[3, 1])?;
            if me == 3 {
                g.link().kill();
                return Ok(None);
            }
            let Some(sub) = sub else { return Ok(None) };
            let mut x = [0u8; 4];
            let e = sub.recv_tagged(&mut x, 0, Tag::user(1)).unwrap_err();
            Ok(Some((sub.link().id(), e)))
        },
    );
    match got[1].as_ref().unwrap() {
        Some((id, e @ DistError::PeerGone { rank, peer, .. })) => {
            assert_eq!((*rank, *peer), (1, 0));
            // Unnamed: the group is named by its id.
            assert_eq!(
                e.to_string(),
                format!(
                    "rank 1: peer 0 gone during recv from 0 (tag 1, 4 bytes) in group {id:#x} \
                     (rank 1 of 2 = backend rank 1; peer 0 = backend rank 3): the rank died \
                     (in-memory link)"
                )
            );
        }
        other => panic!("{other:?}"),
    }
}

/// 4 ranks as a 2 x 2 grid of named groups, "data" {0, 2}, {1, 3} and "tensor" {0, 1},
/// {2, 3}; rank 3 dies. Every text names the group, gives backend ranks beside group ranks,
/// and an abort whose origin is outside the group says "backend rank".
#[test]
fn errors_name_the_group_and_give_backend_ranks_beside_group_ranks() {
    let all_out = std::sync::Barrier::new(4);
    let got = run_group(
        4,
        |_| Tuning::default(),
        Duration::from_secs(5),
        |g| {
            let me = g.rank();
            let data = g.split_named(Some(me as u32 % 2), 0, "data")?.unwrap();
            let tensor = g.split_named(Some(me as u32 / 2), 0, "tensor")?.unwrap();
            assert_eq!(data.link().name(), Some("data"));
            assert_eq!(tensor.link().label(), "\"tensor\"");
            all_out.wait();
            let mut x = [1u32];
            match me {
                3 => {
                    g.link().kill();
                    Ok(vec![])
                }
                1 => {
                    // Data rank 0, with the dead rank as its data rank 1.
                    let first = data.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                    let again = data.barrier().unwrap_err();
                    let other = tensor.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                    Ok(vec![first, again, other])
                }
                0 => Ok(vec![tensor.all_reduce(&mut x, ReduceOp::Sum).unwrap_err()]),
                _ => Ok(vec![]),
            }
        },
    );
    let got = ok(got);
    let first = "rank 0: peer 1 gone during all_reduce(u32 x 1, sum) in group \"data\" (rank 0 of \
                 2 = backend rank 1; peer 1 = backend rank 3): the rank died (in-memory link)";
    let texts: Vec<String> = got[1].iter().map(ToString::to_string).collect();
    assert_eq!(texts[0], first);
    assert_eq!(
        texts[1],
        format!(
            "rank 0: barrier in group \"data\" (rank 0 of 2 = backend rank 1; rank 1 = backend \
             rank 3) aborted because rank 1 failed: {first}"
        )
    );
    let outside = format!("aborted because backend rank 3 failed: (outside this group) {first}");
    assert_eq!(
        texts[2],
        format!(
            "rank 1: all_reduce(u32 x 1, sum) in group \"tensor\" (rank 1 of 2 = backend rank 1) \
             {outside}"
        )
    );
    assert_eq!(
        got[0][0].to_string(),
        format!(
            "rank 0: all_reduce(u32 x 1, sum) in group \"tensor\" (rank 0 of 2 = backend rank 0) \
             {outside}"
        )
    );
    // The fields: group ranks, and the backend rank where the origin is outside.
    assert!(matches!(
        got[1][1],
        DistError::Aborted {
            rank: 0,
            origin: 1,
            ..
        }
    ));
    assert!(matches!(got[0][0], DistError::Aborted { origin: 3, .. }));
}

#[test]
fn tags_with_group_bits_and_ranks_outside_the_group_are_refused() {
    ok(run_group(
        3,
        |_| Tuning::default(),
        T,
        |g| {
            let sub = g.new_group(&[0, 1, 2])?.unwrap();
            let e = sub
                .send_tagged(&[1], 0, Tag::from_wire(1 << 40))
                .unwrap_err();
            assert!(e.to_string().contains("bits 32-62"), "{e}");
            let e = sub.send_tagged(&[1], 3, Tag::user(0)).unwrap_err();
            let r = g.rank();
            assert_eq!(
                e.to_string(),
                format!(
                    "rank {r}: send to 3 (tag 0, 1 bytes) in group {:#x} (rank {r} of 3 = \
                     backend rank {r}): rank 3 is out of range for world size 3",
                    sub.link().id()
                )
            );
            assert!(
                matches!(
                    e,
                    DistError::InvalidRank {
                        given: 3,
                        world_size: 3,
                        ..
                    }
                ),
                "{e}"
            );
            // A group of one works too.
            let one = g.split(Some(g.rank() as u32), 0)?.unwrap();
            let mut x = [5i32];
            one.all_reduce(&mut x, ReduceOp::Sum)?;
            assert_eq!((one.world_size(), x), (1, [5]));
            Ok(())
        },
    ));
}

#[test]
fn a_sub_link_checks_what_it_is_made_of() {
    let link = MemLink::mesh(3).swap_remove(1);
    assert!(SubLink::new(link.clone(), 0, vec![0, 1], 1).is_err());
    assert!(SubLink::new(link.clone(), 5, vec![1, 1], 0).is_err());
    assert!(SubLink::new(link.clone(), 5, vec![0, 3], 0).is_err());
    assert!(SubLink::new(link.clone(), 5, vec![0, 1], 0).is_err());
    let s = SubLink::new(link, 5, vec![2, 1], 1).unwrap();
    assert_eq!(
        (s.id(), s.members(), s.group_rank(2)),
        (5, &[2, 1][..], Some(0))
    );
}

/// In a sub-group as on the root: a rank that passes on an abort naming a later call of the
/// group passes the call on, so a rank still in an earlier call finishes it. (Before, a
/// sub-group passed every abort it heard on naming no call, which ended the slow rank's call.)
#[test]
fn a_passed_on_abort_keeps_its_call_in_a_sub_group() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let passed_on = AtomicBool::new(false);
    // Every rank is out of the split (a call of the root group, which a sub-group's abort
    // ends) before rank 1 fails its call.
    let split_done = std::sync::Barrier::new(3);
    let wait_for = |what: &dyn Fn() -> bool| {
        let until = std::time::Instant::now() + T;
        while !what() {
            assert!(std::time::Instant::now() < until, "waited {T:?}");
            std::thread::yield_now();
        }
    };
    let got = run_group(
        3,
        |_| Tuning::default(),
        T,
        |g| {
            let me = g.rank();
            let sub = g.split(Some(0), 0)?.unwrap();
            split_done.wait();
            let mut data = [me as u32 + 10; 5];
            if me == 1 {
                // Call 1 (its part: the sends), then call 2 refused here alone.
                sub.broadcast(&mut data, 1)?;
                return sub.broadcast(&mut [0u32; 2], 9).map(|()| data);
            }
            if me == 0 {
                wait_for(&|| crate::transport::Link::abort_notice(sub.link()).is_some());
            } else {
                // Rank 2 starts call 1 only once rank 0 has failed call 2 and passed it on.
                wait_for(&|| passed_on.load(Ordering::Acquire));
            }
            if let Err(e) = sub.broadcast(&mut data, 1) {
                panic!("rank {me}: call 1 failed: {e}");
            }
            assert_eq!(data, [11; 5], "rank {me}");
            let r = sub.broadcast(&mut [0u32; 2], 1);
            if me == 0 {
                passed_on.store(true, Ordering::Release);
            }
            r.map(|()| data)
        },
    );
    for (r, res) in got.into_iter().enumerate() {
        match res {
            Err(DistError::InvalidRank { given: 9, .. }) if r == 1 => {}
            Err(DistError::Aborted { origin: 1, .. }) if r != 1 => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

//! Sub-group cases: row and column groups of 2 × 4 and 4 × 2 grids used from two threads at
//! once (tensor × data parallel), split's and new_group's meaning over TCP at any world size,
//! a failure in one group aborting every group, and the typed and object conveniences.

use std::time::{Duration, Instant};

use dist_core::{
    Backend, Collectives, DistError, ObjectCollectives, ReduceOp, Subgroups, Tag, TypedMessages,
};
use dist_multirank::join;
use dist_tcp::{TcpBackend, TcpGroup};

/// Counts for the grid's collectives: one element, a prime, and one past the ring and chain
/// thresholds (1.6 MB of u64).
const COUNTS: [usize; 3] = [1, 1009, 200_003];

/// A value only rank `r` contributes at index `i` of round `k`, exact in u64 sums.
fn val(r: usize, i: usize, k: usize) -> u64 {
    (r as u64 + 1) * 1_000_003 + (i as u64) * 7 + k as u64
}

/// Every collective on `g`, whose group rank `j` is world rank `mates[j]`, each result checked.
fn exercise(g: &TcpGroup, mates: &[usize], rounds: usize) {
    let (me, n) = (g.rank(), g.world_size());
    let world_me = mates[me];
    assert_eq!(n, mates.len());
    for k in 0..rounds {
        for count in COUNTS {
            let mut x: Vec<u64> = (0..count).map(|i| val(world_me, i, k)).collect();
            g.all_reduce(&mut x, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{e}"));
            for (i, v) in x.iter().enumerate() {
                let want: u64 = mates.iter().map(|&m| val(m, i, k)).sum();
                assert_eq!(*v, want, "all_reduce element {i} of {count}, round {k}");
            }
            for (root, &world_root) in mates.iter().enumerate() {
                let mut b: Vec<u64> = if me == root {
                    (0..count).map(|i| val(world_me, i, k)).collect()
                } else {
                    vec![0; count]
                };
                g.broadcast(&mut b, root).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    b.iter()
                        .enumerate()
                        .all(|(i, v)| *v == val(world_root, i, k)),
                    "broadcast of {count} from group rank {root}, round {k}"
                );
            }
            let mine: Vec<u64> = (0..count).map(|i| val(world_me, i, k)).collect();
            let mut all = vec![0u64; count * n];
            g.all_gather(&mine, &mut all)
                .unwrap_or_else(|e| panic!("{e}"));
            for (j, block) in all.chunks_exact(count.max(1)).enumerate() {
                assert!(
                    block
                        .iter()
                        .enumerate()
                        .all(|(i, v)| *v == val(mates[j], i, k)),
                    "all_gather block {j} of {count}, round {k}"
                );
            }
            let full: Vec<u64> = (0..count * n).map(|i| val(world_me, i, k)).collect();
            let mut part = vec![0u64; count];
            g.reduce_scatter(&full, &mut part, ReduceOp::Max)
                .unwrap_or_else(|e| panic!("{e}"));
            let top = *mates.iter().max().unwrap();
            assert!(
                part.iter()
                    .enumerate()
                    .all(|(i, v)| *v == val(top, me * count + i, k)),
                "reduce_scatter max of {count}, round {k}"
            );
        }
        // Point-to-point in group ranks: a ring, typed, its length unknown to the receiver.
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let msg: Vec<u32> = (0..world_me * 10 + k).map(|i| i as u32).collect();
        g.send_slice(&msg, right, Tag::user(7))
            .unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<u32> = g
            .recv_vec(left, Tag::user(7), 1 << 20)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.len(), mates[left] * 10 + k, "ring message from {left}");
        g.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// `b`'s ranks as `rows` × `cols` (row-major): row and column groups, each used from its own
/// thread at once.
fn grid(b: &TcpBackend, rows: usize, cols: usize) {
    let me = b.rank();
    assert_eq!(
        b.world_size(),
        rows * cols,
        "the grid needs {rows} x {cols} ranks"
    );
    let (row, col) = (me / cols, me % cols);
    let row_g = b
        .split(Some(row as u32), col as i64)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank is in a row");
    let col_g = b
        .split(Some(col as u32), row as i64)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank is in a column");
    assert_eq!((row_g.rank(), row_g.world_size()), (col, cols));
    assert_eq!((col_g.rank(), col_g.world_size()), (row, rows));
    assert_ne!(row_g.link().id(), col_g.link().id());
    let row_mates: Vec<usize> = (0..cols).map(|c| row * cols + c).collect();
    let col_mates: Vec<usize> = (0..rows).map(|r| r * cols + col).collect();
    std::thread::scope(|s| {
        let a = s.spawn(|| exercise(&row_g, &row_mates, 3));
        let c = s.spawn(|| exercise(&col_g, &col_mates, 3));
        // The world group is used meanwhile from this thread.
        for k in 0..20u64 {
            let mut x = [me as u64 + k];
            b.all_reduce(&mut x, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{e}"));
            let n = (rows * cols) as u64;
            assert_eq!(x[0], n * (n - 1) / 2 + n * k);
        }
        for h in [a, c] {
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
}

/// 8 ranks as 2 × 4, then as 4 × 2.
pub fn grids() {
    let b = join();
    grid(&b, 2, 4);
    grid(&b, 4, 2);
    b.barrier().unwrap_or_else(|e| panic!("{e}"));
}

/// Every rank's world rank, in group rank order, gathered over `g`.
fn order(g: &TcpGroup, world_me: usize) -> Vec<u64> {
    let mut all = vec![0u64; g.world_size()];
    g.all_gather(&[world_me as u64], &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    all
}

/// split by parity (non-contiguous ranks) with reversed keys, the last rank left out; a
/// nested split; new_group of a non-contiguous list out of order; its errors on every rank.
pub fn splits() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    // Parity groups, the last rank (when there are 3 or more) without a color.
    let color = (n < 3 || me != n - 1).then_some(me as u32 % 2);
    let parity = b
        .split(color, -(me as i64))
        .unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<u64> = (0..n)
        .rev()
        .filter(|&r| r % 2 == me % 2 && (n < 3 || r != n - 1))
        .map(|r| r as u64)
        .collect();
    match (&parity, color) {
        (Some(g), Some(_)) => {
            assert_eq!(order(g, me), want);
            let mut x = [me as u64];
            g.all_reduce(&mut x, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(x[0], want.iter().sum::<u64>());
            // Nested: halves of the parity group, keys equal (parent order).
            let half = g
                .split(Some((g.rank() * 2 / g.world_size()) as u32), 0)
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap();
            let expect: Vec<u64> = want
                .iter()
                .enumerate()
                .filter(|(j, _)| j * 2 / g.world_size() == g.rank() * 2 / g.world_size())
                .map(|(_, r)| *r)
                .collect();
            assert_eq!(order(&half, me), expect);
            assert_ne!(half.link().id(), g.link().id());
        }
        (None, None) => {}
        (got, _) => panic!("rank {me} with color {color:?} got {got:?}"),
    }
    // new_group: the odd ranks from the top down, then rank 0.
    let mut list: Vec<usize> = (0..n).rev().filter(|r| r % 2 == 1).collect();
    list.push(0);
    let ng = b.new_group(&list).unwrap_or_else(|e| panic!("{e}"));
    match list.iter().position(|&r| r == me) {
        Some(i) => {
            let g = ng.expect("a listed rank gets its group");
            assert_eq!(g.rank(), i);
            let got = order(&g, me);
            assert_eq!(got, list.iter().map(|&r| r as u64).collect::<Vec<_>>());
            let objects = g
                .all_gather_bytes(format!("rank {me}").as_bytes())
                .unwrap_or_else(|e| panic!("{e}"));
            let want: Vec<Vec<u8>> = list
                .iter()
                .map(|r| format!("rank {r}").into_bytes())
                .collect();
            assert_eq!(objects, want);
        }
        None => assert!(ng.is_none(), "rank {me} is not listed"),
    }
    // Lists that differ: every rank says so, and the world goes on.
    let bad = if me == 0 { vec![0] } else { vec![0, 1] };
    match b.new_group(&bad) {
        Err(DistError::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("different list"), "{reason}")
        }
        other => panic!("rank {me}: {other:?}"),
    }
    let mut x = [1u32];
    b.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(x[0], n as u32);
}

/// Typed messages, messages of unknown length (one past the cap refused and left queued), and
/// objects broadcast and gathered, on the world and on a sub-group.
pub fn conveniences() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let floats: Vec<f32> = (0..me * 1000 + 3).map(|i| i as f32 * 0.5).collect();
    b.send_slice(&floats, right, Tag::user(1))
        .unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<f32> = b
        .recv_vec(left, Tag::user(1), 1 << 20)
        .unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = (0..left * 1000 + 3).map(|i| i as f32 * 0.5).collect();
    assert_eq!(got, want);
    // Past the receiver's cap: refused, left queued, then taken with a larger cap. 1 MiB is
    // past the TCP grace length, and in the `small_queue` variant past the budget for queued
    // messages too (it then waits in the socket, its send done only once it is received: the
    // send runs on a thread of its own).
    let big = vec![0xA5u8; 1 << 20];
    std::thread::scope(|s| {
        let send = s.spawn(|| b.send_slice(&big, right, Tag::user(2)));
        match b.recv_vec::<u8>(left, Tag::user(2), 1000) {
            Err(DistError::SizeMismatch { peer, got, .. }) => {
                assert_eq!((peer, got), (left, 1 << 20))
            }
            other => panic!("rank {me}: {other:?}"),
        }
        let got: Vec<u8> = b
            .recv_vec(left, Tag::user(2), 1 << 20)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(got == big);
        send.join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
            .unwrap_or_else(|e| panic!("{e}"));
    });
    let mut fixed = [0i64; 3];
    b.send_slice(&[me as i64; 3], right, Tag::user(3))
        .unwrap_or_else(|e| panic!("{e}"));
    b.recv_slice(&mut fixed, left, Tag::user(3))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(fixed, [left as i64; 3]);
    // Objects of every length, from every root.
    let object = |r: usize| -> Vec<u8> {
        (0..r * 101 + (r % 2) * 5000)
            .map(|i| (i + r) as u8)
            .collect()
    };
    for root in 0..n {
        let got = b
            .broadcast_bytes(&object(me), root)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(got == object(root), "broadcast_bytes from {root}");
    }
    let all = b
        .all_gather_bytes(&object(me))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(all == (0..n).map(object).collect::<Vec<_>>());
    // The same in the group of the first half, reversed.
    let half = b
        .split(Some(u32::from(me < n.div_ceil(2))), -(me as i64))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap();
    let mates: Vec<usize> = (0..n)
        .rev()
        .filter(|&r| (r < n.div_ceil(2)) == (me < n.div_ceil(2)))
        .collect();
    let all = half
        .all_gather_bytes(&object(me))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(all == mates.iter().map(|&r| object(r)).collect::<Vec<_>>());
    let got = half
        .broadcast_bytes(&object(me), half.world_size() - 1)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(got == object(*mates.last().unwrap()));
    b.barrier().unwrap_or_else(|e| panic!("{e}"));
}

/// Counts disagree inside one group: that group's ranks get the mismatch (or its abort), and
/// every rank's later collectives, on the world and in every group, fail at once.
pub fn abort_spreads() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let g = b
        .split(Some(me as u32 % 2), 0)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap();
    // Every rank has left the split before the mismatch starts (user tags are not aborted).
    for p in (0..n).filter(|&p| p != me) {
        b.send_tagged(&[1], p, Tag::user(50))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    for p in (0..n).filter(|&p| p != me) {
        b.recv_tagged(&mut [0], p, Tag::user(50))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let t = Instant::now();
    if me % 2 == 0 {
        // The even group (2 ranks or more): its last rank passes one element more. A rank
        // whose part ended before the mismatch was found learns of it from its next call.
        let count = if g.rank() == g.world_size() - 1 { 5 } else { 4 };
        if let Err(e) = g.all_reduce(&mut vec![1u32; count], ReduceOp::Sum) {
            match e {
                // Group ranks, not world ranks.
                DistError::CollectiveMismatch { rank, peer, .. } => {
                    assert_eq!(rank, g.rank());
                    assert!(peer < g.world_size(), "peer {peer}");
                }
                DistError::Aborted { .. } => {}
                e => panic!("rank {me}: {e}"),
            }
        }
    }
    // Every later collective fails at once: on the world (where the odd ranks wait for the
    // even ones) and in both groups.
    let e = b
        .all_reduce(&mut [1u8], ReduceOp::Sum)
        .expect_err("the world is aborted");
    assert!(matches!(e, DistError::Aborted { .. }), "rank {me}: {e}");
    let e = g.barrier().expect_err("the group is aborted");
    assert!(matches!(e, DistError::Aborted { .. }), "rank {me}: {e}");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(10), "rank {me} took {took:?}");
    println!("rank {me}: {e}");
}

//! Async work over TCP: every async collective against references computed here, a bucketed
//! gradient all-reduce overlapped with compute, isend/irecv beside blocking receives, and two
//! threads on one group (one refused at once, every rank ending without a hang).

use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp, Tag};
use dist_multirank::join;
use dist_tcp::TcpBackend;

/// Rank `r`'s element `i`: small integers, so f32 sums are exact.
fn val(r: usize, i: usize) -> f32 {
    ((r * 31 + i) % 1024) as f32
}

fn sum(n: usize, i: usize) -> f32 {
    (0..n).map(|r| val(r, i)).sum()
}

fn check(what: &str, got: &[f32], want: impl Fn(usize) -> f32) {
    for (i, g) in got.iter().enumerate() {
        assert_eq!(*g, want(i), "{what}: element {i} of {}", got.len());
    }
}

/// Every collective issued at once in one scope, at a count `k` per block, each checked.
fn every_collective(b: &TcpBackend, k: usize) {
    let (me, n) = (b.rank(), b.world_size());
    let mine: Vec<f32> = (0..k).map(|i| val(me, i)).collect();
    let blocks: Vec<f32> = (0..n * k).map(|i| val(me, i)).collect();
    let (mut ar, mut ar_out, mut bc, mut red, mut red_out) = (
        mine.clone(),
        vec![0.0; k],
        mine.clone(),
        mine.clone(),
        vec![0.0; k],
    );
    let (mut ag, mut ga, mut sc, mut rs, mut a2a) = (
        vec![0.0; n * k],
        vec![0.0; n * k],
        vec![0.0; k],
        vec![0.0; k],
        vec![0.0; n * k],
    );
    // all_to_all_v: every rank sends j + 1 elements to rank j.
    let send_counts: Vec<usize> = (0..n).map(|j| j + 1).collect();
    let recv_counts = vec![me + 1; n];
    let v_in: Vec<f32> = (0..n * (n + 1) / 2).map(|i| val(me, i)).collect();
    let mut v_out = vec![0.0; n * (me + 1)];
    let root = n - 1;
    let r = b.scope(|s| {
        let w_ar = s.all_reduce(&mut ar, ReduceOp::Sum);
        let w_ar_out = s.all_reduce_into(&mine, &mut ar_out, ReduceOp::Max);
        let w_bc = s.broadcast(&mut bc, root);
        let w_red = s.reduce(&mut red, ReduceOp::Sum, 0);
        let w_red_out = s.reduce_into(&mine, &mut red_out, ReduceOp::Sum, root);
        let w_ag = s.all_gather(&mine, &mut ag);
        let w_ga = s.gather(&mine, (me == root).then_some(&mut ga[..]), root);
        let w_sc = s.scatter((me == 0).then_some(&blocks[..]), &mut sc, 0);
        let w_rs = s.reduce_scatter(&blocks, &mut rs, ReduceOp::Sum);
        let w_a2a = s.all_to_all(&blocks, &mut a2a);
        let w_v = s.all_to_all_v(&v_in, &send_counts, &mut v_out, &recv_counts);
        let w_bar = s.barrier();
        check("all_reduce", w_ar.wait()?, |i| sum(n, i));
        let max = |i| (0..n).map(|r| val(r, i)).fold(f32::MIN, f32::max);
        check("all_reduce_into max", w_ar_out.wait()?, max);
        check("broadcast", w_bc.wait()?, |i| val(root, i));
        let red = w_red.wait()?;
        if me == 0 {
            check("reduce", red, |i| sum(n, i));
        }
        let red_out = w_red_out.wait()?;
        if me == root {
            check("reduce_into", red_out, |i| sum(n, i));
        }
        check("all_gather", w_ag.wait()?, |i| val(i / k, i % k));
        if let Some(out) = w_ga.wait()? {
            check("gather", out, |i| val(i / k, i % k));
        }
        check("scatter", w_sc.wait()?, |i| val(0, me * k + i));
        check("reduce_scatter", w_rs.wait()?, |i| sum(n, me * k + i));
        check("all_to_all", w_a2a.wait()?, |i| val(i / k, me * k + i % k));
        let off: usize = (1..=me).sum();
        let per = me + 1;
        check("all_to_all_v", w_v.wait()?, |i| val(i / per, off + i % per));
        w_bar.wait()
    });
    r.unwrap_or_else(|e| panic!("k={k}: {e}"));
}

/// Every async collective, small (trees, doubling) and large (rings, chains, halving).
pub fn collectives() {
    let b = join();
    for k in [0, 1, 13, 70_001] {
        every_collective(&b, k);
    }
    println!("every async collective checked at 4 counts");
}

/// What rank `r` computes for element `i` of bucket `j` in step `step`.
fn grad(r: usize, step: usize, j: usize, i: usize) -> f32 {
    ((r + 3 * step + 7 * j + i) % 512) as f32
}

/// The bucketed gradient all-reduce: each step computes four buckets of gradients one after
/// the other, issuing each bucket's all_reduce as soon as it is computed, so that it runs
/// beside the computation of the next; then checks every bucket's sum and applies it. The
/// weights end the same on every rank (checked with an all_gather of their sums).
pub fn bucketed() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let len = 256 << 10; // 1 MiB of f32 per bucket: the ring path.
    let mut buckets = vec![vec![0f32; len]; 4];
    let mut weights = vec![0f64; 4];
    for step in 0..5 {
        b.scope(|s| {
            let mut work = Vec::new();
            for (j, bucket) in buckets.iter_mut().enumerate() {
                for (i, x) in bucket.iter_mut().enumerate() {
                    *x = grad(me, step, j, i);
                }
                work.push(s.all_reduce(bucket, ReduceOp::Sum));
            }
            for (j, w) in work.into_iter().enumerate() {
                let reduced = w.wait()?;
                check("bucket", reduced, |i| {
                    (0..n).map(|r| grad(r, step, j, i)).sum()
                });
                weights[j] -= reduced.iter().map(|x| f64::from(*x)).sum::<f64>() * 1e-6;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
    let mut all = vec![0f64; 4 * n];
    b.all_gather(&weights, &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    for r in 0..n {
        assert_eq!(
            &all[4 * r..4 * r + 4],
            &weights[..],
            "rank {r}'s weights differ"
        );
    }
    println!("5 steps of 4 buckets of 1 MiB, every sum checked; weights {weights:?}");
}

/// isend/irecv around a ring (the receive issued before the send), a large message, and an
/// async send received by a blocking recv and the other way round.
pub fn p2p() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let fill = |src: usize, len: usize| -> Vec<u8> {
        (0..len).map(|i| (src * 7 + i % 251) as u8).collect()
    };
    for len in [0, 8, 3 << 20] {
        let out = fill(me, len);
        let mut inb = vec![0u8; len];
        b.scope(|s| {
            let r = s.irecv(&mut inb, left, Tag::user(5));
            let w = s.isend(&out, right, Tag::user(5));
            assert_eq!(r.wait()?, &fill(left, len)[..], "{len} bytes from {left}");
            w.wait()
        })
        .unwrap_or_else(|e| panic!("{len} bytes: {e}"));
    }
    // An async send to a blocking receive, and a blocking send to an async receive.
    let out = fill(me, 1000);
    let mut inb = vec![0u8; 1000];
    b.scope(|s| {
        let w = s.isend(&out, right, Tag::user(6));
        b.recv_tagged(&mut inb, left, Tag::user(6))?;
        w.wait()?;
        let r = s.irecv(&mut inb, right, Tag::user(7));
        b.send_tagged(&out, left, Tag::user(7))?;
        assert_eq!(r.wait()?, &fill(right, 1000)[..]);
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    println!("isend/irecv checked");
}

/// Rank 0 opens a scope on one thread and calls a collective on a second: the second is
/// refused at once with an error naming the rank, the call and the scope; the group is
/// aborted, so every other rank's collective fails promptly (no hang), and so does rank 0's
/// scope.
pub fn threads() {
    let b = join();
    let me = b.rank();
    let t = Instant::now();
    if me == 0 {
        // The scope issues no work of its own: the others' all_reduce must not be matched
        // against one of rank 0's (see the rule on `Collectives`).
        let r = b.scope(|_| {
            let refused = std::thread::scope(|t| {
                t.spawn(|| b.all_reduce(&mut [1f32; 64], ReduceOp::Sum))
                    .join()
                    .expect("the second thread panicked")
            });
            let e = refused.expect_err("a second thread's collective was let in");
            let text = e.to_string();
            assert!(
                matches!(e, DistError::ConcurrentUse { rank: 0, .. })
                    && text.contains("all_reduce(f32 x 64, sum)")
                    && text.contains("another thread is inside an async scope"),
                "{text}"
            );
            println!("refused: {text}");
            Ok(())
        });
        let e = r.expect_err("the scope ended well although the group was aborted");
        println!("the scope: {e}");
    } else {
        let e = b
            .all_reduce(&mut [1f32; 64], ReduceOp::Sum)
            .expect_err("a collective succeeded on an aborted group");
        assert!(matches!(e, DistError::Aborted { origin: 0, .. }), "{e}");
        println!("{e}");
    }
    // The job's timeout is 60 s: a rank that waited for the refused call would take that long.
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

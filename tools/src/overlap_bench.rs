//! Overlap of communication with compute: a bucketed gradient all-reduce (by default 4 buckets
//! of 4 MiB of f32), each bucket "computed" (a fixed number of arithmetic passes over it) and
//! then all-reduced, timed two ways in alternating rounds: four blocking all_reduces with the
//! compute between them, and the same compute with each bucket's all_reduce issued async in a
//! scope as soon as the bucket is ready. Each round's time is the slowest rank's; every result
//! is checked. Prints the medians and their ratio, and the compute alone and the blocking
//! all_reduces alone for scale. Run by `cargo xtask bench-overlap`.
//!
//! Arguments: `--buckets N` (4), `--bucket-mib M` (4), `--passes P` (compute passes per
//! bucket, 4), `--rounds R` (11).

use std::time::Instant;

use dist_core::{Backend, Collectives, ReduceOp};
use dist_tcp::TcpBackend;

struct Args {
    buckets: usize,
    bucket_mib: usize,
    passes: usize,
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        buckets: 4,
        bucket_mib: 4,
        passes: 4,
        rounds: 11,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = || -> usize {
            let v = pair
                .get(1)
                .unwrap_or_else(|| panic!("{} needs a value", pair[0]));
            v.parse().unwrap_or_else(|e| panic!("{} {v}: {e}", pair[0]))
        };
        match pair[0].as_str() {
            "--buckets" => a.buckets = value(),
            "--bucket-mib" => a.bucket_mib = value(),
            "--passes" => a.passes = value(),
            "--rounds" => a.rounds = value(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Rank `r`'s gradient element `i` in `round`: small integers, so the f32 sums are exact.
fn grad(r: usize, round: usize, j: usize, i: usize) -> f32 {
    ((r + round + 3 * j + i) % 256) as f32
}

/// The compute of one bucket: `passes` passes of arithmetic over it, then its gradients.
fn compute(bucket: &mut [f32], passes: usize, me: usize, round: usize, j: usize) {
    for p in 0..passes {
        let a = 1.0 + p as f32 * 1e-3;
        for x in bucket.iter_mut() {
            *x = (*x * a + 0.5).sqrt();
        }
    }
    std::hint::black_box(&mut *bucket);
    for (i, x) in bucket.iter_mut().enumerate() {
        *x = grad(me, round, j, i);
    }
}

fn check(buckets: &[Vec<f32>], n: usize, round: usize) {
    for (j, b) in buckets.iter().enumerate() {
        for (i, x) in b.iter().enumerate().step_by(997) {
            let want: f32 = (0..n).map(|r| grad(r, round, j, i)).sum();
            assert_eq!(*x, want, "round {round} bucket {j} element {i}");
        }
    }
}

/// The slowest rank's time for `f` (seconds), every rank starting together.
fn timed(b: &TcpBackend, f: impl FnOnce()) -> f64 {
    b.barrier().expect("barrier");
    let t = Instant::now();
    f();
    let mut s = [t.elapsed().as_secs_f64()];
    b.all_reduce(&mut s, ReduceOp::Max).expect("max time");
    s[0]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    dist_multirank::init_logging();
    let a = args();
    let b = dist_multirank::join();
    let (me, n) = (b.rank(), b.world_size());
    let len = (a.bucket_mib << 20) / 4;
    let mut buckets = vec![vec![0f32; len]; a.buckets];
    let (mut blocking, mut overlapped, mut compute_only, mut comm_only) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Round 0 warms up (threads, pages) and is not counted.
    for round in 0..=a.rounds {
        let run_blocking = |buckets: &mut Vec<Vec<f32>>| {
            timed(&b, || {
                for (j, bucket) in buckets.iter_mut().enumerate() {
                    compute(bucket, a.passes, me, round, j);
                    b.all_reduce(bucket, ReduceOp::Sum).expect("all_reduce");
                }
            })
        };
        let run_async = |buckets: &mut Vec<Vec<f32>>| {
            timed(&b, || {
                b.scope(|s| {
                    let mut work = Vec::new();
                    for (j, bucket) in buckets.iter_mut().enumerate() {
                        compute(bucket, a.passes, me, round, j);
                        work.push(s.all_reduce(bucket, ReduceOp::Sum));
                    }
                    work.into_iter().try_for_each(|w| w.wait().map(|_| ()))
                })
                .expect("async all_reduce");
            })
        };
        // Alternate which goes first, so that neither always runs on a warmer machine.
        let (tb, ta) = if round % 2 == 0 {
            let tb = run_blocking(&mut buckets);
            check(&buckets, n, round);
            (tb, run_async(&mut buckets))
        } else {
            let ta = run_async(&mut buckets);
            check(&buckets, n, round);
            (run_blocking(&mut buckets), ta)
        };
        check(&buckets, n, round);
        let tc = timed(&b, || {
            for (j, bucket) in buckets.iter_mut().enumerate() {
                compute(bucket, a.passes, me, round, j);
            }
        });
        let tm = timed(&b, || {
            for bucket in buckets.iter_mut() {
                b.all_reduce(bucket, ReduceOp::Sum).expect("all_reduce");
            }
        });
        if round > 0 {
            blocking.push(tb);
            overlapped.push(ta);
            compute_only.push(tc);
            comm_only.push(tm);
        }
    }
    if me == 0 {
        let ms = |v: &[f64]| median(v.to_vec()) * 1e3;
        let (mb, ma) = (ms(&blocking), ms(&overlapped));
        println!(
            "{n} ranks, {} buckets x {} MiB f32, {} compute passes, {} rounds (median, slowest \
             rank, ms):",
            a.buckets, a.bucket_mib, a.passes, a.rounds
        );
        println!("  compute alone          {:9.2}", ms(&compute_only));
        println!("  all_reduces alone      {:9.2}", ms(&comm_only));
        println!("  blocking + compute     {mb:9.2}");
        println!("  async + compute        {ma:9.2}");
        println!("  async / blocking       {:9.3}", ma / mb);
        println!("  results verified: yes");
    }
}

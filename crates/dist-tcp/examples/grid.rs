//! A program written against dist's user API, as the README and the guide describe it: the
//! ranks as a grid of named sub-groups ("tensor" along a row of 2, "data" down a column), each
//! step an all_gather of the weights' shards over the tensor group, gradient buckets reduced
//! over the data group with owned async handles (each started as its bucket is computed,
//! all waited for at the "optimizer step"), and a ring of typed `isend`/`irecv` over all ranks.
//! Every result is checked. Needs an even number of ranks.
//!
//! ```sh
//! cargo build --example grid -p dist-tcp
//! dist-run -n 4 target/debug/examples/grid              # or -n 8
//! dist-run -n 4 target/debug/examples/grid --die        # the last rank exits at step 2
//! ```
//!
//! `--die` (with `--die-rank R`, default the last, and `--die-step S`, default 2) makes a rank
//! exit (status 3) at the start of a step, as a crashed process would; every other rank then
//! fails, prints `rank R failed: ERROR` (the error naming the rank that exited) and exits with
//! status 1. `--steps N` sets the number of steps (5).

use std::process::ExitCode;

use dist_core::{Backend, Collectives, DistError, ReduceOp, Subgroups, Tag, Work};
use dist_tcp::TcpBackend;

/// The buckets of one step's gradient, and the elements in each.
const BUCKETS: usize = 4;
const BUCKET_LEN: usize = 1000;
/// Each rank's shard of the weights.
const SHARD: usize = 8;
/// The ring's tag.
const RING: Tag = Tag::user(1);

struct Args {
    steps: usize,
    die: Option<(Option<usize>, usize)>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        steps: 5,
        die: None,
    };
    let (mut die, mut rank, mut step) = (false, None, 2);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--steps" => a.steps = value("--steps")?,
            "--die" => die = true,
            "--die-rank" => rank = Some(value("--die-rank")?),
            "--die-step" => step = value("--die-step")?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    a.die = die.then_some((rank, step));
    Ok(a)
}

/// Rank `r`'s gradient, bucket `k`, element `i`, at `step`: small integers, exact in f32.
fn grad(r: usize, step: usize, k: usize, i: usize) -> f32 {
    ((r + step + k + i) % 64) as f32
}

fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("grid: {e}");
            return ExitCode::from(2);
        }
    };
    let b = match TcpBackend::from_env() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("grid: forming the job: {e}");
            return ExitCode::FAILURE;
        }
    };
    let me = b.rank();
    match run(&b, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {me} failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(b: &TcpBackend, args: &Args) -> Result<(), DistError> {
    let (me, n) = (b.rank(), b.world_size());
    if n % 2 != 0 {
        return Err(DistError::InvalidArgument {
            rank: me,
            op: "grid".into(),
            reason: format!("{n} ranks: the grid needs an even number"),
        });
    }
    // rank = d * 2 + t: a tensor group per d (a row), a data group per t (a column).
    let (tp, dp) = (2, n / 2);
    let (d, t) = (me / tp, me % tp);
    let tensor = b
        .split_named(Some(d as u32), t as i64, "tensor")?
        .expect("a row");
    let data = b
        .split_named(Some(t as u32), d as i64, "data")?
        .expect("a column");
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let die = args.die.map(|(r, s)| (r.unwrap_or(n - 1), s));

    for step in 0..args.steps {
        if die == Some((me, step)) {
            eprintln!("rank {me}: exiting at step {step} (--die)");
            std::process::exit(3);
        }
        // The weights: each tensor rank holds a shard; all_gather makes the whole.
        let shard: Vec<f32> = (0..SHARD).map(|i| (me * 100 + i + step) as f32).collect();
        let mut weights = vec![0f32; SHARD * tp];
        tensor.all_gather(&shard, &mut weights)?;
        for (j, w) in weights.chunks(SHARD).enumerate() {
            let owner = d * tp + j;
            assert!(
                w.iter()
                    .enumerate()
                    .all(|(i, x)| *x == (owner * 100 + i + step) as f32)
            );
        }

        // Backward: each bucket's reduction starts as soon as the bucket is computed, and its
        // handle (which owns the bucket) is kept until the optimizer step.
        let mut pending: Vec<Work<'static, Vec<f32>>> = Vec::new();
        for k in 0..BUCKETS {
            let bucket: Vec<f32> = (0..BUCKET_LEN).map(|i| grad(me, step, k, i)).collect();
            pending.push(data.all_reduce_owned(bucket, ReduceOp::Sum));
        }

        // A ring over every rank, typed, beside the reductions.
        let mine = [me as u64, step as u64];
        let mut from_left = [0u64; 2];
        b.scope(|s| {
            let r = s.irecv_slice(&mut from_left, left, RING);
            s.isend_slice(&mine, right, RING).wait()?;
            r.wait().map(|_| ())
        })?;
        assert_eq!(from_left, [left as u64, step as u64]);

        // The optimizer step: every bucket back, summed over the data group.
        for (k, w) in pending.into_iter().enumerate() {
            let bucket = w.wait()?;
            for (i, x) in bucket.iter().enumerate() {
                let want: f32 = (0..dp).map(|dd| grad(dd * tp + t, step, k, i)).sum();
                assert_eq!(*x, want, "step {step} bucket {k} element {i}");
            }
        }
    }
    b.barrier()?;
    println!(
        "rank {me}: {} steps ok (tensor rank {t} of {tp}, data rank {d} of {dp})",
        args.steps
    );
    Ok(())
}

//! `dist-perf`: the table users of nccl-tests read, for one collective over a range of sizes.
//! Launched once per rank by `cargo xtask perf`; rank 0 prints.
//!
//! Definitions as nccl-tests': algbw = size / time; busbw = algbw x 2(n-1)/n for all_reduce,
//! x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for broadcast, reduce and
//! sendrecv. `size` is the largest buffer of the call (all_gather's output, reduce_scatter's
//! input). The time is the slowest rank's average over the timed iterations.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

use std::time::Instant;

use dist_core::collectives::{AllReduceAlgorithm, Kind};
use dist_core::{Backend, Collectives, DType, DistError, Element, ReduceOp, Tag, Transport};
use dist_multirank::perf::{
    PerfOp, PerfOpts, perf_count, perf_header, perf_input, perf_opts_or_exit, perf_row, perf_want,
};
use dist_tcp::TcpBackend;
use half::{bf16, f16};

fn val<T: Element>(r: usize, i: usize) -> T {
    T::from_f64(perf_input(r, i))
}

/// One size: buffers, a verified call when asked, then the timed loop.
fn one_size<T: Element>(b: &TcpBackend, o: &PerfOpts, size: usize) {
    let (me, n) = (b.rank(), b.world_size());
    let elt = std::mem::size_of::<T>();
    let count = perf_count(o.op, size, elt, n);
    let bytes = count * elt;
    let k = count / n;
    let mut a: Vec<T> = (0..count).map(|i| val(me, i)).collect();
    let mut out: Vec<T> = vec![T::from_f64(0.0); count];
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let call = |a: &mut Vec<T>, out: &mut Vec<T>| -> Result<(), dist_core::DistError> {
        match o.op {
            PerfOp::Collective(Kind::AllReduce) => b.all_reduce(a, ReduceOp::Sum),
            PerfOp::Collective(Kind::Broadcast) => b.broadcast(a, 0),
            PerfOp::Collective(Kind::Reduce) => b.reduce_into(a, out, ReduceOp::Sum, 0),
            PerfOp::Collective(Kind::AllGather) => b.all_gather(&a[..k], out),
            PerfOp::Collective(Kind::ReduceScatter) => {
                b.reduce_scatter(a, &mut out[..k], ReduceOp::Sum)
            }
            PerfOp::Collective(Kind::AllToAll) => b.all_to_all(a, out),
            PerfOp::SendRecv => b
                .send_recv_meta(
                    (bytemuck::cast_slice(a), right),
                    (bytemuck::cast_slice_mut(out), left),
                    Tag::user(1),
                    [0; 16],
                    Instant::now() + b.default_timeout(),
                )
                .map(|_| ()),
            PerfOp::Collective(other) => Err(DistError::InvalidArgument {
                rank: me,
                op: other.name().into(),
                reason: format!("dist-perf times {}", PerfOp::names()),
            }),
        }
    };
    let wrong = o.check.then(|| {
        call(&mut a, &mut out).unwrap_or_else(|e| panic!("{e}"));
        let got: &[T] = match o.op {
            PerfOp::Collective(Kind::AllReduce | Kind::Broadcast) => &a,
            PerfOp::Collective(Kind::Reduce) if me == 0 => &out,
            PerfOp::Collective(Kind::Reduce) => &[],
            PerfOp::Collective(Kind::ReduceScatter) => &out[..k],
            _ => &out,
        };
        let want = |i: usize| perf_want(o.op, me, n, k, i);
        let wrong = got
            .iter()
            .enumerate()
            .filter(|(i, g)| g.to_f64() != want(*i))
            .count();
        // Restore the inputs the in-place ops overwrote.
        a = (0..count).map(|i| val(me, i)).collect();
        wrong
    });
    let iters = o
        .iters
        .unwrap_or(((1usize << 30) / (bytes + (64 << 10))).clamp(5, 1000));
    let warmup = o.warmup.unwrap_or((iters / 10).max(2));
    for _ in 0..warmup {
        call(&mut a, &mut out).unwrap_or_else(|e| panic!("{e}"));
    }
    b.barrier().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        call(&mut a, &mut out).unwrap_or_else(|e| panic!("{e}"));
    }
    // The algorithm, as the group chose it (known once it agreed on the arena: the warm-up's
    // calls have run), for the collectives whose choice `collective_path` names; the count and
    // bytes in the call's terms (all_gather's are its input's, a rank's block).
    let algorithm = match o.op {
        PerfOp::Collective(kind @ (Kind::AllReduce | Kind::Broadcast | Kind::Reduce)) => Some(
            dist_core::collectives::collective_path(b.group(), kind, count, bytes),
        ),
        PerfOp::Collective(Kind::AllGather) => Some(dist_core::collectives::collective_path(
            b.group(),
            Kind::AllGather,
            k,
            k * elt,
        )),
        _ => None,
    };
    perf_row(
        b,
        o.op,
        T::DTYPE,
        (bytes, count),
        t.elapsed().as_secs_f64() / iters as f64,
        wrong.map(|w| w as u64),
        algorithm.as_deref(),
    );
}

fn sweep<T: Element>(b: &TcpBackend, o: &PerfOpts) {
    for size in o.sizes() {
        one_size::<T>(b, o, size);
    }
}

fn main() {
    dist_multirank::init_logging();
    let o = perf_opts_or_exit("dist-perf", 64 << 20, |o| {
        if o.bare {
            return Err("--bare is the NCCL tool's (dist-nccl-perf)".into());
        }
        Ok(())
    });
    // `DIST_ALL_REDUCE=doubling|ring|halving` forces the all_reduce algorithm (on every rank:
    // all get the same environment), to measure one beside another; unset, by size.
    let forced = std::env::var("DIST_ALL_REDUCE")
        .ok()
        .map(|a| match a.as_str() {
            "doubling" => AllReduceAlgorithm::Doubling,
            "ring" => AllReduceAlgorithm::Ring,
            "halving" => AllReduceAlgorithm::Halving,
            other => {
                eprintln!("dist-perf: DIST_ALL_REDUCE={other}: expected doubling, ring or halving");
                std::process::exit(2);
            }
        });
    let b = dist_multirank::join();
    b.group().force_all_reduce(forced);
    // The group agrees on its host arena on its first all_reduce; the other collectives take
    // the arena's small areas only after it, so it comes before any timed loop.
    b.all_reduce(&mut [0u8], ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    if b.rank() == 0 {
        perf_header(&format!(
            "dist perf: {} over TCP, {} ranks, {} {}; ring pieces of {} KiB, {} lane(s), host \
             arena up to {} KiB{}",
            o.op,
            b.world_size(),
            o.dtype,
            if o.check {
                "(checked)"
            } else {
                "(not checked)"
            },
            dist_core::Transport::ring_piece(&b) >> 10,
            dist_core::Transport::lanes(&b),
            b.group().tuning().arena_max_kb,
            forced.map_or(String::new(), |a| format!("; all_reduce forced: {a:?}")),
        ));
        if matches!(
            o.op,
            PerfOp::Collective(Kind::AllReduce | Kind::Broadcast | Kind::Reduce | Kind::AllGather)
        ) {
            println!("# last column: the algorithm (dist_core::collectives::collective_path)");
        }
    }
    match o.dtype {
        DType::F32 => sweep::<f32>(&b, &o),
        DType::F64 => sweep::<f64>(&b, &o),
        DType::F16 => sweep::<f16>(&b, &o),
        DType::BF16 => sweep::<bf16>(&b, &o),
        DType::I8 => sweep::<i8>(&b, &o),
        DType::U8 => sweep::<u8>(&b, &o),
        DType::I32 => sweep::<i32>(&b, &o),
        DType::U32 => sweep::<u32>(&b, &o),
        DType::I64 => sweep::<i64>(&b, &o),
        DType::U64 => sweep::<u64>(&b, &o),
        other => panic!("unsupported type {other}"),
    }
    barrier_row(&b, &o);
}

/// After the table, the barrier's time (as the table's rows: the slowest rank's average) and
/// its algorithm, on a comment line: `# barrier: N calls, T us (ALGORITHM)`.
fn barrier_row(b: &TcpBackend, o: &PerfOpts) {
    let iters = o.iters.unwrap_or(1000);
    let warmup = o.warmup.unwrap_or((iters / 10).max(2));
    for _ in 0..warmup {
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    let t = Instant::now();
    for _ in 0..iters {
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
    b.all_reduce(&mut secs, ReduceOp::Max)
        .unwrap_or_else(|e| panic!("{e}"));
    let path = dist_core::collectives::collective_path(b.group(), Kind::Barrier, 0, 0);
    if b.rank() == 0 {
        println!("# barrier: {iters} calls, {:.2} us ({path})", secs[0] * 1e6);
    }
    b.barrier().unwrap_or_else(|e| panic!("{e}"));
}

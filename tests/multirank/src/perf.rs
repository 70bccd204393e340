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

use dist_core::{Backend, Collectives, DType, Element, ReduceOp, Tag, Transport};
use dist_multirank::{PerfOp, parse_size};
use dist_tcp::TcpBackend;
use half::{bf16, f16};

struct Opts {
    op: PerfOp,
    min: usize,
    max: usize,
    factor: usize,
    dtype: DType,
    check: bool,
    iters: Option<usize>,
    warmup: Option<usize>,
}

fn opts() -> Opts {
    let mut o = Opts {
        op: PerfOp::AllReduce,
        min: 8,
        max: 64 << 20,
        factor: 4,
        dtype: DType::F32,
        check: false,
        iters: None,
        warmup: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let val = || args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--op" => {
                o.op = PerfOp::parse(&val()).unwrap_or_else(|| panic!("unknown op {:?}", val()))
            }
            "-b" => o.min = parse_size(&val()),
            "-e" => o.max = parse_size(&val()),
            "-f" => o.factor = val().parse().expect("factor"),
            "--dtype" => {
                o.dtype =
                    DType::parse(&val()).unwrap_or_else(|| panic!("unknown dtype {:?}", val()))
            }
            "--iters" => o.iters = Some(val().parse().expect("iters")),
            "--warmup" => o.warmup = Some(val().parse().expect("warmup")),
            "--check" => {
                o.check = true;
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other:?}"),
        }
        i += 2;
    }
    assert!(
        o.factor >= 2 && o.min >= 1 && o.max >= o.min,
        "bad size range"
    );
    o
}

fn val<T: Element>(r: usize, i: usize) -> T {
    T::from_f64(((r * 3 + i) % 7) as f64)
}

/// One size: buffers, a verified call when asked, then the timed loop.
fn one_size<T: Element>(b: &TcpBackend, o: &Opts, size: usize) {
    let (me, n) = (b.rank(), b.world_size());
    let elt = std::mem::size_of::<T>();
    let mut count = (size / elt).max(1);
    if matches!(
        o.op,
        PerfOp::AllGather | PerfOp::ReduceScatter | PerfOp::AllToAll
    ) {
        count = (count / n).max(1) * n;
    }
    let bytes = count * elt;
    let k = count / n;
    let mut a: Vec<T> = (0..count).map(|i| val(me, i)).collect();
    let mut out: Vec<T> = vec![T::from_f64(0.0); count];
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let call = |a: &mut Vec<T>, out: &mut Vec<T>| -> Result<(), dist_core::DistError> {
        match o.op {
            PerfOp::AllReduce => b.all_reduce(a, ReduceOp::Sum),
            PerfOp::Broadcast => b.broadcast(a, 0),
            PerfOp::Reduce => b.reduce_into(a, out, ReduceOp::Sum, 0),
            PerfOp::AllGather => b.all_gather(&a[..k], out),
            PerfOp::ReduceScatter => b.reduce_scatter(a, &mut out[..k], ReduceOp::Sum),
            PerfOp::AllToAll => b.all_to_all(a, out),
            PerfOp::SendRecv => b
                .send_recv_meta(
                    (bytemuck::cast_slice(a), right),
                    (bytemuck::cast_slice_mut(out), left),
                    Tag::user(1),
                    [0; 16],
                    Instant::now() + b.default_timeout(),
                )
                .map(|_| ()),
        }
    };
    let wrong = o.check.then(|| {
        call(&mut a, &mut out).unwrap_or_else(|e| panic!("{e}"));
        let sum = |i: usize| (0..n).map(|r| val::<T>(r, i).to_f64()).sum::<f64>();
        let got: &[T] = match o.op {
            PerfOp::AllReduce | PerfOp::Broadcast => &a,
            PerfOp::Reduce if me == 0 => &out,
            PerfOp::Reduce => &[],
            PerfOp::ReduceScatter => &out[..k],
            _ => &out,
        };
        let want = |i: usize| -> f64 {
            match o.op {
                PerfOp::AllReduce => sum(i),
                PerfOp::Broadcast => val::<T>(0, i).to_f64(),
                PerfOp::Reduce => sum(i),
                PerfOp::ReduceScatter => sum(me * k + i),
                PerfOp::AllGather => val::<T>(i / k, i % k).to_f64(),
                PerfOp::AllToAll => val::<T>(i / k, me * k + i % k).to_f64(),
                PerfOp::SendRecv => val::<T>(left, i).to_f64(),
            }
        };
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
    let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
    b.all_reduce(&mut secs, ReduceOp::Max).unwrap();
    let mut bad = [wrong.unwrap_or(0) as u64];
    b.all_reduce(&mut bad, ReduceOp::Sum).unwrap();
    if me == 0 {
        let algbw = bytes as f64 / secs[0] / 1e9;
        println!(
            "{bytes:>12} {count:>12} {:>8} {:>6} {:>4} {:>10.1} {algbw:>8.3} {:>8.3} {:>6}",
            T::DTYPE.name(),
            if o.op.reduces() { "sum" } else { "none" },
            if matches!(o.op, PerfOp::Broadcast | PerfOp::Reduce) {
                "0"
            } else {
                "-1"
            },
            secs[0] * 1e6,
            algbw * o.op.bus_factor(n),
            if o.check {
                bad[0].to_string()
            } else {
                "N/A".into()
            },
        );
    }
}

fn sweep<T: Element>(b: &TcpBackend, o: &Opts) {
    let mut size = o.min;
    while size <= o.max {
        one_size::<T>(b, o, size);
        size *= o.factor;
    }
}

fn main() {
    dist_multirank::init_logging();
    let o = opts();
    let b = dist_multirank::join();
    if b.rank() == 0 {
        println!(
            "# dist perf: {:?} over TCP, {} ranks, {} {}; ring pieces of {} KiB, {} lane(s)",
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
        );
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>4} {:>10} {:>8} {:>8} {:>6}",
            "size", "count", "type", "redop", "root", "time(us)", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>4} {:>10} {:>8} {:>8} {:>6}",
            "(B)", "(elements)", "", "", "", "", "(GB/s)", "(GB/s)", ""
        );
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
    b.barrier().unwrap();
}

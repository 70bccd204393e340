//! The demo `cargo xtask demo` runs: the ranks exchange messages around the mesh and verify
//! every byte, pass barriers, and rank 0 prints point-to-point latency and bandwidth to rank 1.

use std::time::Instant;

use dist_core::collectives::Kind;
use dist_core::{Backend, Collectives, ReduceOp, Tag};
use dist_tcp::TcpBackend;

use dist_multirank::{fill, first_difference, seed};

fn main() {
    dist_multirank::init_logging();
    // TCP always; NCCL too when every rank has a GPU.
    let tcp = dist_multirank::join();
    let nccl_cfg = dist_hybrid::nccl_config_for(&tcp);
    let hybrid = dist_hybrid::HybridBackend::with_nccl(
        tcp,
        {
            let cfg = dist_multirank::config();
            cfg.local_rank().unwrap_or(cfg.rank())
        },
        dist_hybrid::GpuChoice::Auto,
        None,
        nccl_cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let b = hybrid.tcp();
    let (me, n) = (b.rank(), b.world_size());
    if me == 0 {
        println!("dist demo: {n} ranks over TCP on this host");
    }
    // Every rank sends a verified message to every other rank.
    let size = 1 << 20;
    let mut out = vec![0u8; size];
    let mut inb = vec![0u8; size];
    let mut verified = 0usize;
    for shift in 1..n {
        let (dst, src) = ((me + shift) % n, (me + n - shift) % n);
        fill(&mut out, seed(me, dst, 1));
        std::thread::scope(|s| {
            let h = s.spawn(|| b.send_tagged(&out, dst, Tag::user(1)));
            b.recv_tagged(&mut inb, src, Tag::user(1))
                .unwrap_or_else(|e| panic!("{e}"));
            h.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        });
        assert_eq!(
            first_difference(&inb, seed(src, me, 1)),
            None,
            "bad bytes from {src}"
        );
        verified += size;
    }
    for _ in 0..100 {
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    let mut totals = vec![0u8; 8];
    if me == 0 {
        let mut all = verified;
        for r in 1..n {
            b.recv_tagged(&mut totals, r, Tag::user(2)).unwrap();
            all += u64::from_le_bytes(totals[..8].try_into().unwrap()) as usize;
        }
        println!(
            "mesh exchange: {} messages of 1 MiB, {all} bytes verified; 100 barriers passed",
            n * (n - 1)
        );
    } else {
        b.send_tagged(&(verified as u64).to_le_bytes(), 0, Tag::user(2))
            .unwrap();
    }
    // Ping-pong between ranks 0 and 1.
    if n >= 2 && me < 2 {
        if me == 0 {
            println!("\npoint-to-point, rank 0 <-> rank 1 (ping-pong; one-way = round trip / 2)");
            println!(
                "{:>12} {:>8} {:>14} {:>12}",
                "bytes", "iters", "latency (us)", "GB/s"
            );
        }
        for &size in &[8usize, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
            let iters = (200_000_000 / (size + 20_000)).clamp(5, 2000);
            let mut buf = vec![0u8; size];
            fill(&mut buf, 5);
            let peer = 1 - me;
            let tag = Tag::user(3);
            let mut one = || {
                if me == 0 {
                    b.send_tagged(&buf, peer, tag).unwrap();
                    b.recv_tagged(&mut buf, peer, tag).unwrap();
                } else {
                    b.recv_tagged(&mut buf, peer, tag).unwrap();
                    b.send_tagged(&buf, peer, tag).unwrap();
                }
            };
            for _ in 0..iters.min(20) {
                one();
            }
            let t = Instant::now();
            for _ in 0..iters {
                one();
            }
            let one_way = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
            assert_eq!(
                first_difference(&buf, 5),
                None,
                "ping-pong corrupted the data"
            );
            if me == 0 {
                println!(
                    "{size:>12} {iters:>8} {:>14.2} {:>12.3}",
                    one_way * 1e6,
                    size as f64 / one_way / 1e9
                );
            }
        }
    }
    b.barrier().unwrap();
    collectives(b);
    gpu(&hybrid);
    if me == 0 {
        println!("\nall ranks verified every byte");
    }
}

/// With a GPU per rank: a 64 MiB all_reduce over NCCL, checked, and its time.
fn gpu(h: &dist_hybrid::HybridBackend) {
    let me = h.tcp().rank();
    let Some(comm) = h.nccl() else {
        if me == 0 {
            let why = h.why_no_nccl().unwrap_or_default();
            println!("\nNCCL not used (TCP only): {why}");
            let gpus = dist_nccl::cuda_device_count();
            if gpus >= 2 && gpus < h.tcp().world_size() {
                println!("`cargo xtask demo -n {gpus}` runs one rank per GPU, with NCCL");
            }
        }
        return;
    };
    let n = h.tcp().world_size();
    let count = 16 << 20;
    let s = comm.stream();
    let mut x = s
        .clone_htod(&vec![me as f32 + 1.0; count])
        .unwrap_or_else(|e| panic!("{e}"));
    h.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let t = Instant::now();
    for _ in 0..10 {
        h.all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let per = t.elapsed().as_secs_f64() / 10.0;
    // Eleven sums of every rank's value, each multiplying by n after the first.
    let first: f32 = (1..=n).map(|r| r as f32).sum();
    let want = first * (n as f32).powi(10);
    let got = s.clone_dtoh(&x).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        got.iter().all(|v| *v == want),
        "GPU all_reduce gave a wrong result"
    );
    if me == 0 {
        let busbw = (count * 4) as f64 / per / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "\nGPU: NCCL all_reduce of 64 MiB on {n} GPUs, checked: {:.0} µs, busbw {busbw:.1} GB/s",
            per * 1e6
        );
    }
}

/// Each collective on 100,003 f32 values per rank (a prime count): a warm-up call, then
/// `TIMED` calls each started together after a barrier; the table gives the median of each
/// rank's times, the slowest rank's. The last call's result is checked on every rank, outside
/// the timing.
fn collectives(b: &TcpBackend) {
    const TIMED: usize = 9;
    let (me, n) = (b.rank(), b.world_size());
    let k = 100_003;
    let v = |r: usize, i: usize| ((r * 7 + i) % 11) as f32;
    let sum = |i: usize| (0..n).map(|r| v(r, i)).sum::<f32>();
    if me == 0 {
        println!(
            "\ncollectives, {n} ranks, {k} f32 per rank: median of {TIMED} warm calls (slowest \
             rank), each result checked on every rank"
        );
        println!("{:>16} {:>12}", "collective", "time (us)");
    }
    // One warm-up call, then the timed ones; `call` returns nothing and is timed alone.
    let time = |call: &mut dyn FnMut()| -> f64 {
        call();
        let mut us: Vec<f64> = (0..TIMED)
            .map(|_| {
                b.barrier().unwrap_or_else(|e| panic!("{e}"));
                let t = Instant::now();
                call();
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        us.sort_by(f64::total_cmp);
        us[TIMED / 2]
    };
    let report = |name: &str, us: f64, ok: bool| {
        assert!(ok, "{name} gave a wrong result on rank {me}");
        // Every rank checked; rank 0 prints the slowest rank's median.
        let mut slowest = [us];
        b.all_reduce(&mut slowest, ReduceOp::Max)
            .unwrap_or_else(|e| panic!("{e}"));
        if me == 0 {
            println!("{name:>16} {:>12.1}", slowest[0]);
        }
    };
    let ok = |r: Result<(), dist_core::DistError>| r.unwrap_or_else(|e| panic!("{e}"));
    let mine: Vec<f32> = (0..k).map(|i| v(me, i)).collect();
    let full: Vec<f32> = (0..k * n).map(|i| v(me, i)).collect();

    // In place: each timed call starts again from this rank's values.
    let mut x = mine.clone();
    let us = time(&mut || {
        x.copy_from_slice(&mine);
        ok(b.all_reduce(&mut x, ReduceOp::Sum));
    });
    let good = x.iter().enumerate().all(|(i, y)| *y == sum(i));
    report(Kind::AllReduce.name(), us, good);

    let mut x = mine.clone();
    let us = time(&mut || {
        x.copy_from_slice(&mine);
        ok(b.broadcast(&mut x, n - 1));
    });
    let good = x.iter().enumerate().all(|(i, y)| *y == v(n - 1, i));
    report(Kind::Broadcast.name(), us, good);

    let mut x = vec![0f32; k];
    let us = time(&mut || ok(b.reduce_into(&mine, &mut x, ReduceOp::Sum, 0)));
    let good = me != 0 || x.iter().enumerate().all(|(i, y)| *y == sum(i));
    report(Kind::Reduce.name(), us, good);

    let mut all = vec![0f32; k * n];
    let us = time(&mut || ok(b.all_gather(&mine, &mut all)));
    let good = all.iter().enumerate().all(|(i, y)| *y == v(i / k, i % k));
    report(Kind::AllGather.name(), us, good);

    let mut part = vec![0f32; k];
    let us = time(&mut || ok(b.reduce_scatter(&full, &mut part, ReduceOp::Sum)));
    let good = part.iter().enumerate().all(|(i, y)| *y == sum(me * k + i));
    report(Kind::ReduceScatter.name(), us, good);

    let mut out = vec![0f32; k * n];
    let us = time(&mut || ok(b.all_to_all(&full, &mut out)));
    let good = out
        .iter()
        .enumerate()
        .all(|(i, y)| *y == v(i / k, me * k + i % k));
    report(Kind::AllToAll.name(), us, good);

    let mut g = vec![0f32; k * n];
    let us = time(&mut || ok(b.gather(&mine, (me == 0).then_some(&mut g[..]), 0)));
    let good = me != 0 || g.iter().enumerate().all(|(i, y)| *y == v(i / k, i % k));
    report(Kind::Gather.name(), us, good);

    let src: Vec<f32> = (0..k * n).map(|i| v(0, i)).collect();
    let mut part = vec![0f32; k];
    let us = time(&mut || ok(b.scatter((me == 0).then_some(&src[..]), &mut part, 0)));
    let good = part.iter().enumerate().all(|(i, y)| *y == v(0, me * k + i));
    report(Kind::Scatter.name(), us, good);

    let us = time(&mut || ok(b.barrier()));
    report(Kind::Barrier.name(), us, true);
    if me == 0 {
        println!(
            "(a table of every size, with bus bandwidth: `cargo xtask perf -n {n}`; dist beside \
             Gloo and Open MPI: docs/benchmarks.md)"
        );
    }
}

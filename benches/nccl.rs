//! criterion benchmarks of the NCCL collectives through dist-nccl: one thread driving every
//! local GPU (`init_all`), each step a group of one call per GPU, synchronized inside the timed
//! region. f32, 8 B to 64 MiB. Where there are fewer than 2 GPUs they say so and run nothing.
//! `cargo bench -p dist-benches --bench nccl`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::CudaSlice;
use dist_core::ReduceOp;
use dist_core::collectives::Kind;
use dist_multirank::perf::PerfOp;
use dist_nccl::{CommConfig, Communicator, Nccl};

const SIZES: [usize; 6] = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

/// The ops benchmarked, each named `nccl_` and its `--op` name.
const OPS: [PerfOp; 5] = [
    PerfOp::Collective(Kind::AllReduce),
    PerfOp::Collective(Kind::AllGather),
    PerfOp::Collective(Kind::ReduceScatter),
    PerfOp::Collective(Kind::Broadcast),
    PerfOp::SendRecv,
];

/// One group of one call per GPU.
fn step(comms: &[Communicator], op: PerfOp, a: &mut [CudaSlice<f32>], b: &mut [CudaSlice<f32>]) {
    let n = comms.len();
    let refs: Vec<&Communicator> = comms.iter().collect();
    dist_nccl::group(&refs, |g| {
        for (i, (c, (a, b))) in comms.iter().zip(a.iter_mut().zip(b.iter_mut())).enumerate() {
            let o = g.with(c)?;
            match op {
                PerfOp::Collective(Kind::AllReduce) => o.all_reduce_in_place(a, ReduceOp::Sum)?,
                PerfOp::Collective(Kind::AllGather) => o.all_gather(a, b)?,
                PerfOp::Collective(Kind::ReduceScatter) => o.reduce_scatter(b, a, ReduceOp::Sum)?,
                PerfOp::Collective(Kind::Broadcast) => o.broadcast(a, 0)?,
                PerfOp::SendRecv => {
                    o.send(a, (i + 1) % n)?;
                    o.recv(b, (i + n - 1) % n)?;
                }
                other => unreachable!("{other} is not in OPS"),
            }
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

fn nccl(c: &mut Criterion) {
    let devices = dist_nccl::cuda_device_count();
    if devices < 2 {
        eprintln!("skipped: the NCCL benchmarks need 2 CUDA devices, found {devices}");
        return;
    }
    let nccl = Arc::new(Nccl::load().unwrap_or_else(|e| panic!("{e}")));
    let all: Vec<usize> = (0..devices).collect();
    let comms =
        Communicator::init_all(nccl, &all, CommConfig::default()).unwrap_or_else(|e| panic!("{e}"));
    let n = comms.len();
    for op in OPS {
        let mut g = c.benchmark_group(format!("nccl_{}/{n}gpus", op.name()));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1));
        for bytes in SIZES {
            // `a`: one rank's block (k elements); `b`: k × n.
            let k = (bytes / 4 / n).max(1);
            let (small, big) = match op {
                PerfOp::Collective(Kind::AllGather | Kind::ReduceScatter) => (k, k * n),
                _ => ((bytes / 4).max(1), (bytes / 4).max(1)),
            };
            let mut a: Vec<_> = comms
                .iter()
                .map(|c| c.stream().alloc_zeros::<f32>(small).unwrap())
                .collect();
            let mut b: Vec<_> = comms
                .iter()
                .map(|c| c.stream().alloc_zeros::<f32>(big).unwrap())
                .collect();
            g.throughput(Throughput::BytesDecimal(bytes as u64));
            g.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |bch, _| {
                bch.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        step(&comms, op, &mut a, &mut b);
                    }
                    for c in &comms {
                        c.synchronize().unwrap_or_else(|e| panic!("{e}"));
                    }
                    t.elapsed()
                });
            });
        }
        g.finish();
    }
}

criterion_group!(benches, nccl);
criterion_main!(benches);

//! criterion benchmarks of the collectives over TCP: 4 ranks (threads of this process, each
//! with its own `TcpBackend` on loopback), f32, 8 B to 64 MiB. Run with
//! `cargo bench -p dist-benches`. Throughput is the buffer's size per call (nccl-tests' algbw).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dist_benches::{Job, KINDS};

const RANKS: usize = 4;
const SIZES: [usize; 6] = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

fn collectives(c: &mut Criterion) {
    let job = Job::new(RANKS);
    for op in KINDS {
        let mut g = c.benchmark_group(format!("{}/{RANKS}ranks", op.name()));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for bytes in SIZES {
            g.throughput(Throughput::BytesDecimal(bytes as u64));
            g.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| black_box(job.time(op, bytes, iters)));
            });
        }
        g.finish();
    }
}

criterion_group!(benches, collectives);
criterion_main!(benches);

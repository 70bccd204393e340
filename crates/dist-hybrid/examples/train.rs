//! A data-parallel training loop on `HybridBackend`: linear regression on synthetic data.
//!
//! Each rank holds its own shard of samples, computes the gradient of the squared error on it
//! bucket by bucket, and all-reduces (averages) each bucket while it computes the next: over
//! NCCL on a GPU when there is one (the bucket is enqueued on the communicator's stream), over
//! TCP on a communication thread otherwise. Every rank applies the same update; rank 0 gathers
//! each rank's loss and step time over TCP point-to-point and prints them. At the end every rank
//! checks that all ranks hold bit-identical weights and that the loss fell, and fails otherwise.
//!
//!     cargo xtask run -n 4 --example train
//!     torchrun --nproc-per-node 4 target/release/examples/train

use std::time::Instant;

use dist_core::{Backend, Collectives, ReduceOp, Tag};
use dist_hybrid::HybridBackend;

const FEATURES: usize = 1 << 14;
const SAMPLES_PER_RANK: usize = 256;
const BUCKETS: usize = 4;
const STEPS: usize = 40;
/// Step size per sample: the data are scaled so that XXᵀ/N is close to the identity over the N
/// samples of all ranks, so the step that fits in one iteration is about N.
const LR_PER_SAMPLE: f32 = 0.5;
const METRICS: Tag = Tag::user(100);

/// A deterministic pseudo-random number in [-1, 1).
fn noise(seed: u64) -> f32 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

struct Shard {
    /// Row-major SAMPLES_PER_RANK × FEATURES; each row is sparse-ish and scaled so that the
    /// problem is well conditioned.
    x: Vec<f32>,
    y: Vec<f32>,
}

fn shard(rank: usize) -> Shard {
    let true_w = |j: usize| noise(j as u64 + 7);
    let mut x = vec![0f32; SAMPLES_PER_RANK * FEATURES];
    let mut y = vec![0f32; SAMPLES_PER_RANK];
    for i in 0..SAMPLES_PER_RANK {
        let row = &mut x[i * FEATURES..(i + 1) * FEATURES];
        let sample = (rank * SAMPLES_PER_RANK + i) as u64;
        let mut dot = 0f32;
        for (j, v) in row.iter_mut().enumerate() {
            // Variance 1/FEATURES: each row has unit expected norm.
            *v = noise(sample * FEATURES as u64 + j as u64 + 1_000_003)
                * (3.0 / FEATURES as f32).sqrt();
            dot += *v * true_w(j);
        }
        y[i] = dot;
    }
    Shard { x, y }
}

/// Residuals r = Xw − y and the local half mean squared error.
fn residuals(s: &Shard, w: &[f32]) -> (Vec<f32>, f32) {
    let r: Vec<f32> = (0..SAMPLES_PER_RANK)
        .map(|i| {
            let row = &s.x[i * FEATURES..(i + 1) * FEATURES];
            row.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() - s.y[i]
        })
        .collect();
    let loss = r.iter().map(|v| v * v).sum::<f32>() / (2.0 * SAMPLES_PER_RANK as f32);
    (r, loss)
}

/// The local gradient's bucket `k`: Xᵀr / n over that bucket's features.
fn bucket_grad(s: &Shard, r: &[f32], k: usize) -> Vec<f32> {
    let per = FEATURES / BUCKETS;
    let mut g = vec![0f32; per];
    for (i, ri) in r.iter().enumerate() {
        let row = &s.x[i * FEATURES + k * per..i * FEATURES + (k + 1) * per];
        for (gj, xj) in g.iter_mut().zip(row) {
            *gj += xj * ri;
        }
    }
    let n = SAMPLES_PER_RANK as f32;
    g.iter_mut().for_each(|v| *v /= n);
    g
}

/// One step's gradient, averaged over ranks: buckets over NCCL as they are produced.
fn step_gpu(h: &HybridBackend, s: &Shard, r: &[f32]) -> Vec<f32> {
    let comm = h.nccl().expect("called with NCCL");
    let stream = comm.stream();
    let mut dev = Vec::with_capacity(BUCKETS);
    for k in 0..BUCKETS {
        let g = bucket_grad(s, r, k);
        let mut d = stream.clone_htod(&g).unwrap_or_else(|e| panic!("{e}"));
        // Enqueued; runs on the GPU while the next bucket is computed here.
        h.all_reduce(&mut d, ReduceOp::Avg)
            .unwrap_or_else(|e| panic!("{e}"));
        dev.push(d);
    }
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    dev.iter()
        .flat_map(|d| stream.clone_dtoh(d).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// The same over TCP: a communication thread all-reduces bucket k while this one computes k+1.
fn step_cpu(h: &HybridBackend, s: &Shard, r: &[f32]) -> Vec<f32> {
    let (tx, rx) = std::sync::mpsc::channel::<Vec<f32>>();
    std::thread::scope(|scope| {
        let comm = scope.spawn(move || {
            let mut out = Vec::with_capacity(FEATURES);
            for mut g in rx {
                h.all_reduce(&mut g[..], ReduceOp::Avg)
                    .unwrap_or_else(|e| panic!("{e}"));
                out.extend_from_slice(&g);
            }
            out
        });
        for k in 0..BUCKETS {
            tx.send(bucket_grad(s, r, k))
                .expect("the communication thread is alive");
        }
        drop(tx);
        comm.join().expect("the communication thread finished")
    })
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let h = HybridBackend::from_env().unwrap_or_else(|e| panic!("{e}"));
    let (me, n) = (h.rank(), h.world_size());
    let on_gpu = h.nccl().is_some();
    if me == 0 {
        println!(
            "training: {n} ranks, {FEATURES} parameters, {SAMPLES_PER_RANK} samples per rank, \
             gradients over {}",
            if on_gpu { "NCCL (GPU)" } else { "TCP (CPU)" }
        );
    }
    let data = shard(me);
    let mut w = vec![0f32; FEATURES];
    let mut first_loss = None;
    let mut loss = 0f32;
    for step in 0..STEPS {
        let t = Instant::now();
        let (r, local_loss) = residuals(&data, &w);
        let g = if on_gpu {
            step_gpu(&h, &data, &r)
        } else {
            step_cpu(&h, &data, &r)
        };
        let lr = LR_PER_SAMPLE * (SAMPLES_PER_RANK * n) as f32;
        for (wi, gi) in w.iter_mut().zip(&g) {
            *wi -= lr * gi;
        }
        let mut global = [local_loss];
        h.tcp()
            .all_reduce(&mut global, ReduceOp::Avg)
            .unwrap_or_else(|e| panic!("{e}"));
        loss = global[0];
        first_loss.get_or_insert(loss);
        // Metrics to rank 0 over TCP point-to-point.
        let metrics = [local_loss, t.elapsed().as_secs_f32() * 1e3];
        if me == 0 {
            if step % 10 == 0 || step == STEPS - 1 {
                let mut line = format!(
                    "step {step:>3}  loss {loss:.6}  rank 0: {:.2} ms",
                    metrics[1]
                );
                for src in 1..n {
                    let mut m = [0u8; 8];
                    h.recv_tagged(&mut m, src, METRICS)
                        .unwrap_or_else(|e| panic!("{e}"));
                    let ms = f32::from_le_bytes(m[4..].try_into().unwrap());
                    line += &format!(", rank {src}: {ms:.2} ms");
                }
                println!("{line}");
            } else {
                for src in 1..n {
                    h.recv_tagged(&mut [0u8; 8], src, METRICS)
                        .unwrap_or_else(|e| panic!("{e}"));
                }
            }
        } else {
            let mut m = [0u8; 8];
            m[..4].copy_from_slice(&metrics[0].to_le_bytes());
            m[4..].copy_from_slice(&metrics[1].to_le_bytes());
            h.send_tagged(&m, 0, METRICS)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    // Every rank must hold the same weights, bit for bit.
    let mut lo = w.clone();
    let mut hi = w.clone();
    h.tcp().all_reduce(&mut lo, ReduceOp::Min).unwrap();
    h.tcp().all_reduce(&mut hi, ReduceOp::Max).unwrap();
    let same = lo
        .iter()
        .zip(&hi)
        .zip(&w)
        .all(|((a, b), c)| a.to_bits() == c.to_bits() && b.to_bits() == c.to_bits());
    assert!(same, "rank {me}: the ranks' weights differ");
    let first = first_loss.unwrap_or(loss);
    assert!(
        loss < first * 0.1,
        "the loss did not fall: {first} -> {loss}"
    );
    h.barrier().unwrap();
    if me == 0 {
        println!("ok: loss {first:.6} -> {loss:.6}; all {n} ranks hold identical weights");
    }
}

//! A 2-D parallel training loop on `HybridBackend`: linear regression on synthetic data, its
//! ranks laid out as a grid of tensor × data groups (`split`).
//!
//! - **Tensor axis**: the ranks of a tensor group share one shard of samples and each owns a
//!   slice of the weights; every step they all_gather the slices into the full weights that the
//!   forward pass needs, and each updates only its own slice.
//! - **Data axis**: the ranks of a data group own the same slice for different samples; they
//!   average its gradient in 4 buckets, each all-reduced asynchronously while the next one is
//!   computed: in a `dist-core` scope over TCP on CPUs, as `GpuWork` over NCCL on GPUs.
//!
//! 4 ranks are 2 × 2 (2 tensor ranks × 2 data ranks); 2 ranks (2 GPUs) are 1 × 2; any other
//! world size is 1 × n. At the end every rank checks that its data group holds bit-identical
//! slices, that every rank holds the same full weights, and that the loss fell, and fails
//! otherwise.
//!
//!     cargo xtask run -n 4 --example train
//!     torchrun --no-python --nproc-per-node 2 target/release/examples/train

use dist_core::{Backend, Collectives, ReduceOp, Transport};
use dist_hybrid::{HybridBackend, HybridGroup};

const FEATURES: usize = 1 << 14;
const SAMPLES_PER_RANK: usize = 256;
const BUCKETS: usize = 4;
const STEPS: usize = 40;
/// Step size per sample: the data are scaled so that XXᵀ/N is close to the identity over the N
/// samples of all data ranks, so the step that fits in one iteration is about N.
const LR_PER_SAMPLE: f32 = 0.5;

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

/// The gradient over features `lo..hi`: Xᵀr / n, for those columns of X.
fn grad(s: &Shard, r: &[f32], lo: usize, hi: usize) -> Vec<f32> {
    let mut g = vec![0f32; hi - lo];
    for (i, ri) in r.iter().enumerate() {
        let row = &s.x[i * FEATURES + lo..i * FEATURES + hi];
        for (gj, xj) in g.iter_mut().zip(row) {
            *gj += xj * ri;
        }
    }
    let n = SAMPLES_PER_RANK as f32;
    g.iter_mut().for_each(|v| *v /= n);
    g
}

/// The full weights from every tensor rank's slice: an all_gather over the tensor group, of
/// device buffers on a GPU, of host slices otherwise.
fn gather_weights(tensor: &HybridGroup, slice: &[f32]) -> Vec<f32> {
    let mut full = vec![0f32; slice.len() * tensor.world_size()];
    if let Some(comm) = tensor.nccl() {
        let stream = comm.stream();
        let mine = stream.clone_htod(slice).unwrap_or_else(|e| panic!("{e}"));
        let mut all = stream.clone_htod(&full).unwrap_or_else(|e| panic!("{e}"));
        tensor
            .all_gather(&mine, &mut all)
            .unwrap_or_else(|e| panic!("{e}"));
        tensor.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
        full = stream.clone_dtoh(&all).unwrap_or_else(|e| panic!("{e}"));
    } else {
        tensor
            .all_gather(slice, &mut full[..])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    full
}

/// This rank's slice `lo..hi` of the gradient, averaged over the data group: computed in
/// buckets, each all-reduced over NCCL (a `GpuWork`) while the host computes the next.
fn averaged_grad_gpu(data: &HybridGroup, s: &Shard, r: &[f32], lo: usize, hi: usize) -> Vec<f32> {
    let stream = data.nccl().expect("called with NCCL").stream();
    let per = (hi - lo) / BUCKETS;
    let mut buckets: Vec<_> = (0..BUCKETS)
        .map(|_| {
            stream
                .alloc_zeros::<f32>(per)
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let mut works = Vec::with_capacity(BUCKETS);
    for (k, bucket) in buckets.iter_mut().enumerate() {
        let g = grad(s, r, lo + k * per, lo + (k + 1) * per);
        stream
            .memcpy_htod(&g, bucket)
            .unwrap_or_else(|e| panic!("{e}"));
        // Enqueued on the group's stream; the GPU reduces it while the next bucket is computed.
        works.push(
            data.all_reduce_async(bucket, ReduceOp::Avg)
                .unwrap_or_else(|e| panic!("{e}")),
        );
    }
    for w in works {
        w.wait().unwrap_or_else(|e| panic!("{e}"));
    }
    buckets
        .iter()
        .flat_map(|b| stream.clone_dtoh(b).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// The same over TCP: each bucket's all_reduce is async work in the data group's scope, run
/// while this thread computes the next bucket; the scope ends when all four are done.
fn averaged_grad_cpu(data: &HybridGroup, s: &Shard, r: &[f32], lo: usize, hi: usize) -> Vec<f32> {
    let per = (hi - lo) / BUCKETS;
    let mut buckets = vec![vec![0f32; per]; BUCKETS];
    data.scope(|scope| {
        let mut works = Vec::with_capacity(BUCKETS);
        for (k, bucket) in buckets.iter_mut().enumerate() {
            *bucket = grad(s, r, lo + k * per, lo + (k + 1) * per);
            // Queued: the scope's thread reduces it while this one computes the next bucket.
            works.push(scope.all_reduce(&mut bucket[..], ReduceOp::Avg));
        }
        for w in works {
            w.wait()?;
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    buckets.concat()
}

/// Whether every rank of `g` holds `x`, bit for bit: its elementwise min and max over `g`.
fn same_everywhere<H: Transport>(g: &HybridBackend<H>, x: &[f32]) -> bool {
    let (mut lo, mut hi) = (x.to_vec(), x.to_vec());
    g.tcp()
        .all_reduce(&mut lo, ReduceOp::Min)
        .unwrap_or_else(|e| panic!("{e}"));
    g.tcp()
        .all_reduce(&mut hi, ReduceOp::Max)
        .unwrap_or_else(|e| panic!("{e}"));
    lo.iter()
        .zip(&hi)
        .zip(x)
        .all(|((a, b), c)| a.to_bits() == c.to_bits() && b.to_bits() == c.to_bits())
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
    // The grid: `tp` tensor ranks × `dp` data ranks, rank = d * tp + t.
    let tp = if n == 4 { 2 } else { 1 };
    let dp = n / tp;
    let (t, d) = (me % tp, me / tp);
    // Two collective splits over every rank: the tensor group of the ranks with this `d`, the
    // data group of those with this `t`, each numbered by the other coordinate.
    let tensor = h
        .split(Some(d as u32), t as i64)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank has a tensor group");
    let data = h
        .split(Some(t as u32), d as i64)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank has a data group");
    assert_eq!((tensor.rank(), data.rank()), (t, d));
    let on_gpu = h.nccl().is_some();
    if me == 0 {
        println!(
            "training: {n} ranks as {tp} tensor x {dp} data, {FEATURES} parameters, \
             {SAMPLES_PER_RANK} samples per data rank, over {}",
            if on_gpu { "NCCL (GPU)" } else { "TCP (CPU)" }
        );
    }
    // The samples of this data rank (shared by its tensor group), this rank's slice of weights.
    let samples = shard(d);
    let per = FEATURES / tp;
    let (lo, hi) = (t * per, (t + 1) * per);
    let mut slice = vec![0f32; per];
    let lr = LR_PER_SAMPLE * (SAMPLES_PER_RANK * dp) as f32;
    let mut first_loss = None;
    let mut loss = 0f32;
    for step in 0..STEPS {
        let w = gather_weights(&tensor, &slice);
        let (r, local_loss) = residuals(&samples, &w);
        let g = if on_gpu {
            averaged_grad_gpu(&data, &samples, &r, lo, hi)
        } else {
            averaged_grad_cpu(&data, &samples, &r, lo, hi)
        };
        for (wi, gi) in slice.iter_mut().zip(&g) {
            *wi -= lr * gi;
        }
        let mut mean = [local_loss];
        data.tcp()
            .all_reduce(&mut mean, ReduceOp::Avg)
            .unwrap_or_else(|e| panic!("{e}"));
        loss = mean[0];
        first_loss.get_or_insert(loss);
        if me == 0 && (step % 10 == 0 || step == STEPS - 1) {
            println!("step {step:>3}  loss {loss:.6}");
        }
    }
    assert!(
        same_everywhere(&data, &slice),
        "rank {me}: the slices of data group {t} differ"
    );
    let w = gather_weights(&tensor, &slice);
    assert!(
        same_everywhere(&h, &w),
        "rank {me}: the ranks' full weights differ"
    );
    let first = first_loss.unwrap_or(loss);
    assert!(
        loss < first * 0.1,
        "rank {me}: the loss did not fall: {first} -> {loss}"
    );
    h.barrier().unwrap_or_else(|e| panic!("{e}"));
    if me == 0 {
        println!("ok: loss {first:.6} -> {loss:.6}; all {n} ranks hold identical weights");
    }
}

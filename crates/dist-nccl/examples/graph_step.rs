//! A bucketed gradient all_reduce captured once into a CUDA graph and replayed every step.
//!
//! Each step the "backward pass" (here: the host) writes the parameters' gradients; the
//! captured step packs them into buckets, all_reduces each bucket (summed with a pre-scale of
//! 1/(ranks × micro-batches), as gradient accumulation averages), and unpacks the buckets into
//! the gradients. The same step runs eagerly first, and both are timed. One rank, on GPU 0:
//! `cargo run --release -p dist-nccl --example graph_step` (NCCL from `DIST_NCCL_LIBRARY` or
//! the system).
//!
//! cudarc's own copies go into the capture here, so the context tracks no events (cudarc's
//! waits on events recorded before a capture would break it): the example orders everything
//! on one stream, as `disable_event_tracking` asks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use dist_core::ReduceOp;
use dist_nccl::{Capture, CommConfig, Communicator, Nccl, UniqueId};

/// Gradient lengths (f32 elements) of the model's parameters, and the largest bucket.
const PARAMS: [usize; 7] = [4096, 1024, 16384, 256, 8192, 4096, 512];
const BUCKET: usize = 16384;
const MICRO_BATCHES: usize = 2;
const STEPS: usize = 200;

/// Buckets: runs of consecutive parameters, each run at most `BUCKET` long (a larger
/// parameter gets a bucket of its own), with each parameter's offset in its bucket.
fn plan(params: &[usize]) -> Vec<Vec<(usize, usize)>> {
    let mut buckets: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut used = 0;
    for (i, &len) in params.iter().enumerate() {
        match buckets.last_mut() {
            Some(b) if used + len <= BUCKET => {
                b.push((i, used));
                used += len;
            }
            _ => {
                buckets.push(vec![(i, 0)]);
                used = len;
            }
        }
    }
    buckets
}

/// One step on `s`: pack, all_reduce each bucket, unpack.
fn pack(
    s: &Arc<CudaStream>,
    grads: &[CudaSlice<f32>],
    bucket: &mut CudaSlice<f32>,
    members: &[(usize, usize)],
) -> Result<(), Box<dyn std::error::Error>> {
    for &(p, at) in members {
        let len = grads[p].len();
        s.memcpy_dtod(&grads[p], &mut bucket.slice_mut(at..at + len))?;
    }
    Ok(())
}

fn unpack(
    s: &Arc<CudaStream>,
    grads: &mut [CudaSlice<f32>],
    bucket: &CudaSlice<f32>,
    members: &[(usize, usize)],
) -> Result<(), Box<dyn std::error::Error>> {
    for &(p, at) in members {
        let len = grads[p].len();
        s.memcpy_dtod(&bucket.slice(at..at + len), &mut grads[p])?;
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if dist_nccl::cuda_device_count() == 0 {
        println!("skipped: no CUDA device");
        return Ok(());
    }
    let nccl = Arc::new(Nccl::load()?);
    let ctx = CudaContext::new(0)?;
    // SAFETY: every buffer of this program is allocated after this line and used only on the
    // communicator's stream, which orders all of its uses; the host reads results only after
    // synchronizing that stream.
    unsafe { ctx.disable_event_tracking() };
    let id = UniqueId::new(&nccl)?;
    let comm = Communicator::init_rank(nccl, &ctx, 0, 1, &id, CommConfig::default())?;
    let ranks = comm.size();
    let scale = 1.0 / (ranks * MICRO_BATCHES) as f64;
    let op = ReduceOp::PreMulSum(scale);
    let s = comm.stream().clone();
    let buckets = plan(&PARAMS);
    let mut grads: Vec<CudaSlice<f32>> = PARAMS
        .iter()
        .map(|&n| s.alloc_zeros::<f32>(n))
        .collect::<Result<_, _>>()?;
    let mut bufs: Vec<CudaSlice<f32>> = buckets
        .iter()
        .map(|b| {
            let (last, at) = b[b.len() - 1];
            s.alloc_zeros::<f32>(at + PARAMS[last])
        })
        .collect::<Result<_, _>>()?;
    let host = |step: usize, p: usize| -> Vec<f32> {
        (0..PARAMS[p])
            .map(|j| (step * 7 + p * 3 + j % 11) as f32)
            .collect()
    };
    let check = |grads: &[CudaSlice<f32>], step: usize| -> Result<(), Box<dyn std::error::Error>> {
        for (p, g) in grads.iter().enumerate() {
            let got = s.clone_dtoh(g)?;
            let want: Vec<f32> = host(step, p)
                .iter()
                .map(|x| (f64::from(*x) * scale * ranks as f64) as f32)
                .collect();
            if got != want {
                return Err(format!("step {step}, parameter {p}: wrong gradient").into());
            }
        }
        Ok(())
    };

    // Eager: the same step, call by call.
    let t = Instant::now();
    for step in 0..STEPS {
        for (p, g) in grads.iter_mut().enumerate() {
            s.memcpy_htod(&host(step, p), g)?;
        }
        for (b, members) in bufs.iter_mut().zip(&buckets) {
            pack(&s, &grads, b, members)?;
            comm.all_reduce_in_place(b, op)?;
            unpack(&s, &mut grads, b, members)?;
        }
        comm.synchronize()?;
        if step % 50 == 0 {
            check(&grads, step)?;
        }
    }
    let eager = t.elapsed();

    // Captured once: pack, all_reduce and unpack of every bucket, in one graph. The graph
    // borrows the buckets; the gradients only while capturing (the host writes them between
    // replays, on the same stream).
    let graph = comm.capture(&s, |cap| {
        for (b, members) in bufs.iter_mut().zip(&buckets) {
            pack(cap.stream(), &grads, b, members).map_err(|e| comm_error(cap, e))?;
        }
        for b in &bufs {
            cap.all_reduce_in_place(b, op)?;
        }
        for (b, members) in bufs.iter().zip(&buckets) {
            unpack(cap.stream(), &mut grads, b, members).map_err(|e| comm_error(cap, e))?;
        }
        Ok(())
    })?;
    let t = Instant::now();
    for step in 0..STEPS {
        for (p, g) in grads.iter_mut().enumerate() {
            s.memcpy_htod(&host(step, p), g)?;
        }
        graph.launch()?;
        graph.synchronize()?;
        if step % 50 == 0 {
            check(&grads, step)?;
        }
    }
    let replayed = t.elapsed();
    drop(graph);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / STEPS as f64;
    println!(
        "{} parameters in {} buckets, {ranks} rank(s), {STEPS} steps: eager {:.1} us a step, \
         replayed graph {:.1} us a step (gradients checked every 50 steps)",
        PARAMS.len(),
        buckets.len(),
        per(eager),
        per(replayed),
    );
    Ok(())
}

/// A CUDA error of the caller's own captured work, as the capture closure's error type.
fn comm_error(cap: &Capture<'_>, e: Box<dyn std::error::Error>) -> dist_nccl::NcclError {
    dist_nccl::NcclError::InvalidArgument {
        comm: format!("{:?}", cap.communicator()),
        op: "capture".into(),
        reason: format!("the step's own copies failed: {e}"),
    }
}

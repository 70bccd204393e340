//! `dist-nccl-perf`: the nccl-tests table for one NCCL collective through dist-nccl, one
//! process per GPU, launched by `cargo xtask perf --backend nccl`. Same columns and definitions
//! as the TCP tool. With `--bare`, an all_reduce table follows from a second communicator driven
//! by raw `ncclAllReduce` calls in the same program, the floor dist-nccl's overhead is measured
//! against.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

use std::ffi::c_void;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, DevicePtrMut};
use dist_core::{Backend, Collectives, DType, ReduceOp};
use dist_multirank::{PerfOp, PerfOpts, perf_count, perf_header, perf_input, perf_row, perf_want};
use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
use dist_nccl_sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use dist_tcp::TcpBackend;

/// Timed and untimed calls for `bytes`: `--iters` and `--warmup` if given, else by size.
fn iters_for(o: &PerfOpts, bytes: usize) -> (usize, usize) {
    let iters = o
        .iters
        .unwrap_or(((1usize << 34) / (bytes + (1 << 20))).clamp(20, 2000));
    (iters, o.warmup.unwrap_or((iters / 10).max(5)))
}

fn run_op(comm: &Communicator, op: PerfOp, a: &mut CudaSlice<f32>, b: &mut CudaSlice<f32>) {
    let n = comm.size();
    let (me, right, left) = (
        comm.rank(),
        (comm.rank() + 1) % n,
        (comm.rank() + n - 1) % n,
    );
    let r = match op {
        PerfOp::AllReduce => comm.all_reduce_in_place(a, ReduceOp::Sum),
        PerfOp::Broadcast => comm.broadcast(a, 0),
        PerfOp::Reduce => comm.reduce(a, (me == 0).then_some(b), ReduceOp::Sum, 0),
        // `a` holds this rank's k elements (see the allocation in `main`).
        PerfOp::AllGather => comm.all_gather(a, b),
        PerfOp::ReduceScatter => comm.reduce_scatter(a, b, ReduceOp::Sum),
        PerfOp::AllToAll => comm.all_to_all(a, b),
        PerfOp::SendRecv => {
            let g = comm.group().unwrap();
            comm.send(a, right).unwrap();
            comm.recv(b, left).unwrap();
            g.end()
        }
    };
    r.unwrap_or_else(|e| panic!("{e}"));
}

fn main() -> ExitCode {
    dist_multirank::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = PerfOpts::parse(&args, 1 << 30).unwrap_or_else(|e| panic!("dist-nccl-perf: {e}"));
    assert_eq!(o.dtype, DType::F32, "dist-nccl-perf measures f32");
    let devices = dist_nccl::cuda_device_count();
    let cfg = dist_multirank::config();
    let local = cfg.local_rank().unwrap_or(cfg.rank());
    // One GPU per rank: NCCL refuses two ranks of a communicator on one device.
    let Some(device) = dist_hybrid::pick_device(local, devices) else {
        println!("skipped: local rank {local} has no GPU of its own ({devices} visible)");
        return ExitCode::from(dist_multirank::SKIP_STATUS);
    };
    let tcp = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("{e}"));
    let (me, n) = (tcp.rank(), tcp.world_size());
    let nccl = Arc::new(Nccl::load().unwrap_or_else(|e| panic!("{e}")));
    let mut id = [0u8; 256];
    if me == 0 {
        id[..128].copy_from_slice(UniqueId::new(&nccl).unwrap().as_bytes());
        id[128..].copy_from_slice(UniqueId::new(&nccl).unwrap().as_bytes());
    }
    tcp.broadcast(&mut id, 0).unwrap();
    let ctx = CudaContext::new(device).unwrap_or_else(|e| panic!("{e}"));
    let comm = Communicator::init_rank(
        nccl.clone(),
        &ctx,
        me,
        n,
        &UniqueId::from_bytes(&id[..128]).unwrap(),
        CommConfig {
            timeout: Duration::from_secs(120),
            ..CommConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let s = comm.stream().clone();
    if me == 0 {
        perf_header(&format!(
            "dist-nccl {:?}, {n} ranks (one process per GPU), NCCL {} from {}",
            o.op,
            dist_nccl_sys::version_string(nccl.version()),
            nccl.path()
        ));
    }
    for size in o.sizes() {
        let count = perf_count(o.op, size, 4, n);
        let k = count / n;
        let host: Vec<f32> = (0..count).map(|i| perf_input(me, i) as f32).collect();
        let (mut a, mut b) = match o.op {
            PerfOp::AllGather => (
                s.clone_htod(&host[..k]).unwrap(),
                s.alloc_zeros::<f32>(count).unwrap(),
            ),
            PerfOp::ReduceScatter => (
                s.clone_htod(&host).unwrap(),
                s.alloc_zeros::<f32>(k).unwrap(),
            ),
            _ => (
                s.clone_htod(&host).unwrap(),
                s.alloc_zeros::<f32>(count).unwrap(),
            ),
        };
        let wrong = o.check.then(|| {
            run_op(&comm, o.op, &mut a, &mut b);
            comm.synchronize().unwrap();
            let (ga, gb) = (s.clone_dtoh(&a).unwrap(), s.clone_dtoh(&b).unwrap());
            let got: &[f32] = match o.op {
                PerfOp::AllReduce | PerfOp::Broadcast => &ga,
                PerfOp::Reduce if me == 0 => &gb,
                PerfOp::Reduce => &[],
                _ => &gb,
            };
            let bad = got
                .iter()
                .enumerate()
                .filter(|(i, x)| f64::from(**x) != perf_want(o.op, me, n, k, *i))
                .count();
            // Restore the inputs the in-place ops overwrote.
            s.memcpy_htod(
                if matches!(o.op, PerfOp::AllGather) {
                    &host[..k]
                } else {
                    &host[..]
                },
                &mut a,
            )
            .unwrap();
            bad as u64
        });
        let (iters, warmup) = iters_for(&o, count * 4);
        for _ in 0..warmup {
            run_op(&comm, o.op, &mut a, &mut b);
        }
        comm.synchronize().unwrap();
        tcp.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            run_op(&comm, o.op, &mut a, &mut b);
        }
        comm.synchronize().unwrap_or_else(|e| panic!("{e}"));
        perf_row(
            &tcp,
            o.op,
            DType::F32,
            (count * 4, count),
            t.elapsed().as_secs_f64() / iters as f64,
            wrong,
        );
    }
    if o.bare && o.op == PerfOp::AllReduce {
        bare(&tcp, &nccl, &ctx, &id[128..], &o);
    }
    tcp.barrier().unwrap();
    ExitCode::SUCCESS
}

/// The floor: a communicator made and driven by raw NCCL calls (blocking init, `ncclAllReduce`
/// back to back, one stream synchronize), in this same program.
fn bare(tcp: &TcpBackend, nccl: &Nccl, ctx: &Arc<CudaContext>, id: &[u8], o: &PerfOpts) {
    let (me, n) = (tcp.rank(), tcp.world_size());
    let raw = nccl.raw();
    let init = nccl.get("ncclCommInitRank", &raw.ncclCommInitRank).unwrap();
    let all_reduce = nccl.get("ncclAllReduce", &raw.ncclAllReduce).unwrap();
    let destroy = nccl.get("ncclCommDestroy", &raw.ncclCommDestroy).unwrap();
    let mut uid = ncclUniqueId::default();
    for (d, s) in uid.internal.iter_mut().zip(id) {
        *d = *s as _;
    }
    ctx.bind_to_thread().unwrap();
    let mut comm: ncclComm_t = std::ptr::null_mut();
    // SAFETY: valid pointers; every rank passes the same id.
    let r = unsafe { init(&mut comm, n as i32, uid, me as i32) };
    assert_eq!(r, ncclResult_t::ncclSuccess, "bare ncclCommInitRank");
    let stream = ctx.new_stream().unwrap();
    if me == 0 {
        perf_header(&format!("bare ncclAllReduce loop, {n} ranks, same program"));
    }
    for size in o.sizes() {
        let count = (size / 4).max(1);
        let mut buf = stream.alloc_zeros::<f32>(count).unwrap();
        let (iters, warmup) = iters_for(o, count * 4);
        let (p, guard) = buf.device_ptr_mut(&stream);
        let cu = stream.cu_stream() as dist_nccl_sys::cudaStream_t;
        let call = || {
            // SAFETY: one live buffer of `count` f32 on this device, in place; live comm.
            let r = unsafe {
                all_reduce(
                    p as *const c_void,
                    p as *mut c_void,
                    count,
                    ncclDataType_t::ncclFloat32,
                    ncclRedOp_t::ncclSum,
                    comm,
                    cu,
                )
            };
            assert_eq!(r, ncclResult_t::ncclSuccess);
        };
        for _ in 0..warmup {
            call();
        }
        stream.synchronize().unwrap();
        tcp.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            call();
        }
        stream.synchronize().unwrap();
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        drop(guard);
        perf_row(
            tcp,
            PerfOp::AllReduce,
            DType::F32,
            (count * 4, count),
            secs,
            None,
        );
    }
    // SAFETY: no work is pending on it (synchronized) and it is not used again.
    unsafe { destroy(comm) };
}

//! Per-call cost of small collectives on one rank, four ways side by side: a bare NCCL loop (raw
//! calls on a raw communicator, what nccl-tests times), dist-nccl's eager call, and a CUDA graph
//! of N calls replayed, captured from raw NCCL calls and through `Communicator::capture`.
//!
//! `cargo run --release -p dist-nccl --example graph_perf -- [N] [REPLAYS]` (N calls a graph,
//! default 64; 200 replays). Each op at 8 B is timed in three rounds, each round alternating
//! the loops; a line per op gives each loop's median µs per call. Every loop ends with a
//! stream synchronize; the eager loops run N × REPLAYS calls.
//!
//! What dist's eager call costs, taken apart: a second line per op times dist's eager call on
//! buffers made without cudarc's event tracking (only the stream orders them), so that
//! `tracked - untracked` is cudarc's ordering of the buffers (a `cuStreamWaitEvent` per earlier
//! use waited for and a `cuEventRecord` per buffer) and `untracked - bare` is dist's own path
//! (argument checks, the capture check, the lock, the watchdog's count). The `# step` lines
//! then time each driver step of that path alone, N × REPLAYS times on the communicator's
//! stream: the capture check (`cuStreamIsCapturing`), the ordering cudarc does for a buffer a
//! call reads (one wait, one record) and for one it writes (two waits, one record).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, result};
use dist_core::ReduceOp;
use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
use dist_nccl_sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
}

const OPS: [Op; 4] = [
    Op::AllReduce,
    Op::Broadcast,
    Op::AllGather,
    Op::ReduceScatter,
];

/// Two f32: 8 B in and out for every op at one rank.
const COUNT: usize = 2;

/// A raw communicator of one rank and its raw call of `op` on two buffers.
struct Bare {
    nccl: Arc<Nccl>,
    comm: ncclComm_t,
}

impl Bare {
    fn new(nccl: &Arc<Nccl>, ctx: &Arc<CudaContext>) -> Bare {
        let id = UniqueId::new(nccl).unwrap();
        let init = dist_nccl_sys::nccl_fn!(nccl, ncclCommInitRank).unwrap();
        let mut uid = dist_nccl_sys::ncclUniqueId::default();
        for (d, s) in uid.internal.iter_mut().zip(id.as_bytes()) {
            *d = *s as _;
        }
        ctx.bind_to_thread().unwrap();
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid pointers; one rank of one.
        let r = unsafe { init(&mut comm, 1, uid, 0) };
        assert_eq!(r, ncclResult_t::ncclSuccess, "bare ncclCommInitRank");
        Bare {
            nccl: nccl.clone(),
            comm,
        }
    }

    /// # Safety
    /// `a` and `b` address `COUNT` f32 of device memory each, live until the call has run.
    unsafe fn call(&self, op: Op, a: *mut c_void, b: *mut c_void, s: cudaStream_t) {
        let raw = self.nccl.raw();
        let (f, sum, c) = (ncclDataType_t::ncclFloat32, ncclRedOp_t::ncclSum, self.comm);
        // SAFETY: the caller vouches for the buffers; the communicator is live.
        let r = unsafe {
            match op {
                Op::AllReduce => (raw.ncclAllReduce.as_ref().unwrap())(a, b, COUNT, f, sum, c, s),
                Op::Broadcast => (raw.ncclBroadcast.as_ref().unwrap())(a, a, COUNT, f, 0, c, s),
                Op::AllGather => (raw.ncclAllGather.as_ref().unwrap())(a, b, COUNT, f, c, s),
                Op::ReduceScatter => {
                    (raw.ncclReduceScatter.as_ref().unwrap())(a, b, COUNT, f, sum, c, s)
                }
            }
        };
        assert_eq!(r, ncclResult_t::ncclSuccess, "bare {op:?}");
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        let destroy = dist_nccl_sys::nccl_fn!(&self.nccl, ncclCommDestroy).unwrap();
        // SAFETY: every stream it used was synchronized; it is not used again.
        unsafe { destroy(self.comm) };
    }
}

fn dist_call(comm: &Communicator, op: Op, a: &mut CudaSlice<f32>, b: &mut CudaSlice<f32>) {
    let r = match op {
        Op::AllReduce => comm.all_reduce(a, b, ReduceOp::Sum),
        Op::Broadcast => comm.broadcast(a, 0),
        Op::AllGather => comm.all_gather(a, b),
        Op::ReduceScatter => comm.reduce_scatter(a, b, ReduceOp::Sum),
    };
    r.unwrap();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// µs per call of `iters` calls of `call`, then `sync`.
fn per_call(iters: usize, calls_each: usize, mut call: impl FnMut(), sync: impl Fn()) -> f64 {
    for _ in 0..iters.min(20) {
        call();
    }
    sync();
    let t = Instant::now();
    for _ in 0..iters {
        call();
    }
    sync();
    t.elapsed().as_secs_f64() * 1e6 / (iters * calls_each) as f64
}

/// Each driver step of dist's eager path alone, `iters` times on `s` (median of three rounds,
/// µs a step).
fn steps(s: &Arc<CudaStream>, a: &mut CudaSlice<f32>, b: &mut CudaSlice<f32>, iters: usize) {
    let sync = || s.synchronize().unwrap();
    let time = |mut step: Box<dyn FnMut() + '_>| {
        median(
            (0..3)
                .map(|_| per_call(iters, 1, &mut step, sync))
                .collect(),
        )
    };
    let cu = s.cu_stream();
    let capture = time(Box::new(|| {
        // SAFETY: `cu` is the live stream `s`; the query only reads its capture state.
        let st = unsafe { result::stream::is_capturing(cu) }.unwrap();
        std::hint::black_box(st);
    }));
    let read = time(Box::new(|| {
        let (p, g) = a.device_ptr(s);
        std::hint::black_box(p);
        drop(g);
    }));
    let write = time(Box::new(|| {
        let (p, g) = b.device_ptr_mut(s);
        std::hint::black_box(p);
        drop(g);
    }));
    println!("# step capture check (cuStreamIsCapturing): {capture:.3} us");
    println!("# step cudarc ordering of a buffer read (1 wait, 1 record): {read:.3} us");
    println!("# step cudarc ordering of a buffer written (2 waits, 1 record): {write:.3} us");
}

fn main() {
    if dist_nccl::cuda_device_count() == 0 {
        println!("skipped: no CUDA device");
        return;
    }
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map_or(64, |a| a.parse().expect("N: calls a graph"));
    let replays: usize = args.next().map_or(200, |a| a.parse().expect("REPLAYS"));
    let nccl = Arc::new(Nccl::load().unwrap());
    let ctx = CudaContext::new(0).unwrap();
    let id = UniqueId::new(&nccl).unwrap();
    let comm = Communicator::init_rank(nccl.clone(), &ctx, 0, 1, &id, CommConfig::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let bare = Bare::new(&nccl, &ctx);
    let s = comm.stream().clone();
    // The bare loops' stream and buffers: raw pointers, no cudarc ordering on the calls.
    let bs: Arc<CudaStream> = ctx.new_stream().unwrap();
    let mut ba = bs.alloc_zeros::<f32>(COUNT).unwrap();
    let mut bb = bs.alloc_zeros::<f32>(COUNT).unwrap();
    let (pa, ga) = ba.device_ptr_mut(&bs);
    let (pb, gb) = bb.device_ptr_mut(&bs);
    let (pa, pb) = (pa as *mut c_void, pb as *mut c_void);
    let bcu = bs.cu_stream() as cudaStream_t;
    let mut a = s.alloc_zeros::<f32>(COUNT).unwrap();
    let mut b = s.alloc_zeros::<f32>(COUNT).unwrap();
    // Buffers without cudarc's events, for dist's own cost apart from cudarc's ordering.
    // SAFETY: the two buffers made while tracking is off are used only on the communicator's
    // stream `s` (by dist's calls), which orders every use, and are dropped (freed on `s`) after
    // its last synchronize; every other buffer is made while tracking is on.
    let (mut ua, mut ub) = unsafe {
        ctx.disable_event_tracking();
        let made = (
            s.alloc_zeros::<f32>(COUNT).unwrap(),
            s.alloc_zeros::<f32>(COUNT).unwrap(),
        );
        ctx.enable_event_tracking();
        made
    };
    println!(
        "# one rank, 8 B, NCCL {} from {}, {} ({n} calls a graph, {replays} replays; eager \
         loops {} calls)",
        dist_nccl_sys::version_string(nccl.version()),
        nccl.path(),
        ctx.name().unwrap_or_default(),
        n * replays
    );
    println!(
        "# op: median us per call of 3 rounds: bare eager, dist eager, bare graph, dist graph"
    );
    for op in OPS {
        // The bare graph: N raw calls captured on the bare stream.
        bs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        for _ in 0..n {
            // SAFETY: the bare buffers live (guards held) until after the last replay.
            unsafe { bare.call(op, pa, pb, bcu) };
        }
        let bare_graph = bs
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph");
        let (mut r_be, mut r_de, mut r_bg, mut r_dg) = (vec![], vec![], vec![], vec![]);
        let mut r_du = vec![];
        for _ in 0..3 {
            r_du.push(per_call(
                n * replays,
                1,
                || dist_call(&comm, op, &mut ua, &mut ub),
                || comm.synchronize().unwrap(),
            ));
            r_be.push(per_call(
                n * replays,
                1,
                // SAFETY: as above.
                || unsafe { bare.call(op, pa, pb, bcu) },
                || bs.synchronize().unwrap(),
            ));
            r_de.push(per_call(
                n * replays,
                1,
                || dist_call(&comm, op, &mut a, &mut b),
                || comm.synchronize().unwrap(),
            ));
            r_bg.push(per_call(
                replays,
                n,
                || bare_graph.launch().unwrap(),
                || bs.synchronize().unwrap(),
            ));
            let graph = comm
                .capture(&s, |cap| {
                    for _ in 0..n {
                        match op {
                            Op::AllReduce => cap.all_reduce(&a, &b, ReduceOp::Sum)?,
                            Op::Broadcast => cap.broadcast(&a, 0)?,
                            Op::AllGather => cap.all_gather(&a, &b)?,
                            Op::ReduceScatter => cap.reduce_scatter(&a, &b, ReduceOp::Sum)?,
                        }
                    }
                    Ok(())
                })
                .unwrap_or_else(|e| panic!("{e}"));
            r_dg.push(per_call(
                replays,
                n,
                || graph.launch().unwrap(),
                || graph.synchronize().unwrap(),
            ));
        }
        let (be, de, bg, dg) = (median(r_be), median(r_de), median(r_bg), median(r_dg));
        println!(
            "# per-call {op:?} 8 B: bare eager {be:.2} us, dist eager {de:.2} us ({:+.2}), bare \
             graph {bg:.2} us, dist graph {dg:.2} us ({:+.2} vs bare graph, {:+.2} vs bare eager)",
            de - be,
            dg - bg,
            dg - be
        );
        let du = median(r_du);
        println!(
            "# per-call {op:?} 8 B untracked buffers: dist eager {du:.2} us ({:+.2} vs bare \
             eager: dist's own path; cudarc's ordering {:+.2})",
            du - be,
            de - du
        );
    }
    steps(&s, &mut a, &mut b, n * replays);
    drop((ga, gb));
    bs.synchronize().unwrap();
}

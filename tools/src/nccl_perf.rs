//! `dist-nccl-perf`: the nccl-tests table for one NCCL collective through dist-nccl, one
//! process per GPU, launched by `cargo xtask perf --backend nccl`. Same columns and definitions
//! as the TCP tool. With `--bare` (all_reduce, all_gather, reduce_scatter, broadcast, sendrecv),
//! each size is then timed three more rounds, alternating dist-nccl's loop and a bare loop of the
//! same raw NCCL call on a second communicator in the same program (the floor dist-nccl's
//! per-call overhead is measured against), and a line gives both medians and the difference.
//! With `DIST_PERF_HYBRID_CHECK=1` it measures `HybridBackend`'s NCCL call check instead
//! (`nccl_check_cost.rs`).

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

use std::ffi::c_void;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use dist_core::collectives::Kind;
use dist_core::{Backend, Collectives, DType, ReduceOp};
use dist_multirank::perf::{
    PerfOp, PerfOpts, perf_count, perf_header, perf_input, perf_row, perf_want,
};
use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
use dist_nccl_sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};
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
        PerfOp::Collective(Kind::AllReduce) => comm.all_reduce_in_place(a, ReduceOp::Sum),
        PerfOp::Collective(Kind::Broadcast) => comm.broadcast(a, 0),
        PerfOp::Collective(Kind::Reduce) => {
            comm.reduce(a, (me == 0).then_some(b), ReduceOp::Sum, 0)
        }
        // `a` holds this rank's k elements (see the allocation in `main`).
        PerfOp::Collective(Kind::AllGather) => comm.all_gather(a, b),
        PerfOp::Collective(Kind::ReduceScatter) => comm.reduce_scatter(a, b, ReduceOp::Sum),
        PerfOp::Collective(Kind::AllToAll) => comm.all_to_all(a, b),
        PerfOp::SendRecv => comm.group(|g| {
            g.send(a, right)?;
            g.recv(b, left)
        }),
        PerfOp::Collective(other) => {
            unreachable!(
                "PerfOpts::parse takes only {}, not {}",
                PerfOp::names(),
                other.name()
            )
        }
    };
    r.unwrap_or_else(|e| panic!("{e}"));
}

mod nccl_check_cost;

fn main() -> ExitCode {
    dist_multirank::init_logging();
    if nccl_check_cost::wanted() {
        return nccl_check_cost::run();
    }
    let o = dist_multirank::perf::perf_opts_or_exit("dist-nccl-perf", 1 << 30, |o| {
        if o.dtype != DType::F32 {
            return Err(format!(
                "--dtype {}: dist-nccl-perf measures f32",
                o.dtype.name()
            ));
        }
        if o.bare && !Bare::times(o.op) {
            return Err(format!(
                "--bare times all_reduce, all_gather, reduce_scatter, broadcast and sendrecv, \
                 not {}",
                o.op
            ));
        }
        Ok(())
    });
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
    // `DIST_PERF_NO_EVENT_TRACKING=1`: buffers without cudarc's per-buffer events, to tell
    // dist-nccl's own per-call cost from the stream waits and records cudarc adds to each call
    // (the bare loop has neither).
    let untracked = std::env::var_os("DIST_PERF_NO_EVENT_TRACKING").is_some_and(|v| v == "1");
    if untracked {
        // SAFETY: every buffer this program allocates afterwards is used only on the
        // communicator's own stream (dist's loop) or only on the bare loop's stream, each of
        // which orders its own work; the two loops never share a buffer, and each loop's stream
        // is synchronized before the other runs or the buffers are read back.
        unsafe { ctx.disable_event_tracking() };
    }
    // The communicator's own stream (`CommConfig::own_stream`, the default): the program has two
    // streams and cudarc orders every buffer use with events. `DIST_PERF_DEFAULT_STREAM=1`: the
    // calls go on the context's default stream, the program's only one.
    let own_stream = std::env::var_os("DIST_PERF_DEFAULT_STREAM").is_none_or(|v| v != "1");
    let comm = Communicator::init_rank(
        nccl.clone(),
        &ctx,
        me,
        n,
        &UniqueId::from_bytes(&id[..128]).unwrap(),
        CommConfig {
            timeout: Duration::from_secs(120),
            own_stream,
            ..CommConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let s = comm.stream().clone();
    let mut bare = o
        .bare
        .then(|| Bare::new(&tcp, &nccl, &ctx, &id[128..], o.max, o.op));
    if me == 0 {
        perf_header(&format!(
            "dist-nccl {}, {n} ranks (one process per GPU), NCCL {} from {}{}",
            o.op,
            dist_nccl_sys::version_string(nccl.version()),
            nccl.path(),
            match (own_stream, untracked) {
                (false, _) => ", on the context's default stream",
                (true, false) => ", on a stream of its own (cudarc orders buffers with events)",
                (true, true) => ", on a stream of its own, buffers without cudarc event tracking",
            }
        ));
    }
    for size in o.sizes() {
        let count = perf_count(o.op, size, 4, n);
        let k = count / n;
        let host: Vec<f32> = (0..count).map(|i| perf_input(me, i) as f32).collect();
        let (mut a, mut b) = match o.op {
            PerfOp::Collective(Kind::AllGather) => (
                s.clone_htod(&host[..k]).unwrap(),
                s.alloc_zeros::<f32>(count).unwrap(),
            ),
            PerfOp::Collective(Kind::ReduceScatter) => (
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
                PerfOp::Collective(Kind::AllReduce | Kind::Broadcast) => &ga,
                PerfOp::Collective(Kind::Reduce) if me == 0 => &gb,
                PerfOp::Collective(Kind::Reduce) => &[],
                _ => &gb,
            };
            let bad = got
                .iter()
                .enumerate()
                .filter(|(i, x)| f64::from(**x) != perf_want(o.op, me, n, k, *i))
                .count();
            // Restore the inputs the in-place ops overwrote.
            s.memcpy_htod(
                if o.op == PerfOp::Collective(Kind::AllGather) {
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
        let dist = |a: &mut CudaSlice<f32>, b: &mut CudaSlice<f32>| {
            timed(
                &tcp,
                iters,
                warmup,
                || run_op(&comm, o.op, a, b),
                || comm.synchronize().unwrap_or_else(|e| panic!("{e}")),
            )
        };
        perf_row(
            &tcp,
            o.op,
            DType::F32,
            (count * 4, count),
            dist(&mut a, &mut b),
            wrong,
            None,
        );
        if let Some(bare) = &mut bare {
            let (mut d, mut r) = (Vec::new(), Vec::new());
            for _ in 0..3 {
                d.push(slowest(&tcp, dist(&mut a, &mut b)) * 1e6);
                r.push(slowest(&tcp, bare.time(&tcp, o.op, count, iters, warmup)) * 1e6);
            }
            if me == 0 {
                let (md, mr) = (median(&mut d), median(&mut r));
                println!(
                    "# per-call {} {} B: dist {d:.2?} us, bare {r:.2?} us; medians {md:.2} vs \
                     {mr:.2} us: dist {:+.2} us per call",
                    o.op,
                    count * 4,
                    md - mr
                );
            }
        }
    }
    if let Some(bare) = bare {
        bare.close();
    }
    tcp.barrier().unwrap();
    ExitCode::SUCCESS
}

/// Seconds per call of `call`, `iters` times after `warmup`, between barriers.
fn timed(
    tcp: &TcpBackend,
    iters: usize,
    warmup: usize,
    mut call: impl FnMut(),
    sync: impl Fn(),
) -> f64 {
    for _ in 0..warmup {
        call();
    }
    sync();
    tcp.barrier().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        call();
    }
    sync();
    t.elapsed().as_secs_f64() / iters as f64
}

/// The slowest rank's value.
fn slowest(tcp: &TcpBackend, secs: f64) -> f64 {
    let mut t = [secs];
    tcp.all_reduce(&mut t, ReduceOp::Max).unwrap();
    t[0]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The floor: a communicator made and driven by raw NCCL calls (blocking init, the op's NCCL
/// call back to back, one stream synchronize), in this same program, on its own buffers.
struct Bare {
    nccl: Arc<Nccl>,
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    me: usize,
    n: usize,
}

impl Bare {
    /// Whether `--bare` times `op` (a bare NCCL loop of it exists).
    fn times(op: PerfOp) -> bool {
        matches!(
            op,
            PerfOp::Collective(
                Kind::AllReduce | Kind::AllGather | Kind::ReduceScatter | Kind::Broadcast
            ) | PerfOp::SendRecv
        )
    }

    fn new(
        tcp: &TcpBackend,
        nccl: &Arc<Nccl>,
        ctx: &Arc<CudaContext>,
        id: &[u8],
        max: usize,
        op: PerfOp,
    ) -> Bare {
        // Refused with the other arguments, before any rank joins (`main`).
        assert!(Bare::times(op), "--bare does not time {op}");
        let (me, n) = (tcp.rank(), tcp.world_size());
        let init = dist_nccl_sys::nccl_fn!(nccl, ncclCommInitRank).unwrap();
        let mut uid = ncclUniqueId::default();
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        ctx.bind_to_thread().unwrap();
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid pointers; every rank passes the same id.
        let r = unsafe { init(&mut comm, n as i32, uid, me as i32) };
        assert_eq!(r, ncclResult_t::ncclSuccess, "bare ncclCommInitRank");
        // The context's default stream: a stream of its own would put the whole program in
        // cudarc's multi-stream mode even where dist's loop runs on the default stream too.
        let stream = ctx.default_stream();
        // Room for the largest size times the ranks (all_gather's output, reduce_scatter's
        // input).
        let elems = perf_count(op, max, 4, n) * n.max(1);
        Bare {
            nccl: nccl.clone(),
            comm,
            a: stream.alloc_zeros::<f32>(elems).unwrap(),
            b: stream.alloc_zeros::<f32>(elems).unwrap(),
            stream,
            me,
            n,
        }
    }

    /// Seconds per bare call of `op` on `count` elements (as dist's loop: blocks of
    /// `count / n` for all_gather and reduce_scatter).
    fn time(
        &mut self,
        tcp: &TcpBackend,
        op: PerfOp,
        count: usize,
        iters: usize,
        warmup: usize,
    ) -> f64 {
        let raw = self.nccl.raw();
        let (n, me) = (self.n, self.me);
        let k = count / n;
        let (right, left) = (((me + 1) % n) as i32, ((me + n - 1) % n) as i32);
        let cu = self.stream.cu_stream() as cudaStream_t;
        let comm = self.comm;
        let (pa, ga) = self.a.device_ptr_mut(&self.stream);
        let (pb, gb) = self.b.device_ptr_mut(&self.stream);
        let (pa, pb) = (pa as *mut c_void, pb as *mut c_void);
        let f32t = ncclDataType_t::ncclFloat32;
        let sum = ncclRedOp_t::ncclSum;
        let all_reduce = *raw.ncclAllReduce.as_ref().unwrap();
        let all_gather = *raw.ncclAllGather.as_ref().unwrap();
        let reduce_scatter = *raw.ncclReduceScatter.as_ref().unwrap();
        let broadcast = *raw.ncclBroadcast.as_ref().unwrap();
        let send = *raw.ncclSend.as_ref().unwrap();
        let recv = *raw.ncclRecv.as_ref().unwrap();
        let start = *raw.ncclGroupStart.as_ref().unwrap();
        let end = *raw.ncclGroupEnd.as_ref().unwrap();
        let call = || {
            // SAFETY: both buffers live (their guards are held) on this device, each with room
            // for `count` elements and `count` × n (sizes from `new`); the communicator is live.
            let r = unsafe {
                match op {
                    PerfOp::Collective(Kind::AllReduce) => {
                        all_reduce(pa, pa, count, f32t, sum, comm, cu)
                    }
                    PerfOp::Collective(Kind::AllGather) => all_gather(pa, pb, k, f32t, comm, cu),
                    PerfOp::Collective(Kind::ReduceScatter) => {
                        reduce_scatter(pa, pb, k, f32t, sum, comm, cu)
                    }
                    PerfOp::Collective(Kind::Broadcast) => {
                        broadcast(pa, pa, count, f32t, 0, comm, cu)
                    }
                    _ => {
                        start();
                        send(pa, count, f32t, right, comm, cu);
                        recv(pb, count, f32t, left, comm, cu);
                        end()
                    }
                }
            };
            assert_eq!(r, ncclResult_t::ncclSuccess, "bare {op}");
        };
        let stream = &self.stream;
        let secs = timed(tcp, iters, warmup, call, || stream.synchronize().unwrap());
        drop((ga, gb));
        secs
    }

    fn close(self) {
        self.stream.synchronize().unwrap();
        let destroy = dist_nccl_sys::nccl_fn!(&self.nccl, ncclCommDestroy).unwrap();
        // SAFETY: no work is pending on it (synchronized) and it is not used again.
        unsafe { destroy(self.comm) };
    }
}

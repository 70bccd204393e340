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
use dist_core::{Backend, Collectives, ReduceOp};
use dist_multirank::{PerfOp, parse_size};
use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
use dist_nccl_sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use dist_tcp::TcpBackend;

struct Opts {
    op: PerfOp,
    min: usize,
    max: usize,
    factor: usize,
    check: bool,
    bare: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        op: PerfOp::AllReduce,
        min: 8,
        max: 1 << 30,
        factor: 4,
        check: false,
        bare: false,
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
            "--dtype" => assert_eq!(val(), "f32", "dist-nccl-perf measures f32"),
            "--check" | "--bare" => {
                if args[i] == "--check" {
                    o.check = true;
                } else {
                    o.bare = true;
                }
                i += 1;
                continue;
            }
            "--iters" => {}
            other => panic!("unknown argument {other:?}"),
        }
        i += 2;
    }
    o
}

fn iters_for(bytes: usize) -> usize {
    ((1usize << 34) / (bytes + (1 << 20))).clamp(20, 2000)
}

fn header(title: &str) {
    println!("# {title}");
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>4} {:>10} {:>8} {:>8} {:>6}",
        "size", "count", "type", "redop", "root", "time(us)", "algbw", "busbw", "#wrong"
    );
}

fn row(tcp: &TcpBackend, op: PerfOp, bytes: usize, count: usize, secs: f64, wrong: Option<u64>) {
    let mut t = [secs];
    tcp.all_reduce(&mut t, ReduceOp::Max).unwrap();
    let mut w = [wrong.unwrap_or(0)];
    tcp.all_reduce(&mut w, ReduceOp::Sum).unwrap();
    if tcp.rank() == 0 {
        let algbw = bytes as f64 / t[0] / 1e9;
        println!(
            "{bytes:>12} {count:>12} {:>8} {:>6} {:>4} {:>10.2} {algbw:>8.2} {:>8.2} {:>6}",
            "float",
            if matches!(
                op,
                PerfOp::AllReduce | PerfOp::Reduce | PerfOp::ReduceScatter
            ) {
                "sum"
            } else {
                "none"
            },
            if matches!(op, PerfOp::Broadcast | PerfOp::Reduce) {
                "0"
            } else {
                "-1"
            },
            t[0] * 1e6,
            algbw * op.bus_factor(tcp.world_size()),
            wrong.map_or("N/A".to_string(), |_| w[0].to_string()),
        );
    }
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
    let o = opts();
    let devices = dist_nccl::cuda_device_count();
    let cfg = dist_multirank::config();
    let local = cfg.local_rank().unwrap_or(cfg.rank());
    if devices == 0 {
        println!("skipped: no CUDA device");
        return ExitCode::from(dist_multirank::SKIP_STATUS);
    }
    let tcp = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("{e}"));
    let (me, n) = (tcp.rank(), tcp.world_size());
    let nccl = Arc::new(Nccl::load().unwrap_or_else(|e| panic!("{e}")));
    let mut id = [0u8; 256];
    if me == 0 {
        id[..128].copy_from_slice(UniqueId::new(&nccl).unwrap().as_bytes());
        id[128..].copy_from_slice(UniqueId::new(&nccl).unwrap().as_bytes());
    }
    tcp.broadcast(&mut id, 0).unwrap();
    let ctx = CudaContext::new(local % devices).unwrap_or_else(|e| panic!("{e}"));
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
        header(&format!(
            "dist-nccl {:?}, {n} ranks (one process per GPU), NCCL {} from {}",
            o.op,
            dist_nccl_sys::version_string(nccl.version()),
            nccl.path()
        ));
    }
    let mut size = o.min;
    while size <= o.max {
        let mut count = (size / 4).max(1);
        if matches!(
            o.op,
            PerfOp::AllGather | PerfOp::ReduceScatter | PerfOp::AllToAll
        ) {
            count = (count / n).max(1) * n;
        }
        let k = count / n;
        let host: Vec<f32> = (0..count).map(|i| ((me * 3 + i) % 7) as f32).collect();
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
            let v = |r: usize, i: usize| ((r * 3 + i) % 7) as f32;
            let sum = |i: usize| (0..n).map(|r| v(r, i)).sum::<f32>();
            let bad = match o.op {
                PerfOp::AllReduce => ga
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != sum(*i))
                    .count(),
                PerfOp::Broadcast => ga
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v(0, *i))
                    .count(),
                PerfOp::Reduce if me == 0 => gb
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != sum(*i))
                    .count(),
                PerfOp::Reduce => 0,
                PerfOp::AllGather => gb
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v(*i / k, *i % k))
                    .count(),
                PerfOp::ReduceScatter => gb
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != sum(me * k + *i))
                    .count(),
                PerfOp::AllToAll => gb
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v(*i / k, me * k + *i % k))
                    .count(),
                PerfOp::SendRecv => gb
                    .iter()
                    .enumerate()
                    .filter(|(i, x)| **x != v((me + n - 1) % n, *i))
                    .count(),
            };
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
        let iters = iters_for(count * 4);
        for _ in 0..(iters / 10).max(5) {
            run_op(&comm, o.op, &mut a, &mut b);
        }
        comm.synchronize().unwrap();
        tcp.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            run_op(&comm, o.op, &mut a, &mut b);
        }
        comm.synchronize().unwrap_or_else(|e| panic!("{e}"));
        row(
            &tcp,
            o.op,
            count * 4,
            count,
            t.elapsed().as_secs_f64() / iters as f64,
            wrong,
        );
        size *= o.factor;
    }
    if o.bare && o.op == PerfOp::AllReduce {
        bare(&tcp, &nccl, &ctx, &id[128..], &o);
    }
    tcp.barrier().unwrap();
    ExitCode::SUCCESS
}

/// The floor: a communicator made and driven by raw NCCL calls (blocking init, `ncclAllReduce`
/// back to back, one stream synchronize), in this same program.
fn bare(tcp: &TcpBackend, nccl: &Nccl, ctx: &Arc<CudaContext>, id: &[u8], o: &Opts) {
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
        header(&format!("bare ncclAllReduce loop, {n} ranks, same program"));
    }
    let mut size = o.min;
    while size <= o.max {
        let count = (size / 4).max(1);
        let mut buf = stream.alloc_zeros::<f32>(count).unwrap();
        let iters = iters_for(count * 4);
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
        for _ in 0..(iters / 10).max(5) {
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
        row(tcp, PerfOp::AllReduce, count * 4, count, secs, None);
        size *= o.factor;
    }
    // SAFETY: no work is pending on it (synchronized) and it is not used again.
    unsafe { destroy(comm) };
}

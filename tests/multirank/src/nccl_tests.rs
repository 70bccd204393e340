//! The NCCL multi-rank test program, one process per GPU: `dist-nccl-tests CASE` as the rank
//! the launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
//! `--list`. The unique id travels over TCP (a `TcpBackend` broadcast from rank 0). Without a
//! usable GPU for every local rank, a case prints "skipped: ..." and exits with 77, which
//! `cargo xtask test-multirank --backend nccl` counts as skipped.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use dist_core::{Backend, Collectives, ReduceOp};
use dist_multirank::{Case, TestElem};
use dist_nccl::{CommConfig, Communicator, F8E4M3, F8E5M2, Nccl, NcclError, NcclType, UniqueId};
use dist_tcp::TcpBackend;

mod nccl_bounded;
mod nccl_coll;
mod nccl_failures;
mod nccl_hybrid_coll;
mod nccl_hybrid_groups;
mod nccl_socket;

struct Rig {
    tcp: TcpBackend,
    comm: Communicator,
}

/// Forms the TCP job, shares a unique id from rank 0, and creates the communicator on the GPU
/// of this rank's local rank.
/// `CommConfig::connect_peers` for these cases: on, unless `DIST_TEST_CONNECT_PEERS=0` (to show
/// what `nccl_connect_absent` does without it).
fn connect_peers() -> bool {
    std::env::var("DIST_TEST_CONNECT_PEERS").map_or(true, |v| v != "0")
}

fn rig(timeout: Duration) -> Result<Rig, String> {
    let devices = dist_nccl::cuda_device_count();
    let cfg = dist_multirank::config();
    let local = cfg.local_rank().unwrap_or(cfg.rank());
    let local_world: usize = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cfg.world_size());
    if devices == 0 {
        return Err("skipped: no CUDA device".into());
    }
    if local_world > devices {
        return Err(format!(
            "skipped: {local_world} local ranks but {devices} CUDA devices"
        ));
    }
    let tcp = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    let nccl = Arc::new(Nccl::load().unwrap_or_else(|e| panic!("{e}")));
    let mut id = [0u8; 128];
    if tcp.rank() == 0 {
        id = *UniqueId::new(&nccl)
            .unwrap_or_else(|e| panic!("{e}"))
            .as_bytes();
    }
    tcp.broadcast(&mut id, 0).unwrap_or_else(|e| panic!("{e}"));
    let id = UniqueId::from_bytes(&id).unwrap();
    let ctx = CudaContext::new(local).unwrap_or_else(|e| panic!("cuda:{local}: {e}"));
    let comm = Communicator::init_rank(
        nccl,
        &ctx,
        tcp.rank(),
        tcp.world_size(),
        &id,
        CommConfig {
            timeout,
            name: Some("test".into()),
            connect_peers: connect_peers(),
            ..CommConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    Ok(Rig { tcp, comm })
}

fn up<T: NcclType>(s: &Arc<CudaStream>, x: &[T]) -> CudaSlice<T> {
    s.clone_htod(x).unwrap_or_else(|e| panic!("{e}"))
}

fn down<T: NcclType + Default>(comm: &Communicator, x: &CudaSlice<T>) -> Vec<T> {
    comm.synchronize().unwrap_or_else(|e| panic!("{e}"));
    comm.stream()
        .clone_dtoh(x)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A poison value no input takes, so that an output left unwritten is seen.
fn poison<T: TestElem>(n: usize) -> Vec<T> {
    let mut v = vec![T::val(0, 0, false); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).fill(0x5A);
    v
}

fn bits<T: TestElem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

/// Misuse of sizes, devices, roots and peers is an error before anything is enqueued, and the
/// buffers are left as they were.
fn misuse() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let n = r.comm.size();
    let s = r.comm.stream();
    let send = up(s, &[1.0f32; 10]);
    let mut out = up(s, &poison::<f32>(10 * n + 1));
    let before = down(&r.comm, &out);
    let expect = |res: Result<(), NcclError>, text: &str| {
        let e = res.expect_err("misuse accepted");
        assert!(matches!(e, NcclError::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains(text), "{e}");
        println!("refused: {e}");
    };
    expect(
        r.comm.all_gather(&send, &mut out),
        &format!("recv has {} elements, expected {}", 10 * n + 1, 10 * n),
    );
    expect(
        r.comm.reduce_scatter(&send, &mut out, ReduceOp::Sum),
        "send has 10 elements",
    );
    expect(
        r.comm.broadcast(&mut out, n),
        &format!("root {n} is out of range"),
    );
    expect(
        r.comm.send(&send, n + 5),
        &format!("peer {} is out of range", n + 5),
    );
    expect(
        r.comm.all_reduce(&send, &mut out, ReduceOp::Sum),
        "recv has",
    );
    expect(
        r.comm.all_reduce_in_place(&mut out, ReduceOp::BitXor),
        "NCCL has no reduce op bxor",
    );
    expect(
        r.comm.reduce(&send, None, ReduceOp::Sum, r.comm.rank()),
        "the root must pass a receive buffer",
    );
    if dist_nccl::cuda_device_count() > 1 {
        // A buffer on another GPU.
        let other =
            CudaContext::new((r.comm.device() + 1) % dist_nccl::cuda_device_count()).unwrap();
        let foreign = other.default_stream().clone_htod(&[1.0f32; 10]).unwrap();
        let mut mine = up(s, &[0.0f32; 10]);
        expect(
            r.comm.all_reduce(&foreign, &mut mine, ReduceOp::Sum),
            "send is on cuda:",
        );
        expect(
            r.comm
                .on(&other.default_stream())
                .all_reduce_in_place(&mut mine, ReduceOp::Sum),
            "the stream is on cuda:",
        );
    }
    // Another CudaContext object of the same device: cudarc orders a buffer's uses only through
    // its own context's events, so such buffers and streams are refused (accepted before).
    let twin = CudaContext::new(r.comm.device()).unwrap();
    let foreign = twin.default_stream().clone_htod(&[1.0f32; 10]).unwrap();
    let mut mine = up(s, &[0.0f32; 10]);
    expect(
        r.comm.all_reduce(&foreign, &mut mine, ReduceOp::Sum),
        "send belongs to another CudaContext",
    );
    expect(
        r.comm
            .on(&twin.default_stream())
            .all_reduce_in_place(&mut mine, ReduceOp::Sum),
        "the stream belongs to another CudaContext",
    );
    // A call made inside a group but not through it would be recorded into the group without
    // its buffers being kept alive: refused.
    expect(
        r.comm
            .group(|_g| r.comm.all_reduce_in_place(&mut mine, ReduceOp::Sum)),
        "a group is open on this thread",
    );
    expect(
        r.comm.group(|_g| r.comm.group(|_| Ok(()))),
        "a group is already open on this thread",
    );
    // An init inside an open group would be recorded into it (and the connecting transfers
    // could outlive their buffer): refused before NCCL is called. The id is never used.
    let unused = UniqueId::from_bytes(&[0u8; 128]).unwrap();
    expect(
        r.comm.group(|_g| {
            Communicator::init_rank(
                r.comm.nccl().clone(),
                r.comm.context(),
                0,
                1,
                &unused,
                CommConfig::default(),
            )
            .map(drop)
        }),
        "not inside a group",
    );
    expect(
        r.comm.group(|_g| {
            Communicator::init_all(
                r.comm.nccl().clone(),
                &[r.comm.device()],
                CommConfig::default(),
            )
            .map(drop)
        }),
        "not inside a group",
    );
    assert_eq!(
        bits(&down(&r.comm, &out)),
        bits(&before),
        "a refused call touched memory"
    );
    // The communicator is still healthy.
    let mut y = up(s, &[2u8; 3]);
    r.comm.all_reduce_in_place(&mut y, ReduceOp::Sum).unwrap();
    assert_eq!(down(&r.comm, &y), vec![2 * n as u8; 3]);
    if let Some(e) = r.comm.async_error() {
        panic!("refused calls left an asynchronous error: {e}");
    }
    r.tcp.barrier().unwrap();
    Ok(())
}

/// The last rank exits (`process::exit`: no signal, nothing dropped) between two collectives;
/// every other rank's next collective fails naming it (`rank N failed`) before the NCCL timeout,
/// and the communicator refuses at once from then on. Through `HybridBackend`: a bare
/// `Communicator` cannot name the rank (NCCL's transports do not say which rank stopped, and
/// over NVLink nothing fails before the watchdog's timeout, whose error names no rank); the
/// hybrid's TCP mesh sees the connection close and aborts NCCL naming the rank. Before, this
/// case ran on a bare communicator and took any timeout, abort or NCCL error within the timeout
/// + 5 s.
fn peer_death() -> Result<(), String> {
    let timeout = Duration::from_secs(8);
    let h = nccl_failures::hybrid_with(None, timeout)?;
    let (me, n) = (h.rank(), h.world_size());
    let mut x = nccl_failures::dev(&h, &vec![1.0f32; 1 << 24]);
    h.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.barrier().unwrap();
    if me == n - 1 {
        println!("exiting abruptly before the next all_reduce");
        std::process::exit(0);
    }
    let t = Instant::now();
    let e = (0..100)
        .find_map(|_| {
            h.all_reduce(&mut x, ReduceOp::Sum)
                .and_then(|()| h.synchronize_nccl())
                .err()
        })
        .expect("collectives with a dead peer kept succeeding");
    let waited = t.elapsed();
    let text = e.to_string();
    println!("rank {me}: after {waited:.1?}: {text}");
    assert!(
        text.contains(&format!("rank {} failed", n - 1)),
        "rank {me}: the error does not name the dead rank {}: {text}",
        n - 1
    );
    assert!(
        waited < timeout,
        "rank {me}: took {waited:?}, not before the NCCL timeout of {timeout:?}"
    );
    // And the communicator refuses from now on, at once.
    let t = Instant::now();
    assert!(h.all_reduce(&mut x, ReduceOp::Sum).is_err());
    assert!(t.elapsed() < Duration::from_secs(1));
    Ok(())
}

/// HybridBackend from the launcher's environment: the unique id travels over TCP, the GPU is
/// the local rank's, TCP messages and a barrier go through while NCCL collectives run, and one
/// call reduces host and device buffers alike.
fn hybrid() -> Result<(), String> {
    let devices = dist_nccl::cuda_device_count();
    let cfg = dist_multirank::config();
    let local = cfg.local_rank().unwrap_or(cfg.rank());
    if devices == 0 {
        return Err("skipped: no CUDA device".into());
    }
    if cfg.world_size() > devices {
        return Err(format!(
            "skipped: {} ranks but {devices} CUDA devices",
            cfg.world_size()
        ));
    }
    drop(cfg);
    let h = dist_hybrid::HybridBackend::from_env().unwrap_or_else(|e| panic!("{e}"));
    let (me, n) = (h.rank(), h.world_size());
    let comm = h.nccl().expect("a GPU per rank, so NCCL was formed");
    assert_eq!(comm.device(), local, "the GPU is the local rank's");
    assert_eq!((comm.rank(), comm.size()), (me, n));
    let s = comm.stream().clone();
    let mut x = up(&s, &vec![1.0f32; 1 << 24]);
    for _ in 0..10 {
        h.all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    // While those run on the GPUs: a ring of TCP messages and a barrier.
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    for round in 0..50u32 {
        h.send_tagged(&round.to_le_bytes(), right, dist_core::Tag::user(3))
            .unwrap();
        let mut b = [0u8; 4];
        h.recv_tagged(&mut b, left, dist_core::Tag::user(3))
            .unwrap();
        assert_eq!(u32::from_le_bytes(b), round);
    }
    h.barrier().unwrap();
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let want = (n as f32).powi(10);
    assert!(
        s.clone_dtoh(&x).unwrap().iter().all(|v| *v == want),
        "device all_reduce"
    );
    let mut host = vec![me as f32 + 1.0; 1000];
    h.all_reduce(&mut host[..], ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    let want: f32 = (1..=n).map(|r| r as f32).sum();
    assert!(host.iter().all(|v| *v == want), "host all_reduce");
    println!(
        "hybrid: NCCL on cuda:{local}, TCP messages during NCCL work, host and device reductions verified"
    );
    Ok(())
}

/// 1.0 × n in (f8e4m3, f8e5m2) bits, for the sums the fp8 test checks (exact for n <= 4).
fn fp8_sum(n: usize) -> (u8, u8) {
    match n {
        1 => (0x38, 0x3C),
        2 => (0x40, 0x40),
        3 => (0x44, 0x42),
        4 => (0x48, 0x44),
        _ => panic!("no exact fp8 sum table for {n} ranks"),
    }
}

/// fp8 all_reduces fused in one group: on every rank over its own communicator (each rank checks
/// its result; before, ranks other than 0 returned "ok" having checked nothing), and on rank 0
/// also one process driving every GPU (`init_all`), one group over all those communicators.
fn init_all_fp8() -> Result<(), String> {
    let devices = dist_nccl::cuda_device_count();
    if devices < 2 {
        return Err(format!(
            "skipped: init_all needs 2 CUDA devices, found {devices}"
        ));
    }
    let r = rig(Duration::from_secs(60))?;
    let one = fp8_sum(1);
    let check = |c: &Communicator, x: &CudaSlice<F8E4M3>, y: &CudaSlice<F8E5M2>, n: usize| {
        let (e4, e5) = fp8_sum(n);
        let (gx, gy) = (down(c, x), down(c, y));
        assert!(
            gx.iter().all(|v| v.0 == e4),
            "f8e4m3 sum of {n} on cuda:{}: {:?}",
            c.device(),
            &gx[..4]
        );
        assert!(
            gy.iter().all(|v| v.0 == e5),
            "f8e5m2 sum of {n} on cuda:{}: {:?}",
            c.device(),
            &gy[..4]
        );
    };
    let s = r.comm.stream();
    let mut x = up(s, &vec![F8E4M3(one.0); 4096]);
    let mut y = up(s, &vec![F8E5M2(one.1); 4096]);
    r.comm
        .group(|g| {
            g.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            g.all_reduce_in_place(&mut y, ReduceOp::Sum)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    check(&r.comm, &x, &y, r.comm.size());
    println!("rank {}: fused fp8 all_reduce verified", r.comm.rank());
    r.tcp.barrier().unwrap();
    if r.comm.rank() == 0 {
        let nccl = r.comm.nccl().clone();
        let all: Vec<usize> = (0..devices).collect();
        let comms = Communicator::init_all(nccl, &all, CommConfig::default())
            .unwrap_or_else(|e| panic!("{e}"));
        let n = comms.len();
        let mut a: Vec<CudaSlice<F8E4M3>> = comms
            .iter()
            .map(|c| up(c.stream(), &vec![F8E4M3(one.0); 4096]))
            .collect();
        let mut b: Vec<CudaSlice<F8E5M2>> = comms
            .iter()
            .map(|c| up(c.stream(), &vec![F8E5M2(one.1); 4096]))
            .collect();
        let refs: Vec<&Communicator> = comms.iter().collect();
        dist_nccl::group(&refs, |g| {
            for (c, (x, y)) in comms.iter().zip(a.iter_mut().zip(b.iter_mut())) {
                let o = g.with(c)?;
                o.all_reduce_in_place(x, ReduceOp::Sum)?;
                o.all_reduce_in_place(y, ReduceOp::Sum)?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        for (c, (x, y)) in comms.iter().zip(a.iter().zip(&b)) {
            check(c, x, y, n);
        }
        println!("init_all over {n} GPUs: one group over {n} communicators, fp8 sums verified");
    }
    r.tcp.barrier().unwrap();
    Ok(())
}

/// Eight threads share one communicator, 50 all_reduces each, every result checked. NCCL forbids
/// concurrent calls on one communicator; before, dist made them outside its lock (racing inside
/// NCCL's enqueue); now each runs under the communicator's lock. Every rank's inputs are equal
/// and every call has the same size, so however the threads' calls interleave (differently on
/// each rank), each sum is exact.
fn threads() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let want = (n * (n + 1) / 2) as f32;
    let comm = &r.comm;
    let t0 = Instant::now();
    std::thread::scope(|sc| {
        for t in 0..8 {
            sc.spawn(move || {
                comm.context().bind_to_thread().unwrap();
                let s = comm.stream();
                for i in 0..50 {
                    let mut x = up(s, &vec![me as f32 + 1.0; 4099]);
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum)
                        .unwrap_or_else(|e| panic!("thread {t} call {i}: {e}"));
                    let got = down(comm, &x);
                    assert!(
                        got.iter().all(|v| *v == want),
                        "thread {t} call {i}: {:?}, want {want}",
                        &got[..4]
                    );
                }
            });
        }
    });
    println!(
        "8 threads x 50 all_reduces on one communicator, every result verified, in {:.1?}",
        t0.elapsed()
    );
    r.tcp.barrier().unwrap();
    Ok(())
}

/// Groups end on every path: a closure that fails after recording a send and a receive still
/// launches them (the ring's data arrives), a panicking one too (its guard ends the group while
/// unwinding), and the thread is out of the group afterwards (a plain call works).
fn group_paths() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let s = r.comm.stream();
    let a = up(s, &vec![me as u32; 1024]);
    let mut b = up(s, &vec![u32::MAX; 1024]);
    let e = r
        .comm
        .group(|g| {
            g.send(&a, right)?;
            g.recv(&mut b, left)?;
            g.send(&a, n + 7)
        })
        .expect_err("a bad peer inside the group");
    assert!(
        e.to_string()
            .contains(&format!("peer {} is out of range", n + 7)),
        "{e}"
    );
    assert!(
        down(&r.comm, &b).iter().all(|v| *v == left as u32),
        "after a failed group"
    );
    let mut c = up(s, &vec![u32::MAX; 1024]);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        r.comm.group(|g| -> dist_nccl::Result<()> {
            g.send(&a, right)?;
            g.recv(&mut c, left)?;
            panic!("inside the group");
        })
    }));
    assert!(caught.is_err(), "the closure panicked");
    assert!(
        down(&r.comm, &c).iter().all(|v| *v == left as u32),
        "after a panicking group"
    );
    let mut y = up(s, &[1i32; 5]);
    r.comm
        .all_reduce_in_place(&mut y, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&r.comm, &y), vec![n as i32; 5]);
    println!("groups ended and launched after an error and after a panic");
    r.tcp.barrier().unwrap();
    Ok(())
}

/// Every case; `gpu` declares what each needs.
const CASES: &[Case] = &[
    gpu("nccl_collectives", nccl_coll::collectives),
    gpu("nccl_collectives_socket", nccl_coll::collectives_socket),
    gpu("nccl_split", nccl_coll::split).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_misuse", misuse),
    gpu("nccl_peer_death", peer_death).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid", hybrid).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_init_all_fp8", init_all_fp8),
    gpu("nccl_threads", threads).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_group_paths", group_paths).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_drop_bounded", nccl_bounded::drop_bounded).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_split_absent", nccl_bounded::split_absent).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_connect_absent", nccl_bounded::connect_absent).variants(&[nccl_socket::SOCKET]),
    gpu("nccl_two_stalled", nccl_bounded::two_stalled).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_mismatch_count", nccl_failures::mismatch_count).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_mismatch_dtype", nccl_failures::mismatch_dtype),
    gpu("hybrid_mismatch_op", nccl_failures::mismatch_op),
    gpu("hybrid_mismatch_root", nccl_failures::mismatch_root),
    gpu("hybrid_sigkill", nccl_failures::sigkill).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_sigstop", nccl_failures::sigstop).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_timeout_positions", nccl_failures::timeout_positions)
        .variants(&[nccl_socket::SOCKET]),
    gpu("nccl_uneven_grouped", nccl_coll::uneven_grouped).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_device_collectives", nccl_hybrid_coll::collectives)
        .variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_uneven_mismatch", nccl_hybrid_coll::uneven_mismatch),
    gpu("hybrid_gpu_work", nccl_hybrid_coll::work).variants(&[nccl_socket::SOCKET]),
    gpu("hybrid_gpu_work_timeout", nccl_hybrid_coll::work_timeout),
    gpu("hybrid_groups_gpu", nccl_hybrid_groups::groups).variants(&[nccl_socket::SOCKET]),
];

/// A GPU case: at 2 ranks unless asked for more, needing a CUDA device per rank (skipped, saying
/// so, without).
const fn gpu(name: &'static str, run: fn() -> Result<(), String>) -> Case {
    Case::new(name, run).sizes(&[2]).gpu_per_rank()
}

fn main() -> ExitCode {
    dist_multirank::run_cases("dist-nccl-tests", CASES)
}

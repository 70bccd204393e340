//! Failures found and named on GPUs, through `HybridBackend`: mismatched NCCL calls (count, type,
//! op, root) and a killed or stopped rank are errors on every rank within their bounds, naming the
//! ranks and the calls. (The cost of the call check is measured by `dist-nccl-perf` with
//! `DIST_PERF_HYBRID_CHECK=1`, not here.)

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use dist_core::{Backend, ReduceOp};
use dist_hybrid::{GpuChoice, HybridBackend};
use dist_nccl::CommConfig;
use half::f16;

/// The NCCL timeout of these cases: far above every bound they check, so that no error here
/// comes from a timeout.
const NCCL_TIMEOUT: Duration = Duration::from_secs(30);

fn hybrid() -> Result<HybridBackend, String> {
    hybrid_tracing_to(None)
}

/// [`hybrid`], writing flight records to `trace` on a failure (as `DIST_TRACE_DIR` does).
fn hybrid_tracing_to(trace: Option<&std::path::Path>) -> Result<HybridBackend, String> {
    hybrid_with(trace, NCCL_TIMEOUT)
}

/// [`hybrid_tracing_to`] with an NCCL timeout of `timeout`.
pub(crate) fn hybrid_with(
    trace: Option<&std::path::Path>,
    timeout: Duration,
) -> Result<HybridBackend, String> {
    let devices = dist_nccl::cuda_device_count();
    let world: usize = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    if devices == 0 {
        return Err("skipped: no CUDA device".into());
    }
    if world > devices {
        return Err(format!("skipped: {world} ranks but {devices} CUDA devices"));
    }
    let cfg = CommConfig {
        timeout,
        name: Some("t2".into()),
        ..CommConfig::default()
    };
    let mut tcp_cfg = dist_tcp::TcpConfig::from_env().map_err(|e| e.to_string())?;
    if let Some(dir) = trace {
        tcp_cfg = tcp_cfg.trace_dir(dir);
    }
    let local = tcp_cfg.local_rank().unwrap_or(tcp_cfg.rank());
    let tcp = dist_tcp::TcpBackend::with_config(tcp_cfg).map_err(|e| e.to_string())?;
    HybridBackend::with_nccl(tcp, local, GpuChoice::Auto, None, cfg)
        .map_err(|e| e.to_string())
        .inspect(|h| assert!(h.nccl().is_some(), "a GPU per rank, so NCCL was formed"))
}

pub(crate) fn dev<T: dist_nccl::NcclType>(h: &HybridBackend, x: &[T]) -> CudaSlice<T> {
    let s = h.nccl().unwrap().stream();
    s.clone_htod(x).unwrap_or_else(|e| panic!("{e}"))
}

/// Synchronizes, then makes matching calls, until the first error; `None` if none comes
/// within `give_up` (the silent wrong results found before the call check).
fn first_error(
    h: &HybridBackend,
    x: &mut CudaSlice<f32>,
    since: Instant,
    give_up: Duration,
) -> Option<(String, Duration)> {
    loop {
        let r = h
            .synchronize_nccl()
            .and_then(|()| h.all_reduce(x, ReduceOp::Sum));
        if let Err(e) = r {
            return Some((e.to_string(), since.elapsed()));
        }
        if since.elapsed() > give_up {
            return None;
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Count,
    Dtype,
    Op,
    Root,
}

/// Rank 1 makes call #2 differ from rank 0's in one way; every rank's error comes within 1 s
/// and names both ranks and both calls. Without the check (main before this branch) the count
/// case ran silently: no error at all.
fn mismatch(kind: Kind) -> Result<(), String> {
    // Each rank's own folder for its NCCL flight record, written on the first failure.
    let trace = std::env::temp_dir().join(format!("dist-t2-trace-{}", std::process::id()));
    let h = hybrid_tracing_to(Some(&trace))?;
    let (me, n) = (h.rank(), h.world_size());
    let odd = me == n - 1;
    let mut x = dev(&h, &[1.0f32; 1024]);
    h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.barrier().unwrap();
    let t = Instant::now();
    let (mine, theirs) = match kind {
        Kind::Count => {
            let mut y = dev(&h, &vec![1.0f32; if odd { 2048 } else { 1024 }]);
            h.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            ("all_reduce f32 x 2048 sum", "all_reduce f32 x 1024 sum")
        }
        Kind::Dtype => {
            if odd {
                let mut y = dev(&h, &[f16::ONE; 1024]);
                h.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            } else {
                h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            }
            ("all_reduce f16 x 1024 sum", "all_reduce f32 x 1024 sum")
        }
        Kind::Op => {
            let op = if odd { ReduceOp::Max } else { ReduceOp::Sum };
            h.all_reduce(&mut x, op).unwrap();
            ("all_reduce f32 x 1024 max", "all_reduce f32 x 1024 sum")
        }
        Kind::Root => {
            h.broadcast(&mut x, if odd { 1 } else { 0 }).unwrap();
            ("broadcast f32 x 1024 root 1", "broadcast f32 x 1024 root 0")
        }
    };
    let (e, waited) = first_error(&h, &mut x, t, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("rank {me}: no error 10 s after the mismatch: silent"));
    println!("rank {me}: {kind:?} mismatch: error after {waited:.1?}: {e}");
    for want in [
        "mismatch",
        "#2 ",
        mine,
        theirs,
        "rank 0",
        &format!("rank {}", n - 1),
    ] {
        assert!(e.contains(want), "rank {me}: {want:?} not in: {e}");
    }
    assert!(
        waited < Duration::from_secs(1),
        "rank {me}: {waited:?} to the error"
    );
    // The record of the NCCL calls, written on the failure: the mismatched call is in it.
    let file = trace.join("nccl").join(format!("rank-{me}.json"));
    let json = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("rank {me}: no flight record at {}: {e}", file.display()));
    assert!(json.contains("\"seq\":2"), "rank {me}: {json}");
    let _ = std::fs::remove_dir_all(&trace);
    // The TCP side still works, and the error stays.
    h.barrier().unwrap();
    assert!(h.all_reduce(&mut x, ReduceOp::Sum).is_err());
    Ok(())
}

pub fn mismatch_count() -> Result<(), String> {
    mismatch(Kind::Count)
}
pub fn mismatch_dtype() -> Result<(), String> {
    mismatch(Kind::Dtype)
}
pub fn mismatch_op() -> Result<(), String> {
    mismatch(Kind::Op)
}
pub fn mismatch_root() -> Result<(), String> {
    mismatch(Kind::Root)
}

/// The environment variable that marks the victim's child (the process that really is the
/// rank); its parent only waits for it, so that the launcher sees a clean exit.
const CHILD: &str = "DIST_T2_VICTIM_CHILD";

/// The last rank runs as a child of its launched process; rank 0 learns its pid over TCP and
/// sends it `sig` in the middle of a loop of 64 MiB all_reduces; every survivor's error must
/// come within `bound` of the signal and name the rank.
fn victim(sig: i32, bound: impl Fn() -> Duration) -> Result<(), String> {
    let world: usize = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if rank == world - 1 && std::env::var_os(CHILD).is_none() {
        if dist_nccl::cuda_device_count() < world {
            return Err("skipped: fewer CUDA devices than ranks".into());
        }
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env(CHILD, "1")
            .spawn()
            .unwrap_or_else(|e| panic!("spawn the victim: {e}"));
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("the victim was not killed within 120 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "the victim ended otherwise: {status}"
        );
        println!("rank {rank}: the victim process was killed as planned");
        return Ok(());
    }
    let h = hybrid()?;
    let (me, n) = (h.rank(), h.world_size());
    let mut x = dev(&h, &vec![1.0f32; 1 << 24]);
    if me == n - 1 {
        h.send(&std::process::id().to_le_bytes(), 0).unwrap();
        loop {
            if h.all_reduce(&mut x, ReduceOp::Sum)
                .and_then(|()| h.synchronize_nccl())
                .is_err()
            {
                // A survivor's own failure: rank 0 still signals this process.
                std::thread::park_timeout(Duration::from_secs(60));
            }
        }
    }
    let mut pid = [0u8; 4];
    if me == 0 {
        h.recv(&mut pid, n - 1).unwrap();
    }
    for _ in 0..5 {
        h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    }
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let t = Instant::now();
    if me == 0 {
        let pid = i32::from_le_bytes(pid);
        // SAFETY: kill(2) takes two integers and touches no memory of this process; the pid is
        // the victim's, a child of rank n-1's launched process that is alive until signalled.
        let r = unsafe { libc::kill(pid, sig) };
        assert_eq!(
            r,
            0,
            "kill({pid}, {sig}): {}",
            std::io::Error::last_os_error()
        );
    }
    let got = first_error(&h, &mut x, t, bound() + Duration::from_secs(5));
    if me == 0 && sig == libc::SIGSTOP {
        // SAFETY: as above; the stopped victim is killed now (error or not) so that its
        // parent returns.
        unsafe { libc::kill(i32::from_le_bytes(pid), libc::SIGKILL) };
    }
    let (e, waited) = got.unwrap_or_else(|| panic!("rank {me}: no error after signal {sig}"));
    println!(
        "rank {me}: signal {sig} to rank {}: error after {waited:.1?}: {e}",
        n - 1
    );
    assert!(e.contains(&format!("rank {}", n - 1)), "rank {me}: {e}");
    assert!(e.contains("NCCL op in flight"), "rank {me}: {e}");
    assert!(waited < bound(), "rank {me}: {waited:?} to the error");
    Ok(())
}

/// SIGKILL mid all_reduce: every survivor's error within 2 s (before this branch: the NCCL
/// deadline, 20.8 s with a 20 s timeout, not naming the rank).
pub fn sigkill() -> Result<(), String> {
    victim(libc::SIGKILL, || Duration::from_secs(2))
}

/// SIGSTOP mid all_reduce: every survivor's error within the peer timeout + 2 s (TCP's
/// heartbeats stop, the mesh's fault hook aborts NCCL).
pub fn sigstop() -> Result<(), String> {
    victim(libc::SIGSTOP, || {
        let peer = std::env::var("DIST_PEER_TIMEOUT")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(10.0);
        Duration::from_secs_f64(peer) + Duration::from_secs(2)
    })
}

/// A rank that stops calling NCCL (it waits on TCP instead) while the others make their
/// fourth all_reduce: no rank fails and no call mismatches, so the others' NCCL calls time out
/// (the NCCL timeout here is 3 s); their errors say where every rank's NCCL calls are, asked
/// of the peers over the TCP mesh: the stopped rank "finished #3 all_reduce", the others are in
/// #4. Fails on the code before `HybridError::NcclTimeout` (the error named no other rank).
pub fn timeout_positions() -> Result<(), String> {
    const TIMEOUT: Duration = Duration::from_secs(3);
    let h = hybrid_with(None, TIMEOUT)?;
    let (me, n) = (h.rank(), h.world_size());
    let idle = n - 1;
    let mut x = dev(&h, &[1.0f32; 1024]);
    for _ in 0..3 {
        h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    }
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.barrier().unwrap();
    if me == idle {
        // Wait for rank 0 to have its error, on TCP only.
        let mut done = [0u8; 1];
        h.tcp()
            .recv_timeout(&mut done, 0, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        println!("rank {me}: made no fourth NCCL call");
        return Ok(());
    }
    let t = Instant::now();
    h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let e = h
        .synchronize_nccl()
        .expect_err("the fourth all_reduce cannot complete without the idle rank");
    let took = t.elapsed();
    let text = e.to_string();
    println!("rank {me}: error after {took:.2?}: {text}");
    let want = format!("rank {idle} finished #3 all_reduce");
    if !matches!(e, dist_hybrid::HybridError::NcclTimeout { .. }) || !text.contains(&want) {
        return Err(format!(
            "rank {me}: expected an NCCL timeout saying \"{want}\", got: {text}"
        ));
    }
    if !text.contains("#4 all_reduce") {
        return Err(format!(
            "rank {me}: the error does not say where the others are: {text}"
        ));
    }
    if took > TIMEOUT + Duration::from_secs(3) {
        return Err(format!(
            "rank {me}: the error took {took:.2?} (timeout {TIMEOUT:?})"
        ));
    }
    if me == 0 {
        h.tcp().send(&[1], idle).unwrap_or_else(|e| panic!("{e}"));
    }
    Ok(())
}

//! Failures found in seconds and named: one of 4 ranks killed (SIGKILL) or stopped
//! (SIGSTOP) in the middle of a loop of collectives, and a barrier against an all_reduce.
//!
//! The rank that dies cannot be a process the launcher started (a rank killed by a signal is a
//! failed case): rank 3 starts a copy of this program that joins the job as rank 3 in its place,
//! and passes once that copy has died of SIGKILL. The copy sends its pid to rank 0, which
//! signals it; after a SIGSTOP, rank 0 SIGKILLs it once the survivors have their errors.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp, Tag};
use dist_tcp::TcpBackend;

use dist_multirank::config;

/// The peer timeout these cases run with.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Set in the environment of the copy that plays the victim.
const VICTIM: &str = "DIST_TEST_VICTIM";
const VICTIM_RANK: usize = 3;
/// The collectives run before the victim is signalled.
const BEFORE: u64 = 100;
const PID_TAG: Tag = Tag::user(90);

fn join() -> TcpBackend {
    TcpBackend::with_config(
        config()
            .timeout(Duration::from_secs(30))
            .peer_timeout(PEER_TIMEOUT),
    )
    .unwrap_or_else(|e| panic!("init failed: {e}"))
}

/// SIGKILL of rank 3 mid-loop: every survivor errors, naming rank 3, well under 2 s after its
/// last good all_reduce.
pub fn sigkill() -> Result<(), String> {
    victim_loop("KILL", Duration::from_millis(1500))
}

/// SIGSTOP of rank 3 mid-loop: every survivor errors, naming rank 3 as unresponsive, within the
/// peer timeout + 2 s of its last good all_reduce.
pub fn sigstop() -> Result<(), String> {
    victim_loop("STOP", PEER_TIMEOUT + Duration::from_secs(2))
}

/// Rank 3 signalled with `signal` after [`BEFORE`] all_reduces of a loop: every survivor
/// errors, naming rank 3, within `bound` of its last good all_reduce.
pub fn victim_loop(signal: &str, bound: Duration) -> Result<(), String> {
    victim_loop_of(signal, bound, 1024)
}

/// [`victim_loop`] with all_reduces of `count` floats.
pub fn victim_loop_of(signal: &str, bound: Duration, count: usize) -> Result<(), String> {
    let n: usize = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if n != 4 {
        return Err(format!("skipped: needs 4 ranks, not {n}"));
    }
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    if rank == VICTIM_RANK && std::env::var_os(VICTIM).is_none() {
        // Stand aside for a copy that joins as this rank and is killed.
        let status = Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env(VICTIM, "1")
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(9), "the victim ended with {status}");
        println!("victim (rank {rank}) ended by SIGKILL, as planned");
        return Ok(());
    }
    let b = join();
    let me = b.rank();
    if me == VICTIM_RANK {
        b.send_tagged(&std::process::id().to_le_bytes(), 0, PID_TAG)
            .unwrap();
    }
    let victim_pid = (me == 0).then(|| {
        let mut pid = [0u8; 4];
        b.recv_tagged(&mut pid, VICTIM_RANK, PID_TAG).unwrap();
        u32::from_le_bytes(pid)
    });
    b.barrier().unwrap();
    let mut x = vec![1.0f32; count];
    let start = Instant::now();
    let mut last_ok = Instant::now();
    let mut k = 0u64;
    let e = loop {
        if let Some(pid) = victim_pid
            && k == BEFORE
        {
            signal_pid(signal, pid);
        }
        match b.all_reduce(&mut x, ReduceOp::Max) {
            Ok(()) => {
                last_ok = Instant::now();
                k += 1;
            }
            Err(e) => break e,
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no error after {k} all_reduces"
        );
    };
    let took = last_ok.elapsed();
    assert!(me != VICTIM_RANK, "the victim returned: {e}");
    println!("rank {me}: after {k} all_reduces, error {took:.2?} after the last good one: {e}");
    if let Some(pid) = victim_pid
        && signal == "STOP"
    {
        signal_pid("KILL", pid);
    }
    assert!(k >= BEFORE, "failed before the victim was signalled: {e}");
    assert_eq!(
        e.peer(),
        Some(VICTIM_RANK),
        "the error names another rank: {e}"
    );
    if signal == "STOP" {
        assert!(e.to_string().contains("unresponsive"), "{e}");
    }
    assert!(took < bound, "error after {took:?}, bound {bound:?}: {e}");
    Ok(())
}

fn signal_pid(signal: &str, pid: u32) {
    let st = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{signal} {pid}: {st}");
}

/// The last rank calls barrier while the others call all_reduce: every rank errors at once
/// (well under 2 s, with a 30 s timeout), its error naming the barrier and the all_reduce.
pub fn barrier_vs_all_reduce() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    if n < 2 {
        return;
    }
    let t = Instant::now();
    let e = match b.barrier() {
        // A rank still on its way out of this first barrier may hear of the mismatch first
        // (the last rank leaves it early and meets the others' all_reduce).
        Err(e) => e,
        Ok(()) if me == n - 1 => b.barrier().unwrap_err(),
        Ok(()) => b.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum).unwrap_err(),
    };
    let took = t.elapsed();
    println!("rank {me}: after {took:.2?}: {e}");
    assert!(
        matches!(
            e,
            DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
        ),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("barrier") && text.contains("all_reduce"),
        "{text}"
    );
    assert!(took < Duration::from_secs(2), "{took:?}: {e}");
}

/// A collective skipped by the last rank: the others' error (a 2 s per-call timeout) says which
/// rank had not reached which sequence number ("rank 2 finished #4 all_reduce; ranks 0–1 wait
/// in #5 all_reduce"), from the positions the heartbeats carried; and every rank writes its
/// flight record to the trace folder, where the skipping rank's ends at #4.
pub fn skipped_collective() {
    let port = std::env::var("MASTER_PORT").unwrap_or_default();
    let n_env = std::env::var("WORLD_SIZE").unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("dist-trace-{port}-n{n_env}"));
    let b = TcpBackend::with_config(
        config()
            .timeout(Duration::from_secs(30))
            .peer_timeout(PEER_TIMEOUT)
            .trace_dir(&dir),
    )
    .unwrap_or_else(|e| panic!("init failed: {e}"));
    let (me, n) = (b.rank(), b.world_size());
    let (done, written) = (Tag::user(91), Tag::user(92));
    b.barrier().unwrap();
    let mut x = [1.0f32; 8];
    for _ in 0..3 {
        b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    }
    let skipper = n - 1;
    if me == skipper {
        // Skips #5; waits until rank 0 has its error (by then it has heard of the abort and
        // written its record, on the liveness thread: rank 0 waits for the file below).
        b.recv_tagged_timeout(&mut [0u8; 1], 0, done, Duration::from_secs(20))
            .unwrap();
    } else {
        use dist_core::Within;
        let t = Instant::now();
        let e = b
            .within(Duration::from_secs(2))
            .all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_err();
        println!("rank {me}: after {:.2?}: {e}", t.elapsed());
        let want = format!("rank {skipper} finished #4 all_reduce");
        assert!(e.to_string().contains(&want), "no '{want}' in: {e}");
    }
    if me != 0 {
        b.send_tagged(&[1], 0, written).unwrap();
        return;
    }
    // Every rank that called #5 has its error; only then may the skipping rank go on (and
    // leave, closing its connections).
    for r in 1..skipper {
        b.recv_tagged_timeout(&mut [0u8; 1], r, written, Duration::from_secs(20))
            .unwrap();
    }
    b.send_tagged(&[1], skipper, done).unwrap();
    b.recv_tagged_timeout(&mut [0u8; 1], skipper, written, Duration::from_secs(20))
        .unwrap();
    for r in 0..n {
        let path = dir.join(format!("rank-{r}.json"));
        // The skipping rank writes its record on its liveness thread, when the abort notice
        // arrives; wait for it (bounded), as for any file another process writes.
        let until = Instant::now() + Duration::from_secs(10);
        let json = loop {
            match std::fs::read_to_string(&path) {
                Ok(j) if j.ends_with("]}\n") => break j,
                r if Instant::now() > until => panic!("{}: {r:?}", path.display()),
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let reached_5 = json.contains("\"seq\":5,\"op\":\"all_reduce\"");
        assert_eq!(reached_5, r != skipper, "rank {r}'s record: {json}");
    }
    println!(
        "flight records in {} (cargo xtask trace {0})",
        dir.display()
    );
    if std::env::var_os("DIST_KEEP_TRACE").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

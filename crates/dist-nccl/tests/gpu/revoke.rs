//! `Communicator::revoke` on one rank: a wait pending behind a slow kernel ends at once with
//! the revoke's reason, and every later call is refused with it; with an NCCL older than
//! `ncclCommRevoke` (a library limited to 2.27) the revoke aborts instead, with the same
//! errors, and the communicator can still be shrunk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::ReduceOp;
use dist_nccl::{CommConfig, Communicator, Nccl, NcclError};
use dist_nccl_sys::version_code;

use crate::calls::K;
use crate::shrink::sum_of_ones;
use crate::{Rig, nccl, rig_with};

/// How long the kernel ahead of the pending wait spins: far longer than a revoke may take to
/// end the wait.
const SPIN_NS: u64 = 4_000_000_000;
/// The most a wait or a refused call may take once the revoke is asked for.
const PROMPT: Duration = Duration::from_millis(500);

fn expect(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

/// `e` is `Aborted` and its reason carries `needle`.
pub fn refused_with(e: &Result<(), NcclError>, needle: &str) -> bool {
    matches!(e, Err(NcclError::Aborted { reason, .. }) if reason.contains(needle))
}

/// A slow kernel, then an all_reduce behind it, on the communicator's stream; a thread waits
/// for them (`synchronize`) while this one revokes. The wait ends within [`PROMPT`] of the
/// revoke, long before the kernel does, with the revoke's reason; so does every later call
/// and the abort handle's report. Returns how long `revoke` itself took.
fn revoke_while_waiting(r: &Rig, reason: &str) -> Result<Duration, String> {
    let s = r.comm.stream().clone();
    let a = s.clone_htod(&[1.0f32; K]).map_err(|e| format!("a: {e}"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(|e| format!("b: {e}"))?;
    let mut slow = s.alloc_zeros::<f32>(1).map_err(|e| format!("slow: {e}"))?;
    r.k.spin_fill(&s, &mut slow, 0.0, SPIN_NS);
    r.comm
        .all_reduce(&a, &mut b, ReduceOp::Sum)
        .map_err(|e| format!("all_reduce behind the kernel: {e}"))?;
    let (waited, ended, took) = std::thread::scope(|sc| -> Result<_, String> {
        let comm = &r.comm;
        let waiter = sc.spawn(move || {
            let w = comm.synchronize();
            (w, Instant::now())
        });
        // Long enough for the waiter to be waiting; checked below.
        std::thread::sleep(Duration::from_millis(200));
        expect(!waiter.is_finished(), || {
            "the wait ended before the revoke (the kernel spins 4 s)".into()
        })?;
        let t0 = Instant::now();
        r.comm.revoke(reason);
        let took = t0.elapsed();
        let (w, at) = waiter
            .join()
            .map_err(|_| "the waiter panicked".to_string())?;
        Ok((w, at.saturating_duration_since(t0), took))
    })?;
    expect(refused_with(&waited, reason), || {
        format!("the pending wait: want Aborted naming {reason:?}, got {waited:?}")
    })?;
    expect(ended < PROMPT, || {
        format!("the pending wait ended {ended:?} after the revoke (the kernel spins 4 s)")
    })?;
    let t0 = Instant::now();
    let later = r.comm.all_reduce(&a, &mut b, ReduceOp::Sum);
    let later_took = t0.elapsed();
    expect(refused_with(&later, reason), || {
        format!("a later call: want Aborted naming {reason:?}, got {later:?}")
    })?;
    expect(later_took < PROMPT, || {
        format!("the later call was refused after {later_took:?}")
    })?;
    let msg = later.unwrap_err().to_string();
    expect(
        msg.contains("all_reduce") && msg.contains("revoked: "),
        || format!("the refusal does not name the call and the revoke: {msg}"),
    )?;
    let reported = r.comm.abort_handle().aborted();
    expect(
        reported
            .as_deref()
            .is_some_and(|x| x == format!("revoked: {reason}")),
        || format!("the abort handle reports {reported:?}"),
    )?;
    Ok(took)
}

/// Revoke with the loaded NCCL (`ncclCommRevoke` from 2.28, else an abort).
pub fn ends_pending_and_later_calls() -> Result<(), String> {
    let r = rig_with(nccl(), CommConfig::default())?;
    sum_of_ones(&r.comm, "before the revoke")?;
    let took = revoke_while_waiting(&r, "epoch 3 revoked: rank 5 died")?;
    eprintln!(
        "revoke (NCCL {}) took {took:?}",
        dist_nccl_sys::version_string(nccl().version())
    );
    // A second revoke or abort changes nothing: the first reason stays.
    r.comm.revoke("again");
    r.comm.abort();
    let again = r.comm.synchronize();
    expect(refused_with(&again, "rank 5 died"), || {
        format!("after a second revoke: {again:?}")
    })?;
    // The drop frees what the revoke kept, within its bound (the kernel may still spin).
    let t0 = Instant::now();
    drop(r);
    let dropped = t0.elapsed();
    expect(dropped < Duration::from_secs(10), || {
        format!("the drop after the revoke took {dropped:?}")
    })
}

/// The loaded NCCL limited to 2.27.0, which has no `ncclCommRevoke`: the revoke aborts the
/// calls' handle instead, with the same errors, and keeps the handle for shrinks: a shrink
/// (of the same members, on one rank) forms a working communicator.
pub fn older_nccl_aborts() -> Result<(), String> {
    let lib = Nccl::load()
        .map_err(|e| e.to_string())?
        .limited_to(version_code(2, 27, 0));
    let old = Arc::new(lib);
    let refused = dist_nccl_sys::nccl_fn!(&old, ncclCommRevoke).map(|_| ());
    expect(
        matches!(&refused, Err(e) if e.to_string().contains("needs NCCL 2.28.0 or newer")),
        || format!("the limited library offers ncclCommRevoke: {refused:?}"),
    )?;
    let r = rig_with(old, CommConfig::default())?;
    sum_of_ones(&r.comm, "before the revoke")?;
    revoke_while_waiting(&r, "rank 1 is gone")?;
    let new: Communicator = r
        .comm
        .shrink(&[], CommConfig::default())
        .map_err(|e| format!("shrink after the aborting revoke: {e}"))?;
    sum_of_ones(&new, "on the communicator shrunk after the aborting revoke")
}

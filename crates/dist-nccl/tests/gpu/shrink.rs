//! `Communicator::shrink` on one rank: the lists a shrink must refuse are refused before
//! anything changes, and the communicator still computes; the shrink one rank can make
//! (excluding nobody, which forms the same members again) works on a live communicator, after
//! a revoke, and after the common failure (a timeout); an abort that freed the only handle,
//! and an NCCL older than `ncclCommShrink`, are refused saying why. A shrink that leaves a rank
//! out needs two GPUs (two ranks, threads of this process).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use dist_core::ReduceOp;
use dist_nccl::{CommConfig, Communicator, Nccl, NcclError, UniqueId};
use dist_nccl_sys::version_code;

use crate::calls::K;
use crate::revoke::refused_with;
use crate::{nccl, rig, rig_with};

fn e(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// An all_reduce of ones on `comm`'s stream, checked: a one-rank sum is the input.
pub fn sum_of_ones(comm: &Communicator, what: &str) -> Result<(), String> {
    sum_of_ones_of(comm, 1.0, what)
}

/// An all_reduce of ones on `comm`'s stream, checked against `want` (the number of ranks).
fn sum_of_ones_of(comm: &Communicator, want: f32, what: &str) -> Result<(), String> {
    let s = comm.stream().clone();
    let a = s.clone_htod(&[1.0f32; K]).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    comm.all_reduce(&a, &mut b, ReduceOp::Sum)
        .map_err(|err| format!("{what}: all_reduce: {err}"))?;
    comm.synchronize()
        .map_err(|err| format!("{what}: synchronize: {err}"))?;
    let got = s.clone_dtoh(&b).map_err(e("read"))?;
    if got.iter().any(|&x| x != want) {
        return Err(format!("{what}: want {want}, got {:?}", &got[..4]));
    }
    Ok(())
}

/// A rank out of range, one listed twice, and this rank itself: each refused
/// with the reason, and the communicator still computes afterwards.
pub fn refusals() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    let cases: [(&[usize], &str); 3] = [
        (&[1], "not in this communicator of 1"),
        (&[0], "a rank left out does not call shrink"),
        (&[3, 3], "not in this communicator"),
    ];
    for (list, needle) in cases {
        match r.comm.shrink(list, CommConfig::default()) {
            Err(NcclError::InvalidArgument { op, reason, .. })
                if op == "shrink" && reason.contains(needle) => {}
            other => return Err(format!("shrink({list:?}): want {needle:?}, got {other:?}")),
        }
    }
    sum_of_ones(&r.comm, "after the refused shrinks")
}

/// The only shrink one rank can make: excluding nobody (a split of the kept handle, since
/// NCCL's shrink refuses an empty list). The new communicator is rank 0 of 1 and computes; the
/// old one refuses every later call, naming the shrink, and a second shrink of it.
pub fn excluding_nobody() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    sum_of_ones(&r.comm, "before the shrink")?;
    let new = r
        .comm
        .shrink(&[], CommConfig::default())
        .map_err(|err| format!("shrink: {err}"))?;
    if (new.rank(), new.size()) != (0, 1) {
        return Err(format!("shrunk to rank {} of {}", new.rank(), new.size()));
    }
    sum_of_ones(&new, "on the shrunk communicator")?;
    let old = r.comm.synchronize();
    if !refused_with(&old, "shrunk") {
        return Err(format!("the old communicator after the shrink: {old:?}"));
    }
    match r.comm.shrink(&[], CommConfig::default()) {
        Err(NcclError::Aborted { reason, .. }) if reason.contains("shrunk already") => {}
        other => return Err(format!("a second shrink of the old one: {other:?}")),
    }
    // The new one can shrink in turn.
    let newer = new
        .shrink(&[], CommConfig::default())
        .map_err(|err| format!("shrink of the shrunk one: {err}"))?;
    sum_of_ones(&newer, "on the twice shrunk communicator")
}

/// Revoke, then shrink: the revoke keeps what the shrink runs on (the kept nonblocking handle;
/// with `nonblocking_calls`, the calls' handle itself, revoked rather than freed, which needs
/// NCCL 2.28). The new communicator computes; the old one still refuses with the revoke's
/// reason.
pub fn after_revoke(nonblocking_calls: bool) -> Result<(), String> {
    let cfg = CommConfig {
        nonblocking_calls,
        timeout: Duration::from_secs(30),
        ..CommConfig::default()
    };
    let r = rig_with(nccl(), cfg.clone())?;
    sum_of_ones(&r.comm, "before the revoke")?;
    r.comm.revoke("rank 1 died");
    let refused = r.comm.synchronize();
    if !refused_with(&refused, "revoked: rank 1 died") {
        return Err(format!("after the revoke: {refused:?}"));
    }
    let new = r
        .comm
        .shrink(&[], cfg)
        .map_err(|err| format!("shrink after the revoke: {err}"))?;
    sum_of_ones(&new, "on the communicator shrunk after the revoke")?;
    let old = r.comm.synchronize();
    if !refused_with(&old, "revoked: rank 1 died") {
        return Err(format!("the old communicator after the shrink: {old:?}"));
    }
    Ok(())
}

/// The common failure: work stops completing (a kernel ahead of the call spins 3 s, the
/// timeout is 1 s), the communicator is aborted at its deadline and the wait returns the
/// timeout; then a shrink still forms a working communicator (before, the abort freed the
/// handle the shrink runs on, and the shrink was refused).
pub fn after_timeout() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(1));
    let s = r.comm.stream().clone();
    let a = s.clone_htod(&[1.0f32; K]).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    let mut slow = s.alloc_zeros::<f32>(1).map_err(e("slow"))?;
    r.k.spin_fill(&s, &mut slow, 0.0, 3_000_000_000);
    r.comm
        .all_reduce(&a, &mut b, ReduceOp::Sum)
        .map_err(|err| format!("all_reduce: {err}"))?;
    let waited = r.comm.synchronize();
    if !matches!(waited, Err(NcclError::Timeout { .. })) {
        return Err(format!("want a timeout, got {waited:?}"));
    }
    let new = r
        .comm
        .shrink(&[], CommConfig::default())
        .map_err(|err| format!("shrink after the timeout: {err}"))?;
    sum_of_ones(&new, "on the communicator shrunk after the timeout")?;
    let old = r.comm.all_reduce(&a, &mut b, ReduceOp::Sum);
    if !matches!(old, Err(NcclError::Timeout { .. })) {
        return Err(format!("the old communicator after the shrink: {old:?}"));
    }
    Ok(())
}

/// With `nonblocking_calls` the calls' handle is the only one: an abort frees it, and a
/// shrink afterwards is refused saying so (and what keeps it: a revoke); the same after a
/// revoke on an NCCL limited to 2.27, which has no `ncclCommRevoke` and aborts instead.
pub fn after_abort_without_kept_handle() -> Result<(), String> {
    let cfg = CommConfig {
        nonblocking_calls: true,
        timeout: Duration::from_secs(30),
        ..CommConfig::default()
    };
    let older = Nccl::load()
        .map_err(|err| err.to_string())?
        .limited_to(version_code(2, 27, 0));
    let cases: [(Arc<Nccl>, &str); 2] = [(nccl(), "abort"), (Arc::new(older), "revoke")];
    for (lib, how) in cases {
        let r = rig_with(lib, cfg.clone())?;
        sum_of_ones(&r.comm, "before the abort")?;
        if how == "abort" {
            r.comm.abort_with("rank 1 died");
        } else {
            r.comm.revoke("rank 1 died");
        }
        match r.comm.shrink(&[], cfg.clone()) {
            Err(NcclError::Aborted { op, reason, .. })
                if op == "shrink"
                    && reason.contains("rank 1 died")
                    && reason.contains("the abort freed the calls' handle")
                    && reason.contains("revoke() keeps the calls' one") => {}
            other => return Err(format!("shrink after the {how}: {other:?}")),
        }
    }
    Ok(())
}

/// The loaded NCCL limited to 2.26.0, older than `ncclCommShrink`: a shrink that leaves a
/// rank out is refused naming the version needed and the one loaded, before anything changes
/// (the communicator still computes), while a shrink of the same members (a split, from 2.18)
/// still forms a working communicator.
pub fn older_nccl_refused() -> Result<(), String> {
    let lib = Nccl::load()
        .map_err(|err| err.to_string())?
        .limited_to(version_code(2, 26, 0));
    let r = rig_with(Arc::new(lib), CommConfig::default())?;
    match r.comm.shrink(&[0], CommConfig::default()) {
        Err(NcclError::Load(err))
            if err
                .to_string()
                .starts_with("ncclCommShrink needs NCCL 2.27.0 or newer; ")
                && err.to_string().ends_with("is NCCL 2.26.0") => {}
        other => return Err(format!("shrink on NCCL limited to 2.26: {other:?}")),
    }
    sum_of_ones(&r.comm, "after the refused shrink")?;
    let new = r
        .comm
        .shrink(&[], CommConfig::default())
        .map_err(|err| format!("shrink of the same members on 2.26: {err}"))?;
    sum_of_ones(&new, "on the communicator formed again on 2.26")
}

/// Two ranks on two GPUs (threads of this process); rank 1 stops calling (as a dead or
/// stopped rank would), rank 0 shrinks it out and gets a communicator of one that computes.
/// Rank 1 then revokes its own and drops it. Needs two GPUs.
pub fn leaving_out_a_rank() -> Result<(), String> {
    let lib = nccl();
    let id = UniqueId::new(&lib).map_err(|err| format!("unique id: {err}"))?;
    let cfg = CommConfig {
        timeout: Duration::from_secs(30),
        init_timeout: Duration::from_secs(30),
        ..CommConfig::default()
    };
    let (to_rank1, rank1_told) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|sc| -> Result<(), String> {
        let (lib, id, cfg) = (&lib, &id, &cfg);
        let rank1 = sc.spawn(move || -> Result<(), String> {
            let ctx = CudaContext::new(1).map_err(|err| format!("cuda:1: {err}"))?;
            let comm = Communicator::init_rank(lib.clone(), &ctx, 1, 2, id, cfg.clone())
                .map_err(|err| format!("rank 1 init: {err}"))?;
            sum_of_ones_of(&comm, 2.0, "rank 1 before")?;
            // Silent until rank 0 has shrunk it out (or given up: the sender is dropped).
            let _ = rank1_told.recv_timeout(Duration::from_secs(120));
            comm.revoke("left out by rank 0");
            Ok(())
        });
        let rank0 = (|| -> Result<(), String> {
            let ctx = CudaContext::new(0).map_err(|err| format!("cuda:0: {err}"))?;
            let comm = Communicator::init_rank(lib.clone(), &ctx, 0, 2, id, cfg.clone())
                .map_err(|err| format!("rank 0 init: {err}"))?;
            sum_of_ones_of(&comm, 2.0, "rank 0 before")?;
            let t0 = Instant::now();
            let new = comm
                .shrink(&[1], cfg.clone())
                .map_err(|err| format!("rank 0 shrink: {err}"))?;
            eprintln!("shrink leaving rank 1 out took {:?}", t0.elapsed());
            if (new.rank(), new.size()) != (0, 1) {
                return Err(format!("shrunk to rank {} of {}", new.rank(), new.size()));
            }
            sum_of_ones(&new, "rank 0 after the shrink")
        })();
        drop(to_rank1);
        let rank1 = rank1.join().map_err(|_| "rank 1 panicked".to_string())?;
        rank0.and(rank1)
    })
}

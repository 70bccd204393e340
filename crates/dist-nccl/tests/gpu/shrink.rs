//! `Communicator::shrink` on one rank: the lists a shrink must refuse are refused before
//! anything changes, and the communicator still computes. One GPU cannot run a shrink itself
//! (NCCL refuses an empty list, and a device holds one rank of a communicator): a shrink that
//! leaves a rank out needs two GPUs.

use std::time::Duration;

use dist_core::ReduceOp;
use dist_nccl::{CommConfig, NcclError};

use crate::calls::K;
use crate::rig;

fn e(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// An all_reduce of ones on `comm`'s stream, checked: a one-rank sum is the input.
fn sum_of_ones(comm: &dist_nccl::Communicator, what: &str) -> Result<(), String> {
    let s = comm.stream().clone();
    let a = s.clone_htod(&[1.0f32; K]).map_err(e("a"))?;
    let mut b = s.alloc_zeros::<f32>(K).map_err(e("b"))?;
    comm.all_reduce(&a, &mut b, ReduceOp::Sum)
        .map_err(|err| format!("{what}: all_reduce: {err}"))?;
    comm.synchronize()
        .map_err(|err| format!("{what}: synchronize: {err}"))?;
    let got = s.clone_dtoh(&b).map_err(e("read"))?;
    if got.iter().any(|&x| x != 1.0) {
        return Err(format!("{what}: want ones, got {:?}", &got[..4]));
    }
    Ok(())
}

/// An empty list, a rank out of range, one listed twice, and this rank itself: each refused
/// with the reason, and the communicator still computes afterwards.
pub fn refusals() -> Result<(), String> {
    let r = rig(true, Duration::from_secs(30));
    let cases: [(&[usize], &str); 4] = [
        (&[], "no rank to leave out"),
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

//! Argument checks that need no GPU, and reduce ops as NCCL takes them.

use dist_core::ReduceOp;
use dist_nccl_sys::ncclRedOp_t;

use crate::shared::Shared;

/// A reduce op as NCCL takes it; a `PreMulSum` op is created for the call and destroyed after
/// (NCCL allows that as soon as the call that uses it has returned).
pub(crate) struct RedOp<'a> {
    pub(crate) op: ncclRedOp_t,
    pub(crate) premul: Option<&'a Shared>,
}

impl Drop for RedOp<'_> {
    fn drop(&mut self) {
        if let Some(shared) = self.premul
            && let Ok(f) = shared
                .nccl
                .get("ncclRedOpDestroy", &shared.nccl.raw().ncclRedOpDestroy)
        {
            let op = self.op;
            // SAFETY: the op was created on this communicator, which `call` uses only while
            // live and under its lock; the call that used the op has returned.
            let r = shared.call("destroy a PreMulSum op", |c| unsafe { f(op, c) });
            if let Err(e) = r {
                tracing::debug!(comm = %shared.who, error = %e, "ncclRedOpDestroy");
            }
        }
    }
}

/// `got` elements where `want` are needed, or why not.
pub(crate) fn len_ok(what: &str, got: usize, want: usize) -> std::result::Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} has {got} elements, expected {want}"))
    }
}

/// A rank (root or peer) in `0..size`, as NCCL's `int`.
pub(crate) fn rank_ok(what: &str, r: usize, size: usize) -> std::result::Result<i32, String> {
    if r < size && r <= i32::MAX as usize {
        Ok(r as i32)
    } else {
        Err(format!("{what} {r} is out of range for {size} ranks"))
    }
}

/// NCCL's code for a built-in op; `None` for `PreMulSum`, which is created per call; an error
/// for the ops NCCL does not have.
pub(crate) fn builtin_op(op: ReduceOp) -> std::result::Result<Option<u32>, String> {
    match op {
        ReduceOp::Sum => Ok(Some(0)),
        ReduceOp::Prod => Ok(Some(1)),
        ReduceOp::Max => Ok(Some(2)),
        ReduceOp::Min => Ok(Some(3)),
        ReduceOp::Avg => Ok(Some(4)),
        ReduceOp::PreMulSum(_) => Ok(None),
        other => Err(format!("NCCL has no reduce op {}", other.name())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_checks_without_a_gpu() {
        assert_eq!(len_ok("recv", 20, 20), Ok(()));
        assert_eq!(
            len_ok("recv", 21, 20).unwrap_err(),
            "recv has 21 elements, expected 20"
        );
        assert_eq!(rank_ok("root", 1, 2), Ok(1));
        assert_eq!(
            rank_ok("peer", 2, 2).unwrap_err(),
            "peer 2 is out of range for 2 ranks"
        );
        assert_eq!(builtin_op(ReduceOp::Min), Ok(Some(3)));
        assert_eq!(builtin_op(ReduceOp::Avg), Ok(Some(4)));
        assert_eq!(builtin_op(ReduceOp::PreMulSum(0.5)), Ok(None));
        assert_eq!(
            builtin_op(ReduceOp::BitXor).unwrap_err(),
            "NCCL has no reduce op bxor"
        );
        // The values NCCL's header gives these ops.
        assert_eq!(dist_nccl_sys::ncclRedOp_t::ncclMin.0, 3);
        assert_eq!(dist_nccl_sys::ncclRedOp_t::ncclAvg.0, 4);
    }
}

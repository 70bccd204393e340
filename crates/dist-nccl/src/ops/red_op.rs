//! Reduce ops as NCCL takes them: the built-in ones by their codes in `nccl.h`, `PreMulSum`
//! created for the call (`ncclRedOpCreatePreMulSum`) and destroyed after it.

use std::ffi::c_void;

use dist_core::ReduceOp;
use dist_nccl_sys::{nccl_fn, ncclRedOp_t, ncclScalarResidence_t};

use super::Ops;
use crate::error::Result;
use crate::shared::Shared;
use crate::types::{NcclType, scalar_for};

/// A reduce op as NCCL takes it; a `PreMulSum` op is created for the call and destroyed after
/// (NCCL allows that as soon as the call that uses it has returned).
pub(crate) struct RedOp<'a> {
    pub(crate) op: ncclRedOp_t,
    premul: Option<&'a Shared>,
}

impl Drop for RedOp<'_> {
    fn drop(&mut self) {
        if let Some(shared) = self.premul
            && let Ok(f) = nccl_fn!(&shared.nccl, ncclRedOpDestroy)
        {
            let op = self.op;
            // SAFETY: the op was created on this communicator, which `call` uses only while
            // live and under its lock; the call that used the op has returned. The multirank
            // trial `nccl_collectives` reduces with `PreMulSum` for every type.
            let r = shared.call("destroy a PreMulSum op", |c| unsafe { f(op, c) });
            if let Err(e) = r {
                tracing::debug!(comm = %shared.who, error = %e, "ncclRedOpDestroy");
            }
        }
    }
}

/// NCCL's op for a built-in `op`; `None` for `PreMulSum`, which is created per call; an error
/// for the ops NCCL does not have.
pub(crate) fn builtin_op(op: ReduceOp) -> std::result::Result<Option<ncclRedOp_t>, String> {
    match op {
        ReduceOp::Sum => Ok(Some(ncclRedOp_t::ncclSum)),
        ReduceOp::Prod => Ok(Some(ncclRedOp_t::ncclProd)),
        ReduceOp::Max => Ok(Some(ncclRedOp_t::ncclMax)),
        ReduceOp::Min => Ok(Some(ncclRedOp_t::ncclMin)),
        ReduceOp::Avg => Ok(Some(ncclRedOp_t::ncclAvg)),
        ReduceOp::PreMulSum(_) => Ok(None),
        other => Err(format!("NCCL has no reduce op {}", other.name())),
    }
}

impl<'a> Ops<'a> {
    /// `op` for a call named `op_name` on elements of `T`.
    pub(super) fn red_op<T: NcclType>(&self, op_name: &str, op: ReduceOp) -> Result<RedOp<'a>> {
        if let Some(code) = builtin_op(op).map_err(|e| self.invalid(op_name, e))? {
            return Ok(RedOp {
                op: code,
                premul: None,
            });
        }
        let ReduceOp::PreMulSum(s) = op else {
            return Err(self.invalid(op_name, format!("NCCL has no reduce op {}", op.name())));
        };
        let shared: &'a Shared = &self.comm.shared;
        let f = nccl_fn!(&shared.nccl, ncclRedOpCreatePreMulSum)?;
        // Exactly one element's bytes, as NCCL reads for T's data type (checked), in an 8-byte
        // buffer that outlives the call.
        let mut scalar = scalar_for::<T>(s).map_err(|e| self.invalid(op_name, e))?;
        let mut out = ncclRedOp_t(0);
        shared.call(op_name, |c| {
            // SAFETY: NCCL reads one element of T::NCCL from the scalar during the call
            // (host-immediate); `scalar_for` checked that this is `size_of::<T>()` <= 8 bytes,
            // all inside `scalar`. `out` is valid for one op; `c` is live under the lock (the
            // multirank trial `nccl_collectives`, `PreMulSum` for every type).
            unsafe {
                f(
                    &mut out,
                    scalar.as_mut_ptr().cast::<c_void>(),
                    T::NCCL,
                    ncclScalarResidence_t::ncclScalarHostImmediate,
                    c,
                )
            }
        })?;
        Ok(RedOp {
            op: out,
            premul: Some(shared),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_ops_map_to_the_headers_codes() {
        assert_eq!(builtin_op(ReduceOp::Sum), Ok(Some(ncclRedOp_t(0))));
        assert_eq!(builtin_op(ReduceOp::Prod), Ok(Some(ncclRedOp_t(1))));
        assert_eq!(builtin_op(ReduceOp::Max), Ok(Some(ncclRedOp_t(2))));
        assert_eq!(builtin_op(ReduceOp::Min), Ok(Some(ncclRedOp_t(3))));
        assert_eq!(builtin_op(ReduceOp::Avg), Ok(Some(ncclRedOp_t(4))));
        assert_eq!(builtin_op(ReduceOp::PreMulSum(0.5)), Ok(None));
        assert_eq!(
            builtin_op(ReduceOp::BitXor).unwrap_err(),
            "NCCL has no reduce op bxor"
        );
    }
}

//! Point-to-point calls (not collectives: they keep NCCL's own names, `send` and `recv`). As
//! in `collectives.rs`, every `// SAFETY:` relies on [`Ops::launch`] for the pointers, the
//! ordering, the buffers' lifetime, the lock and the element size.

use cudarc::driver::CudaSlice;
use dist_nccl_sys::nccl_fn;

use super::{Dst, Guards, Ops};
use crate::error::Result;
use crate::types::NcclType;

impl<'a> Ops<'a> {
    pub(crate) fn send_g<'b, T: NcclType>(
        &self,
        buf: &'b CudaSlice<T>,
        peer: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "send";
        self.check_context(OP, [("buffer", Some(buf)), ("", None)])?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclSend)?;
        let n = buf.len();
        // SAFETY: `buf` holds n elements of T on this context; `peer` < size (the multirank
        // trials `nccl_collectives` and `hybrid_device_collectives`).
        self.launch(
            OP,
            Some(buf),
            None::<&mut CudaSlice<T>>,
            |p, _, c, st| unsafe { f(p, n, T::NCCL, peer, c, st) },
        )
    }

    pub(crate) fn recv_g<'b, T: NcclType>(
        &self,
        buf: impl Dst<'b, T>,
        peer: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "recv";
        self.check_context(OP, [("buffer", Some(buf.slice())), ("", None)])?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclRecv)?;
        let n = buf.slice().len();
        // SAFETY: `buf` holds n elements of T on this context; `peer` < size (the multirank
        // trials `nccl_collectives` and `hybrid_device_collectives`).
        self.launch(OP, None, Some(buf), |_, p, c, st| unsafe {
            f(p, n, T::NCCL, peer, c, st)
        })
    }
}

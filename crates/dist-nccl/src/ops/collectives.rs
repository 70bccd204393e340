//! The collectives: each checks its arguments, then hands NCCL's function to [`Ops::launch`].
//! Their names (in errors, and for the watchdog) are `dist_core`'s [`Kind`] names.
//!
//! Every `// SAFETY:` below relies on [`Ops::launch`] for the rest: the pointers it passes are
//! those of the buffers given (null where none), taken on this stream, so cudarc made the
//! stream wait for the buffers' earlier uses; the guards it returns keep the buffers borrowed
//! until the call has launched (at once, or at the group's end); it calls under the
//! communicator's lock, with the communicator live; and it checked that `size_of::<T>()` is
//! NCCL's size for `T::NCCL` before calling.

use cudarc::driver::CudaSlice;
use dist_core::ReduceOp;
use dist_core::collectives::Kind;
use dist_nccl_sys::nccl_fn;

use super::{Dst, Guards, Ops};
use crate::error::Result;
use crate::types::NcclType;

impl<'a> Ops<'a> {
    pub(crate) fn all_reduce_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: impl Dst<'b, T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllReduce.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        self.check_len(OP, "recv", recv.slice().len(), send.len())?;
        let red = self.red_op::<T>(OP, op)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclAllReduce)?;
        let n = send.len();
        // SAFETY: both buffers are of this context and hold `n` elements of T (checked).
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), Some(recv), |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, red.op, c, st)
        })
    }

    pub(crate) fn all_reduce_in_place_g<'b, T: NcclType>(
        &self,
        buf: impl Dst<'b, T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllReduce.name();
        self.check_context(OP, [("buffer", Some(buf.slice())), ("", None)])?;
        let red = self.red_op::<T>(OP, op)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclAllReduce)?;
        let n = buf.slice().len();
        // SAFETY: one buffer of `n` elements of T on this context, used in place (send and
        // receive the same pointer) as NCCL allows.
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, None, Some(buf), |_, p, c, st| unsafe {
            f(p, p, n, T::NCCL, red.op, c, st)
        })
    }

    pub(crate) fn broadcast_g<'b, T: NcclType>(
        &self,
        buf: impl Dst<'b, T>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::Broadcast.name();
        self.check_context(OP, [("buffer", Some(buf.slice())), ("", None)])?;
        let root = self.check_rank(OP, "root", root)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclBroadcast)?;
        let n = buf.slice().len();
        // SAFETY: one buffer of `n` elements of T on this context, in place; `root` < size.
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, None, Some(buf), |_, p, c, st| unsafe {
            f(p, p, n, T::NCCL, root, c, st)
        })
    }

    pub(crate) fn reduce_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: Option<impl Dst<'b, T>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::Reduce.name();
        self.check_context(
            OP,
            [
                ("send", Some(send)),
                ("recv", recv.as_ref().map(|r| r.slice())),
            ],
        )?;
        let root_i = self.check_rank(OP, "root", root)?;
        self.check_root_has(OP, "receive", recv.is_some(), root)?;
        if let Some(recv) = &recv {
            self.check_len(OP, "recv", recv.slice().len(), send.len())?;
        }
        let red = self.red_op::<T>(OP, op)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclReduce)?;
        let n = send.len();
        // SAFETY: `send` holds `n` elements of T on this context; `recv`, where given, holds
        // `n` too; it is given on the root (checked), and elsewhere NCCL does not touch the
        // receive buffer (null there).
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), recv, |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, red.op, root_i, c, st)
        })
    }

    pub(crate) fn all_gather_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: impl Dst<'b, T>,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllGather.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        let want = self.times_size(OP, send.len())?;
        self.check_len(OP, "recv", recv.slice().len(), want)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclAllGather)?;
        let n = send.len();
        // SAFETY: `send` holds n and `recv` size × n elements of T on this context, as NCCL
        // reads and writes.
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), Some(recv), |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, c, st)
        })
    }

    pub(crate) fn reduce_scatter_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: impl Dst<'b, T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::ReduceScatter.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        let want = self.times_size(OP, recv.slice().len())?;
        self.check_len(OP, "send", send.len(), want)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = nccl_fn!(&self.comm.shared.nccl, ncclReduceScatter)?;
        let n = recv.slice().len();
        // SAFETY: `send` holds size × n and `recv` n elements of T on this context.
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), Some(recv), |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, red.op, c, st)
        })
    }

    pub(crate) fn all_to_all_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: impl Dst<'b, T>,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllToAll.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        self.check_len(OP, "recv", recv.slice().len(), send.len())?;
        let size = self.comm.size;
        if !send.len().is_multiple_of(size) {
            return Err(self.invalid(
                OP,
                format!(
                    "{} elements do not split into {size} equal blocks",
                    send.len()
                ),
            ));
        }
        let f = nccl_fn!(&self.comm.shared.nccl, ncclAlltoAll)?;
        let k = send.len() / size;
        // SAFETY: both buffers hold size × k elements of T on this context.
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), Some(recv), |s, r, c, st| unsafe {
            f(s, r, k, T::NCCL, c, st)
        })
    }

    pub(crate) fn gather_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: Option<impl Dst<'b, T>>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::Gather.name();
        self.check_context(
            OP,
            [
                ("send", Some(send)),
                ("recv", recv.as_ref().map(|r| r.slice())),
            ],
        )?;
        let root_i = self.check_rank(OP, "root", root)?;
        self.check_root_has(OP, "receive", recv.is_some(), root)?;
        if let Some(recv) = &recv {
            let want = self.times_size(OP, send.len())?;
            self.check_len(OP, "recv", recv.slice().len(), want)?;
        }
        let f = nccl_fn!(&self.comm.shared.nccl, ncclGather)?;
        let n = send.len();
        // SAFETY: `send` holds n elements of T on this context; `recv`, where given, size × n;
        // it is given on the root (checked), and elsewhere NCCL does not touch the receive
        // buffer (null there).
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, Some(send), recv, |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, root_i, c, st)
        })
    }

    pub(crate) fn scatter_g<'b, T: NcclType>(
        &self,
        send: Option<&'b CudaSlice<T>>,
        recv: impl Dst<'b, T>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::Scatter.name();
        self.check_context(OP, [("send", send), ("recv", Some(recv.slice()))])?;
        let root_i = self.check_rank(OP, "root", root)?;
        self.check_root_has(OP, "send", send.is_some(), root)?;
        let n = recv.slice().len();
        if let Some(send) = send {
            let want = self.times_size(OP, n)?;
            self.check_len(OP, "send", send.len(), want)?;
        }
        let f = nccl_fn!(&self.comm.shared.nccl, ncclScatter)?;
        // SAFETY: `recv` holds n elements of T on this context; `send`, where given, size × n;
        // it is given on the root (checked), and elsewhere NCCL does not read the send buffer
        // (null there).
        // The multirank trials `nccl_collectives` and `hybrid_device_collectives` run it.
        self.launch(OP, send, Some(recv), |s, r, c, st| unsafe {
            f(s, r, n, T::NCCL, root_i, c, st)
        })
    }
}

//! The collectives and point-to-point calls, each written once: every argument is checked
//! before NCCL sees it, and the call is enqueued under the communicator's lock. The same code
//! serves [`Ops`] (one call, launched at once) and a [`crate::Group`] (calls recorded, launched
//! at `ncclGroupEnd`): each returns the buffers' stream-ordering guards, which `Ops` drops at
//! once and a group keeps until its launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use dist_core::ReduceOp;
use dist_nccl_sys::{cudaStream_t, ncclComm_t, ncclRedOp_t, ncclResult_t, ncclScalarResidence_t};

use crate::args::{RedOp, builtin_op, len_ok, rank_ok};
use crate::communicator::Communicator;
use crate::error::{NcclError, Result};
use crate::shared::{Shared, Used};
use crate::types::{NcclType, scalar_for, size_matches};

/// The collectives and point-to-point calls of one communicator on one stream. Every size,
/// root, peer, device, context and stream is checked before NCCL is called: misuse is an error
/// with nothing enqueued, never a GPU write out of bounds.
#[derive(Clone, Copy)]
pub struct Ops<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) stream: &'a Arc<CudaStream>,
    /// Made by a [`crate::Group`], which keeps the buffers alive until its launch.
    pub(crate) grouped: bool,
}

impl std::fmt::Debug for Ops<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ops({:?})", self.comm)
    }
}

/// The stream-ordering guards of one call's buffers (cudarc records, when they drop, that the
/// stream used the buffers; a later use on another stream waits for that point).
pub(crate) struct Guards<'b>(
    pub(crate) Option<SyncOnDrop<'b>>,
    pub(crate) Option<SyncOnDrop<'b>>,
);

impl<'b> Guards<'b> {
    fn one(g: SyncOnDrop<'b>) -> Guards<'b> {
        Guards(Some(g), None)
    }
    fn two(a: SyncOnDrop<'b>, b: SyncOnDrop<'b>) -> Guards<'b> {
        Guards(Some(a), Some(b))
    }
}

fn sym<'n, F>(
    shared: &'n Shared,
    name: &'static str,
    field: &'n std::result::Result<F, libloading::Error>,
) -> Result<&'n F> {
    crate::shared::sym(&shared.nccl, name, field)
}

impl<'a> Ops<'a> {
    fn shared(&self) -> &'a Shared {
        &self.comm.shared
    }

    fn invalid(&self, op: &str, reason: String) -> NcclError {
        self.comm.invalid(op, reason)
    }

    /// The stream must belong to the communicator's `CudaContext` (not only its device): cudarc
    /// orders a buffer's uses through events of its own context object.
    fn check_stream(&self, op: &str) -> Result<()> {
        if Arc::ptr_eq(self.stream.context(), &self.comm.ctx) {
            return Ok(());
        }
        Err(self.invalid(op, self.comm.foreign("the stream", self.stream.context())))
    }

    fn check_buf<T>(&self, op: &str, what: &str, b: &CudaSlice<T>) -> Result<()> {
        if Arc::ptr_eq(b.stream().context(), &self.comm.ctx) {
            return Ok(());
        }
        Err(self.invalid(op, self.comm.foreign(what, b.stream().context())))
    }

    fn check_len(&self, op: &str, what: &str, got: usize, want: usize) -> Result<()> {
        len_ok(what, got, want).map_err(|r| self.invalid(op, r))
    }

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<i32> {
        rank_ok(what, r, self.comm.size).map_err(|e| self.invalid(op, e))
    }

    fn check_type<T: NcclType>(&self, op: &str) -> Result<()> {
        if !size_matches::<T>() {
            return Err(self.invalid(
                op,
                format!(
                    "{} is {} bytes, not NCCL's size for data type {}",
                    T::NAME,
                    std::mem::size_of::<T>(),
                    T::NCCL.0
                ),
            ));
        }
        let have = self.shared().nccl.version();
        if have < T::MIN_VERSION {
            return Err(self.invalid(
                op,
                format!(
                    "{} needs NCCL {} or newer; this is {}",
                    T::NAME,
                    dist_nccl_sys::version_string(T::MIN_VERSION),
                    dist_nccl_sys::version_string(have)
                ),
            ));
        }
        Ok(())
    }

    fn red_op<T: NcclType>(&self, op_name: &str, op: ReduceOp) -> Result<RedOp<'a>> {
        if let Some(code) = builtin_op(op).map_err(|e| self.invalid(op_name, e))? {
            return Ok(RedOp {
                op: ncclRedOp_t(code),
                premul: None,
            });
        }
        let ReduceOp::PreMulSum(s) = op else {
            return Err(self.invalid(op_name, format!("NCCL has no reduce op {}", op.name())));
        };
        let shared = self.shared();
        let f = sym(
            shared,
            "ncclRedOpCreatePreMulSum",
            &shared.nccl.raw().ncclRedOpCreatePreMulSum,
        )?;
        // Exactly one element's bytes, as NCCL reads for T's data type (checked), in an 8-byte
        // buffer that outlives the call.
        let mut scalar = scalar_for::<T>(s).map_err(|e| self.invalid(op_name, e))?;
        let mut out = ncclRedOp_t(0);
        shared.call(op_name, |c| {
            // SAFETY: NCCL reads one element of T::NCCL from the scalar during the call
            // (host-immediate); `scalar_for` checked that this is `size_of::<T>()` <= 8 bytes,
            // all inside `scalar`. `out` is valid for one op; `c` is live under the lock.
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

    /// Runs one enqueueing call under the communicator's lock and notes the stream for the
    /// watchdog and for drop.
    fn enqueue<T: NcclType>(
        &self,
        op: &'static str,
        f: impl FnOnce(ncclComm_t, cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        self.check_type::<T>(op)?;
        if !self.grouped && crate::group::in_group() {
            return Err(self.invalid(
                op,
                "a group is open on this thread: make the call through the group (`g.send(..)`, \
                 `g.with(comm)?..`), which keeps its buffers alive until the launch"
                    .into(),
            ));
        }
        let shared = self.shared();
        let mut st = shared.lock_for_call(op)?;
        let cu = self.stream.cu_stream();
        let r = f(st.comm, cu as cudaStream_t);
        shared.settle(&mut st, op, r)?;
        st.last_op = op;
        match st.streams.iter_mut().find(|u| u.stream.cu_stream() == cu) {
            Some(u) => u.enqueued += 1,
            None => st.streams.push(Used {
                stream: self.stream.clone(),
                enqueued: 1,
            }),
        }
        Ok(())
    }

    pub(crate) fn all_reduce_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: &'b mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "all_reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "recv", recv.len(), send.len())?;
        let red = self.red_op::<T>(OP, op)?;
        let f = sym(
            self.shared(),
            "ncclAllReduce",
            &self.shared().nccl.raw().ncclAllReduce,
        )?;
        let n = send.len();
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = recv.device_ptr_mut(stream);
        // SAFETY: both buffers belong to this communicator's context and hold `n` elements of
        // T, whose size is NCCL's for T::NCCL (checked by `enqueue` before the call runs);
        // cudarc made the stream wait for their earlier uses, and the guards returned keep them
        // borrowed until the call has launched (at once here, or at the group's end).
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                n,
                T::NCCL,
                red.op,
                c,
                st,
            )
        })?;
        Ok(Guards::two(gs, gr))
    }

    pub(crate) fn all_reduce_in_place_g<'b, T: NcclType>(
        &self,
        buf: &'b mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "all_reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = sym(
            self.shared(),
            "ncclAllReduce",
            &self.shared().nccl.raw().ncclAllReduce,
        )?;
        let n = buf.len();
        let stream: &'b CudaStream = self.stream;
        let (p, g) = buf.device_ptr_mut(stream);
        // SAFETY: one buffer of `n` elements of T on this context, used in place as NCCL
        // allows; ordering and lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                p as *const c_void,
                p as *mut c_void,
                n,
                T::NCCL,
                red.op,
                c,
                st,
            )
        })?;
        Ok(Guards::one(g))
    }

    pub(crate) fn broadcast_g<'b, T: NcclType>(
        &self,
        buf: &'b mut CudaSlice<T>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "broadcast";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let root = self.check_rank(OP, "root", root)?;
        let f = sym(
            self.shared(),
            "ncclBroadcast",
            &self.shared().nccl.raw().ncclBroadcast,
        )?;
        let n = buf.len();
        let stream: &'b CudaStream = self.stream;
        let (p, g) = buf.device_ptr_mut(stream);
        // SAFETY: one buffer of `n` elements of T on this context, in place; ordering and
        // lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                p as *const c_void,
                p as *mut c_void,
                n,
                T::NCCL,
                root,
                c,
                st,
            )
        })?;
        Ok(Guards::one(g))
    }

    pub(crate) fn reduce_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: Option<&'b mut CudaSlice<T>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        let root_i = self.check_rank(OP, "root", root)?;
        if recv.is_none() && self.comm.rank == root {
            return Err(self.invalid(OP, "the root must pass a receive buffer".into()));
        }
        if let Some(recv) = &recv {
            self.check_buf(OP, "recv", recv)?;
            self.check_len(OP, "recv", recv.len(), send.len())?;
        }
        let red = self.red_op::<T>(OP, op)?;
        let f = sym(
            self.shared(),
            "ncclReduce",
            &self.shared().nccl.raw().ncclReduce,
        )?;
        let n = send.len();
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = match recv {
            Some(recv) => {
                let (r, g) = recv.device_ptr_mut(stream);
                (r as *mut c_void, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        // SAFETY: `send` holds `n` elements of T on this context; `recv`, where given, holds
        // `n` too; off the root NCCL does not touch the receive buffer (null there). Ordering
        // and lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s as *const c_void, r, n, T::NCCL, red.op, root_i, c, st)
        })?;
        Ok(Guards(Some(gs), gr))
    }

    pub(crate) fn all_gather_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: &'b mut CudaSlice<T>,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "all_gather";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        let want = self.times_size(OP, send.len())?;
        self.check_len(OP, "recv", recv.len(), want)?;
        let f = sym(
            self.shared(),
            "ncclAllGather",
            &self.shared().nccl.raw().ncclAllGather,
        )?;
        let n = send.len();
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = recv.device_ptr_mut(stream);
        // SAFETY: `send` holds n and `recv` size × n elements of T on this context, as NCCL
        // reads and writes; ordering and lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s as *const c_void, r as *mut c_void, n, T::NCCL, c, st)
        })?;
        Ok(Guards::two(gs, gr))
    }

    pub(crate) fn reduce_scatter_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: &'b mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "reduce_scatter";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        let want = self.times_size(OP, recv.len())?;
        self.check_len(OP, "send", send.len(), want)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = sym(
            self.shared(),
            "ncclReduceScatter",
            &self.shared().nccl.raw().ncclReduceScatter,
        )?;
        let n = recv.len();
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = recv.device_ptr_mut(stream);
        // SAFETY: `send` holds size × n and `recv` n elements of T on this context; ordering
        // and lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                n,
                T::NCCL,
                red.op,
                c,
                st,
            )
        })?;
        Ok(Guards::two(gs, gr))
    }

    pub(crate) fn all_to_all_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: &'b mut CudaSlice<T>,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "all_to_all";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "recv", recv.len(), send.len())?;
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
        let f = sym(
            self.shared(),
            "ncclAlltoAll",
            &self.shared().nccl.raw().ncclAlltoAll,
        )?;
        let k = send.len() / size;
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = recv.device_ptr_mut(stream);
        // SAFETY: both buffers hold size × k elements of T on this context; ordering and
        // lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s as *const c_void, r as *mut c_void, k, T::NCCL, c, st)
        })?;
        Ok(Guards::two(gs, gr))
    }

    pub(crate) fn gather_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: Option<&'b mut CudaSlice<T>>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "gather";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        let root_i = self.check_rank(OP, "root", root)?;
        if recv.is_none() && self.comm.rank == root {
            return Err(self.invalid(OP, "the root must pass a receive buffer".into()));
        }
        if let Some(recv) = &recv {
            self.check_buf(OP, "recv", recv)?;
            let want = self.times_size(OP, send.len())?;
            self.check_len(OP, "recv", recv.len(), want)?;
        }
        let f = sym(
            self.shared(),
            "ncclGather",
            &self.shared().nccl.raw().ncclGather,
        )?;
        let n = send.len();
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = send.device_ptr(stream);
        let (r, gr) = match recv {
            Some(recv) => {
                let (r, g) = recv.device_ptr_mut(stream);
                (r as *mut c_void, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        // SAFETY: `send` holds n elements of T on this context; `recv`, where given, size × n;
        // off the root NCCL does not touch the receive buffer (null there). Ordering and
        // lifetime as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s as *const c_void, r, n, T::NCCL, root_i, c, st)
        })?;
        Ok(Guards(Some(gs), gr))
    }

    pub(crate) fn scatter_g<'b, T: NcclType>(
        &self,
        send: Option<&'b CudaSlice<T>>,
        recv: &'b mut CudaSlice<T>,
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "scatter";
        self.check_stream(OP)?;
        self.check_buf(OP, "recv", recv)?;
        let root_i = self.check_rank(OP, "root", root)?;
        if send.is_none() && self.comm.rank == root {
            return Err(self.invalid(OP, "the root must pass a send buffer".into()));
        }
        let n = recv.len();
        if let Some(send) = send {
            self.check_buf(OP, "send", send)?;
            let want = self.times_size(OP, n)?;
            self.check_len(OP, "send", send.len(), want)?;
        }
        let f = sym(
            self.shared(),
            "ncclScatter",
            &self.shared().nccl.raw().ncclScatter,
        )?;
        let stream: &'b CudaStream = self.stream;
        let (r, gr) = recv.device_ptr_mut(stream);
        let (s, gs) = match send {
            Some(send) => {
                let (s, g) = send.device_ptr(stream);
                (s as *const c_void, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        // SAFETY: `recv` holds n elements of T on this context; `send`, where given, size × n;
        // off the root NCCL does not read the send buffer (null there). Ordering and lifetime
        // as in `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s, r as *mut c_void, n, T::NCCL, root_i, c, st)
        })?;
        Ok(Guards(Some(gr), gs))
    }

    pub(crate) fn send_g<'b, T: NcclType>(
        &self,
        buf: &'b CudaSlice<T>,
        peer: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "send";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = sym(
            self.shared(),
            "ncclSend",
            &self.shared().nccl.raw().ncclSend,
        )?;
        let n = buf.len();
        let stream: &'b CudaStream = self.stream;
        let (p, g) = buf.device_ptr(stream);
        // SAFETY: `buf` holds n elements of T on this context; ordering and lifetime as in
        // `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(p as *const c_void, n, T::NCCL, peer, c, st)
        })?;
        Ok(Guards::one(g))
    }

    pub(crate) fn recv_g<'b, T: NcclType>(
        &self,
        buf: &'b mut CudaSlice<T>,
        peer: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = "recv";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = sym(
            self.shared(),
            "ncclRecv",
            &self.shared().nccl.raw().ncclRecv,
        )?;
        let n = buf.len();
        let stream: &'b CudaStream = self.stream;
        let (p, g) = buf.device_ptr_mut(stream);
        // SAFETY: `buf` holds n elements of T on this context; ordering and lifetime as in
        // `all_reduce_g`.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(p as *mut c_void, n, T::NCCL, peer, c, st)
        })?;
        Ok(Guards::one(g))
    }

    /// `k × size`, or an error where it overflows.
    fn times_size(&self, op: &str, k: usize) -> Result<usize> {
        k.checked_mul(self.comm.size).ok_or_else(|| {
            self.invalid(
                op,
                format!("{k} elements × {} ranks overflows", self.comm.size),
            )
        })
    }
}

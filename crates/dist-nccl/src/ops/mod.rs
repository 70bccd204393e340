//! The collectives and point-to-point calls, each written once: every argument is checked
//! before NCCL sees it, and the call is enqueued under the communicator's lock. The same code
//! serves [`Ops`] (one call, launched at once) and a [`crate::Group`] (calls recorded, launched
//! at `ncclGroupEnd`): each returns the buffers' stream-ordering guards, which `Ops` drops at
//! once and a group keeps until its launch.
//!
//! Here: the checks every call shares and [`Ops::launch`], the one way a call reaches NCCL;
//! `collectives.rs`, `p2p.rs` and `uneven.rs` hold the calls, `red_op.rs` the reduce ops.

mod collectives;
mod p2p;
mod red_op;
mod uneven;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use dist_nccl_sys::{cudaStream_t, ncclComm_t, ncclResult_t};

use crate::args::{len_ok, rank_ok};
use crate::communicator::Communicator;
use crate::error::{NcclError, Result};
use crate::shared::Used;
use crate::types::{NcclType, size_matches};

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

/// The stream-ordering guards of one call's buffers, send then receive (cudarc records, when
/// they drop, that the stream used the buffers; a later use on another stream waits for that
/// point).
pub(crate) struct Guards<'b>(
    pub(crate) Option<SyncOnDrop<'b>>,
    pub(crate) Option<SyncOnDrop<'b>>,
);

impl<'a> Ops<'a> {
    fn invalid(&self, op: &str, reason: String) -> NcclError {
        self.comm.invalid(op, reason)
    }

    /// The stream, and each buffer given, must belong to the communicator's `CudaContext` (not
    /// only its device): cudarc orders a buffer's uses through events of its own context object.
    fn check_context<T>(&self, op: &str, bufs: [(&str, Option<&CudaSlice<T>>); 2]) -> Result<()> {
        let ctx = &self.comm.ctx;
        if !Arc::ptr_eq(self.stream.context(), ctx) {
            return Err(self.invalid(op, self.comm.foreign("the stream", self.stream.context())));
        }
        for (what, b) in bufs {
            if let Some(b) = b
                && !Arc::ptr_eq(b.stream().context(), ctx)
            {
                return Err(self.invalid(op, self.comm.foreign(what, b.stream().context())));
            }
        }
        Ok(())
    }

    fn check_len(&self, op: &str, what: &str, got: usize, want: usize) -> Result<()> {
        len_ok(what, got, want).map_err(|r| self.invalid(op, r))
    }

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<i32> {
        rank_ok(what, r, self.comm.size).map_err(|e| self.invalid(op, e))
    }

    /// The root must pass the buffer (`what`) that only it uses.
    fn check_root_has(&self, op: &str, what: &str, given: bool, root: usize) -> Result<()> {
        if !given && self.comm.rank == root {
            return Err(self.invalid(op, format!("the root must pass a {what} buffer")));
        }
        Ok(())
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
        let have = self.comm.shared.nccl.version();
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

    /// `k × size`, or an error where it overflows.
    fn times_size(&self, op: &str, k: usize) -> Result<usize> {
        k.checked_mul(self.comm.size).ok_or_else(|| {
            self.invalid(
                op,
                format!("{k} elements × {} ranks overflows", self.comm.size),
            )
        })
    }

    /// The one way a call reaches NCCL. Takes the buffers' device pointers on the stream (so
    /// cudarc makes the stream wait for their earlier uses; null for a buffer not given), runs
    /// `call(send, recv, comm, stream)` under the communicator's lock, settles its result, notes
    /// the stream for the watchdog and for drop, and returns the buffers' guards, which keep
    /// them borrowed until the call has launched (dropped at once by [`Ops`], kept until after
    /// `ncclGroupEnd` by a group). No allocation, and the one lock, per call.
    fn launch<'b, T: NcclType>(
        &self,
        op: &'static str,
        send: Option<&'b CudaSlice<T>>,
        recv: Option<&'b mut CudaSlice<T>>,
        call: impl FnOnce(*const c_void, *mut c_void, ncclComm_t, cudaStream_t) -> ncclResult_t,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        self.check_type::<T>(op)?;
        if !self.grouped && crate::group::in_group() {
            return Err(self.invalid(
                op,
                "a group is open on this thread: make the call through the group (`g.send(..)`, \
                 `g.with(comm)?..`), which keeps its buffers alive until the launch"
                    .into(),
            ));
        }
        let stream: &'b CudaStream = self.stream;
        let (s, gs) = match send {
            Some(b) => {
                let (p, g) = b.device_ptr(stream);
                (p as *const c_void, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        let (r, gr) = match recv {
            Some(b) => {
                let (p, g) = b.device_ptr_mut(stream);
                (p as *mut c_void, Some(g))
            }
            None => (std::ptr::null_mut(), None),
        };
        let shared = &self.comm.shared;
        let mut st = shared.lock_for_call(op)?;
        let cu = self.stream.cu_stream();
        let res = call(s, r, st.comm, cu as cudaStream_t);
        shared.settle(&mut st, op, res)?;
        st.last_op = op;
        match st.streams.iter_mut().find(|u| u.stream.cu_stream() == cu) {
            Some(u) => u.enqueued += 1,
            None => st.streams.push(Used {
                stream: self.stream.clone(),
                enqueued: 1,
            }),
        }
        Ok(Guards(gs, gr))
    }
}

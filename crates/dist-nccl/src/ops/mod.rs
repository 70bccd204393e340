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

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop, sys};
use dist_nccl_sys::{cudaStream_t, ncclComm_t, ncclResult_t};

use crate::args::{len_ok, rank_ok};
use crate::capture::{CAPTURING_REASON, Captured};
use crate::communicator::Communicator;
use crate::error::{NcclError, Result};
use crate::shared::cuda;
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
    /// Made by a [`crate::Capture`] (directly or through its group): the call is recorded into
    /// a graph, which keeps the buffers alive while it can replay.
    pub(crate) capture: Option<Captured<'a>>,
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

/// A buffer a call writes: `&mut` for a call enqueued now (cudarc records its write event
/// behind the call), `&` for one recorded into a graph, which borrows it for the graph's life
/// and waits for its replays before releasing it (`capture.rs`).
pub(crate) trait Dst<'b, T> {
    /// Whether the buffer is borrowed exclusively (only a captured call may take a shared one).
    const EXCLUSIVE: bool;
    fn slice(&self) -> &CudaSlice<T>;
    /// The device pointer on `stream` and cudarc's guard, which records the buffer's use when
    /// dropped.
    fn ptr(self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>);
}

impl<'b, T> Dst<'b, T> for &'b mut CudaSlice<T> {
    const EXCLUSIVE: bool = true;
    fn slice(&self) -> &CudaSlice<T> {
        self
    }
    fn ptr(self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.device_ptr_mut(stream)
    }
}

impl<'b, T> Dst<'b, T> for &'b CudaSlice<T> {
    const EXCLUSIVE: bool = false;
    fn slice(&self) -> &CudaSlice<T> {
        self
    }
    fn ptr(self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.device_ptr(stream)
    }
}

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

    /// The stream to take the buffers' pointers on: the call's own, or for a call recorded
    /// into a capture the communicator's scratch stream (`capture.rs` says why). Refuses a call
    /// whose stream's capture state does not match how it was made.
    fn pointer_stream(&self, op: &str) -> Result<&'a CudaStream> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        let status = crate::capture::status(self.stream).map_err(cuda(
            &self.comm.shared.who,
            "query the stream's capture state",
        ))?;
        let reason = match (status, self.capture) {
            (S::CU_STREAM_CAPTURE_STATUS_NONE, None) => return Ok(self.stream),
            (S::CU_STREAM_CAPTURE_STATUS_ACTIVE, Some(c))
                if c.stream.cu_stream() == self.stream.cu_stream() =>
            {
                return Ok(c.scratch);
            }
            (S::CU_STREAM_CAPTURE_STATUS_ACTIVE, Some(_)) => {
                "inside a capture, calls go on the capture's stream"
            }
            (S::CU_STREAM_CAPTURE_STATUS_ACTIVE, None) => CAPTURING_REASON,
            (S::CU_STREAM_CAPTURE_STATUS_INVALIDATED, _) => {
                "the stream's CUDA graph capture was invalidated by an earlier error; end it \
                 before calling"
            }
            (S::CU_STREAM_CAPTURE_STATUS_NONE, Some(_)) => {
                "the capture this call was made through has ended (a capture's calls are made \
                 inside its closure)"
            }
        };
        Err(self.invalid(op, reason.into()))
    }

    /// The one way a call reaches NCCL. Takes the buffers' device pointers on the stream (so
    /// cudarc makes the stream wait for their earlier uses; null for a buffer not given), runs
    /// `call(send, recv, comm, stream)` under the communicator's lock, settles its result, notes
    /// the stream for the watchdog and for drop, and returns the buffers' guards, which keep
    /// them borrowed until the call has launched (dropped at once by [`Ops`], kept until after
    /// `ncclGroupEnd` by a group). No allocation, and the one lock, per call.
    ///
    /// What an eager call does besides NCCL's own call, in order (the example `graph_perf`
    /// times the driver steps alone, and dist's call on buffers without cudarc's events):
    /// - host checks (type, group, context, lengths, ranks): comparisons, no call;
    /// - the capture check: one `cuStreamIsCapturing` on the call's stream. It cannot be
    ///   cached: any thread may begin a capture on the stream (cudarc's `begin_capture` is
    ///   safe), or make it join another stream's capture by waiting on an event recorded there,
    ///   between two calls, and nothing tells dist; a call recorded into a capture dist does
    ///   not hold would let safe code replay it after its buffers were freed;
    /// - cudarc's ordering of each buffer (only while the context tracks events, in
    ///   multi-stream mode): a `cuStreamWaitEvent` for each earlier use the call must follow
    ///   (the last write of a buffer it reads; the last read and write of one it writes) and a
    ///   `cuEventRecord` per buffer when its guard drops (after the lock is released): for an
    ///   out-of-place call 3 waits and 2 records, in place 2 and 1;
    /// - the communicator's lock (one uncontended mutex: the watchdog only ever `try_lock`s it)
    ///   with three atomic loads around it, and the watchdog's count of the stream's calls (a
    ///   search of the few streams used).
    fn launch<'b, T: NcclType, R: Dst<'b, T>>(
        &self,
        op: &'static str,
        send: Option<&'b CudaSlice<T>>,
        recv: Option<R>,
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
        // Before any CUDA call on the buffers: on a capturing stream even cudarc's waits would
        // be recorded (or refused, invalidating the capture).
        let ptr_stream = self.pointer_stream(op)?;
        if !R::EXCLUSIVE && self.capture.is_none() {
            return Err(self.invalid(
                op,
                "a buffer the call writes must be borrowed exclusively (shared only in a capture)"
                    .into(),
            ));
        }
        let (s, gs) = match send {
            Some(b) => {
                let (p, g) = b.device_ptr(ptr_stream);
                (p as *const c_void, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        let (r, gr) = match recv {
            Some(b) => {
                let (p, g) = b.ptr(ptr_stream);
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
        // A captured call enqueued nothing: its replays are counted when launched.
        if self.capture.is_none() {
            st.note_enqueued(self.stream);
        }
        Ok(Guards(gs, gr))
    }
}

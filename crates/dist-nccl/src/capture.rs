//! CUDA graphs of NCCL calls: [`Communicator::capture`] records calls on a capturing stream
//! into a [`Graph`], which replays them with [`Graph::launch`] any number of times.
//!
//! What capture changes, and why:
//! - A captured call enqueues nothing now: NCCL records its kernels into the graph, and each
//!   replay is a launch the caller makes. So nothing of the call is watched while capturing;
//!   each [`Graph::launch`] is enqueued under the communicator's lock like a call, counted for
//!   the watchdog (whose deadline then bounds the replay, and whose abort ends it) and for the
//!   drop, and [`Graph::synchronize`] waits for the replays with the communicator's timeout.
//! - cudarc orders a buffer's uses by waiting on and recording the buffer's events on the
//!   stream that uses it. Inside a capture both would be wrong: a wait on an event recorded
//!   outside the capture crosses the capture's boundary (CUDA refuses it and invalidates the
//!   capture), and an event recorded inside it becomes a captured event that later waits and
//!   queries cannot use. So a captured call takes its buffers' pointers on a second stream of
//!   the communicator's (`scratch`), never on the capturing one: that stream waits for the
//!   buffers' earlier uses; the capture stream waits for it once the capture ends, so every
//!   replay follows those uses; and the buffers' events are recorded on it, behind every
//!   replay, when the graph is dropped, so later uses wait for the last replay.
//! - The graph borrows the communicator and every buffer its calls name for as long as it
//!   lives (`'buf`): a replay never reaches a freed buffer or communicator. The borrows are
//!   shared, also of the buffers the calls write, so that the caller's own work captured after
//!   a call (a copy, a kernel) can read its result, and the caller can read results between
//!   replays on the graph's stream. cudarc does not order other streams after a replay until
//!   the graph is dropped: read a written buffer on the graph's stream (or order the other
//!   stream after it yourself) while the graph lives. Through a shared borrow cudarc lets the
//!   scratch stream wait only for a written buffer's earlier writes, not for its earlier reads
//!   on other streams: let those complete before the first replay. A call inside
//!   [`Capture::group`] borrows what it writes exclusively, as every group call does.
//! - A call made any other way on a capturing stream (plain [`Ops`], a [`Communicator`]
//!   method, `HybridBackend`'s plain calls, which capture through `HybridBackend::capture`) is
//!   refused before anything is enqueued, as are a synchronize, a
//!   [`Communicator::record_work`] and a graph launch on a capturing stream: NCCL would record
//!   it into a graph dist does not hold, or CUDA would invalidate the capture.
//! - NCCL (2.26 and newer) keeps a communicator whose work a graph holds until that graph is
//!   destroyed: `ncclCommAbort` and `ncclCommDestroy` wait inside NCCL for it. So while a graph
//!   of the communicator lives (or is being captured), an abort (the watchdog's, the deadline's,
//!   [`Communicator::abort`]) runs on a thread of its own, which waits for the graphs' drops
//!   (a drop takes no lock), and a call waiting for the communicator's lock gives up once an
//!   abort is decided: the thread holding the graph is never the one blocked behind it.
//! - The watchdog never records its mark on a capturing stream, and never queries a mark that
//!   may have landed in a capture (`watchdog.rs`); its thread's capture mode is relaxed, so its
//!   event queries on other streams never invalidate a capture made in CUDA's global mode.
//!
//! ```no_run
//! # use dist_core::ReduceOp;
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let s = comm.stream();
//! let a = s.alloc_zeros::<f32>(1024).unwrap();
//! let b = s.alloc_zeros::<f32>(1024).unwrap();
//! let graph = comm.capture(s, |cap| {
//!     cap.all_reduce(&a, &b, ReduceOp::Sum)?;
//!     cap.broadcast(&b, 0)
//! })?;
//! for _ in 0..10 {
//!     graph.launch()?;
//!     let result = s.clone_dtoh(&b).unwrap(); // on the graph's stream: after the replay
//! }
//! graph.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! A buffer the graph uses cannot be freed while it can replay:
//!
//! ```compile_fail,E0505
//! # use dist_core::ReduceOp;
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//! let graph = comm.capture(comm.stream(), |cap| cap.all_reduce_in_place(&a, ReduceOp::Sum))?;
//! drop(a);
//! graph.launch()?;
//! # Ok(()) }
//! ```
//!
//! nor the communicator:
//!
//! ```compile_fail,E0505
//! # use std::sync::Arc;
//! # use dist_core::ReduceOp;
//! # fn demo(comm: dist_nccl::Communicator, s: Arc<cudarc::driver::CudaStream>) -> dist_nccl::Result<()> {
//! let a = s.alloc_zeros::<f32>(1024).unwrap();
//! let graph = comm.capture(&s, |cap| cap.all_reduce_in_place(&a, ReduceOp::Sum))?;
//! drop(comm);
//! graph.launch()?;
//! # Ok(()) }
//! ```
//!
//! A buffer made inside the capture does not live long enough:
//!
//! ```compile_fail,E0597
//! # use dist_core::ReduceOp;
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let graph = comm.capture(comm.stream(), |cap| {
//!     let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//!     cap.all_reduce_in_place(&a, ReduceOp::Sum)
//! })?;
//! # Ok(()) }
//! ```
//!
//! And the capture belongs to its thread (CUDA's thread-local capture mode):
//!
//! ```compile_fail,E0277
//! # use dist_core::ReduceOp;
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//! let graph = comm.capture(comm.stream(), |cap| {
//!     std::thread::scope(|t| {
//!         t.spawn(|| cap.all_reduce_in_place(&a, ReduceOp::Sum));
//!     });
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaGraph, CudaStream, DriverError, SyncOnDrop, result, sys};

use crate::communicator::Communicator;
use crate::error::Result;
use crate::group::Group;
use crate::ops::{Guards, Ops};
use crate::shared::{Shared, cuda};

/// Why a call on a capturing stream, not made through a [`Capture`], is refused.
pub(crate) const CAPTURING_REASON: &str = "the stream is capturing a CUDA graph: record calls \
     into a graph through Communicator::capture, which keeps the communicator and the buffers \
     alive while the graph can replay";

/// The capture state of `stream`: whether work enqueued on it now is recorded into a graph.
pub(crate) fn status(
    stream: &CudaStream,
) -> std::result::Result<CUstreamCaptureStatus, DriverError> {
    // SAFETY: the stream is alive (borrowed); cuStreamIsCapturing only reads its state into
    // the value it returns. Every captured and refused call of the GPU test `graph` runs it.
    match unsafe { result::stream::is_capturing(stream.cu_stream()) } {
        Ok(s) => Ok(s),
        // No context current on this thread: cudarc's query binds the stream's first.
        Err(_) => stream.capture_status(),
    }
}

/// Whether `stream` is capturing now (`Err`: the query failed).
pub(crate) fn capturing(stream: &CudaStream) -> std::result::Result<bool, DriverError> {
    Ok(status(stream)? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Makes this thread's CUDA calls never invalidate another thread's capture (CUDA's relaxed
/// capture mode, for this thread only): for the watchdog, which queries and records events
/// while a caller may be capturing in global mode.
pub(crate) fn relax_this_thread() {
    let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid pointer for the call, which only swaps this thread's capture
    // mode (the old one is written back into `mode` and dropped). The watchdog of every
    // communicator runs it (the GPU tests `graph`).
    if let Err(e) = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result() {
        tracing::warn!(error = %e, "cannot relax the watchdog thread's CUDA capture mode");
    }
}

/// A call recorded into a capture: its pointers are taken on `scratch`, not on `stream` (the
/// capturing one, which the call must use).
#[derive(Clone, Copy)]
pub(crate) struct Captured<'a> {
    pub(crate) scratch: &'a Arc<CudaStream>,
    pub(crate) stream: &'a Arc<CudaStream>,
}

/// An open capture on one stream of a communicator (see [`Communicator::capture`]): calls made
/// through it are recorded into the graph, their buffers borrowed (shared) for the graph's
/// life.
pub struct Capture<'buf> {
    comm: &'buf Communicator,
    captured: Captured<'buf>,
    guards: RefCell<Vec<SyncOnDrop<'buf>>>,
    /// A capture in CUDA's thread-local mode belongs to the thread that began it.
    _thread: PhantomData<*const ()>,
    /// Invariant in `'buf`, as [`Group`] is, for the same reason.
    _invariant: PhantomData<fn(&'buf ()) -> &'buf ()>,
}

impl std::fmt::Debug for Capture<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Capture({:?})", self.comm)
    }
}

impl<'buf> Capture<'buf> {
    /// The capturing stream: work the caller enqueues on it (copies, kernels) is recorded into
    /// the same graph, in order with the calls.
    pub fn stream(&self) -> &'buf Arc<CudaStream> {
        self.captured.stream
    }

    /// The communicator the calls run on.
    pub fn communicator(&self) -> &'buf Communicator {
        self.comm
    }

    /// Runs `f` inside one NCCL group, recorded into the graph (sends and receives that must
    /// be matched in one group, such as a rank's with itself).
    pub fn group<R>(&self, f: impl FnOnce(&Group<'buf>) -> Result<R>) -> Result<R> {
        let (r, guards) = crate::group::group_in(&[self.comm], Some(self.captured), f)?;
        self.guards.borrow_mut().extend(guards);
        Ok(r)
    }

    pub(crate) fn ops(&self) -> Ops<'buf> {
        Ops {
            capture: Some(self.captured),
            ..self.comm.on(self.captured.stream)
        }
    }

    pub(crate) fn keep(&self, g: Guards<'buf>) {
        let mut v = self.guards.borrow_mut();
        v.extend(g.0);
        v.extend(g.1);
    }
}

/// One CUDA graph holding the communicator's NCCL work (captured, or being captured), counted
/// in [`Shared::graphs`] while it lives: NCCL's abort waits for every such graph to be
/// destroyed, so while any lives an abort runs on a thread of its own (`shared.rs`).
struct Held<'a>(&'a Shared);

impl<'a> Held<'a> {
    fn new(shared: &'a Shared) -> Held<'a> {
        shared
            .graphs
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Held(shared)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0
            .graphs
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Ends a capture that is still open when dropped (the closure failed or panicked): the
/// stream leaves capture mode and what was recorded is discarded.
struct Ending<'s> {
    stream: &'s Arc<CudaStream>,
    done: bool,
}

impl Ending<'_> {
    fn end(mut self) -> std::result::Result<Option<CudaGraph>, DriverError> {
        self.done = true;
        self.stream.end_capture(CUgraphInstantiate_flags(0))
    }
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stream.end_capture(CUgraphInstantiate_flags(0));
        }
    }
}

impl Communicator {
    /// The stream captured calls take their buffers' pointers on, made once.
    pub(crate) fn scratch_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.scratch.get() {
            return Ok(s);
        }
        let made = self
            .ctx
            .new_stream()
            .map_err(cuda(&self.shared.who, "create a stream"))?;
        Ok(self.scratch.get_or_init(|| made))
    }

    /// Records the calls `f` makes through its [`Capture`] (and the caller's own work on
    /// [`Capture::stream`]) into a CUDA graph on `stream` (of this communicator's context, not
    /// the legacy default stream), in CUDA's thread-local capture mode, and returns it to
    /// replay. The graph borrows the communicator and every buffer its calls name until it
    /// is dropped. Refused while `stream` is capturing already, while this thread has a group
    /// open, and once the communicator was aborted; an error inside `f` ends the capture and
    /// discards it.
    ///
    /// Every replay is the caller's launch: [`Graph::launch`] enqueues one (watched with the
    /// communicator's timeout, like a call), [`Graph::synchronize`] waits for those enqueued.
    pub fn capture<'buf>(
        &'buf self,
        stream: &'buf Arc<CudaStream>,
        f: impl FnOnce(&Capture<'buf>) -> Result<()>,
    ) -> Result<Graph<'buf>> {
        const OP: &str = "capture";
        if !Arc::ptr_eq(stream.context(), &self.ctx) {
            return Err(self.invalid(OP, self.foreign("the stream", stream.context())));
        }
        if crate::group::in_group() {
            return Err(self.invalid(OP, "a group is open on this thread".into()));
        }
        if let Some(why) = self.shared.doomed.get() {
            return Err(self.shared.aborted_error(OP, why));
        }
        let who = &self.shared.who;
        if capturing(stream).map_err(cuda(who, "query the stream's capture state"))? {
            return Err(self.invalid(OP, "the stream is capturing already".into()));
        }
        let scratch = self.scratch_stream()?;
        // Counted from before the first captured call until the graph (or the capture's
        // discarded one, dropped before this) is destroyed.
        let held = Held::new(&self.shared);
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda(who, "begin a CUDA graph capture"))?;
        let ending = Ending {
            stream,
            done: false,
        };
        let cap = Capture {
            comm: self,
            captured: Captured { scratch, stream },
            guards: RefCell::new(Vec::new()),
            _thread: PhantomData,
            _invariant: PhantomData,
        };
        let out = f(&cap);
        let ended = ending.end();
        let guards = cap.guards.take();
        out?;
        let graph = ended
            .map_err(cuda(
                who,
                "end the CUDA graph capture (work recorded into it was not capturable)",
            ))?
            .ok_or_else(|| self.invalid(OP, "the capture recorded no graph".into()))?;
        // Every replay follows the buffers' uses before the capture (the scratch stream waited
        // for them when the calls took their pointers).
        stream
            .join(scratch)
            .map_err(cuda(who, "order the graph after its buffers' earlier uses"))?;
        Ok(Graph {
            comm: self,
            stream,
            scratch,
            graph: Some(graph),
            guards,
            _held: held,
            _invariant: PhantomData,
        })
    }
}

/// A CUDA graph of NCCL calls (see [`Communicator::capture`]), replayed on the stream it was
/// captured on. It borrows the communicator and the buffers its calls name (shared: read what
/// its calls write on its stream while it lives, since cudarc orders other streams after its
/// replays only once it is dropped); dropping it waits (within the communicator's timeout) for
/// its replays, and later uses of the buffers through cudarc are ordered after them.
pub struct Graph<'buf> {
    comm: &'buf Communicator,
    stream: &'buf Arc<CudaStream>,
    scratch: &'buf Arc<CudaStream>,
    graph: Option<CudaGraph>,
    guards: Vec<SyncOnDrop<'buf>>,
    /// Dropped after the graph is destroyed (`Drop` below runs first).
    _held: Held<'buf>,
    _invariant: PhantomData<fn(&'buf ()) -> &'buf ()>,
}

impl std::fmt::Debug for Graph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({:?})", self.comm)
    }
}

impl Graph<'_> {
    /// The stream its replays run on (the one it was captured on).
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }

    /// Enqueues one replay on the graph's stream. Like a call, it runs under the
    /// communicator's lock (so no abort frees the communicator under it), is refused once the
    /// communicator was aborted or while the stream is capturing, and is watched: if the
    /// stream's work stops completing for the communicator's timeout, the communicator is
    /// aborted, which ends the replay's NCCL kernels. A replay's collectives match other
    /// ranks' calls in the order they are launched, as calls do: every rank launches its
    /// replays where it would make those calls.
    pub fn launch(&self) -> Result<()> {
        const OP: &str = "graph launch";
        let shared = &self.comm.shared;
        let Some(graph) = &self.graph else {
            return Err(self.comm.invalid(OP, "the graph was released".into()));
        };
        if capturing(self.stream).map_err(cuda(&shared.who, "query the stream's capture state"))? {
            return Err(self.comm.invalid(OP, CAPTURING_REASON.into()));
        }
        let mut st = shared.lock_for_call(OP)?;
        graph
            .launch()
            .map_err(cuda(&shared.who, "launch a CUDA graph"))?;
        st.last_op = OP;
        st.note_enqueued(self.stream);
        Ok(())
    }

    /// Waits until the replays enqueued so far (and everything else on the graph's stream)
    /// have completed, within the communicator's timeout (see
    /// [`Communicator::synchronize_stream`]).
    pub fn synchronize(&self) -> Result<()> {
        self.comm.synchronize_stream(self.stream)
    }

    /// [`Graph::launch`], then [`Graph::synchronize`].
    pub fn replay(&self) -> Result<()> {
        self.launch()?;
        self.synchronize()
    }
}

impl Drop for Graph<'_> {
    /// Bounded: waits for the replays within the communicator's timeout (a hang aborts the
    /// communicator, which ends them), destroys the graph, then records the buffers' events
    /// behind the replays.
    fn drop(&mut self) {
        let idle = !matches!(capturing(self.stream), Ok(true) | Err(_));
        if idle && let Err(e) = self.comm.synchronize_stream(self.stream) {
            tracing::warn!(comm = %self.comm.shared.who, error = %e, "graph replays at drop");
        }
        drop(self.graph.take());
        if !idle || self.scratch.join(self.stream).is_err() {
            tracing::error!(
                comm = %self.comm.shared.who,
                "a dropped graph's stream is capturing or failed: its buffers' later uses are \
                 not ordered after its replays"
            );
        }
        self.guards.clear();
    }
}

//! Asynchronous collectives on device buffers: each enqueues its NCCL call (through the record
//! and the check, as the blocking ones) and returns a [`GpuWork`], an event recorded on the
//! communicator's stream after the call, which borrows the call's buffers for as long as it
//! lives, so that the host can compute meanwhile and wait when it needs the result.
//!
//! The invariant soundness rests on, which no handle's drop (nor its absence, `mem::forget`)
//! can break: before an `_async` call returns, cudarc has recorded each buffer's read or write
//! event on the communicator's stream after the NCCL kernels (`dist_nccl::Work`'s docs), and
//! every later use of the buffer through cudarc (a kernel or copy on any stream of the
//! context, a copy to the host, its free) waits for that event first; a context with a single
//! stream orders its work by that stream, and cudarc synchronizes the context when a second
//! stream is made. So a forgotten handle leaves the buffers' later uses after the work
//! (`hybrid_gpu_work` reads a buffer whose handle was forgotten, on another stream, and finds
//! the reduced values). The borrow is for correctness, not soundness: safe code cannot pass
//! the buffers to another call, or read them, until it has waited for (or dropped) the handle,
//! so it does not mistake an unfinished result for a finished one.

use std::marker::PhantomData;
use std::time::Duration;

use cudarc::driver::CudaSlice;
use dist_core::collectives::Kind;
use dist_core::{ReduceOp, Transport};
use dist_nccl::{NcclType, Work};
use dist_tcp::TcpBackend;

use crate::buffer::Buffer;
use crate::{HybridBackend, Result};

/// An asynchronous device collective: the work enqueued on the communicator's stream up to and
/// including the call. Its buffers stay borrowed until it is waited on or dropped.
///
/// [`GpuWork::wait`] and [`GpuWork::wait_timeout`] end as [`HybridBackend::synchronize_nccl`]
/// does: done, or the communicator's failure (a dead peer, a mismatch found by the check, an
/// abort), or a timeout that aborts the communicator and names where every rank's NCCL calls
/// are. Dropping an unfinished handle waits for it as [`GpuWork::wait`] would (nothing is
/// cancelled: the other ranks take part in the same call); a failure it finds stays on the
/// communicator, so the next call, wait or synchronize reports it. A handle that is never
/// dropped (`mem::forget`) does not wait, and is still sound: see the module's docs.
///
/// Buckets of gradients all-reduced while the host computes:
///
/// ```no_run
/// # fn demo(h: &dist_hybrid::HybridBackend, buckets: &mut [cudarc::driver::CudaSlice<f32>])
/// # -> dist_hybrid::Result<()> {
/// use dist_core::ReduceOp;
/// let mut works = Vec::new();
/// for b in buckets.iter_mut() {
///     works.push(h.all_reduce_async(b, ReduceOp::Avg)?);
///     // ... host work here, while the bucket travels ...
/// }
/// for w in works {
///     w.wait()?;
/// }
/// # Ok(()) }
/// ```
///
/// The buffers stay borrowed until the handle is gone: using one before does not compile.
///
/// ```compile_fail,E0499
/// # fn demo(h: &dist_hybrid::HybridBackend, x: &mut cudarc::driver::CudaSlice<f32>)
/// # -> dist_hybrid::Result<()> {
/// use dist_core::ReduceOp;
/// let w = h.all_reduce_async(x, ReduceOp::Sum)?;
/// h.all_reduce(x, ReduceOp::Sum)?;
/// w.wait()
/// # }
/// ```
#[must_use = "an unwaited GpuWork does not say whether its work succeeded"]
pub struct GpuWork<'a, H: Transport = TcpBackend> {
    h: &'a HybridBackend<H>,
    /// `None` once waited on.
    work: Option<Work<'a>>,
    /// The record's ticket of the call: a successful wait marks the calls up to it done.
    ticket: u64,
    _buffers: PhantomData<&'a mut ()>,
}

impl<H: Transport> std::fmt::Debug for GpuWork<'_, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuWork({} on rank {})",
            self.op(),
            dist_core::Backend::rank(&*self.h.tcp)
        )
    }
}

impl<H: Transport> GpuWork<'_, H> {
    /// The collective this handle follows.
    pub fn op(&self) -> &'static str {
        self.work.as_ref().map_or("(waited)", Work::op)
    }

    /// Whether the work has ended: completed, or failed (then [`GpuWork::wait`] says how).
    /// Never blocks.
    pub fn is_completed(&self) -> bool {
        self.work.as_ref().is_none_or(Work::is_completed)
    }

    /// Waits for the work, within the NCCL timeout.
    pub fn wait(mut self) -> Result<()> {
        match self.work.take() {
            Some(work) => self.h.work_outcome(self.ticket, work.wait()),
            None => Ok(()),
        }
    }

    /// Waits for the work at most `timeout` (capped at the NCCL timeout); past it the
    /// communicator is aborted and this returns the timeout, naming where every rank's NCCL
    /// calls are.
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<()> {
        match self.work.take() {
            Some(work) => self.h.work_outcome(self.ticket, work.wait_timeout(timeout)),
            None => Ok(()),
        }
    }
}

impl<H: Transport> Drop for GpuWork<'_, H> {
    /// Waits for work not waited on (see [`GpuWork`]), unless a panic is unwinding; its
    /// error, if any, is recorded on the communicator rather than lost.
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            // Unwinding from a panic, the caller is not waiting for results: the work goes on
            // in stream order (sound either way: see the module's docs).
            if !std::thread::panicking() {
                let _ = self.h.work_outcome(self.ticket, work.wait());
            }
        }
    }
}

impl<H: Transport> HybridBackend<H> {
    /// The handle for the call just enqueued (named `op`), recorded on the communicator's
    /// stream.
    fn work_after(&self, op: &'static str) -> Result<GpuWork<'_, H>> {
        let c = self.need_nccl(op)?;
        let ticket = self.watch.as_ref().map_or(0, |w| w.last_ticket());
        let work = c.record_work(op).map_err(|e| self.explain_nccl(e))?;
        Ok(GpuWork {
            h: self,
            work: Some(work),
            ticket,
            _buffers: PhantomData,
        })
    }

    /// A work's wait, in the record: done through its call, or every open call failed.
    fn work_outcome(&self, ticket: u64, r: dist_nccl::Result<()>) -> Result<()> {
        let Some(w) = &self.watch else {
            return Ok(r?);
        };
        match r {
            Ok(()) => {
                w.done_through(ticket);
                Ok(())
            }
            Err(e) => {
                w.synced(Err(&e));
                Err(self.explain_nccl(e))
            }
        }
    }

    /// [`HybridBackend::all_reduce`] of a device buffer, returning at once with its handle.
    pub fn all_reduce_async<'a, T: NcclType>(
        &'a self,
        buf: &'a mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<GpuWork<'a, H>> {
        buf.all_reduce(self, op)?;
        self.work_after(Kind::AllReduce.name())
    }

    /// [`HybridBackend::broadcast`] of a device buffer, returning at once with its handle.
    pub fn broadcast_async<'a, T: NcclType>(
        &'a self,
        buf: &'a mut CudaSlice<T>,
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        buf.broadcast(self, root)?;
        self.work_after(Kind::Broadcast.name())
    }

    /// [`HybridBackend::reduce`] of device buffers, returning at once with its handle.
    pub fn reduce_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: Option<&'a mut CudaSlice<T>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.reduce(input, output, op, root)?;
        self.work_after(Kind::Reduce.name())
    }

    /// [`HybridBackend::all_gather`] of device buffers, returning at once with its handle.
    pub fn all_gather_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: &'a mut CudaSlice<T>,
    ) -> Result<GpuWork<'a, H>> {
        self.all_gather(input, output)?;
        self.work_after(Kind::AllGather.name())
    }

    /// [`HybridBackend::reduce_scatter`] of device buffers, returning at once with its handle.
    pub fn reduce_scatter_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: &'a mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<GpuWork<'a, H>> {
        self.reduce_scatter(input, output, op)?;
        self.work_after(Kind::ReduceScatter.name())
    }

    /// [`HybridBackend::all_to_all`] of device buffers, returning at once with its handle.
    pub fn all_to_all_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: &'a mut CudaSlice<T>,
    ) -> Result<GpuWork<'a, H>> {
        self.all_to_all(input, output)?;
        self.work_after(Kind::AllToAll.name())
    }

    /// [`HybridBackend::all_gather_v`] of device buffers, returning at once with its handle.
    pub fn all_gather_v_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: &'a mut CudaSlice<T>,
        counts: &[usize],
    ) -> Result<GpuWork<'a, H>> {
        self.all_gather_v(input, output, counts)?;
        self.work_after(Kind::AllGatherV.name())
    }

    /// [`HybridBackend::all_to_all_v`] of device buffers, returning at once with its handle.
    pub fn all_to_all_v_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        send_counts: &[usize],
        output: &'a mut CudaSlice<T>,
        recv_counts: &[usize],
    ) -> Result<GpuWork<'a, H>> {
        self.all_to_all_v(input, send_counts, output, recv_counts)?;
        self.work_after(Kind::AllToAllV.name())
    }

    /// [`HybridBackend::gather`] of device buffers, returning at once with its handle.
    pub fn gather_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: Option<&'a mut CudaSlice<T>>,
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.gather(input, output, root)?;
        self.work_after(Kind::Gather.name())
    }

    /// [`HybridBackend::scatter`] of device buffers, returning at once with its handle.
    pub fn scatter_async<'a, T: NcclType>(
        &'a self,
        input: Option<&'a CudaSlice<T>>,
        output: &'a mut CudaSlice<T>,
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.scatter(input, output, root)?;
        self.work_after(Kind::Scatter.name())
    }

    /// [`HybridBackend::gather_v`] of device buffers, returning at once with its handle.
    pub fn gather_v_async<'a, T: NcclType>(
        &'a self,
        input: &'a CudaSlice<T>,
        output: Option<&'a mut CudaSlice<T>>,
        counts: &[usize],
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.gather_v(input, output, counts, root)?;
        self.work_after(Kind::GatherV.name())
    }

    /// [`HybridBackend::scatter_v`] of device buffers, returning at once with its handle.
    pub fn scatter_v_async<'a, T: NcclType>(
        &'a self,
        input: Option<&'a CudaSlice<T>>,
        counts: &[usize],
        output: &'a mut CudaSlice<T>,
        root: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.scatter_v(input, counts, output, root)?;
        self.work_after(Kind::ScatterV.name())
    }

    /// [`HybridBackend::send_to`] of a device buffer, returning at once with its handle.
    pub fn send_async<'a, T: NcclType>(
        &'a self,
        buf: &'a CudaSlice<T>,
        dst: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.send_to(buf, dst)?;
        self.work_after("send")
    }

    /// [`HybridBackend::recv_from`] into a device buffer, returning at once with its handle.
    pub fn recv_async<'a, T: NcclType>(
        &'a self,
        buf: &'a mut CudaSlice<T>,
        src: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.recv_from(buf, src)?;
        self.work_after("recv")
    }

    /// [`HybridBackend::send_recv`], returning at once with its handle.
    pub fn send_recv_async<'a, T: NcclType>(
        &'a self,
        send: &'a CudaSlice<T>,
        dst: usize,
        recv: &'a mut CudaSlice<T>,
        src: usize,
    ) -> Result<GpuWork<'a, H>> {
        self.send_recv(send, dst, recv, src)?;
        self.work_after("send_recv")
    }
}

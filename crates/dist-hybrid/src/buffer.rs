//! Every collective and point-to-point message on host or device buffers, dispatched on the
//! buffer's type ([`Buffer`]): a host slice goes over TCP (`dist-core`'s collectives), a device
//! buffer over NCCL (`device.rs`), through the record and the check of the NCCL calls. Training
//! code calls one method whatever its data's place.

use dist_core::{Collectives, DistError, Element, ReduceOp, Tag, Transport};

use crate::{HybridBackend, Result};

/// A buffer the hybrid's collectives accept: host slices (`[T]`) go over TCP, device buffers
/// (`CudaSlice<T>`) over NCCL, so that training code does not branch on where its data lives.
/// The methods are the hybrid's (e.g. [`HybridBackend::all_gather`]); every rank must pass
/// buffers of one kind to a collective.
pub trait Buffer {
    /// See [`HybridBackend::all_reduce`].
    fn all_reduce<H: Transport>(&mut self, h: &HybridBackend<H>, op: ReduceOp) -> Result<()>;
    /// See [`HybridBackend::broadcast`].
    fn broadcast<H: Transport>(&mut self, h: &HybridBackend<H>, root: usize) -> Result<()>;
    /// See [`HybridBackend::reduce`].
    fn reduce<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()>;
    /// See [`HybridBackend::all_gather`].
    fn all_gather<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()>;
    /// See [`HybridBackend::reduce_scatter`].
    fn reduce_scatter<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
        op: ReduceOp,
    ) -> Result<()>;
    /// See [`HybridBackend::all_to_all`].
    fn all_to_all<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()>;
    /// See [`HybridBackend::all_to_all_v`].
    fn all_to_all_v<H: Transport>(
        input: &Self,
        send_counts: &[usize],
        output: &mut Self,
        recv_counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()>;
    /// See [`HybridBackend::gather`].
    fn gather<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()>;
    /// See [`HybridBackend::scatter`].
    fn scatter<H: Transport>(
        input: Option<&Self>,
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()>;
    /// See [`HybridBackend::all_gather_v`].
    fn all_gather_v<H: Transport>(
        input: &Self,
        output: &mut Self,
        counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()>;
    /// See [`HybridBackend::gather_v`].
    fn gather_v<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        counts: &[usize],
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()>;
    /// See [`HybridBackend::scatter_v`].
    fn scatter_v<H: Transport>(
        input: Option<&Self>,
        counts: &[usize],
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()>;
    /// See [`HybridBackend::send_to`].
    fn send_to<H: Transport>(&self, h: &HybridBackend<H>, dst: usize) -> Result<()>;
    /// See [`HybridBackend::recv_from`].
    fn recv_from<H: Transport>(&mut self, h: &HybridBackend<H>, src: usize) -> Result<()>;
}

impl<T: Element> Buffer for [T] {
    fn all_reduce<H: Transport>(&mut self, h: &HybridBackend<H>, op: ReduceOp) -> Result<()> {
        Ok(h.tcp.all_reduce(self, op)?)
    }

    fn broadcast<H: Transport>(&mut self, h: &HybridBackend<H>, root: usize) -> Result<()> {
        Ok(h.tcp.broadcast(self, root)?)
    }

    fn reduce<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        match output {
            Some(out) => Ok(h.tcp.reduce_into(input, out, op, root)?),
            None if h.tcp.rank() == root => {
                // Refused like every bad argument of a collective: here, and on every other
                // rank (told, so that none waits for this one until its deadline).
                let e = DistError::InvalidArgument {
                    rank: root,
                    op: format!("reduce({} x {}, {op}, root {root})", T::DTYPE, input.len()),
                    reason: "the root must pass an output buffer".into(),
                };
                h.tcp.refuse_next_call(&e.to_string());
                Err(e.into())
            }
            // Off the root the output is scratch: a copy of the input stands in for it.
            None => Ok(h.tcp.reduce(&mut input.to_vec(), op, root)?),
        }
    }

    fn all_gather<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()> {
        Ok(h.tcp.all_gather(input, output)?)
    }

    fn reduce_scatter<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
        op: ReduceOp,
    ) -> Result<()> {
        Ok(h.tcp.reduce_scatter(input, output, op)?)
    }

    fn all_to_all<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()> {
        Ok(h.tcp.all_to_all(input, output)?)
    }

    fn all_to_all_v<H: Transport>(
        input: &Self,
        send_counts: &[usize],
        output: &mut Self,
        recv_counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()> {
        Ok(h.tcp
            .all_to_all_v(input, send_counts, output, recv_counts)?)
    }

    fn gather<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        Ok(h.tcp.gather(input, output, root)?)
    }

    fn scatter<H: Transport>(
        input: Option<&Self>,
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        Ok(h.tcp.scatter(input, output, root)?)
    }

    fn all_gather_v<H: Transport>(
        input: &Self,
        output: &mut Self,
        counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()> {
        Ok(h.tcp.all_gather_v(input, output, counts)?)
    }

    fn gather_v<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        counts: &[usize],
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        Ok(h.tcp.gather_v(input, output, counts, root)?)
    }

    fn scatter_v<H: Transport>(
        input: Option<&Self>,
        counts: &[usize],
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        Ok(h.tcp.scatter_v(input, counts, output, root)?)
    }

    fn send_to<H: Transport>(&self, h: &HybridBackend<H>, dst: usize) -> Result<()> {
        Ok(h.tcp
            .send_tagged(bytemuck::cast_slice(self), dst, Tag::DEFAULT)?)
    }

    fn recv_from<H: Transport>(&mut self, h: &HybridBackend<H>, src: usize) -> Result<()> {
        Ok(h.tcp
            .recv_tagged(bytemuck::cast_slice_mut(self), src, Tag::DEFAULT)?)
    }
}

/// The collectives, each for host slices (over TCP) and device buffers (over NCCL, enqueued on
/// the communicator's stream: see [`HybridBackend::synchronize_nccl`], or the `_async`
/// variants' [`crate::GpuWork`]). Every rank must make the same calls in the same order, with
/// buffers of one kind; on NCCL a disagreement is found by the call check (see the type's
/// docs) and aborts every rank with an error naming both calls.
impl<H: Transport> HybridBackend<H> {
    /// Reduces `buf` over all ranks with `op`, in place.
    pub fn all_reduce<B: Buffer + ?Sized>(&self, buf: &mut B, op: ReduceOp) -> Result<()> {
        buf.all_reduce(self, op)
    }

    /// Copies `buf` from `root` to every rank.
    pub fn broadcast<B: Buffer + ?Sized>(&self, buf: &mut B, root: usize) -> Result<()> {
        buf.broadcast(self, root)
    }

    /// Reduces every rank's `input` with `op` into `output` on `root` (same length; required
    /// there, `None` elsewhere).
    pub fn reduce<B: Buffer + ?Sized>(
        &self,
        input: &B,
        output: Option<&mut B>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        B::reduce(input, output, self, op, root)
    }

    /// Every rank's `input` (k elements) in rank order into every rank's `output` (k × world
    /// size).
    pub fn all_gather<B: Buffer + ?Sized>(&self, input: &B, output: &mut B) -> Result<()> {
        B::all_gather(input, output, self)
    }

    /// Reduces every rank's `input` (k × world size) with `op` and leaves block r in rank r's
    /// `output` (k).
    pub fn reduce_scatter<B: Buffer + ?Sized>(
        &self,
        input: &B,
        output: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        B::reduce_scatter(input, output, self, op)
    }

    /// Block j of `input` (k × world size) to rank j, landing in block r (this rank's) of its
    /// `output`.
    pub fn all_to_all<B: Buffer + ?Sized>(&self, input: &B, output: &mut B) -> Result<()> {
        B::all_to_all(input, output, self)
    }

    /// `send_counts[j]` elements of `input` (in rank order) to rank j, `recv_counts[j]` from
    /// rank j into `output` (in rank order). Rank i's `send_counts[j]` must be rank j's
    /// `recv_counts[i]`.
    pub fn all_to_all_v<B: Buffer + ?Sized>(
        &self,
        input: &B,
        send_counts: &[usize],
        output: &mut B,
        recv_counts: &[usize],
    ) -> Result<()> {
        B::all_to_all_v(input, send_counts, output, recv_counts, self)
    }

    /// Every rank's `input` (k) in rank order into `output` on `root` (k × world size;
    /// required there, `None` elsewhere).
    pub fn gather<B: Buffer + ?Sized>(
        &self,
        input: &B,
        output: Option<&mut B>,
        root: usize,
    ) -> Result<()> {
        B::gather(input, output, self, root)
    }

    /// Block r of `input` on `root` (k × world size; required there, `None` elsewhere) into
    /// rank r's `output` (k).
    pub fn scatter<B: Buffer + ?Sized>(
        &self,
        input: Option<&B>,
        output: &mut B,
        root: usize,
    ) -> Result<()> {
        B::scatter(input, output, self, root)
    }

    /// [`HybridBackend::all_gather`] with blocks of uneven sizes: rank r's `input` has
    /// `counts[r]` elements; `output` gets every block in rank order (`counts`' sum). Every
    /// rank passes the same `counts`.
    pub fn all_gather_v<B: Buffer + ?Sized>(
        &self,
        input: &B,
        output: &mut B,
        counts: &[usize],
    ) -> Result<()> {
        B::all_gather_v(input, output, counts, self)
    }

    /// [`HybridBackend::gather`] with blocks of uneven sizes (`counts[r]` from rank r; the
    /// root's `output` holds `counts`' sum). Every rank passes the same `counts`.
    pub fn gather_v<B: Buffer + ?Sized>(
        &self,
        input: &B,
        output: Option<&mut B>,
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        B::gather_v(input, output, counts, self, root)
    }

    /// [`HybridBackend::scatter`] with blocks of uneven sizes (`counts[r]` to rank r; the
    /// root's `input` holds `counts`' sum). Every rank passes the same `counts`.
    pub fn scatter_v<B: Buffer + ?Sized>(
        &self,
        input: Option<&B>,
        counts: &[usize],
        output: &mut B,
        root: usize,
    ) -> Result<()> {
        B::scatter_v(input, counts, output, self, root)
    }

    /// Sends `buf` to rank `dst`: a host slice as a TCP message (on the default tag), a device
    /// buffer by NCCL's `ncclSend` (enqueued; `dst` must post a matching
    /// [`HybridBackend::recv_from`] of the same length). On NCCL a send holds the stream until
    /// its receive runs: two ranks that exchange at once use [`HybridBackend::send_recv`] (a
    /// send and a receive fused in one NCCL group), or order their calls so that one of them
    /// receives first.
    pub fn send_to<B: Buffer + ?Sized>(&self, buf: &B, dst: usize) -> Result<()> {
        buf.send_to(self, dst)
    }

    /// Receives into `buf` from rank `src` (see [`HybridBackend::send_to`]).
    pub fn recv_from<B: Buffer + ?Sized>(&self, buf: &mut B, src: usize) -> Result<()> {
        buf.recv_from(self, src)
    }
}

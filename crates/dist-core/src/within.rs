//! Per-call timeouts for the collectives: `b.within(timeout)` is a view of a backend whose
//! operations that take no timeout of their own (every collective, `barrier`, `recv`) are
//! bounded by `timeout` instead of the backend's default.
//!
//! ```no_run
//! use std::time::Duration;
//! use dist_core::{Collectives, ReduceOp, Transport, Within};
//!
//! fn step(b: &impl Transport, grads: &mut [f32]) -> dist_core::Result<()> {
//!     // This one all_reduce may take 5 s at most, whatever the backend's default is.
//!     b.within(Duration::from_secs(5)).all_reduce(grads, ReduceOp::Avg)
//! }
//! ```

use std::time::{Duration, Instant};

use crate::backend::{Backend, Meta, Tag, Transport};
use crate::error::Result;

/// A backend seen with another default timeout; see [`Within::within`].
#[derive(Debug)]
pub struct Timed<'a, B: ?Sized> {
    b: &'a B,
    timeout: Duration,
}

/// Gives every [`Transport`] per-call timeouts for its collectives.
pub trait Within: Transport {
    /// A view of this backend whose operations without a timeout argument (the collectives,
    /// `barrier`, `recv`) wait at most `timeout`. It shares everything else with the backend:
    /// the connections, the collectives' sequence, their aborts.
    fn within(&self, timeout: Duration) -> Timed<'_, Self> {
        Timed { b: self, timeout }
    }
}

impl<B: Transport + ?Sized> Within for B {}

impl<B: Transport + ?Sized> Backend for Timed<'_, B> {
    fn rank(&self) -> usize {
        self.b.rank()
    }

    fn world_size(&self) -> usize {
        self.b.world_size()
    }

    fn default_timeout(&self) -> Duration {
        self.timeout
    }

    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> Result<()> {
        self.b.send_tagged(data, dst, tag)
    }

    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<()> {
        self.b.recv_tagged_timeout(buf, src, tag, timeout)
    }

    fn barrier_timeout(&self, timeout: Duration) -> Result<()> {
        self.b.barrier_timeout(timeout)
    }
}

impl<B: Transport + ?Sized> Transport for Timed<'_, B> {
    fn send_meta(&self, data: &[u8], dst: usize, tag: Tag, meta: Meta) -> Result<()> {
        self.b.send_meta(data, dst, tag, meta)
    }

    fn recv_meta(&self, buf: &mut [u8], src: usize, tag: Tag, deadline: Instant) -> Result<Meta> {
        self.b.recv_meta(buf, src, tag, deadline)
    }

    fn send_recv_meta(
        &self,
        send: (&[u8], usize),
        recv: (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
    ) -> Result<Meta> {
        self.b.send_recv_meta(send, recv, tag, meta, deadline)
    }

    fn send_recv_meta_while(
        &self,
        send: (&[u8], usize),
        recv: (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Meta> {
        self.b
            .send_recv_meta_while(send, recv, tag, meta, deadline, meanwhile)
    }

    fn peek_meta(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        self.b.peek_meta(src, tag)
    }

    fn broadcast_abort(&self, tag: Tag, reason: &str) {
        self.b.broadcast_abort(tag, reason)
    }

    fn broadcast_abort_naming(&self, tag: Tag, reason: &str, culprit: Option<usize>) {
        self.b.broadcast_abort_naming(tag, reason, culprit)
    }

    fn flight(&self) -> Option<&crate::flight::FlightRecorder> {
        self.b.flight()
    }

    fn positions(&self) -> Option<String> {
        self.b.positions()
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        self.b.abort_notice()
    }

    fn next_collective(&self) -> u64 {
        self.b.next_collective()
    }

    fn ring_piece(&self) -> usize {
        self.b.ring_piece()
    }

    fn run_beside(&self, first: &mut dyn FnMut(), second: &mut (dyn FnMut() + Send)) {
        self.b.run_beside(first, second)
    }

    fn lanes(&self) -> usize {
        self.b.lanes()
    }
}

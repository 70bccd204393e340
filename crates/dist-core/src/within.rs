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

use std::time::Duration;

use crate::backend::{Backend, Tag};
use crate::collectives::Transport;
use crate::error::Result;
use crate::group::Group;

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
    /// the connections, the group (the collectives' sequence, their aborts).
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
    type Link = B::Link;

    fn group(&self) -> &Group<B::Link> {
        self.b.group()
    }
}

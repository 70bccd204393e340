//! Collectives on host buffers, written once against [`Link`] so that every transport that
//! moves bytes gets them: a [`Group`] owns a link and the collectives' state, and every
//! [`Transport`] (a group, or a backend that owns one) gets [`Collectives`].
//!
//! The files: `desc` (the call descriptor every message carries), `call` (one call: its
//! messages, checks, errors and abort), `ops` (each collective's arguments), `select` (the
//! choice of algorithm by size and world size), `ring`, `halving`, `tree`, `chain`, `pairwise`
//! (the algorithms), `lanes` (two rings at once) and `scratch` (memory).
//!
//! Algorithms, for any world size (not only powers of two):
//!
//! | collective | small messages | large messages |
//! | --- | --- | --- |
//! | all_reduce | recursive doubling (non-powers of two fold the extra ranks in and out) | ring reduce-scatter + ring all-gather; from 8 ranks recursive halving + recursive doubling ([`all_reduce_algorithm`]) |
//! | broadcast | binomial tree | pipelined chain in 1 MiB chunks; from 8 ranks, while the chain's fill dominates, the halving all_reduce of the bytes with bitwise or ([`broadcast_by_halving`]) |
//! | reduce | binomial tree | ring reduce-scatter, then each segment to the root; from 8 ranks the halving all_reduce ([`reduce_by_halving`]) |
//! | all_gather | ring | ring |
//! | reduce_scatter | ring | ring |
//! | all_to_all(v) | pairwise exchange | pairwise exchange |
//! | gather, scatter | direct to / from the root | direct |
//! | barrier | recursive doubling of empty messages where the world is a power of two or from 64 ranks (all_reduce's partners); else the dissemination barrier | |
//! | all_gather_v | ring over blocks of the given sizes | ring |
//! | gather_v, scatter_v | direct to / from the root | direct |
//!
//! Where every rank of the group shares one host and the group agreed on the host arena, the
//! small calls take the arena's small areas instead: all_reduce, broadcast, reduce and
//! all_gather up to [`HOST_SMALL_MAX`] bytes a rank (`small`, `small_ops`), and every barrier;
//! larger all_reduces take the arena's slots or read the peers' buffers (`host`, `direct`).
//! Where the group's ranks span several hosts, some sharing one, all_reduce reduces within each
//! host on the arena and between one leader per host (`host`), or above the arena's limit on
//! hosts of equal size by columns, one ring across the hosts per position in a host
//! (`hier/columns.rs`); broadcast, reduce, gather,
//! scatter, all_gather, reduce_scatter and the barrier run in phases inside each host and
//! between one rank per host, each byte crossing between hosts once per host that needs it
//! (`hier`).
//!
//! Within a step the receive is posted before the send starts, so both directions move at
//! once and the payload lands in place. Every message carries a 16-byte descriptor of the call
//! (collective, element type, count, reduce op, root, sequence number) in its header: a rank
//! whose call differs is found by the first rank that hears from it, with no extra round trip,
//! and that rank tells every other, so every rank returns an error instead of hanging or
//! computing garbage. After such an error (or a dead peer, or a timeout) the backend's
//! collectives stay aborted: create a new backend to go on.

use std::time::{Duration, Instant};

use crate::backend::{Backend, Meta, Tag};
use crate::error::Result;
use crate::group::Group;
use crate::link::{Link, PostedRecv};
use crate::types::{Element, ReduceOp};

mod arena_wait;
mod call;
mod chain;
mod consts;
mod desc;
mod direct;
mod halving;
mod hier;
mod host;
mod lanes;
pub(crate) mod ops;
mod pairwise;
mod parts;
mod ring;
mod scratch;
mod select;
mod small;
mod small_ops;
mod tree;
pub(crate) mod uneven;

pub use crate::group::{GROUP_TAG, RING_PIECE, forming_tree};
pub use arena_wait::SLICE as HOST_WAIT_SLICE;
pub(crate) use call::abort_all;
pub use consts::*;
pub use desc::{Kind, position_from_wire, position_to_wire};
pub use select::{
    AllReduceAlgorithm, HostAllReducePath, all_reduce_algorithm, all_reduce_path,
    broadcast_by_halving, collective_path, host_all_reduce_path, host_small_max, host_split_min,
    host_time_ns, reduce_by_halving,
};

/// A backend whose ranks form a [`Group`]: it gets every collective ([`Collectives`]) on the
/// group, each with the backend's default timeout ([`Backend::default_timeout`]).
pub trait Transport: Backend {
    /// The link the group moves its bytes over.
    type Link: Link;

    /// The group the collectives run on.
    fn group(&self) -> &Group<Self::Link>;

    /// The largest piece, in bytes, a ring step moves in one message (the group's tuning).
    fn ring_piece(&self) -> usize {
        self.group().tuning().ring_piece()
    }

    /// How many rings (or chains) a large collective runs at once (the group's tuning).
    fn lanes(&self) -> usize {
        self.group().tuning().lanes as usize
    }

    /// Sends `send.0` to rank `send.1` while receiving into `recv.0` from rank `recv.1`, both
    /// on `tag`, over the group's link: the receive is posted first, so both move at once.
    /// Returns the received message's meta.
    fn send_recv_meta(
        &self,
        (send, dst): (&[u8], usize),
        (recv, src): (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
    ) -> Result<Meta> {
        let link = self.group().link();
        // SAFETY: the handle is waited on, or dropped by the `?` of a failed send, in this
        // function; it is never leaked. (Tests: `collectives::tests`' send_recv cases; over
        // TCP, `a_receive_whose_send_unwinds_is_withdrawn`.)
        let r = unsafe { link.post(recv, src, tag, deadline)? };
        link.send(send, dst, tag, meta, deadline, Some(&r))?;
        r.wait()
    }

    /// Tells every other rank that this rank's operation on `tag` failed with `reason`: their
    /// waits on system tags (every collective's) fail with
    /// [`DistError::Aborted`](crate::DistError::Aborted), and so do this rank's later
    /// collectives. Only the group's first abort is sent. The notice names no call: it ends
    /// every wait at once, a call in flight on another thread of this rank included.
    fn broadcast_abort(&self, tag: Tag, reason: &str) {
        self.group().abort_call(tag, None, reason, None);
    }

    /// Tells every rank that this rank refuses the collective it was about to start (a bad
    /// argument that a layer above the group found) with `reason`, naming the group's next call:
    /// a rank still in an earlier call (whose part this rank has done) finishes it and fails at
    /// that one. For a rank with no call of the group in flight; one in flight on another
    /// thread of this rank would be left running (use [`Transport::broadcast_abort`] there).
    fn refuse_next_call(&self, reason: &str) {
        let g = self.group();
        g.abort_call(COLLECTIVE_TAG, Some(g.next_number()), reason, None);
    }
}

/// The collectives, for every [`Transport`], blocking or async ([`Collectives::scope`]).
///
/// All ranks must call the same collectives in the same order with matching arguments; a rank
/// that does not is reported on every rank as
/// [`DistError::CollectiveMismatch`](crate::DistError::CollectiveMismatch) (on the ranks that
/// noticed) or [`DistError::Aborted`](crate::DistError::Aborted) (on the others). Each call
/// waits at most the backend's default timeout.
///
/// # Threads
///
/// A group takes collectives from one thread at a time. The order of calls must be the same on
/// every rank, and two threads racing on one group would order them differently on different
/// ranks (two same-shaped all_reduces swapped would mix their data unnoticed), so a lock that
/// serialised them would not be enough. The rule instead:
///
/// - A collective called while another thread is inside a call on the same group (a blocking
///   collective, or an open [`scope`](Collectives::scope)) fails at once with
///   [`DistError::ConcurrentUse`](crate::DistError::ConcurrentUse), naming the rank, the call
///   and what the other thread is inside. It never waits for it.
/// - The group is aborted with it, so that no rank waits for the refused call; the other
///   thread's call fails too (with `ConcurrentUse` or `Aborted`), here and on every rank.
///   Results of calls that ended around such an error are not to be used: a rank on which the
///   two threads' calls did not overlap cannot tell, and may finish one of them matched
///   against the other thread's call of a peer before the abort reaches it. The abort makes
///   its next call fail.
/// - A thread that has a scope open on the group may still call blocking collectives on it:
///   such a call runs after the async collectives the thread has queued (issue order), on the
///   calling thread.
/// - Owned work ([`Collectives::all_reduce_owned`]) is a call of the thread that issues it and
///   holds the group for that thread until it ends: the thread's later collectives run after
///   it (a blocking one waits for it), another thread's are refused as above.
/// - Different groups (a backend and its sub-groups, say) are independent: one thread each
///   may call at once.
///
/// Point-to-point messages ([`Backend::send_tagged`], [`Backend::recv_tagged`]) are not
/// collectives: several threads may use them at once, on distinct tags.
pub trait Collectives: Transport {
    /// Opens a [`Scope`](crate::Scope) for async work on this group, runs `f` in it, and
    /// waits for all of the scope's work before it returns (in the style of
    /// `std::thread::scope`). Returns `f`'s result, or, if `f` succeeded, the error of the
    /// first piece of work that failed without its handle taking the error (a handle dropped
    /// or leaked). Each piece of work waits at most the backend's default timeout, from when
    /// it starts to run. Fails at once with
    /// [`DistError::ConcurrentUse`](crate::DistError::ConcurrentUse) if another thread is
    /// inside a call on this group (see [Threads](Collectives#threads)).
    ///
    /// See [`crate::work`] for an example and where the work runs.
    fn scope<'scope, R>(
        &'scope self,
        f: impl for<'s> FnOnce(&'s crate::Scope<'s, 'scope, Self::Link>) -> Result<R>,
    ) -> Result<R> {
        crate::work::scope(self.group(), self.default_timeout(), f)
    }

    /// Reduces `data` over all ranks with `op`, in place: every rank ends with the result.
    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        ops::all_reduce(self.group(), self.default_timeout(), data, op)
    }

    /// [`Collectives::all_reduce`], async, on a buffer the work owns: returns at once, and
    /// [`Work::wait`](crate::Work::wait) gives `data` back reduced. The handle borrows nothing
    /// (neither a [`scope`](Collectives::scope) nor this backend), so it can be kept anywhere
    /// and waited on later, from any thread: the backward-hook pattern, a bucket's reduction
    /// started as soon as its gradients are ready and waited for at the optimizer step.
    ///
    /// Order: owned work is a collective call of the thread that issues it, in issue order.
    /// It runs on the group's async thread, after the work queued before it; a later
    /// collective of the same thread (blocking, a scope, more owned work) comes after it, a
    /// blocking one waiting until the owned work has ended. Every rank must issue its owned
    /// and blocking collectives in the same order, as for blocking calls. The group takes
    /// calls from one thread at a time, and owned work holds the group for its thread until it
    /// ends: a collective of another thread meanwhile fails at once with
    /// [`DistError::ConcurrentUse`](crate::DistError::ConcurrentUse) and aborts the group
    /// (see [Threads](Collectives#threads)); so does owned work issued while another thread is
    /// inside a call (its handle gives the error). Waiting on the handle is not a call: any
    /// thread may.
    ///
    /// Dropping the handle unwaited does not wait: the work runs to its end (each run has the
    /// backend's default timeout, from when it starts) and frees the buffer then; a failure
    /// aborts the group, so the next call reports it. On an error the buffer is dropped.
    /// Issued inside an open scope of this thread, the scope's end waits for it. The work keeps
    /// the group's state alive; if the backend itself is dropped first, its connections close
    /// and the work fails.
    ///
    /// ```
    /// use std::time::Duration;
    /// use dist_core::testing::run_group;
    /// use dist_core::{Backend, Collectives, ReduceOp, Tuning, Work};
    ///
    /// let out = run_group(2, |_| Tuning::default(), Duration::from_secs(10), |g| {
    ///     // Started bucket by bucket (as each one's gradients are ready) ...
    ///     let pending: Vec<Work<'static, Vec<f32>>> = (0..3)
    ///         .map(|k| g.all_reduce_owned(vec![(g.rank() + k) as f32; 4], ReduceOp::Sum))
    ///         .collect();
    ///     // ... and waited for later (the optimizer step).
    ///     for (k, w) in pending.into_iter().enumerate() {
    ///         assert_eq!(w.wait()?, vec![(1 + 2 * k) as f32; 4]);
    ///     }
    ///     Ok(())
    /// });
    /// assert!(out.into_iter().all(|r| r.is_ok()));
    /// ```
    fn all_reduce_owned<T: Element>(
        &self,
        data: Vec<T>,
        op: ReduceOp,
    ) -> crate::Work<'static, Vec<T>>
    where
        Self::Link: 'static,
    {
        crate::work::all_reduce_owned(self.group(), self.default_timeout(), data, op)
    }

    /// [`Collectives::all_reduce`] out of place: `output` gets the reduction of every rank's
    /// `input`; `input` is not modified.
    fn all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        ops::all_reduce_into(self.group(), self.default_timeout(), input, output, op)
    }

    /// Copies `data` on `root` to every other rank's `data`.
    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        ops::broadcast(self.group(), self.default_timeout(), data, root)
    }

    /// Reduces `data` over all ranks with `op` into `data` on `root`. On the other ranks `data`
    /// serves as scratch space and its contents afterwards are unspecified; see
    /// [`Collectives::reduce_into`] to keep the input.
    fn reduce<T: Element>(&self, data: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        ops::reduce(self.group(), self.default_timeout(), data, op, root)
    }

    /// [`Collectives::reduce`] out of place: `input` is kept; `output` (same length) receives the
    /// result on `root` and is scratch elsewhere.
    fn reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        ops::reduce_into(
            self.group(),
            self.default_timeout(),
            input,
            output,
            op,
            root,
        )
    }

    /// Every rank's `input` (all of one length `k`) concatenated in rank order into every rank's
    /// `output` (`k * world_size` elements).
    fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        ops::all_gather(self.group(), self.default_timeout(), input, output)
    }

    /// Every rank's `input` (length `k`) concatenated in rank order into `output` on `root`
    /// (`k * world_size` elements; pass `None` elsewhere).
    fn gather<T: Element>(&self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()> {
        ops::gather(self.group(), self.default_timeout(), input, output, root)
    }

    /// Block `r` of `input` on `root` (`k * world_size` elements; `None` elsewhere) into rank
    /// `r`'s `output` (`k` elements).
    fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        ops::scatter(self.group(), self.default_timeout(), input, output, root)
    }

    /// Reduces every rank's `input` (`k * world_size` elements) with `op` and leaves block `r` of
    /// the result in rank `r`'s `output` (`k` elements).
    fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        ops::reduce_scatter(self.group(), self.default_timeout(), input, output, op)
    }

    /// Block `j` of this rank's `input` (`k * world_size` elements) goes to rank `j`, landing
    /// in block `r` (this rank's) of its `output`.
    fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        ops::all_to_all(self.group(), self.default_timeout(), input, output)
    }

    /// [`Collectives::all_to_all`] with uneven blocks: `send_counts[j]` elements of `input` (in
    /// rank order) go to rank `j`; `recv_counts[j]` elements arrive from rank `j`. The counts
    /// must agree pairwise across ranks; a disagreement is reported as a mismatch.
    fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (g, t) = (self.group(), self.default_timeout());
        ops::all_to_all_v(g, t, input, send_counts, output, recv_counts)
    }

    /// [`Collectives::all_gather`] with blocks of uneven sizes: rank `r`'s `input` has
    /// `counts[r]` elements, and every rank's `output` gets every block in rank order
    /// (`counts`' sum). Every rank passes the same `counts`.
    fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        uneven::all_gather_v(self.group(), self.default_timeout(), input, output, counts)
    }

    /// [`Collectives::gather`] with blocks of uneven sizes: rank `r`'s `input` (`counts[r]`
    /// elements) lands in block `r` of `output` on `root` (`counts`' sum; `None` elsewhere).
    /// Every rank passes the same `counts`.
    fn gather_v<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        let (g, t) = (self.group(), self.default_timeout());
        uneven::gather_v(g, t, input, output, counts, root)
    }

    /// [`Collectives::scatter`] with blocks of uneven sizes: block `r` of `input` on `root`
    /// (`counts`' sum; `None` elsewhere) into rank `r`'s `output` (`counts[r]` elements).
    /// Every rank passes the same `counts`.
    fn scatter_v<T: Element>(
        &self,
        input: Option<&[T]>,
        counts: &[usize],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let (g, t) = (self.group(), self.default_timeout());
        uneven::scatter_v(g, t, input, counts, output, root)
    }
}

impl<B: Transport + ?Sized> Collectives for B {}

/// A barrier that is a collective: every rank waits until every other has entered it, within
/// `timeout`, and its messages carry the call's descriptor like every collective's, so a barrier
/// that meets another collective on another rank is a
/// [`DistError::CollectiveMismatch`](crate::DistError::CollectiveMismatch) on every rank at once
/// (not a wait until the deadline). Recursive doubling of empty messages over all_reduce's
/// partners where the world is a power of two or from [`BARRIER_DOUBLING_MIN`] ranks (the
/// extra ranks of a world that is not a power of two folded in and out: ⌊log₂ n⌋ + 2 rounds);
/// otherwise dissemination, in round k each rank signalling rank + 2^k and waiting for
/// rank - 2^k (⌈log₂ n⌉ rounds). Either way each rank has heard from all before it leaves.
pub fn barrier<B: Transport + ?Sized>(b: &B, timeout: Duration) -> Result<()> {
    ops::barrier(b.group(), timeout)
}

/// A group is a backend: point-to-point messages over its link (with no meta), its barrier a
/// collective.
impl<L: Link> Backend for Group<L> {
    fn rank(&self) -> usize {
        self.link().rank()
    }

    fn world_size(&self) -> usize {
        self.link().world_size()
    }

    fn default_timeout(&self) -> Duration {
        self.timeout()
    }

    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> Result<()> {
        let deadline =
            crate::transport::deadline_after(Instant::now(), self.timeout(), self.rank(), || {
                format!("send to {dst} (tag {tag}, {} bytes)", data.len())
            })?;
        self.link().send(data, dst, tag, [0; 16], deadline, None)
    }

    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<()> {
        let len = buf.len();
        let deadline =
            crate::transport::deadline_after(Instant::now(), timeout, self.rank(), || {
                format!("recv from {src} (tag {tag}, {len} bytes)")
            })?;
        // SAFETY: the handle is waited on in this statement; it is never leaked. (Tests:
        // `collectives::tests`' point-to-point cases, every TCP receive test.)
        unsafe { self.link().post(buf, src, tag, deadline)? }
            .wait()
            .map(|_| ())
    }

    fn barrier_timeout(&self, timeout: Duration) -> Result<()> {
        ops::barrier(self, timeout)
    }
}

impl<L: Link> Transport for Group<L> {
    type Link = L;

    fn group(&self) -> &Group<L> {
        self
    }
}

#[cfg(test)]
mod tests;

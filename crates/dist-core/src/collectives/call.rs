//! One collective call: its descriptor, deadline and flight-record entry; the messages it sends
//! and receives, each checked against the descriptor; and the explanation of its errors (a
//! mismatch names the rank that differs and how, a failure caused by another rank's abort is
//! reported as that abort). A call that fails tells every other rank.

use std::time::{Duration, Instant};

use crate::backend::{Meta, Tag};
use crate::error::{DistError, Result};
use crate::flight::{OpInfo, OpState};
use crate::group::Group;
use crate::link::{Link, PostedRecv};
use crate::types::{Element, ReduceOp};

use super::consts::COLLECTIVE_TAG;
use super::desc::{Desc, Kind};

/// One collective call in progress: the group, this rank, the descriptor and the deadline.
pub(super) struct Call<'a, L: Link> {
    pub(super) g: &'a Group<L>,
    pub(super) me: usize,
    pub(super) n: usize,
    desc: Desc,
    meta: Meta,
    deadline: Instant,
    /// The call's number in its group, from 1 (its abort notice names it).
    number: u64,
}

/// A receive posted by a call: the link's handle, and what the call's checks need.
pub(super) struct Pending<'b, L: Link + 'b> {
    recv: L::Recv<'b>,
    src: usize,
    tag: Tag,
    len: usize,
}

impl<L: Link> Call<'_, L> {
    pub(super) fn op_text(&self) -> String {
        self.desc.describe()
    }

    /// The call's descriptor, as its messages carry it.
    pub(super) fn meta(&self) -> Meta {
        self.meta
    }

    /// The call's descriptor.
    pub(super) fn desc(&self) -> &Desc {
        &self.desc
    }

    /// The call's deadline.
    pub(super) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The call's number in its group, from 1.
    pub(super) fn number(&self) -> u64 {
        self.number
    }

    /// The first abort notice that ends this call (not one naming a later call).
    pub(super) fn abort_notice(&self) -> Option<crate::link::Notice> {
        self.link().abort_notice_for(COLLECTIVE_TAG, self.number)
    }

    /// This call's error for an abort notice that ends it.
    pub(super) fn aborted(&self, n: crate::link::Notice) -> DistError {
        DistError::Aborted {
            rank: self.me,
            op: self.op_text(),
            origin: n.origin,
            culprit: n.culprit,
            reason: n.reason,
        }
    }

    fn link(&self) -> &L {
        self.g.link()
    }

    /// Sends `data` to `dst` on the collectives' tag.
    pub(super) fn send(&self, data: &[u8], dst: usize) -> Result<()> {
        self.send_on(COLLECTIVE_TAG, data, dst)
    }

    pub(super) fn send_on(&self, tag: Tag, data: &[u8], dst: usize) -> Result<()> {
        self.link()
            .send(data, dst, tag, self.meta, self.deadline, None)
            .map_err(|e| self.explain_link(e))
    }

    /// Receives from `src` on the collectives' tag into `buf`.
    pub(super) fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        self.recv_on(COLLECTIVE_TAG, buf, src)
    }

    pub(super) fn recv_on(&self, tag: Tag, buf: &mut [u8], src: usize) -> Result<()> {
        let p = self.post(tag, buf, src)?;
        self.wait(p)
    }

    /// Posts the receive of the next message from `src` on `tag` into `buf`: it may land there
    /// from now on, until [`Call::wait`] (or the handle's drop, which withdraws it).
    ///
    /// The algorithms of this module wait on or drop every handle this returns, on every path
    /// (`?` drops it); none is ever leaked, which is what [`Link::post`] asks.
    pub(super) fn post<'b>(
        &'b self,
        tag: Tag,
        buf: &'b mut [u8],
        src: usize,
    ) -> Result<Pending<'b, L>> {
        let len = buf.len();
        // SAFETY: the handle goes into a `Pending`, which this module's algorithms wait on or
        // drop on every path and never leak (see above). (Tests: `collectives::tests` over
        // `MemLink`, their failing-rank cases included; every TCP collective test.)
        let recv = unsafe { self.link().post(buf, src, tag, self.deadline) }
            .map_err(|e| self.explain(e, src, tag, len))?;
        Ok(Pending {
            recv,
            src,
            tag,
            len,
        })
    }

    /// Sends `data` to `dst` on `p`'s tag while `p` may be arriving: a link can move `p`'s
    /// bytes whenever the send waits for room. An error is explained as `p`'s would be.
    pub(super) fn send_beside(&self, data: &[u8], dst: usize, p: &Pending<'_, L>) -> Result<()> {
        self.link()
            .send(data, dst, p.tag, self.meta, self.deadline, Some(&p.recv))
            .map_err(|e| self.explain(e, p.src, p.tag, p.len))
    }

    /// Waits for a posted receive and checks its descriptor against this call's.
    pub(super) fn wait(&self, p: Pending<'_, L>) -> Result<()> {
        let (src, tag, len) = (p.src, p.tag, p.len);
        match p.recv.wait() {
            Ok(m) => self.check(&m, src),
            Err(e) => Err(self.explain(e, src, tag, len)),
        }
    }

    /// One exchange: receive from `src` into `recv` while sending `send` to `dst`, on `tag`.
    pub(super) fn send_recv_on(
        &self,
        tag: Tag,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
    ) -> Result<()> {
        let p = self.post(tag, recv, src)?;
        self.send_beside(send, dst, &p)?;
        self.wait(p)
    }

    /// [`Call::send_recv_on`] on the collectives' tag.
    pub(super) fn send_recv(
        &self,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
    ) -> Result<()> {
        self.send_recv_on(COLLECTIVE_TAG, send, dst, recv, src)
    }

    fn check(&self, got: &Meta, src: usize) -> Result<()> {
        if *got == self.meta {
            return Ok(());
        }
        Err(DistError::CollectiveMismatch {
            rank: self.me,
            op: self.op_text(),
            peer: src,
            detail: self.desc.differences(&Desc::decode(got)),
        })
    }

    /// The collective's error for a link error on a receive from `src` on `tag` of `expected`
    /// bytes. A size mismatch is a disagreement between the calls: say how they differ. A peer
    /// that left or went quiet after another rank aborted the call is reported as that abort,
    /// the cause.
    fn explain(&self, e: DistError, src: usize, tag: Tag, expected: usize) -> DistError {
        match e {
            DistError::SizeMismatch { got, .. } => {
                let detail = match self.link().peek(src, tag) {
                    Some((_, m)) if m != self.meta => self.desc.differences(&Desc::decode(&m)),
                    _ => format!(
                        "it sends {got} bytes where this rank expects {expected} (counts disagree)"
                    ),
                };
                DistError::CollectiveMismatch {
                    rank: self.me,
                    op: self.op_text(),
                    peer: src,
                    detail,
                }
            }
            other => self.explain_link(other),
        }
    }

    /// A link error of this call (a send's or a receive's), said as this call rather than as
    /// the link's wait that noticed it. A peer that left or went quiet after a rank aborted
    /// this call (or an earlier one) is reported as that abort, the cause. (A notice for a
    /// later call is no cause: its sender had done its part of this one.)
    fn explain_link(&self, e: DistError) -> DistError {
        if matches!(e, DistError::PeerGone { .. } | DistError::Timeout { .. })
            && let Some(n) = self.abort_notice()
        {
            return self.aborted(n);
        }
        match e {
            e @ (DistError::Timeout { .. }
            | DistError::PeerGone { .. }
            | DistError::Aborted { .. }
            | DistError::PeerUnresponsive { .. }) => e.map_op(|_| self.op_text()),
            other => other,
        }
    }

    pub(super) fn invalid(&self, reason: String) -> DistError {
        DistError::InvalidArgument {
            rank: self.me,
            op: self.op_text(),
            reason,
        }
    }

    pub(super) fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.n {
            return Err(DistError::InvalidRank {
                rank: self.me,
                op: self.op_text(),
                given: root,
                world_size: self.n,
            });
        }
        Ok(())
    }

    /// `k * world_size`, the length of a buffer of one block per rank; an error naming the
    /// buffer when that does not fit in a `usize`.
    pub(super) fn blocks(&self, what: &str, k: usize) -> Result<usize> {
        k.checked_mul(self.n).ok_or_else(|| {
            self.invalid(format!(
                "{what} would need {k} x {} elements, more than a usize holds",
                self.n
            ))
        })
    }

    /// The sum of `counts`; an error naming them when it overflows a `usize`.
    pub(super) fn total(&self, what: &str, counts: &[usize]) -> Result<usize> {
        counts
            .iter()
            .try_fold(0usize, |a, x| a.checked_add(*x))
            .ok_or_else(|| {
                self.invalid(format!(
                    "{what} {counts:?} add up to more than a usize holds"
                ))
            })
    }

    pub(super) fn check_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(self.invalid(format!("{what} has {got} elements, expected {want}")));
        }
        Ok(())
    }

    pub(super) fn check_op<T: Element>(&self, op: ReduceOp) -> Result<()> {
        op.check(T::DTYPE).map_err(|r| self.invalid(r))
    }

    /// `acc = acc op other`, elementwise.
    pub(super) fn reduce<T: Element>(
        &self,
        acc: &mut [T],
        other: &[T],
        op: ReduceOp,
    ) -> Result<()> {
        T::reduce_into(op, acc, other).map_err(|e| self.invalid(e))
    }

    /// The ring's piece, in elements, for one step's message.
    pub(super) fn ring_piece<T: Element>(&self) -> usize {
        (self.g.tuning().ring_piece() / std::mem::size_of::<T>()).max(1)
    }
}

/// Applies the scaling that `Avg` needs after a sum.
pub(super) fn finish<T: Element>(x: &mut [T], op: ReduceOp, n: usize) {
    if matches!(op, ReduceOp::Avg) {
        T::scale(x, None, n);
    }
}

/// Scales a rank's input for `PreMulSum`, before the sum.
pub(super) fn premul<T: Element>(x: &mut [T], op: ReduceOp) {
    if let ReduceOp::PreMulSum(s) = op {
        T::scale(x, Some(s), 1);
    }
}

/// What a collective is: its kind, the count its descriptor carries, its reduce op and root.
#[derive(Clone, Copy)]
pub(super) struct What {
    pub(super) kind: Kind,
    pub(super) count: usize,
    pub(super) op: Option<ReduceOp>,
    pub(super) root: usize,
}

/// Runs one collective of elements `T` on `g` with a deadline `timeout` from now: refuses at
/// once if another thread is inside a call on `g` or an earlier one aborted (after this
/// thread's queued async work, if it has a scope open on `g`); records it in the link's flight
/// recorder; on failure, tells every other rank, so that none of them waits for this one until
/// its deadline.
pub(super) fn run<L: Link, T: Element, R>(
    g: &Group<L>,
    timeout: Duration,
    what: What,
    f: impl FnOnce(&Call<'_, L>) -> Result<R>,
) -> Result<R> {
    let described = |seq: u64| Desc {
        kind: what.kind as u8,
        dtype: T::DTYPE as u8,
        op: what.op.map_or(0, ReduceOp::code),
        root: (what.root as u32) & 0x00ff_ffff,
        seq: seq as u16,
        count: what.count as u64,
    };
    let me = g.link().rank();
    let entry = match g
        .occupancy()
        .enter(me, what.kind as u8, true, || described(0).describe())
    {
        Ok(entry) => entry,
        Err(e) => {
            let e = g.link().label_error(e);
            // The other ranks must not wait for this call, and the call inside this group
            // may be matched against this one elsewhere: every rank stops.
            abort_all(g, &e, None);
            return Err(e);
        }
    };
    let r = run_entered::<L, T, R>(g, timeout, what, described, f);
    if g.occupancy().leave(entry) && r.is_ok() {
        let e = crate::work::Occupancy::refused_meanwhile(me, described(0).describe());
        let e = g.link().label_error(e);
        abort_all(g, &e, None);
        return Err(e);
    }
    r
}

/// [`run`] once the call is inside the group.
fn run_entered<L: Link, T: Element, R>(
    g: &Group<L>,
    timeout: Duration,
    what: What,
    described: impl Fn(u64) -> Desc,
    f: impl FnOnce(&Call<'_, L>) -> Result<R>,
) -> Result<R> {
    let What {
        kind, count, root, ..
    } = what;
    let seq = g.next_seq();
    let desc = described(seq);
    // One read of the clock for the record and the deadline.
    let started = Instant::now();
    // Numbered from 1 in the record (0 marks point-to-point operations there).
    let entry = g.link().flight().map(|f| {
        let info = OpInfo {
            seq: seq + 1,
            op: kind.name(),
            dtype: if kind == Kind::Barrier {
                ""
            } else {
                T::DTYPE.name()
            },
            count,
            peer: kind.has_root().then_some(root),
        };
        (f, f.begin_at(info, OpState::Started, started))
    });
    // Said the way the link says its errors (a sub-group names itself) before anything else
    // sees them: the record, the abort sent to the other ranks, the caller.
    let r = run_call(g, desc, seq + 1, (started, timeout), f).map_err(|e| g.link().label_error(e));
    if let Some((f, e)) = entry {
        f.finish(
            e,
            r.as_ref()
                .map(|_| ())
                .map_err(|e| e as &dyn std::fmt::Display),
        );
    }
    if let Err(e) = &r {
        // Pass every failure on, heard-of ones included: a rank that has not heard yet must
        // hear it from this one before it sees this one leave.
        abort_all(g, e, Some(seq + 1));
    }
    r
}

/// The body of [`run`]: the call's deadline (`timeout` from `started`), its run, and its error.
fn run_call<L: Link, R>(
    g: &Group<L>,
    desc: Desc,
    number: u64,
    (started, timeout): (Instant, Duration),
    f: impl FnOnce(&Call<'_, L>) -> Result<R>,
) -> Result<R> {
    let link = g.link();
    let deadline =
        crate::transport::deadline_after(started, timeout, link.rank(), || desc.describe())?;
    let call = Call {
        g,
        me: link.rank(),
        n: link.world_size(),
        desc,
        meta: desc.encode(),
        deadline,
        number,
    };
    // From here the link's waits end only for notices of this call or an earlier one (or
    // naming none): a notice for a later call comes from a rank whose part of this one is done.
    link.enter_call(COLLECTIVE_TAG, number);
    if let Some(n) = call.abort_notice() {
        return Err(call.aborted(n));
    }
    if let Some(a) = link.arena() {
        a.set_call(call.meta);
    }
    let mut r = f(&call);
    if r.is_ok()
        && let Some(n) = call.abort_notice()
    {
        // Another rank failed this call (or an earlier one) after this rank's part was done.
        r = Err(call.aborted(n));
    }
    if let Err(e @ DistError::Timeout { .. }) = r {
        // Who is behind: where the ranks are, as the link knows it.
        r = Err(match link.positions() {
            Some(p) => e.map_op(|op| format!("{op} #{number} [{p}]")),
            None => e,
        });
    }
    r
}

/// Tells every rank that call number `number` (where it has one) failed with `e`, naming the
/// rank at fault where `e` names one (a peer gone or unresponsive, or the origin of an abort
/// passed on).
///
/// The notice names the call (so that ranks still in earlier calls finish them) when this
/// rank's failure is its own (its part of every earlier call is done), and passes on the call
/// an abort heard of named. A peer gone or silent, or a timeout (some rank, perhaps the one
/// waited on, is behind), names none: such a rank may have left an earlier call undone, and
/// every rank stops at once.
/// An abort heard of is passed on as it came (its origin and the first error), not wrapped.
pub(crate) fn abort_all<L: Link>(g: &Group<L>, e: &DistError, number: Option<u64>) {
    match e {
        DistError::PeerGone { peer, .. } | DistError::PeerUnresponsive { peer, .. } => {
            g.abort_call(COLLECTIVE_TAG, None, &e.to_string(), Some(*peer))
        }
        // Its culprit stays the only rank named at fault: an origin that failed its own call
        // is passed on as the origin, not as a rank known failed.
        DistError::Aborted {
            origin,
            culprit,
            reason,
            ..
        } => {
            let named = number
                .and_then(|n| g.link().abort_notice_for(COLLECTIVE_TAG, n))
                .and_then(|n| n.call);
            match culprit {
                Some(c) => g.abort_call(COLLECTIVE_TAG, named, reason, Some(*c)),
                None => g.pass_on_call(COLLECTIVE_TAG, named, reason, *origin),
            }
        }
        DistError::Timeout { .. } => g.abort_call(COLLECTIVE_TAG, None, &e.to_string(), None),
        // A revoked group's failure, passed on as the revocation came.
        DistError::Revoked {
            culprit, reason, ..
        } => g.abort_call(COLLECTIVE_TAG, None, reason, *culprit),
        _ => g.abort_call(COLLECTIVE_TAG, number, &e.to_string(), None),
    }
}

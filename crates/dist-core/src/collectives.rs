//! Collectives on host buffers, written once against [`Transport`] so that every backend that
//! moves bytes gets them.
//!
//! Algorithms, for any world size (not only powers of two):
//!
//! | collective | small messages | large messages |
//! | --- | --- | --- |
//! | all_reduce | recursive doubling (non-powers of two fold the extra ranks in and out) | ring reduce-scatter + ring all-gather |
//! | broadcast | binomial tree | pipelined chain in 1 MiB chunks |
//! | reduce | binomial tree | ring reduce-scatter, then each segment to the root |
//! | all_gather | ring | ring |
//! | reduce_scatter | ring | ring |
//! | all_to_all(v) | pairwise exchange | pairwise exchange |
//! | gather, scatter | direct to / from the root | direct |
//!
//! Within a step the receive is posted before the send starts, so both directions move at
//! once and the payload lands in place. Every message carries a 16-byte descriptor of the call
//! (collective, element type, count, reduce op, root, sequence number) in its header: a rank
//! whose call differs is found by the first rank that hears from it, with no extra round trip,
//! and that rank tells every other, so every rank returns an error instead of hanging or
//! computing garbage. After such an error (or a dead peer, or a timeout) the backend's
//! collectives stay aborted: create a new backend to go on.

use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

use crate::backend::{Meta, Tag, Transport};
use crate::error::{DistError, Result};
use crate::flight::{OpInfo, OpState, Position};
use crate::types::{DType, Element, ReduceOp};

/// The tag every collective message travels on. Collectives are called in the same order on
/// every rank, and messages between two ranks on one tag keep their order, so one tag suffices.
pub const COLLECTIVE_TAG: Tag = Tag::system(2);
/// The tag of the second ring of a two-lane collective (see [`Transport::lanes`]), so that its
/// messages can never be taken for the first ring's, even where both rings join the same ranks.
pub const SECOND_RING_TAG: Tag = Tag::system(3);

/// all_reduce messages up to this size use recursive doubling; larger ones the ring.
pub const ALL_REDUCE_RING_MIN: usize = 64 << 10;
/// broadcast messages up to this size use the binomial tree; larger ones the pipelined chain.
pub const BROADCAST_CHAIN_MIN: usize = 256 << 10;
/// reduce messages up to this size use the binomial tree; larger ones the ring.
pub const REDUCE_RING_MIN: usize = 256 << 10;
/// The largest piece of a ring step: small enough to stay in cache between its arrival and
/// its reduction.
pub const RING_PIECE: usize = 256 << 10;
/// all_reduce, reduce_scatter and all_gather moving this many bytes in all (the buffer, the
/// input, the output) run as two rings at once where the transport has two lanes; below it,
/// handing half the work to the other thread costs more than it saves (all_reduce on 32
/// cores: 1 MiB 0.51 ms with one ring, 0.57 ms with two; 2 MiB 1.04 and 0.88).
pub const TWO_RINGS_MIN: usize = 2 << 20;
/// all_gather, which reduces nothing, gains from a second ring only later (on 32 cores, 4 MiB:
/// 4.2 GB/s busbw with one ring, 3.9 with two; 16 MiB: 3.5 and 4.1).
pub const ALL_GATHER_TWO_RINGS_MIN: usize = 16 << 20;
/// broadcast runs two chains only from here (on 32 cores, 8 MiB: 4.7 GB/s with one chain, 4.1
/// with two; 16 MiB: even; 32 and 64 MiB: 3.9 and 3.6 with one, 4.4 and 4.3 with two).
pub const BROADCAST_TWO_CHAINS_MIN: usize = 32 << 20;
/// The chunk of the pipelined broadcast.
pub const CHAIN_CHUNK: usize = 1 << 20;

/// Which collective a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Kind {
    /// [`Collectives::all_reduce`]
    AllReduce = 1,
    /// [`Collectives::broadcast`]
    Broadcast = 2,
    /// [`Collectives::reduce`]
    Reduce = 3,
    /// [`Collectives::all_gather`]
    AllGather = 4,
    /// [`Collectives::gather`]
    Gather = 5,
    /// [`Collectives::scatter`]
    Scatter = 6,
    /// [`Collectives::reduce_scatter`]
    ReduceScatter = 7,
    /// [`Collectives::all_to_all`]
    AllToAll = 8,
    /// [`Collectives::all_to_all_v`]
    AllToAllV = 9,
    /// [`barrier`]: every rank waits for every other.
    Barrier = 10,
}

impl Kind {
    const ALL: [Kind; 10] = [
        Kind::AllReduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
        Kind::Gather,
        Kind::Scatter,
        Kind::ReduceScatter,
        Kind::AllToAll,
        Kind::AllToAllV,
        Kind::Barrier,
    ];

    /// The collective's name, as in `all_reduce`.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
            Kind::AllToAllV => "all_to_all_v",
            Kind::Barrier => "barrier",
        }
    }

    fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == c)
    }

    fn has_root(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }

    fn has_op(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }
}

/// The descriptor of one collective call, as it travels in every message's meta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Desc {
    kind: u8,
    dtype: u8,
    op: u8,
    root: u32,
    seq: u16,
    count: u64,
}

impl Desc {
    fn encode(&self) -> Meta {
        let mut m = [0u8; 16];
        m[0] = self.kind;
        m[1] = self.dtype;
        m[2] = self.op;
        m[3..6].copy_from_slice(&self.root.to_le_bytes()[..3]);
        m[6..8].copy_from_slice(&self.seq.to_le_bytes());
        m[8..16].copy_from_slice(&self.count.to_le_bytes());
        m
    }

    fn decode(m: &Meta) -> Desc {
        Desc {
            kind: m[0],
            dtype: m[1],
            op: m[2],
            root: u32::from_le_bytes([m[3], m[4], m[5], 0]),
            seq: u16::from_le_bytes([m[6], m[7]]),
            count: u64::from_le_bytes(m[8..16].try_into().expect("8 bytes")),
        }
    }

    fn kind_name(&self) -> String {
        Kind::from_code(self.kind)
            .map_or_else(|| format!("unknown op {}", self.kind), |k| k.name().into())
    }

    fn dtype_name(&self) -> String {
        DType::from_code(self.dtype)
            .map_or_else(|| format!("type {}", self.dtype), |d| d.to_string())
    }

    fn op_name(&self) -> &'static str {
        [
            "-",
            "sum",
            "prod",
            "min",
            "max",
            "avg",
            "premulsum",
            "band",
            "bor",
            "bxor",
        ]
        .get(self.op as usize)
        .copied()
        .unwrap_or("?")
    }

    /// `all_reduce(f32 x 100, sum)`, `barrier`.
    fn describe(&self) -> String {
        if self.kind == Kind::Barrier as u8 {
            return Kind::Barrier.name().into();
        }
        let mut s = format!(
            "{}({} x {}",
            self.kind_name(),
            self.dtype_name(),
            self.count
        );
        let kind = Kind::from_code(self.kind);
        if kind.is_some_and(Kind::has_op) {
            s += &format!(", {}", self.op_name());
        }
        if kind.is_some_and(Kind::has_root) {
            s += &format!(", root {}", self.root);
        }
        s + ")"
    }

    /// How `theirs` differs from this (ours), for the error message.
    fn differences(&self, theirs: &Desc) -> String {
        let mut d = Vec::new();
        if self.kind != theirs.kind {
            d.push(format!(
                "it called {} where this rank called {}",
                theirs.kind_name(),
                self.kind_name()
            ));
        } else {
            if self.dtype != theirs.dtype {
                d.push(format!(
                    "element type {} vs {} here",
                    theirs.dtype_name(),
                    self.dtype_name()
                ));
            }
            if self.count != theirs.count {
                d.push(format!("count {} vs {} here", theirs.count, self.count));
            }
            if self.op != theirs.op {
                d.push(format!(
                    "reduce op {} vs {} here",
                    theirs.op_name(),
                    self.op_name()
                ));
            }
            if self.root != theirs.root {
                d.push(format!("root {} vs {} here", theirs.root, self.root));
            }
        }
        if self.seq != theirs.seq && d.is_empty() {
            d.push(format!(
                "it is at collective #{} and this rank at #{} (a rank skipped or added a collective)",
                // Numbered from 1, as in the flight record (the descriptor keeps 16 bits).
                u32::from(theirs.seq) + 1,
                u32::from(self.seq) + 1
            ));
        }
        if d.is_empty() {
            d.push("message sizes differ".into());
        }
        format!("{} ({})", d.join(", "), theirs.describe())
    }
}

thread_local! {
    /// Scratch space reused across calls, so that no collective allocates per step (nor, once
    /// warm, per call). `u64` backing keeps it aligned for every element type.
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a scratch slice of `len` elements.
fn with_scratch<T: Element, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let bytes = len * std::mem::size_of::<T>();
    let words = bytes.div_ceil(8);
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < words {
                v.resize(words, 0);
            }
            let b: &mut [u8] = bytemuck::cast_slice_mut(&mut v[..words]);
            f(bytemuck::cast_slice_mut(&mut b[..bytes]))
        }
        // Only if a collective runs inside another on one thread: use fresh memory.
        Err(_) => {
            let mut v = vec![0u64; words];
            let b: &mut [u8] = bytemuck::cast_slice_mut(&mut v[..]);
            f(bytemuck::cast_slice_mut(&mut b[..bytes]))
        }
    })
}

fn bytes<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn bytes_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

/// Two disjoint ranges of one slice, the first shared and the second mutable.
fn split_pair<T>(
    x: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.start < b.start {
        let (lo, hi) = x.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = x.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// The element range of segment `i` when `count` elements are cut into `n` near-equal parts.
fn segment(count: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    // 128-bit so that huge counts times n cannot overflow.
    let at = |k: usize| (k as u128 * count as u128 / n as u128) as usize;
    at(i)..at(i + 1)
}

/// One collective call in progress: the backend, this rank, the descriptor and the deadline.
struct Call<'a, B: Transport + ?Sized> {
    b: &'a B,
    me: usize,
    n: usize,
    desc: Desc,
    meta: Meta,
    deadline: Instant,
}

impl<B: Transport + ?Sized> Call<'_, B> {
    fn op_text(&self) -> String {
        self.desc.describe()
    }

    fn send(&self, data: &[u8], dst: usize) -> Result<()> {
        self.send_on(COLLECTIVE_TAG, data, dst)
    }

    fn send_on(&self, tag: Tag, data: &[u8], dst: usize) -> Result<()> {
        self.b.send_meta(data, dst, tag, self.meta)
    }

    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        self.recv_on(COLLECTIVE_TAG, buf, src)
    }

    fn recv_on(&self, tag: Tag, buf: &mut [u8], src: usize) -> Result<()> {
        let len = buf.len();
        match self.b.recv_meta(buf, src, tag, self.deadline) {
            Ok(m) => self.check(&m, src),
            Err(e) => Err(self.explain(e, src, tag, len)),
        }
    }

    fn send_recv(&self, send: &[u8], dst: usize, recv: &mut [u8], src: usize) -> Result<()> {
        self.send_recv_on(COLLECTIVE_TAG, send, dst, recv, src)
    }

    fn send_recv_on(
        &self,
        tag: Tag,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
    ) -> Result<()> {
        self.send_recv_while(tag, (send, dst), (recv, src), &mut || Ok(()))
    }

    /// [`Call::send_recv_on`], running `meanwhile` while the transfers are in flight.
    fn send_recv_while(
        &self,
        tag: Tag,
        (send, dst): (&[u8], usize),
        (recv, src): (&mut [u8], usize),
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let len = recv.len();
        match self.b.send_recv_meta_while(
            (send, dst),
            (recv, src),
            tag,
            self.meta,
            self.deadline,
            meanwhile,
        ) {
            Ok(m) => self.check(&m, src),
            Err(e) => Err(self.explain(e, src, tag, len)),
        }
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

    /// A size mismatch is a disagreement between the calls: say how they differ. A peer that
    /// left or went quiet after another rank aborted the call is reported as that abort, the
    /// cause.
    /// The collective's error for a transport error on a receive from `src` on `tag`.
    fn explain(&self, e: DistError, src: usize, tag: Tag, expected: usize) -> DistError {
        if matches!(e, DistError::PeerGone { .. } | DistError::Timeout { .. })
            && let Some((origin, reason)) = self.b.abort_notice()
        {
            return DistError::Aborted {
                rank: self.me,
                op: self.op_text(),
                origin,
                reason,
            };
        }
        match e {
            DistError::SizeMismatch { got, .. } => {
                let detail = match self.b.peek_meta(src, tag) {
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
            DistError::Timeout {
                rank, peer, waited, ..
            } => DistError::Timeout {
                rank,
                op: self.op_text(),
                peer,
                waited,
            },
            DistError::PeerGone {
                rank, peer, cause, ..
            } => DistError::PeerGone {
                rank,
                peer,
                op: self.op_text(),
                cause,
            },
            DistError::Aborted {
                rank,
                origin,
                reason,
                ..
            } => DistError::Aborted {
                rank,
                op: self.op_text(),
                origin,
                reason,
            },
            DistError::PeerUnresponsive {
                rank,
                peer,
                silent,
                position,
                ..
            } => DistError::PeerUnresponsive {
                rank,
                peer,
                op: self.op_text(),
                silent,
                position,
            },
            other => other,
        }
    }

    fn invalid(&self, reason: String) -> DistError {
        DistError::InvalidArgument {
            rank: self.me,
            op: self.op_text(),
            reason,
        }
    }

    fn check_root(&self, root: usize) -> Result<()> {
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
    fn blocks(&self, what: &str, k: usize) -> Result<usize> {
        k.checked_mul(self.n).ok_or_else(|| {
            self.invalid(format!(
                "{what} would need {k} x {} elements, more than a usize holds",
                self.n
            ))
        })
    }

    /// The sum of `counts`; an error naming them when it overflows a `usize`.
    fn total(&self, what: &str, counts: &[usize]) -> Result<usize> {
        counts
            .iter()
            .try_fold(0usize, |a, x| a.checked_add(*x))
            .ok_or_else(|| {
                self.invalid(format!(
                    "{what} {counts:?} add up to more than a usize holds"
                ))
            })
    }

    fn check_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(self.invalid(format!("{what} has {got} elements, expected {want}")));
        }
        Ok(())
    }

    fn check_op<T: Element>(&self, op: ReduceOp) -> Result<()> {
        op.check(T::DTYPE).map_err(|r| self.invalid(r))
    }
}

/// Runs one collective: refuses at once if an earlier one aborted; on failure, tells every other
/// rank, so that none of them waits for this one until its deadline.
fn run<B: Transport + ?Sized, T: Element, R>(
    b: &B,
    kind: Kind,
    count: usize,
    op: Option<ReduceOp>,
    root: usize,
    f: impl FnOnce(&Call<'_, B>) -> Result<R>,
) -> Result<R> {
    run_within::<B, T, R>(b, kind, count, op, root, b.default_timeout(), f)
}

/// [`run`] with a deadline `timeout` from now.
fn run_within<B: Transport + ?Sized, T: Element, R>(
    b: &B,
    kind: Kind,
    count: usize,
    op: Option<ReduceOp>,
    root: usize,
    timeout: std::time::Duration,
    f: impl FnOnce(&Call<'_, B>) -> Result<R>,
) -> Result<R> {
    let seq = b.next_collective();
    let desc = Desc {
        kind: kind as u8,
        dtype: T::DTYPE as u8,
        op: op.map_or(0, ReduceOp::code),
        root: (root as u32) & 0x00ff_ffff,
        seq: seq as u16,
        count: count as u64,
    };
    // Numbered from 1 in the record (0 marks point-to-point operations there).
    let entry = b.flight().map(|f| {
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
        (f, f.begin(info, OpState::Started))
    });
    let r = run_call(b, desc, seq + 1, timeout, f);
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
        abort_all(b, e);
    }
    r
}

/// The body of [`run_within`]: the call's deadline, its run, and its error.
fn run_call<B: Transport + ?Sized, R>(
    b: &B,
    desc: Desc,
    number: u64,
    timeout: std::time::Duration,
    f: impl FnOnce(&Call<'_, B>) -> Result<R>,
) -> Result<R> {
    let deadline = crate::deadline_after(Instant::now(), timeout, b.rank(), || desc.describe())?;
    let call = Call {
        b,
        me: b.rank(),
        n: b.world_size(),
        desc,
        meta: desc.encode(),
        deadline,
    };
    if let Some((origin, reason)) = b.abort_notice() {
        return Err(DistError::Aborted {
            rank: call.me,
            op: call.op_text(),
            origin,
            reason,
        });
    }
    let mut r = f(&call);
    if r.is_ok()
        && let Some((origin, reason)) = b.abort_notice()
    {
        // Another rank failed this call (or an earlier one) after this rank's part was done.
        r = Err(DistError::Aborted {
            rank: call.me,
            op: call.op_text(),
            origin,
            reason,
        });
    }
    if let Err(DistError::Timeout {
        rank,
        op,
        peer,
        waited,
    }) = r
    {
        // Who is behind: where the ranks are, as the transport knows it.
        let op = match b.positions() {
            Some(p) => format!("{op} #{number} [{p}]"),
            None => op,
        };
        r = Err(DistError::Timeout {
            rank,
            op,
            peer,
            waited,
        });
    }
    r
}

/// A barrier that is a collective: every rank waits until every other has entered it, within
/// `timeout`, and its messages carry the call's descriptor like every collective's, so a barrier
/// that meets another collective on another rank is a [`DistError::CollectiveMismatch`] on every
/// rank at once (not a wait until the deadline). Dissemination: in round k each rank signals
/// rank + 2^k and waits for rank - 2^k; after ceil(log2 n) rounds each has heard from all.
pub fn barrier<B: Transport + ?Sized>(b: &B, timeout: std::time::Duration) -> Result<()> {
    run_within::<B, u8, ()>(b, Kind::Barrier, 0, None, 0, timeout, |c| {
        let mut d = 1;
        while d < c.n {
            c.send_recv(&[], (c.me + d) % c.n, &mut [], (c.me + c.n - d) % c.n)?;
            d *= 2;
        }
        Ok(())
    })
}

/// A rank's position as a heartbeat carries it: the collective's sequence number (0: none),
/// its state (1 queued, 2 started, 3 done, 4 failed) and its kind's code.
pub fn position_to_wire(p: Option<Position>) -> (u64, u8, u8) {
    let Some(p) = p else { return (0, 0, 0) };
    let state = match p.state {
        OpState::Queued => 1,
        OpState::Started => 2,
        OpState::Done => 3,
        OpState::Failed => 4,
    };
    let kind = Kind::ALL
        .into_iter()
        .find(|k| k.name() == p.op)
        .map_or(0, |k| k as u8);
    (p.seq, state, kind)
}

/// The inverse of [`position_to_wire`]; `None` for "none" and for what it cannot read.
pub fn position_from_wire(seq: u64, state: u8, kind: u8) -> Option<Position> {
    let state = match state {
        1 => OpState::Queued,
        2 => OpState::Started,
        3 => OpState::Done,
        4 => OpState::Failed,
        _ => return None,
    };
    let op = Kind::from_code(kind)?.name();
    (seq != 0).then_some(Position { seq, op, state })
}

/// Tells every rank that this call failed with `e`, naming the rank at fault where `e` names
/// one (a peer gone or unresponsive, or the origin of an abort passed on).
/// An abort heard of is passed on as it came (its origin and the first error), not wrapped.
fn abort_all<B: Transport + ?Sized>(b: &B, e: &DistError) {
    match e {
        DistError::PeerGone { peer, .. } | DistError::PeerUnresponsive { peer, .. } => {
            b.broadcast_abort_naming(COLLECTIVE_TAG, &e.to_string(), Some(*peer))
        }
        DistError::Aborted { origin, reason, .. } => {
            b.broadcast_abort_naming(COLLECTIVE_TAG, reason, Some(*origin))
        }
        _ => b.broadcast_abort_naming(COLLECTIVE_TAG, &e.to_string(), None),
    }
}

/// Applies the scaling that `Avg` and `PreMulSum` need after (or before) a sum.
fn finish<T: Element>(x: &mut [T], op: ReduceOp, n: usize) {
    if matches!(op, ReduceOp::Avg) {
        T::scale(x, None, n);
    }
}

fn premul<T: Element>(x: &mut [T], op: ReduceOp) {
    if let ReduceOp::PreMulSum(s) = op {
        T::scale(x, Some(s), 1);
    }
}

fn reduce<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    acc: &mut [T],
    other: &[T],
    op: ReduceOp,
) -> Result<()> {
    T::reduce_into(op, acc, other).map_err(|e| c.invalid(e))
}

/// Recursive doubling over the largest power of two `p <= n`; the first `2 (n - p)` ranks pair
/// up first (odd ranks take their even neighbour's data) and get the result back at the end.
fn all_reduce_doubling<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    with_scratch::<T, _>(data.len(), |tmp| {
        let virt = if me < 2 * rem {
            if me % 2 == 0 {
                c.send(bytes(data), me + 1)?;
                None
            } else {
                c.recv(bytes_mut(tmp), me - 1)?;
                reduce(c, data, tmp, op)?;
                Some(me / 2)
            }
        } else {
            Some(me - rem)
        };
        if let Some(v) = virt {
            let mut mask = 1;
            while mask < p {
                let pv = v ^ mask;
                let partner = if pv < rem { pv * 2 + 1 } else { pv + rem };
                c.send_recv(bytes(data), partner, bytes_mut(tmp), partner)?;
                // a op b == b op a exactly for these ops, so both partners hold the same bits.
                reduce(c, data, tmp, op)?;
                mask <<= 1;
            }
        }
        if me < 2 * rem {
            if me % 2 == 1 {
                c.send(bytes(data), me - 1)?;
            } else {
                c.recv(bytes_mut(data), me + 1)?;
            }
        }
        Ok(())
    })?;
    finish(data, op, n);
    Ok(())
}

/// One ring through all ranks: this rank's position on it, its neighbours and the tag its
/// messages travel on. Segment `i` of a ring's data belongs to position `i`.
#[derive(Clone, Copy, Debug)]
struct Ring {
    pos: usize,
    right: usize,
    left: usize,
    tag: Tag,
    reversed: bool,
}

impl Ring {
    /// Ranks in order: position `r` is rank `r`, sending to `r + 1`.
    fn forward(me: usize, n: usize) -> Ring {
        Ring {
            pos: me,
            right: (me + 1) % n,
            left: (me + n - 1) % n,
            tag: COLLECTIVE_TAG,
            reversed: false,
        }
    }

    /// Ranks in reverse order, on the second ring's tag: position `p` is rank `(n - p) % n`,
    /// sending to rank `r - 1`. Beside a forward ring it uses each connection's other direction.
    fn backward(me: usize, n: usize) -> Ring {
        Ring {
            pos: (n - me) % n,
            right: (me + n - 1) % n,
            left: (me + 1) % n,
            tag: SECOND_RING_TAG,
            reversed: true,
        }
    }

    /// The position of `rank` on this ring of `n` ranks.
    fn position_of(&self, rank: usize, n: usize) -> usize {
        if self.reversed { (n - rank) % n } else { rank }
    }
}

/// The ring's piece, in elements, for one step's message.
fn ring_piece<T: Element>(c: &Call<'_, impl Transport + ?Sized>) -> usize {
    (c.b.ring_piece() / std::mem::size_of::<T>()).max(1)
}

/// `data` cut into `n` near-equal segments, in order (segment `i` is `segment(len, n, i)`).
fn segments<T>(data: &mut [T], n: usize) -> Vec<&mut [T]> {
    let len = data.len();
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    for i in 0..n {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(segment(len, n, i).len());
        out.push(head);
        rest = tail;
    }
    out
}

/// `buf`'s `n` blocks of `k` elements, each cut in two: the first parts in block order for a
/// forward ring, and the second parts ordered for a backward ring (its position `p` gets block
/// `(n - p) % n`, the block of the rank at that position). With these, rank `r` owns (or ends
/// with) both halves of block `r`.
fn halves<T>(buf: &mut [T], n: usize, k: usize) -> (Vec<&mut [T]>, Vec<&mut [T]>) {
    let h = k / 2;
    let (mut first, mut second) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for block in segments(buf, n) {
        let (a, b) = block.split_at_mut(h);
        first.push(a);
        second.push(b);
    }
    let backward = (0..n)
        .map(|p| std::mem::take(&mut second[(n - p) % n]))
        .collect();
    (first, backward)
}

/// Two distinct segments: `a` shared and `b` mutable.
fn seg_pair<'s, T>(segs: &'s mut [&mut [T]], a: usize, b: usize) -> (&'s [T], &'s mut [T]) {
    debug_assert_ne!(a, b, "one segment twice");
    if a < b {
        let (lo, hi) = segs.split_at_mut(b);
        (&*lo[a], &mut *hi[0])
    } else {
        let (lo, hi) = segs.split_at_mut(a);
        (&*hi[0], &mut *lo[b])
    }
}

/// Ring reduce-scatter in place over `segs`, the ring's `n` segments: afterwards the rank at
/// position `p` holds the full reduction of segment `(p + off) % n`. `tmp` holds two pieces
/// (2 × [`ring_piece`] elements, or twice the longest segment if that is less).
fn ring_reduce_scatter<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    ring: Ring,
    segs: &mut [&mut [T]],
    op: ReduceOp,
    off: usize,
    tmp: &mut [T],
) -> Result<()> {
    let (p, n) = (ring.pos, c.n);
    // Each step's segment moves in pieces, each received into one of two scratch buffers in
    // turn; a piece is reduced while the next one travels, still in cache from its arrival.
    let piece = ring_piece::<T>(c).min(tmp.len() / 2).max(1);
    let (tmp0, tmp1) = tmp.split_at_mut(tmp.len() / 2);
    let mut bufs = [tmp0, tmp1];
    // The piece received but not yet reduced: its segment, its range there, and its buffer.
    let mut pending: Option<(usize, Range<usize>, usize)> = None;
    let mut cur = 0;
    for s in 0..n - 1 {
        let si = (p + off + 2 * n - 1 - s) % n;
        let ri = (p + off + 2 * n - 2 - s) % n;
        let (slen, rlen) = (segs[si].len(), segs[ri].len());
        let pieces = slen.max(rlen).div_ceil(piece).max(1);
        for k in 0..pieces {
            let part = |len: usize| {
                let lo = (k * piece).min(len);
                lo..(lo + piece).min(len)
            };
            let (sp, rp) = (part(slen), part(rlen));
            // A piece about to be sent must be reduced first (a step's first piece can be the
            // previous step's last).
            if let Some((pi, pr, pb)) = pending.clone()
                && pi == si
                && pr.start < sp.end
                && sp.start < pr.end
            {
                reduce(c, &mut segs[pi][pr.clone()], &bufs[pb][..pr.len()], op)?;
                pending = None;
            }
            let [b0, b1] = &mut bufs;
            let (into, other) = if cur == 0 { (b0, b1) } else { (b1, b0) };
            let into = &mut into[..rp.len()];
            match pending.take() {
                Some((pi, pr, _)) => {
                    let (out, acc) = if pi == si {
                        split_pair(&mut *segs[si], sp, pr)
                    } else {
                        let (o, a) = seg_pair(segs, si, pi);
                        (&o[sp], &mut a[pr])
                    };
                    let other = &other[..acc.len()];
                    c.send_recv_while(
                        ring.tag,
                        (bytes(out), ring.right),
                        (bytes_mut(into), ring.left),
                        &mut || reduce(c, acc, other, op),
                    )?;
                }
                None => {
                    let out = bytes(&segs[si][sp]);
                    c.send_recv_on(ring.tag, out, ring.right, bytes_mut(into), ring.left)?;
                }
            }
            pending = Some((ri, rp, cur));
            cur ^= 1;
        }
    }
    if let Some((pi, pr, pb)) = pending {
        reduce(c, &mut segs[pi][pr.clone()], &bufs[pb][..pr.len()], op)?;
    }
    Ok(())
}

/// Ring reduce-scatter out of place: `input` is this rank's contribution as the ring's `n`
/// segments, all of `acc.len()` elements, and is only read; afterwards `acc` holds the full
/// reduction of segment `pos` (premultiplied for `PreMulSum`, not yet averaged). `acc` also
/// carries, piece by piece, the partial sums between steps: a piece is sent before the next
/// step's piece of the same place is reduced into it. `tmp` as for [`ring_reduce_scatter`].
fn ring_reduce_scatter_out<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    ring: Ring,
    input: &[&[T]],
    acc: &mut [T],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let (p, n, len) = (ring.pos, c.n, acc.len());
    let piece = ring_piece::<T>(c).min(tmp.len() / 2).max(1);
    let (tmp0, tmp1) = tmp.split_at_mut(tmp.len() / 2);
    let mut bufs = [tmp0, tmp1];
    // acc[range] = this rank's part of segment `seg` there, op the partial sum in `buf`.
    let fold = |acc: &mut [T], seg: usize, range: Range<usize>, buf: &[T]| {
        acc.copy_from_slice(&input[seg][range]);
        premul(acc, op);
        reduce(c, acc, buf, op)
    };
    // The first step sends this rank's own part of the segment before its own.
    acc.copy_from_slice(input[(p + n - 1) % n]);
    premul(acc, op);
    let pieces = len.div_ceil(piece).max(1);
    // The piece received but not yet folded: its segment, its range and its buffer.
    let mut pending: Option<(usize, Range<usize>, usize)> = None;
    let mut cur = 0;
    for s in 0..n - 1 {
        let ri = (p + 2 * n - 2 - s) % n;
        for k in 0..pieces {
            let lo = (k * piece).min(len);
            let r = lo..(lo + piece).min(len);
            // A step's first piece can be the previous step's last: fold it before sending.
            if let Some((pi, pr, pb)) = pending.clone()
                && pr.start < r.end
                && r.start < pr.end
            {
                fold(&mut acc[pr.clone()], pi, pr.clone(), &bufs[pb][..pr.len()])?;
                pending = None;
            }
            let [b0, b1] = &mut bufs;
            let (into, other) = if cur == 0 { (b0, b1) } else { (b1, b0) };
            let into = &mut into[..r.len()];
            match pending.take() {
                Some((pi, pr, _)) => {
                    let (out, dst) = split_pair(acc, r.clone(), pr.clone());
                    let other = &other[..pr.len()];
                    c.send_recv_while(
                        ring.tag,
                        (bytes(out), ring.right),
                        (bytes_mut(into), ring.left),
                        &mut || fold(&mut *dst, pi, pr.clone(), other),
                    )?;
                }
                None => {
                    let out = bytes(&acc[r.clone()]);
                    c.send_recv_on(ring.tag, out, ring.right, bytes_mut(into), ring.left)?;
                }
            }
            pending = Some((ri, r, cur));
            cur ^= 1;
        }
    }
    if let Some((pi, pr, pb)) = pending {
        fold(&mut acc[pr.clone()], pi, pr.clone(), &bufs[pb][..pr.len()])?;
    }
    Ok(())
}

/// Ring all-gather in place over `segs`: the rank at position `p` holds segment
/// `(p + off) % n`; afterwards all do.
fn ring_all_gather<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    ring: Ring,
    segs: &mut [&mut [T]],
    off: usize,
) -> Result<()> {
    let (p, n) = (ring.pos, c.n);
    for s in 0..n - 1 {
        let si = (p + off + n - s) % n;
        let ri = (p + off + 2 * n - s - 1) % n;
        let (out, inb) = seg_pair(segs, si, ri);
        c.send_recv_on(ring.tag, bytes(out), ring.right, bytes_mut(inb), ring.left)?;
    }
    Ok(())
}

/// all_reduce of `data` around one ring: reduce-scatter, then all-gather.
fn ring_lane<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    ring: Ring,
    data: &mut [T],
    op: ReduceOp,
    tmp: &mut [T],
) -> Result<()> {
    let mut segs = segments(data, c.n);
    ring_reduce_scatter(c, ring, &mut segs, op, 1, tmp)?;
    finish(segs[(ring.pos + 1) % c.n], op, c.n);
    ring_all_gather(c, ring, &mut segs, 1)
}

/// Whether a collective moving `bytes` in all runs two rings (or chains) at once: the transport
/// has two lanes, there are three ranks or more (with two, both rings would share the one
/// connection), and `bytes` reaches the collective's threshold `min` ([`TWO_RINGS_MIN`],
/// [`ALL_GATHER_TWO_RINGS_MIN`], [`BROADCAST_TWO_CHAINS_MIN`]).
fn two_rings(c: &Call<'_, impl Transport + ?Sized>, bytes: usize, min: usize) -> bool {
    c.b.lanes() >= 2 && c.n >= 3 && bytes >= min
}

fn all_reduce_ring<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    // Two scratch pieces per ring (see ring_reduce_scatter).
    let scratch = 2 * ring_piece::<T>(c).min(data.len());
    // Two rings at once, in opposite directions, each on its own thread with half the data:
    // every connection carries data both ways, and two cores reduce. With two ranks both rings
    // would share the one connection, so there it runs one.
    if two_rings(c, std::mem::size_of_val(data), TWO_RINGS_MIN) {
        return with_scratch::<T, _>(2 * scratch, |tmp| {
            let (tmp_a, tmp_b) = tmp.split_at_mut(scratch);
            let (a, b) = data.split_at_mut(data.len() / 2);
            two_lanes(
                c,
                |c| ring_lane(c, Ring::forward(c.me, c.n), a, op, tmp_a),
                |c| ring_lane(c, Ring::backward(c.me, c.n), b, op, tmp_b),
            )
        });
    }
    with_scratch::<T, _>(scratch, |tmp| {
        ring_lane(c, Ring::forward(c.me, c.n), data, op, tmp)
    })
}

/// Runs the two lanes at once ([`Transport::run_beside`]). The first lane to fail tells every
/// rank at once (so that the other lane, here and elsewhere, stops waiting), and its error is
/// the call's. Where the two run one after the other instead, that is still correct: each lane
/// moves on its own connections and tag, so the other ranks' lanes wait for this one's (within
/// the deadline) but never block it.
fn two_lanes<B: Transport + ?Sized>(
    c: &Call<'_, B>,
    first: impl FnOnce(&Call<'_, B>) -> Result<()>,
    second: impl FnOnce(&Call<'_, B>) -> Result<()> + Send,
) -> Result<()> {
    let report = |r: Result<()>| {
        if let Err(e) = &r {
            abort_all(c.b, e);
        }
        r
    };
    let (mut first, mut second) = (Some(first), Some(second));
    let (mut ra, mut rb) = (None, None);
    c.b.run_beside(&mut || ra = first.take().map(|f| report(f(c))), &mut || {
        rb = second.take().map(|f| report(f(c)))
    });
    let not_run = || Err(c.invalid("a ring lane did not run".into()));
    match (ra.unwrap_or_else(not_run), rb.unwrap_or_else(not_run)) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        // One lane's failure aborts the other: report the cause, not the echo.
        (Err(a), Err(b)) => Err(match a {
            DistError::Aborted { .. } if !matches!(b, DistError::Aborted { .. }) => b,
            a => a,
        }),
    }
}

/// The parent and children of virtual rank `v` in a binomial tree over `n` ranks rooted at 0,
/// children largest subtree first.
fn binomial(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let parent = (v > 0).then(|| v & (v - 1));
    let limit = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let mut children = Vec::new();
    let mut m = limit >> 1;
    while m > 0 {
        if v + m < n {
            children.push(v + m);
        }
        m >>= 1;
    }
    (parent, children)
}

fn broadcast_tree<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let n = c.n;
    let v = (c.me + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let (parent, children) = binomial(v, n);
    if let Some(p) = parent {
        c.recv(bytes_mut(data), real(p))?;
    }
    for ch in children {
        c.send(bytes(data), real(ch))?;
    }
    Ok(())
}

fn broadcast_chain<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    ring: Ring,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let n = c.n;
    // Along the ring from the root: the root is 0, the last rank to receive n - 1.
    let v = (ring.pos + n - ring.position_of(root, n)) % n;
    let (prev, next, tag) = (ring.left, ring.right, ring.tag);
    let per = (CHAIN_CHUNK / std::mem::size_of::<T>()).max(1);
    let chunks = data.len().div_ceil(per);
    let len = data.len();
    let chunk = |i: usize| i * per..((i + 1) * per).min(len);
    if v == 0 {
        for i in 0..chunks {
            c.send_on(tag, bytes(&data[chunk(i)]), next)?;
        }
        return Ok(());
    }
    c.recv_on(tag, bytes_mut(&mut data[chunk(0)]), prev)?;
    for i in 0..chunks {
        let last_rank = v == n - 1;
        match (last_rank, i + 1 < chunks) {
            (false, true) => {
                let (out, inb) = split_pair(data, chunk(i), chunk(i + 1));
                c.send_recv_on(tag, bytes(out), next, bytes_mut(inb), prev)?;
            }
            (false, false) => c.send_on(tag, bytes(&data[chunk(i)]), next)?,
            (true, true) => c.recv_on(tag, bytes_mut(&mut data[chunk(i + 1)]), prev)?,
            (true, false) => {}
        }
    }
    Ok(())
}

fn reduce_tree<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = c.n;
    let v = (c.me + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let (parent, mut children) = binomial(v, n);
    // Smallest subtrees first: they finish first.
    children.reverse();
    with_scratch::<T, _>(data.len(), |tmp| {
        for ch in children {
            c.recv(bytes_mut(tmp), real(ch))?;
            reduce(c, data, tmp, op)?;
        }
        Ok(())
    })?;
    match parent {
        Some(p) => c.send(bytes(data), real(p)),
        None => {
            finish(data, op, n);
            Ok(())
        }
    }
}

fn reduce_ring<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let scratch = 2 * ring_piece::<T>(c).min(data.len());
    with_scratch::<T, _>(scratch, |tmp| {
        ring_reduce_scatter(c, Ring::forward(me, n), &mut segments(data, n), op, 1, tmp)
    })?;
    let owned = |r: usize| (r + 1) % n;
    let len = data.len();
    if me == root {
        for r in (0..n).filter(|r| *r != root) {
            c.recv(bytes_mut(&mut data[segment(len, n, owned(r))]), r)?;
        }
        finish(data, op, n);
    } else {
        c.send(bytes(&data[segment(data.len(), n, owned(me))]), root)?;
    }
    Ok(())
}

/// all_reduce in place, by size: recursive doubling for small buffers, the ring for large.
fn all_reduce_on<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    c.check_op::<T>(op)?;
    premul(data, op);
    if c.n == 1 {
        return Ok(());
    }
    if std::mem::size_of_val(data) <= ALL_REDUCE_RING_MIN || data.len() < c.n {
        all_reduce_doubling(c, data, op)
    } else {
        all_reduce_ring(c, data, op)
    }
}

/// reduce in place, by size: binomial tree for small buffers, ring then gather for large.
fn reduce_on<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    c.check_root(root)?;
    c.check_op::<T>(op)?;
    premul(data, op);
    if c.n == 1 {
        return Ok(());
    }
    if std::mem::size_of_val(data) <= REDUCE_RING_MIN || data.len() < c.n {
        reduce_tree(c, data, op, root)
    } else {
        reduce_ring(c, data, op, root)
    }
}

/// The collectives, for every backend that implements [`Transport`].
///
/// All ranks must call the same collectives in the same order with matching arguments; a rank
/// that does not is reported on every rank as [`DistError::CollectiveMismatch`] (on the ranks that
/// noticed) or [`DistError::Aborted`] (on the others). Each call waits at most the backend's
/// default timeout.
pub trait Collectives: Transport {
    /// Reduces `data` over all ranks with `op`, in place: every rank ends with the result.
    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        run::<_, T, _>(self, Kind::AllReduce, data.len(), Some(op), 0, |c| {
            all_reduce_on(c, data, op)
        })
    }

    /// [`Collectives::all_reduce`] out of place: `output` gets the reduction of every rank's
    /// `input`; `input` is not modified.
    fn all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        run::<_, T, _>(self, Kind::AllReduce, input.len(), Some(op), 0, |c| {
            c.check_len("output", output.len(), input.len())?;
            output.copy_from_slice(input);
            all_reduce_on(c, output, op)
        })
    }

    /// Copies `data` on `root` to every other rank's `data`.
    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        run::<_, T, _>(self, Kind::Broadcast, data.len(), None, root, |c| {
            c.check_root(root)?;
            if c.n == 1 {
                return Ok(());
            }
            let size = std::mem::size_of_val(data);
            let fwd = Ring::forward(c.me, c.n);
            if size <= BROADCAST_CHAIN_MIN {
                broadcast_tree(c, data, root)
            } else if two_rings(c, size, BROADCAST_TWO_CHAINS_MIN) {
                // Two chains at once in opposite directions, half the data each: every
                // connection carries data both ways.
                let bwd = Ring::backward(c.me, c.n);
                let (a, b) = data.split_at_mut(data.len() / 2);
                two_lanes(
                    c,
                    |c| broadcast_chain(c, fwd, a, root),
                    |c| broadcast_chain(c, bwd, b, root),
                )
            } else {
                broadcast_chain(c, fwd, data, root)
            }
        })
    }

    /// Reduces `data` over all ranks with `op` into `data` on `root`. On the other ranks `data`
    /// serves as scratch space and its contents afterwards are unspecified; see
    /// [`Collectives::reduce_into`] to keep the input.
    fn reduce<T: Element>(&self, data: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        run::<_, T, _>(self, Kind::Reduce, data.len(), Some(op), root, |c| {
            reduce_on(c, data, op, root)
        })
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
        run::<_, T, _>(self, Kind::Reduce, input.len(), Some(op), root, |c| {
            c.check_len("output", output.len(), input.len())?;
            output.copy_from_slice(input);
            reduce_on(c, output, op, root)
        })
    }

    /// Every rank's `input` (all of one length `k`) concatenated in rank order into every rank's
    /// `output` (`k * world_size` elements).
    fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        run::<_, T, _>(self, Kind::AllGather, input.len(), None, 0, |c| {
            let k = input.len();
            c.check_len("output", output.len(), c.blocks("output", k)?)?;
            output[c.me * k..(c.me + 1) * k].copy_from_slice(input);
            if c.n == 1 {
                return Ok(());
            }
            // Blocks of exactly k: `segment` of n*k over n is block i. With two rings, the
            // first half of every block goes around one, the second half around the other, in
            // the opposite direction.
            let (fwd, bwd) = (Ring::forward(c.me, c.n), Ring::backward(c.me, c.n));
            if two_rings(c, std::mem::size_of_val(output), ALL_GATHER_TWO_RINGS_MIN) {
                let (mut a, mut b) = halves(output, c.n, k);
                return two_lanes(
                    c,
                    |c| ring_all_gather(c, fwd, &mut a, 0),
                    |c| ring_all_gather(c, bwd, &mut b, 0),
                );
            }
            ring_all_gather(c, fwd, &mut segments(output, c.n), 0)
        })
    }

    /// Every rank's `input` (length `k`) concatenated in rank order into `output` on `root`
    /// (`k * world_size` elements; pass `None` elsewhere).
    fn gather<T: Element>(&self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()> {
        run::<_, T, _>(self, Kind::Gather, input.len(), None, root, |c| {
            c.check_root(root)?;
            let k = input.len();
            if c.me != root {
                return c.send(bytes(input), root);
            }
            let Some(out) = output else {
                return Err(c.invalid("the root must pass an output buffer".into()));
            };
            c.check_len("output", out.len(), c.blocks("output", k)?)?;
            out[root * k..(root + 1) * k].copy_from_slice(input);
            for r in (0..c.n).filter(|r| *r != root) {
                c.recv(bytes_mut(&mut out[r * k..(r + 1) * k]), r)?;
            }
            Ok(())
        })
    }

    /// Block `r` of `input` on `root` (`k * world_size` elements; `None` elsewhere) into rank
    /// `r`'s `output` (`k` elements).
    fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        run::<_, T, _>(self, Kind::Scatter, output.len(), None, root, |c| {
            c.check_root(root)?;
            let k = output.len();
            if c.me != root {
                return c.recv(bytes_mut(output), root);
            }
            let Some(inp) = input else {
                return Err(c.invalid("the root must pass an input buffer".into()));
            };
            c.check_len("input", inp.len(), c.blocks("input", k)?)?;
            for r in (0..c.n).filter(|r| *r != root) {
                c.send(bytes(&inp[r * k..(r + 1) * k]), r)?;
            }
            output.copy_from_slice(&inp[root * k..(root + 1) * k]);
            Ok(())
        })
    }

    /// Reduces every rank's `input` (`k * world_size` elements) with `op` and leaves block `r` of
    /// the result in rank `r`'s `output` (`k` elements).
    fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        run::<_, T, _>(self, Kind::ReduceScatter, output.len(), Some(op), 0, |c| {
            c.check_op::<T>(op)?;
            let k = output.len();
            c.check_len("input", input.len(), c.blocks("input", k)?)?;
            if c.n == 1 {
                output.copy_from_slice(input);
                premul(output, op);
                return Ok(());
            }
            // Out of place: `input` is only read; `output` carries the partial sums between
            // steps and ends with block `me`. With two lanes, the first half of every block goes
            // around a forward ring and the second half around a backward one (see `halves`).
            let (fwd, bwd) = (Ring::forward(c.me, c.n), Ring::backward(c.me, c.n));
            let scratch = 2 * ring_piece::<T>(c).min(k);
            let blocks: Vec<&[T]> = (0..c.n).map(|i| &input[i * k..(i + 1) * k]).collect();
            if two_rings(c, std::mem::size_of_val(input), TWO_RINGS_MIN) {
                let h = k / 2;
                let first: Vec<&[T]> = blocks.iter().map(|b| &b[..h]).collect();
                let second: Vec<&[T]> = (0..c.n).map(|p| &blocks[(c.n - p) % c.n][h..]).collect();
                let (out_a, out_b) = output.split_at_mut(h);
                with_scratch::<T, _>(2 * scratch, |tmp| {
                    let (tmp_a, tmp_b) = tmp.split_at_mut(scratch);
                    two_lanes(
                        c,
                        |c| ring_reduce_scatter_out(c, fwd, &first, out_a, op, tmp_a),
                        |c| ring_reduce_scatter_out(c, bwd, &second, out_b, op, tmp_b),
                    )
                })?;
            } else {
                with_scratch::<T, _>(scratch, |tmp| {
                    ring_reduce_scatter_out(c, fwd, &blocks, output, op, tmp)
                })?;
            }
            finish(output, op, c.n);
            Ok(())
        })
    }

    /// Block `j` of this rank's `input` (`k * world_size` elements) goes to rank `j`, landing
    /// in block `r` (this rank's) of its `output`.
    fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        run::<_, T, _>(self, Kind::AllToAll, input.len(), None, 0, |c| {
            let n = c.n;
            if !input.len().is_multiple_of(n) {
                return Err(c.invalid(format!(
                    "input has {} elements, not a multiple of the world size {n}",
                    input.len()
                )));
            }
            c.check_len("output", output.len(), input.len())?;
            let k = input.len() / n;
            let counts = vec![k; n];
            exchange(c, input, &counts, output, &counts)
        })
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
        run::<_, T, _>(self, Kind::AllToAllV, 0, None, 0, |c| {
            let n = c.n;
            c.check_len("send_counts", send_counts.len(), n)?;
            c.check_len("recv_counts", recv_counts.len(), n)?;
            c.check_len("input", input.len(), c.total("send_counts", send_counts)?)?;
            c.check_len("output", output.len(), c.total("recv_counts", recv_counts)?)?;
            exchange(c, input, send_counts, output, recv_counts)
        })
    }
}

impl<B: Transport + ?Sized> Collectives for B {}

/// Pairwise exchange: in step `s` send to `me + s` while receiving from `me - s`.
fn exchange<T: Element>(
    c: &Call<'_, impl Transport + ?Sized>,
    input: &[T],
    send_counts: &[usize],
    output: &mut [T],
    recv_counts: &[usize],
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let offsets = |counts: &[usize]| {
        let mut o = Vec::with_capacity(n + 1);
        o.push(0);
        for x in counts {
            o.push(o.last().copied().unwrap_or(0) + x);
        }
        o
    };
    let (so, ro) = (offsets(send_counts), offsets(recv_counts));
    if send_counts[me] != recv_counts[me] {
        return Err(c.invalid(format!(
            "sends {} elements to itself but expects {}",
            send_counts[me], recv_counts[me]
        )));
    }
    output[ro[me]..ro[me + 1]].copy_from_slice(&input[so[me]..so[me + 1]]);
    for s in 1..n {
        let (dst, src) = ((me + s) % n, (me + n - s) % n);
        c.send_recv(
            bytes(&input[so[dst]..so[dst + 1]]),
            dst,
            bytes_mut(&mut output[ro[src]..ro[src + 1]]),
            src,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;

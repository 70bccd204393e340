//! all_reduce over a host arena ([`HostArena`]), for a group whose ranks all share one host:
//! peers' buffers are read in place, through the arena, instead of passing messages.
//!
//! A buffer that fits the arena's small areas (up to [`host_small_max`](super::host_small_max)
//! of the host's ranks: [`HOST_SMALL_MAX`](super::consts::HOST_SMALL_MAX) up to 4 ranks, less
//! from 5) goes through them, in one piece (`collectives/small.rs`). Larger ones go in pieces
//! of at most one slot. For piece k (counted over every arena
//! collective of the group, the same on every rank) each rank copies its input (what of it
//! its peers read) into its slot `k % 2` and publishes `Input = k + 1`, then waits for every
//! peer's `Input`:
//! - small buffers (up to [`host_split_min`](super::host_split_min) of the host's ranks: 32 KiB
//!   at 2 ranks, about 10 KiB at 3; from 4 none past the small areas, as the cost model
//!   [`host_time_ns`](super::host_time_ns) has it): every rank reduces all n inputs, in rank order,
//!   into its buffer and publishes `Reduced = k + 1` (read done). One wait per call.
//! - larger: a rank's slot takes only the shares its peers reduce (all but its own), and
//!   rank i reduces share i of the piece (1/n of it) from its buffer and every
//!   peer's slot, in rank order, writes the result over its own share in its slot and publishes
//!   `Reduced = k + 1`; then every rank copies every other share out once that rank's
//!   `Reduced` says it is there.
//!
//! A rank with several threads ([`HostArena::threads`]) splits its input's copy, its share's
//! reduction and, once every peer's `Reduced` says so, the copy of every element outside its
//! share, into ranges of at least [`ARENA_PART_MIN`] bytes, in pieces of at least
//! [`ARENA_THREADS_MIN`] (`collectives/parts.rs`); each step
//! ends when every range has, so a word is published only after the bytes it announces.
//!
//! Each element is reduced by one rank only, always in rank order, so every rank gets bitwise
//! the same result. A slot is written again two pieces later, only after every peer published
//! `Input` of the piece between, which it does after it read the slot: no piece overwrites one
//! still being read. The first piece of each call publishes the call's descriptor beside its
//! slot, and every rank compares its peers' with its own: a mismatched call is reported as
//! every collective's is. A peer's word is checked against what the protocol allows (one piece
//! behind; for `Input` two, after a small piece, or one ahead): anything else is a corrupt arena, an error naming
//! that peer. Waits (`collectives/arena_wait.rs`) spin for the arena's spin time, then sleep
//! in slices until the call's deadline, checking between slices whether the peer is gone, an
//! abort has come, or the peer sent a message of another collective (a mismatched call on the
//! TCP path).

use crate::arena::{ArenaWord, HostArena};
use crate::error::{DistError, Result};
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::arena_wait::wait_word;
use super::call::{Call, finish};
use super::consts::HOST_SPLIT_MIN;
use super::desc::Desc;
use super::scratch::{bytes, bytes_mut, segment, with_scratch};
use super::select::{HostAllReducePath, host_all_reduce_path};
use crate::group::Group;

/// Fills its buffer with a local peer's bytes from a byte offset: `read(rank, offset, dst)`.
pub(super) type ReadPeer<'r> = &'r (dyn Fn(usize, usize, &mut [u8]) -> Result<()> + Sync);

/// The bytes reduced at a time from a peer's slot (copied first into a buffer that stays in
/// the cache: no reference into memory another process writes is ever made).
const CHUNK: usize = 16 << 10;

/// The fewest bytes one thread takes when a rank splits its part of a piece over several
/// ([`HostArena::threads`]): the piece is in the cache, so less than a direct read's part.
/// On the 16-core host ("2026-12-02, morning (00e12fa)" in `docs/results/README.md`), 128 KiB parts
/// were slower at every size from 512 KiB to 16 MiB (4 ranks 1 MiB 243 us against 218; 8 ranks 546
/// against 300).
pub(super) const ARENA_PART_MIN: usize = 64 << 10;

/// The smallest piece a rank splits over its threads: below it the helpers' wake-ups cost
/// more than they save. 16 cores, all_reduce us, split over each rank's threads against one
/// thread ("2026-12-02, morning (00e12fa)"): 4 ranks 256 KiB 105 against 79, 512 KiB 140 against
/// 167, 1 MiB 205 against 319; 8 ranks 256 KiB 110 against 93, 512 KiB 197 against 203, 1 MiB 322
/// against 389.
pub(super) const ARENA_THREADS_MIN: usize = 512 << 10;

/// Whether this call's group runs its all_reduces on the arena: agreed once, on the group's
/// first all_reduce, by an all_reduce of every rank's vote (its arena complete, the host
/// layout and slot size it sees) over the group's messages; the answer is kept in the group.
/// Every rank of a link that offers an arena takes part, so every rank decides alike. A group
/// uses it if some host has two of its ranks or more.
pub(super) fn agreed<L: Link>(c: &Call<'_, L>, a: &dyn HostArena) -> Result<bool> {
    if let Some(known) = c.g.arena_in_use() {
        return Ok(known);
    }
    let v = vote(a);
    // The direct reads' proposal: 0 for none, else the greater the smaller the size, so that
    // the least is the largest size (or none if some rank cannot read its peers).
    let direct = match a.direct_min() {
        Some(b) if v != 0 => u64::MAX - b as u64,
        _ => 0,
    };
    let mut x = [v, !v, direct];
    super::tree::all_reduce_doubling(c, &mut x, ReduceOp::Min)?;
    // x[0] is the least vote, !x[1] the greatest: equal only if every rank voted alike.
    // Some host with two ranks or more (else the arena saves nothing).
    let hosts = a.hosts();
    let shared = hosts.len() == c.n && (0..c.n).any(|r| hosts[r + 1..].contains(&hosts[r]));
    let yes = x[0] == !x[1] && x[0] != 0 && shared;
    let direct_min = (x[2] != 0).then(|| usize::try_from(u64::MAX - x[2]).unwrap_or(usize::MAX));
    c.g.set_arena_agreed(yes, direct_min);
    Ok(yes)
}

/// A rank's vote: 0 if its arena is incomplete or an earlier group over the same link claimed
/// it, else a hash (never 0) of the host layout, the slot size and the small areas' size.
/// A claim spent on a vote whose all_reduce then fails is not given back: a failed collective
/// aborts the link, and no later call of any group over it runs.
fn vote(a: &dyn HostArena) -> u64 {
    if !a.complete() || !a.claim() {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(a.slot_len() as u64);
    eat(a.small_len() as u64);
    for &host in a.hosts() {
        eat(host as u64);
    }
    h | 1
}

/// The arena part of a call: the arena, the host's ranks (`local`, in rank order: all of the
/// group's here) and this rank's place among them.
pub(super) struct Host<'a, 'c, L: Link> {
    pub(super) c: &'a Call<'c, L>,
    pub(super) a: &'a dyn HostArena,
    pub(super) local: &'a [usize],
    pub(super) pos: usize,
    /// Whether the reduction is the group's whole (then `Avg` is scaled here).
    pub(super) whole: bool,
}

impl<'a, 'c, L: Link> Host<'a, 'c, L> {
    pub(super) fn new(
        c: &'a Call<'c, L>,
        a: &'a dyn HostArena,
        local: &'a [usize],
    ) -> Result<Self> {
        let pos = local
            .iter()
            .position(|&r| r == c.me)
            .ok_or_else(|| c.invalid(format!("rank {} is not among its host's ranks", c.me)))?;
        Ok(Host {
            c,
            a,
            local,
            pos,
            whole: local.len() == c.n,
        })
    }
}

/// Whether an all_reduce of `bytes` on the arena reads the peers' buffers directly
/// (`collectives/direct.rs`): where the group agreed to, from the size it agreed on, for
/// buffers the arena would split (larger than [`HOST_SPLIT_MIN`]), if a slot holds the
/// buffer's address and an element of any type after it (where the results go).
pub(super) fn direct_for<L: Link>(c: &Call<'_, L>, a: &dyn HostArena, bytes: usize) -> bool {
    direct_for_group(c.g, a, bytes)
}

/// [`direct_for`], for group `g`.
pub(super) fn direct_for_group<L: Link>(g: &Group<L>, a: &dyn HostArena, bytes: usize) -> bool {
    g.arena_direct_min()
        .is_some_and(|min| bytes >= min.max(HOST_SPLIT_MIN + 1))
        && a.slot_len() >= super::direct::HEADER + 8
}

/// all_reduce of `data` in place over the arena among the ranks of this host (`local`): the
/// group's result if they are all of its ranks, else the host's part (no `Avg` scaling).
pub(super) fn all_reduce_host<T: Element, L: Link>(
    c: &Call<'_, L>,
    a: &dyn HostArena,
    local: &[usize],
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let h = Host::new(c, a, local)?;
    let bytes = std::mem::size_of_val(data);
    let direct = direct_for(c, a, bytes);
    let path = host_all_reduce_path(local.len(), bytes, (a.small_len(), a.slot_len()), direct);
    let split = match path {
        // It runs `ready_to_write` itself, before it writes its area.
        HostAllReducePath::Small => return h.all_reduce_small(data, op),
        HostAllReducePath::Split => true,
        HostAllReducePath::Whole | HostAllReducePath::Direct => false,
    };
    // After a broadcast on the small areas, every peer must be done with what this rank's
    // first piece overwrites (`collectives/small.rs`).
    h.ready_to_write()?;
    if path == HostAllReducePath::Direct {
        return h.all_reduce_direct(data, op);
    }
    let size = std::mem::size_of::<T>();
    let per_piece = a.slot_len() / size;
    if per_piece == 0 {
        return Err(c.invalid(format!("arena slots of {} bytes", a.slot_len())));
    }
    let mut first = true;
    let mut start = 0;
    loop {
        let end = (start + per_piece).min(data.len());
        let piece = &mut data[start..end];
        if split {
            h.piece_split(piece, op, first)?;
        } else {
            h.piece_whole(piece, op, first)?;
        }
        first = false;
        start = end;
        if start >= data.len() {
            return Ok(());
        }
    }
}

impl<L: Link> Host<'_, '_, L> {
    /// The number of this piece (this rank's `Input` word so far) and its slot.
    pub(super) fn next_piece(&self) -> (u32, usize) {
        let k = self.a.load(self.c.me, ArenaWord::Input);
        (k, (k % 2) as usize)
    }

    /// Copies `piece` into this rank's slot and publishes it (with the call's descriptor on its
    /// first piece), then waits for every peer's input and checks their descriptors.
    fn put_and_gather<T: Element>(
        &self,
        piece: &[T],
        k: u32,
        slot: usize,
        first: bool,
    ) -> Result<()> {
        self.announce(Some(piece), k, slot, first)
    }

    /// [`Host::put_and_gather`], with `piece` written only if given.
    pub(super) fn announce<T: Element>(
        &self,
        piece: Option<&[T]>,
        k: u32,
        slot: usize,
        first: bool,
    ) -> Result<()> {
        let (c, a) = (self.c, self.a);
        if let Some(piece) = piece {
            a.write(slot, 0, bytes(piece))
                .map_err(|e| e.map_op(|_| c.op_text()))?;
        }
        if first {
            a.set_meta(slot, c.meta());
        }
        a.publish(ArenaWord::Input, k.wrapping_add(1));
        for &q in self.local.iter().filter(|&&q| q != c.me) {
            wait_word(c, a, q, ArenaWord::Input, k.wrapping_add(1))?;
            if first {
                let theirs = a.meta(q, slot);
                if theirs != c.meta() {
                    return Err(DistError::CollectiveMismatch {
                        rank: c.me,
                        op: c.op_text(),
                        peer: q,
                        detail: c.desc().differences(&Desc::decode(&theirs)),
                    });
                }
            }
        }
        Ok(())
    }

    /// `acc` (a part of this rank's piece at element `at`, holding this rank's input) becomes
    /// the reduction of every local rank's input there, in rank order, the peers' read from
    /// their slots `slot` in chunks (this rank's own from `acc`).
    fn reduce_range<T: Element>(
        &self,
        acc: &mut [T],
        at: usize,
        slot: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let (c, a) = (self.c, self.a);
        self.reduce_from(acc, at, op, CHUNK, &|q, off, dst| {
            a.read(q, slot, off, dst)
                .map_err(|e| e.map_op(|_| c.op_text()))
        })
    }

    /// `acc` (a part of this rank's input at element `at`) becomes the reduction of every local
    /// rank's input there, in rank order, `chunk` bytes at a time: `read(q, offset, dst)` fills
    /// `dst` with rank `q`'s bytes from byte `offset` (never called for this rank).
    pub(super) fn reduce_from<T: Element>(
        &self,
        acc: &mut [T],
        at: usize,
        op: ReduceOp,
        chunk: usize,
        read: ReadPeer<'_>,
    ) -> Result<()> {
        let c = self.c;
        let size = std::mem::size_of::<T>();
        let chunk = (chunk / size).max(1);
        // Rank order: the first local rank's input starts the sum, and each next one is
        // reduced into it. At position 0 that is `acc` itself; elsewhere a chunk of scratch
        // takes it (read straight there), this rank's own input is reduced in from `acc` in
        // its turn, and the sum is copied back at the end.
        with_scratch::<T, _>(2 * chunk.min(acc.len().max(1)), |scratch| {
            let (sum, theirs) = scratch.split_at_mut(scratch.len() / 2);
            let mut done = 0;
            while done < acc.len() {
                let len = chunk.min(acc.len() - done);
                let out = &mut acc[done..done + len];
                let off = (at + done) * size;
                let theirs = &mut theirs[..len];
                if self.pos == 0 {
                    for &q in &self.local[1..] {
                        read(q, off, bytes_mut(theirs))?;
                        c.reduce(out, theirs, op)?;
                    }
                } else {
                    let sum = &mut sum[..len];
                    read(self.local[0], off, bytes_mut(sum))?;
                    for (i, &q) in self.local.iter().enumerate().skip(1) {
                        if i == self.pos {
                            c.reduce(sum, out, op)?;
                        } else {
                            read(q, off, bytes_mut(theirs))?;
                            c.reduce(sum, theirs, op)?;
                        }
                    }
                    out.copy_from_slice(sum);
                }
                done += len;
            }
            Ok(())
        })
    }

    /// A piece that every rank reduces whole: one wait for every input, then the reduction.
    fn piece_whole<T: Element>(&self, piece: &mut [T], op: ReduceOp, first: bool) -> Result<()> {
        let (k, slot) = self.next_piece();
        self.put_and_gather(piece, k, slot, first)?;
        self.reduce_range(piece, 0, slot, op)?;
        if self.whole {
            finish(piece, op, self.c.n);
        }
        self.a.publish(ArenaWord::Reduced, k.wrapping_add(1));
        Ok(())
    }

    /// A piece split into shares: this rank reduces its own, publishes it in its slot, and
    /// copies the others' out of their slots. With one thread it copies each share as soon as
    /// its owner has published it; with several ([`Host::in_parts`], ranges of at least
    /// [`ARENA_PART_MIN`] bytes) it splits its input's copy, its share's reduction and, once
    /// every peer has published, the copy of every other share.
    fn piece_split<T: Element>(&self, piece: &mut [T], op: ReduceOp, first: bool) -> Result<()> {
        let (c, a) = (self.c, self.a);
        let (k, slot) = self.next_piece();
        let size = std::mem::size_of::<T>();
        // Split only a piece large enough to pay for the helpers' wake-ups.
        // (Without helpers, inside a rayon worker, the rank copies each share as it comes.)
        let split = a.threads() > 1
            && std::mem::size_of_val(piece) >= ARENA_THREADS_MIN
            && self.c.g.helpers(a.threads()).is_some();
        let part_min = if split { ARENA_PART_MIN } else { usize::MAX };
        let write = |at: usize, part: &[T]| {
            a.write(slot, at * size, bytes(part))
                .map_err(|e| e.map_op(|_| c.op_text()))
        };
        let m = self.local.len();
        let len = piece.len();
        let share = segment(len, m, self.pos);
        // Only what the peers reduce goes into the slot: this rank reduces its own share from
        // its buffer, and writes the result over that share of the slot.
        let inputs = around(piece, &share);
        self.in_parts_of(inputs, part_min, &|at, part| write(at, part))?;
        self.announce::<T>(None, k, slot, first)?;
        self.in_parts(&mut piece[share.clone()], part_min, &|at, part| {
            self.reduce_range(part, share.start + at, slot, op)?;
            if self.whole {
                finish(part, op, c.n);
            }
            write(share.start + at, part)
        })?;
        a.publish(ArenaWord::Reduced, k.wrapping_add(1));
        let others = || {
            (0..m)
                .filter(move |&i| i != self.pos)
                .map(move |i| (self.local[i], segment(len, m, i)))
                .filter(|(_, s)| !s.is_empty())
        };
        let copy_out = |q: usize, from: usize, dst: &mut [T]| {
            a.read(q, slot, from * size, bytes_mut(dst))
                .map_err(|e| e.map_op(|_| c.op_text()))
        };
        if !split {
            for (q, theirs) in others() {
                wait_word(c, a, q, ArenaWord::Reduced, k.wrapping_add(1))?;
                copy_out(q, theirs.start, &mut piece[theirs])?;
            }
            return Ok(());
        }
        for (q, _) in others() {
            wait_word(c, a, q, ArenaWord::Reduced, k.wrapping_add(1))?;
        }
        // The elements outside this rank's share, split; each range takes the part of every
        // other share that falls in it.
        let outside = around(piece, &share);
        self.in_parts_of(outside, part_min, &|at, part| {
            for (q, theirs) in others() {
                let (from, to) = (theirs.start.max(at), theirs.end.min(at + part.len()));
                if from < to {
                    copy_out(q, from, &mut part[from - at..to - at])?;
                }
            }
            Ok(())
        })
    }
}

/// all_reduce of `data` for a group over several hosts: within each host on the arena (every
/// rank gets its host's part), then between one leader per host (its lowest rank) over
/// messages, by a ring reduce-scatter and all-gather, and from each leader to the other ranks
/// of its host on the arena.
pub(super) fn all_reduce_hosts<T: Element, L: Link>(
    c: &Call<'_, L>,
    a: &dyn HostArena,
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let hosts = a.hosts();
    let local = a.local();
    let h = Host::new(c, a, local)?;
    if local.len() > 1 {
        all_reduce_host(c, a, local, data, op)?;
    }
    if h.pos == 0 {
        let leaders: Vec<usize> = (0..c.n)
            .filter(|&r| !hosts[..r].contains(&hosts[r]))
            .collect();
        leaders_ring(c, &leaders, data, op)?;
        finish(data, op, c.n);
    }
    if local.len() > 1 {
        h.broadcast_from_leader(data)?;
    }
    Ok(())
}

/// all_reduce of `data` among `leaders` (this rank one of them) over messages: ring
/// reduce-scatter, then ring all-gather, one segment per leader.
fn leaders_ring<T: Element, L: Link>(
    c: &Call<'_, L>,
    leaders: &[usize],
    data: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let m = leaders.len();
    let Some(p) = leaders.iter().position(|&r| r == c.me) else {
        return Err(c.invalid(format!("rank {} is no host's leader", c.me)));
    };
    if m < 2 {
        return Ok(());
    }
    let (right, left) = (leaders[(p + 1) % m], leaders[(p + m - 1) % m]);
    let len = data.len();
    let longest = (0..m).map(|i| segment(len, m, i).len()).max().unwrap_or(0);
    with_scratch::<T, _>(longest, |tmp| {
        for s in 0..m - 1 {
            let send = segment(len, m, (p + m - s) % m);
            let recv = segment(len, m, (p + 2 * m - s - 1) % m);
            let inb = &mut tmp[..recv.len()];
            c.send_recv(bytes(&data[send]), right, bytes_mut(inb), left)?;
            c.reduce(&mut data[recv], inb, op)?;
        }
        for s in 0..m - 1 {
            let send = segment(len, m, (p + 1 + m - s) % m);
            let recv = segment(len, m, (p + m - s) % m);
            let inb = &mut tmp[..recv.len()];
            c.send_recv(bytes(&data[send]), right, bytes_mut(inb), left)?;
            data[recv].copy_from_slice(inb);
        }
        Ok(())
    })
}

impl<L: Link> Host<'_, '_, L> {
    /// The leader's (position 0's) `data` to every rank of the host, in pieces: the leader
    /// writes each into its slot, every rank announces the piece and waits for the others,
    /// then copies it out of the leader's slot.
    fn broadcast_from_leader<T: Element>(&self, data: &mut [T]) -> Result<()> {
        let (c, a) = (self.c, self.a);
        let per_piece = (a.slot_len() / std::mem::size_of::<T>()).max(1);
        let mut start = 0;
        loop {
            let end = (start + per_piece).min(data.len());
            let piece = &mut data[start..end];
            let (k, slot) = self.next_piece();
            let leader = self.pos == 0;
            self.announce(leader.then_some(&*piece), k, slot, false)?;
            if !leader {
                a.read(self.local[0], slot, 0, bytes_mut(piece))
                    .map_err(|e| e.map_op(|_| c.op_text()))?;
            }
            a.publish(ArenaWord::Reduced, k.wrapping_add(1));
            start = end;
            if start >= data.len() {
                return Ok(());
            }
        }
    }
}

/// The two ranges of `piece` around `share`, each with the element it starts at.
fn around<'p, T>(piece: &'p mut [T], share: &std::ops::Range<usize>) -> [(usize, &'p mut [T]); 2] {
    let (before, rest) = piece.split_at_mut(share.start);
    [(0, before), (share.end, &mut rest[share.len()..])]
}

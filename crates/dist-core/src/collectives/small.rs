//! all_reduce of a small buffer on the host arena (up to
//! [`host_small_max`](super::host_small_max) bytes of the host's ranks, at most
//! [`HOST_SMALL_MAX`](super::consts::HOST_SMALL_MAX), within the arena's small areas,
//! [`HostArena::small_len`](crate::arena::HostArena::small_len)): the fewest cache lines a
//! rank's input can travel in. Its one round ([`Host::small_round`]: write, publish, wait for
//! every peer, check) is also the barrier's, broadcast's, reduce's and all_gather's on the small
//! areas (`collectives/small_ops.rs`), which differ only in what they write and read.
//!
//! For piece k (the count every arena collective of the group shares, `collectives/host.rs`)
//! each rank writes its whole input, the call's descriptor and the word `k + 1` into its small
//! area `k % 2` ([`HostArena::put_small`]: the word last, a release store). The word, the
//! descriptor and the first bytes of the input share one cache line, so a peer that sees the
//! word has the descriptor and (for up to 32 bytes in dist-tcp) the whole input with it. The rank
//! also publishes its `Input` word (which a peer that has spun long enough sleeps on, and which
//! the pieces of larger calls count on), looks at every peer's area word until it reads `k + 1`,
//! checks their descriptors, reduces every input in rank order into its buffer (bitwise the same
//! result on every rank) and publishes `Reduced = k + 1`: one wait per call, as the pieces that
//! every rank reduces whole.
//!
//! An area is written again two pieces later, only after every peer published `Input` of the
//! piece between (small or not), which it does after it read the area: no piece overwrites an
//! area still being read.
//!
//! **Waiting.** A rank spins on a peer's area word (the CPU's pause between looks) for at most
//! [`SMALL_SPIN`](super::consts::SMALL_SPIN) a call (none where the arena's spin time is zero, a host crowded with ranks,
//! where the host's ranks outnumber the cores this process may run on, or in a backoff after
//! spins that ran out, [`SPIN_BACKOFF`]),
//! then waits on the peer's `Input` word as every arena wait does (`collectives/arena_wait.rs`:
//! giving its core away between looks, then sleeping until the call's deadline, ending on a gone
//! peer, an abort or a mismatched call). Once that word says the piece is published, the area's
//! word must be `k + 1`; if it is not, the peer published this piece elsewhere: a mismatched
//! call on the pieces' path (its descriptor beside its slot says which), or a corrupt arena.
//!
//! **Checks.** While spinning, a peer's area word may hold `k + 1` or the area's word before
//! this piece, which is the same on every rank: the word of the last piece that wrote that area
//! (0 for none), however long ago, which this rank reads in its own area before writing it
//! (every peer has finished writing it: each has published piece k − 2 at least). Anything else
//! is a corrupt arena, an error naming the peer. Where the two are equal (the area last written
//! exactly 2³² pieces ago) the spin accepts neither and the wait on the `Input` word decides. A
//! peer whose descriptor differs from this rank's is a mismatched call, named as every
//! collective's is.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::arena::ArenaWord;
use crate::error::{DistError, Result};
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::arena_wait::{wait_word, wait_word_after};
use super::call::{abort_all, finish};
use super::desc::Desc;
use super::host::Host;
use super::scratch::bytes;

/// Looks at a peer's area word between two reads of the clock while spinning
/// ([`Host::wait_small`]): a look is one load (a few ns while the line stays put), a read of
/// the clock tens of ns, so the spin's bound is overrun by at most this many looks.
const LOOKS_PER_CLOCK: u32 = 32;

/// When the spin pays: after a call whose spin ran out (some peer came later, off its core:
/// the host is busy with other work), the next 1, then 2, 4, … 64 calls do not spin; a call
/// whose peers all came within it ends the backoff. One per process. (On 2 ranks of the
/// 2-core machine with other load, a spin that ran out every call made 8 B calls 6.9 µs
/// against 4.7 without the small areas; in quiet rounds they took 1.33 µs against 1.7–2.0:
/// `docs/results/2026-12-07-2core-22bfbe8`.)
static SPIN_BACKOFF: Backoff = Backoff::new();

/// The state of [`SPIN_BACKOFF`]: the calls left that skip the spin, and the next skip's
/// length. Relaxed atomics: a heuristic, which threads racing on it can only make spin a call
/// more or less.
pub(super) struct Backoff {
    skip: AtomicU32,
    next: AtomicU32,
}

impl Backoff {
    /// A backoff with nothing to skip.
    pub(super) const fn new() -> Backoff {
        Backoff {
            skip: AtomicU32::new(0),
            next: AtomicU32::new(0),
        }
    }

    /// Whether this call skips its spin (counting it off if so).
    pub(super) fn skip(&self) -> bool {
        let left = self.skip.load(Ordering::Relaxed);
        if left == 0 {
            return false;
        }
        self.skip.store(left - 1, Ordering::Relaxed);
        true
    }

    /// A call spun: `paid` if every peer came within the spin.
    pub(super) fn spun(&self, paid: bool) {
        if paid {
            self.next.store(0, Ordering::Relaxed);
        } else {
            let next = (self.next.load(Ordering::Relaxed) * 2).clamp(1, 64);
            self.next.store(next, Ordering::Relaxed);
            self.skip.store(next, Ordering::Relaxed);
        }
    }
}

/// Whether `local` ranks outnumber the cores this process may run on (counted once): there a
/// spin keeps the core from the peer it waits for, so a wait gives the core away at once.
fn crowded(local: usize) -> bool {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    local > cores
}

/// Whether a peer's small-area word `v` says its input for `target` is there, where the area's
/// word before this piece was `before` (on every rank alike: the last piece that wrote the
/// area, or 0): `Some(true)` for `target`, `Some(false)` for `before` (not yet, however long
/// ago that piece was; also where `before` is `target`, after exactly 2³² pieces, which only
/// the peer's `Input` word can tell apart), `None` for anything else (a corrupt arena).
pub(super) fn small_reached(v: u32, target: u32, before: u32) -> Option<bool> {
    if v == before {
        Some(false)
    } else if v == target {
        Some(true)
    } else {
        None
    }
}

/// A round's place on the small areas: the area, the piece's word (`k + 1`), and the word the
/// area held before it ([`small_reached`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Round {
    pub(super) area: usize,
    pub(super) target: u32,
    pub(super) before: u32,
}

impl<L: Link> Host<'_, '_, L> {
    /// all_reduce of `data` (at most the small areas' bytes) through the small areas.
    pub(super) fn all_reduce_small<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let (c, a) = (self.c, self.a);
        let Round { area, target, .. } = self.small_round(bytes(data))?;
        let len = std::mem::size_of_val(data);
        self.reduce_from(data, 0, op, len.max(1), &|q, off, dst| {
            a.read_small(q, area, off, dst)
                .map_err(|e| e.map_op(|_| c.op_text()))
        })?;
        if self.whole {
            finish(data, op, c.n);
        }
        a.publish(ArenaWord::Reduced, target);
        Ok(())
    }

    /// One round on the small areas, every collective's that takes them: writes `data` (at
    /// most the small areas' bytes, empty for a rank with nothing to give), the call's
    /// descriptor and the piece's word into this rank's area for the next piece, publishes
    /// `Input`, waits until every peer's area holds its part of the same piece and checks their
    /// descriptors. Returns the round (its area and word, `k + 1`); the caller reads what it
    /// needs of the peers' areas, then publishes `Reduced` with the word.
    pub(super) fn small_round(&self, data: &[u8]) -> Result<Round> {
        let c = self.c;
        let round = self.small_put(data)?;
        let budget = self.spin_budget();
        // One look at every peer first, in one pass: the loads do not depend on each other, so
        // the processor has the peers' lines on their way at once instead of one after another
        // (at 16 ranks, fifteen cache-line transfers overlapped rather than in a row). Those
        // not there yet are waited for after.
        let mut late = Vec::new();
        for &q in self.local.iter().filter(|&&q| q != c.me) {
            if !self.arrived(q, round)? {
                late.push(q);
            }
        }
        if late.is_empty() {
            if !budget.is_zero() {
                SPIN_BACKOFF.spun(true);
            }
            return Ok(round);
        }
        let mut spin = budget;
        for q in late {
            spin = spin.saturating_sub(self.wait_small(q, round, spin)?);
        }
        if !budget.is_zero() {
            SPIN_BACKOFF.spun(!spin.is_zero());
        }
        Ok(round)
    }

    /// How long this call may spin on its peers' area words, in all: the arena's
    /// [`HostArena::small_spin`](crate::arena::HostArena::small_spin) ([`SMALL_SPIN`](super::consts::SMALL_SPIN) by
    /// default), none on a crowded host or in a backoff ([`SPIN_BACKOFF`]).
    pub(super) fn spin_budget(&self) -> Duration {
        if crowded(self.local.len()) || SPIN_BACKOFF.skip() {
            Duration::ZERO
        } else {
            self.a.small_spin()
        }
    }

    /// Waits for the root `root`'s area word of this piece only (a broadcast's non-root),
    /// spinning as [`Host::small_round`] does, and checks its descriptor.
    pub(super) fn wait_root(&self, root: usize, round: Round) -> Result<()> {
        let budget = self.spin_budget();
        let spun = self.wait_small(root, round, budget)?;
        if !budget.is_zero() {
            SPIN_BACKOFF.spun(spun < budget);
        }
        Ok(())
    }

    /// Writes `data`, the call's descriptor and the next piece's word into this rank's small
    /// area for it (once [`Host::ready_to_write`]), and publishes `Input`; returns the round.
    pub(super) fn small_put(&self, data: &[u8]) -> Result<Round> {
        let (c, a) = (self.c, self.a);
        self.ready_to_write()?;
        let (k, area) = self.next_piece();
        let target = k.wrapping_add(1);
        let before = a.small_seq(c.me, area);
        a.put_small(area, target, c.meta(), data)
            .map_err(|e| e.map_op(|_| c.op_text()))?;
        // Beside the slot too, for a peer in a mismatched call on the pieces' path, which
        // looks there.
        a.set_meta(area, c.meta());
        a.publish(ArenaWord::Input, target);
        Ok(Round {
            area,
            target,
            before,
        })
    }

    /// Before this rank writes its small area or slot for its next piece k: where its piece
    /// k − 1 was a broadcast on the small areas (its own area for k − 1 holds the word k and a
    /// broadcast's descriptor), in which it waited for the root at most, waits until every peer
    /// has published `Input` k (it has started piece k − 1, so it is done reading piece k − 2,
    /// the last use of what this rank is about to write), and checks that peer's descriptor for
    /// piece k − 1 against this rank's: a broadcast whose ranks disagreed (on its root, say) is
    /// found here, at the next call, as a root over messages finds it. Where piece k − 1 was
    /// anything else, this rank waited in it for every peer's word of k − 1: nothing to do.
    ///
    /// Then it publishes `Reduced` k, the broadcast's (which the broadcast leaves out): a peer
    /// still in piece k − 2, splitting it into shares, waits for this rank's `Reduced` k − 1
    /// and may not see k yet (the protocol allows no word ahead there); once every peer has
    /// started piece k − 1, none is.
    pub(super) fn ready_to_write(&self) -> Result<()> {
        let (c, a) = (self.c, self.a);
        let k = a.load(c.me, ArenaWord::Input);
        let prev = (k.wrapping_sub(1) % 2) as usize;
        // At the very start (k = 0) area 1 holds nothing (word 0, descriptor zeros, no
        // broadcast's); after the count wraps, k = 0 is a piece like any other.
        if a.small_seq(c.me, prev) != k {
            return Ok(());
        }
        let mine = a.small_meta(c.me, prev);
        let was = Desc::decode(&mine);
        if was.kind != super::desc::Kind::Broadcast as u8 {
            return Ok(());
        }
        let checked = self
            .local
            .iter()
            .filter(|&&q| q != c.me)
            .try_for_each(|&q| {
                wait_word_after(c, a, q, ArenaWord::Input, k, Some(&mine))?;
                let theirs = a.small_meta(q, prev);
                if theirs != mine {
                    return Err(DistError::CollectiveMismatch {
                        rank: c.me,
                        op: format!(
                            "{} (found at the next call: {})",
                            was.describe(),
                            c.op_text()
                        ),
                        peer: q,
                        detail: was.differences(&Desc::decode(&theirs)),
                    });
                }
                Ok(())
            });
        if let Err(e @ DistError::CollectiveMismatch { .. }) = &checked {
            // The notice names the broadcast, not this call: a peer still in the broadcast
            // (waiting for messages that will not come) must stop too. Calls over messages only
            // may have come between, so its number is not this call's less one but the
            // descriptors' call numbers (the number less one, mod 2¹⁶) apart.
            let since = c.desc().seq.wrapping_sub(was.seq);
            abort_all(c.g, e, Some(c.number().saturating_sub(u64::from(since))));
        }
        checked?;
        a.publish(ArenaWord::Reduced, k);
        Ok(())
    }

    /// Whether peer `q`'s small area of `round` holds its input for it (its descriptor checked
    /// then), at one look: no clock read, no wait.
    pub(super) fn arrived(&self, q: usize, round: Round) -> Result<bool> {
        let v = self.a.small_seq(q, round.area);
        match small_reached(v, round.target, round.before) {
            Some(true) => self.check_meta(q, round).map(|()| true),
            Some(false) => Ok(false),
            None => Err(self.corrupt(q, round, v)),
        }
    }

    /// Waits until peer `q`'s small area of `round` holds its input for it, spinning for at
    /// most `spin`, and checks its descriptor; returns how long it spun. The clock is read
    /// once every [`LOOKS_PER_CLOCK`] looks while spinning (a look is a load, the clock far
    /// more), and not at all where the first look finds the word.
    pub(super) fn wait_small(&self, q: usize, round: Round, spin: Duration) -> Result<Duration> {
        if self.arrived(q, round)? {
            return Ok(Duration::ZERO);
        }
        let (c, a) = (self.c, self.a);
        let Round { area, target, .. } = round;
        let started = Instant::now();
        let mut looks = 0u32;
        loop {
            looks = looks.wrapping_add(1);
            if looks.is_multiple_of(LOOKS_PER_CLOCK) || spin.is_zero() {
                let spun = started.elapsed();
                if spun >= spin {
                    // Late: wait as every arena wait does, on the peer's input word.
                    wait_word(c, a, q, ArenaWord::Input, target)?;
                    let v = a.small_seq(q, area);
                    if v == target {
                        self.check_meta(q, round)?;
                        return Ok(spin);
                    }
                    let theirs = a.meta(q, area);
                    if theirs != c.meta() {
                        return Err(self.mismatch(q, theirs));
                    }
                    return Err(self.corrupt(q, round, v));
                }
            }
            std::hint::spin_loop();
            if self.arrived(q, round)? {
                return Ok(started.elapsed().min(spin));
            }
        }
    }

    /// Checks peer `q`'s descriptor in its small area of `round` (its word says its input is
    /// there) against this rank's call.
    fn check_meta(&self, q: usize, round: Round) -> Result<()> {
        let theirs = self.a.small_meta(q, round.area);
        if theirs != self.c.meta() {
            return Err(self.mismatch(q, theirs));
        }
        Ok(())
    }

    fn mismatch(&self, q: usize, theirs: crate::backend::Meta) -> DistError {
        let c = self.c;
        DistError::CollectiveMismatch {
            rank: c.me,
            op: c.op_text(),
            peer: q,
            detail: c.desc().differences(&Desc::decode(&theirs)),
        }
    }

    fn corrupt(&self, q: usize, round: Round, v: u32) -> DistError {
        let Round {
            area,
            target,
            before,
        } = round;
        let c = self.c;
        DistError::PeerGone {
            rank: c.me,
            peer: q,
            op: c.op_text(),
            cause: format!(
                "corrupt host arena: its small area {area}'s word is {v}, where this rank waits \
                 for {target} (possible: {target}, or the area's word before this piece, \
                 {before})"
            ),
        }
    }
}

//! A host arena: memory that the ranks of one host share, which a [`Link`](crate::Link) may
//! offer ([`Link::arena`](crate::Link::arena)) so that the collectives of its group read their
//! peers' buffers in place instead of passing messages (see `collectives/host.rs`).
//!
//! Each rank of the host owns two slots of [`HostArena::slot_len`] bytes, which it alone
//! writes and its host's other ranks read, and a header of sequence words
//! ([`ArenaWord`]) that it alone publishes and the others wait on. Everything a peer
//! published is untrusted input: the words are checked by the collectives against what the
//! protocol allows, and the slot accesses are checked by the arena against its bounds.

use std::time::Duration;

use crate::backend::Meta;
use crate::error::Result;

/// A sequence word in a rank's arena header. Each counts the pieces of collectives the rank has
/// gone through on the arena (wrapping at 2³²).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaWord {
    /// The rank's input for piece k is in its slot `k % 2`: it publishes k + 1.
    Input = 0,
    /// The rank's reduced share of piece k is in its slot `k % 2` (or, for a collective that
    /// reduces the whole piece on every rank, the rank has read every input of piece k): it
    /// publishes k + 1.
    Reduced = 1,
}

impl ArenaWord {
    /// The word's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            ArenaWord::Input => "input",
            ArenaWord::Reduced => "reduced",
        }
    }
}

/// Memory shared by the ranks of one host, as a link offers it. Ranks are the link's.
///
/// Every method is safe: a slot access out of bounds, or to a rank not on this host, is an
/// error (never an access outside the arena); a value a peer published may be anything, and
/// the caller checks it.
pub trait HostArena: Send + Sync {
    /// The host of every rank of the link, as an index (ranks with the same index share a
    /// host); the same on every rank. A rank that shares no memory has a host of its own.
    fn hosts(&self) -> &[usize];

    /// The ranks of this rank's host, in rank order ([`host_ranks`] of [`HostArena::hosts`]
    /// for this rank), kept so that a call does not work them out again.
    fn local(&self) -> &[usize];

    /// Whether this rank has mapped the arena of every other rank of its host (and they its
    /// own). It may differ between ranks: the group agrees on it before using the arena.
    fn complete(&self) -> bool;

    /// Claims this rank's arena for the group that asks (on its first all_reduce): true the
    /// first time, false ever after. The arena's words count one group's pieces, so a later
    /// group over the same link (formed after the first was dropped: two cannot live at once,
    /// [`Link::claim_group`](crate::Link::claim_group)) must not use it: it runs its
    /// all_reduces over messages.
    fn claim(&self) -> bool;

    /// The bytes of one slot.
    fn slot_len(&self) -> usize;

    /// How long a wait spins before it sleeps (zero where the host has more ranks than cores).
    fn spin(&self) -> Duration;

    /// Copies `data` into this rank's slot `slot` (0 or 1) at byte `offset`.
    fn write(&self, slot: usize, offset: usize, data: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes of rank `owner`'s slot `slot` at byte `offset` into `dst`
    /// (`owner` may be this rank).
    fn read(&self, owner: usize, slot: usize, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Publishes `meta` (the descriptor of the collective whose first piece uses slot `slot`)
    /// beside that slot, before the input word that announces it.
    fn set_meta(&self, slot: usize, meta: Meta);

    /// The descriptor rank `owner` published beside its slot `slot` (zeros for a rank not on
    /// this host).
    fn meta(&self, owner: usize, slot: usize) -> Meta;

    /// Publishes `meta`, the descriptor of the collective this rank is in now (whatever its
    /// algorithm), so that a peer waiting on the arena can tell a mismatched call from a late
    /// one.
    fn set_call(&self, meta: Meta);

    /// The descriptor rank `owner` last published with [`HostArena::set_call`] (zeros for
    /// none, for a rank not on this host, or while the owner is writing it: never half of one
    /// and half of another).
    fn call(&self, owner: usize) -> Meta;

    /// Stores `value` in this rank's word `word` (a release store: the slot bytes written
    /// before are visible to a peer that loads it), and wakes the peers that sleep on it.
    fn publish(&self, word: ArenaWord, value: u32);

    /// Loads rank `owner`'s word `word` (an acquire load; `owner` may be this rank; 0 for a
    /// rank not on this host).
    fn load(&self, owner: usize, word: ArenaWord) -> u32;

    /// Sleeps while rank `owner`'s word `word` holds `seen`, at most `limit`; a wake-up, a
    /// timeout or a spurious return all return: the caller looks again.
    fn sleep(&self, owner: usize, word: ArenaWord, seen: u32, limit: Duration);

    /// An error if rank `owner` is known to be gone ([`DistError::PeerGone`](crate::DistError::PeerGone)
    /// or [`DistError::PeerUnresponsive`](crate::DistError::PeerUnresponsive), naming it), for
    /// the operation `op`.
    fn check_peer(&self, owner: usize, op: &dyn Fn() -> String) -> Result<()>;
}

/// The ranks of `hosts` on `me`'s host, in rank order.
pub fn host_ranks(hosts: &[usize], me: usize) -> Vec<usize> {
    let h = hosts.get(me).copied();
    (0..hosts.len()).filter(|&r| Some(hosts[r]) == h).collect()
}

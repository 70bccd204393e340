//! Shared memory between ranks of one host: a byte ring per ordered pair of ranks in a sealed
//! `memfd` of the sending rank, passed to the receiving rank with `SCM_RIGHTS` when the
//! connection is made (`setup.rs`). The frames that would cross the TCP connection go through
//! the ring instead, and the TCP connection stays as the liveness channel and the doorbell:
//! a rank whose I/O thread sleeps asks for a byte on it when data arrives. Each rank also owns
//! a host arena (`arena.rs`), a segment its host's peers map read-only, on which the
//! collectives read each other's buffers in place. See `docs/architecture.md`, "Shared memory".

mod arena;
mod arena_map;
mod busy;
mod copy;
mod map;
mod peer_cred;
mod pidfd;
mod ring;
mod setup;
mod shared_map;

pub(crate) use arena::{ArenaSetup, TcpArena};
pub(crate) use ring::{RxRing, TxRing};
pub(crate) use setup::{Shm, host_identity, negotiate};

impl crate::TcpBackend {
    /// Whether frames to and from `peer` go through shared memory: `(to, from)`. Both are
    /// false for this rank itself, a rank out of range, a peer on another host, and when
    /// shared memory is off (`DIST_SHM=0`).
    pub fn shared_memory_with(&self, peer: usize) -> (bool, bool) {
        self.shared
            .peers
            .get(peer)
            .map_or((false, false), |p| p.shared_memory())
    }
}

//! Support for dist's own tests, not part of the API: a rank that forms the mesh with the real
//! handshake and then gets the raw connections, to play a hostile peer.

use std::net::TcpStream;

use dist_core::Result;

use crate::{TcpConfig, init};

pub use crate::init::{Dialed, Formed, Mesh, OnIncoming};

/// Joins the job `cfg` describes through the real rendezvous and handshake, eagerly whatever
/// `cfg` says, and returns the connection to every other rank (`None` at this rank's own
/// index), with no reader on them. Like every rank, it first answers each peer's
/// shared-memory offer (declining it), so frames written on the connections are read as such.
pub fn form_raw(cfg: &TcpConfig) -> Result<Vec<Option<TcpStream>>> {
    let (streams, _store) = init::form(cfg)?;
    let deadline = std::time::Instant::now() + cfg.init_timeout;
    for (peer, s) in streams.iter().enumerate() {
        if let Some(s) = s {
            crate::shm::negotiate(s, cfg.rank, peer, None, None, deadline).map_err(|cause| {
                dist_core::DistError::PeerGone {
                    rank: cfg.rank,
                    peer,
                    op: "answer the shared-memory offer".into(),
                    cause,
                }
            })?;
        }
    }
    Ok(streams)
}

/// Forms the job `cfg` describes lazily ([`Formation::Lazy`](crate::Formation), whatever `cfg`
/// says): no rank connected to another, each with its listener and acceptor up (the
/// connections peers make go to `on_incoming`), with no peer layer on the connections; for the
/// formation benchmarks and tests.
pub fn form_lazy(cfg: &TcpConfig, on_incoming: OnIncoming) -> Result<Formed> {
    init::form_lazy(cfg, on_incoming)
}

/// How many peers `b` has a connection to now (the loopback peer, this rank itself, not
/// counted).
pub fn connected_peers(b: &crate::TcpBackend) -> usize {
    b.shared
        .peers
        .iter()
        .filter(|p| !p.is_loopback() && p.is_connected())
        .count()
}

/// A second handle on `b`'s connection to `peer` (its socket, under the shared-memory ring
/// too), for a test rank that plays a peer writing bytes the protocol does not expect.
pub fn peer_socket(b: &crate::TcpBackend, peer: usize) -> Option<TcpStream> {
    b.shared.peers.get(peer)?.stream()?.try_clone().ok()
}

/// Makes this process exit (status 0, abruptly: no backend dropped) inside its next
/// [`TcpBackend::recover`](crate::TcpBackend::recover), right after it checked in for the
/// agreement: a rank that fails during the recovery itself, for the tests of that.
pub fn die_in_recovery() {
    DIE_IN_RECOVERY.store(true, std::sync::atomic::Ordering::SeqCst);
}

static DIE_IN_RECOVERY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`die_in_recovery`] was called.
pub(crate) fn dies_in_recovery() -> bool {
    DIE_IN_RECOVERY.load(std::sync::atomic::Ordering::SeqCst)
}

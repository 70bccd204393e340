//! What ties a lazily formed job's mesh ([`Mesh`]: the acceptor and the dialer) to the peers:
//! the connect hook each unconnected peer calls on first use, and the hand-off of the
//! connections peers make to this rank.

use std::net::TcpStream;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use dist_core::DistError;

use crate::init::{Dialed, Mesh};
use crate::peer::{ConnectHook, Peer};

/// The connect hook of an unconnected peer: dials it through `mesh` (which holds no reference
/// back, so the backend's teardown ends the mesh).
pub(crate) fn dialer(me: usize, mesh: &Arc<Mesh>) -> ConnectHook {
    let mesh = Arc::downgrade(mesh);
    Arc::new(move |peer, deadline| match mesh.upgrade() {
        None => Err(DistError::PeerGone {
            rank: me,
            peer,
            op: format!("connect to rank {peer}"),
            cause: "this rank's backend is closing".into(),
        }),
        Some(m) => match m.dial(peer, deadline)? {
            Dialed::Stream(s) => Ok(Some(s)),
            // The peer's own connection won, and `Incoming::deliver` attached it before `dial`
            // returned.
            Dialed::Elsewhere => Ok(None),
        },
    })
}

/// Connections peers made to this rank, attached to their peers; those that arrive before the
/// peers exist (a fast rank may dial as soon as formation ends) wait here until [`open`].
///
/// [`open`]: Incoming::open
#[derive(Default)]
pub(crate) struct Incoming {
    peers: OnceLock<Vec<Weak<Peer>>>,
    early: Mutex<Vec<(usize, TcpStream)>>,
}

impl Incoming {
    /// Hands the connection `peer` made to this rank (its handshake done) to that peer.
    pub(crate) fn deliver(&self, peer: usize, stream: TcpStream) {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock `open` sets the peers under: no stream is left behind.
        match self.peers.get() {
            Some(peers) => {
                drop(early);
                attach(peers, peer, stream);
            }
            None => early.push((peer, stream)),
        }
    }

    /// The peers exist: attaches the connections that came before, and every later one at once.
    pub(crate) fn open(&self, peers: &[Arc<Peer>]) {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.peers.set(peers.iter().map(Arc::downgrade).collect());
        let waiting = std::mem::take(&mut *early);
        drop(early);
        if let Some(peers) = self.peers.get() {
            for (r, s) in waiting {
                attach(peers, r, s);
            }
        }
    }
}

fn attach(peers: &[Weak<Peer>], rank: usize, stream: TcpStream) {
    let Some(p) = peers.get(rank).and_then(Weak::upgrade) else {
        return;
    };
    match p.attach(stream) {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            rank = p.me,
            peer = rank,
            "a second connection from a connected peer was dropped"
        ),
        Err(e) => {
            tracing::warn!(rank = p.me, peer = rank, error = %e, "could not attach a connection")
        }
    }
}

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
pub(crate) struct Incoming {
    peers: OnceLock<Vec<Weak<Peer>>>,
    /// The connections that came before the peers existed; `None` once closed.
    early: Mutex<Option<Vec<(usize, TcpStream)>>>,
}

impl Default for Incoming {
    fn default() -> Incoming {
        Incoming {
            peers: OnceLock::new(),
            early: Mutex::new(Some(Vec::new())),
        }
    }
}

impl Incoming {
    /// Hands the connection `peer` made to this rank (its handshake done) to that peer.
    /// Returns whether the connection is in use (or waits for the peers to exist); `false`:
    /// it was shut (the backend is closing, or the peer could not take it).
    pub(crate) fn deliver(&self, peer: usize, stream: TcpStream) -> bool {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock `open` sets the peers under, and `close` closes under: no
        // stream is left behind, and none attached once the backend is closing.
        let Some(waiting) = early.as_mut() else {
            drop(early);
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return false;
        };
        match self.peers.get() {
            Some(peers) => {
                // Attached under the lock, so that `close` returning means no attach is left.
                attach(peers, peer, stream)
            }
            None => {
                waiting.push((peer, stream));
                true
            }
        }
    }

    /// The backend is closing: every connection delivered from now on is shut and dropped.
    /// Returns once no attach is in progress.
    pub(crate) fn close(&self) {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        *early = None;
    }

    /// The peers exist: attaches the connections that came before, and every later one at once.
    pub(crate) fn open(&self, peers: &[Arc<Peer>]) {
        let mut early = self.early.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.peers.set(peers.iter().map(Arc::downgrade).collect());
        let waiting = early.as_mut().map(std::mem::take).unwrap_or_default();
        if let Some(peers) = self.peers.get() {
            for (r, s) in waiting {
                // A failure here is logged; the link was counted connected when this
                // connection was delivered early (left open: see docs/scale.md).
                attach(peers, r, s);
            }
        }
    }
}

/// Attaches `stream` to peer `rank`; whether the peer has a connection now (this one, or
/// one it had already).
fn attach(peers: &[Weak<Peer>], rank: usize, stream: TcpStream) -> bool {
    let Some(p) = peers.get(rank).and_then(Weak::upgrade) else {
        return false;
    };
    match p.attach(stream) {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!(
                rank = p.me,
                peer = rank,
                "a second connection from a connected peer was dropped"
            );
            true
        }
        Err(e) => {
            tracing::warn!(rank = p.me, peer = rank, error = %e, "could not attach a connection");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Duration;

    use super::*;
    use crate::peer::{Aborts, Limits};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// Before `close`, a delivered connection is attached to its peer; after it (the backend's
    /// teardown has begun), one a handshake worker still delivers is shut, not attached (it
    /// was attached to a closing peer before the fix, which then never told that peer goodbye).
    #[test]
    fn a_connection_delivered_after_close_is_shut_not_attached() {
        let aborts = Arc::new(Aborts::default());
        let limits = Limits {
            max_message: 1 << 20,
            unexpected: 1 << 20,
            sealed: false,
        };
        let unconnected = |r| {
            Arc::new(Peer::unconnected(
                0,
                r,
                Duration::from_secs(5),
                aborts.clone(),
                limits,
                None,
            ))
        };
        let peers = vec![
            Arc::new(Peer::loopback(0, aborts.clone())),
            unconnected(1),
            unconnected(2),
        ];
        let inc = Incoming::default();
        // One arrives before the peers exist, and is attached when they do.
        let (early, _early_far) = pair();
        assert!(inc.deliver(1, early), "kept until the peers exist");
        assert!(!peers[1].is_connected());
        inc.open(&peers);
        assert!(peers[1].is_connected());
        inc.close();
        let (late, mut late_far) = pair();
        assert!(!inc.deliver(2, late), "a connection shut is not in use");
        assert!(!peers[2].is_connected());
        late_far
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            late_far.read(&mut buf).unwrap(),
            0,
            "the late connection is shut"
        );
    }
}

//! Connections made after formation ([`Formation::Lazy`](crate::Formation)): each rank keeps
//! its listener and a long-lived [`Acceptor`], and dials a peer on first use ([`Mesh::dial`]).
//! Both sides may dial at once; [`Links`] resolves it (the lower rank's connection wins).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};

use super::acceptor::Acceptor;
use super::handshake::{Failed, Gate, Rules, client_handshake, nonce};
use super::links::{Links, Next, OnIncoming, Outcome, Start};
use crate::wire::{Hello, PROTOCOL_VERSION, Purpose};

/// What [`Mesh::dial`] got.
#[derive(Debug)]
pub enum Dialed {
    /// The connection to the peer, for the caller to use: its own, or the peer's when both
    /// dialed and the peer is the lower rank.
    Stream(TcpStream),
    /// The peer's connection arrived first and went to `on_incoming` (which returned before
    /// this did); nothing for the caller.
    Elsewhere,
}

/// One rank's means of connecting after formation: its acceptor, the table of listeners, and
/// the per-peer links shared by both.
pub struct Mesh {
    me: usize,
    world: usize,
    job_id: u64,
    secret: Option<Vec<u8>>,
    seal: bool,
    addrs: Vec<SocketAddr>,
    /// How long a peer's acceptor may take over a handshake; a dial waits for the verdict up
    /// to this long past its caller's deadline (see `client_handshake`).
    handshake_timeout: Duration,
    links: Arc<Links>,
    _acceptor: Option<Acceptor>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.me)
            .field("world_size", &self.world)
            .field("job_id", &self.job_id)
            .field("listening", &self._acceptor.is_some())
            .finish()
    }
}

/// What a rank needs to build its [`Mesh`].
pub(crate) struct MeshSpec {
    pub(crate) me: usize,
    pub(crate) world: usize,
    pub(crate) job_id: u64,
    pub(crate) secret: Option<Vec<u8>>,
    /// Whether connections are sealed (`crate::seal`).
    pub(crate) seal: bool,
    pub(crate) handshake_timeout: Duration,
    pub(crate) addrs: Vec<SocketAddr>,
}

impl Mesh {
    /// Starts the acceptor on `listener` (none for a rank connected to every peer already);
    /// `connected(r)` says which links formation made. `on_incoming` gets each connection a
    /// peer makes to this rank that no dialer of this rank waits for, on a handshake worker,
    /// from now on.
    pub(crate) fn start(
        spec: MeshSpec,
        listener: Option<TcpListener>,
        connected: impl Fn(usize) -> bool,
        on_incoming: OnIncoming,
    ) -> Result<Mesh> {
        let MeshSpec {
            me,
            world,
            job_id,
            secret,
            seal,
            handshake_timeout,
            addrs,
        } = spec;
        let links = Arc::new(Links::new(
            me,
            |r| r == me || connected(r),
            world,
            on_incoming,
        ));
        let acceptor = match listener {
            None => None,
            Some(l) => Some(Acceptor::start(
                l,
                Rules {
                    me,
                    world,
                    purpose: Purpose::Mesh,
                    ranks: 0..world,
                    job_id,
                    secret: secret.clone(),
                    seal,
                    handshake_timeout,
                    gate: Gate::Mesh(links.clone()),
                },
            )?),
        };
        Ok(Mesh {
            me,
            world,
            job_id,
            secret,
            seal,
            addrs,
            handshake_timeout,
            links,
            _acceptor: acceptor,
        })
    }

    /// Sets the table of listeners, once it has arrived (rank 0 starts its mesh before it
    /// knows the others' listeners).
    pub(crate) fn set_addrs(&mut self, addrs: Vec<SocketAddr>) {
        self.addrs = addrs;
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.me
    }

    /// How many ranks of the job (this one included) listen on this rank's own address: the
    /// ranks on this host, as far as the table of listeners tells.
    pub(crate) fn same_host_ranks(&self) -> usize {
        match self.addrs.get(self.me) {
            Some(mine) => self.addrs.iter().filter(|a| a.ip() == mine.ip()).count(),
            None => 1,
        }
    }

    /// Whether this rank is connected to `peer` (its stream went to a dialer or the callback).
    pub fn is_connected(&self, peer: usize) -> bool {
        self.links.get(peer) == super::links::Link::Connected
    }

    /// Connects to `peer` by `deadline`, for its first use. A refused connection is final
    /// (every listener is up once the job has formed, so the peer is gone); a listener that
    /// closes the connection unread (busy with other handshakes) is tried again with backoff;
    /// when both ranks dial at once the higher one waits for the lower one's connection.
    pub fn dial(&self, peer: usize, deadline: Instant) -> Result<Dialed> {
        let me = self.me;
        let op = || format!("connect to rank {peer}");
        if peer >= self.world || peer == me {
            return Err(DistError::InvalidRank {
                rank: me,
                op: op(),
                given: peer,
                world_size: self.world,
            });
        }
        let timeout = |started: Instant| DistError::Timeout {
            rank: me,
            op: op(),
            peer,
            waited: started.elapsed(),
        };
        let started = Instant::now();
        match self.links.begin(peer, deadline) {
            None => return Err(timeout(started)),
            Some(Start::Already) => return Ok(Dialed::Elsewhere),
            Some(_) => {} // This thread is the dialer now.
        }
        let (outcome, own, err) = match self.handshake(peer, deadline) {
            Ok(s) => (Outcome::Won, Some(s), None),
            Err(Failed::Crossed(e)) => (Outcome::Crossed, None, Some(e)),
            Err(Failed::Final(e) | Failed::TurnedAway(e)) => (Outcome::Failed, None, Some(e)),
        };
        match self.links.outcome(peer, outcome) {
            Next::UseOwn => Ok(Dialed::Stream(own.expect("won with a stream"))),
            Next::Fail => Err(err.expect("failed with an error")),
            Next::AwaitHanded => {
                drop(own);
                tracing::debug!(
                    rank = me,
                    peer,
                    "crossed; waiting for the peer's connection"
                );
                match self.links.await_handed(peer, deadline) {
                    Some(s) => Ok(Dialed::Stream(s)),
                    None if self.is_connected(peer) => Ok(Dialed::Elsewhere),
                    None => Err(DistError::PeerGone {
                        rank: me,
                        peer,
                        op: op(),
                        cause: format!(
                            "both ranks connected at once and rank {peer}'s connection, which \
                             wins, did not arrive within {:.1?}",
                            started.elapsed()
                        ),
                    }),
                }
            }
        }
    }

    /// Connects to `peer`'s listener and runs the handshake, again with backoff while the
    /// listener turns the connection away unread.
    fn handshake(&self, peer: usize, deadline: Instant) -> std::result::Result<TcpStream, Failed> {
        let me = self.me;
        let addr = self.addrs[peer];
        let who = format!("rank {peer} at {addr}");
        let gone = |cause: String| DistError::PeerGone {
            rank: me,
            peer,
            op: format!("connect to rank {peer} at {addr}"),
            cause,
        };
        let mut backoff = Duration::from_millis(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failed::Final(DistError::Timeout {
                    rank: me,
                    op: format!("connect to rank {peer} at {addr}"),
                    peer,
                    waited: Duration::ZERO,
                }));
            }
            let mut s = match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    return Err(Failed::Final(gone(format!(
                        "connection refused: its listener is closed ({e})"
                    ))));
                }
                Err(e) => return Err(Failed::Final(gone(e.to_string()))),
            };
            let hello = Hello {
                version: PROTOCOL_VERSION,
                purpose: Purpose::Mesh,
                has_secret: self.secret.is_some(),
                sealed: self.seal,
                world_size: self.world as u32,
                rank: me as u32,
                listen_port: 0,
                job_id: self.job_id,
                nonce: nonce(me).map_err(Failed::Final)?,
            };
            let secret = self.secret.as_deref();
            let grace = self.handshake_timeout;
            match client_handshake(
                &mut s,
                &hello,
                secret,
                peer as u32,
                deadline,
                grace,
                me,
                &who,
            ) {
                Ok(()) => return Ok(s),
                Err(Failed::TurnedAway(e)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Failed::Final(e));
                    }
                    // The listener is busy with other handshakes, each of which ends within
                    // its handshake timeout.
                    std::thread::sleep(backoff.min(left));
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(other) => return Err(other),
            }
        }
    }
}

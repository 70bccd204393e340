//! The TCP backend of dist: ranks rendezvous through the job's store (a TCPStore on
//! `MASTER_PORT`: rank 0's, or torchrun's agent's; [`TcpBackend::store`]), authenticate each
//! other, and keep TCP connections (a full mesh made at init below 65 ranks; from 65 ranks, by
//! default, each pair's connection made on its first use) over which tagged messages travel
//! with no copy on the large message path.
//!
//! ```no_run
//! use dist_core::Backend;
//! use dist_tcp::TcpBackend;
//!
//! # fn main() -> Result<(), dist_core::DistError> {
//! // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them.
//! let b = TcpBackend::from_env()?;
//! let (me, n) = (b.rank(), b.world_size());
//! b.send(format!("hello from {me}").as_bytes(), (me + 1) % n)?;
//! let mut buf = vec![0u8; format!("hello from {}", (me + n - 1) % n).len()];
//! b.recv(&mut buf, (me + n - 1) % n)?;
//! b.barrier()?;
//! # Ok(()) }
//! ```
//!
//! What a peer can make a rank hold is bounded. A frame longer than
//! [`TcpConfig::max_message`] (16 GiB by default), of an unknown kind or cut short is a protocol
//! error: that connection closes and every wait on it fails naming the peer. Messages that arrive
//! before their receive is posted are queued up to [`TcpConfig::unexpected_limit`] per peer
//! (64 MiB by default); past it the peer's socket is not read until receives are posted, so TCP
//! slows the sender. A message larger than that budget is never queued: its send completes once
//! the receiver posts the receive for it (so two ranks that each send such a message to the
//! other before receiving wait for each other until the send timeout; post the receive first,
//! or use `send_recv`).
#![deny(missing_docs)]

mod build;
mod config;
mod elastic;
mod init;
pub mod launch;
mod lazy;
mod link;
mod liveness;
mod peer;
mod record;
mod seal;
mod shm;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod wire;

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_core::flight::FlightRecorder;
use dist_core::transport::Link;
use dist_core::{Backend, DistError, Group, Result, Tag, Transport};

pub use config::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_INIT_TIMEOUT, DEFAULT_PEER_TIMEOUT, DEFAULT_STORE_PREFIX,
    DEFAULT_TIMEOUT, Formation, LAZY_FROM, TcpConfig,
};
/// The store crate, whose [`Store`](dist_store::Store) trait [`TcpBackend::store`]'s
/// operations come from.
pub use dist_store;
pub use elastic::{Admission, JOIN_ENV, joining};
pub use launch::{LaunchEnv, Launcher};
pub use link::TcpLink;

/// A sub-group of a [`TcpBackend`] (from [`dist_core::Subgroups::split`] or
/// [`dist_core::Subgroups::new_group`]): its own ranks, sequence numbers and tags over the
/// backend's connections.
///
/// It holds a shared handle on the connections, not a borrow of the backend, so it can move to
/// another thread. Once the backend is dropped its connections are closed: the group's calls
/// then fail (the peer gone, or a timeout at their deadline), they never wait past it.
pub type TcpGroup = dist_core::SubGroup<TcpLink>;
pub use liveness::{FaultCause, PeerFault};
pub use peer::AbortNotice;
pub use peer::TcpRecv;
use peer::{Aborts, Limits, Peer};

/// Default largest message a peer may send ([`TcpConfig::max_message`]).
pub const DEFAULT_MAX_MESSAGE: u64 = 16 << 30;
/// Default bytes of unexpected messages kept per peer ([`TcpConfig::unexpected_limit`]).
pub const DEFAULT_UNEXPECTED_LIMIT: usize = 64 << 20;

/// Reads `DIST_MAX_MESSAGE` and `DIST_UNEXPECTED_LIMIT` (bytes) from `get` into `cfg`.
fn limits_from_env(cfg: TcpConfig, get: &impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
    let bytes = |k: &str| -> Result<Option<u64>> {
        get(k)
            .map(|v| match v.trim().parse::<u64>() {
                Ok(x) if x > 0 && x <= isize::MAX as u64 => Ok(x),
                _ => Err(DistError::Config {
                    what: k.into(),
                    reason: format!(
                        "{v:?} is not a whole number of bytes from 1 to {}",
                        isize::MAX
                    ),
                }),
            })
            .transpose()
    };
    let mut cfg = cfg;
    if let Some(b) = bytes("DIST_MAX_MESSAGE")? {
        cfg = cfg.max_message(b);
    }
    if let Some(b) = bytes("DIST_UNEXPECTED_LIMIT")? {
        cfg = cfg.unexpected_limit(b as usize);
    }
    Ok(cfg)
}

struct Shared {
    rank: usize,
    world: usize,
    timeout: Duration,
    linger: Duration,
    peers: Vec<Arc<Peer>>,
    aborts: Arc<Aborts>,
    /// Whether large sends and receives run on separate threads (see [`TcpLink::send`]).
    parallel: bool,
    /// How long a peer may be silent before it is declared unresponsive.
    peer_timeout: Duration,
    /// The backend is being dropped: connections ending now are no faults.
    closing: AtomicBool,
    /// The peer-fault hooks, and the faults seen so far.
    faults: std::sync::Mutex<liveness::Faults>,
    /// The liveness thread's inbox.
    events: Arc<liveness::Inbox>,
    /// The last operations of this rank (collectives, barriers, point-to-point).
    flight: FlightRecorder,
    /// Where to write the flight record on a failure (`DIST_TRACE_DIR`).
    trace_dir: Option<std::path::PathBuf>,
    /// Held while the record is written (by a failing call, or the liveness thread).
    trace_lock: std::sync::Mutex<()>,
    /// Where the calls made beside this backend are (see [`TcpBackend::report_beside`]).
    beside: OnceLock<record::BesideSource>,
    /// Woken when a heartbeat arrives while some thread gathers positions (see `record.rs`).
    beats: record::BeatWait,
    /// The memory shared with the ranks of this host, on a job formed at init.
    arena: Option<shm::TcpArena>,
    /// A group runs over the link ([`dist_core::transport::Link::claim_group`]).
    group_claimed: AtomicBool,
    /// This backend's epoch ([`TcpBackend::epoch`]).
    epoch: u64,
    /// Each rank's job rank ([`TcpBackend::members`]).
    members: Vec<usize>,
    /// A failure revokes the backend ([`TcpConfig::elastic`]).
    elastic: bool,
    /// Why the backend was revoked, once it is (`elastic.rs`).
    revoked: OnceLock<elastic::Revocation>,
    /// The ranks seen failed, for the next agreement (`elastic.rs`).
    failed: std::sync::Mutex<std::collections::BTreeSet<usize>>,
    /// The first rank noted failed, and how it failed.
    first_failure: OnceLock<(usize, String)>,
}

/// Sends at least this large may run beside their receive on another thread.
const PARALLEL_MIN: usize = 64 << 10;

/// A rank of a job whose ranks talk over TCP. See the [crate docs](crate).
///
/// It owns the job's collective [`Group`] over its [`TcpLink`]: the collectives
/// ([`dist_core::Collectives`]) are methods on it, and so are sub-groups
/// ([`dist_core::Subgroups`]: `split`, `new_group`, giving [`TcpGroup`]s).
pub struct TcpBackend {
    shared: Arc<Shared>,
    /// Declared before `threads`, so dropped first: its lane thread is told to stop (rayon does
    /// not wait for it; it is idle by then, no collective being in flight) before the
    /// connections close.
    group: Group<TcpLink>,
    /// Held for its `Drop`, which closes the connections in order.
    _threads: Threads,
    /// The job's store (and its server, on the rank that serves it): dropped after the
    /// connections have closed.
    store: init::Kept,
    /// The configuration it formed with (a recovery forms the next epoch with it).
    cfg: TcpConfig,
    /// The job rank of the rank that serves the store, where one of the job's does.
    keeper: Option<usize>,
}

/// The backend's threads (the I/O thread, which reads every connection, and the liveness
/// thread); dropping this closes the connections in order (see its `Drop`).
struct Threads {
    shared: Arc<Shared>,
    /// The acceptor and dialer of a lazily formed job; stopped first at teardown.
    mesh: Option<Arc<init::Mesh>>,
    /// Where accepted connections are handed to their peers; closed first at teardown, so
    /// that a handshake still running then cannot attach a connection to a closing peer.
    incoming: Arc<lazy::Incoming>,
    io: peer::IoThread,
    liveness: Option<JoinHandle<()>>,
    /// The most a drop waits for the peers to close their side (a recovery's).
    linger_cap: Option<Duration>,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world)
            .finish()
    }
}

impl TcpBackend {
    /// Joins the job as `rank` of `world_size`, with rank 0 listening on `master` (`host:port`),
    /// and the default timeouts. Returns once every rank has joined (and, in an eager job, is
    /// connected to every other; see [`Formation`]).
    pub fn new(rank: usize, world_size: usize, master: impl Into<String>) -> Result<TcpBackend> {
        Self::with_config(TcpConfig::new(rank, world_size, master))
    }

    /// A configuration to adjust (timeouts, bind address, shared secret) before joining with
    /// [`TcpBackend::with_config`].
    pub fn builder(rank: usize, world_size: usize, master: impl Into<String>) -> TcpConfig {
        TcpConfig::new(rank, world_size, master)
    }

    /// Joins the job as torchrun describes it in the environment (see [`TcpConfig::from_env`]).
    pub fn from_env() -> Result<TcpBackend> {
        Self::with_config(TcpConfig::from_env()?)
    }

    /// Joins the job described by `cfg`.
    pub fn with_config(cfg: TcpConfig) -> Result<TcpBackend> {
        let keeper = cfg.serve_store.then_some(0);
        let elastic = cfg.elastic;
        let b = Self::build(cfg, None, keeper)?;
        if elastic {
            // Joiners find the job by these facts (`TcpBackend::join`).
            elastic::announce(&b)?;
        }
        Ok(b)
    }

    /// The job's store, under a prefix of this job's own (`<job prefix>/user`; see
    /// [`TcpConfig::store_prefix`]), for user code to coordinate beside the collectives:
    /// `set`, `get`, `add`, `wait`, `compare_set`, queues and named barriers
    /// ([`dist_store::Store`]). It is the store the job formed through: served by rank 0's
    /// backend (so it lives as long as that backend), or by torchrun's agent. Its operations
    /// that do not wait for keys are bounded by [`TcpConfig::timeout`]; those that wait take
    /// their own. [`PrefixStore::inner`](dist_store::PrefixStore::inner) is the connection
    /// without a prefix, to meet processes that are not dist's (a Python rank's
    /// `torch.distributed.TCPStore`) at keys agreed with them.
    pub fn store(&self) -> dist_store::PrefixStore<Arc<dist_store::TcpStore>> {
        self.store.under("user")
    }

    /// The job's store under `<job prefix>/<part>`, for the crates built on this one (the
    /// hybrid backend keeps its NCCL setup under `nccl`). `init` is formation's own.
    #[doc(hidden)]
    pub fn store_under(&self, part: &str) -> dist_store::PrefixStore<Arc<dist_store::TcpStore>> {
        self.store.under(part)
    }

    /// Calls `hook` whenever a peer fails: its connection closes or breaks, it stays silent past
    /// the peer timeout ([`TcpConfig::peer_timeout`]), or it sends an abort notice (one of its
    /// collectives failed). Faults seen before the call are passed to `hook` at once, on the
    /// calling thread; later ones on this backend's liveness thread, within milliseconds of
    /// being seen. A layer above (such as NCCL beside this mesh) can abort its own work there.
    ///
    /// Hooks must be quick and must not wait: the liveness thread also sends this rank's
    /// heartbeats, and a hook that blocks for longer than the peer timeout makes the peers
    /// declare this rank unresponsive. Calling back into the backend from a hook does not
    /// deadlock (no lock is held while hooks run), but a blocking call (a receive, a
    /// collective) holds the liveness thread up as any wait would. No fault is reported once
    /// the backend is being dropped.
    pub fn on_peer_fault(&self, hook: impl Fn(&PeerFault) + Send + Sync + 'static) {
        self.shared.add_hook(Arc::new(hook));
    }

    /// The abort notices received so far.
    pub fn abort_notices(&self) -> Vec<AbortNotice> {
        self.shared.aborts.notices()
    }

    /// Where this backend writes its flight record on a failure (`DIST_TRACE_DIR` or
    /// [`TcpConfig::trace_dir`]), if anywhere; layers above it (the NCCL side of
    /// `dist-hybrid`) write theirs beside it.
    pub fn trace_dir(&self) -> Option<&std::path::Path> {
        self.shared.trace_dir.as_deref()
    }
}

impl Transport for TcpBackend {
    type Link = TcpLink;

    fn group(&self) -> &Group<TcpLink> {
        &self.group
    }
}

impl Shared {
    /// Keeps `n` ([`peer::Aborts::raise`]) and, if a wait may end because of it, wakes every
    /// waiter to recheck: a notice that ends no wait its sender's others did not costs no work
    /// per peer.
    fn note_abort(&self, n: AbortNotice) {
        tracing::debug!(rank = self.rank, from = n.from, reason = %n.reason, "abort notice");
        if self.aborts.raise(n) {
            for p in &self.peers {
                p.wake();
            }
        }
    }
}

impl Backend for TcpBackend {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn default_timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> Result<()> {
        self.recorded("send", data.len(), dst, || {
            let op = || format!("send to {dst} (tag {tag}, {} bytes)", data.len());
            self.shared.refuse_if_revoked(op)?;
            let deadline = deadline_after(self.shared.rank, self.shared.timeout, op)?;
            self.group
                .link()
                .send(data, dst, tag, [0; 16], deadline, None)
                .map_err(|e| self.shared.label(e))
        })
    }

    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<()> {
        let len = buf.len();
        let deadline = deadline_after(self.shared.rank, timeout, || {
            format!("recv from {src} (tag {tag}, {len} bytes)")
        })?;
        self.recorded("recv", len, src, || {
            let op = || format!("recv from {src} (tag {tag}, {len} bytes)");
            self.shared.refuse_if_revoked(op)?;
            self.group
                .link()
                .peer(src, &op)?
                .recv(buf, tag.to_wire(), deadline, &op)
                .map(|_| ())
                .map_err(|e| self.shared.label(e))
        })
    }

    /// A collective: see [`dist_core::collectives::barrier`].
    fn barrier_timeout(&self, timeout: Duration) -> Result<()> {
        dist_core::collectives::barrier(self, timeout)
    }
}

/// The instant `timeout` from now, or an error naming the timeout if that is past what an
/// [`Instant`] can hold (e.g. `Duration::MAX`).
fn deadline_after(rank: usize, timeout: Duration, op: impl FnOnce() -> String) -> Result<Instant> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| DistError::InvalidArgument {
            rank,
            op: op(),
            reason: format!("timeout {timeout:?} is too far in the future to be a deadline"),
        })
}

impl Drop for Threads {
    fn drop(&mut self) {
        // Connections ending from here on are no faults; heartbeats go on while we linger.
        self.shared.closing.store(true, Ordering::Release);
        // No connection is attached from here on (one a handshake worker still delivers is
        // closed), and none is made (a dial in progress holds the mesh until
        // it ends; the peers' hooks hold it only weakly).
        self.incoming.close();
        drop(self.mesh.take());
        let at = self.shared.whereabouts();
        for p in &self.shared.peers {
            p.goodbye(at);
        }
        // Close our sending side, then wait (up to the linger time) for each peer to close
        // theirs, so that nothing they sent us is cut off by a reset, and nothing we sent them is
        // lost. Then close everything.
        for p in &self.shared.peers {
            p.shutdown(Shutdown::Write);
        }
        // `validate` bounds the linger; were it still too far out, wait as long as one can.
        let linger = self
            .linger_cap
            .map_or(self.shared.linger, |c| c.min(self.shared.linger));
        let now = Instant::now();
        let deadline = now
            .checked_add(linger)
            .unwrap_or(now + dist_core::MAX_TIMEOUT);
        for p in &self.shared.peers {
            if !p.wait_closed(deadline) {
                tracing::debug!(
                    rank = self.shared.rank,
                    peer = p.rank,
                    "peer did not close in time"
                );
            }
        }
        if let Some(l) = self.liveness.take() {
            self.shared.post_event(liveness::Event::Stop);
            let _ = l.join();
        }
        for p in &self.shared.peers {
            p.shutdown(Shutdown::Both);
        }
        self.io.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_come_from_the_builder_and_the_environment() {
        let cfg = TcpConfig::new(0, 1, "127.0.0.1:1");
        assert_eq!(cfg.max_message, DEFAULT_MAX_MESSAGE);
        assert_eq!(cfg.unexpected_limit, DEFAULT_UNEXPECTED_LIMIT);
        assert_eq!(
            cfg.clone().max_message(u64::MAX).max_message,
            isize::MAX as u64
        );
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let cfg = limits_from_env(
            cfg,
            &env(&[
                ("DIST_MAX_MESSAGE", "1048576"),
                ("DIST_UNEXPECTED_LIMIT", "4096"),
            ]),
        )
        .unwrap();
        assert_eq!((cfg.max_message, cfg.unexpected_limit), (1 << 20, 4096));
        for bad in ["0", "-1", "1e9", "99999999999999999999"] {
            let pairs: &'static [(&str, &str)] = Box::leak(Box::new([("DIST_MAX_MESSAGE", bad)]));
            match limits_from_env(cfg.clone(), &env(pairs)) {
                Err(DistError::Config { what, .. }) => assert_eq!(what, "DIST_MAX_MESSAGE"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}

//! Configuration of a [`TcpBackend`](crate::TcpBackend): the builder and the environment.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use dist_core::{DistError, Result};

use crate::wire::MIN_SECRET_LEN;

/// The shortest operation, init or handshake timeout: socket timeouts under 1 µs mean "block
/// forever" to the OS, and nothing useful completes in less than a millisecond.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

mod env;
mod host_defaults;
pub(crate) use host_defaults::*;

/// Default deadline of every operation after init.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default time a peer may stay silent before it is reported unresponsive
/// ([`TcpConfig::peer_timeout`]).
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default deadline for the whole job to form.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// Default time a connection gets to complete its handshake before it is dropped.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How the job forms ([`TcpConfig::formation`]; `DIST_FORMATION=auto|eager|lazy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Formation {
    /// Eager up to [`LAZY_FROM`] − 1 ranks, lazy from [`LAZY_FROM`] ranks on.
    #[default]
    Auto,
    /// Every rank connects to every other at init, which returns once all are connected.
    Eager,
    /// No connection but each rank's to rank 0 and to its neighbours in the tree the table of
    /// listeners goes down is made at init: init returns once every rank has the table and
    /// its own listener is up, and each rank then connects to a
    /// peer on first use, of a send or of a posted receive (its acceptor takes the peers'
    /// connections for the life of the backend). A rank hears directly only of the failures of
    /// the peers it is connected to (every one it has waited on) and of rank 0.
    Lazy,
}

/// From how many ranks [`Formation::Auto`] forms lazily: below it a full mesh costs little
/// (64 ranks on 2 cores form eagerly in about a second) and every rank hears of every failure
/// directly.
pub const LAZY_FROM: usize = 65;

/// The prefix of a job's keys in its store unless told otherwise ([`TcpConfig::store_prefix`]).
pub const DEFAULT_STORE_PREFIX: &str = "dist";

/// Everything a [`TcpBackend`](crate::TcpBackend) needs to form a job.
#[derive(Clone)]
pub struct TcpConfig {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) master: String,
    pub(crate) bind: Option<std::net::IpAddr>,
    pub(crate) timeout: Duration,
    pub(crate) peer_timeout: Duration,
    pub(crate) trace_dir: Option<std::path::PathBuf>,
    pub(crate) init_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) linger: Duration,
    pub(crate) secret: Option<Vec<u8>>,
    pub(crate) local_rank: Option<usize>,
    pub(crate) parallel: Option<bool>,
    pub(crate) ring_piece_kb: Option<u32>,
    pub(crate) lanes: Option<u32>,
    pub(crate) arena_max_kb: Option<u32>,
    pub(crate) direct: Option<bool>,
    pub(crate) direct_min_kb: Option<u32>,
    pub(crate) arena_threads: Option<u32>,
    pub(crate) max_message: u64,
    pub(crate) unexpected_limit: usize,
    pub(crate) formation: Formation,
    pub(crate) shm: bool,
    pub(crate) host_id: Option<String>,
    pub(crate) serve_store: bool,
    pub(crate) store_prefix: String,
    pub(crate) elastic: bool,
    pub(crate) admission: crate::Admission,
    pub(crate) seal: bool,
}

impl std::fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConfig")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("master", &self.master)
            .field("bind", &self.bind)
            .field("timeout", &self.timeout)
            .field("peer_timeout", &self.peer_timeout)
            .field("init_timeout", &self.init_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("linger", &self.linger)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("local_rank", &self.local_rank)
            .field("parallel", &self.parallel)
            .field("ring_piece_kb", &self.ring_piece_kb)
            .field("lanes", &self.lanes)
            .field("arena_max_kb", &self.arena_max_kb)
            .field("direct", &self.direct)
            .field("direct_min_kb", &self.direct_min_kb)
            .field("arena_threads", &self.arena_threads)
            .field("max_message", &self.max_message)
            .field("unexpected_limit", &self.unexpected_limit)
            .field("formation", &self.formation)
            .field("shm", &self.shm)
            .field("host_id", &self.host_id)
            .field("serve_store", &self.serve_store)
            .field("store_prefix", &self.store_prefix)
            .field("elastic", &self.elastic)
            .field("admission", &self.admission)
            .field("seal", &self.seal)
            .finish()
    }
}

impl TcpConfig {
    /// A configuration with the defaults: `master` is rank 0's `host:port`.
    pub fn new(rank: usize, world_size: usize, master: impl Into<String>) -> TcpConfig {
        TcpConfig {
            rank,
            world_size,
            master: master.into(),
            bind: None,
            timeout: DEFAULT_TIMEOUT,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            trace_dir: None,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            linger: Duration::from_secs(30),
            secret: None,
            local_rank: None,
            parallel: None,
            ring_piece_kb: None,
            lanes: None,
            arena_max_kb: None,
            direct: None,
            direct_min_kb: None,
            arena_threads: None,
            max_message: crate::DEFAULT_MAX_MESSAGE,
            unexpected_limit: crate::DEFAULT_UNEXPECTED_LIMIT,
            formation: Formation::Auto,
            shm: true,
            host_id: None,
            serve_store: true,
            store_prefix: DEFAULT_STORE_PREFIX.into(),
            elastic: false,
            admission: crate::Admission::AtAdmit,
            seal: false,
        }
    }

    /// Whether rank 0 serves the job's store on the master address (the default), or every rank
    /// uses a store already served there: torchrun's agent's
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`), or one started by hand with `cargo xtask store`
    /// (`DIST_SERVE_STORE=0`). The job forms through the store's keys.
    pub fn serve_store(mut self, on: bool) -> Self {
        self.serve_store = on;
        self
    }

    /// The prefix of the job's keys in its store (default `dist`; under torchrun
    /// `dist/<run id>/attempt_<restart count>`; `DIST_STORE_PREFIX`). Jobs that share one
    /// store need different prefixes. Under it, each formation's keys lie under a count: 0
    /// where rank 0 serves a fresh store; where the store is served by others, the number of
    /// backends this rank formed before through it in this process, so that successive
    /// backends of one process never read each other's keys.
    pub fn store_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.store_prefix = prefix.into();
        self
    }

    /// The deadline of every operation that takes none (default 300 s; `DIST_TIMEOUT`).
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// How long a peer may stay silent (nothing at all received from it, heartbeats included)
    /// before every wait on it fails with [`DistError::PeerUnresponsive`] (default 10 s;
    /// `DIST_PEER_TIMEOUT`). Each rank's transport sends a heartbeat to every peer five times per
    /// peer timeout from a thread of its own (skipped where other bytes went to the peer since
    /// the last), so a peer that computes for a long time
    /// is never reported; one that is stopped, partitioned away or whose host is down is, in
    /// about this long. Keep it well below [`TcpConfig::timeout`].
    pub fn peer_timeout(mut self, t: Duration) -> Self {
        self.peer_timeout = t;
        self
    }

    /// A folder where this rank writes its flight record (its last operations, as JSON, file
    /// `rank-R.json`) when one of its collectives fails; `DIST_TRACE_DIR`. `cargo xtask trace
    /// DIR` prints a summary of the ranks' files: who was where, who is behind.
    pub fn trace_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.trace_dir = Some(dir.into());
        self
    }

    /// Whether a failure revokes the backend's group (default off; `DIST_ELASTIC=1`): from
    /// the first failure this rank sees or hears of (a peer gone or silent, an abort notice),
    /// every pending and later operation of the backend, point-to-point ones on user tags
    /// included, fails at once with [`DistError::Revoked`]
    /// naming the epoch and the rank at fault, and the survivors go on with
    /// [`TcpBackend::recover`](crate::TcpBackend::recover). Off, a failed group's collectives
    /// fail as they always did (`PeerGone`, `Aborted`) and point-to-point messages between the
    /// live ranks still work; [`TcpBackend::recover`](crate::TcpBackend::recover) revokes
    /// either way.
    pub fn elastic(mut self, on: bool) -> Self {
        self.elastic = on;
        self
    }

    /// When the members take in processes waiting to join ([`TcpBackend::join`](crate::TcpBackend::join)):
    /// see [`Admission`](crate::Admission) (default [`Admission::AtAdmit`](crate::Admission::AtAdmit);
    /// `DIST_ADMIT`: `admit`, `recovery` or `at-least:N`). Every member must have the same.
    pub fn admission(mut self, policy: crate::Admission) -> Self {
        self.admission = policy;
        self
    }

    /// Whether every TCP connection between ranks is sealed (default off; `DIST_SEAL=1`; needs
    /// a [`TcpConfig::secret`], and every rank must agree): each frame after the handshake is
    /// encrypted and authenticated with AES-256-GCM under keys of that connection and direction
    /// that the handshake derives from both sides' nonces and the secret, numbered so that a
    /// frame forged, replayed, reordered or cut short on the wire ends the connection with an
    /// error naming the peer, and nothing of it is delivered. Frames through shared memory
    /// inside a host ([`TcpConfig::shared_memory`]) are not sealed, nor is the store's traffic.
    pub fn seal(mut self, on: bool) -> Self {
        self.seal = on;
        self
    }

    /// Whether ranks of one host exchange frames through shared memory (default on;
    /// `DIST_SHM=0` turns it off): a ring per ordered pair of ranks in a sealed `memfd`, with
    /// the TCP connection kept for liveness. Both ranks of a pair must want it, and be on one
    /// host: the same boot id and network namespace, and the same [`TcpConfig::host_id`]. A
    /// lazily formed job ([`Formation::Lazy`]) stays on TCP.
    pub fn shared_memory(mut self, on: bool) -> Self {
        self.shm = on;
        self
    }

    /// A name for this rank's host that ranks compare, besides the boot id and network
    /// namespace, before sharing memory (`DIST_HOST_ID`; tests simulate several hosts on one
    /// machine with it). Default none.
    pub fn host_id(mut self, id: impl Into<String>) -> Self {
        self.host_id = Some(id.into());
        self
    }

    /// This rank's host identity for shared memory, or `None` when it is off, the job forms
    /// lazily (its connections to rank 0 would give rank 0 a ring pair per rank of a large
    /// job; every connection of such a job stays on TCP), or the identity cannot be read.
    pub(crate) fn shm_host(&self) -> Option<[u8; 32]> {
        if !self.shm || matches!(self.formation_mode(), Formation::Lazy) {
            return None;
        }
        crate::shm::host_identity(self.host_id.as_deref())
    }

    /// How the job forms (default [`Formation::Auto`]; `DIST_FORMATION`).
    pub fn formation(mut self, f: Formation) -> Self {
        self.formation = f;
        self
    }

    /// How this job will form: [`Formation::Eager`] or [`Formation::Lazy`] ([`Formation::Auto`]
    /// decided by the world size).
    pub fn formation_mode(&self) -> Formation {
        match self.formation {
            Formation::Auto if self.world_size >= LAZY_FROM => Formation::Lazy,
            Formation::Auto => Formation::Eager,
            f => f,
        }
    }

    /// The deadline for the job to form (default 120 s; `DIST_INIT_TIMEOUT`).
    pub fn init_timeout(mut self, t: Duration) -> Self {
        self.init_timeout = t;
        self
    }

    /// How long a new connection may take to complete its handshake (default 5 s).
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// How long dropping the backend waits for peers to close their side, so that the last
    /// messages sent are not lost (default 30 s).
    pub fn linger(mut self, t: Duration) -> Self {
        self.linger = t;
        self
    }

    /// The local address this rank listens on for its peers (default: the address it uses to
    /// reach rank 0; rank 0 listens on `master`).
    pub fn bind(mut self, ip: std::net::IpAddr) -> Self {
        self.bind = Some(ip);
        self
    }

    /// A shared secret every rank must prove it knows (HMAC-SHA256 challenge-response; the
    /// secret never crosses the wire), at least 16 bytes: init refuses a shorter one.
    /// `DIST_SECRET` sets it from the environment.
    ///
    /// The secret alone only admits ranks: unless [`TcpConfig::seal`] is on, the frames after
    /// the handshake are neither encrypted nor authenticated, so someone who can read or change
    /// the traffic between ranks can read or change the data. Seal the connections, or run on a
    /// trusted network, or over WireGuard or IPsec.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Whether a large send and its receive run on two threads at once (default: where the
    /// machine has at least 8 cores; `DIST_TCP_PARALLEL`). This rank's own choice.
    pub fn parallel(mut self, on: bool) -> Self {
        self.parallel = Some(on);
        self
    }

    /// The largest message of a ring step, in KiB, 1 to 65536 (default 64 on a host with more
    /// than 16 of the job's ranks per core, else 1024 where sends and receives run in parallel,
    /// else 256; `DIST_RING_PIECE_KB`). Rank 0's value is the job's.
    pub fn ring_piece_kb(mut self, kb: u32) -> Self {
        self.ring_piece_kb = Some(kb);
        self
    }

    /// How many rings a large all_reduce runs at once, 1 or 2 (default 2 where sends and
    /// receives run in parallel, else 1; `DIST_TCP_LANES`). Rank 0's value is the job's.
    pub fn lanes(mut self, lanes: u32) -> Self {
        self.lanes = Some(lanes);
        self
    }

    /// The largest all_reduce, in KiB, that runs on the host arena (shared memory read in
    /// place by the ranks of one host), 0 (never) to 1 GiB; larger ones run the message
    /// algorithms (default: every size up to 1 GiB for a job all on this host of 8 ranks or
    /// more with a core each, or of ranks with two cores or more each, else 1024, also where
    /// ranks outnumber the host's cores;
    /// `DIST_ARENA_MAX_KB`). Rank 0's value is the job's.
    pub fn arena_max_kb(mut self, kb: u32) -> Self {
        self.arena_max_kb = Some(kb);
        self
    }

    /// Whether this rank proposes that the ranks of its host read each other's buffers
    /// directly in a large all_reduce on the host arena (`process_vm_readv`, Linux;
    /// `DIST_DIRECT`): one copy out of each peer's buffer for the reduction instead of a copy
    /// into the arena first (the results then pass through the arena's slots). Default: where
    /// the read copies at least half as fast as a copy within the process (timed once at init)
    /// and the host's ranks are at most 16 to each core this rank may run on: where they
    /// outnumber those cores above the arena's limit, else (a core a rank or more) from
    /// 16 MiB, a rank with two cores or more splitting its part over them
    /// ([`TcpConfig::arena_threads`]): measured faster there than the arena's copies and the
    /// shared-memory rings, and slower where the read is slower or below those sizes
    /// (`docs/results/README.md`, "2026-12-01, evening (0436ad0)" to "2026-12-02, afternoon
    /// (4249335)"). Used only if every rank of the group proposes it and can (probed: a strict
    /// ptrace policy such as Yama's `ptrace_scope` 1 or more, or a seccomp filter, refuses it, and
    /// then the arena's copies run as before).
    pub fn direct(mut self, on: bool) -> Self {
        self.direct = Some(on);
        self
    }

    /// The smallest all_reduce, in KiB, whose ranks read each other's buffers directly
    /// ([`TcpConfig::direct`]; default: where the host's ranks outnumber its cores, every size
    /// above the arena's limit there, 1 MiB or [`TcpConfig::arena_max_kb`] where set (not 0);
    /// where each has a core or more, 16 MiB; with
    /// direct reads asked for, [`dist_core::collectives::HOST_DIRECT_MIN`]; never
    /// below the arena's split size, [`dist_core::collectives::HOST_SPLIT_MIN`];
    /// `DIST_DIRECT_MIN_KB`). The group takes the largest any rank proposes. A direct
    /// all_reduce may be larger than [`TcpConfig::arena_max_kb`] where all the group's ranks
    /// are on one host (unless that limit is 0).
    pub fn direct_min_kb(mut self, kb: u32) -> Self {
        self.direct_min_kb = Some(kb);
        self
    }

    /// How many threads (its own among them) this rank splits its part of an all_reduce on
    /// the host arena over (`DIST_ARENA_THREADS`, 1 to 64): on the arena's slots, in pieces of
    /// at least 512 KiB, each copies a range of at least 64 KiB of its input in, reduces a
    /// range of its share and copies a range of the peers' shares out; reading directly
    /// ([`TcpConfig::direct`]) each reads and reduces a range of at least 256 KiB. Default: the cores this rank may run on (its
    /// affinity mask and cgroup) over its host's ranks, from 1 to 8. The rank's own choice:
    /// the results are the same whatever the count. Calls run as async work
    /// ([`dist_core::Collectives::scope`]) do not split.
    pub fn arena_threads(mut self, threads: u32) -> Self {
        self.arena_threads = Some(threads.clamp(1, ARENA_THREADS_LIMIT));
        self
    }

    /// The largest message a peer may send this rank, in bytes (default 16 GiB;
    /// `DIST_MAX_MESSAGE`); a longer frame is a protocol error that closes the connection.
    /// At most `isize::MAX` (what one buffer can hold).
    pub fn max_message(mut self, bytes: u64) -> Self {
        self.max_message = bytes.min(isize::MAX as u64);
        self
    }

    /// Bytes of messages that arrive before their receive is posted kept per peer (default
    /// 64 MiB; `DIST_UNEXPECTED_LIMIT`); past it the peer is not read until receives are posted.
    pub fn unexpected_limit(mut self, bytes: usize) -> Self {
        self.unexpected_limit = bytes;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's size.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The rank on this host, when the launcher gave one.
    pub fn local_rank(&self) -> Option<usize> {
        self.local_rank
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.world_size > u32::MAX as usize {
            return Err(DistError::Config {
                what: "world size".into(),
                reason: format!("{} is not in 1..=2^32-1", self.world_size),
            });
        }
        if self.rank >= self.world_size {
            return Err(DistError::InvalidRank {
                rank: self.rank,
                op: "init".into(),
                given: self.rank,
                world_size: self.world_size,
            });
        }
        if let Some(s) = &self.secret
            && s.len() < MIN_SECRET_LEN
        {
            return Err(DistError::Config {
                what: "shared secret (DIST_SECRET)".into(),
                reason: format!(
                    "is {} bytes; it must be at least {MIN_SECRET_LEN} bytes, random, and the \
                     same on every rank (e.g. `openssl rand -hex 16`)",
                    s.len()
                ),
            });
        }
        if self.seal && self.secret.is_none() {
            return Err(DistError::Config {
                what: "sealed connections (DIST_SEAL)".into(),
                reason: "need a shared secret (DIST_SECRET): the keys are derived from it".into(),
            });
        }
        for (what, t) in [
            ("timeout (DIST_TIMEOUT)", self.timeout),
            ("peer timeout (DIST_PEER_TIMEOUT)", self.peer_timeout),
            ("init timeout (DIST_INIT_TIMEOUT)", self.init_timeout),
            ("handshake timeout", self.handshake_timeout),
            ("linger", self.linger),
        ] {
            // Under 1 ms a socket timeout rounds to 0, which the OS reads as "never time out".
            if t < MIN_TIMEOUT && what != "linger" {
                return Err(DistError::Config {
                    what: what.into(),
                    reason: format!("{t:?} is shorter than the shortest allowed, 1 ms"),
                });
            }
            if let Some(reason) = dist_core::transport::timeout_problem(t) {
                return Err(DistError::Config {
                    what: what.into(),
                    reason,
                });
            }
        }
        Ok(())
    }

    pub(crate) fn master_addr(&self) -> Result<SocketAddr> {
        self.master
            .to_socket_addrs()
            .map_err(|e| DistError::Config {
                what: "master address".into(),
                reason: format!("cannot resolve {:?}: {e}", self.master),
            })?
            .next()
            .ok_or_else(|| DistError::Config {
                what: "master address".into(),
                reason: format!("{:?} resolves to no address", self.master),
            })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
pub(crate) mod tests;

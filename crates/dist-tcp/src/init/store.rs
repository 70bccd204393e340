//! The job's store and the keys formation exchanges through it.
//!
//! Rank 0 serves a [`StoreServer`] on the master address, unless the store is served already
//! (torchrun's agent, `cargo xtask store`); every rank connects to it, retrying until the init
//! deadline. The keys of one formation lie under `<prefix>/<count>`: the job's prefix
//! ([`TcpConfig::store_prefix`]) and, where the store outlives the backend (served by others),
//! the number of formations this rank made before under it in this process, so that
//! successive backends of one process never read each other's keys (0 where rank 0 serves a
//! fresh store for each formation).
//!
//! | key | set by | value |
//! | --- | --- | --- |
//! | `init/addr/<r>` | rank `r` (`compare_set`: a second claim of `r` sees the first) | its world size and listener, `<n> <ip:port>`, or `failed: <why>` |
//! | `init/table` | rank 0, once every `addr` key is there | the table of listeners (`wire::encode_table`), or `failed <r>: <why>` |
//! | `init/ready/<r>` | rank `r`, its connections up | `1` |
//! | `init/ready` | every rank (`add`) | how many are ready |
//! | `init/go` | the last rank ready, or the first to fail (`compare_set`, first wins) | `go`, or `failed <r>: <why>` |
//! | `user/…` | user code ([`TcpBackend::store`](crate::TcpBackend::store)) | |

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};
use dist_store::{PrefixStore, Store, StoreError, StoreServer, TcpStore};

use crate::config::TcpConfig;

/// Formations made so far in this process through a store served by others, per (store
/// address, prefix, rank): the count under the prefix that the next one uses. Every rank of a job forms the same sequence of
/// backends, so the counts agree; ranks that are threads of one process (tests) count apart.
static FORMATIONS: Mutex<BTreeMap<(String, String, usize), u64>> = Mutex::new(BTreeMap::new());

/// How long a store whose rank failed formation stays up for the others to read why.
pub(crate) const LINGER: Duration = Duration::from_secs(2);

/// The job's store: the connection, the server when this rank serves it, and the prefix of
/// this formation's keys.
pub(crate) struct JobStore {
    pub(crate) client: TcpStore,
    server: Option<StoreServer>,
    /// `<prefix>/<count>`: every key of this formation lies under it.
    pub(crate) prefix: String,
    me: usize,
}

impl std::fmt::Debug for JobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobStore")
            .field("server", &self.client.server())
            .field("serving", &self.server.is_some())
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// The job's store once formed: what [`TcpBackend::store`](crate::TcpBackend::store) hands out.
#[derive(Debug)]
pub(crate) struct Kept {
    pub(crate) client: Arc<TcpStore>,
    pub(crate) prefix: String,
    /// Held for as long as the backend: the store lives with rank 0's backend.
    _server: Option<StoreServer>,
}

impl Kept {
    /// The connection, the prefix user keys lie under, and the server (the rank that serves
    /// it hands it on to the backend of its next epoch).
    pub(crate) fn into_parts(self) -> (Arc<TcpStore>, String, Option<StoreServer>) {
        (self.client, self.prefix, self._server)
    }

    /// The same store, its user keys under `prefix` and holding `server` (a later epoch's
    /// backend keeps the first epoch's prefix and server).
    pub(crate) fn reparented(mut self, prefix: String, server: Option<StoreServer>) -> Kept {
        self.prefix = prefix;
        if server.is_some() {
            self._server = server;
        }
        self
    }

    /// The job's store under `<job prefix>/<part>`.
    pub(crate) fn under(&self, part: &str) -> PrefixStore<Arc<TcpStore>> {
        PrefixStore::new(format!("{}/{part}", self.prefix), self.client.clone())
    }
}

/// The key of rank `r`'s listener.
pub(crate) fn addr_key(r: usize) -> String {
    format!("init/addr/{r}")
}

/// The key that says rank `r` is ready.
pub(crate) fn ready_key(r: usize) -> String {
    format!("init/ready/{r}")
}

/// The time left to `deadline`, at least a millisecond.
pub(crate) fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

impl JobStore {
    /// Serves the store (rank 0, unless it is served already) and connects to it by
    /// `deadline`. A world of one with nobody else to meet serves its store on a free
    /// loopback port rather than the master address.
    pub(crate) fn open(cfg: &TcpConfig, started: Instant, deadline: Instant) -> Result<JobStore> {
        let (me, world) = (cfg.rank, cfg.world_size);
        let serve_at = |addr: SocketAddr| {
            StoreServer::bind(addr).map_err(|e| DistError::Io {
                rank: me,
                context: format!(
                    "serve the job's store on {addr} (another store or job on that port? to \
                     use a store served already, set DIST_SERVE_STORE=0)"
                ),
                source: std::io::Error::other(e),
            })
        };
        let (server, target) = if cfg.serve_store && world == 1 {
            let s = serve_at(SocketAddr::from(([127, 0, 0, 1], 0)))?;
            let a = s.local_addr();
            (Some(s), a)
        } else {
            let master = cfg.master_addr()?;
            if cfg.serve_store && me == 0 {
                let at = SocketAddr::new(cfg.bind.unwrap_or(master.ip()), master.port());
                let s = serve_at(at)?;
                let mut a = s.local_addr();
                if a.ip().is_unspecified() {
                    a.set_ip(master.ip());
                }
                (Some(s), a)
            } else {
                (None, master)
            }
        };
        // A store served by others is dialed by name: every address the master's name
        // resolves to is tried (torchrun says `localhost`, which may resolve to ::1 first while
        // its agent listens on IPv4 alone).
        let dialed = match &server {
            Some(_) => TcpStore::connect(target, left(deadline)),
            None => TcpStore::connect(cfg.master.as_str(), left(deadline)),
        };
        let client = dialed.map_err(|e| {
            let detail = format!("no store at {target}: {}", full(&e));
            if cfg.serve_store {
                // Rank 0 serves it: rank 0 is who is missing.
                DistError::RendezvousFailed {
                    rank: me,
                    joined: 0,
                    world_size: world,
                    missing: vec![0],
                    waited: started.elapsed(),
                    detail,
                }
            } else {
                DistError::RendezvousFailed {
                    rank: me,
                    joined: 0,
                    world_size: world,
                    missing: Vec::new(),
                    waited: started.elapsed(),
                    detail,
                }
            }
        })?;
        // A store served by rank 0 is fresh for each formation; one served by others
        // (torchrun's agent) outlives a backend, and a second backend of the process must not
        // read the first one's keys.
        let count = if server.is_some() || cfg.serve_store {
            0
        } else {
            let mut f = FORMATIONS.lock().unwrap_or_else(|p| p.into_inner());
            let c = f
                .entry((target.to_string(), cfg.store_prefix.clone(), me))
                .or_insert(0);
            *c += 1;
            *c - 1
        };
        Ok(JobStore {
            client,
            server,
            prefix: format!("{}/{count}", cfg.store_prefix),
            me,
        })
    }

    /// A new connection to the store at `server` (served already, by this process or
    /// another), for a formation whose keys lie under `prefix`: a later epoch's
    /// ([`TcpBackend::recover`](crate::TcpBackend::recover)).
    pub(crate) fn reconnect(
        server: &str,
        prefix: String,
        me: usize,
        deadline: Instant,
    ) -> Result<JobStore> {
        let client = TcpStore::connect(server, left(deadline)).map_err(|e| DistError::Io {
            rank: me,
            context: format!("reconnect to the job's store at {server}"),
            source: std::io::Error::other(full(&e)),
        })?;
        Ok(JobStore {
            client,
            server: None,
            prefix,
            me,
        })
    }

    /// The rank this store was opened for.
    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    /// This rank's formation failed: a store it serves stays up for [`LINGER`] more on a
    /// thread of its own (the error returns at once), so that the other ranks read the failure
    /// it published rather than a closed connection. A process that exits ends it sooner.
    pub(crate) fn linger(self) {
        if self.server.is_some() {
            let _ = std::thread::Builder::new()
                .name(format!("dist-store-linger-{}", self.me))
                .spawn(move || {
                    std::thread::sleep(LINGER);
                    drop(self);
                });
        }
    }

    /// The store under this formation's prefix.
    pub(crate) fn keys(&self) -> PrefixStore<&TcpStore> {
        PrefixStore::new(self.prefix.clone(), &self.client)
    }

    /// What the backend keeps: the connection (its plain operations bounded by `timeout` from
    /// now on) and the server.
    pub(crate) fn keep(self, timeout: Duration) -> Kept {
        Kept {
            client: Arc::new(self.client.with_timeout(timeout)),
            prefix: self.prefix,
            _server: self.server,
        }
    }

    /// A store operation's failure as this rank's error.
    pub(crate) fn err(&self, e: StoreError) -> DistError {
        DistError::Io {
            rank: self.me,
            context: "form the job through its store".into(),
            source: std::io::Error::other(full(&e)),
        }
    }

    /// The ranks among `ranks` whose key (`key(r)`) is absent, checked one at a time. Should
    /// the store fail a check, the ranks from there on count as absent: no more checks, each
    /// of which could take the client's whole timeout.
    pub(crate) fn absent(
        &self,
        ranks: std::ops::Range<usize>,
        key: impl Fn(usize) -> String,
    ) -> Vec<usize> {
        let keys = self.keys();
        let mut failed = false;
        ranks
            .filter(|&r| {
                if !failed {
                    match keys.check(&[&key(r)]) {
                        Ok(there) => return !there,
                        Err(_) => failed = true,
                    }
                }
                true
            })
            .collect()
    }

    /// Waits by `deadline` for the keys of `ranks` (`key(r)`), or fails naming those absent.
    pub(crate) fn wait_for(
        &self,
        ranks: std::ops::Range<usize>,
        key: impl Fn(usize) -> String + Copy,
        world: usize,
        started: Instant,
        deadline: Instant,
        what: &str,
    ) -> Result<()> {
        let names: Vec<String> = ranks.map(key).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        match self.keys().wait(&refs, left(deadline)) {
            Ok(()) => Ok(()),
            Err(StoreError::Timeout { .. }) => Err(self.missing(key, world, started, what)),
            Err(e) => Err(self.err(e)),
        }
    }

    /// The rendezvous timed out: the error names the ranks whose key (`key(r)`: their
    /// listener's, or their readiness) is absent.
    pub(crate) fn missing(
        &self,
        key: impl Fn(usize) -> String,
        world: usize,
        started: Instant,
        what: &str,
    ) -> DistError {
        let missing = self.absent(0..world, key);
        DistError::RendezvousFailed {
            rank: self.me,
            joined: world - missing.len(),
            world_size: world,
            missing,
            waited: started.elapsed(),
            detail: format!(
                "{what} (keys under {}/ in the store at {})",
                self.prefix,
                self.client.server()
            ),
        }
    }
}

/// A store error and the chain of its causes, in one line.
pub(crate) fn full(e: &StoreError) -> String {
    let mut text = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

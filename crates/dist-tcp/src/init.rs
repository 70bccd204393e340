//! Forming the job: the rendezvous through the job's store, the handshake, and the full mesh
//! (eager) or the means to connect later (lazy).
//!
//! Every rank connects to the job's store (`store.rs`: served by rank 0 on the master address,
//! or by torchrun's agent), binds a listener of its own and publishes its address under the
//! job's prefix. Rank 0 waits for every rank's key (ranks may start in any order; on the
//! deadline the store tells which keys are absent) and publishes the table of listeners with a
//! fresh job id. Eager ([`Formation::Eager`](crate::Formation::Eager)): rank `j` then connects
//! to every rank `i < j`, whose listener accepts only that job's ranks above it (the handshake
//! and the secret's proofs on each connection, `handshake.rs`). Lazy
//! ([`Formation::Lazy`](crate::Formation::Lazy)): each rank starts its long-lived acceptor
//! ([`Mesh`]) and connects to a peer on first use. A rank ready says so in the store; the last
//! one sets `go`, the first to fail sets why, and every rank returns on what it finds there:
//! init returns on all ranks together, or fails on all of them with the first rank's error.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::Instant;

use crossbeam_channel::RecvTimeoutError;
use dist_core::{DistError, Result};
use dist_store::Store;

use crate::config::TcpConfig;
use crate::wire::{self, Hello, PROTOCOL_VERSION, Purpose};

mod acceptor;
mod handshake;
mod links;
mod mesh;
mod store;

use acceptor::Acceptor;
use handshake::*;
pub use links::OnIncoming;
use mesh::MeshSpec;
pub use mesh::{Dialed, Mesh};
pub(crate) use store::{JobStore, Kept, full as store_error_text};
use store::{addr_key, ready_key};

/// Forms the job eagerly (whatever `cfg` says) and returns one handshaken stream per peer
/// (`None` at this rank's index) and the job's store.
pub(crate) fn form(cfg: &TcpConfig) -> Result<(Vec<Option<TcpStream>>, Kept)> {
    form_with(cfg, None, None).map(|f| (f.streams, f.store))
}

/// [`form`] or [`form_lazy`] (with `lazy`) through `store` rather than a store this opens:
/// a later epoch's formation ([`TcpBackend::recover`](crate::TcpBackend::recover)).
pub(crate) fn form_in(
    cfg: &TcpConfig,
    store: JobStore,
    lazy: Option<OnIncoming>,
) -> Result<(Vec<Option<TcpStream>>, Option<Mesh>, Kept)> {
    form_with(cfg, lazy, Some(store)).map(|f| (f.streams, f.mesh, f.store))
}

/// A job formed lazily: no connection yet, the means to make them, and the job's store.
#[derive(Debug)]
pub struct Formed {
    /// The stream to each peer connected at formation (`None` everywhere: a lazy formation
    /// connects no pair of ranks).
    pub streams: Vec<Option<TcpStream>>,
    /// This rank's acceptor and dialer.
    pub mesh: Mesh,
    /// The job's store.
    pub(crate) store: Kept,
}

/// Forms the job lazily ([`Formation::Lazy`](crate::Formation::Lazy), whatever `cfg` says): `on_incoming` gets every
/// connection a peer makes to this rank that no dialer of this rank waits for, from before
/// this returns.
pub(crate) fn form_lazy(cfg: &TcpConfig, on_incoming: OnIncoming) -> Result<Formed> {
    let f = form_with(cfg, Some(on_incoming), None)?;
    Ok(Formed {
        streams: f.streams,
        mesh: f.mesh.expect("a lazy formation makes a mesh"),
        store: f.store,
    })
}

struct Made {
    streams: Vec<Option<TcpStream>>,
    mesh: Option<Mesh>,
    store: Kept,
}

/// Forms the job: eagerly without `lazy`, lazily with the callback; through `store` where
/// given, else through the store `cfg` names.
fn form_with(cfg: &TcpConfig, lazy: Option<OnIncoming>, store: Option<JobStore>) -> Result<Made> {
    cfg.validate()?;
    let started = Instant::now();
    let (me, world) = (cfg.rank, cfg.world_size);
    let deadline =
        dist_core::transport::deadline_after(started, cfg.init_timeout, me, || "init".into())?;
    let store = match store {
        Some(s) => s,
        None => JobStore::open(cfg, started, deadline)?,
    };
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    if world == 1 {
        let mesh = match lazy {
            None => None,
            Some(cb) => {
                let any = SocketAddr::from(([127, 0, 0, 1], 0));
                Some(Mesh::start(spec(cfg, 0, vec![any]), None, |_| true, cb)?)
            }
        };
        return Ok(Made {
            streams,
            mesh,
            store: store.keep(cfg.timeout),
        });
    }
    let mut claimed = false;
    let formed = form_through(
        cfg,
        &store,
        started,
        deadline,
        &mut streams,
        lazy,
        &mut claimed,
    );
    let mesh = match formed {
        Ok(mesh) => mesh,
        Err(e) => {
            // Tell every rank, so that each fails now rather than at the deadline (the first
            // failure set wins; one already there stays). Only a rank that has claimed its
            // rank speaks for the job: a second process claiming a rank, or one of another
            // world size, is refused without failing the job.
            if claimed {
                let _ = store.keys().compare_set(
                    "init/go",
                    b"",
                    format!("failed {me}: {e}").as_bytes(),
                );
            }
            store.linger();
            return Err(e);
        }
    };
    tracing::debug!(rank = me, world, elapsed = ?started.elapsed(), "job formed");
    Ok(Made {
        streams,
        mesh,
        store: store.keep(cfg.timeout),
    })
}

/// What a rank needs to build its [`Mesh`], from the job id and the table of listeners.
fn spec(cfg: &TcpConfig, job_id: u64, addrs: Vec<SocketAddr>) -> MeshSpec {
    MeshSpec {
        me: cfg.rank,
        world: cfg.world_size,
        job_id,
        secret: cfg.secret.clone(),
        seal: cfg.seal,
        handshake_timeout: cfg.handshake_timeout,
        addrs,
    }
}

fn bind_listener(addr: SocketAddr, me: usize) -> Result<TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )
    .map_err(io_err(me, format!("create a socket for {addr}")))?;
    sock.set_reuse_address(true)
        .map_err(io_err(me, "set SO_REUSEADDR"))?;
    sock.bind(&addr.into())
        .map_err(io_err(me, format!("bind {addr}")))?;
    sock.listen(1024)
        .map_err(io_err(me, format!("listen on {addr}")))?;
    Ok(sock.into())
}

/// A failure another rank published in the store (`failed <rank>: <why>`), as this rank's
/// error.
fn published_failure(me: usize, text: &str) -> Option<DistError> {
    let rest = text.strip_prefix("failed ")?;
    let (origin, reason) = rest.split_once(": ").unwrap_or((rest, ""));
    Some(DistError::Aborted {
        rank: me,
        op: "init".into(),
        origin: origin.parse().unwrap_or(0),
        culprit: None,
        reason: reason.into(),
    })
}

/// The rendezvous through the store, then the connections: the eager mesh, or the lazy one's
/// acceptor. Returns the lazy mesh; `claimed` says, on failure too, whether this rank had
/// claimed its rank in the store.
fn form_through(
    cfg: &TcpConfig,
    store: &JobStore,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
    lazy: Option<OnIncoming>,
    claimed: &mut bool,
) -> Result<Option<Mesh>> {
    let (me, world) = (cfg.rank, cfg.world_size);
    let keys = store.keys();
    let server = store.client.server().to_string();
    // Listen on the interface that reaches the store, unless told otherwise.
    let local_ip: IpAddr = match cfg.bind {
        Some(ip) => ip,
        None => store
            .client
            .local_addr()
            .map_err(io_err(me, "local address of the store's connection"))?
            .ip(),
    };
    let key = addr_key(me);
    let listener = match bind_listener(SocketAddr::new(local_ip, 0), me) {
        Ok(l) => l,
        Err(e) => {
            // Rank 0 reads this key with the others' and fails the job naming this rank.
            let _ = keys.compare_set(&key, b"", format!("failed: {e}").as_bytes());
            return Err(e);
        }
    };
    // The world size beside the address: rank 0 checks that every rank's is its own.
    let mine = format!(
        "{world} {}",
        listener
            .local_addr()
            .map_err(io_err(me, "listener address"))?
    );
    // Rank 0 draws the job id now and accepts from the start (as every listener: bounded, the
    // handshake's checks), so that its listener is never a backlog nobody drains; the other
    // ranks accept once the table has told them the job id.
    let (mut listening, mut lazy) = (Some(listener), lazy);
    let mut early = None;
    let job_id0 = if me == 0 {
        let id = u64::from_le_bytes(nonce(0)?[..8].try_into().expect("8 bytes"));
        let l = listening.take().expect("bound above");
        early = Some(match lazy.take() {
            Some(cb) => {
                let unknown = vec![SocketAddr::from(([0, 0, 0, 0], 0)); world];
                Accepting::Lazy(Mesh::start(spec(cfg, id, unknown), Some(l), |_| false, cb)?)
            }
            None => Accepting::Eager(eager_acceptor(cfg, l, id)?),
        });
        id
    } else {
        0
    };
    let got = keys
        .compare_set(&key, b"", mine.as_bytes())
        .map_err(|e| store.err(e))?;
    if got != mine.as_bytes() {
        return Err(DistError::HandshakeRefused {
            rank: me,
            peer: format!("the store at {server}"),
            reason: format!(
                "duplicate rank {me}: key {}/{key} already holds {:?} (another process claims \
                 rank {me}, or an earlier job's keys are under this prefix; DIST_STORE_PREFIX)",
                store.prefix,
                String::from_utf8_lossy(&got)
            ),
        });
    }
    *claimed = true;
    tracing::debug!(rank = me, addr = %mine, "listening; waiting for the table");
    let (job_id, addrs) = if me == 0 {
        (
            job_id0,
            publish_table(store, job_id0, world, started, deadline)?,
        )
    } else {
        read_table(store, world, started, deadline)?
    };
    let accepting = match (early, listening, lazy) {
        (Some(a), _, _) => a,
        (None, Some(l), Some(cb)) => Accepting::Lazy(Mesh::start(
            spec(cfg, job_id, addrs.clone()),
            Some(l),
            |_| false,
            cb,
        )?),
        (None, Some(l), None) => Accepting::Eager(eager_acceptor(cfg, l, job_id)?),
        (None, None, _) => unreachable!("a rank without an early acceptor kept its listener"),
    };
    let mesh = match accepting {
        Accepting::Lazy(mut m) => {
            m.set_addrs(addrs);
            Some(m)
        }
        Accepting::Eager(acceptor) => {
            // A rank that fails meanwhile says so in the store: seen here while this rank
            // waits for the ranks above it, rather than at the deadline.
            let failed = || match keys.check(&["init/go"]) {
                Ok(true) => match keys.get("init/go", store::left(deadline)) {
                    Ok(v) => published_failure(me, &String::from_utf8_lossy(&v)),
                    Err(_) => None,
                },
                _ => None,
            };
            mesh_eagerly(
                cfg, acceptor, &addrs, job_id, started, deadline, streams, &failed,
            )?;
            None
        }
    };
    // Ready: the last rank to say so lets every rank go.
    keys.set(&ready_key(me), b"1").map_err(|e| store.err(e))?;
    let ready = keys.add("init/ready", 1).map_err(|e| store.err(e))?;
    if ready == world as i64 {
        keys.compare_set("init/go", b"", b"go")
            .map_err(|e| store.err(e))?;
    }
    match decide_go(&keys, me, deadline) {
        Ok(Some(v)) if v == b"go" => Ok(mesh),
        Ok(Some(v)) => {
            let text = String::from_utf8_lossy(&v);
            Err(
                published_failure(me, &text).unwrap_or_else(|| DistError::HandshakeRefused {
                    rank: me,
                    peer: format!("the store at {server}"),
                    reason: format!("key {}/init/go holds {text:?}", store.prefix),
                }),
            )
        }
        Ok(None) | Err(dist_store::StoreError::Timeout { .. }) => Err(store.missing(
            ready_key,
            world,
            started,
            "ranks did not say they were ready before the init deadline",
        )),
        Err(e) => Err(store.err(e)),
    }
}

/// The outcome of the formation, one decision in the store: `init/go` as the last rank ready
/// (`go`) or the first to fail set it, waited for until `deadline`. A rank whose deadline
/// passes first sets it to its failure, unless it is set already (`compare_set` from empty),
/// and takes whatever the key then holds: every rank acts on the same value, so no rank
/// fails a formation that the others completed (it would form an epoch of its own after).
/// `None`: this rank's failure is the decision.
pub(crate) fn decide_go(
    keys: &dist_store::PrefixStore<&dist_store::TcpStore>,
    me: usize,
    deadline: Instant,
) -> std::result::Result<Option<Vec<u8>>, dist_store::StoreError> {
    match keys.get("init/go", store::left(deadline)) {
        Err(dist_store::StoreError::Timeout { .. }) => {
            let mine = format!("failed {me}: ranks did not say they were ready in time");
            let v = keys.compare_set("init/go", b"", mine.as_bytes())?;
            Ok((v != mine.as_bytes()).then_some(v))
        }
        other => other.map(Some),
    }
}

/// Rank 0: waits for every rank's listener, then publishes the table with the job id.
fn publish_table(
    store: &JobStore,
    job_id: u64,
    world: usize,
    started: Instant,
    deadline: Instant,
) -> Result<Vec<SocketAddr>> {
    let keys = store.keys();
    store.wait_for(
        0..world,
        addr_key,
        world,
        started,
        deadline,
        "ranks did not publish their listener before the init deadline",
    )?;
    let names: Vec<String> = (0..world).map(addr_key).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let values = keys
        .multi_get(&refs, store::left(deadline))
        .map_err(|e| store.err(e))?;
    let mut addrs = Vec::with_capacity(world);
    for (r, v) in values.iter().enumerate() {
        let text = String::from_utf8_lossy(v);
        let why = match text.strip_prefix("failed: ") {
            Some(why) => why.to_string(),
            None => match text
                .split_once(' ')
                .map(|(w, a)| (w.parse::<usize>(), a.parse::<SocketAddr>()))
            {
                Some((Ok(w), Ok(a))) if w == world => {
                    addrs.push(a);
                    continue;
                }
                Some((Ok(w), Ok(_))) => format!(
                    "rank {r} has a world size of {w}, rank 0 of {world} (key {}/{})",
                    store.prefix,
                    addr_key(r)
                ),
                _ => format!(
                    "key {}/{} holds {text:?}, not a world size and an address",
                    store.prefix,
                    addr_key(r)
                ),
            },
        };
        let _ = keys.set("init/table", format!("failed {r}: {why}").as_bytes());
        return Err(DistError::Aborted {
            rank: 0,
            op: "init".into(),
            origin: r,
            culprit: None,
            reason: why,
        });
    }
    keys.set("init/table", &wire::encode_table(job_id, &addrs))
        .map_err(|e| store.err(e))?;
    Ok(addrs)
}

/// A rank other than 0: waits for the table rank 0 publishes, and checks it.
fn read_table(
    store: &JobStore,
    world: usize,
    started: Instant,
    deadline: Instant,
) -> Result<(u64, Vec<SocketAddr>)> {
    let me = store.rank();
    let table = match store.keys().get("init/table", store::left(deadline)) {
        Ok(t) => t,
        Err(dist_store::StoreError::Timeout { .. }) => {
            return Err(store.missing(
                addr_key,
                world,
                started,
                "no table of listeners from rank 0 before the init deadline",
            ));
        }
        Err(e) => return Err(store.err(e)),
    };
    if let Some(e) = std::str::from_utf8(&table)
        .ok()
        .and_then(|t| published_failure(me, t))
    {
        return Err(e);
    }
    let bad = |what: String| DistError::HandshakeRefused {
        rank: me,
        peer: format!("rank 0 (key {}/init/table)", store.prefix),
        reason: format!("bad table of {} bytes: {what}", table.len()),
    };
    let head = wire::decode_table_head(&table).map_err(|e| bad(e.to_string()))?;
    if head.world as usize != world {
        return Err(DistError::Config {
            what: "world size".into(),
            reason: format!(
                "rank {me} has {world}, but rank 0's table (key {}/init/table) has {}",
                store.prefix, head.world
            ),
        });
    }
    if !head.is_whole() {
        return Err(bad(format!(
            "ranks {}..{} of {}, expected the whole table of {world}",
            head.first,
            u64::from(head.first) + u64::from(head.count),
            head.world
        )));
    }
    let addrs = wire::decode_table_entries(&table[wire::TABLE_HEAD_LEN..], world)
        .map_err(|e| bad(e.to_string()))?;
    Ok((head.job_id, addrs))
}

/// A rank's listener at work: the eager mesh's acceptor (and the connections it passed), or
/// the lazy mesh.
enum Accepting {
    Eager((Acceptor, crossbeam_channel::Receiver<Joined>)),
    Lazy(Mesh),
}

/// The eager mesh's acceptor on `listener`: it takes the ranks above this one, of job `job_id`.
fn eager_acceptor(
    cfg: &TcpConfig,
    listener: TcpListener,
    job_id: u64,
) -> Result<(Acceptor, crossbeam_channel::Receiver<Joined>)> {
    let (me, world) = (cfg.rank, cfg.world_size);
    let (gate, joins) = Gate::once(world);
    let acceptor = Acceptor::start(
        listener,
        Rules {
            me,
            world,
            purpose: Purpose::Mesh,
            ranks: me + 1..world,
            job_id,
            secret: cfg.secret.clone(),
            seal: cfg.seal,
            handshake_timeout: cfg.handshake_timeout,
            gate,
        },
    )?;
    Ok((acceptor, joins))
}

/// How often a rank waiting for the connections of the ranks above it looks in the store for
/// a failure another rank published.
const FAILURE_LOOK: std::time::Duration = std::time::Duration::from_millis(200);

/// The eager mesh: connects to every rank `i < me` and takes the connections of the ranks
/// above from `acceptor`, by `deadline`; `failed` says whether another rank has failed the job.
#[allow(clippy::too_many_arguments)] // Each is one fact about the formation in progress.
fn mesh_eagerly(
    cfg: &TcpConfig,
    (acceptor, joins): (Acceptor, crossbeam_channel::Receiver<Joined>),
    addrs: &[SocketAddr],
    job_id: u64,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
    failed: &dyn Fn() -> Option<DistError>,
) -> Result<()> {
    let (me, world) = (cfg.rank, cfg.world_size);
    // Ranks above us connect to our listener; we connect to the ranks below us.
    for (i, addr) in addrs.iter().enumerate().take(me) {
        let who = format!("rank {i}");
        let s = join_listener(
            *addr,
            &mut || {
                Ok(Hello {
                    version: PROTOCOL_VERSION,
                    purpose: Purpose::Mesh,
                    has_secret: cfg.secret.is_some(),
                    sealed: cfg.seal,
                    world_size: world as u32,
                    rank: me as u32,
                    listen_port: 0,
                    job_id,
                    nonce: nonce(me)?,
                })
            },
            cfg.secret.as_deref(),
            i as u32,
            deadline,
            me,
            &who,
            &|detail| DistError::RendezvousFailed {
                rank: me,
                joined: world,
                world_size: world,
                missing: vec![i],
                waited: started.elapsed(),
                detail,
            },
            failed,
        )?;
        streams[i] = Some(s);
    }
    let mut expected = world - 1 - me;
    while expected > 0 {
        let look = deadline.min(Instant::now() + FAILURE_LOOK);
        match joins.recv_deadline(look) {
            Ok(j) => {
                streams[j.rank] = Some(j.stream);
                expected -= 1;
            }
            Err(RecvTimeoutError::Timeout) if look < deadline => {
                if let Some(e) = failed() {
                    return Err(e);
                }
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                return Err(DistError::RendezvousFailed {
                    rank: me,
                    joined: world - expected,
                    world_size: world,
                    missing: (me + 1..world).filter(|r| streams[*r].is_none()).collect(),
                    waited: started.elapsed(),
                    detail: "these ranks did not connect to this one".into(),
                });
            }
        }
    }
    drop(acceptor);
    Ok(())
}

#[cfg(test)]
mod links_tests;
#[cfg(test)]
mod mesh_tests;
#[cfg(test)]
mod tests;

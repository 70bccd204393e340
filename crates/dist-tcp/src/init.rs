//! Forming the job: rendezvous through rank 0, the handshake, and the full mesh (eager) or the
//! means to connect later (lazy).
//!
//! Rank 0 listens on the master address; its acceptor runs the handshakes on a fixed pool of
//! workers (`acceptor.rs`). Every other rank connects to it (retrying with backoff until the init
//! deadline, so ranks may start in any order), opens a listener of its own, and announces that
//! listener's port in its [`Hello`]. Once all ranks have joined, rank 0 sends each the table of
//! listeners and a fresh job id. Eager ([`Formation::Eager`](crate::Formation::Eager)): rank
//! `j` then connects to every rank `0 < i < j`, whose listener accepts only that job's ranks
//! above it, and reports `Ready` once all its connections are up. Lazy
//! ([`Formation::Lazy`](crate::Formation::Lazy)): each rank starts its long-lived acceptor
//! ([`Mesh`]); the table goes down a tree (`tree.rs`: a rank dials its parent for it and
//! forwards it to its children), and a rank reports `Ready` once it has the table. Rank 0 reads
//! the statuses on one thread (`status.rs`) and answers `Go` when every rank is ready, so that
//! init returns on all ranks together, or fails on all of them with the first rank's error.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::RecvTimeoutError;
use dist_core::{DistError, Result};

use crate::config::TcpConfig;
use crate::wire::{self, Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, STATUS_LEN, Status};

mod acceptor;
mod handshake;
mod links;
mod mesh;
mod status;
mod tree;

use acceptor::Acceptor;
use handshake::*;
pub use links::OnIncoming;
use mesh::MeshSpec;
pub use mesh::{Dialed, Mesh};

/// Forms the job eagerly (whatever `cfg` says) and returns one handshaken stream per peer
/// (`None` at this rank's index).
pub(crate) fn form(cfg: &TcpConfig) -> Result<Vec<Option<TcpStream>>> {
    form_with(cfg, None).map(|f| f.streams)
}

/// A job formed lazily: the connections formation made (to rank 0 on every rank; rank 0's to
/// every rank) and the means to make the others.
#[derive(Debug)]
pub struct Formed {
    /// The stream to each peer connected at formation (`None` elsewhere and at this rank).
    pub streams: Vec<Option<TcpStream>>,
    /// This rank's acceptor and dialer.
    pub mesh: Mesh,
}

/// Forms the job lazily ([`Formation::Lazy`](crate::Formation::Lazy), whatever `cfg` says): `on_incoming` gets every
/// connection a peer makes to this rank that no dialer of this rank waits for, from before
/// this returns.
pub(crate) fn form_lazy(cfg: &TcpConfig, on_incoming: OnIncoming) -> Result<Formed> {
    let f = form_with(cfg, Some(on_incoming))?;
    Ok(Formed {
        streams: f.streams,
        mesh: f.mesh.expect("a lazy formation makes a mesh"),
    })
}

/// Builds a rank's [`MeshSpec`] from the job id and the table of listeners.
type SpecFor<'a> = dyn Fn(u64, Vec<SocketAddr>) -> MeshSpec + 'a;

struct Made {
    streams: Vec<Option<TcpStream>>,
    mesh: Option<Mesh>,
}

/// Forms the job: eagerly without `lazy`, lazily with the callback.
fn form_with(cfg: &TcpConfig, lazy: Option<OnIncoming>) -> Result<Made> {
    cfg.validate()?;
    let started = Instant::now();
    let (me, world) = (cfg.rank, cfg.world_size);
    let deadline =
        dist_core::transport::deadline_after(started, cfg.init_timeout, me, || "init".into())?;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let spec = |job_id: u64, addrs: Vec<SocketAddr>| MeshSpec {
        me,
        world,
        job_id,
        secret: cfg.secret.clone(),
        handshake_timeout: cfg.handshake_timeout,
        addrs,
    };
    if world == 1 {
        let mesh = match lazy {
            None => None,
            Some(cb) => {
                let any = SocketAddr::from(([127, 0, 0, 1], 0));
                Some(Mesh::start(spec(0, vec![any]), None, |_| true, cb)?)
            }
        };
        return Ok(Made { streams, mesh });
    }
    let master = cfg.master_addr()?;
    let mut mesh = None;
    if me == 0 {
        let (job_id, addrs) =
            form_as_root(cfg, master, started, deadline, lazy.is_some(), &mut streams)?;
        if let Some(cb) = lazy {
            mesh = Some(Mesh::start(spec(job_id, addrs), None, |_| true, cb)?);
        }
    } else {
        let mut to_root = match connect_retry(master, deadline, me, "rank 0") {
            Ok(s) => s,
            Err(detail) => {
                return Err(DistError::RendezvousFailed {
                    rank: me,
                    joined: 0,
                    world_size: world,
                    missing: vec![0],
                    waited: started.elapsed(),
                    detail,
                });
            }
        };
        let made = form_as_member(
            cfg,
            master,
            &mut to_root,
            started,
            deadline,
            &mut streams,
            lazy.map(|cb| (cb, &spec as &SpecFor<'_>)),
        );
        match made {
            Ok(m) => mesh = m,
            Err(e) => {
                // Tell rank 0, so that every rank fails now rather than at the deadline.
                let _ = write_by(
                    &mut to_root,
                    &Status::Failed(e.to_string()).encode(me as u32),
                    deadline,
                );
                return Err(e);
            }
        }
        streams[0] = Some(to_root);
    }
    tracing::debug!(rank = me, world, elapsed = ?started.elapsed(), "job formed");
    Ok(Made { streams, mesh })
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

fn form_as_root(
    cfg: &TcpConfig,
    master: SocketAddr,
    started: Instant,
    deadline: Instant,
    lazy: bool,
    streams: &mut [Option<TcpStream>],
) -> Result<(u64, Vec<SocketAddr>)> {
    let world = cfg.world_size;
    let bind_at = SocketAddr::new(cfg.bind.unwrap_or(master.ip()), master.port());
    let listener = bind_listener(bind_at, 0)?;
    tracing::debug!(rank = 0, addr = %bind_at, world, "waiting for ranks to join");
    let (gate, joins) = Gate::once(world);
    let acceptor = Acceptor::start(
        listener,
        Rules {
            me: 0,
            world,
            purpose: Purpose::Rendezvous,
            ranks: 1..world,
            job_id: 0,
            secret: cfg.secret.clone(),
            handshake_timeout: cfg.handshake_timeout,
            gate,
        },
    )?;
    let mut joined: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    let mut count = 1;
    while count < world {
        match joins.recv_deadline(deadline) {
            Ok(j) => {
                let r = j.rank;
                joined[r] = Some(j);
                count += 1;
            }
            Err(_) => {
                return Err(DistError::RendezvousFailed {
                    rank: 0,
                    joined: count,
                    world_size: world,
                    missing: (1..world).filter(|r| joined[*r].is_none()).collect(),
                    waited: started.elapsed(),
                    detail: String::new(),
                });
            }
        }
    }
    drop(acceptor);
    let mut addrs = vec![bind_at; world];
    for (r, j) in joined.iter().enumerate().skip(1) {
        let j = j.as_ref().expect("every rank joined");
        addrs[r] = SocketAddr::new(j.from.ip(), j.hello.listen_port);
    }
    let job_id = u64::from_le_bytes(nonce(0)?[..8].try_into().expect("8 bytes"));
    // The whole table to every rank (eager), or down the tree (lazy): whole to rank 0's
    // children, and to every other rank its parent's entry only (`tree.rs`).
    let table = wire::encode_table(job_id, &addrs);
    let mut conns: Vec<TcpStream> = Vec::with_capacity(world - 1);
    let (sending, mut bytes) = (Instant::now(), 0);
    for (r, j) in joined.into_iter().enumerate().skip(1) {
        let mut s = j.expect("every rank joined").stream;
        let p = tree::parent(r);
        let part;
        let message = if lazy && p != 0 {
            part = wire::encode_table_part(job_id, world as u32, p as u32, &addrs[p..=p]);
            &part
        } else {
            &table
        };
        bytes += message.len();
        write_by(&mut s, message, deadline)
            .map_err(io_err(0, format!("send the table to rank {r}")))?;
        conns.push(s);
    }
    tracing::debug!(
        rank = 0,
        world,
        bytes,
        elapsed = ?sending.elapsed(),
        "table sent"
    );
    let failure = status::gather(&conns, deadline);
    let status = match &failure {
        None => Status::Go,
        Some((_, why)) => Status::Failed(why.clone()),
    };
    for (i, s) in conns.iter_mut().enumerate() {
        write_by(s, &status.encode(0), deadline)
            .map_err(io_err(0, format!("send the go to rank {}", i + 1)))?;
    }
    if let Some((origin, reason)) = failure {
        return Err(DistError::Aborted {
            rank: 0,
            op: "init".into(),
            origin,
            reason,
        });
    }
    for (i, s) in conns.into_iter().enumerate() {
        streams[i + 1] = Some(s);
    }
    Ok((job_id, addrs))
}

fn form_as_member(
    cfg: &TcpConfig,
    master: SocketAddr,
    to_root: &mut TcpStream,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
    lazy: Option<(OnIncoming, &SpecFor<'_>)>,
) -> Result<Option<Mesh>> {
    let (me, world) = (cfg.rank, cfg.world_size);
    // Listen on the interface that reaches rank 0, unless told otherwise.
    let local_ip: IpAddr = match cfg.bind {
        Some(ip) => ip,
        None => to_root
            .local_addr()
            .map_err(io_err(me, "local address"))?
            .ip(),
    };
    let listener = bind_listener(SocketAddr::new(local_ip, 0), me)?;
    let port = listener
        .local_addr()
        .map_err(io_err(me, "listener address"))?
        .port();
    let hello = Hello {
        version: PROTOCOL_VERSION,
        purpose: Purpose::Rendezvous,
        has_secret: cfg.secret.is_some(),
        world_size: world as u32,
        rank: me as u32,
        listen_port: port,
        job_id: 0,
        nonce: [0; NONCE_LEN],
    };
    let root_desc = format!("rank 0 at {}", cfg.master);
    let rendezvous_failed = |detail: String| DistError::RendezvousFailed {
        rank: me,
        joined: 0,
        world_size: world,
        missing: vec![0],
        waited: started.elapsed(),
        detail,
    };
    let first = to_root
        .try_clone()
        .map_err(io_err(me, "clone the socket to rank 0"))?;
    *to_root = join_listener(
        Some(first),
        master,
        &mut || {
            Ok(Hello {
                nonce: nonce(me)?,
                ..hello
            })
        },
        cfg.secret.as_deref(),
        0,
        deadline,
        me,
        "rank 0",
        &rendezvous_failed,
    )?;
    tracing::debug!(rank = me, "joined; waiting for the table");

    // The table arrives once every rank has joined.
    let waiting_for_table = |e: std::io::Error| DistError::RendezvousFailed {
        rank: me,
        joined: 0,
        world_size: world,
        missing: Vec::new(),
        waited: started.elapsed(),
        detail: format!("no table from rank 0 (other ranks missing?): {e}"),
    };
    let protocol = |what: String| DistError::HandshakeRefused {
        rank: me,
        peer: root_desc.clone(),
        reason: what,
    };
    let (head, entries) =
        tree::read_table(to_root, world, deadline, &waiting_for_table, &protocol)?;
    let job_id = head.job_id;

    let mesh = match lazy {
        // Lazy: the listener stays up for the life of the rank; only the tree is dialed now.
        Some((cb, spec)) => {
            let forward = Arc::new(tree::Forward::new(me, world, cfg.handshake_timeout, cb));
            let parent = tree::parent(me);
            let whole = head.is_whole();
            if !whole && (head.first as usize != parent || head.count != 1) {
                return Err(protocol(format!(
                    "rank 0 sent ranks {}..{} of the table; rank {me} expects the whole table \
                     or its parent's entry (rank {parent})",
                    head.first,
                    u64::from(head.first) + u64::from(head.count)
                )));
            }
            let known = if whole {
                entries.clone()
            } else {
                let mut a = vec![SocketAddr::from(([0, 0, 0, 0], 0)); world];
                a[parent] = entries[0];
                a
            };
            let f = forward.clone();
            let mut mesh = Mesh::start(
                spec(job_id, known),
                Some(listener),
                |r| r == 0,
                Box::new(move |r, s| f.incoming(r, s)),
            )?;
            let addrs = if whole {
                entries
            } else {
                let (addrs, s) =
                    tree::table_from_parent(&mesh, parent, entries[0], job_id, world, deadline)?;
                mesh.set_addrs(addrs.clone());
                forward.hand_on(parent, s);
                addrs
            };
            forward.publish(wire::encode_table(job_id, &addrs));
            Some(mesh)
        }
        None => {
            if !head.is_whole() {
                return Err(protocol(format!(
                    "rank 0 sent ranks {}..{} of the table; an eager formation needs the \
                     whole table (is rank 0 forming lazily? DIST_FORMATION must agree)",
                    head.first,
                    u64::from(head.first) + u64::from(head.count)
                )));
            }
            mesh_eagerly(
                cfg, listener, &entries, job_id, &hello, started, deadline, streams,
            )?;
            None
        }
    };
    write_by(to_root, &Status::Ready.encode(me as u32), deadline)
        .map_err(io_err(me, "send ready to rank 0"))?;
    let mut b = [0u8; STATUS_LEN];
    read_exact_by(to_root, &mut b, deadline).map_err(io_err(me, "wait for the go from rank 0"))?;
    match Status::decode(&b) {
        Ok((_, Status::Go)) => Ok(mesh),
        Ok((_, Status::Failed(reason))) => Err(DistError::Aborted {
            rank: me,
            op: "init".into(),
            origin: 0,
            reason,
        }),
        Ok((_, s)) => Err(protocol(format!("unexpected status {s:?}"))),
        Err(e) => Err(protocol(format!("bad status: {e}"))),
    }
}

/// The eager mesh: connects to every rank `0 < i < me` and takes the connections of the ranks
/// above on `listener`, by `deadline`.
#[allow(clippy::too_many_arguments)] // Each is one fact about the formation in progress.
fn mesh_eagerly(
    cfg: &TcpConfig,
    listener: TcpListener,
    addrs: &[SocketAddr],
    job_id: u64,
    hello: &Hello,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> Result<()> {
    let (me, world) = (cfg.rank, cfg.world_size);
    // Ranks above us connect to our listener; we connect to the ranks between 0 and us.
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
            handshake_timeout: cfg.handshake_timeout,
            gate,
        },
    )?;
    for (i, addr) in addrs.iter().enumerate().take(me).skip(1) {
        let who = format!("rank {i}");
        let s = join_listener(
            None,
            *addr,
            &mut || {
                Ok(Hello {
                    purpose: Purpose::Mesh,
                    listen_port: 0,
                    job_id,
                    nonce: nonce(me)?,
                    ..*hello
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
        )?;
        streams[i] = Some(s);
    }
    let mut expected = world - 1 - me;
    while expected > 0 {
        match joins.recv_deadline(deadline) {
            Ok(j) => {
                streams[j.rank] = Some(j.stream);
                expected -= 1;
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
#[cfg(test)]
mod tree_tests;

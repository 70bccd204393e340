//! Forming the job: rendezvous through rank 0, the handshake, and the full mesh.
//!
//! Rank 0 listens on the master address. Every other rank connects to it (retrying with backoff
//! until the init deadline, so ranks may start in any order), opens a listener of its own, and
//! announces that listener's port in its [`Hello`]. Once all ranks have joined, rank 0 sends each
//! the table of listeners and a fresh job id; rank `j` then connects to every rank `0 < i < j`,
//! whose listener accepts only that job's ranks above it. Each rank reports `Ready` to rank 0 once
//! all its connections are up, and rank 0 answers `Go` when every rank has, so that init returns
//! on all ranks together, or fails on all of them with the first rank's error.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::Instant;

use crossbeam_channel::RecvTimeoutError;
use dist_core::{DistError, Result};

use crate::config::TcpConfig;
use crate::wire::{
    self, Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, STATUS_LEN, Status, TABLE_ENTRY_LEN,
    TABLE_HEAD_LEN,
};

mod handshake;

use handshake::*;

/// Forms the job and returns one handshaken stream per peer (`None` at this rank's index).
pub(crate) fn form(cfg: &TcpConfig) -> Result<Vec<Option<TcpStream>>> {
    cfg.validate()?;
    let started = Instant::now();
    let (me, world) = (cfg.rank, cfg.world_size);
    let deadline = dist_core::deadline_after(started, cfg.init_timeout, me, || "init".into())?;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok(streams);
    }
    let master = cfg.master_addr()?;
    if me == 0 {
        form_as_root(cfg, master, started, deadline, &mut streams)?;
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
        if let Err(e) = form_as_member(cfg, master, &mut to_root, started, deadline, &mut streams) {
            // Tell rank 0, so that every rank fails now rather than at the deadline.
            let _ = write_by(
                &mut to_root,
                &Status::Failed(e.to_string()).encode(me as u32),
                deadline,
            );
            return Err(e);
        }
        streams[0] = Some(to_root);
    }
    tracing::debug!(rank = me, world, elapsed = ?started.elapsed(), "job formed");
    Ok(streams)
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
    streams: &mut [Option<TcpStream>],
) -> Result<()> {
    let world = cfg.world_size;
    let bind_at = SocketAddr::new(cfg.bind.unwrap_or(master.ip()), master.port());
    let listener = bind_listener(bind_at, 0)?;
    tracing::debug!(rank = 0, addr = %bind_at, world, "waiting for ranks to join");
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
            claimed: Mutex::new(vec![false; world]),
        },
    )?;
    let mut joined: Vec<Option<Joined>> = (0..world).map(|_| None).collect();
    let mut count = 1;
    while count < world {
        match acceptor.rx.recv_deadline(deadline) {
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
    let table = wire::encode_table(job_id, &addrs);
    let mut conns: Vec<TcpStream> = Vec::with_capacity(world - 1);
    for (r, j) in joined.into_iter().enumerate().skip(1) {
        let mut s = j.expect("every rank joined").stream;
        write_by(&mut s, &table, deadline)
            .map_err(io_err(0, format!("send the table to rank {r}")))?;
        conns.push(s);
    }
    // Wait for every rank's status, each on its own thread so that the first failure is seen at
    // once whichever rank it comes from.
    let (tx, rx) = crossbeam_channel::unbounded();
    for (i, s) in conns.iter().enumerate() {
        let mut s = s.try_clone().map_err(io_err(0, "clone a socket"))?;
        let tx = tx.clone();
        std::thread::Builder::new()
            .name("dist-init-status".into())
            .spawn(move || {
                let mut b = [0u8; STATUS_LEN];
                let r = read_exact_by(&mut s, &mut b, deadline)
                    .map_err(|e| format!("rank {}: no status: {e}", i + 1))
                    .and_then(|()| Status::decode(&b).map_err(|e| format!("rank {}: {e}", i + 1)));
                let _ = tx.send((i + 1, r));
            })
            .map_err(io_err(0, "spawn a status thread"))?;
    }
    drop(tx);
    let mut failure = None;
    for _ in 1..world {
        match rx.recv_deadline(deadline) {
            Ok((_, Ok((_, Status::Ready)))) => {}
            Ok((r, Ok((_, Status::Failed(why))))) => {
                failure = Some((r, why));
                break;
            }
            Ok((r, Ok((_, Status::Go)))) => {
                failure = Some((r, format!("rank {r} sent an unexpected status")));
                break;
            }
            Ok((r, Err(why))) => {
                failure = Some((r, why));
                break;
            }
            Err(_) => {
                failure = Some((
                    0,
                    "ranks did not finish connecting before the init deadline".into(),
                ));
                break;
            }
        }
    }
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
    Ok(())
}

fn form_as_member(
    cfg: &TcpConfig,
    master: SocketAddr,
    to_root: &mut TcpStream,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> Result<()> {
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
    let mut head = [0u8; TABLE_HEAD_LEN];
    read_exact_by(to_root, &mut head, deadline).map_err(waiting_for_table)?;
    let protocol = |what: String| DistError::HandshakeRefused {
        rank: me,
        peer: root_desc.clone(),
        reason: what,
    };
    let (job_id, n) =
        wire::decode_table_head(&head).map_err(|e| protocol(format!("bad table: {e}")))?;
    if n as usize != world {
        return Err(protocol(format!("table has {n} ranks, expected {world}")));
    }
    let mut entries = vec![0u8; world * TABLE_ENTRY_LEN];
    read_exact_by(to_root, &mut entries, deadline).map_err(waiting_for_table)?;
    let addrs = wire::decode_table_entries(&entries, world)
        .map_err(|e| protocol(format!("bad table: {e}")))?;

    // Ranks above us connect to our listener; we connect to the ranks between 0 and us.
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
            claimed: Mutex::new(vec![false; world]),
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
                    ..hello
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
        match acceptor.rx.recv_deadline(deadline) {
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
    write_by(to_root, &Status::Ready.encode(me as u32), deadline)
        .map_err(io_err(me, "send ready to rank 0"))?;
    let mut b = [0u8; STATUS_LEN];
    read_exact_by(to_root, &mut b, deadline).map_err(io_err(me, "wait for the go from rank 0"))?;
    match Status::decode(&b) {
        Ok((_, Status::Go)) => Ok(()),
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

#[cfg(test)]
mod tests;

//! Forming the job: rendezvous through rank 0, the handshake, and the full mesh.
//!
//! Rank 0 listens on the master address. Every other rank connects to it (retrying with backoff
//! until the init deadline, so ranks may start in any order), opens a listener of its own, and
//! announces that listener's port in its [`Hello`]. Once all ranks have joined, rank 0 sends each
//! the table of listeners and a fresh job id; rank `j` then connects to every rank `0 < i < j`,
//! whose listener accepts only that job's ranks above it. Each rank reports `Ready` to rank 0 once
//! all its connections are up, and rank 0 answers `Go` when every rank has, so that init returns
//! on all ranks together, or fails on all of them with the first rank's error.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use dist_core::{DistError, Result};

use crate::config::TcpConfig;
use crate::wire::{
    self, HELLO_LEN, Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, REPLY_LEN, Refusal, Reply,
    STATUS_LEN, Side, Status, TABLE_ENTRY_LEN, TABLE_HEAD_LEN, Tuning,
};

/// How often the accept loop checks whether init is over.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

fn io_err(rank: usize, context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DistError {
    let context = context.into();
    move |source| DistError::Io {
        rank,
        context,
        source,
    }
}

fn nonce(rank: usize) -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| DistError::Io {
        rank,
        context: "draw a random nonce".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(n)
}

/// Reads exactly `buf.len()` bytes by `deadline`, however slowly the peer trickles them.
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut n = 0;
    while n < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("deadline passed after {n} of {} bytes", buf.len()),
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[n..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {n} of {} bytes", buf.len()),
                ));
            }
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("deadline passed after {n} of {} bytes", buf.len()),
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_by(stream: &mut TcpStream, data: &[u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left))?;
    stream.write_all(data)
}

/// What the accepting side enforces on new connections.
struct Rules {
    me: usize,
    world: usize,
    purpose: Purpose,
    ranks: Range<usize>,
    job_id: u64,
    secret: Option<Vec<u8>>,
    handshake_timeout: Duration,
    /// Ranks that have completed the handshake.
    claimed: Mutex<Vec<bool>>,
}

/// A connection that passed the handshake.
struct Joined {
    rank: usize,
    stream: TcpStream,
    hello: Hello,
    from: SocketAddr,
}

/// Accepts connections until stopped; each gets a thread that runs the handshake within the
/// handshake deadline and passes the connection on only if it passes.
struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    rx: Receiver<Joined>,
}

impl Acceptor {
    fn start(listener: TcpListener, rules: Rules) -> Result<Acceptor> {
        let me = rules.me;
        let sock = socket2::Socket::from(listener);
        sock.set_read_timeout(Some(ACCEPT_POLL))
            .map_err(io_err(me, "set accept timeout"))?;
        let listener: TcpListener = sock.into();
        let (tx, rx) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let rules = Arc::new(rules);
        let thread = std::thread::Builder::new()
            .name(format!("dist-accept-{me}"))
            .spawn({
                let stop = stop.clone();
                move || accept_loop(listener, rules, tx, stop)
            })
            .map_err(io_err(me, "spawn the accept thread"))?;
        Ok(Acceptor {
            stop,
            thread: Some(thread),
            rx,
        })
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    rules: Arc<Rules>,
    tx: Sender<Joined>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let (stream, from) = match listener.accept() {
            Ok(c) => c,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                tracing::warn!(rank = rules.me, error = %e, "accept failed");
                continue;
            }
        };
        let me = rules.me;
        let rules = rules.clone();
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("dist-handshake-{}", rules.me))
            .spawn(move || match serve_handshake(stream, from, &rules) {
                Ok(j) => {
                    tracing::debug!(rank = rules.me, peer = j.rank, %from, "peer joined");
                    let _ = tx.send(j);
                }
                Err(why) => {
                    tracing::warn!(rank = rules.me, %from, reason = %why, "refused a connection");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(rank = me, error = %e, "cannot spawn a handshake thread; connection dropped");
        }
    }
}

/// The accepting side of the handshake. Returns the refusal reason on failure, after telling
/// the other side when it is worth telling.
fn serve_handshake(
    mut stream: TcpStream,
    from: SocketAddr,
    r: &Rules,
) -> std::result::Result<Joined, String> {
    let deadline = Instant::now() + r.handshake_timeout;
    let mut buf = [0u8; HELLO_LEN];
    read_exact_by(&mut stream, &mut buf, deadline).map_err(|e| format!("no hello: {e}"))?;
    let refuse = |stream: &mut TcpStream, why: Refusal, reason: String| {
        let _ = write_by(
            stream,
            &Reply::refuse(why, reason.clone()).encode(),
            deadline,
        );
        reason
    };
    let hello = match Hello::decode(&buf) {
        Ok(h) => h,
        Err(e @ wire::DecodeError::BadMagic(_)) => {
            return Err(refuse(&mut stream, Refusal::BadMagic, e.to_string()));
        }
        Err(e) => return Err(refuse(&mut stream, Refusal::Protocol, e.to_string())),
    };
    let rank = hello.rank as usize;
    let checks: [(bool, Refusal, &dyn Fn() -> String); 6] = [
        (hello.version != PROTOCOL_VERSION, Refusal::Version, &|| {
            format!(
                "protocol version {} is not this rank's {PROTOCOL_VERSION}",
                hello.version
            )
        }),
        (hello.purpose != r.purpose, Refusal::Protocol, &|| {
            format!(
                "rank {} accepts {:?} connections, not {:?}",
                r.me, r.purpose, hello.purpose
            )
        }),
        (
            hello.world_size as usize != r.world,
            Refusal::WorldSize,
            &|| {
                format!(
                    "world size {} does not match rank {}'s {}",
                    hello.world_size, r.me, r.world
                )
            },
        ),
        (!r.ranks.contains(&rank), Refusal::RankOutOfRange, &|| {
            if rank == r.me {
                format!("duplicate rank {rank}: that is rank {}'s own rank", r.me)
            } else {
                format!(
                    "rank {rank} may not connect here (rank {} accepts ranks {:?})",
                    r.me, r.ranks
                )
            }
        }),
        (
            r.purpose == Purpose::Mesh && hello.job_id != r.job_id,
            Refusal::WrongJob,
            &|| format!("job id {:#x} is not this job's", hello.job_id),
        ),
        (
            hello.has_secret != r.secret.is_some(),
            Refusal::SecretConfig,
            &|| {
                if r.secret.is_some() {
                    format!(
                        "rank {} requires a shared secret and rank {rank} has none",
                        r.me
                    )
                } else {
                    format!("rank {rank} has a shared secret but rank {} has none", r.me)
                }
            },
        ),
    ];
    if let Some((_, why, text)) = checks.iter().find(|c| c.0) {
        return Err(refuse(&mut stream, *why, format!("{} ({from})", text())));
    }
    let taken = |r: &Rules| r.claimed.lock().map(|c| c[rank]).unwrap_or(true);
    if taken(r) {
        return Err(refuse(
            &mut stream,
            Refusal::DuplicateRank,
            format!(
                "duplicate rank {rank}: it has already joined rank {} ({from})",
                r.me
            ),
        ));
    }
    let server_nonce = nonce(r.me).map_err(|e| e.to_string())?;
    let server_proof = match &r.secret {
        Some(s) => wire::proof(s, Side::Server, &hello, &server_nonce),
        None => [0; NONCE_LEN],
    };
    write_by(
        &mut stream,
        &Reply::accept(server_nonce, server_proof).encode(),
        deadline,
    )
    .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut client_proof = [0u8; NONCE_LEN];
    read_exact_by(&mut stream, &mut client_proof, deadline)
        .map_err(|e| format!("no proof: {e}"))?;
    if let Some(s) = &r.secret
        && !wire::verify_proof(s, Side::Client, &hello, &server_nonce, &client_proof)
    {
        return Err(refuse(
            &mut stream,
            Refusal::WrongSecret,
            format!("wrong shared secret from rank {rank} ({from})"),
        ));
    }
    {
        let mut claimed = r
            .claimed
            .lock()
            .map_err(|_| "rank table poisoned".to_string())?;
        if claimed[rank] {
            drop(claimed);
            return Err(refuse(
                &mut stream,
                Refusal::DuplicateRank,
                format!(
                    "duplicate rank {rank}: it has already joined rank {} ({from})",
                    r.me
                ),
            ));
        }
        claimed[rank] = true;
    }
    write_by(
        &mut stream,
        &Reply::accept([0; NONCE_LEN], [0; NONCE_LEN]).encode(),
        deadline,
    )
    .map_err(|e| format!("sending the verdict: {e}"))?;
    Ok(Joined {
        rank,
        stream,
        hello,
        from,
    })
}

/// The connecting side of the handshake.
fn client_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
    secret: Option<&[u8]>,
    deadline: Instant,
    me: usize,
    peer: &str,
) -> Result<()> {
    let io = |what: &str| io_err(me, format!("handshake with {peer}: {what}"));
    write_by(stream, &hello.encode(), deadline).map_err(io("send hello"))?;
    let refused = |reason: String| DistError::HandshakeRefused {
        rank: me,
        peer: peer.to_string(),
        reason,
    };
    let mut buf = [0u8; REPLY_LEN];
    read_exact_by(stream, &mut buf, deadline).map_err(io("read reply"))?;
    let reply = Reply::decode(&buf).map_err(|e| refused(format!("malformed reply: {e}")))?;
    if reply.refusal.is_some() {
        return Err(refused(reply.reason));
    }
    // Send our proof even when the other side's is wrong, so that it can judge ours and both
    // sides report the mismatch.
    let (proof, peer_proved) = match secret {
        Some(s) => (
            wire::proof(s, Side::Client, hello, &reply.nonce),
            wire::verify_proof(s, Side::Server, hello, &reply.nonce, &reply.proof),
        ),
        None => ([0; NONCE_LEN], true),
    };
    write_by(stream, &proof, deadline).map_err(io("send proof"))?;
    let verdict = read_exact_by(stream, &mut buf, deadline)
        .map_err(|e| e.to_string())
        .and_then(|()| Reply::decode(&buf).map_err(|e| format!("malformed verdict: {e}")));
    match verdict {
        Ok(v) if v.refusal.is_some() => Err(refused(v.reason)),
        _ if !peer_proved => Err(refused(
            "the other side failed to prove the shared secret: the ranks have different secrets"
                .into(),
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(refused(format!("no verdict: {e}"))),
    }
}

/// Connects to `addr`, retrying with backoff until `deadline`.
fn connect_retry(
    addr: SocketAddr,
    deadline: Instant,
    me: usize,
    who: &str,
) -> std::result::Result<TcpStream, String> {
    let mut backoff = Duration::from_millis(5);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        ) {
            Ok(s) => {
                if attempts > 1 {
                    tracing::debug!(rank = me, %addr, attempts, "connected to {who}");
                }
                return Ok(s);
            }
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "cannot connect to {who} at {addr} after {attempts} attempts: {last}"
            ));
        }
        tracing::trace!(rank = me, %addr, error = %last, "connect failed; retrying");
        // Back off between attempts: the peer may simply not have started yet.
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Forms the job and returns one handshaken stream per peer (`None` at this rank's index), and
/// the job's tuning: rank 0's `tuning`, which it sends to every rank.
pub(crate) fn form(cfg: &TcpConfig, tuning: Tuning) -> Result<(Vec<Option<TcpStream>>, Tuning)> {
    cfg.validate()?;
    let started = Instant::now();
    let deadline = started + cfg.init_timeout;
    let (me, world) = (cfg.rank, cfg.world_size);
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok((streams, tuning));
    }
    let master = cfg.master_addr()?;
    let mut tuning = tuning;
    if me == 0 {
        form_as_root(cfg, tuning, master, started, deadline, &mut streams)?;
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
        match form_as_member(cfg, &mut to_root, started, deadline, &mut streams) {
            Ok(t) => tuning = t,
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
    tracing::debug!(rank = me, world, elapsed = ?started.elapsed(), ?tuning, "job formed");
    Ok((streams, tuning))
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
    tuning: Tuning,
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
    let table = wire::encode_table(job_id, tuning, &addrs);
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
    to_root: &mut TcpStream,
    started: Instant,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> Result<Tuning> {
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
        nonce: nonce(me)?,
    };
    let root_desc = format!("rank 0 at {}", cfg.master);
    client_handshake(
        to_root,
        &hello,
        cfg.secret.as_deref(),
        deadline,
        me,
        &root_desc,
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
    let (job_id, n, tuning) =
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
        let mut s = connect_retry(*addr, deadline, me, &who).map_err(|detail| {
            DistError::RendezvousFailed {
                rank: me,
                joined: world,
                world_size: world,
                missing: vec![i],
                waited: started.elapsed(),
                detail,
            }
        })?;
        let mesh_hello = Hello {
            purpose: Purpose::Mesh,
            listen_port: 0,
            job_id,
            nonce: nonce(me)?,
            ..hello
        };
        client_handshake(
            &mut s,
            &mesh_hello,
            cfg.secret.as_deref(),
            deadline,
            me,
            &format!("{who} at {addr}"),
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
        Ok((_, Status::Go)) => Ok(tuning),
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

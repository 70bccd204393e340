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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The most handshakes one listener runs at once. A connection that arrives while this many are
/// in progress is closed at once, unread: a flood of idle or garbage connections costs at most
/// this many threads and sockets, each for at most the handshake timeout. A rank turned away
/// this way (closed before any reply) connects again until the init deadline.
pub(crate) const MAX_HANDSHAKES: usize = 64;

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
    let active = Arc::new(AtomicUsize::new(0));
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
        // Only this thread adds, so the count cannot pass the cap between the check and the add.
        if active.load(Ordering::Acquire) >= MAX_HANDSHAKES {
            tracing::debug!(rank = me, %from, "{MAX_HANDSHAKES} handshakes in progress; closed at once");
            drop(stream);
            continue;
        }
        active.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(active.clone());
        let rules = rules.clone();
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("dist-handshake-{}", rules.me))
            .spawn(move || match serve_handshake(stream, from, &rules, slot) {
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

/// One of a listener's [`MAX_HANDSHAKES`] places, given back when dropped (however the
/// handshake thread ends; if the thread cannot be spawned, the closure that owns it is dropped).
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The accepting side of the handshake, holding `_slot` until it ends. Returns the refusal
/// reason on failure, after telling the other side when it is worth telling.
///
/// With a shared secret, the connecting side proves first: the challenge carries no proof, and
/// this side sends its own proof, in the verdict, only after checking the other's. A stranger
/// that does not know the secret never gets a proof (which would let it test guesses offline).
fn serve_handshake(
    mut stream: TcpStream,
    from: SocketAddr,
    r: &Rules,
    _slot: Slot,
) -> std::result::Result<Joined, String> {
    let deadline = dist_core::deadline_after(Instant::now(), r.handshake_timeout, r.me, || {
        "handshake".into()
    })
    .map_err(|e| e.to_string())?;
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
    // The challenge: this side's nonce, and no proof yet.
    write_by(
        &mut stream,
        &Reply::accept(server_nonce, [0; NONCE_LEN]).encode(),
        deadline,
    )
    .map_err(|e| format!("sending the challenge: {e}"))?;
    let mut client_proof = [0u8; NONCE_LEN];
    read_exact_by(&mut stream, &mut client_proof, deadline)
        .map_err(|e| format!("no proof: {e}"))?;
    let me = r.me as u32;
    if let Some(s) = &r.secret
        && !wire::verify_proof(s, Side::Client, &hello, me, &server_nonce, &client_proof)
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
    // The other side proved the secret (or there is none): now, and only now, this side proves.
    let server_proof = match &r.secret {
        Some(s) => wire::proof(s, Side::Server, &hello, me, &server_nonce),
        None => [0; NONCE_LEN],
    };
    write_by(
        &mut stream,
        &Reply::accept([0; NONCE_LEN], server_proof).encode(),
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

/// How a connecting handshake failed.
#[derive(Debug)]
enum Failed {
    /// The listener closed the connection before any reply: it was busy with
    /// [`MAX_HANDSHAKES`] others (or restarting). Worth connecting again.
    TurnedAway(DistError),
    /// Refused, or broken after the reply: final.
    Final(DistError),
}

/// The connecting side of the handshake with the listener of rank `server_rank`. With a shared
/// secret, this side proves first, and checks the listener's proof in its verdict.
fn client_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
    secret: Option<&[u8]>,
    server_rank: u32,
    deadline: Instant,
    me: usize,
    peer: &str,
) -> std::result::Result<(), Failed> {
    let io = |what: &str| io_err(me, format!("handshake with {peer}: {what}"));
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
        )
    };
    if let Err(e) = write_by(stream, &hello.encode(), deadline) {
        let away = closed(&e);
        let e = io("send hello")(e);
        return Err(if away {
            Failed::TurnedAway(e)
        } else {
            Failed::Final(e)
        });
    }
    let refused = |reason: String| {
        Failed::Final(DistError::HandshakeRefused {
            rank: me,
            peer: peer.to_string(),
            reason,
        })
    };
    let mut buf = [0u8; REPLY_LEN];
    if let Err(e) = read_exact_by(stream, &mut buf, deadline) {
        let away = closed(&e);
        let e = io("read the challenge")(e);
        return Err(if away {
            Failed::TurnedAway(e)
        } else {
            Failed::Final(e)
        });
    }
    let challenge = Reply::decode(&buf).map_err(|e| refused(format!("malformed reply: {e}")))?;
    if challenge.refusal.is_some() {
        return Err(refused(challenge.reason));
    }
    let proof = match secret {
        Some(s) => wire::proof(s, Side::Client, hello, server_rank, &challenge.nonce),
        None => [0; NONCE_LEN],
    };
    write_by(stream, &proof, deadline).map_err(|e| Failed::Final(io("send proof")(e)))?;
    let verdict = read_exact_by(stream, &mut buf, deadline)
        .map_err(|e| e.to_string())
        .and_then(|()| Reply::decode(&buf).map_err(|e| format!("malformed verdict: {e}")));
    match verdict {
        Ok(v) if v.refusal.is_some() => Err(refused(v.reason)),
        Ok(v) => match secret {
            Some(s)
                if !wire::verify_proof(
                    s,
                    Side::Server,
                    hello,
                    server_rank,
                    &challenge.nonce,
                    &v.proof,
                ) =>
            {
                Err(refused(
                    "the other side failed to prove the shared secret: the ranks have different \
                     secrets, or it is not a rank of this job"
                        .into(),
                ))
            }
            _ => Ok(()),
        },
        Err(e) => Err(refused(format!("no verdict: {e}"))),
    }
}

/// Connects to the listener of rank `server_rank` at `addr` (the first time over `first`, when
/// given) and runs the handshake with a hello from `hello` (a fresh nonce each time),
/// connecting again with backoff while the listener turns the connection away unread, until
/// `deadline`.
#[allow(clippy::too_many_arguments)] // Each is one fact about the connection; a struct would only rename them.
fn join_listener(
    first: Option<TcpStream>,
    addr: SocketAddr,
    hello: &mut dyn FnMut() -> Result<Hello>,
    secret: Option<&[u8]>,
    server_rank: u32,
    deadline: Instant,
    me: usize,
    who: &str,
    on_connect_failure: &dyn Fn(String) -> DistError,
) -> Result<TcpStream> {
    let peer = format!("{who} at {addr}");
    let mut backoff = Duration::from_millis(5);
    let mut first = first;
    loop {
        let mut s = match first.take() {
            Some(s) => s,
            None => connect_retry(addr, deadline, me, who).map_err(on_connect_failure)?,
        };
        match client_handshake(&mut s, &hello()?, secret, server_rank, deadline, me, &peer) {
            Ok(()) => return Ok(s),
            Err(Failed::Final(e)) => return Err(e),
            Err(Failed::TurnedAway(e)) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(e);
                }
                tracing::debug!(rank = me, %addr, error = %e, "turned away; connecting again");
                // Back off: the listener is busy with other handshakes, each of which ends
                // within its handshake timeout.
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
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
    let (me, world) = (cfg.rank, cfg.world_size);
    let deadline = dist_core::deadline_after(started, cfg.init_timeout, me, || "init".into())?;
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
        match form_as_member(cfg, master, &mut to_root, started, deadline, &mut streams) {
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
    master: SocketAddr,
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

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"a shared secret of 16+ bytes";

    /// A mesh listener of rank 1 in a job of 4 (job id 7), accepting ranks 2 and 3.
    fn mesh_acceptor(secret: Option<&[u8]>, handshake_timeout: Duration) -> (Acceptor, SocketAddr) {
        let l = bind_listener("127.0.0.1:0".parse().unwrap(), 1).unwrap();
        let addr = l.local_addr().unwrap();
        let a = Acceptor::start(
            l,
            Rules {
                me: 1,
                world: 4,
                purpose: Purpose::Mesh,
                ranks: 2..4,
                job_id: 7,
                secret: secret.map(<[u8]>::to_vec),
                handshake_timeout,
                claimed: Mutex::new(vec![false; 4]),
            },
        )
        .unwrap();
        (a, addr)
    }

    fn mesh_hello(rank: u32, has_secret: bool) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            purpose: Purpose::Mesh,
            has_secret,
            world_size: 4,
            rank,
            listen_port: 0,
            job_id: 7,
            nonce: [rank as u8; NONCE_LEN],
        }
    }

    fn raw(addr: SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn read_all(s: &mut TcpStream) -> Vec<u8> {
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        all
    }

    /// The listener sends its proof only after checking the connecting side's: a client that
    /// sends a wrong proof, or none, gets no proof at all (on main the challenge carried the
    /// listener's proof, so any stranger got an HMAC of the secret to test guesses against).
    #[test]
    fn the_listener_proves_only_after_the_client_has() {
        let (acceptor, addr) = mesh_acceptor(Some(KEY), Duration::from_secs(1));
        let hello = mesh_hello(3, true);

        // A wrong proof: refused, and nothing it received is the listener's proof.
        let mut s = raw(addr);
        s.write_all(&hello.encode()).unwrap();
        s.write_all(&[0x55; NONCE_LEN]).unwrap();
        let got = read_all(&mut s);
        assert_eq!(got.len(), 2 * REPLY_LEN, "challenge then verdict");
        let challenge = Reply::decode(&got[..REPLY_LEN]).unwrap();
        let verdict = Reply::decode(&got[REPLY_LEN..]).unwrap();
        assert_eq!(challenge.refusal, None);
        assert_eq!(
            challenge.proof, [0; NONCE_LEN],
            "the challenge carries a proof"
        );
        assert_eq!(
            verdict.refusal,
            Some(Refusal::WrongSecret),
            "{}",
            verdict.reason
        );
        assert_eq!(verdict.proof, [0; NONCE_LEN], "a refusal carries a proof");
        let server_proof = wire::proof(KEY, Side::Server, &hello, 1, &challenge.nonce);
        assert!(!got.windows(NONCE_LEN).any(|w| w == server_proof));

        // No proof at all: after the challenge the listener waits out the handshake deadline
        // and closes, having sent nothing more.
        let mut s = raw(addr);
        s.write_all(&hello.encode()).unwrap();
        let got = read_all(&mut s);
        assert_eq!(got.len(), REPLY_LEN, "sent more than the challenge");
        assert_eq!(Reply::decode(&got).unwrap().proof, [0; NONCE_LEN]);

        // A wrong secret through the real client: refused, saying why.
        let mut s = raw(addr);
        let deadline = Instant::now() + Duration::from_secs(5);
        let wrong = b"another secret of 16+ bytes";
        match client_handshake(&mut s, &hello, Some(wrong), 1, deadline, 3, "rank 1") {
            Err(Failed::Final(e)) => {
                assert!(
                    e.to_string().contains("wrong shared secret from rank 3"),
                    "{e}"
                )
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // A right secret, but a proof meant for another listener (rank 2): refused too.
        let mut s = raw(addr);
        assert!(matches!(
            client_handshake(&mut s, &hello, Some(KEY), 2, deadline, 3, "rank 1"),
            Err(Failed::Final(_))
        ));
        // The right secret for this listener: both proofs check, and rank 3 has joined.
        let mut s = raw(addr);
        client_handshake(&mut s, &hello, Some(KEY), 1, deadline, 3, "rank 1").unwrap();
        let j = acceptor.rx.recv_deadline(deadline).unwrap();
        assert_eq!(j.rank, 3);
        assert!(acceptor.rx.try_recv().is_err(), "a refused client joined");
    }

    /// The client checks the listener's proof: a listener that accepts any proof but cannot
    /// prove the secret itself is refused by the client.
    #[test]
    fn the_client_refuses_a_listener_that_cannot_prove() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; HELLO_LEN + NONCE_LEN];
            s.read_exact(&mut b[..HELLO_LEN]).unwrap();
            s.write_all(&Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode())
                .unwrap();
            s.read_exact(&mut b[HELLO_LEN..]).unwrap();
            s.write_all(&Reply::accept([0; NONCE_LEN], [2; NONCE_LEN]).encode())
                .unwrap();
        });
        let mut s = raw(addr);
        let deadline = Instant::now() + Duration::from_secs(5);
        match client_handshake(&mut s, &mesh_hello(3, true), Some(KEY), 1, deadline, 3, "x") {
            Err(Failed::Final(e)) => assert!(
                e.to_string().contains("failed to prove the shared secret"),
                "{e}"
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
        fake.join().unwrap();
    }

    /// Open connections a listener holds: `false` for one it has closed.
    fn still_open(s: &TcpStream) -> bool {
        s.set_nonblocking(true).unwrap();
        let open =
            matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        s.set_nonblocking(false).unwrap();
        open
    }

    /// A flood of idle and garbage connections holds at most [`MAX_HANDSHAKES`] of them open
    /// (the rest are closed at once, long before the handshake deadline), and a real rank still
    /// gets through. On main every connection got a thread and was held until its deadline.
    #[test]
    fn admission_is_capped_and_a_rank_gets_through_a_flood() {
        let timeout = Duration::from_secs(3);
        let (acceptor, addr) = mesh_acceptor(None, timeout);
        let t = Instant::now();
        const IDLE: usize = 500;
        const {
            assert!(
                MAX_HANDSHAKES < IDLE / 2,
                "the flood must be well over the cap"
            )
        };
        let idle: Vec<TcpStream> = (0..IDLE).map(|_| raw(addr)).collect();
        let mut garbage: Vec<TcpStream> = (0..50)
            .map(|i| {
                let mut s = raw(addr);
                let _ = s.write_all(&[i as u8; HELLO_LEN]);
                s
            })
            .collect();
        let held = loop {
            let held = idle.iter().filter(|s| still_open(s)).count();
            if held <= MAX_HANDSHAKES || t.elapsed() > timeout - Duration::from_millis(500) {
                break held;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            held <= MAX_HANDSHAKES,
            "{held} of {IDLE} idle connections held open after {:?}",
            t.elapsed()
        );
        for s in &mut garbage {
            // Refused as not a dist peer, or closed at once: never left hanging.
            let got = read_all(s);
            if !got.is_empty() {
                let r = Reply::decode(&got).unwrap();
                assert_eq!(r.refusal, Some(Refusal::BadMagic), "{}", r.reason);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let s = join_listener(
            None,
            addr,
            &mut || Ok(mesh_hello(2, false)),
            None,
            1,
            deadline,
            2,
            "rank 1",
            &|detail| panic!("{detail}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let j = acceptor.rx.recv_deadline(deadline).unwrap();
        assert_eq!(j.rank, 2);
        drop((s, idle));
    }

    /// Runs `form` as rank 1 of 2 against a fake rank 0 that plays `script` on the connection.
    fn against_fake_root(script: fn(&mut TcpStream)) -> DistError {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            script(&mut s);
            // Hold the connection until the rank gives up on it.
            let _ = s.read_to_end(&mut Vec::new());
        });
        let cfg = TcpConfig::new(1, 2, addr.to_string()).init_timeout(Duration::from_secs(10));
        let tuning = Tuning {
            ring_piece_kb: 256,
            lanes: 1,
        };
        let e = form(&cfg, tuning).unwrap_err();
        fake.join().unwrap();
        e
    }

    fn accept_hello(s: &mut TcpStream) {
        let mut b = [0u8; HELLO_LEN];
        s.read_exact(&mut b).unwrap();
        s.write_all(&Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode())
            .unwrap();
        let mut proof = [0u8; NONCE_LEN];
        s.read_exact(&mut proof).unwrap();
        s.write_all(&Reply::accept([0; NONCE_LEN], [0; NONCE_LEN]).encode())
            .unwrap();
    }

    /// What the connecting side reads as lengths (a reply's reason length, the table's count of
    /// ranks) is checked before use: a fake rank 0 that claims 65,535 bytes of reason or a
    /// table of 2^32 - 1 ranks gets an error saying so, and nothing is allocated by it.
    #[test]
    fn lengths_from_a_fake_rank0_are_checked() {
        let e = against_fake_root(|s| {
            let mut b = [0u8; HELLO_LEN];
            s.read_exact(&mut b).unwrap();
            let mut r = Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode();
            r[76..78].copy_from_slice(&u16::MAX.to_le_bytes());
            s.write_all(&r).unwrap();
        });
        assert!(
            e.to_string()
                .contains("malformed reply: invalid reason length 65535"),
            "{e}"
        );
        let e = against_fake_root(|s| {
            accept_hello(s);
            let tuning = Tuning {
                ring_piece_kb: 256,
                lanes: 1,
            };
            let mut table = wire::encode_table(5, tuning, &[]);
            table[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
            s.write_all(&table).unwrap();
        });
        assert!(
            e.to_string()
                .contains(&format!("table has {} ranks, expected 2", u32::MAX)),
            "{e}"
        );
    }
}

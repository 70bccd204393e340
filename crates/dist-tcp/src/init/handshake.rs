//! The handshake of one connection (both sides): the hello, the checks, the proofs of a shared
//! secret, the decision at the verdict ([`Gate`]), and connecting with backoff. The listener
//! that runs it is `acceptor.rs`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dist_core::{DistError, Result};

use super::links::{Links, Verdict};

use crate::wire::{
    self, HELLO_LEN, Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, REPLY_LEN, Refusal, Reply, Side,
};

pub(super) fn io_err(
    rank: usize,
    context: impl Into<String>,
) -> impl FnOnce(std::io::Error) -> DistError {
    let context = context.into();
    move |source| DistError::Io {
        rank,
        context,
        source,
    }
}

pub(super) fn nonce(rank: usize) -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| DistError::Io {
        rank,
        context: "draw a random nonce".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(n)
}

/// Reads exactly `buf.len()` bytes by `deadline`, however slowly the peer trickles them.
pub(super) fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
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

pub(super) fn write_by(
    stream: &mut TcpStream,
    data: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left))?;
    stream.write_all(data)
}

/// What the accepting side enforces on new connections.
pub(super) struct Rules {
    pub(super) me: usize,
    pub(super) world: usize,
    pub(super) purpose: Purpose,
    pub(super) ranks: Range<usize>,
    pub(super) job_id: u64,
    pub(super) secret: Option<Vec<u8>>,
    /// Whether connections are sealed (`crate::seal`; with a secret only).
    pub(super) seal: bool,
    pub(super) handshake_timeout: Duration,
    /// Who decides, at the verdict, whether a rank that passed every check is let in.
    pub(super) gate: Gate,
}

/// The decision at the verdict, made under one lock so that two handshakes cannot both win.
pub(super) enum Gate {
    /// Each rank of `Rules::ranks` joins once (formation): the ranks that have completed the
    /// handshake, and where their connections go.
    Once {
        claimed: Mutex<Vec<bool>>,
        tx: Sender<Joined>,
    },
    /// After formation: the per-peer link states shared with this rank's dialer, which decide
    /// (the crossing rule) and take the connection.
    Mesh(Arc<Links>),
}

impl Gate {
    /// A gate for formation, and the receiving end of its connections.
    pub(super) fn once(world: usize) -> (Gate, Receiver<Joined>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (
            Gate::Once {
                claimed: Mutex::new(vec![false; world]),
                tx,
            },
            rx,
        )
    }
}

/// A connection that passed the handshake.
pub(super) struct Joined {
    pub(super) rank: usize,
    pub(super) stream: TcpStream,
}

/// The accepting side of the handshake, on a worker of the listener's pool, by the handshake
/// deadline from `accepted_at`. A connection that passes goes where the rules' [`Gate`] says;
/// returns the refusal reason on failure, after telling the other side when it is worth
/// telling.
///
/// With a shared secret, the connecting side proves first: the challenge carries no proof, and
/// this side sends its own proof, in the verdict, only after checking the other's. A stranger
/// that does not know the secret never gets a proof (which would let it test guesses offline).
pub(super) fn serve_handshake(
    mut stream: TcpStream,
    from: SocketAddr,
    accepted_at: Instant,
    r: &Rules,
) -> std::result::Result<(), String> {
    // The deadline counts from the accept, so that a connection that waited in the queue for
    // a free worker gets no more time than one served at once.
    let deadline =
        dist_core::transport::deadline_after(accepted_at, r.handshake_timeout, r.me, || {
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
    let checks: [(bool, Refusal, &dyn Fn() -> String); 7] = [
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
        (
            !r.ranks.contains(&rank) || rank == r.me,
            Refusal::RankOutOfRange,
            &|| {
                if rank == r.me {
                    format!("duplicate rank {rank}: that is rank {}'s own rank", r.me)
                } else {
                    format!(
                        "rank {rank} may not connect here (rank {} accepts ranks {:?})",
                        r.me, r.ranks
                    )
                }
            },
        ),
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
        (hello.sealed != r.seal, Refusal::SealConfig, &|| {
            let (on, off) = if r.seal { (r.me, rank) } else { (rank, r.me) };
            format!("rank {on} seals its connections (DIST_SEAL) and rank {off} does not")
        }),
    ];
    if let Some((_, why, text)) = checks.iter().find(|c| c.0) {
        return Err(refuse(&mut stream, *why, format!("{} ({from})", text())));
    }
    let taken = |r: &Rules| match &r.gate {
        Gate::Once { claimed, .. } => claimed.lock().map(|c| c[rank]).unwrap_or(true),
        // Decided at the verdict only: the link's state may change meanwhile.
        Gate::Mesh(_) => false,
    };
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
    // Both ranks dialing each other: the higher rank's connection loses. Refused before the
    // challenge when that is already plain, which saves the proofs and a round trip of a
    // connection that cannot win; refusing needs no proof, as it changes nothing here.
    if let Gate::Mesh(links) = &r.gate
        && links.crosses_early(rank)
    {
        return Err(refuse(
            &mut stream,
            Refusal::Crossed,
            crossed_reason(r.me, rank, from),
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
    match &r.gate {
        Gate::Once { claimed, .. } => {
            let mut claimed = claimed
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
        Gate::Mesh(links) => match links.decide(rank) {
            Verdict::Accept => {}
            Verdict::Crossed => {
                return Err(refuse(
                    &mut stream,
                    Refusal::Crossed,
                    crossed_reason(r.me, rank, from),
                ));
            }
            Verdict::Duplicate => {
                return Err(refuse(
                    &mut stream,
                    Refusal::DuplicateRank,
                    format!(
                        "duplicate rank {rank}: it is already connected to rank {} ({from})",
                        r.me
                    ),
                ));
            }
        },
    }
    // The other side proved the secret: the connection's keys wait for its peer.
    if let (true, Some(s)) = (r.seal, &r.secret) {
        let (to_server, to_client) = wire::seal_keys(s, &hello, me, &server_nonce);
        let keys = crate::seal::Keys {
            tx: to_client,
            rx: to_server,
        };
        crate::seal::remember(&stream, keys).map_err(|e| format!("keeping the keys: {e}"))?;
    }
    // The other side proved the secret (or there is none): now, and only now, this side proves.
    let server_proof = match &r.secret {
        Some(s) => wire::proof(s, Side::Server, &hello, me, &server_nonce),
        None => [0; NONCE_LEN],
    };
    let sent = write_by(
        &mut stream,
        &Reply::accept([0; NONCE_LEN], server_proof).encode(),
        deadline,
    );
    let joined = Joined { rank, stream };
    match &r.gate {
        Gate::Once { tx, .. } => {
            sent.map_err(|e| format!("sending the verdict: {e}"))?;
            let _ = tx.send(joined);
        }
        Gate::Mesh(links) => {
            let failed = sent
                .as_ref()
                .err()
                .map(|e| format!("sending the verdict: {e}"));
            links.settle(rank, failed.is_none().then_some(joined.stream));
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    Ok(())
}

fn crossed_reason(me: usize, rank: usize, from: SocketAddr) -> String {
    format!(
        "crossed: rank {me} is connecting to rank {rank} too, and the lower rank's connection \
         wins ({from})"
    )
}

/// How a connecting handshake failed.
#[derive(Debug)]
pub(super) enum Failed {
    /// The listener closed the connection before any reply: it was busy with
    /// [`MAX_HANDSHAKES`](super::acceptor::MAX_HANDSHAKES) others (or restarting). Worth connecting again.
    TurnedAway(DistError),
    /// Refused as [`Refusal::Crossed`]: the listener's rank is connecting to this one too, and
    /// its (lower-ranked) connection wins; this side waits for it.
    Crossed(DistError),
    /// Refused, or broken after the reply: final.
    Final(DistError),
}

/// The connecting side of the handshake with the listener of rank `server_rank`. With a shared
/// secret, this side proves first, and checks the listener's proof in its verdict.
#[allow(clippy::too_many_arguments)] // Each is one fact about the handshake; a struct would only rename them.
pub(super) fn client_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
    secret: Option<&[u8]>,
    server_rank: u32,
    deadline: Instant,
    verdict_grace: Duration,
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
    let crossed = |reason: String| {
        Failed::Crossed(DistError::HandshakeRefused {
            rank: me,
            peer: peer.to_string(),
            reason,
        })
    };
    match challenge.refusal {
        None => {}
        Some(Refusal::Crossed) => return Err(crossed(challenge.reason)),
        Some(_) => return Err(refused(challenge.reason)),
    }
    let proof = match secret {
        Some(s) => wire::proof(s, Side::Client, hello, server_rank, &challenge.nonce),
        None => [0; NONCE_LEN],
    };
    write_by(stream, &proof, deadline).map_err(|e| Failed::Final(io("send proof")(e)))?;
    // From here the listener may accept this connection and hand it on: a client giving up
    // now would leave the listener holding a connection it dropped. The verdict follows the
    // proof at once on a listener that is running, so the client waits for it past its own
    // deadline by up to `verdict_grace`.
    let verdict_by = deadline.max(Instant::now() + verdict_grace);
    let verdict = match read_exact_by(stream, &mut buf, verdict_by) {
        // The listener closed the connection instead of answering: it gave up on this
        // handshake (past its handshake timeout, on a loaded host) and holds nothing of it, so
        // connecting again is safe.
        Err(e) if closed(&e) => {
            return Err(Failed::TurnedAway(DistError::HandshakeRefused {
                rank: me,
                peer: peer.to_string(),
                reason: format!("no verdict: the listener closed the connection ({e})"),
            }));
        }
        r => r
            .map_err(|e| e.to_string())
            .and_then(|()| Reply::decode(&buf).map_err(|e| format!("malformed verdict: {e}"))),
    };
    match verdict {
        Ok(v) if v.refusal == Some(Refusal::Crossed) => Err(crossed(v.reason)),
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
            Some(s) if hello.sealed => {
                let (to_server, to_client) =
                    wire::seal_keys(s, hello, server_rank, &challenge.nonce);
                let keys = crate::seal::Keys {
                    tx: to_server,
                    rx: to_client,
                };
                crate::seal::remember(stream, keys)
                    .map_err(|e| Failed::Final(io("keep the connection's keys")(e)))
            }
            _ => Ok(()),
        },
        Err(e) => Err(refused(format!("no verdict: {e}"))),
    }
}

/// Connects to the listener of rank `server_rank` at `addr` and runs the handshake with a hello
/// from `hello` (a fresh nonce each time), connecting again with backoff while the listener
/// refuses the connection or turns it away unread, until `deadline`, or until `abandon` says
/// why not to (another rank has failed the job).
#[allow(clippy::too_many_arguments)] // Each is one fact about the connection; a struct would only rename them.
pub(super) fn join_listener(
    addr: SocketAddr,
    hello: &mut dyn FnMut() -> Result<Hello>,
    secret: Option<&[u8]>,
    server_rank: u32,
    deadline: Instant,
    me: usize,
    who: &str,
    on_connect_failure: &dyn Fn(String) -> DistError,
    abandon: &dyn Fn() -> Option<DistError>,
) -> Result<TcpStream> {
    let peer = format!("{who} at {addr}");
    let mut backoff = Duration::from_millis(5);
    loop {
        let mut s = match connect_retry(addr, deadline, me, who, abandon) {
            Ok(s) => s,
            Err(NoConnection::GaveUp(detail)) => return Err(on_connect_failure(detail)),
            Err(NoConnection::Abandoned(e)) => return Err(e),
        };
        // A formation that fails fails as a whole: no grace is needed.
        let grace = Duration::ZERO;
        match client_handshake(
            &mut s,
            &hello()?,
            secret,
            server_rank,
            deadline,
            grace,
            me,
            &peer,
        ) {
            Ok(()) => return Ok(s),
            Err(Failed::Final(e) | Failed::Crossed(e)) => return Err(e),
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

/// Why [`connect_retry`] returned no connection.
pub(super) enum NoConnection {
    /// The deadline passed; what the last attempt met.
    GaveUp(String),
    /// `abandon` said why to stop.
    Abandoned(DistError),
}

/// From which backoff on a connect that keeps failing asks `abandon` between attempts (each
/// asking is a round trip to the store): the first few quick retries do not.
const ASK_FROM: Duration = Duration::from_millis(40);

/// Connects to `addr`, retrying with backoff until `deadline`, or until `abandon` says why not
/// to.
pub(super) fn connect_retry(
    addr: SocketAddr,
    deadline: Instant,
    me: usize,
    who: &str,
    abandon: &dyn Fn() -> Option<DistError>,
) -> std::result::Result<TcpStream, NoConnection> {
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
            return Err(NoConnection::GaveUp(format!(
                "cannot connect to {who} at {addr} after {attempts} attempts: {last}"
            )));
        }
        if backoff >= ASK_FROM
            && let Some(e) = abandon()
        {
            return Err(NoConnection::Abandoned(e));
        }
        tracing::trace!(rank = me, %addr, error = %last, "connect failed; retrying");
        // Back off between attempts: the peer may simply not have started yet.
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

//! Choosing shared memory for a connection, once its handshake is done and before any frame
//! crosses it. Both sides run [`negotiate`] on the TCP stream at the same point:
//!
//! 1. Each sends an offer (96 bytes): whether it wants shared memory, its host identity (a hash
//!    of the boot id, the network namespace and `DIST_HOST_ID`), its ring's capacity and, from
//!    the lower rank, the name of an abstract Unix socket it listens on (no file) and a token.
//! 2. If both want it and the identities match, the higher rank connects to that socket and
//!    sends the token with its ring's `memfd` (`SCM_RIGHTS`); the lower rank checks the token
//!    and answers with its own `memfd`. Each maps the peer's segment after checking it.
//!    With the ring's `memfd` goes the rank's host arena's (`arena.rs`), when it has one.
//! 3. Each sends one byte over TCP: whether it mapped the peer's ring (bit 0) and its arena
//!    (bit 1). A rank writes to its own ring only if the peer mapped it, and reads the peer's
//!    only if it did: every failure in step 2 leaves that direction on TCP, agreed by both
//!    sides. The arena of a pair counts only where both mapped the other's.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
#[cfg(target_os = "linux")]
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use sha2::{Digest, Sha256};

use super::arena::ArenaSetup;
use super::map::Segment;
use super::peer_cred::socket_process;
// The pidfd and arena tests name `socket_pid` here, where it was defined first.
#[cfg(test)]
pub(super) use super::peer_cred::socket_pid;
use super::pidfd::PeerProcess;
use super::{RxRing, TxRing};

/// The capacity of each ring: enough for a 1 MiB piece of a pipelined collective in flight.
pub(crate) const RING_CAP: u64 = 1 << 20;

const OFFER_MAGIC: [u8; 8] = *b"dist-shO";
const OFFER_LEN: usize = 96;
const FLAG_WANTS: u32 = 1;

/// A connection's shared-memory parts: the ring this rank writes (if the peer mapped it) and
/// the peer's ring this rank reads (if it mapped it).
#[derive(Debug, Default)]
pub(crate) struct Shm {
    pub(crate) tx: Option<TxRing>,
    pub(crate) rx: Option<RxRing>,
}

/// What a rank says about itself in its offer.
#[derive(Debug)]
struct Offer {
    wants: bool,
    cap: u64,
    host: [u8; 32],
    nonce: [u8; 16],
    token: [u8; 16],
    rank: u64,
}

impl Offer {
    fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[..8].copy_from_slice(&OFFER_MAGIC);
        let flags = if self.wants { FLAG_WANTS } else { 0 };
        b[8..12].copy_from_slice(&flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.cap.to_le_bytes());
        b[24..56].copy_from_slice(&self.host);
        b[56..72].copy_from_slice(&self.nonce);
        b[72..88].copy_from_slice(&self.token);
        b[88..96].copy_from_slice(&self.rank.to_le_bytes());
        b
    }

    fn decode(b: &[u8; OFFER_LEN]) -> Result<Offer, String> {
        if b[..8] != OFFER_MAGIC {
            return Err("its first bytes after the handshake are not a shared-memory offer".into());
        }
        fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
            b[at..at + N].try_into().expect("slice of fixed length")
        }
        let flags = u32::from_le_bytes(arr(b, 8));
        if flags & !FLAG_WANTS != 0 || b[12..16] != [0; 4] {
            return Err(format!("shared-memory offer with unknown flags {flags:#x}"));
        }
        Ok(Offer {
            wants: flags & FLAG_WANTS != 0,
            cap: u64::from_le_bytes(arr(b, 16)),
            host: arr(b, 24),
            nonce: arr(b, 56),
            token: arr(b, 72),
            rank: u64::from_le_bytes(arr(b, 88)),
        })
    }
}

/// This host's identity as far as shared memory goes: the kernel's boot id and this process's
/// network namespace (device and inode of `/proc/self/ns/net`), and `host_id` (the
/// `DIST_HOST_ID` that simulates hosts in tests). `None` when either cannot be read.
pub(crate) fn host_identity(host_id: Option<&str>) -> Option<[u8; 32]> {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let ns = std::fs::metadata("/proc/self/ns/net").ok()?;
    let mut h = Sha256::new();
    h.update(b"dist shm host\0");
    h.update(boot.trim().as_bytes());
    h.update(format!("\0{}:{}\0", ns.dev(), ns.ino()).as_bytes());
    h.update(host_id.unwrap_or("").as_bytes());
    Some(h.finalize().into())
}

fn left(deadline: Instant) -> std::io::Result<Duration> {
    let l = deadline.saturating_duration_since(Instant::now());
    if l.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(l)
}

fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.set_read_timeout(Some(left(deadline)?))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    s.set_write_timeout(Some(left(deadline)?))?;
    s.write_all(buf)
}

/// Runs the exchange above on `stream` (rank `me` and `peer`; `host` this rank's identity, or
/// `None` to decline shared memory; `arena` the host arena's setup, which learns the peer's
/// host and segment). An error is a failure of the TCP connection itself or of the protocol
/// (the connection is unusable); a failure to set up shared memory is not: that direction
/// stays on TCP.
pub(crate) fn negotiate(
    stream: &TcpStream,
    me: usize,
    peer: usize,
    host: Option<[u8; 32]>,
    arena: Option<&ArenaSetup>,
    deadline: Instant,
) -> Result<Shm, String> {
    let mut s = stream
        .try_clone()
        .map_err(|e| format!("clone socket: {e}"))?;
    let mut nonce = [0u8; 16];
    let mut token = [0u8; 16];
    let mut listener = None;
    if host.is_some() && me < peer {
        getrandom::fill(&mut nonce)
            .and_then(|()| getrandom::fill(&mut token))
            .map_err(|e| format!("random bytes: {e}"))?;
        listener = UnixListener::bind_addr(&abstract_addr(&nonce).map_err(|e| e.to_string())?)
            .inspect_err(|e| tracing::debug!(me, peer, error = %e, "no shared-memory listener"))
            .ok();
    }
    let mine = Offer {
        wants: host.is_some() && (me > peer || listener.is_some()),
        cap: RING_CAP,
        host: host.unwrap_or([0; 32]),
        nonce,
        token,
        rank: me as u64,
    };
    let tcp = |what: &str, e: std::io::Error| format!("{what} (shared-memory offer): {e}");
    write_all_by(&mut s, &mine.encode(), deadline).map_err(|e| tcp("send", e))?;
    let mut raw = [0u8; OFFER_LEN];
    read_exact_by(&mut s, &mut raw, deadline).map_err(|e| tcp("receive", e))?;
    let theirs = Offer::decode(&raw)?;
    if theirs.rank != peer as u64 {
        return Err(format!(
            "shared-memory offer from rank {} on the connection of rank {peer}",
            theirs.rank
        ));
    }
    if let Some(a) = arena {
        a.note_host(peer, theirs.wants.then_some(theirs.host));
    }
    let mut shm = Shm::default();
    let mut own = None;
    let mut arena_mapped = false;
    if mine.wants && theirs.wants && mine.host == theirs.host {
        let arena_fd = arena.and_then(ArenaSetup::fd);
        match exchange(
            &s,
            me,
            peer,
            &mine,
            &theirs,
            listener.take(),
            arena_fd,
            deadline,
        ) {
            Ok((seg, fd, their_arena, process)) => {
                own = Some(seg);
                match Segment::open(&fd, theirs.cap) {
                    Ok(seg) => shm.rx = Some(RxRing::new(seg, theirs.cap, peer)),
                    Err(e) => tracing::warn!(me, peer, "peer's shared-memory ring refused: {e}"),
                }
                if let (Some(a), Some(fd)) = (arena, their_arena) {
                    arena_mapped = a.map_peer(peer, &fd, process);
                }
            }
            Err(e) => tracing::warn!(me, peer, "no shared memory with this peer: {e}"),
        }
    }
    drop(listener);
    let ok = [u8::from(shm.rx.is_some()) | (u8::from(arena_mapped) << 1)];
    write_all_by(&mut s, &ok, deadline).map_err(|e| tcp("send", e))?;
    let mut theirs_ok = [0u8];
    read_exact_by(&mut s, &mut theirs_ok, deadline).map_err(|e| tcp("receive", e))?;
    let b = theirs_ok[0];
    if b > 3 {
        return Err(format!("shared-memory answer {b} is not one of 0 to 3"));
    }
    if b & 1 != 0 {
        let Some(seg) = own else {
            return Err("peer says it mapped a ring this rank never sent".into());
        };
        shm.tx = Some(TxRing::new(seg, RING_CAP, peer));
    }
    if b & 2 != 0 {
        match arena {
            Some(a) if a.fd().is_some() && mine.wants => a.note_mapped_mine(peer),
            _ => return Err("peer says it mapped a host arena this rank never sent".into()),
        }
    }
    tracing::debug!(
        me,
        peer,
        tx = shm.tx.is_some(),
        rx = shm.rx.is_some(),
        "shared memory"
    );
    Ok(shm)
}

#[cfg(target_os = "linux")]
fn abstract_addr(nonce: &[u8; 16]) -> std::io::Result<SocketAddr> {
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    SocketAddr::from_abstract_name(format!("dist-shm-{hex}"))
}

/// Abstract Unix sockets are Linux's; elsewhere there is no shared memory (`host_identity`
/// reads Linux's `/proc` and is `None`, so no rank offers it), and this is never reached.
#[cfg(not(target_os = "linux"))]
fn abstract_addr(_nonce: &[u8; 16]) -> std::io::Result<SocketAddr> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "shared memory between ranks needs Linux (abstract Unix sockets)",
    ))
}

/// Step 2: passes this rank's new segment (and its arena's, `arena`) to the peer and receives
/// the peer's descriptors: its ring's, and its arena's if it sent one; and the process at the
/// other end of the Unix socket they came through, as the kernel says ([`socket_process`]).
// The exchange's two ends, its descriptors and its deadline.
#[allow(clippy::too_many_arguments)]
fn exchange(
    tcp: &TcpStream,
    me: usize,
    peer: usize,
    mine: &Offer,
    theirs: &Offer,
    listener: Option<UnixListener>,
    arena: Option<&OwnedFd>,
    deadline: Instant,
) -> Result<(Segment, OwnedFd, Option<OwnedFd>, Option<PeerProcess>), String> {
    let (fd, seg) = Segment::create(RING_CAP).map_err(|e| format!("memfd ring: {e}"))?;
    let got = if me < peer {
        let l = listener.ok_or("no listener")?;
        let mut u = accept_peer(&l, tcp, deadline)?;
        let fds_in = recv_fd(&mut u, &mut [0u8; 16], deadline, Some(&mine.token))?;
        send_fd(&u, &[1], &fd, arena, deadline)?;
        (fds_in, socket_process(&u))
    } else {
        let u = connect_peer(me, peer, &theirs.nonce, deadline)?;
        send_fd(&u, &theirs.token, &fd, arena, deadline)?;
        let mut u = u;
        (
            recv_fd(&mut u, &mut [0u8; 1], deadline, Some(&[1]))?,
            socket_process(&u),
        )
    };
    let ((got, their_arena), process) = got;
    Ok((seg, got, their_arena, process))
}

/// Connects to the lower rank's abstract socket named by `nonce`, by `deadline`. A blocking
/// Unix connect to a listener whose queue is full waits for the socket's send timeout
/// (infinite by default), so the timeout is set to the time left before connecting; the
/// kernel then gives up with `EAGAIN`.
#[cfg(target_os = "linux")]
fn connect_peer(
    me: usize,
    peer: usize,
    nonce: &[u8; 16],
    deadline: Instant,
) -> Result<UnixStream, String> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let start = Instant::now();
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let addr = SocketAddrUnix::new_abstract_name(format!("dist-shm-{hex}").as_bytes())
        .map_err(|e| format!("rank {me}: the name of peer {peer}'s socket: {e}"))?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| format!("rank {me}: a socket for peer {peer}: {e}"))?;
    let u = UnixStream::from(fd);
    let timed_out = || {
        format!(
            "rank {me}: connect to peer {peer}'s socket did not complete in {:?} (its deadline)",
            start.elapsed()
        )
    };
    let wait = left(deadline).map_err(|_| timed_out())?;
    u.set_write_timeout(Some(wait))
        .map_err(|e| format!("rank {me}: send timeout for peer {peer}'s socket: {e}"))?;
    match rustix::net::connect(&u, &addr) {
        Ok(()) => Ok(u),
        Err(rustix::io::Errno::AGAIN) => Err(timed_out()),
        Err(e) => Err(format!(
            "rank {me}: connect to peer {peer}'s socket: {e} (after {:?})",
            start.elapsed()
        )),
    }
}

#[cfg(not(target_os = "linux"))]
fn connect_peer(
    _me: usize,
    _peer: usize,
    nonce: &[u8; 16],
    _deadline: Instant,
) -> Result<UnixStream, String> {
    Err(abstract_addr(nonce).err().map_or_else(
        || "shared memory between ranks needs Linux".to_string(),
        |e| e.to_string(),
    ))
}

/// Accepts the first connection on `l` (its token is checked next: a stranger that connects
/// first only costs this pair its shared memory), unless the peer gives up first (its answer
/// arrives on `tcp`) or `deadline` passes.
fn accept_peer(l: &UnixListener, tcp: &TcpStream, deadline: Instant) -> Result<UnixStream, String> {
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    loop {
        match l.accept() {
            Ok((u, _)) => {
                u.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(u);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("accept: {e}")),
        }
        let wait = left(deadline).map_err(|_| "the peer did not connect in time".to_string())?;
        let mut fds = [
            libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: tcp.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        crate::sys::poll_many(&mut fds, wait).map_err(|e| format!("poll: {e}"))?;
        if fds[1].revents != 0 && fds[0].revents == 0 {
            return Err("the peer gave up before connecting".into());
        }
    }
}

/// Sends `bytes` with the ring's descriptor `fd` and, if given, the arena's `arena`.
fn send_fd(
    u: &UnixStream,
    bytes: &[u8],
    fd: &OwnedFd,
    arena: Option<&OwnedFd>,
    deadline: Instant,
) -> Result<(), String> {
    u.set_write_timeout(Some(left(deadline).map_err(|e| e.to_string())?))
        .map_err(|e| e.to_string())?;
    let all = [Some(fd.as_fd()), arena.map(|a| a.as_fd())];
    let fds: Vec<_> = all.into_iter().flatten().collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err("no room for the descriptor".into());
    }
    let n = rustix::net::sendmsg(u, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)
        .map_err(|e| format!("send the ring: {e}"))?;
    if n != bytes.len() {
        return Err(format!("sent {n} of {} bytes with the ring", bytes.len()));
    }
    Ok(())
}

/// Receives `buf.len()` bytes with one descriptor (the ring's) and maybe a second (the
/// arena's); the bytes must equal `expect`.
fn recv_fd(
    u: &mut UnixStream,
    buf: &mut [u8],
    deadline: Instant,
    expect: Option<&[u8]>,
) -> Result<(OwnedFd, Option<OwnedFd>), String> {
    u.set_read_timeout(Some(left(deadline).map_err(|e| e.to_string())?))
        .map_err(|e| e.to_string())?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = rustix::net::recvmsg(
        &*u,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| format!("receive the peer's ring: {e}"))?;
    let mut got = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            // Any descriptor beyond the second is closed here, unused.
            got.extend(fds.take(2 - got.len().min(2)));
        }
    }
    let mut got = got.into_iter();
    let (fd, arena) = (got.next(), got.next());
    if r.bytes != buf.len() {
        return Err(format!(
            "unexpected answer on the ring socket: {} bytes where {} were expected",
            r.bytes,
            buf.len()
        ));
    }
    if expect.is_some_and(|x| x != &buf[..]) {
        // (Neither value is printed: the expected one is this pair's secret token.)
        return Err(format!(
            "unexpected answer on the ring socket: its {} bytes are not the token this rank sent",
            r.bytes
        ));
    }
    fd.map(|f| (f, arena)).ok_or_else(|| {
        format!(
            "no descriptor came with the {}-byte answer (the ring's, and the arena's if any, \
             were expected)",
            r.bytes
        )
    })
}

#[cfg(test)]
#[path = "setup_tests.rs"]
mod tests;

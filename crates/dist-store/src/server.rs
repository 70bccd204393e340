//! [`StoreServer`]: one thread, one event loop (epoll on Linux) over every connection, serving
//! PyTorch's TCPStore protocol. Idle connections cost a socket and a few bytes, no thread; every
//! buffer is bounded (see [`ServerOptions`]); a client that breaks a rule is closed, alone.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use crate::error::{Result, StoreError};
use crate::poll::{NOTIFY, Poll, Ready};
use crate::proto::{self, ParseError, Request, VALIDATION_MAGIC, WireLimits};
use crate::state::{Answer, ClientId, Outbox, Refusal, State, StoreLimits};

/// The server's bounds. The defaults hold 16 Ki clients in at most a few GiB whatever they send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerOptions {
    /// What one request may carry (PyTorch's libuv caps by default).
    pub wire: WireLimits,
    /// What the store may hold in total.
    pub store: StoreLimits,
    /// Most connections at once; more are accepted and closed at once.
    pub max_clients: usize,
    /// A client's answers waiting to be sent, beyond which its further requests wait (it is not
    /// read from) until it has taken them.
    pub client_out_pause: usize,
    /// All clients' answers waiting to be sent; beyond it the client holding the most is closed.
    pub max_total_out: usize,
    /// All clients' partly received requests; a read that would pass it closes that client.
    pub max_total_in: usize,
    /// The listen backlog asked of the kernel (it caps it at `net.core.somaxconn`).
    pub backlog: i32,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            wire: WireLimits::default(),
            store: StoreLimits::default(),
            max_clients: 16 * 1024,
            client_out_pause: 256 * 1024,
            max_total_out: 1 << 30,
            max_total_in: 1 << 30,
            backlog: 16 * 1024,
        }
    }
}

/// Counters of a running server (for tests and tools).
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections open now.
    pub clients: AtomicUsize,
    /// Connections accepted so far.
    pub accepted: AtomicUsize,
    /// Connections the server closed because of what they sent (or did not take).
    pub refused: AtomicUsize,
    /// Bytes of answers waiting to be sent, all clients together.
    pub unsent: AtomicUsize,
    /// Bytes of requests received and not yet run, all clients together.
    pub unrun: AtomicUsize,
}

/// A TCPStore server on its own thread. Dropping it (or [`StoreServer::stop`]) closes every
/// connection; a client waiting on a key then sees the connection end.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    poller: Arc<Poll>,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
    thread: Option<JoinHandle<()>>,
}

const LISTENER: usize = 0;
/// Bytes read from one client per readiness event before the loop turns to others.
const READ_BUDGET: usize = 1 << 20;
/// Requests up to this long get their whole buffer when their length is known (a libuv-sized
/// value, 8 MiB, and its key); longer ones grow as they arrive.
const RESERVE_AT_ONCE: usize = 9 << 20;

impl StoreServer {
    /// Listens on `addr` (port 0: any free port) with the default bounds.
    pub fn bind(addr: impl ToSocketAddrs) -> Result<StoreServer> {
        StoreServer::bind_with(addr, ServerOptions::default())
    }

    /// Listens on `addr` with the bounds in `opts`.
    pub fn bind_with(addr: impl ToSocketAddrs, opts: ServerOptions) -> Result<StoreServer> {
        let want = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| StoreError::Serve {
                addr: "?".into(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "no address to bind"),
            })?;
        let serve_err = |source| StoreError::Serve {
            addr: want.to_string(),
            source,
        };
        let listener = listen(want, opts.backlog).map_err(serve_err)?;
        let addr = listener.local_addr().map_err(serve_err)?;
        let poller = Arc::new(Poll::new().map_err(serve_err)?);
        // SAFETY: the listener lives in the loop below until the loop deletes it from the poller
        // (its last act); should the loop unwind, the poller goes with it or outlives a closed
        // socket, which epoll drops from its set on close, so no event names a reused fd
        // (`polling`'s contract off Linux). Shown by `server_stops_and_clients_see_it` in
        // crates/dist-store/tests/server.rs.
        unsafe { poller.add(&listener, LISTENER, true, false) }.map_err(serve_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ServerStats::default());
        let mut ev = EventLoop {
            listener,
            poller: poller.clone(),
            conns: HashMap::new(),
            next_id: LISTENER + 1,
            state: State::new(opts.store),
            opts,
            total_in: 0,
            total_out: 0,
            stop: stop.clone(),
            stats: stats.clone(),
            addr,
            scratch: vec![0u8; 64 * 1024].into_boxed_slice(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("dist-store {addr}"))
            .spawn(move || ev.run())
            .map_err(serve_err)?;
        Ok(StoreServer {
            addr,
            poller,
            stop,
            stats,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its counters.
    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }

    /// Stops the loop and closes every connection (as dropping it does).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.poller.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn listen(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    inbuf: Vec<u8>,
    /// Bytes the request at the front of `inbuf` needs in all, once its length is known.
    need: usize,
    out: VecDeque<Answer>,
    /// Bytes of `out.front()` already sent.
    out_off: usize,
    /// Bytes in `out` not yet sent.
    out_len: usize,
    validated: bool,
    /// The interest registered now (readable, writable); level-triggered, so it changes only
    /// when the client pauses or has answers waiting.
    armed: (bool, bool),
}

struct EventLoop {
    listener: TcpListener,
    poller: Arc<Poll>,
    conns: HashMap<ClientId, Conn>,
    next_id: ClientId,
    state: State,
    opts: ServerOptions,
    total_in: usize,
    total_out: usize,
    stop: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
    addr: SocketAddr,
    /// Where every read lands first.
    scratch: Box<[u8]>,
}

/// Why a client is closed.
#[derive(Debug)]
enum Close {
    Eof,
    Io(io::Error),
    Parse(ParseError),
    Refused(Refusal),
    NotValidated(u8),
    InBudget,
    OutBudget,
}

impl std::fmt::Display for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Close::Eof => write!(f, "the client closed the connection"),
            Close::Io(e) => write!(f, "i/o error: {e}"),
            Close::Parse(e) => write!(f, "malformed or oversized request: {e}"),
            Close::Refused(Refusal::Full(what)) => write!(f, "the store's limit on {what} reached"),
            Close::Refused(Refusal::NotANumber) => {
                write!(
                    f,
                    "add or barrier on a value that is no decimal integer, or overflow"
                )
            }
            Close::Refused(Refusal::AlreadyWaiting) => write!(f, "a second wait while waiting"),
            Close::Refused(Refusal::Revalidate) => write!(f, "validate after the first query"),
            Close::NotValidated(q) => write!(f, "first query {q}, not VALIDATE with the magic"),
            Close::InBudget => write!(f, "the server's receive budget is spent"),
            Close::OutBudget => write!(
                f,
                "the most unsent answers while the server's send budget is spent"
            ),
        }
    }
}

impl EventLoop {
    fn run(&mut self) {
        let mut ready: Vec<Ready> = Vec::with_capacity(1024);
        while !self.stop.load(Ordering::SeqCst) {
            ready.clear();
            if let Err(e) = self.poller.wait(&mut ready) {
                tracing::error!(server = %self.addr, error = %e, "store server: poll failed, stopping");
                break;
            }
            for &(key, readable) in &ready {
                match key {
                    LISTENER => self.accept(),
                    NOTIFY => {}
                    _ => self.service(key, readable),
                }
            }
            self.stats.unsent.store(self.total_out, Ordering::Relaxed);
            self.stats.unrun.store(self.total_in, Ordering::Relaxed);
        }
        let ids: Vec<ClientId> = self.conns.keys().copied().collect();
        for id in ids {
            self.drop_conn(id);
        }
        let _ = self.poller.delete(&self.listener);
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                    if self.conns.len() >= self.opts.max_clients {
                        tracing::warn!(server = %self.addr, %peer, max = self.opts.max_clients,
                            "store server: client limit reached, closing new connection");
                        self.stats.refused.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let id = self.next_id;
                    self.next_id += 1;
                    // SAFETY: as for the listener: the stream stays in `conns` until `drop_conn`
                    // deletes it from the poller before dropping it.
                    let added = unsafe { self.poller.add(&stream, id, true, false) };
                    if added.is_err() {
                        continue;
                    }
                    self.conns.insert(
                        id,
                        Conn {
                            stream,
                            peer,
                            inbuf: Vec::new(),
                            need: 0,
                            out: VecDeque::new(),
                            out_off: 0,
                            out_len: 0,
                            validated: false,
                            armed: (true, false),
                        },
                    );
                    self.stats.clients.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: try again later.
                    tracing::warn!(server = %self.addr, error = %e, "store server: accept failed");
                    break;
                }
            }
        }
    }

    /// Serves `first` (reading from it if `readable`) and every client its requests answered.
    fn service(&mut self, first: ClientId, readable: bool) {
        let mut work = vec![(first, readable)];
        while let Some((id, readable)) = work.pop() {
            let mut touched = Vec::new();
            if let Err(why) = self.step(id, readable, &mut touched) {
                self.close(id, why);
            }
            touched.sort_unstable();
            touched.dedup();
            work.extend(touched.into_iter().filter(|&c| c != id).map(|c| (c, false)));
        }
        while self.total_out > self.opts.max_total_out {
            let hog = self
                .conns
                .iter()
                .max_by_key(|(_, c)| c.out_len)
                .map(|(&k, _)| k);
            match hog {
                Some(h) => self.close(h, Close::OutBudget),
                None => break,
            }
        }
    }

    /// Reads (if `readable`), runs complete requests, sends, and registers the interest left.
    fn step(
        &mut self,
        id: ClientId,
        readable: bool,
        touched: &mut Vec<ClientId>,
    ) -> Result<(), Close> {
        if readable {
            self.read(id)?;
        }
        loop {
            let paused = self.run_requests(id, touched)?;
            self.flush(id)?;
            let conn = self.conns.get(&id).ok_or(Close::Eof)?;
            if !paused || conn.out_len >= self.opts.client_out_pause {
                break;
            }
        }
        let conn = self.conns.get_mut(&id).ok_or(Close::Eof)?;
        let want = (conn.out_len < self.opts.client_out_pause, conn.out_len > 0);
        if want != conn.armed {
            conn.armed = want;
            self.poller
                .modify(&conn.stream, id, want.0, want.1)
                .map_err(Close::Io)?;
        }
        Ok(())
    }

    fn read(&mut self, id: ClientId) -> Result<(), Close> {
        let pause = self.opts.client_out_pause;
        let max_req = self.opts.wire.max_request_len;
        let conn = self.conns.get_mut(&id).ok_or(Close::Eof)?;
        let mut read = 0;
        while read < READ_BUDGET && conn.out_len < pause && conn.inbuf.len() <= max_req {
            let want = conn.need.saturating_sub(conn.inbuf.len());
            #[cfg(target_os = "linux")]
            if want >= self.scratch.len() && conn.inbuf.capacity() - conn.inbuf.len() >= want {
                // A large request whose room is reserved: straight into it, no scratch copy.
                let before = conn.inbuf.len();
                let room = rustix::buffer::spare_capacity(&mut conn.inbuf);
                match rustix::io::read(&conn.stream, room) {
                    Ok(0) => return Err(Close::Eof),
                    Ok(_) => {}
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(Close::Io(e.into())),
                }
                let n = conn.inbuf.len() - before;
                self.total_in += n;
                read += n;
                if self.total_in > self.opts.max_total_in {
                    return Err(Close::InBudget);
                }
                continue;
            }
            #[cfg(not(target_os = "linux"))]
            let _ = want;
            // Into the loop's one scratch buffer, then only what came into the client's: no
            // per-client 64 KiB buffer to allocate and clear for a request of a few bytes.
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => return Err(Close::Eof),
                Ok(n) => {
                    if self.total_in + n > self.opts.max_total_in {
                        return Err(Close::InBudget);
                    }
                    conn.inbuf.extend_from_slice(&self.scratch[..n]);
                    self.total_in += n;
                    read += n;
                    if n < self.scratch.len() {
                        break;
                    }
                }
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(Close::Io(e)),
                },
            }
        }
        Ok(())
    }

    /// Runs the complete requests in `id`'s buffer while its unsent answers stay under the
    /// pause; `Ok(true)` when it stopped for the pause.
    fn run_requests(&mut self, id: ClientId, touched: &mut Vec<ClientId>) -> Result<bool, Close> {
        let pause = self.opts.client_out_pause;
        let mut conn = self.conns.remove(&id).ok_or(Close::Eof)?;
        let mut used = 0;
        let mut outbox: Outbox = Vec::new();
        let mut result = Ok(false);
        let mut need = 0;
        loop {
            if conn.out_len >= pause {
                result = Ok(true);
                break;
            }
            let (req, n) = match proto::parse_or_need(&conn.inbuf[used..], &self.opts.wire) {
                Ok(Ok(p)) => p,
                Ok(Err(n)) => {
                    need = n;
                    break;
                }
                Err(e) => {
                    result = Err(Close::Parse(e));
                    break;
                }
            };
            used += n;
            if !conn.validated {
                // The first query must be VALIDATE with the magic (PyTorch's legacy server
                // closes such a client too).
                if req == Request::Validate(VALIDATION_MAGIC) {
                    conn.validated = true;
                    continue;
                }
                result = Err(Close::NotValidated(conn.inbuf[used - n]));
                break;
            }
            let r = self.state.apply(id, req, &mut outbox);
            for (c, answer) in outbox.drain(..) {
                let target = if c == id {
                    Some(&mut conn)
                } else {
                    touched.push(c);
                    self.conns.get_mut(&c)
                };
                if let Some(t) = target {
                    t.out_len += answer.len();
                    self.total_out += answer.len();
                    t.out.push_back(answer);
                }
            }
            if let Err(refusal) = r {
                result = Err(Close::Refused(refusal));
                break;
            }
        }
        conn.inbuf.drain(..used);
        self.total_in -= used;
        conn.need = need;
        if conn.inbuf.is_empty() && conn.inbuf.capacity() > 64 * 1024 {
            // An idle client keeps no large buffer.
            conn.inbuf = Vec::new();
        } else if need > conn.inbuf.len() && need <= RESERVE_AT_ONCE {
            // The request's length is known: one allocation rather than a doubling chain of
            // copies as it arrives.
            conn.inbuf.reserve_exact(need - conn.inbuf.len());
        }
        self.conns.insert(id, conn);
        result
    }

    /// Sends what `id` has pending, as far as the socket takes it.
    fn flush(&mut self, id: ClientId) -> Result<(), Close> {
        let conn = self.conns.get_mut(&id).ok_or(Close::Eof)?;
        while let Some(front) = conn.out.front() {
            let off = conn.out_off;
            let header;
            let wrote = match front {
                Answer::Bytes(b) => conn.stream.write(&b[off..]),
                Answer::Value(v) if off < 8 => {
                    header = (v.len() as u64).to_le_bytes();
                    let parts = [io::IoSlice::new(&header[off..]), io::IoSlice::new(v)];
                    conn.stream.write_vectored(&parts)
                }
                Answer::Value(v) => conn.stream.write(&v[off - 8..]),
            };
            match wrote {
                Ok(n) => {
                    conn.out_off += n;
                    conn.out_len -= n;
                    self.total_out -= n;
                    if conn.out_off == front.len() {
                        conn.out.pop_front();
                        conn.out_off = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Close::Io(e)),
            }
        }
        Ok(())
    }

    fn close(&mut self, id: ClientId, why: Close) {
        let Some(conn) = self.conns.get(&id) else {
            return;
        };
        match &why {
            Close::Eof | Close::Io(_) => {
                tracing::debug!(server = %self.addr, peer = %conn.peer, reason = %why, "store server: client gone");
            }
            _ => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(server = %self.addr, peer = %conn.peer, reason = %why,
                    "store server: closing client");
            }
        }
        self.drop_conn(id);
    }

    fn drop_conn(&mut self, id: ClientId) {
        if let Some(conn) = self.conns.remove(&id) {
            let _ = self.poller.delete(&conn.stream);
            self.total_in -= conn.inbuf.len();
            self.total_out -= conn.out_len;
            self.state.forget(id);
            self.stats.clients.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

//! One peer's connection after the handshake: the writer (callers' threads write frames directly,
//! one at a time), the reader thread (reads every frame and lands its payload in the buffer a
//! receiver has posted, or queues it), and the matching of messages to receivers by tag.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dist_core::{DistError, Meta, Result, Tag};

use crate::wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind};

/// Messages at least this long wait up to [`GRACE`] for a receive before being queued.
const GRACE_MIN_LEN: usize = 64 << 10;
/// How long a large message waits for its receive to be posted.
const GRACE: Duration = Duration::from_millis(5);

/// How long a receiver spins for its message before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// A message that arrived before anyone asked for it.
struct Queued {
    data: Vec<u8>,
    meta: Meta,
}

/// How a posted receive ended.
enum Outcome {
    Delivered(Meta),
    /// The message had another length; it stays queued.
    Mismatch(usize),
    Gone(String),
}

enum Slot {
    /// Waiting for a message.
    Open,
    /// The reader thread is writing a payload into the buffer.
    Filling,
    Done(Outcome),
}

/// A receive waiting for a message: the caller's buffer, which the reader fills directly.
struct Posted {
    id: u64,
    tag: u64,
    ptr: *mut u8,
    len: usize,
    slot: Slot,
}

struct State {
    /// Why the connection ended, once it has.
    closed: Option<String>,
    posted: VecDeque<Posted>,
    queued: HashMap<u64, VecDeque<Queued>>,
    next_id: u64,
    /// Threads blocked on the condition variable; nobody is notified when there are none.
    sleepers: usize,
}

// SAFETY: `Posted::ptr` is the only non-`Send` field. It points into a buffer that the receiving
// thread borrows mutably for as long as the entry is in `posted`; that thread removes the entry
// before it returns (waiting out a fill in progress), and only the thread that moved the entry to
// `Filling` writes through the pointer. So moving `State` between threads (inside the mutex) never
// lets the pointer outlive or alias its buffer.
unsafe impl Send for State {}

/// Withdraws a posted receive when dropped while armed.
struct PostGuard<'a> {
    peer: &'a Peer,
    id: u64,
    deadline: Instant,
    armed: bool,
}

impl Drop for PostGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.peer.withdraw(self.id, self.deadline);
        }
    }
}

/// An abort notice received from a peer: who sent it, on which tag, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank that aborted.
    pub from: usize,
    /// The tag of the operation it aborted.
    pub tag: Tag,
    /// Its error.
    pub reason: String,
}

/// The abort notices of one backend, shared by its peers. Once one has arrived, every wait on a
/// system tag (barrier, collectives) fails with it instead of waiting out its deadline.
#[derive(Debug, Default)]
pub(crate) struct Aborts {
    raised: AtomicBool,
    notices: Mutex<Vec<AbortNotice>>,
}

impl Aborts {
    pub(crate) fn raise(&self, n: AbortNotice) {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(n);
        self.raised.store(true, Ordering::Release);
    }

    pub(crate) fn raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    pub(crate) fn notices(&self) -> Vec<AbortNotice> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn error(&self, me: usize, op: String) -> DistError {
        let first = self.notices().into_iter().next();
        DistError::Aborted {
            rank: me,
            op,
            origin: first.as_ref().map_or(me, |n| n.from),
            reason: first.map_or_else(|| "aborted".into(), |n| n.reason),
        }
    }
}

/// A hook the owning backend passes to each peer to hear of abort frames.
pub(crate) type AbortSink = Arc<dyn Fn(AbortNotice) + Send + Sync>;

/// One peer: its socket halves, and the messages and receives waiting on it.
pub(crate) struct Peer {
    pub(crate) me: usize,
    pub(crate) rank: usize,
    /// The writing half; `None` for the loopback peer (this rank itself).
    writer: Option<Mutex<Writer>>,
    /// A handle used only to shut the connection down.
    stream: Option<TcpStream>,
    state: Mutex<State>,
    cond: Condvar,
    /// Bumped whenever a receive completes, for waiters that spin before they sleep.
    events: AtomicU64,
    aborts: Arc<Aborts>,
}

struct Writer {
    sock: socket2::Socket,
    broken: Option<String>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("rank", &self.rank).finish()
    }
}

fn write_all_vectored(sock: &socket2::Socket, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    // MSG_NOSIGNAL: a closed peer is an EPIPE error, never a SIGPIPE that kills the process.
    const FLAGS: i32 = libc_msg_nosignal();
    while !bufs.is_empty() {
        match sock.send_vectored_with_flags(bufs, FLAGS) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

const fn libc_msg_nosignal() -> i32 {
    // The value of MSG_NOSIGNAL on Linux and the BSDs that have it.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        0x4000
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        0
    }
}

impl Peer {
    /// A peer over `stream`, whose handshake is done.
    pub(crate) fn connected(
        me: usize,
        rank: usize,
        stream: TcpStream,
        timeout: Duration,
        aborts: Arc<Aborts>,
    ) -> Result<Peer> {
        let io = |context: &str, source| DistError::Io {
            rank: me,
            context: format!("{context} for peer {rank}"),
            source,
        };
        stream
            .set_nodelay(true)
            .map_err(|e| io("set TCP_NODELAY", e))?;
        stream
            .set_read_timeout(None)
            .map_err(|e| io("clear read timeout", e))?;
        let w = stream.try_clone().map_err(|e| io("clone socket", e))?;
        let sock = socket2::Socket::from(w);
        sock.set_write_timeout(Some(timeout))
            .map_err(|e| io("set send timeout", e))?;
        Ok(Peer {
            me,
            rank,
            writer: Some(Mutex::new(Writer { sock, broken: None })),
            stream: Some(stream),
            state: Mutex::new(State {
                closed: None,
                posted: VecDeque::new(),
                queued: HashMap::new(),
                next_id: 0,
                sleepers: 0,
            }),
            cond: Condvar::new(),
            events: AtomicU64::new(0),
            aborts,
        })
    }

    /// The peer that is this rank itself: sends are copied to its own queue.
    pub(crate) fn loopback(me: usize, aborts: Arc<Aborts>) -> Peer {
        Peer {
            me,
            rank: me,
            writer: None,
            stream: None,
            state: Mutex::new(State {
                closed: None,
                posted: VecDeque::new(),
                queued: HashMap::new(),
                next_id: 0,
                sleepers: 0,
            }),
            cond: Condvar::new(),
            events: AtomicU64::new(0),
            aborts,
        }
    }

    /// A second handle on the socket for the reader thread.
    pub(crate) fn reader_stream(&self) -> Option<std::io::Result<TcpStream>> {
        self.stream.as_ref().map(TcpStream::try_clone)
    }

    /// Blocks on the condition variable (at most `limit`), counted in `sleepers`.
    fn sleep<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        limit: Option<Duration>,
    ) -> MutexGuard<'a, State> {
        st.sleepers += 1;
        let mut st = match limit {
            Some(d) => {
                self.cond
                    .wait_timeout(st, d)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => self.cond.wait(st).unwrap_or_else(|p| p.into_inner()),
        };
        st.sleepers -= 1;
        st
    }

    /// Wakes the threads blocked on the condition variable, if any, and any spinning waiter.
    fn notify(&self, st: &State) {
        self.events.fetch_add(1, Ordering::Release);
        if st.sleepers > 0 {
            self.cond.notify_all();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock can only come from a bug in this module; the state is
        // still consistent (every update is a single assignment), so carry on with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends one frame. `op` names the operation in errors.
    pub(crate) fn send(
        &self,
        kind: FrameKind,
        tag: u64,
        data: &[u8],
        meta: Meta,
        op: &dyn Fn() -> String,
    ) -> Result<()> {
        let Some(writer) = &self.writer else {
            return self.deliver_local(tag, data, meta);
        };
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        let header = FrameHeader {
            kind,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
        let started = Instant::now();
        match write_all_vectored(&w.sock, &mut bufs) {
            Ok(()) => Ok(()),
            Err(e) => {
                // A frame may be half written: the stream is no longer in step with the reader on
                // the other side, so close it; both sides then see the peer as gone.
                let timed_out = matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
                let cause = if timed_out {
                    format!(
                        "send blocked for {:.1?}: peer not reading",
                        started.elapsed()
                    )
                } else {
                    format!("send failed: {e}")
                };
                w.broken = Some(cause.clone());
                let _ = w.sock.shutdown(Shutdown::Both);
                if timed_out {
                    Err(DistError::Timeout {
                        rank: self.me,
                        op: op(),
                        peer: self.rank,
                        waited: started.elapsed(),
                    })
                } else {
                    Err(self.gone(op(), cause))
                }
            }
        }
    }

    fn gone(&self, op: String, cause: String) -> DistError {
        DistError::PeerGone {
            rank: self.me,
            peer: self.rank,
            op,
            cause,
        }
    }

    /// A send to this rank itself: hand the bytes to a posted receive or queue a copy.
    fn deliver_local(&self, tag: u64, data: &[u8], meta: Meta) -> Result<()> {
        self.offer(tag, Payload::Borrowed(data), meta);
        Ok(())
    }

    /// Hands a complete message to the first open receive on `tag` (copying it into the posted
    /// buffer), or queues it. A receive whose buffer has another size is told so, and the
    /// message stays queued for a receive with the right size.
    fn offer(&self, tag: u64, data: Payload<'_>, meta: Meta) {
        let mut st = self.lock();
        let bytes = data.bytes();
        let keep = match st
            .posted
            .iter_mut()
            .find(|p| p.tag == tag && matches!(p.slot, Slot::Open))
        {
            Some(p) if p.len == bytes.len() => {
                // SAFETY: see `State`'s `Send` impl: the entry is open, so its buffer is live and
                // only written by whoever moves the entry out of `Open`, which we do under the lock.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.ptr, bytes.len()) };
                p.slot = Slot::Done(Outcome::Delivered(meta));
                false
            }
            Some(p) => {
                p.slot = Slot::Done(Outcome::Mismatch(bytes.len()));
                true
            }
            None => true,
        };
        if keep {
            let data = data.into_vec();
            st.queued
                .entry(tag)
                .or_default()
                .push_back(Queued { data, meta });
        }
        self.notify(&st);
    }

    /// Receives the next message on `tag` into `buf` by `deadline`; returns its meta.
    pub(crate) fn recv(
        &self,
        buf: &mut [u8],
        tag: u64,
        deadline: Instant,
        op: &dyn Fn() -> String,
    ) -> Result<Meta> {
        self.recv_overlapped(buf, tag, deadline, op, || Ok(()))
    }

    /// Posts a receive of `buf`, runs `during` (a send, typically), then waits for the receive.
    /// The payload can land in `buf` while `during` runs. If `during` fails, its error is
    /// returned once the receive has been withdrawn.
    pub(crate) fn recv_overlapped(
        &self,
        buf: &mut [u8],
        tag: u64,
        deadline: Instant,
        op: &dyn Fn() -> String,
        during: impl FnOnce() -> Result<()>,
    ) -> Result<Meta> {
        let started = Instant::now();
        let len = buf.len();
        let mut st = self.lock();
        if let Some(q) = st.queued.get_mut(&tag)
            && let Some(front) = q.front()
        {
            let r = if front.data.len() != len {
                Err(self.mismatch(op(), len, front.data.len()))
            } else {
                let m = q.pop_front().expect("front exists");
                buf.copy_from_slice(&m.data);
                Ok(m.meta)
            };
            drop(st);
            during()?;
            return r;
        }
        if let Some(cause) = &st.closed {
            let e = self.gone(op(), cause.clone());
            drop(st);
            during()?;
            return Err(e);
        }
        let id = st.next_id;
        st.next_id += 1;
        st.posted.push_back(Posted {
            id,
            tag,
            ptr: buf.as_mut_ptr(),
            len,
            slot: Slot::Open,
        });
        // The reader may be holding a large message back for a receive like this one.
        if st.sleepers > 0 {
            self.cond.notify_all();
        }
        drop(st);
        // From here the reader may write into `buf`: the guard withdraws the receive (waiting out
        // a fill in progress) on every way out, unwinding included, before `buf` is released.
        let mut guard = PostGuard {
            peer: self,
            id,
            deadline,
            armed: true,
        };
        during()?;
        guard.armed = false;
        self.wait(id, tag, len, started, deadline, op)
    }

    fn wait(
        &self,
        id: u64,
        tag: u64,
        len: usize,
        started: Instant,
        deadline: Instant,
        op: &dyn Fn() -> String,
    ) -> Result<Meta> {
        let mut st = self.lock();
        let mut timed_out = false;
        let mut spun = false;
        loop {
            let i = st
                .posted
                .iter()
                .position(|p| p.id == id)
                .expect("an entry stays until its owner removes it");
            if matches!(st.posted[i].slot, Slot::Done(_)) {
                let Some(Posted {
                    slot: Slot::Done(outcome),
                    ..
                }) = st.posted.remove(i)
                else {
                    unreachable!("checked above")
                };
                if timed_out {
                    return Err(self.timeout(op(), started));
                }
                return match outcome {
                    Outcome::Delivered(meta) => Ok(meta),
                    Outcome::Mismatch(got) => Err(self.mismatch(op(), len, got)),
                    Outcome::Gone(cause) => Err(self.gone(op(), cause)),
                };
            }
            let open = matches!(st.posted[i].slot, Slot::Open);
            if open && Tag::from_wire(tag).is_system() && self.aborts.raised() {
                st.posted.remove(i);
                return Err(self.aborts.error(self.me, op()));
            }
            if !spun {
                // Spin briefly before sleeping: a reply that comes within microseconds is then
                // picked up without the reader thread having to wake this one.
                spun = true;
                let seen = self.events.load(Ordering::Acquire);
                drop(st);
                let until = Instant::now() + SPIN;
                while self.events.load(Ordering::Acquire) == seen && Instant::now() < until {
                    std::thread::yield_now();
                }
                st = self.lock();
                continue;
            }
            let now = Instant::now();
            if !timed_out && now >= deadline {
                if open {
                    st.posted.remove(i);
                    return Err(self.timeout(op(), started));
                }
                timed_out = true;
                self.cut_stalled();
            }
            st = self.sleep(
                st,
                (!timed_out).then(|| deadline.saturating_duration_since(now)),
            );
        }
    }

    /// The peer stalled in the middle of a payload that is landing in a caller's buffer, past
    /// the caller's deadline. The caller may not return while the reader can still write to the
    /// buffer: cut the connection, which stops the reader at once and releases the buffer.
    fn cut_stalled(&self) {
        tracing::warn!(
            rank = self.me,
            peer = self.rank,
            "peer stalled mid-message past the deadline; closing the connection"
        );
        if let Some(s) = &self.stream {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Withdraws a posted receive; if its buffer is being filled, waits for the fill to end
    /// (cutting the connection if that takes past `deadline`).
    fn withdraw(&self, id: u64, deadline: Instant) {
        let mut st = self.lock();
        let mut cut = false;
        loop {
            let Some(i) = st.posted.iter().position(|p| p.id == id) else {
                return;
            };
            if !matches!(st.posted[i].slot, Slot::Filling) {
                st.posted.remove(i);
                return;
            }
            let now = Instant::now();
            if !cut && now >= deadline {
                cut = true;
                self.cut_stalled();
            }
            st = self.sleep(st, (!cut).then(|| deadline.saturating_duration_since(now)));
        }
    }

    fn timeout(&self, op: String, started: Instant) -> DistError {
        DistError::Timeout {
            rank: self.me,
            op,
            peer: self.rank,
            waited: started.elapsed(),
        }
    }

    /// The length and meta of the next queued message on `tag`, if one is queued.
    pub(crate) fn peek(&self, tag: u64) -> Option<(usize, Meta)> {
        let st = self.lock();
        st.queued
            .get(&tag)
            .and_then(|q| q.front())
            .map(|m| (m.data.len(), m.meta))
    }

    /// Wakes every waiter so that it rechecks the abort flag.
    pub(crate) fn wake(&self) {
        let st = self.lock();
        self.notify(&st);
    }

    /// Waits until the reader has seen the connection end, or `deadline`. True if it has.
    pub(crate) fn wait_closed(&self, deadline: Instant) -> bool {
        if self.stream.is_none() {
            return true;
        }
        let mut st = self.lock();
        while st.closed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.sleep(st, Some(left));
        }
        true
    }

    fn mismatch(&self, op: String, expected: usize, got: usize) -> DistError {
        DistError::SizeMismatch {
            rank: self.me,
            peer: self.rank,
            op,
            expected,
            got,
        }
    }

    /// Marks the connection closed and fails every open receive with `cause`.
    fn close(&self, cause: String) {
        let mut st = self.lock();
        if st.closed.is_none() {
            st.closed = Some(cause.clone());
        }
        for p in st.posted.iter_mut() {
            if matches!(p.slot, Slot::Open) {
                p.slot = Slot::Done(Outcome::Gone(cause.clone()));
            }
        }
        self.notify(&st);
    }

    /// Shuts the socket down in both directions (on drop, or to break a hung connection).
    pub(crate) fn shutdown(&self, how: Shutdown) {
        if let Some(s) = &self.stream {
            let _ = s.shutdown(how);
        }
    }

    /// The reader thread's body: runs until the connection ends, then fails all waiters.
    pub(crate) fn read_loop(&self, stream: TcpStream, on_abort: AbortSink) {
        // Buffered, so that a small message's header and payload take one system call; reads of
        // large payloads bypass the buffer and land in the receiver's memory directly.
        let mut stream = std::io::BufReader::with_capacity(64 << 10, stream);
        let cause = match self.read_frames(&mut stream, &on_abort) {
            Ok(()) => "connection closed by peer".to_string(),
            Err(e) => e,
        };
        tracing::debug!(rank = self.me, peer = self.rank, %cause, "reader finished");
        self.close(cause);
    }

    fn read_frames(
        &self,
        stream: &mut impl Read,
        on_abort: &AbortSink,
    ) -> std::result::Result<(), String> {
        let mut hdr = [0u8; FRAME_HEADER_LEN];
        loop {
            // A clean end of stream is only clean between frames.
            match read_full(stream, &mut hdr) {
                Ok(0) => return Ok(()),
                Ok(n) if n < FRAME_HEADER_LEN => {
                    return Err(format!(
                        "connection closed in a frame header ({n} of {FRAME_HEADER_LEN} bytes)"
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(describe(&e)),
            }
            let h = FrameHeader::decode(&hdr).map_err(|e| format!("protocol error: {e}"))?;
            let len = usize::try_from(h.len)
                .map_err(|_| format!("protocol error: frame of {} bytes", h.len))?;
            match h.kind {
                FrameKind::Abort => {
                    let mut text = vec![0u8; len.min(64 * 1024)];
                    stream.read_exact(&mut text).map_err(|e| describe(&e))?;
                    skip(stream, len - text.len()).map_err(|e| describe(&e))?;
                    on_abort(AbortNotice {
                        from: self.rank,
                        tag: Tag::from_wire(h.tag),
                        reason: String::from_utf8_lossy(&text).into_owned(),
                    });
                }
                FrameKind::Data => self.land(stream, h.tag, len, h.meta)?,
            }
        }
    }

    /// Lands one payload: into a posted buffer of the right size, else into the queue.
    fn land(
        &self,
        stream: &mut impl Read,
        tag: u64,
        len: usize,
        meta: Meta,
    ) -> std::result::Result<(), String> {
        let mut st = self.lock();
        let open = |st: &State| {
            st.posted
                .iter()
                .any(|p| p.tag == tag && matches!(p.slot, Slot::Open))
        };
        if len >= GRACE_MIN_LEN && !open(&st) {
            // A large message nobody waits for yet. Streaming receivers post their next buffer
            // a moment after the last one filled: give them that moment, so the payload lands
            // in place instead of in a fresh allocation and a second copy. Correctness does not
            // depend on it; after the grace period the message is queued as usual.
            let until = Instant::now() + GRACE;
            while !open(&st) {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = self.sleep(st, Some(left));
            }
        }
        let target = st
            .posted
            .iter_mut()
            .find(|p| p.tag == tag && matches!(p.slot, Slot::Open))
            .filter(|p| p.len == len)
            .map(|p| {
                p.slot = Slot::Filling;
                (p.id, p.ptr)
            });
        match target {
            Some((id, ptr)) => {
                drop(st);
                // SAFETY: the entry is `Filling`, which only this thread sets and clears; its
                // owner waits (see `recv`) until it is `Done` before touching or freeing the
                // buffer, and `len` is the buffer's length.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                let r = stream.read_exact(buf);
                let mut st = self.lock();
                if let Some(p) = st.posted.iter_mut().find(|p| p.id == id) {
                    p.slot = Slot::Done(match &r {
                        Ok(()) => Outcome::Delivered(meta),
                        Err(e) => {
                            Outcome::Gone(format!("connection lost mid-message: {}", describe(e)))
                        }
                    });
                }
                self.notify(&st);
                r.map_err(|e| format!("connection lost mid-message: {}", describe(&e)))
            }
            _ => {
                // No receive waits with a buffer of this size: read the message whole, then offer
                // it again (a receive may have been posted meanwhile) or keep it.
                drop(st);
                let mut data = vec![0u8; len];
                stream
                    .read_exact(&mut data)
                    .map_err(|e| format!("connection lost mid-message: {}", describe(&e)))?;
                self.offer(tag, Payload::Owned(data), meta);
                Ok(())
            }
        }
    }
}

enum Payload<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Payload<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::Borrowed(b) => b,
            Payload::Owned(v) => v,
        }
    }

    fn into_vec(self) -> Vec<u8> {
        match self {
            Payload::Borrowed(b) => b.to_vec(),
            Payload::Owned(v) => v,
        }
    }
}

fn describe(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "connection closed mid-message".into(),
        std::io::ErrorKind::ConnectionReset => "connection reset by peer".into(),
        _ => e.to_string(),
    }
}

/// Reads until `buf` is full or the stream ends; returns how much was read.
fn read_full(stream: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match stream.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn skip(stream: &mut impl Read, mut n: usize) -> std::io::Result<()> {
    let mut scratch = [0u8; 4096];
    while n > 0 {
        let k = n.min(scratch.len());
        stream.read_exact(&mut scratch[..k])?;
        n -= k;
    }
    Ok(())
}

//! One peer's connection after the handshake: the writer (callers' threads write frames directly,
//! one at a time), the read side (frames are read without blocking, by the peer's reader thread
//! or by a receiver spinning for its message, and each payload lands in the buffer a receiver
//! has posted, or in the queue), and the matching of messages to receivers by tag.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use dist_core::{DistError, Meta, Result, Tag};

use crate::sys::{MSG_DONTWAIT, MSG_NOSIGNAL};
use crate::wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind};

/// The longest abort notice a peer may send (its error text); a longer one is a protocol error.
pub(crate) const ABORT_MAX: usize = 64 << 10;
/// How many abort notices a backend keeps (the first ones; later ones are counted only).
const ABORTS_KEPT: usize = 64;
/// What a queued message costs the unexpected-message budget beyond its payload (its entry).
const QUEUED_OVERHEAD: usize = 64;
/// How often a reader that holds a message back for flow control rechecks on its own (it is
/// woken whenever a receive is posted or a queued message taken; this only bounds a lost wake).
const HOLD_RECHECK: Duration = Duration::from_millis(500);

/// What a peer may make this rank hold: the largest frame accepted, and the bytes of messages
/// that arrived before their receive that are kept per peer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// A data frame longer than this is a protocol error.
    pub(crate) max_message: u64,
    /// Bytes of unexpected messages queued per peer before the reader stops reading the socket.
    pub(crate) unexpected: usize,
}

/// Messages at least this long wait up to [`GRACE`] for a receive before being queued.
const GRACE_MIN_LEN: usize = 64 << 10;
/// How long a large message waits for its receive to be posted.
const GRACE: Duration = Duration::from_millis(5);

/// How often the reader thread drains a connection that nobody is waiting on.
const IDLE_DRAIN: Duration = Duration::from_millis(20);

/// How long a receiver spins for its message before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// A message that arrived before anyone asked for it.
struct Queued {
    data: Vec<u8>,
    meta: Meta,
    /// Whether it counts against the peer's unexpected-message budget (it came off the socket).
    counted: bool,
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
    /// A payload is being written into the buffer (under the read-side lock).
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
    /// The reader thread is blocked on `reader_cond`.
    reader_sleeping: bool,
    /// ... and it is holding a large message back for a receive to be posted.
    reader_holding: bool,
    /// The backend is being dropped and waits for the peer to close its side.
    closing: bool,
    /// Bytes (plus [`QUEUED_OVERHEAD`] each) of queued messages that came off the socket.
    queued_bytes: usize,
    /// Counts posts and takes from the queue: a reader holding a frame back rechecks when it moves.
    events: u64,
}

impl State {
    fn new() -> State {
        State {
            closed: None,
            posted: VecDeque::new(),
            queued: HashMap::new(),
            next_id: 0,
            sleepers: 0,
            reader_sleeping: false,
            reader_holding: false,
            closing: false,
            queued_bytes: 0,
            events: 0,
        }
    }
}

// SAFETY: `Posted::ptr` is the only non-`Send` field. It points into a buffer that the receiving
// thread borrows mutably for as long as the entry is in `posted`; that thread removes the entry
// before it returns, and never while it is `Filling` (a fill ends, or the connection is shut and
// the fill dropped, under the read-side lock first). Only the holder of the read-side lock writes
// through the pointer. So moving `State` between threads (inside its mutex) never lets the
// pointer outlive or alias its buffer.
unsafe impl Send for State {}

/// Where the read side is in the byte stream.
enum Frame {
    /// Between frames.
    Header,
    /// A payload landing in the posted buffer of receive `id`.
    Fill {
        id: u64,
        ptr: *mut u8,
        len: usize,
        done: usize,
        meta: Meta,
    },
    /// A payload nobody waits for (yet), read into fresh memory.
    Queue {
        tag: u64,
        data: Vec<u8>,
        done: usize,
        meta: Meta,
    },
    /// An abort notice's text (the first 64 KiB of it).
    Abort {
        tag: u64,
        text: Vec<u8>,
        left: usize,
    },
    /// A large payload nobody waits for yet, left in the socket until a receive is posted for it
    /// or `until` passes (then it is queued); with no `until`, until a receive is posted or the
    /// queue has room for it (flow control).
    Held {
        header: FrameHeader,
        until: Option<Instant>,
        /// [`State::events`] when it was routed.
        seen: u64,
    },
    /// A payload read and dropped: nobody will receive it (the backend is closing).
    Skip { left: u64 },
}

/// The read side of a connection: a 64 KiB buffer in front of the socket, and the frame in
/// progress. Every read is non-blocking, so the lock around it is only ever held briefly.
struct Rx {
    sock: socket2::Socket,
    buf: Box<[u8]>,
    lo: usize,
    hi: usize,
    frame: Frame,
    dead: bool,
}

// SAFETY: `Frame::Fill::ptr` is the only non-`Send` field; see `State`'s impl. It is written
// through only while this struct's mutex is held and the receive is `Filling`.
unsafe impl Send for Rx {}

/// What a call to [`Peer::progress`] ended with.
enum Step {
    /// Some bytes were consumed.
    Progress,
    /// Nothing to read now.
    Idle,
    /// A frame waits for its receive to be posted, at most until then (if given), or until
    /// [`State::events`] moves past the count given.
    Held(Option<Instant>, u64),
    /// The connection ended.
    Closed(String),
}

const RX_BUF: usize = 64 << 10;

fn would_block(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

/// Receives into `dst` without blocking.
fn recv_now(sock: &socket2::Socket, dst: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and `recv` only writes initialised bytes
    // into the slice, so viewing initialised memory as maybe-uninitialised is sound.
    let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
    loop {
        match sock.recv_with_flags(dst, MSG_DONTWAIT) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

impl Rx {
    /// Reads more of the stream into the buffer; `Ok(0)` at its end.
    fn read_more(&mut self) -> std::io::Result<usize> {
        if self.lo == self.hi {
            (self.lo, self.hi) = (0, 0);
        } else if self.hi == self.buf.len() {
            self.buf.copy_within(self.lo..self.hi, 0);
            (self.lo, self.hi) = (0, self.hi - self.lo);
        }
        let n = recv_now(&self.sock, &mut self.buf[self.hi..])?;
        self.hi += n;
        Ok(n)
    }
}

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
    /// Records `n`. Only the first [`ABORTS_KEPT`] are kept: a peer flooding abort frames
    /// cannot grow this list.
    pub(crate) fn raise(&self, n: AbortNotice) {
        let mut v = self.notices.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < ABORTS_KEPT {
            v.push(n);
        }
        drop(v);
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
    /// Receivers sleep on this one.
    cond: Condvar,
    /// The reader thread sleeps on this one, so that delivering a message wakes no one else.
    reader_cond: Condvar,
    /// The read side, shared by the reader thread and spinning receivers; `None` for loopback.
    rx: Option<Mutex<Rx>>,
    /// Receivers spinning on this peer right now; the reader thread stands back meanwhile.
    spinners: AtomicUsize,
    aborts: Arc<Aborts>,
    on_abort: OnceLock<AbortSink>,
    limits: Limits,
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
    while !bufs.is_empty() {
        match sock.send_vectored_with_flags(bufs, MSG_NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Peer {
    /// A peer over `stream`, whose handshake is done.
    pub(crate) fn connected(
        me: usize,
        rank: usize,
        stream: TcpStream,
        timeout: Duration,
        aborts: Arc<Aborts>,
        limits: Limits,
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
        crate::sys::prepare(&sock).map_err(|e| io("prepare socket", e))?;
        let r = stream.try_clone().map_err(|e| io("clone socket", e))?;
        Ok(Peer {
            me,
            rank,
            writer: Some(Mutex::new(Writer { sock, broken: None })),
            rx: Some(Mutex::new(Rx {
                sock: socket2::Socket::from(r),
                buf: vec![0u8; RX_BUF].into_boxed_slice(),
                lo: 0,
                hi: 0,
                frame: Frame::Header,
                dead: false,
            })),
            spinners: AtomicUsize::new(0),
            on_abort: OnceLock::new(),
            stream: Some(stream),
            state: Mutex::new(State::new()),
            cond: Condvar::new(),
            reader_cond: Condvar::new(),
            aborts,
            limits,
        })
    }

    /// The peer that is this rank itself: sends are copied to its own queue.
    pub(crate) fn loopback(me: usize, aborts: Arc<Aborts>) -> Peer {
        Peer {
            me,
            rank: me,
            writer: None,
            rx: None,
            spinners: AtomicUsize::new(0),
            on_abort: OnceLock::new(),
            stream: None,
            state: Mutex::new(State::new()),
            cond: Condvar::new(),
            reader_cond: Condvar::new(),
            aborts,
            // Loopback messages are copies of this rank's own sends: no wire, no budget.
            limits: Limits {
                max_message: u64::MAX,
                unexpected: usize::MAX,
            },
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

    /// Blocks the reader thread (at most `limit`) until [`Peer::wake_reader`].
    fn reader_sleep<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        limit: Duration,
        holding: bool,
    ) -> MutexGuard<'a, State> {
        st.reader_sleeping = true;
        st.reader_holding = holding;
        let mut st = self
            .reader_cond
            .wait_timeout(st, limit)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        st.reader_sleeping = false;
        st.reader_holding = false;
        st
    }

    fn wake_reader_if_holding(&self, st: &State) {
        if st.reader_holding {
            self.reader_cond.notify_one();
        }
    }

    fn wake_reader(&self, st: &State) {
        if st.reader_sleeping {
            self.reader_cond.notify_one();
        }
    }

    /// Wakes the receivers blocked on the condition variable, if any.
    fn notify(&self, st: &State) {
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
        write_all_vectored(&w.sock, &mut bufs).map_err(|e| self.send_failed(&mut w, e, started, op))
    }

    /// Sends a data frame while receive `id` on `src` is pending, from this one thread: the
    /// socket is written without blocking and, whenever it is full, `src`'s socket is read, so
    /// that neither direction waits on a thread switch. If neither moves for a spin period the
    /// thread stops spinning: the reader thread takes the receive and the send blocks.
    pub(crate) fn send_while_receiving(
        &self,
        tag: u64,
        data: &[u8],
        meta: Meta,
        op: &dyn Fn() -> String,
        src: &Peer,
        id: u64,
    ) -> Result<()> {
        let (Some(writer), Some(rx)) = (&self.writer, &src.rx) else {
            return self.send(FrameKind::Data, tag, data, meta, op);
        };
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        let header = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
        let mut bufs = &mut bufs[..];
        let started = Instant::now();
        let spin = spin_time();
        src.spinners.fetch_add(1, Ordering::AcqRel);
        let mut spinning = true;
        let mut idle_since: Option<Instant> = None;
        let mut received = false;
        let r = loop {
            if bufs.is_empty() {
                break Ok(());
            }
            let mut moved = false;
            match w
                .sock
                .send_vectored_with_flags(bufs, MSG_NOSIGNAL | MSG_DONTWAIT)
            {
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    moved = true;
                }
                Err(e) if would_block(&e) || e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
            if !received && let Ok(mut r) = rx.try_lock() {
                match src.progress(&mut r) {
                    Step::Progress => moved = true,
                    Step::Closed(cause) => src.shut(&mut r, cause),
                    Step::Idle | Step::Held(..) => {}
                }
                drop(r);
                received = src
                    .lock()
                    .posted
                    .iter()
                    .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
            }
            if moved {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now - *idle_since.get_or_insert(now) > spin {
                // Stop spinning: the reader thread takes the receive, and this thread blocks
                // on the send (within the socket's send timeout).
                src.spinners.fetch_sub(1, Ordering::AcqRel);
                spinning = false;
                src.wake_reader(&src.lock());
                break write_all_vectored(&w.sock, bufs);
            }
            std::thread::yield_now();
        };
        if spinning {
            src.spinners.fetch_sub(1, Ordering::AcqRel);
        }
        r.map_err(|e| self.send_failed(&mut w, e, started, op))
    }

    /// A send failed part-way: a frame may be half written, so the stream is no longer in step
    /// with the reader on the other side. Close it; both sides then see the peer as gone.
    fn send_failed(
        &self,
        w: &mut Writer,
        e: std::io::Error,
        started: Instant,
        op: &dyn Fn() -> String,
    ) -> DistError {
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
            DistError::Timeout {
                rank: self.me,
                op: op(),
                peer: self.rank,
                waited: started.elapsed(),
            }
        } else {
            self.gone(op(), cause)
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
        self.offer(tag, Payload::Borrowed(data), meta, false);
        Ok(())
    }

    /// Hands a complete message to the first open receive on `tag` (copying it into the posted
    /// buffer), or queues it. A receive whose buffer has another size is told so, and the
    /// message stays queued for a receive with the right size.
    /// `counted`: the message came off the socket, and its bytes were taken from the budget.
    fn offer(&self, tag: u64, data: Payload<'_>, meta: Meta, counted: bool) {
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
                if counted {
                    st.queued_bytes -= bytes.len() + QUEUED_OVERHEAD;
                }
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
            st.queued.entry(tag).or_default().push_back(Queued {
                data,
                meta,
                counted,
            });
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
        self.recv_overlapped(buf, tag, deadline, op, false, |_| Ok(()))
    }

    /// Posts a receive of `buf`, runs `during` (a send, typically), then waits for the receive.
    /// The payload can land in `buf` while `during` runs; when `during` may block for a while
    /// (`long`: a large send), the reader thread is woken to take it meanwhile. If `during`
    /// fails, its error is returned once the receive has been withdrawn.
    pub(crate) fn recv_overlapped(
        &self,
        buf: &mut [u8],
        tag: u64,
        deadline: Instant,
        op: &dyn Fn() -> String,
        long: bool,
        during: impl FnOnce(Option<u64>) -> Result<()>,
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
                if m.counted {
                    // Room in the budget: a reader holding a frame back for it may go on.
                    st.queued_bytes -= m.data.len() + QUEUED_OVERHEAD;
                    st.events += 1;
                    self.wake_reader_if_holding(&st);
                }
                Ok(m.meta)
            };
            drop(st);
            during(None)?;
            return r;
        }
        if let Some(cause) = &st.closed {
            let e = self.gone(op(), cause.clone());
            drop(st);
            during(None)?;
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
        st.events += 1;
        // The reader may be holding a large message back for a receive like this one; or we are
        // about to be busy sending, and it must take the message as it comes.
        if st.reader_holding || long {
            self.wake_reader(&st);
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
        during(Some(id))?;
        let r = self.wait(id, tag, len, started, deadline, op);
        // `wait` returned, and it removes the entry on every return: the reader can no longer
        // reach `buf`. Had it unwound instead, the armed guard withdraws the receive.
        guard.armed = false;
        r
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
        #[cfg(test)]
        if tests::PANIC_IN_WAIT.with(|p| p.replace(false)) {
            panic!("injected: a panic inside a receive's wait");
        }
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
            if !spun && self.rx.is_some() {
                // Spin briefly before sleeping, reading the socket ourselves: a message that
                // comes within microseconds then lands with no thread switch at all.
                spun = true;
                drop(st);
                let until = Instant::now()
                    .checked_add(spin_time())
                    .map_or(deadline, |t| deadline.min(t));
                self.spin(id, until);
                st = self.lock();
                let done = st
                    .posted
                    .iter()
                    .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
                if !done {
                    // About to sleep: the reader thread must now watch the socket for us.
                    self.wake_reader(&st);
                }
                continue;
            }
            let now = Instant::now();
            if !timed_out && now >= deadline {
                if open {
                    st.posted.remove(i);
                    return Err(self.timeout(op(), started));
                }
                timed_out = true;
                // The peer stalled in the middle of a payload that is landing in our buffer.
                // We may not return while it can still be written: cut the connection, which
                // ends the fill, under the read-side lock, before we go on.
                drop(st);
                self.cut("the peer stalled mid-message past a receiver's deadline");
                st = self.lock();
                continue;
            }
            st = self.sleep(
                st,
                (!timed_out).then(|| deadline.saturating_duration_since(now)),
            );
        }
    }

    /// Reads the socket from this thread until receive `id` is done or `until` passes, as long
    /// as nobody else is reading it at that moment.
    fn spin(&self, id: u64, until: Instant) {
        let Some(rx) = &self.rx else { return };
        self.spinners.fetch_add(1, Ordering::AcqRel);
        loop {
            if let Ok(mut r) = rx.try_lock()
                && let Step::Closed(cause) = self.progress(&mut r)
            {
                self.shut(&mut r, cause);
            }
            let done = self
                .lock()
                .posted
                .iter()
                .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
            if done || Instant::now() >= until {
                break;
            }
            std::thread::yield_now();
        }
        self.spinners.fetch_sub(1, Ordering::AcqRel);
    }

    /// Ends the connection: no more bytes are read, every waiting receive fails with `cause`.
    /// Called with the read side locked, so that no fill is in progress once it returns.
    fn shut(&self, rx: &mut Rx, cause: String) {
        if !rx.dead {
            rx.dead = true;
            rx.frame = Frame::Header;
            let _ = rx.sock.shutdown(Shutdown::Both);
            tracing::debug!(rank = self.me, peer = self.rank, %cause, "connection ended");
        }
        self.close(cause);
    }

    /// Cuts the connection from a receiver's thread.
    fn cut(&self, cause: &str) {
        tracing::warn!(
            rank = self.me,
            peer = self.rank,
            "{cause}; closing the connection"
        );
        if let Some(rx) = &self.rx {
            let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
            self.shut(&mut r, cause.to_string());
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
                drop(st);
                self.cut("a receive was withdrawn while its message was arriving too slowly");
                st = self.lock();
                continue;
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
        self.cond.notify_all();
        self.wake_reader(&st);
    }

    /// Waits until the reader has seen the connection end, or `deadline`. True if it has.
    pub(crate) fn wait_closed(&self, deadline: Instant) -> bool {
        if self.stream.is_none() {
            return true;
        }
        let mut st = self.lock();
        st.closing = true;
        self.wake_reader(&st);
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
        // Callers hold the read-side lock with the connection shut, or there is none
        // (loopback): no fill is in progress, so `Filling` entries end here too.
        for p in st.posted.iter_mut() {
            if matches!(p.slot, Slot::Open | Slot::Filling) {
                p.slot = Slot::Done(Outcome::Gone(cause.clone()));
            }
        }
        self.notify(&st);
        self.wake_reader(&st);
    }

    /// Shuts the socket down in both directions (on drop, or to break a hung connection).
    pub(crate) fn shutdown(&self, how: Shutdown) {
        if let Some(s) = &self.stream {
            let _ = s.shutdown(how);
        }
    }

    /// Sets the hook that hears of abort frames.
    pub(crate) fn set_abort_sink(&self, sink: AbortSink) {
        let _ = self.on_abort.set(sink);
    }

    /// The reader thread's body, until the connection ends. While a receiver sleeps waiting on
    /// this peer, or a frame is half read, it blocks until bytes arrive and moves them along.
    /// Otherwise it stays off the socket, so that a spinning receiver reads its message itself
    /// with no thread switch, and only drains the socket every [`IDLE_DRAIN`] (unexpected
    /// messages must not fill the sender's buffers while nobody receives).
    pub(crate) fn read_loop(&self, probe: TcpStream) {
        let Some(rx) = &self.rx else { return };
        let mut held: Option<(Option<Instant>, u64)> = None;
        let mut mid_frame = false;
        loop {
            let watch = {
                let mut st = self.lock();
                loop {
                    if st.closed.is_some() {
                        return;
                    }
                    if let Some((until, seen)) = held.take() {
                        // A message waits for its receive (or, for flow control, for room in
                        // the queue): a post or a take moves it on, as does the grace period
                        // ending. Events since it was routed are rechecked at once.
                        let limit = until.map_or(HOLD_RECHECK, |u| {
                            u.saturating_duration_since(Instant::now())
                        });
                        if !st.closing && st.events == seen && !limit.is_zero() {
                            st = self.reader_sleep(st, limit, true);
                        }
                        if st.closed.is_some() {
                            return;
                        }
                        break false;
                    }
                    let sleeping = st.posted.iter().any(|p| !matches!(p.slot, Slot::Done(_)));
                    let spinning = self.spinners.load(Ordering::Acquire) > 0;
                    if st.closing || ((sleeping || mid_frame) && !spinning) {
                        break true;
                    }
                    st = self.reader_sleep(st, IDLE_DRAIN, false);
                    if st.closed.is_none() {
                        break false;
                    }
                }
            };
            if watch {
                // Block until bytes (or the end of the stream) arrive, without taking them.
                let _ = probe.peek(&mut [0u8; 1]);
            }
            let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
            match self.progress(&mut r) {
                Step::Closed(cause) => {
                    self.shut(&mut r, cause);
                    return;
                }
                Step::Held(until, seen) => held = Some((until, seen)),
                Step::Progress | Step::Idle => {}
            }
            mid_frame = !matches!(r.frame, Frame::Header);
        }
    }

    /// Reads whatever has arrived, without blocking, and moves frames along: into posted
    /// buffers, into the queue, or to the abort hook.
    fn progress(&self, rx: &mut Rx) -> Step {
        if rx.dead {
            return Step::Closed("connection closed".into());
        }
        let mut moved = false;
        let io_end = |e: std::io::Error, moved: bool| {
            if would_block(&e) {
                if moved { Step::Progress } else { Step::Idle }
            } else {
                Step::Closed(describe(&e))
            }
        };
        loop {
            match &mut rx.frame {
                Frame::Header => {
                    while rx.hi - rx.lo < FRAME_HEADER_LEN {
                        match rx.read_more() {
                            Ok(0) if rx.hi == rx.lo => {
                                return Step::Closed("connection closed by peer".into());
                            }
                            Ok(0) => {
                                return Step::Closed(format!(
                                    "connection closed in a frame header ({} of {FRAME_HEADER_LEN} bytes)",
                                    rx.hi - rx.lo
                                ));
                            }
                            Ok(_) => moved = true,
                            Err(e) => return io_end(e, moved),
                        }
                    }
                    let raw: [u8; FRAME_HEADER_LEN] = rx.buf[rx.lo..rx.lo + FRAME_HEADER_LEN]
                        .try_into()
                        .expect("a header's worth of bytes");
                    rx.lo += FRAME_HEADER_LEN;
                    moved = true;
                    let (h, len) = match self.check_header(&raw) {
                        Ok(x) => x,
                        Err(cause) => return Step::Closed(cause),
                    };
                    rx.frame = match h.kind {
                        FrameKind::Abort => Frame::Abort {
                            tag: h.tag,
                            text: Vec::with_capacity(len),
                            left: len,
                        },
                        FrameKind::Data => self.route(h, len, None),
                    };
                    if let Frame::Held { until, seen, .. } = rx.frame {
                        return Step::Held(until, seen);
                    }
                }
                Frame::Held { header, until, .. } => {
                    let (h, until) = (*header, *until);
                    // Checked against `usize` when the header was read.
                    let len = h.len as usize;
                    rx.frame = self.route(h, len, Some(until));
                    if let Frame::Held { until, seen, .. } = rx.frame {
                        return Step::Held(until, seen);
                    }
                }
                Frame::Skip { left } => {
                    if *left > 0 {
                        let mut scratch = [0u8; 4096];
                        let k = (*left).min(scratch.len() as u64) as usize;
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut scratch[..k],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *left -= n as u64;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    rx.frame = Frame::Header;
                }
                Frame::Fill {
                    id,
                    ptr,
                    len,
                    done,
                    meta,
                } => {
                    if *done < *len {
                        // SAFETY: receive `id` is `Filling` and we hold the read-side lock: its
                        // owner cannot release the buffer before the fill ends (see `State`), and
                        // `len` is the buffer's length.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(ptr.add(*done), *len - *done) };
                        match rx_pull(&mut rx.sock, &mut rx.buf, &mut rx.lo, &mut rx.hi, dst) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *done += n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let (id, meta) = (*id, *meta);
                    let mut st = self.lock();
                    if let Some(p) = st.posted.iter_mut().find(|p| p.id == id) {
                        p.slot = Slot::Done(Outcome::Delivered(meta));
                    }
                    self.notify(&st);
                    drop(st);
                    rx.frame = Frame::Header;
                }
                Frame::Queue {
                    tag,
                    data,
                    done,
                    meta,
                } => {
                    if *done < data.len() {
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut data[*done..],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *done += n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let (tag, meta) = (*tag, *meta);
                    let data = std::mem::take(data);
                    rx.frame = Frame::Header;
                    self.offer(tag, Payload::Owned(data), meta, true);
                }
                Frame::Abort { tag, text, left } => {
                    if *left > 0 {
                        let mut scratch = [0u8; 4096];
                        let k = (*left).min(scratch.len());
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut scratch[..k],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                text.extend_from_slice(&scratch[..n]);
                                *left -= n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let notice = AbortNotice {
                        from: self.rank,
                        tag: Tag::from_wire(*tag),
                        reason: String::from_utf8_lossy(text).into_owned(),
                    };
                    rx.frame = Frame::Header;
                    match self.on_abort.get() {
                        Some(sink) => sink(notice),
                        None => self.aborts.raise(notice),
                    }
                }
            }
        }
    }

    /// Decides where a data frame's payload goes: the first open receive on its tag with a
    /// buffer of its size, else the queue. A large message that nobody waits for yet is held
    /// in the socket for a moment first: streaming receivers post their next buffer just after
    /// the last one filled, and the payload then lands in place instead of in fresh memory.
    ///
    /// Flow control: a message queues only while the peer's queued bytes stay within
    /// [`Limits::unexpected`]; otherwise it stays in the socket (so TCP slows the sender) until
    /// a receive is posted for it or the queue drains. A message larger than the whole budget
    /// is never queued: it waits for its receive and lands straight in the posted buffer.
    /// `held` is `None` for a frame just read; `Some(until)` for one held back already: until
    /// the grace period's end, or `Some(None)` once held for flow control.
    fn route(&self, h: FrameHeader, len: usize, held: Option<Option<Instant>>) -> Frame {
        let mut st = self.lock();
        let unexpected = self.limits.unexpected;
        let st = &mut *st;
        let open = st
            .posted
            .iter_mut()
            .find(|p| p.tag == h.tag && matches!(p.slot, Slot::Open));
        let cost = len.saturating_add(QUEUED_OVERHEAD);
        let fits = st
            .queued_bytes
            .checked_add(cost)
            .is_some_and(|b| b <= unexpected);
        match open {
            Some(p) if p.len == len => {
                p.slot = Slot::Filling;
                return Frame::Fill {
                    id: p.id,
                    ptr: p.ptr,
                    len,
                    done: 0,
                    meta: h.meta,
                };
            }
            // A receive of another size is told so: when the message has been queued, or now,
            // if it cannot be queued.
            Some(p) if !fits && !st.closing => {
                p.slot = Slot::Done(Outcome::Mismatch(len));
                self.notify(st);
                return Frame::Held {
                    header: h,
                    until: None,
                    seen: st.events,
                };
            }
            None if st.closing => return Frame::Skip { left: h.len },
            None if len >= GRACE_MIN_LEN => {
                // `Instant + 5 ms` cannot overflow in practice; if it did, the grace is skipped.
                let until = match held {
                    None => Instant::now().checked_add(GRACE),
                    Some(until) => until,
                };
                if let Some(until) = until.filter(|u| Instant::now() < *u) {
                    return Frame::Held {
                        header: h,
                        until: Some(until),
                        seen: st.events,
                    };
                }
            }
            _ => {}
        }
        if !fits {
            if st.closing {
                return Frame::Skip { left: h.len };
            }
            return Frame::Held {
                header: h,
                until: None,
                seen: st.events,
            };
        }
        st.queued_bytes = st.queued_bytes.saturating_add(cost);
        Frame::Queue {
            tag: h.tag,
            data: vec![0u8; len],
            done: 0,
            meta: h.meta,
        }
    }

    /// Decodes and checks a frame header from this peer: a known kind, no reserved flags, and
    /// a length within [`Limits::max_message`] (data) or [`ABORT_MAX`] (abort notices).
    /// Returns it with its length, or the protocol error that ends the connection.
    fn check_header(
        &self,
        raw: &[u8; FRAME_HEADER_LEN],
    ) -> std::result::Result<(FrameHeader, usize), String> {
        let h = FrameHeader::decode(raw)
            .map_err(|e| format!("protocol error from peer {}: {e}", self.rank))?;
        let max = match h.kind {
            FrameKind::Data => self.limits.max_message,
            FrameKind::Abort => ABORT_MAX as u64,
        };
        match usize::try_from(h.len) {
            Ok(len) if h.len <= max => Ok((h, len)),
            _ => Err(format!(
                "protocol error from peer {}: {:?} frame of {} bytes on tag {} exceeds the limit of {max} bytes",
                self.rank, h.kind, h.len, h.tag
            )),
        }
    }
}

/// [`Rx::pull`] on the fields of a borrowed `Rx` (so that the frame can be borrowed beside it).
fn rx_pull(
    sock: &mut socket2::Socket,
    buf: &mut [u8],
    lo: &mut usize,
    hi: &mut usize,
    dst: &mut [u8],
) -> std::io::Result<usize> {
    if *lo == *hi {
        (*lo, *hi) = (0, 0);
        if dst.len() >= buf.len() / 2 {
            return recv_now(sock, dst);
        }
        let n = recv_now(sock, buf)?;
        if n == 0 {
            return Ok(0);
        }
        *hi = n;
    }
    let n = dst.len().min(*hi - *lo);
    dst[..n].copy_from_slice(&buf[*lo..*lo + n]);
    *lo += n;
    Ok(n)
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

fn spin_time() -> Duration {
    static S: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("DIST_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros)
            .unwrap_or(SPIN)
    })
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::io::Write;
    use std::net::TcpListener;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::thread::JoinHandle;

    use super::*;

    thread_local! {
        /// Set by a test: the next receive's wait on this thread panics as it starts.
        pub(super) static PANIC_IN_WAIT: Cell<bool> = const { Cell::new(false) };
    }

    const RANK: usize = 1;

    /// A peer (rank 1 as seen from rank 0) over loopback TCP with its reader thread running,
    /// and the raw other end, on which a test writes whatever bytes it likes.
    struct Pair {
        peer: Arc<Peer>,
        raw: TcpStream,
        reader: Option<JoinHandle<()>>,
    }

    impl Pair {
        fn new(limits: Limits) -> Pair {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, _) = l.accept().unwrap();
            let peer = Arc::new(
                Peer::connected(
                    0,
                    RANK,
                    s,
                    Duration::from_secs(10),
                    Arc::new(Aborts::default()),
                    limits,
                )
                .unwrap(),
            );
            let probe = peer.reader_stream().unwrap().unwrap();
            let p = peer.clone();
            let reader = Some(std::thread::spawn(move || p.read_loop(probe)));
            Pair { peer, raw, reader }
        }

        fn frame(&mut self, kind: u32, tag: u64, len: u64, payload: &[u8]) {
            let mut h = FrameHeader {
                kind: FrameKind::Data,
                tag,
                len,
                meta: [tag as u8; 16],
            }
            .encode();
            h[..4].copy_from_slice(&kind.to_le_bytes());
            self.raw.write_all(&h).unwrap();
            self.raw.write_all(payload).unwrap();
        }

        fn recv(&self, buf: &mut [u8], tag: u64) -> Result<Meta> {
            let deadline = Instant::now() + Duration::from_secs(10);
            self.peer
                .recv(buf, tag, deadline, &|| format!("recv tag {tag}"))
        }

        fn queued_bytes(&self) -> usize {
            self.peer.lock().queued_bytes
        }
    }

    impl Drop for Pair {
        fn drop(&mut self) {
            let _ = self.raw.shutdown(Shutdown::Both);
            self.peer.shutdown(Shutdown::Both);
            if let Some(r) = self.reader.take() {
                r.join().unwrap();
            }
        }
    }

    fn limits(max_message: u64, unexpected: usize) -> Limits {
        Limits {
            max_message,
            unexpected,
        }
    }

    /// Issue 10 point 8. Fails before the fix: the guard was disarmed before the wait, so the
    /// receive stayed posted after the panic and the reader wrote the message into `buf`,
    /// whose borrow had ended (here a live `Vec`, so the write is visible, not a crash).
    #[test]
    fn a_receive_whose_wait_unwinds_is_withdrawn() {
        let mut pair = Pair::new(limits(1 << 30, 1 << 20));
        let mut buf = vec![0u8; 8];
        let r = catch_unwind(AssertUnwindSafe(|| {
            PANIC_IN_WAIT.with(|p| p.set(true));
            pair.recv(&mut buf, 7)
        }));
        assert!(r.is_err(), "the injected panic unwound out of recv");
        pair.frame(1, 7, 8, &[9; 8]);
        // The message must now be queued, not written into `buf`.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pair.peer.peek(7).is_none() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(buf, [0; 8], "the reader wrote into a withdrawn buffer");
        assert_eq!(pair.peer.peek(7), Some((8, [7; 16])));
        let mut again = [0u8; 8];
        assert_eq!(pair.recv(&mut again, 7).unwrap(), [7; 16]);
        assert_eq!(again, [9; 8]);
    }

    /// A receive's `during` that panics also withdraws it (this held before the fix too).
    #[test]
    fn a_receive_whose_send_unwinds_is_withdrawn() {
        let mut pair = Pair::new(limits(1 << 30, 1 << 20));
        let mut buf = vec![0u8; 8];
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pair.peer
                .recv_overlapped(&mut buf, 7, deadline, &|| "op".into(), false, |_| {
                    panic!("injected: a panic in the send beside a receive")
                })
        }));
        assert!(r.is_err());
        pair.frame(1, 7, 8, &[9; 8]);
        while pair.peer.peek(7).is_none() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(buf, [0; 8]);
        assert_eq!(pair.peer.peek(7), Some((8, [7; 16])));
    }

    /// What a receive from a peer that sent `bytes` fails with.
    fn after(bytes: &[u8], max_message: u64) -> DistError {
        let mut pair = Pair::new(limits(max_message, 1 << 20));
        pair.raw.write_all(bytes).unwrap();
        pair.raw.shutdown(Shutdown::Write).unwrap();
        let mut buf = [0u8; 4];
        pair.recv(&mut buf, 3).unwrap_err()
    }

    fn header(kind: u32, len: u64) -> Vec<u8> {
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            tag: 3,
            len,
            meta: [0; 16],
        }
        .encode();
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h.to_vec()
    }

    fn gone_cause(e: DistError) -> String {
        match e {
            DistError::PeerGone {
                rank, peer, cause, ..
            } => {
                assert_eq!((rank, peer), (0, RANK));
                cause
            }
            e => panic!("expected PeerGone, got {e}"),
        }
    }

    /// Issue 10 point 9. Fails before the fix: a 2^47-byte frame was queued with
    /// `vec![0; 2^47]`, which aborts the process (allocation failure), and 2^63 the same.
    #[test]
    fn frames_over_the_cap_are_protocol_errors_naming_the_peer() {
        for len in [1u64 << 47, 1 << 63, u64::MAX, (1 << 20) + 1] {
            let cause = gone_cause(after(&header(1, len), 1 << 20));
            assert!(cause.contains("protocol error from peer 1"), "{cause}");
            assert!(cause.contains(&format!("{len} bytes")), "{cause}");
            assert!(cause.contains("limit of 1048576 bytes"), "{cause}");
        }
        // An abort notice longer than 64 KiB is refused as well.
        let cause = gone_cause(after(&header(2, 1 << 20), 1 << 30));
        assert!(cause.contains("Abort frame of 1048576 bytes"), "{cause}");
    }

    #[test]
    fn unknown_kinds_and_truncated_frames_close_the_connection() {
        let cause = gone_cause(after(&header(9, 4), 1 << 20));
        assert!(
            cause.contains("protocol error from peer 1: unknown frame kind 9"),
            "{cause}"
        );
        let cause = gone_cause(after(&header(1, 4)[..17], 1 << 20));
        assert!(cause.contains("frame header (17 of 40 bytes)"), "{cause}");
        let mut cut = header(1, 4);
        cut.extend_from_slice(&[1, 2]);
        let cause = gone_cause(after(&cut, 1 << 20));
        assert!(cause.contains("closed mid-message"), "{cause}");
    }

    /// Issue 10 point 10, in one process. Fails before the fix: every unexpected message was
    /// queued (`queued_bytes` had no bound; here it reached 16 MiB), and a message larger than
    /// the bound was queued whole.
    #[test]
    fn unexpected_messages_are_bounded_and_larger_ones_still_arrive() {
        const LIMIT: usize = 1 << 20;
        const PIECE: usize = 64 << 10;
        const COUNT: usize = 256;
        let mut pair = Pair::new(limits(1 << 30, LIMIT));
        let mut raw = pair.raw.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            // One message larger than the whole budget, then many small ones.
            let big: Vec<u8> = (0..4 * LIMIT).map(|i| (i % 251) as u8).collect();
            let mut h = FrameHeader {
                kind: FrameKind::Data,
                tag: 5,
                len: big.len() as u64,
                meta: [5; 16],
            };
            raw.write_all(&h.encode()).unwrap();
            raw.write_all(&big).unwrap();
            h.tag = 6;
            h.len = PIECE as u64;
            for k in 0..COUNT {
                raw.write_all(&h.encode()).unwrap();
                raw.write_all(&vec![k as u8; PIECE]).unwrap();
            }
        });
        // Let the reader run into the bound while nothing is posted: the writer blocks.
        std::thread::sleep(Duration::from_millis(300));
        assert!(pair.queued_bytes() <= LIMIT, "{}", pair.queued_bytes());
        let mut big = vec![0u8; 4 * LIMIT];
        pair.recv(&mut big, 5).unwrap();
        assert!(big.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        let mut buf = vec![0u8; PIECE];
        let mut peak = 0;
        for k in 0..COUNT {
            peak = peak.max(pair.queued_bytes());
            pair.recv(&mut buf, 6).unwrap();
            assert!(buf.iter().all(|b| *b == k as u8), "message {k}");
        }
        assert!(peak <= LIMIT, "{peak}");
        writer.join().unwrap();
        pair.frame(1, 6, 0, &[]);
    }
}

//! One peer's connection after the handshake: the writer (callers' threads write frames directly,
//! one at a time), the read side (frames are read without blocking, by the peer's reader thread
//! or by a receiver spinning for its message, and each payload lands in the buffer a receiver
//! has posted, or in the queue), and the matching of messages to receivers by tag.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use dist_core::{DistError, Meta, Result, Tag};

use crate::sys::{MSG_DONTWAIT, MSG_NOSIGNAL};
use crate::wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind};

mod aborts;
mod live;
pub(crate) use live::{Beat, Whereabouts};
#[cfg(test)]
mod props;
mod reader;
mod rx;
mod slots;
#[cfg(test)]
mod tests;
mod writer;

pub use aborts::AbortNotice;
pub(crate) use aborts::{AbortSink, Aborts};
use rx::*;
use slots::*;
use writer::*;

/// The longest abort notice a peer may send (its error text); a longer one is a protocol error.
pub(crate) const ABORT_MAX: usize = 64 << 10;
/// How many abort notices a backend keeps (the first ones; later ones are counted only).
const ABORTS_KEPT: usize = 64;
/// What a queued message costs the unexpected-message budget beyond its payload. A message on a
/// fresh tag costs about this much memory besides its bytes: the `Queued` entry (40 B) in a
/// `VecDeque` that allocates room for 4 on its first push (160 B), the map's bucket (tag + deque,
/// 40 B, more with the load factor), and the allocator's minimum chunk and header on the payload
/// and the deque (16-32 B each). Charging less let a peer that sends 1-byte messages on distinct
/// tags hold several times the budget.
const QUEUED_OVERHEAD: usize = 256;
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
/// The longest spin `DIST_SPIN_US` may ask for (10 ms); more is a configuration error.
pub(crate) const SPIN_MAX_US: u32 = 10_000;

/// Counts a spinner in [`Peer::spinners`] while it lives, so that a panic cannot leave it counted
/// (the reader thread would then stand back for good).
struct Spinning<'a>(&'a AtomicUsize);

impl<'a> Spinning<'a> {
    fn new(n: &'a AtomicUsize) -> Spinning<'a> {
        n.fetch_add(1, Ordering::AcqRel);
        Spinning(n)
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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

/// One peer: its socket halves, and the messages and receives waiting on it.
pub(crate) struct Peer {
    pub(crate) me: usize,
    pub(crate) rank: usize,
    /// The writing half; `None` for the loopback peer (this rank itself).
    writer: Option<WriterLock>,
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
    /// Hears, from the reader thread, that the connection has ended (with why).
    on_close: OnceLock<CloseSink>,
    limits: Limits,
    /// Set whenever something arrives from the peer; the liveness thread clears it each tick.
    pub(crate) heard: AtomicBool,
    /// How long the peer had been silent when it was declared unresponsive, in ms (0: it was not).
    silent_ms: AtomicU64,
    /// The peer's latest collective, as its last heartbeat said, packed (see `live.rs`;
    /// `u64::MAX`: none yet).
    position: AtomicU64,
    /// Where the peer's calls beside its backend are (a hybrid's NCCL calls), as its last
    /// heartbeat said: the low 24 bits of the sequence number, the state and the kind, packed
    /// as `position` (`u64::MAX`: none yet).
    beside: AtomicU64,
    /// Heartbeats heard from the peer so far.
    pub(crate) beats: AtomicU64,
    /// Hears, from the reader thread, each heartbeat (and whether it asked for one back).
    on_beat: OnceLock<BeatSink>,
    /// The peer said it is closing its backend normally.
    leaving: AtomicBool,
}

/// A hook the owning backend passes to each peer to hear that its connection ended.
pub(crate) type CloseSink = Arc<dyn Fn(usize, String) + Send + Sync>;

/// A hook the owning backend passes to each peer to hear of its heartbeats: the peer's rank and
/// whether it asked for a heartbeat back.
pub(crate) type BeatSink = Arc<dyn Fn(usize, bool) + Send + Sync>;

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("rank", &self.rank).finish()
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
            writer: Some(WriterLock::new(Writer {
                sock,
                broken: None,
                hb: [0; FRAME_HEADER_LEN],
                hb_left: 0,
            })),
            rx: Some(Mutex::new(Rx {
                sock: Source::Socket(socket2::Socket::from(r)),
                buf: vec![0u8; RX_BUF].into_boxed_slice(),
                lo: 0,
                hi: 0,
                frame: Frame::Header,
                dead: false,
            })),
            spinners: AtomicUsize::new(0),
            on_abort: OnceLock::new(),
            on_close: OnceLock::new(),
            heard: AtomicBool::new(false),
            silent_ms: AtomicU64::new(0),
            position: AtomicU64::new(u64::MAX),
            beside: AtomicU64::new(u64::MAX),
            beats: AtomicU64::new(0),
            on_beat: OnceLock::new(),
            leaving: AtomicBool::new(false),
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
            on_close: OnceLock::new(),
            heard: AtomicBool::new(false),
            silent_ms: AtomicU64::new(0),
            position: AtomicU64::new(u64::MAX),
            beside: AtomicU64::new(u64::MAX),
            beats: AtomicU64::new(0),
            on_beat: OnceLock::new(),
            leaving: AtomicBool::new(false),
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

    fn gone(&self, op: String, cause: String) -> DistError {
        let silent = self.silent_ms.load(Ordering::Acquire);
        if silent > 0 {
            return DistError::PeerUnresponsive {
                rank: self.me,
                peer: self.rank,
                op,
                silent: Duration::from_millis(silent),
                position: self.position_text(),
            };
        }
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
        if let Some(r) = st.take_queued(tag, buf) {
            // There may be room in the budget: a reader holding a frame back for it may go on.
            self.wake_reader_if_holding(&st);
            drop(st);
            during(None)?;
            return r.map_err(|got| self.mismatch(op(), len, got));
        }
        if let Some(cause) = &st.closed {
            let e = self.gone(op(), cause.clone());
            drop(st);
            during(None)?;
            return Err(e);
        }
        // SAFETY: `buf` is borrowed mutably for this whole call. The entry leaves `posted`
        // before it returns: `wait` removes it on every return (waiting out or cutting a fill),
        // and `guard` withdraws it on every other way out, a failing or panicking `during` or a
        // panic in `wait` included (tests: peer::tests::a_receive_whose_*_unwinds_is_withdrawn).
        let id = unsafe { st.post(tag, buf.as_mut_ptr(), len) };
        // The reader may be holding a large message back for a receive like this one; or we are
        // about to be busy sending, and it must take the message as it comes.
        if st.reader_holding || long {
            self.wake_reader(&st);
        }
        drop(st);
        // From here the reader may write into `buf`: the guard withdraws the receive (waiting out
        // a fill in progress) on every way out, unwinding included, before `buf` is released.
        // Nothing between the post and here can panic (a notify, a mutex guard's drop).
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
        let _spinning = Spinning::new(&self.spinners);
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
    }

    /// Ends the connection: no more bytes are read, every waiting receive fails with `cause`.
    /// Called with the read side locked, so that no fill is in progress once it returns.
    fn shut(&self, rx: &mut Rx, cause: String) {
        if !rx.dead {
            rx.dead = true;
            if let Frame::Queue { data, .. } = &rx.frame {
                // The budget reserved for a message that will now never be queued.
                self.lock().queued_bytes -= data.len() + QUEUED_OVERHEAD;
            }
            rx.frame = Frame::Header;
            rx.sock.shutdown();
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
}

fn spin_time() -> Duration {
    static S: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("DIST_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(|us: u64| Duration::from_micros(us.min(SPIN_MAX_US.into())))
            .unwrap_or(SPIN)
    })
}

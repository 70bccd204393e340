//! One peer's connection after the handshake: the writer (callers' threads write frames directly,
//! one at a time), the read side (frames are read without blocking, by the backend's I/O thread
//! or by a receiver spinning for its message, and each payload lands in the buffer a receiver
//! has posted, or in the queue), and the matching of messages to receivers by tag. A peer may
//! exist before its connection (`connect.rs`): the connection is attached once (its parts made
//! in `setup.rs`).

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
mod connect;
#[cfg(test)]
mod fill_tests;
mod io;
#[cfg(test)]
mod io_tests;
#[cfg(test)]
mod lazy_tests;
mod live;
mod notices;
mod poll_wait;
#[cfg(test)]
mod poll_wait_tests;
mod poller;
pub(crate) use live::{Beat, Whereabouts};
#[cfg(test)]
mod props;
mod reader;
mod recv;
mod route;
mod rx;
#[cfg(test)]
mod seal_tests;
mod setup;
#[cfg(test)]
mod shm_tests;
mod slots;
#[cfg(test)]
mod socket_tests;
#[cfg(test)]
mod tests;
mod writer;

pub use aborts::AbortNotice;
pub(crate) use aborts::{AbortSink, Aborts};
pub(crate) use connect::ConnectHook;
pub(crate) use io::IoThread;
use poll_wait::SocketWait;
use recv::Spinning;
pub use recv::TcpRecv;
pub(crate) use recv::{small_spin_env, spin_env};
use rx::*;
use slots::*;
use writer::*;

/// The longest abort notice a peer may send (its error text); a longer one is a protocol error.
pub(crate) const ABORT_MAX: usize = 64 << 10;

/// Set in an abort frame's named rank (meta bytes 0..8, rank + 1) where the rank is not named
/// at fault but is the one whose own call failed first, passed on
/// ([`AbortNotice::first`]).
pub(crate) const ORIGIN_ONLY: u64 = 1 << 63;
/// How many abort notices a backend keeps from each sender (this rank's own included): a peer
/// flooding abort frames pushes out no other rank's notices, and holds at most this many of
/// [`ABORT_MAX`] bytes here (its text as kept, invalid UTF-8 replaced, is cut back to that
/// bound). A sender's later notice that ends more waits replaces one of its older ones, never
/// its first ([`Aborts::raise`]). At least 3.
const ABORTS_KEPT_PER_PEER: usize = 16;
/// What a queued message costs the unexpected-message budget beyond its payload. A message on a
/// fresh tag costs about this much memory besides its bytes: the `Queued` entry (40 B) in a
/// `VecDeque` that allocates room for 4 on its first push (160 B), the map's bucket (tag + deque,
/// 40 B, more with the load factor), and the allocator's minimum chunk and header on the payload
/// and the deque (16-32 B each). Charging less let a peer that sends 1-byte messages on distinct
/// tags hold several times the budget.
const QUEUED_OVERHEAD: usize = 256;
/// How often the read side of a peer that holds a message back for flow control rechecks on its
/// own (it is woken whenever a receive is posted or a queued message taken; this only bounds a
/// lost wake).
const HOLD_RECHECK: Duration = Duration::from_millis(500);

/// What a peer may make this rank hold: the largest frame accepted, and the bytes of messages
/// that arrived before their receive that are kept per peer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// A data frame longer than this is a protocol error.
    pub(crate) max_message: u64,
    /// Bytes of unexpected messages queued per peer before the reader stops reading the socket.
    pub(crate) unexpected: usize,
    /// Connections must be sealed (`crate::seal`): one whose handshake left no keys is refused.
    pub(crate) sealed: bool,
}

/// Messages at least this long wait up to [`GRACE`] for a receive before being queued.
const GRACE_MIN_LEN: usize = 64 << 10;
/// How long a large message waits for its receive to be posted.
const GRACE: Duration = Duration::from_millis(5);

/// How often the I/O thread drains a connection that nobody is waiting on, while receives come
/// and go on it.
const IDLE_DRAIN: Duration = Duration::from_millis(20);
/// How long nothing must be posted or taken on a connection before the I/O thread waits for its
/// socket alone (no timer) instead of draining every [`IDLE_DRAIN`].
const IDLE_QUIET: Duration = Duration::from_millis(100);

/// How long a receiver spins for its message before it sleeps, unless the host is
/// oversubscribed (see `config::default_spin`) or `DIST_SPIN_US` says otherwise.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// The longest spin `DIST_SPIN_US` may ask for (10 ms); more is a configuration error.
pub(crate) const SPIN_MAX_US: u32 = 10_000;

/// A connection's parts, set once when it is attached.
struct Conn {
    /// The writing half.
    writer: WriterLock,
    /// The read side, shared by the I/O thread and spinning receivers.
    rx: Mutex<Rx>,
    /// A handle to watch the socket with, and to shut the connection down.
    stream: TcpStream,
    /// Whether frames to and from the peer go through shared memory.
    shm: (bool, bool),
    /// A receiver may wait in `poll` on the socket itself (`poll_wait.rs`): it carries the
    /// frames (not a ring's doorbells) and is a real socket.
    pollable: bool,
}

/// One peer: its connection (once attached), and the messages and receives waiting on it.
pub(crate) struct Peer {
    pub(crate) me: usize,
    pub(crate) rank: usize,
    /// The peer is this rank itself: sends are copied to its own queue; it has no connection.
    loopback: bool,
    /// The connection, once attached ([`Peer::attach`]); boxed, so that a peer never connected
    /// (most of them, in a lazily formed job of many ranks) costs a pointer for it, not the
    /// connection's few hundred bytes.
    conn: OnceLock<Box<Conn>>,
    /// The send timeout set on an attached socket.
    send_timeout: Duration,
    /// Makes the connection on first use, for a peer created without one.
    connect: Option<ConnectHook>,
    /// Who dials the connection now (one caller at a time; the others wait for it).
    dial: Mutex<connect::Dial>,
    dialed: Condvar,
    /// The I/O thread that drives the read side, once adopted.
    io: OnceLock<Arc<io::Io>>,
    /// This peer's own `Arc`, for handing it to the I/O thread (set when adopted).
    this: OnceLock<std::sync::Weak<Peer>>,
    /// The connection has been handed to the I/O thread.
    io_added: AtomicBool,
    /// A wake of the I/O thread for this peer is pending.
    io_woken: AtomicBool,
    state: Mutex<State>,
    /// Receivers sleep on this one.
    cond: Condvar,
    /// Receivers spinning on this peer right now; the I/O thread stands back meanwhile.
    spinners: AtomicUsize,
    /// How long a receiver spins on this peer before it sleeps, in µs ([`Peer::set_spin`]).
    spin_us: AtomicU64,
    /// How many turns the I/O thread has given this peer's state (tests count its wake-ups).
    #[cfg(test)]
    reader_turns: AtomicU64,
    aborts: Arc<Aborts>,
    on_abort: OnceLock<AbortSink>,
    /// Hears, from the I/O thread, that the connection has ended (with why).
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
    /// Hears, from the I/O thread (or a receiver reading), each heartbeat (and whether it asked for one back).
    on_beat: OnceLock<BeatSink>,
    /// When the peer first said it is closing its backend normally.
    leaving: OnceLock<Instant>,
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
    /// Whether frames to and from this peer go through shared memory (to, from).
    pub(crate) fn shared_memory(&self) -> (bool, bool) {
        self.conn.get().map_or((false, false), |c| c.shm)
    }

    /// The read side, once connected.
    fn rx(&self) -> Option<&Mutex<Rx>> {
        self.conn.get().map(|c| &c.rx)
    }

    /// The writing half, once connected.
    fn writer(&self) -> Option<&WriterLock> {
        self.conn.get().map(|c| &c.writer)
    }

    /// The socket handle, once connected.
    pub(crate) fn stream(&self) -> Option<&TcpStream> {
        self.conn.get().map(|c| &c.stream)
    }

    /// Whether the peer has a connection (the loopback peer: never).
    pub(crate) fn is_connected(&self) -> bool {
        self.conn.get().is_some()
    }

    /// Sets how long a receiver spins on this peer before it sleeps.
    pub(crate) fn set_spin(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.spin_us.store(us, Ordering::Relaxed);
    }

    /// How long a wait on this thread spins before it sleeps: not at all on a thread running
    /// async work ([`dist_core::work::on_work_thread`]), whose caller computes beside it.
    fn spin_time(&self) -> Duration {
        if dist_core::work::on_work_thread() {
            return Duration::ZERO;
        }
        Duration::from_micros(self.spin_us.load(Ordering::Relaxed))
    }

    /// Whether this is the rank itself.
    pub(crate) fn is_loopback(&self) -> bool {
        self.loopback
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

    /// Wakes the I/O thread's side of this peer if it waits holding a frame back.
    fn wake_reader_if_holding(&self, st: &State) {
        if st.reader_holding {
            self.kick();
        }
    }

    /// Wakes the I/O thread's side of this peer if it waits for an event or its timer (not
    /// for the socket).
    fn wake_reader(&self, st: &State) {
        if st.reader_sleeping {
            self.kick();
        }
    }

    /// Wakes the receivers blocked on the condition variable or waiting on the socket, if any.
    fn notify(&self, st: &State) {
        if st.sleepers > 0 {
            self.cond.notify_all();
        }
        for w in &st.pollers {
            w.ring();
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
                // (Tests: `ring_messages_self_sends_and_barrier`, `peer/props.rs`.)
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
        if let Some(rx) = self.rx() {
            let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
            self.shut(&mut r, cause.to_string());
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
        for w in &st.pollers {
            w.ring();
        }
        self.wake_reader(&st);
    }

    /// Waits until the read side has seen the connection end, or `deadline`. True if it has
    /// (or there is no connection).
    pub(crate) fn wait_closed(&self, deadline: Instant) -> bool {
        self.wait_read_end(deadline, true)
    }

    /// [`Peer::wait_closed`]; `closing`: this side is closing too (what still comes is
    /// skipped), else the peer's frames are taken as ever, an abort notice among them.
    pub(super) fn wait_read_end(&self, deadline: Instant, closing: bool) -> bool {
        if !self.is_connected() {
            return true;
        }
        let mut st = self.lock();
        st.closing |= closing;
        // Whatever the I/O thread waits for on this peer (a quiet socket has no timer).
        self.kick();
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
        // The I/O thread forgets the peer (and calls the close hook) on its next turn.
        self.kick();
    }

    /// Shuts the socket down in both directions (on drop, or to break a hung connection).
    pub(crate) fn shutdown(&self, how: Shutdown) {
        if let Some(s) = self.stream() {
            let _ = s.shutdown(how);
        }
    }

    /// Sets the hook that hears of abort frames.
    pub(crate) fn set_abort_sink(&self, sink: AbortSink) {
        let _ = self.on_abort.set(sink);
    }
}

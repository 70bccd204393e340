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
mod recv;
mod rx;
mod slots;
#[cfg(test)]
mod tests;
mod writer;

pub use aborts::AbortNotice;
pub(crate) use aborts::{AbortSink, Aborts};
pub use recv::TcpRecv;
use recv::{Spinning, spin_time};
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

/// How often the reader thread drains a connection that nobody is waiting on, while receives
/// come and go on it.
const IDLE_DRAIN: Duration = Duration::from_millis(20);
/// How long nothing must be posted or taken on a connection before its reader waits for the
/// socket instead of draining every [`IDLE_DRAIN`].
const IDLE_QUIET: Duration = Duration::from_millis(100);
/// The longest a quiet reader waits for the socket before it looks at its state again (a
/// closing backend, which wakes sleeping readers, reaches a quiet one within this).
const IDLE_POLL: Duration = Duration::from_millis(250);

/// How long a receiver spins for its message before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// The longest spin `DIST_SPIN_US` may ask for (10 ms); more is a configuration error.
pub(crate) const SPIN_MAX_US: u32 = 10_000;

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
    /// How many times the reader thread has looked at its state (tests count its wake-ups).
    #[cfg(test)]
    reader_turns: AtomicU64,
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
            #[cfg(test)]
            reader_turns: AtomicU64::new(0),
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
            #[cfg(test)]
            reader_turns: AtomicU64::new(0),
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

//! The always-on check of NCCL collectives made through [`crate::HybridBackend`]: each call's
//! descriptor (sequence number, collective, element type, count, op, root) goes to the ring's
//! next rank over TCP from a background thread, and a second background thread compares what
//! the previous rank sent with this rank's own record. Nothing waits on the calling thread: it
//! hands the descriptor to a bounded channel with `try_send` and returns.
//! While calls keep coming, the sender polls the channel (every 50 µs) rather than block on
//! it, so that `try_send` has no thread to wake, and sends up to 6 descriptors per frame.
//!
//! A disagreement makes the detecting rank call its `fail` sink (which aborts its NCCL
//! communicator with a reason naming both ranks and both calls) and send a *poison* frame
//! with that reason to the next rank, which does the same and forwards it, until it has gone
//! round the ring. A receive from the previous rank that fails with `PeerGone` means that rank
//! died: the `peer_gone` sink is called (and the reason forwarded as poison likewise).
//!
//! Bounds: the channel holds [`CHANNEL`] descriptors; when it is full (the sender thread is
//! behind by that many calls) a descriptor is dropped, counted, and not checked. The record of
//! descriptors not yet matched holds at most [`UNMATCHED`] per side; older ones are dropped and
//! counted likewise. A descriptor the other side never sent (dropped there) is skipped by
//! sequence number, never compared with the wrong call.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_core::{Backend, DistError, Tag};
use dist_tcp::TcpBackend;

/// The tag of the check's frames (a system tag no other protocol of dist uses).
pub(crate) const CHECK_TAG: Tag = Tag::system(0x4e43_4b00);
/// Every frame has this length, so the receive is posted without knowing what comes.
pub(crate) const FRAME: usize = 512;
/// Descriptors the calling threads may queue ahead of the sender thread.
pub(crate) const CHANNEL: usize = 4096;
/// Unmatched descriptors kept per side.
pub(crate) const UNMATCHED: usize = 4096;
/// How long the receiving thread waits per receive before it looks at its stop flag.
const POLL: Duration = Duration::from_millis(50);
/// Descriptors per frame (72 bytes each, after a 16-byte header).
pub(crate) const PER_FRAME: usize = 6;
const DESC_LEN: usize = 72;
/// While calls keep coming, the sender looks at the queue this often instead of blocking on it,
/// so that a call's `try_send` finds no thread to wake (a futex wake per call cost the caller
/// microseconds); it blocks again after [`BUSY_FOR`] without a call.
const BUSY_POLL: Duration = Duration::from_micros(50);
const BUSY_FOR: Duration = Duration::from_millis(5);

const KIND_DESC: u8 = 1;
const KIND_POISON: u8 = 2;
const KIND_BYE: u8 = 3;
const TEXT_AT: usize = 16;

/// A short name (collective, element type, op) as it travels: up to 15 bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Name([u8; 16]);

impl Name {
    /// `s`, cut at 15 bytes.
    pub(crate) fn new(s: &str) -> Name {
        let mut b = [0u8; 16];
        let n = s.len().min(15);
        b[..n].copy_from_slice(&s.as_bytes()[..n]);
        Name(b)
    }

    fn as_str(&self) -> &str {
        let n = self.0.iter().position(|&c| c == 0).unwrap_or(16);
        std::str::from_utf8(&self.0[..n]).unwrap_or("?")
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One NCCL call as the check compares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    /// The call's sequence number among this backend's NCCL calls (from 1).
    pub(crate) seq: u64,
    /// The collective, e.g. `all_reduce`.
    pub(crate) coll: Name,
    /// The element type, e.g. `f32`.
    pub(crate) dtype: Name,
    /// Elements.
    pub(crate) count: u64,
    /// The reduction (`-` for none). PreMulSum's scalar is not part of it (ranks may differ).
    pub(crate) op: Name,
    /// The root of a rooted collective.
    pub(crate) root: Option<u64>,
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} {} {} x {}",
            self.seq, self.coll, self.dtype, self.count
        )?;
        if self.op.as_str() != "-" {
            write!(f, " {}", self.op)?;
        }
        if let Some(r) = self.root {
            write!(f, " root {r}")?;
        }
        Ok(())
    }
}

/// A frame of the check's protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// Calls of the sender, in order (1 to [`PER_FRAME`]).
    Descs(Vec<Desc>),
    /// Abort: `origin` found `reason`; forwarded round the ring up to the rank before it.
    Poison { origin: u64, reason: String },
    /// The sender is shutting down normally: its connection closing is no failure. `last`
    /// is the last sequence number it was handed (sent or dropped): a call of this rank after
    /// it has no counterpart to come.
    Bye { last: u64 },
}

impl Frame {
    pub(crate) fn encode(&self) -> [u8; FRAME] {
        let mut b = [0u8; FRAME];
        match self {
            Frame::Descs(ds) => {
                b[0] = KIND_DESC;
                let n = ds.len().min(PER_FRAME);
                b[1] = n as u8;
                for (i, d) in ds[..n].iter().enumerate() {
                    let o = TEXT_AT + i * DESC_LEN;
                    b[o..o + 8].copy_from_slice(&d.seq.to_le_bytes());
                    b[o + 8..o + 16].copy_from_slice(&d.count.to_le_bytes());
                    b[o + 16..o + 24].copy_from_slice(&d.root.unwrap_or(u64::MAX).to_le_bytes());
                    b[o + 24..o + 40].copy_from_slice(&d.coll.0);
                    b[o + 40..o + 56].copy_from_slice(&d.dtype.0);
                    b[o + 56..o + 72].copy_from_slice(&d.op.0);
                }
            }
            Frame::Poison { origin, reason } => {
                b[0] = KIND_POISON;
                b[8..16].copy_from_slice(&origin.to_le_bytes());
                // Cut at a character boundary within the frame.
                let mut n = reason.len().min(FRAME - TEXT_AT);
                while !reason.is_char_boundary(n) {
                    n -= 1;
                }
                b[2..4].copy_from_slice(&(n as u16).to_le_bytes());
                b[TEXT_AT..TEXT_AT + n].copy_from_slice(&reason.as_bytes()[..n]);
            }
            Frame::Bye { last } => {
                b[0] = KIND_BYE;
                b[8..16].copy_from_slice(&last.to_le_bytes());
            }
        }
        b
    }

    /// The frame in `b`, or why it is not one (a peer's bytes: never a panic).
    pub(crate) fn decode(b: &[u8]) -> Result<Frame, String> {
        if b.len() != FRAME {
            return Err(format!("a check frame of {} bytes, not {FRAME}", b.len()));
        }
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let name_at = |i: usize| {
            let mut x = [0u8; 16];
            x.copy_from_slice(&b[i..i + 16]);
            Name(x)
        };
        match b[0] {
            KIND_DESC => {
                let n = usize::from(b[1]);
                if n == 0 || n > PER_FRAME {
                    return Err(format!(
                        "a check frame of kind {KIND_DESC} (calls) with {n} descriptors (1 to \
                         {PER_FRAME})"
                    ));
                }
                Ok(Frame::Descs(
                    (0..n)
                        .map(|i| {
                            let o = TEXT_AT + i * DESC_LEN;
                            Desc {
                                seq: u64_at(o),
                                count: u64_at(o + 8),
                                root: Some(u64_at(o + 16)).filter(|&r| r != u64::MAX),
                                coll: name_at(o + 24),
                                dtype: name_at(o + 40),
                                op: name_at(o + 56),
                            }
                        })
                        .collect(),
                ))
            }
            KIND_POISON => {
                let n = usize::from(u16::from_le_bytes([b[2], b[3]])).min(FRAME - TEXT_AT);
                Ok(Frame::Poison {
                    origin: u64_at(8),
                    reason: String::from_utf8_lossy(&b[TEXT_AT..TEXT_AT + n]).into_owned(),
                })
            }
            KIND_BYE => Ok(Frame::Bye { last: u64_at(8) }),
            k => Err(format!("a check frame of unknown kind {k}")),
        }
    }
}

/// Two calls that disagree: this rank's and the previous rank's of the same sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mismatch {
    pub(crate) mine: Desc,
    pub(crate) theirs: Desc,
}

/// This rank's descriptors and the previous rank's, matched by sequence number. At most one
/// side has unmatched descriptors at a time (both arrive in sequence order).
#[derive(Debug, Default)]
pub(crate) struct Matcher {
    mine: VecDeque<Desc>,
    theirs: VecDeque<Desc>,
    /// Descriptors never compared (dropped on a full channel or record, on either side).
    pub(crate) unchecked: u64,
    /// The previous rank's last sequence number, once it said Bye.
    left_last: Option<u64>,
}

impl Matcher {
    pub(crate) fn mine(&mut self, d: Desc) -> Option<Mismatch> {
        Self::pair(d, &mut self.mine, &mut self.theirs, &mut self.unchecked)
            .map(|(mine, theirs)| Mismatch { mine, theirs })
    }

    pub(crate) fn theirs(&mut self, d: Desc) -> Option<Mismatch> {
        Self::pair(d, &mut self.theirs, &mut self.mine, &mut self.unchecked)
            .map(|(theirs, mine)| Mismatch { mine, theirs })
    }

    /// The previous rank ended its check (Bye) after its call `last`.
    pub(crate) fn left_ended(&mut self, last: u64) {
        self.left_last = Some(last);
    }

    /// Whether this rank's call `d` comes after the previous rank ended its check: its
    /// counterpart will never come.
    pub(crate) fn after_left_ended(&self, d: &Desc) -> Option<u64> {
        self.left_last.filter(|&last| d.seq > last)
    }

    /// The other side's descriptors waiting for this rank's (tests watch them arrive).
    #[cfg(test)]
    pub(crate) fn theirs_pending(&self) -> usize {
        self.theirs.len()
    }

    /// Matches `d` against the other side's oldest unmatched descriptors; returns (d, other)
    /// when they disagree.
    fn pair(
        d: Desc,
        own: &mut VecDeque<Desc>,
        other: &mut VecDeque<Desc>,
        unchecked: &mut u64,
    ) -> Option<(Desc, Desc)> {
        // The other side's descriptors this side never had (dropped here): unchecked.
        while other.front().is_some_and(|o| o.seq < d.seq) {
            other.pop_front();
            *unchecked += 1;
        }
        match other.front() {
            Some(o) if o.seq == d.seq => {
                let o = *o;
                other.pop_front();
                (o != d).then_some((d, o))
            }
            // The other side dropped this one: it has later ones already.
            Some(_) => {
                *unchecked += 1;
                None
            }
            None => {
                if own.len() == UNMATCHED {
                    own.pop_front();
                    *unchecked += 1;
                }
                own.push_back(d);
                None
            }
        }
    }
}

/// What the check does when it finds something: abort this rank's communicator with a reason.
pub(crate) type Sink = Arc<dyn Fn(String) + Send + Sync>;
/// What the check does when a rank is gone: `(rank, cause)`; returns the reason it aborted
/// with, which is forwarded round the ring.
pub(crate) type PeerSink = Arc<dyn Fn(usize, String) -> String + Send + Sync>;

/// The two threads and the calling side's handle.
pub(crate) struct Checker {
    tx: Option<SyncSender<Desc>>,
    stop: Arc<AtomicBool>,
    /// Set to stop without telling the next rank (a test's simulated death).
    silent: Arc<AtomicBool>,
    pub(crate) dropped: Arc<AtomicU64>,
    /// The last sequence number handed to `note` (sent or dropped), which the Bye carries.
    last: Arc<AtomicU64>,
    pub(crate) matcher: Arc<Mutex<Matcher>>,
    /// Each thread and its "done" signal (in a mutex only to make the checker `Sync`).
    threads: Mutex<Vec<(JoinHandle<()>, Receiver<()>)>>,
    tcp: Arc<TcpBackend>,
}

impl fmt::Debug for Checker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checker")
            .field("dropped", &self.dropped.load(Ordering::Relaxed))
            .finish()
    }
}

/// The text of a mismatch, as every rank's error carries it.
pub(crate) fn mismatch_text(me: usize, left: usize, m: &Mismatch) -> String {
    format!(
        "NCCL collective mismatch: rank {left} called {} but rank {me} called {}",
        m.theirs, m.mine
    )
}

impl Checker {
    /// Starts the sender and receiver threads over `tcp`'s ring (a job of one rank has no
    /// one to compare with: no threads then). `fail` aborts this rank with a reason;
    /// `peer_gone` is told of a rank whose connection closed.
    pub(crate) fn start(tcp: Arc<TcpBackend>, fail: Sink, peer_gone: PeerSink) -> Checker {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Desc>(CHANNEL);
        let mut c = Checker {
            tx: Some(tx),
            stop: Arc::new(AtomicBool::new(false)),
            silent: Arc::new(AtomicBool::new(false)),
            dropped: Arc::new(AtomicU64::new(0)),
            last: Arc::new(AtomicU64::new(0)),
            matcher: Arc::new(Mutex::new(Matcher::default())),
            threads: Mutex::new(Vec::new()),
            tcp: tcp.clone(),
        };
        let (me, n) = (tcp.rank(), tcp.world_size());
        if n < 2 {
            return c;
        }
        let (left, right) = ((me + n - 1) % n, (me + 1) % n);
        let ctx = Arc::new(Ctx {
            tcp,
            me,
            left,
            right,
            fail,
            peer_gone,
            matcher: c.matcher.clone(),
            last: c.last.clone(),
            stop: c.stop.clone(),
            silent: c.silent.clone(),
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    f();
                    let _ = done_tx.send(());
                })
                .map(|h| (h, done_rx))
        };
        let x = ctx.clone();
        match spawn(
            format!("dist-check-tx-{me}"),
            Box::new(move || x.send_loop(rx)),
        ) {
            Ok(t) => c
                .threads
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .push(t),
            Err(e) => tracing::error!(rank = me, error = %e, "NCCL call check off: no thread"),
        }
        let x = ctx;
        match spawn(
            format!("dist-check-rx-{me}"),
            Box::new(move || x.recv_loop()),
        ) {
            Ok(t) => c
                .threads
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .push(t),
            Err(e) => tracing::error!(rank = me, error = %e, "NCCL call check off: no thread"),
        }
        c
    }

    /// Hands `d` to the sender thread without waiting; a full channel drops it (counted).
    pub(crate) fn note(&self, d: Desc) {
        if let Some(tx) = &self.tx {
            self.last.fetch_max(d.seq, Ordering::Relaxed);
            match tx.try_send(d) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Stops both threads, waiting for each at most until `deadline` (a thread still inside a
    /// TCP call then is left to finish on its own: it holds only shared handles).
    pub(crate) fn stop(&mut self, deadline: Instant) {
        // The sender sees the channel close, sends what is queued and a Bye, and ends.
        self.tx = None;
        let threads: Vec<_> = self
            .threads
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for (h, done) in threads {
            let left = deadline.saturating_duration_since(Instant::now());
            // The receiver ends at its next poll after the sender is done.
            if h.thread()
                .name()
                .is_some_and(|n| n.starts_with("dist-check-rx"))
            {
                self.stop.store(true, Ordering::Release);
            }
            match done.recv_timeout(left) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                    let _ = h.join();
                }
                Err(RecvTimeoutError::Timeout) => {
                    tracing::warn!(
                        rank = self.tcp.rank(),
                        "NCCL call check thread did not stop in time; left running"
                    );
                }
            }
        }
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
impl Checker {
    /// Stops like a rank that died: no Bye to the next rank.
    pub(crate) fn stop_silently(&mut self) {
        self.silent.store(true, Ordering::Release);
        self.stop(Instant::now() + Duration::from_secs(2));
    }
}

impl Drop for Checker {
    fn drop(&mut self) {
        self.stop(Instant::now() + Duration::from_secs(2));
    }
}

/// What both threads share.
struct Ctx {
    tcp: Arc<TcpBackend>,
    me: usize,
    left: usize,
    right: usize,
    fail: Sink,
    peer_gone: PeerSink,
    matcher: Arc<Mutex<Matcher>>,
    last: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    silent: Arc<AtomicBool>,
}

impl Ctx {
    /// The previous rank broke the check's protocol (`what` says how): a failure of that
    /// peer, poisoned like a mismatch, so the check does not just stop.
    fn protocol_failure(&self, what: &str) {
        let left = self.left;
        self.poison(
            self.me,
            format!(
                "NCCL call check: rank {left} broke the check's protocol with rank {}: {what}",
                self.me
            ),
        );
    }

    fn send(&self, f: &Frame) -> Result<(), DistError> {
        self.tcp.send_tagged(&f.encode(), self.right, CHECK_TAG)
    }

    /// Sends the reason on round the ring (not back to its origin), then aborts here: the
    /// abort can take NCCL a second or more on this thread, and the next rank must not wait
    /// for it.
    fn poison(&self, origin: usize, reason: String) {
        if self.right != origin {
            let _ = self.send(&Frame::Poison {
                origin: origin as u64,
                reason: reason.clone(),
            });
        }
        (self.fail)(reason);
    }

    /// The next descriptors queued, up to a frame's worth: at once if some are queued; while
    /// calls came within [`BUSY_FOR`], by polling every [`BUSY_POLL`]; else by blocking. `None`
    /// when the calling side closed the channel (`Checker::stop`).
    fn next_batch(rx: &Receiver<Desc>, last: &mut Instant) -> Option<Vec<Desc>> {
        let mut batch = Vec::with_capacity(PER_FRAME);
        loop {
            match rx.try_recv() {
                Ok(d) => {
                    batch.push(d);
                    if batch.len() == PER_FRAME {
                        break;
                    }
                    continue;
                }
                Err(TryRecvError::Disconnected) if batch.is_empty() => return None,
                Err(_) if !batch.is_empty() => break,
                Err(_) => {}
            }
            if last.elapsed() < BUSY_FOR {
                // A polling interval, not a wait for some event: see BUSY_POLL.
                std::thread::sleep(BUSY_POLL);
            } else {
                batch.push(rx.recv().ok()?);
            }
        }
        *last = Instant::now();
        Some(batch)
    }

    fn send_loop(&self, rx: Receiver<Desc>) {
        let mut last = Instant::now();
        while let Some(batch) = Self::next_batch(&rx, &mut last) {
            let found = {
                let mut m = self.matcher.lock().unwrap_or_else(|p| p.into_inner());
                batch.iter().find_map(|d| {
                    if let Some(last) = m.after_left_ended(d) {
                        return Some(format!(
                            "NCCL call check: rank {} ended its check after its call #{last} \
                             (Bye), but rank {} called {d}",
                            self.left, self.me
                        ));
                    }
                    m.mine(*d).map(|x| mismatch_text(self.me, self.left, &x))
                })
            };
            // The calls go on to the next rank first, so that it finds the mismatch itself
            // at once, whatever this rank's abort (in `poison`) then takes.
            let sent = self.send(&Frame::Descs(batch));
            if let Some(why) = found {
                self.poison(self.me, why);
            }
            match sent {
                Ok(()) => {}
                Err(e @ DistError::PeerGone { .. }) => {
                    (self.peer_gone)(self.right, e.to_string());
                    return;
                }
                Err(e) => {
                    tracing::warn!(rank = self.me, error = %e, "NCCL call check: send failed; check off");
                    return;
                }
            }
        }
        if !self.silent.load(Ordering::Acquire) {
            let _ = self.send(&Frame::Bye {
                last: self.last.load(Ordering::Relaxed),
            });
        }
    }

    fn recv_loop(&self) {
        let mut buf = [0u8; FRAME];
        while !self.stop.load(Ordering::Acquire) {
            match self
                .tcp
                .recv_tagged_timeout(&mut buf, self.left, CHECK_TAG, POLL)
            {
                Ok(()) => match Frame::decode(&buf) {
                    Ok(Frame::Descs(ds)) => {
                        let found = {
                            let mut m = self.matcher.lock().unwrap_or_else(|p| p.into_inner());
                            ds.into_iter().find_map(|d| m.theirs(d))
                        };
                        if let Some(m) = found {
                            self.poison(self.me, mismatch_text(self.me, self.left, &m));
                            return;
                        }
                    }
                    Ok(Frame::Poison { origin, reason }) => {
                        let origin = usize::try_from(origin).unwrap_or(self.left);
                        self.poison(origin, reason);
                        return;
                    }
                    // Its connection may close now: stop receiving. A call of this rank past
                    // its last is found by the sender thread.
                    Ok(Frame::Bye { last }) => {
                        self.matcher
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .left_ended(last);
                        return;
                    }
                    Err(why) => {
                        self.protocol_failure(&why);
                        return;
                    }
                },
                Err(DistError::Timeout { .. }) => {}
                Err(e @ DistError::SizeMismatch { .. }) => {
                    self.protocol_failure(&format!("a check message of the wrong size ({e})"));
                    return;
                }
                Err(e @ DistError::PeerGone { .. }) => {
                    let reason = (self.peer_gone)(self.left, e.to_string());
                    if self.right != self.left {
                        let _ = self.send(&Frame::Poison {
                            origin: self.me as u64,
                            reason,
                        });
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(rank = self.me, error = %e, "NCCL call check: receive failed; check off");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "check_tests.rs"]
mod tests;

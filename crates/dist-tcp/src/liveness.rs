//! Liveness and peer faults: the thread that sends heartbeats and declares silent peers
//! unresponsive, the [`PeerFault`] hook, and abort notices sent without blocking the caller.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use dist_core::Tag;
use dist_core::collectives::COLLECTIVE_TAG;

use crate::Shared;
use crate::peer::{AbortNotice, Peer};
use crate::wire::FrameKind;

/// Why a peer is reported as faulty.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultCause {
    /// Its connection closed or broke (the process exited or was killed, or the connection was
    /// reset); the text is what the transport saw. A peer that ends its job normally (drops its
    /// backend) while this rank still runs is reported this way too.
    Closed(String),
    /// Nothing was heard from it for this long, past the peer timeout, while its connection
    /// stayed open: it is stopped, partitioned away, or its host is down. Its connection is
    /// closed by this rank when this is reported.
    Silent(Duration),
    /// It sent an abort notice: one of its collectives failed, with this error.
    Aborted(String),
}

/// A peer fault, as [`TcpBackend::on_peer_fault`](crate::TcpBackend::on_peer_fault) hooks hear
/// of it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerFault {
    /// The rank reporting it (this backend's rank).
    pub rank: usize,
    /// The faulty peer (for an abort notice, the rank that sent it).
    pub peer: usize,
    /// What happened.
    pub cause: FaultCause,
}

impl std::fmt::Display for PeerFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rank, peer) = (self.rank, self.peer);
        match &self.cause {
            FaultCause::Closed(c) => write!(f, "rank {rank}: peer {peer} gone: {c}"),
            FaultCause::Silent(d) => write!(
                f,
                "rank {rank}: peer {peer} unresponsive: nothing heard from it for {d:.1?} \
                 (stopped, partitioned, or its host down)"
            ),
            FaultCause::Aborted(r) => write!(f, "rank {rank}: peer {peer} aborted: {r}"),
        }
    }
}

/// A registered fault hook.
pub(crate) type FaultHook = Arc<dyn Fn(&PeerFault) + Send + Sync>;

/// How many faults a backend remembers, to replay to hooks registered later.
const FAULTS_KEPT: usize = 64;

/// What the liveness thread is told.
pub(crate) enum Event {
    /// Dispatch this fault to the hooks.
    Fault(PeerFault),
    /// Write the flight record to the trace folder (an abort notice arrived).
    WriteTrace,
    /// This peer asked for a heartbeat back: send it one now.
    Answer(usize),
    /// The backend is going away.
    Stop,
}

/// The hooks and the faults seen so far.
#[derive(Default)]
pub(crate) struct Faults {
    hooks: Vec<FaultHook>,
    seen: Vec<PeerFault>,
}

/// How often heartbeats go out, for a peer timeout: five per timeout (every 2 s by default),
/// at least 5 ms apart. Each one wakes the peer's I/O thread: at 1,024 ranks on 2 cores
/// (`cargo xtask scale`), one a second on every connection took about a fifth of the run.
pub(crate) fn heartbeat_interval(peer_timeout: Duration) -> Duration {
    (peer_timeout / 5).max(Duration::from_millis(5))
}

/// The liveness thread's body: a heartbeat to every connected peer each interval (unless other
/// bytes went to it since the last, [`Peer::heartbeat_if_quiet`]), silent peers
/// declared unresponsive, and faults dispatched to the hooks as they come.
pub(crate) fn run(shared: Weak<Shared>, events: Receiver<Event>, world: usize, interval: Duration) {
    let start = Instant::now();
    let mut last = vec![start; world];
    let mut prev = start;
    let mut next = start + interval;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        match events.recv_timeout(wait) {
            Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => return,
            Ok(Event::Fault(f)) => {
                if let Some(s) = shared.upgrade() {
                    s.dispatch(f);
                }
                continue;
            }
            Ok(Event::WriteTrace) => {
                if let Some(s) = shared.upgrade() {
                    s.write_trace();
                }
                continue;
            }
            Ok(Event::Answer(peer)) => {
                if let Some(s) = shared.upgrade()
                    && let Some(p) = s.peers.get(peer)
                {
                    p.heartbeat(s.whereabouts());
                }
                continue;
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        let Some(s) = shared.upgrade() else { return };
        let now = Instant::now();
        if now.saturating_duration_since(prev) > interval * 3 {
            // This thread itself was held up (the process stopped, or starved of CPU): the
            // peers' silence meanwhile says nothing about them. Judge afresh from now.
            last.fill(now);
        }
        prev = now;
        next = now + interval;
        s.tick(&mut last, now);
        let took = now.elapsed();
        if took > s.peer_timeout / 2 {
            // On a host with far more runnable threads than cores, a round of heartbeats to
            // many peers can outlast the peer timeout (docs/scale.md): say so, since the peers
            // may then declare this rank unresponsive.
            tracing::warn!(
                rank = s.rank,
                peers = s.peers.len() - 1,
                ?took,
                peer_timeout = ?s.peer_timeout,
                "a round of heartbeats took over half the peer timeout (host overloaded?)"
            );
        }
    }
}

impl Shared {
    /// One heartbeat round, and the silent peers declared.
    fn tick(&self, last: &mut [Instant], now: Instant) {
        let at = self.whereabouts();
        for p in self.peers.iter().filter(|p| p.rank != self.rank) {
            if !p.is_connected() {
                // Not connected (yet): no heartbeat, and no silence to judge until it is.
                last[p.rank] = now;
                continue;
            }
            if p.heard.swap(false, std::sync::atomic::Ordering::Relaxed) {
                last[p.rank] = now;
            }
            p.heartbeat_if_quiet(at);
            let silent = now.saturating_duration_since(last[p.rank]);
            if silent <= self.peer_timeout
                || self.closing()
                || p.declared_silent()
                || p.leaving()
                || !p.is_open()
            {
                continue;
            }
            self.silent(p, silent);
        }
    }

    /// Declares `p` unresponsive: its waits fail naming it, and so do this rank's collectives
    /// (whichever peer they wait on), with it as the origin of their abort.
    fn silent(&self, p: &Peer, silent: Duration) {
        p.declare_silent(silent);
        let reason = p
            .unresponsive("the liveness check".into())
            .map_or_else(String::new, |e| e.to_string());
        self.note_abort(AbortNotice {
            from: self.rank,
            culprit: Some(p.rank),
            tag: COLLECTIVE_TAG,
            call: None,
            reason,
        });
        self.dispatch(PeerFault {
            rank: self.rank,
            peer: p.rank,
            cause: FaultCause::Silent(silent),
        });
    }

    /// Queues `f` for the liveness thread to dispatch (from the I/O thread, which must not run
    /// the hooks itself: it may hold the read side of a connection).
    pub(crate) fn post(&self, f: PeerFault) {
        if self.closing() {
            return;
        }
        self.post_event(Event::Fault(f));
    }

    /// Queues `e` for the liveness thread.
    pub(crate) fn post_event(&self, e: Event) {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let _ = events.send(e);
    }

    /// Calls every hook with `f`, holding no lock.
    fn dispatch(&self, f: PeerFault) {
        if self.closing() {
            return;
        }
        let hooks = {
            let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
            if faults.seen.len() < FAULTS_KEPT {
                faults.seen.push(f.clone());
            }
            faults.hooks.clone()
        };
        tracing::debug!(rank = self.rank, fault = %f, "peer fault");
        for h in hooks {
            h(&f);
        }
    }

    /// Registers `hook`, and calls it (on this thread) with every fault seen before.
    pub(crate) fn add_hook(&self, hook: FaultHook) {
        let seen = {
            let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
            faults.hooks.push(hook.clone());
            faults.seen.clone()
        };
        for f in &seen {
            hook(f);
        }
    }

    pub(crate) fn closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sends an abort notice to every other connected rank, all from one thread (non-blocking
    /// writes in one loop, for at most [`NOTICE_SEND`]), and waits for it at most
    /// [`ABORT_WAIT`]: a peer that does not read (stopped, or its buffers full) holds up neither
    /// the caller nor the notices to the others, and the threads of a rank do not grow with the
    /// world size.
    pub(crate) fn send_abort_notices(
        self: &Arc<Self>,
        tag: Tag,
        call: Option<u64>,
        reason: &str,
        culprit: Option<usize>,
    ) {
        let mut meta = [0u8; 16];
        // Rank + 1 (0: none). The link passes only ranks of the job; a number with no
        // successor in 64 bits names none rather than wrapping.
        let named = culprit
            .and_then(|c| u64::try_from(c).ok())
            .and_then(|c| c.checked_add(1));
        meta[..8].copy_from_slice(&named.unwrap_or(0).to_le_bytes());
        // Call numbers start at 1: 0 says the notice names none.
        meta[8..].copy_from_slice(&call.unwrap_or(0).to_le_bytes());
        let me = self.rank;
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let shared = self.clone();
        let text = reason.to_string();
        let spawned = std::thread::Builder::new()
            .name(format!("dist-abort-{me}"))
            .spawn(move || {
                shared.notify_all(tag, &text, meta);
                let _ = done.send(());
            });
        match spawned {
            Ok(_) => {
                if finished.recv_timeout(ABORT_WAIT).is_err() {
                    tracing::debug!(rank = me, "abort notices still on their way");
                }
            }
            Err(e) => {
                tracing::debug!(rank = me, error = %e, "no thread for the abort notices");
                // On this thread, then, within the caller's bound.
                self.notify_all_by(tag, reason, meta, Instant::now() + ABORT_WAIT);
            }
        }
    }

    fn notify_all(&self, tag: Tag, reason: &str, meta: [u8; 16]) {
        self.notify_all_by(tag, reason, meta, Instant::now() + NOTICE_SEND);
    }

    fn notify_all_by(&self, tag: Tag, reason: &str, meta: [u8; 16], deadline: Instant) {
        let peers: Vec<&Peer> = self.peers.iter().map(|p| &**p).collect();
        Peer::send_to_all(
            &peers,
            FrameKind::Abort,
            tag.to_wire(),
            reason.as_bytes(),
            meta,
            deadline,
            &|r| format!("abort notice to {r}"),
        );
    }
}

/// How long a failing call waits for its abort notices to go out.
pub(crate) const ABORT_WAIT: Duration = Duration::from_millis(500);

/// How long the notices' thread tries to write them (a peer that does not read must not keep
/// it for the operation's whole timeout).
const NOTICE_SEND: Duration = Duration::from_secs(1);

/// The channel the liveness thread listens on.
pub(crate) fn channel() -> (Mutex<Sender<Event>>, Receiver<Event>) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Mutex::new(tx), rx)
}

//! Liveness and peer faults: the thread that sends heartbeats and declares silent peers
//! unresponsive, the [`PeerFault`] hook, and abort notices sent without blocking the caller.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
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

/// How many abort notices of one peer the hooks hear of (each a distinct tag and call; a
/// notice repeated is heard of once): a peer that streams abort frames gets no more.
pub(crate) const ABORT_FAULTS_PER_PEER: usize = 4;

/// What the liveness thread is told ([`Shared::post_event`]).
pub(crate) enum Event {
    /// Dispatch this fault to the hooks.
    Fault(PeerFault),
    /// This peer asked for a heartbeat back: send it one now.
    Answer(usize),
    /// The backend is going away.
    Stop,
}

/// The liveness thread's inbox, fed by the I/O thread once per frame that asks something of it:
/// coalesced, so that what a peer's frames make it hold is bounded by the world size, however
/// many frames come. A heartbeat that asks for an answer sets a flag of its peer (one answer
/// pending per peer); an abort notice queues a fault only if its peer has had fewer than
/// [`ABORT_FAULTS_PER_PEER`] reported and none for the same tag and call, and sets the one
/// pending trace write. So the thread holds at most one answer per peer, and
/// `ABORT_FAULTS_PER_PEER + 1` faults per peer (each at most an abort notice's 64 KiB).
pub(crate) struct Inbox {
    pending: Mutex<Pending>,
    wake: Condvar,
}

#[derive(Default)]
struct Pending {
    stop: bool,
    /// A flight record to write.
    trace: bool,
    /// The peers whose heartbeat asked for one back, each once, in the order they asked.
    answer: Vec<usize>,
    /// By rank: in `answer`.
    asked: Vec<bool>,
    /// Faults to dispatch, in order.
    faults: Vec<PeerFault>,
    /// By peer: the abort notices (tag, call) reported to the hooks.
    reported: HashMap<usize, Vec<(u64, Option<u64>)>>,
    /// The peers with a fault (other than an abort notice's) queued.
    fault_pending: HashSet<usize>,
}

/// What the liveness thread takes from its inbox at once.
#[derive(Default)]
struct Work {
    answer: Vec<usize>,
    faults: Vec<PeerFault>,
    trace: bool,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Plain flags and lists, consistent after any panic.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn post(&self, e: Event) {
        let mut p = self.lock();
        match e {
            Event::Stop => p.stop = true,
            Event::Answer(peer) => {
                if p.asked.len() <= peer {
                    p.asked.resize(peer + 1, false);
                }
                if std::mem::replace(&mut p.asked[peer], true) {
                    // One answer pending already serves this ask too.
                    return;
                }
                p.answer.push(peer);
            }
            Event::Fault(f) => {
                // Closed and silent peers are reported once per connection: one pending fault
                // per peer (beside its abort notices) bounds even a peer that finds a way to
                // report more.
                if !p.fault_pending.insert(f.peer) {
                    return;
                }
                p.faults.push(f);
            }
        }
        drop(p);
        self.wake.notify_one();
    }

    /// Queues the fault of an abort notice from `peer` on `tag`, naming `call`, unless the hooks
    /// heard of this notice already or of [`ABORT_FAULTS_PER_PEER`] of the peer's; with a trace
    /// write if `trace`. Returns whether it was queued.
    fn post_abort(&self, f: PeerFault, tag: u64, call: Option<u64>, trace: bool) -> bool {
        let mut p = self.lock();
        let seen = p.reported.entry(f.peer).or_default();
        if seen.contains(&(tag, call)) || seen.len() >= ABORT_FAULTS_PER_PEER {
            return false;
        }
        seen.push((tag, call));
        p.faults.push(f);
        p.trace |= trace;
        drop(p);
        self.wake.notify_one();
        true
    }

    /// Waits until something is pending or `until` passes, and takes what is pending; `None`
    /// once the thread is to stop.
    fn take(&self, until: Instant) -> Option<Work> {
        let mut p = self.lock();
        loop {
            if p.stop {
                return None;
            }
            if p.trace || !p.answer.is_empty() || !p.faults.is_empty() {
                break;
            }
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                break;
            }
            p = self
                .wake
                .wait_timeout(p, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let Pending { answer, asked, .. } = &mut *p;
        for &peer in answer.iter() {
            asked[peer] = false;
        }
        p.fault_pending.clear();
        Some(Work {
            answer: std::mem::take(&mut p.answer),
            faults: std::mem::take(&mut p.faults),
            trace: std::mem::take(&mut p.trace),
        })
    }
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
pub(crate) fn run(shared: Weak<Shared>, inbox: Arc<Inbox>, world: usize, interval: Duration) {
    let start = Instant::now();
    let mut last = vec![start; world];
    let mut prev = start;
    let mut next = start + interval;
    loop {
        let Some(work) = inbox.take(next) else { return };
        if !work.answer.is_empty() || !work.faults.is_empty() || work.trace {
            let Some(s) = shared.upgrade() else { return };
            if !work.answer.is_empty() {
                let at = s.whereabouts();
                for peer in work.answer {
                    if let Some(p) = s.peers.get(peer) {
                        p.heartbeat(at);
                    }
                }
            }
            // One grace for the batch: many connections ending at once hold this thread up
            // for one grace at most.
            let until = Instant::now() + crate::elastic::NOTICE_GRACE;
            for f in work.faults {
                let closed = matches!(f.cause, FaultCause::Closed(_)).then_some(f.peer);
                let why = f.to_string();
                s.dispatch(f);
                if let Some(peer) = closed {
                    s.after_close(peer, why, until);
                }
            }
            s.revoke_if_failed();
            if work.trace {
                s.write_trace();
            }
        }
        // The round is due whatever came meanwhile: what a peer sends may keep the inbox
        // busy, never this rank's own heartbeats from going out.
        if Instant::now() < next {
            continue;
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
        s.revoke_if_failed();
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
                || p.leaving_within(self.closing_excuse(), now)
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
        self.note_failed(p.rank, || reason.clone());
        self.note_abort(AbortNotice {
            from: self.rank,
            culprit: Some(p.rank),
            first: None,
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

    /// Queues `e` for the liveness thread (coalesced: see [`Inbox`]).
    pub(crate) fn post_event(&self, e: Event) {
        self.events.post(e);
    }

    /// Reports an abort notice from a peer to the hooks (on the liveness thread), once per
    /// notice and at most [`ABORT_FAULTS_PER_PEER`] a peer, with the flight record written
    /// where `DIST_TRACE_DIR` asks (no file I/O on the I/O thread, the caller).
    pub(crate) fn post_abort(&self, n: &AbortNotice) {
        if self.closing() {
            return;
        }
        let f = PeerFault {
            rank: self.rank,
            peer: n.from,
            cause: FaultCause::Aborted(n.reason.clone()),
        };
        if !self
            .events
            .post_abort(f, n.tag.to_wire(), n.call, self.trace_dir.is_some())
        {
            tracing::debug!(
                rank = self.rank,
                peer = n.from,
                "abort notice not reported again to the fault hooks"
            );
        }
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

    /// How long a peer's silence is excused after it said it is closing: the linger (how long
    /// a closing rank waits for its peers, the job's ranks sharing one configuration), and at
    /// least one peer timeout.
    pub(crate) fn closing_excuse(&self) -> Duration {
        self.linger.max(self.peer_timeout)
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
        first: Option<usize>,
    ) {
        let mut meta = [0u8; 16];
        // Rank + 1 (0: none), with `crate::peer::ORIGIN_ONLY` set for a rank not at fault. The link
        // passes only ranks of the job; a number that does not fit below the flag names none
        // rather than wrapping.
        let (rank, flag) = match (culprit, first) {
            (Some(c), _) => (Some(c), 0),
            (None, f) => (f, crate::peer::ORIGIN_ONLY),
        };
        let named = rank
            .and_then(|c| u64::try_from(c).ok())
            .and_then(|c| c.checked_add(1))
            .filter(|&c| c < crate::peer::ORIGIN_ONLY)
            .map(|c| c | flag);
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

/// The inbox the liveness thread listens on: one handle for the backend, one for the thread.
pub(crate) fn channel() -> (Arc<Inbox>, Arc<Inbox>) {
    let inbox = Arc::new(Inbox {
        pending: Mutex::new(Pending::default()),
        wake: Condvar::new(),
    });
    (inbox.clone(), inbox)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aborted(peer: usize, k: u64) -> PeerFault {
        PeerFault {
            rank: 0,
            peer,
            cause: FaultCause::Aborted(format!("abort {k}")),
        }
    }

    /// However many heartbeats of a peer ask for an answer before the thread takes its inbox,
    /// one answer is pending per peer; asked again after, the peer is answered again.
    #[test]
    fn asks_coalesce_into_one_answer_per_peer() {
        let (inbox, _) = channel();
        for _ in 0..100_000 {
            inbox.post(Event::Answer(3));
            inbox.post(Event::Answer(1));
        }
        let w = inbox.take(Instant::now()).unwrap();
        assert_eq!(w.answer, [3, 1]);
        assert!(w.faults.is_empty() && !w.trace);
        inbox.post(Event::Answer(1));
        assert_eq!(inbox.take(Instant::now()).unwrap().answer, [1]);
        assert!(inbox.take(Instant::now()).unwrap().answer.is_empty());
    }

    /// A peer streaming abort frames is reported once per notice (tag and call), at most
    /// `ABORT_FAULTS_PER_PEER` times in all, with one trace write pending; another peer's
    /// notices and a closed connection are still reported.
    #[test]
    fn abort_floods_are_reported_once_per_notice_and_bounded() {
        let (inbox, _) = channel();
        let tag = Tag::system(9).to_wire();
        for _ in 0..1000 {
            inbox.post_abort(aborted(2, 1), tag, Some(1), true);
        }
        for k in 2..10_000 {
            inbox.post_abort(aborted(2, k), tag, Some(k), true);
        }
        assert!(inbox.post_abort(aborted(1, 1), tag, Some(1), false));
        for _ in 0..1000 {
            inbox.post(Event::Fault(PeerFault {
                rank: 0,
                peer: 4,
                cause: FaultCause::Closed("gone".into()),
            }));
        }
        let w = inbox.take(Instant::now()).unwrap();
        let from = |p| w.faults.iter().filter(|f| f.peer == p).count();
        assert_eq!(from(2), ABORT_FAULTS_PER_PEER, "{:?}", w.faults);
        assert_eq!((from(1), from(4)), (1, 1), "{:?}", w.faults);
        assert_eq!(w.faults[0], aborted(2, 1));
        assert!(w.trace);
        // Later notices of the same peer stay unreported; nothing more is pending.
        assert!(!inbox.post_abort(aborted(2, 20_000), tag, Some(20_000), true));
        let w = inbox.take(Instant::now()).unwrap();
        assert!(w.faults.is_empty() && !w.trace);
    }

    /// The thread stops when told, with work pending or not.
    #[test]
    fn stop_ends_the_wait() {
        let (inbox, theirs) = channel();
        let t = std::thread::spawn(move || theirs.take(Instant::now() + Duration::from_secs(60)));
        inbox.post(Event::Stop);
        assert!(t.join().unwrap().is_none());
    }
}

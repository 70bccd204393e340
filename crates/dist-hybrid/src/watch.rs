//! What the hybrid keeps beside its NCCL communicator to fail fast and say why: the flight
//! recorder of its NCCL calls, their sequence numbers, and the abort with a reason that names
//! the NCCL op in flight. The check (`check.rs`) and the peer-failure wiring
//! ([`watch_peer_faults`]) end here.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use dist_core::flight::{DEFAULT_CAPACITY, Entry, FlightRecorder, OpInfo, OpState};
use dist_nccl::AbortHandle;
use dist_tcp::{FaultCause, TcpBackend};

use crate::check::{Desc, Name, PeerSink};

/// The NCCL side's record and abort.
pub(crate) struct Watch {
    me: usize,
    abort: AbortHandle,
    pub(crate) flight: FlightRecorder,
    /// Calls enqueued and not yet seen complete by a synchronize or a work's wait (at most the
    /// record's size), each with its ticket: its place among every call recorded here.
    open: Mutex<VecDeque<(u64, Entry)>>,
    /// The ticket of the latest call recorded (collective or point-to-point).
    ticket: AtomicU64,
    seq: AtomicU64,
    /// The first failure's full reason.
    failed: OnceLock<String>,
    /// Where to write the record on the first failure, and the world size.
    trace: Option<(std::path::PathBuf, usize)>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("rank", &self.me)
            .field("failed", &self.failed.get())
            .finish()
    }
}

impl Watch {
    pub(crate) fn new(
        me: usize,
        abort: AbortHandle,
        trace: Option<(std::path::PathBuf, usize)>,
    ) -> Watch {
        Watch {
            me,
            abort,
            trace,
            flight: FlightRecorder::new(DEFAULT_CAPACITY),
            open: Mutex::new(VecDeque::new()),
            ticket: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            failed: OnceLock::new(),
        }
    }

    /// Records a collective about to be enqueued; its descriptor for the check. `op` is the
    /// reduce op's name, or for the uneven collectives the fingerprint of their counts.
    pub(crate) fn begin(
        &self,
        coll: &'static str,
        dtype: &'static str,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
    ) -> Desc {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        self.record(OpInfo {
            seq,
            op: coll,
            dtype,
            count,
            peer: root,
        });
        Self::desc(seq, coll, dtype, count, op, root)
    }

    /// Records a collective recorded into a CUDA graph (`capture.rs`): it takes its sequence
    /// number as a call does, but nothing is enqueued, so its record is not among the calls a
    /// synchronize finishes; the capture finishes it (returned) when it ends.
    pub(crate) fn begin_captured(
        &self,
        coll: &'static str,
        dtype: &'static str,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
    ) -> (Desc, Entry) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let info = OpInfo {
            seq,
            op: coll,
            dtype,
            count,
            peer: root,
        };
        let e = self.flight.begin(info, OpState::Queued);
        (Self::desc(seq, coll, dtype, count, op, root), e)
    }

    /// A point-to-point call recorded into a CUDA graph: its record only (no sequence number,
    /// as [`Watch::begin_p2p`]), finished by the capture.
    pub(crate) fn begin_captured_p2p(
        &self,
        op: &'static str,
        dtype: &'static str,
        count: usize,
        peer: usize,
    ) -> Entry {
        let info = OpInfo {
            seq: 0,
            op,
            dtype,
            count,
            peer: Some(peer),
        };
        self.flight.begin(info, OpState::Queued)
    }

    fn desc(
        seq: u64,
        coll: &str,
        dtype: &str,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
    ) -> Desc {
        Desc {
            seq,
            coll: Name::new(coll),
            dtype: Name::new(dtype),
            count: count as u64,
            op: Name::new(op.unwrap_or("-")),
            root: root.map(|r| r as u64),
        }
    }

    /// Records a point-to-point call (`send`, `recv`) with `peer` about to be enqueued. It
    /// takes no sequence number (0 in the record): only the two ranks make it, and the check
    /// compares the collectives every rank makes.
    pub(crate) fn begin_p2p(
        &self,
        op: &'static str,
        dtype: &'static str,
        count: usize,
        peer: usize,
    ) {
        self.record(OpInfo {
            seq: 0,
            op,
            dtype,
            count,
            peer: Some(peer),
        });
    }

    fn record(&self, info: OpInfo) {
        let e = self.flight.begin(info, OpState::Queued);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = self.ticket.fetch_add(1, Ordering::Relaxed) + 1;
        if open.len() == DEFAULT_CAPACITY {
            open.pop_front();
        }
        open.push_back((ticket, e));
    }

    /// The ticket of the latest call recorded: a work handle made now follows it.
    pub(crate) fn last_ticket(&self) -> u64 {
        self.ticket.load(Ordering::Relaxed)
    }

    /// A call that failed to enqueue.
    pub(crate) fn failed_call(&self, why: &dyn std::fmt::Display) {
        let e = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_back();
        if let Some((_, e)) = e {
            self.flight.finish(e, Err(why));
        }
    }

    /// A synchronize's outcome: every open call done, or failed with its error.
    pub(crate) fn synced(&self, outcome: Result<(), &dyn std::fmt::Display>) {
        self.finish_through(u64::MAX, outcome);
    }

    /// A work handle's wait succeeded: the calls up to its ticket are done (one stream runs
    /// them in order).
    pub(crate) fn done_through(&self, ticket: u64) {
        self.finish_through(ticket, Ok(()));
    }

    fn finish_through(&self, ticket: u64, outcome: Result<(), &dyn std::fmt::Display>) {
        let done: Vec<Entry> = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let n = open.iter().take_while(|(t, _)| *t <= ticket).count();
            open.drain(..n).map(|(_, e)| e).collect()
        };
        for e in done {
            self.flight.finish(e, outcome);
        }
    }

    /// The oldest NCCL call not yet seen complete, else the latest; `none` before the first.
    pub(crate) fn in_flight(&self) -> String {
        let recs = self.flight.snapshot();
        let open = recs
            .iter()
            .find(|r| matches!(r.state, OpState::Queued | OpState::Started));
        match open.or(recs.last()) {
            None => "none".into(),
            Some(r) => {
                let i = &r.info;
                let word = if i.seq == 0 { "peer" } else { "root" };
                let root = i.peer.map_or(String::new(), |p| format!(" {word} {p}"));
                format!(
                    "#{} {} {} x {}{root} ({})",
                    i.seq,
                    i.op,
                    i.dtype,
                    i.count,
                    r.state.name()
                )
            }
        }
    }

    /// Aborts the communicator with `reason` and the op in flight here; returns the full text
    /// (the first failure's, if there was one already).
    pub(crate) fn fail(&self, reason: &str) -> String {
        let full = format!(
            "{reason}; NCCL op in flight on rank {}: {}",
            self.me,
            self.in_flight()
        );
        // The record first, then the abort: the abort can take NCCL a second or more on this
        // thread, while a caller sees the decision at once and may look for the file. Written
        // inside the once-cell's initialiser, so that a second thread failing meanwhile (the
        // check's sender and receiver can both find a mismatch) waits for the file before it
        // aborts (2 x H200, run 8b6352c of docs/results/2026-11-30-2xH200-efd5e41/: the second
        // thread's abort came first, and the caller found no record).
        let kept = self
            .failed
            .get_or_init(|| {
                self.write_trace();
                full
            })
            .clone();
        self.abort.abort_with(kept.clone());
        kept
    }

    /// With a trace folder (`DIST_TRACE_DIR`), writes the NCCL calls' record to
    /// `DIR/nccl/rank-R.json` (`cargo xtask trace DIR/nccl` summarises them); best effort.
    fn write_trace(&self) {
        if let Some((dir, world)) = &self.trace {
            let dir = dir.join("nccl");
            match self.flight.write_json(&dir, self.me, *world) {
                Ok(path) => {
                    tracing::info!(rank = self.me, path = %path.display(), "NCCL flight record written")
                }
                Err(e) => {
                    tracing::warn!(rank = self.me, dir = %dir.display(), error = %e, "NCCL flight record not written")
                }
            }
        }
    }

    /// Aborts because rank `peer` failed.
    pub(crate) fn peer_failed(&self, peer: usize, cause: &str) -> String {
        self.fail(&format!("rank {peer} failed ({cause})"))
    }

    /// The first failure's reason.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failed.get().map(String::as_str)
    }
}

/// Connects TCP's knowledge of failed peers to the NCCL side: `on_fault(rank, cause)` aborts
/// the communicator naming the rank. Two sources: the TCP mesh's fault hook
/// (`TcpBackend::on_peer_fault`: a peer's connection closed other than by a normal drop, or the
/// peer silent past the peer timeout, e.g. stopped), and the sink returned here, which the NCCL
/// call check calls when its receive from the previous rank fails with `PeerGone`. Abort
/// notices of TCP collectives are not NCCL faults and are left to the TCP side.
///
/// The hook runs on the TCP liveness thread, which must stay quick (it sends the heartbeats):
/// the abort, which can take NCCL a second or more, runs on a thread of its own.
pub(crate) fn watch_peer_faults(tcp: &TcpBackend, on_fault: PeerSink) -> PeerSink {
    let f = on_fault.clone();
    tcp.on_peer_fault(move |fault| {
        if !matches!(fault.cause, FaultCause::Closed(_) | FaultCause::Silent(_)) {
            return;
        }
        let (f, peer, text) = (f.clone(), fault.peer, fault.to_string());
        let spawned = std::thread::Builder::new()
            .name(format!("dist-nccl-abort-{peer}"))
            .spawn(move || {
                f(peer, text);
            });
        if let Err(e) = spawned {
            tracing::warn!(peer, error = %e, "no thread to abort NCCL for a failed peer");
        }
    });
    on_fault
}

/// The sinks the check calls, bound to `watch`.
pub(crate) fn sinks(watch: &Arc<Watch>) -> (crate::check::Sink, PeerSink) {
    let w = watch.clone();
    let fail: crate::check::Sink = Arc::new(move |reason: String| {
        w.fail(&reason);
    });
    let w = watch.clone();
    let peer: PeerSink = Arc::new(move |peer: usize, cause: String| w.peer_failed(peer, &cause));
    (fail, peer)
}

//! The TCP backend of dist: ranks rendezvous through rank 0, authenticate each other, and keep
//! a full mesh of TCP connections over which tagged messages travel with no copy on the large
//! message path.
//!
//! ```no_run
//! use dist_core::Backend;
//! use dist_tcp::TcpBackend;
//!
//! # fn main() -> Result<(), dist_core::DistError> {
//! // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them.
//! let b = TcpBackend::from_env()?;
//! let (me, n) = (b.rank(), b.world_size());
//! b.send(format!("hello from {me}").as_bytes(), (me + 1) % n)?;
//! let mut buf = vec![0u8; format!("hello from {}", (me + n - 1) % n).len()];
//! b.recv(&mut buf, (me + n - 1) % n)?;
//! b.barrier()?;
//! # Ok(()) }
//! ```
//!
//! What a peer can make a rank hold is bounded. A frame longer than
//! [`TcpConfig::max_message`] (16 GiB by default), of an unknown kind or cut short is a protocol
//! error: that connection closes and every wait on it fails naming the peer. Messages that arrive
//! before their receive is posted are queued up to [`TcpConfig::unexpected_limit`] per peer
//! (64 MiB by default); past it the peer's socket is not read until receives are posted, so TCP
//! slows the sender. A message larger than that budget is never queued: its send completes once
//! the receiver posts the receive for it (so two ranks that each send such a message to the
//! other before receiving wait for each other until the send timeout; post the receive first,
//! or use `send_recv`).
#![warn(missing_docs)]

mod config;
mod init;
pub mod launch;
mod liveness;
mod peer;
mod record;
mod sys;
#[doc(hidden)]
pub mod testing;
pub mod wire;

use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_core::flight::FlightRecorder;
use dist_core::{Backend, DistError, Meta, Result, Tag, Transport};

pub use config::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_INIT_TIMEOUT, DEFAULT_PEER_TIMEOUT, DEFAULT_TIMEOUT,
    TcpConfig,
};
pub use launch::{LaunchEnv, Launcher};
pub use liveness::{FaultCause, PeerFault};
pub use peer::AbortNotice;
use peer::{Aborts, Limits, Peer};
use wire::{FrameKind, Tuning};

/// Default largest message a peer may send ([`TcpConfig::max_message`]).
pub const DEFAULT_MAX_MESSAGE: u64 = 16 << 30;
/// Default bytes of unexpected messages kept per peer ([`TcpConfig::unexpected_limit`]).
pub const DEFAULT_UNEXPECTED_LIMIT: usize = 64 << 20;

/// Reads `DIST_MAX_MESSAGE` and `DIST_UNEXPECTED_LIMIT` (bytes) from `get` into `cfg`.
fn limits_from_env(cfg: TcpConfig, get: &impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
    let bytes = |k: &str| -> Result<Option<u64>> {
        get(k)
            .map(|v| match v.trim().parse::<u64>() {
                Ok(x) if x > 0 && x <= isize::MAX as u64 => Ok(x),
                _ => Err(DistError::Config {
                    what: k.into(),
                    reason: format!(
                        "{v:?} is not a whole number of bytes from 1 to {}",
                        isize::MAX
                    ),
                }),
            })
            .transpose()
    };
    let mut cfg = cfg;
    if let Some(b) = bytes("DIST_MAX_MESSAGE")? {
        cfg = cfg.max_message(b);
    }
    if let Some(b) = bytes("DIST_UNEXPECTED_LIMIT")? {
        cfg = cfg.unexpected_limit(b as usize);
    }
    Ok(cfg)
}

struct Shared {
    rank: usize,
    world: usize,
    timeout: Duration,
    linger: Duration,
    peers: Vec<Arc<Peer>>,
    aborts: Arc<Aborts>,
    collectives: AtomicU64,
    abort_sent: AtomicBool,
    /// Whether large sends and receives run on separate threads (see `send_recv_meta`).
    parallel: bool,
    /// The job's tuning, as rank 0 chose it (see [`local_tuning`]).
    tuning: Tuning,
    /// The thread that runs a second lane, started on first use (`None` inside if it could
    /// not be): starting one per call costs more than a 1 MiB all_reduce saves.
    lane: OnceLock<Option<rayon::ThreadPool>>,
    /// How long a peer may be silent before it is declared unresponsive.
    peer_timeout: Duration,
    /// The backend is being dropped: connections ending now are no faults.
    closing: AtomicBool,
    /// The peer-fault hooks, and the faults seen so far.
    faults: std::sync::Mutex<liveness::Faults>,
    /// The liveness thread's inbox.
    events: std::sync::Mutex<std::sync::mpsc::Sender<liveness::Event>>,
    /// The last operations of this rank (collectives, barriers, point-to-point).
    flight: FlightRecorder,
    /// Where to write the flight record on a failure (`DIST_TRACE_DIR`).
    trace_dir: Option<std::path::PathBuf>,
    /// Held while the record is written (by a failing call, or the liveness thread).
    trace_lock: std::sync::Mutex<()>,
    /// Where the calls made beside this backend are (see [`TcpBackend::report_beside`]).
    beside: OnceLock<record::BesideSource>,
    /// Woken when a heartbeat arrives while some thread gathers positions (see `record.rs`).
    beats: record::BeatWait,
}

/// Sends at least this large may run beside their receive on another thread.
const PARALLEL_MIN: usize = 64 << 10;

/// Whether this rank runs a large send and its receive on two threads: as `cfg` says, else
/// where the machine has at least 8 cores.
fn parallel_for(cfg: &TcpConfig) -> bool {
    cfg.parallel
        .unwrap_or_else(|| std::thread::available_parallelism().is_ok_and(|n| n.get() >= 8))
}

/// This rank's choice of the job's [`Tuning`] (rank 0's is the job's): what `cfg` says, else
/// - the ring piece: 256 KiB (cache-sized) when one thread moves both directions, or 1 MiB when
///   a send and its receive run on separate cores;
/// - the lanes (rings a large all_reduce runs at once, in opposite directions, each on its own
///   thread): 2 when there are cores to spare, else 1.
fn local_tuning(cfg: &TcpConfig, parallel: bool) -> Tuning {
    let piece_default = if parallel {
        1 << 10
    } else {
        (dist_core::collectives::RING_PIECE >> 10) as u32
    };
    Tuning {
        ring_piece_kb: cfg
            .ring_piece_kb
            .unwrap_or(piece_default)
            .clamp(1, Tuning::MAX_PIECE_KB),
        lanes: cfg
            .lanes
            .unwrap_or(if parallel { 2 } else { 1 })
            .clamp(1, Tuning::MAX_LANES),
    }
}

/// A rank of a job whose ranks talk over TCP. See the [crate docs](crate).
pub struct TcpBackend {
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    liveness: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world)
            .finish()
    }
}

impl TcpBackend {
    /// Joins the job as `rank` of `world_size`, with rank 0 listening on `master` (`host:port`),
    /// and the default timeouts. Returns once every rank is connected to every other.
    pub fn new(rank: usize, world_size: usize, master: impl Into<String>) -> Result<TcpBackend> {
        Self::with_config(TcpConfig::new(rank, world_size, master))
    }

    /// A configuration to adjust (timeouts, bind address, shared secret) before joining with
    /// [`TcpBackend::with_config`].
    pub fn builder(rank: usize, world_size: usize, master: impl Into<String>) -> TcpConfig {
        TcpConfig::new(rank, world_size, master)
    }

    /// Joins the job as torchrun describes it in the environment (see [`TcpConfig::from_env`]).
    pub fn from_env() -> Result<TcpBackend> {
        Self::with_config(TcpConfig::from_env()?)
    }

    /// Joins the job described by `cfg`.
    pub fn with_config(cfg: TcpConfig) -> Result<TcpBackend> {
        let parallel = parallel_for(&cfg);
        let (streams, tuning) = init::form(&cfg, local_tuning(&cfg, parallel))?;
        let me = cfg.rank;
        let aborts = Arc::new(Aborts::default());
        let limits = Limits {
            max_message: cfg.max_message,
            unexpected: cfg.unexpected_limit,
        };
        let mut peers = Vec::with_capacity(cfg.world_size);
        for (r, s) in streams.into_iter().enumerate() {
            peers.push(Arc::new(match s {
                Some(s) => Peer::connected(me, r, s, cfg.timeout, aborts.clone(), limits)?,
                None => Peer::loopback(me, aborts.clone()),
            }));
        }
        let (events, inbox) = liveness::channel();
        let shared = Arc::new(Shared {
            rank: me,
            world: cfg.world_size,
            timeout: cfg.timeout,
            linger: cfg.linger,
            peers,
            aborts,
            collectives: AtomicU64::new(0),
            abort_sent: AtomicBool::new(false),
            parallel,
            tuning,
            lane: OnceLock::new(),
            peer_timeout: cfg.peer_timeout,
            closing: AtomicBool::new(false),
            faults: Default::default(),
            events,
            flight: FlightRecorder::default(),
            trace_dir: cfg.trace_dir.clone(),
            trace_lock: std::sync::Mutex::new(()),
            beside: OnceLock::new(),
            beats: record::BeatWait::default(),
        });
        let mut readers = Vec::new();
        for p in shared.peers.iter() {
            let Some(stream) = p.reader_stream() else {
                continue;
            };
            let stream = stream.map_err(|source| DistError::Io {
                rank: me,
                context: format!("clone the socket of peer {}", p.rank),
                source,
            })?;
            let peer = p.clone();
            let weak = Arc::downgrade(&shared);
            let sink: peer::AbortSink = Arc::new(move |notice: AbortNotice| {
                if let Some(s) = weak.upgrade() {
                    s.post(PeerFault {
                        rank: s.rank,
                        peer: notice.from,
                        cause: FaultCause::Aborted(notice.reason.clone()),
                    });
                    // A rank that only hears of a failure writes its record too (on the
                    // liveness thread: no file I/O on a reader thread).
                    if s.trace_dir.is_some() {
                        s.post_event(liveness::Event::WriteTrace);
                    }
                    s.note_abort(notice);
                }
            });
            peer.set_abort_sink(sink);
            let weak = Arc::downgrade(&shared);
            peer.set_beat_sink(Arc::new(move |from, asked| {
                if let Some(s) = weak.upgrade() {
                    s.heard_beat(from, asked);
                }
            }));
            let weak = Arc::downgrade(&shared);
            peer.set_close_sink(Arc::new(move |from, cause| {
                if let Some(s) = weak.upgrade()
                    && !s.peers[from].declared_silent()
                    && !s.peers[from].leaving()
                {
                    s.post(PeerFault {
                        rank: s.rank,
                        peer: from,
                        cause: FaultCause::Closed(cause),
                    });
                }
            }));
            let handle = std::thread::Builder::new()
                .name(format!("dist-rx-{me}-from-{}", p.rank))
                .spawn(move || peer.read_loop(stream))
                .map_err(|source| DistError::Io {
                    rank: me,
                    context: "spawn a reader thread".into(),
                    source,
                })?;
            readers.push(handle);
        }
        let weak = Arc::downgrade(&shared);
        let (world, interval) = (
            cfg.world_size,
            liveness::heartbeat_interval(cfg.peer_timeout),
        );
        let liveness = std::thread::Builder::new()
            .name(format!("dist-live-{me}"))
            .spawn(move || liveness::run(weak, inbox, world, interval))
            .map_err(|source| DistError::Io {
                rank: me,
                context: "spawn the liveness thread".into(),
                source,
            })?;
        Ok(TcpBackend {
            shared,
            readers,
            liveness: Some(liveness),
        })
    }

    /// Calls `hook` whenever a peer fails: its connection closes or breaks, it stays silent past
    /// the peer timeout ([`TcpConfig::peer_timeout`]), or it sends an abort notice (one of its
    /// collectives failed). Faults seen before the call are passed to `hook` at once, on the
    /// calling thread; later ones on this backend's liveness thread, within milliseconds of
    /// being seen. A layer above (such as NCCL beside this mesh) can abort its own work there.
    ///
    /// Hooks must be quick and must not wait: the liveness thread also sends this rank's
    /// heartbeats, and a hook that blocks for longer than the peer timeout makes the peers
    /// declare this rank unresponsive. Calling back into the backend from a hook does not
    /// deadlock (no lock is held while hooks run), but a blocking call (a receive, a
    /// collective) holds the liveness thread up as any wait would. No fault is reported once
    /// the backend is being dropped.
    pub fn on_peer_fault(&self, hook: impl Fn(&PeerFault) + Send + Sync + 'static) {
        self.shared.add_hook(Arc::new(hook));
    }

    fn peer(&self, r: usize, op: &dyn Fn() -> String) -> Result<&Peer> {
        self.shared
            .peers
            .get(r)
            .map(|p| &**p)
            .ok_or_else(|| DistError::InvalidRank {
                rank: self.shared.rank,
                op: op(),
                given: r,
                world_size: self.shared.world,
            })
    }

    /// The abort notices received so far.
    pub fn abort_notices(&self) -> Vec<AbortNotice> {
        self.shared.aborts.notices()
    }

    /// Where this backend writes its flight record on a failure (`DIST_TRACE_DIR` or
    /// [`TcpConfig::trace_dir`]), if anywhere; layers above it (the NCCL side of
    /// `dist-hybrid`) write theirs beside it.
    pub fn trace_dir(&self) -> Option<&std::path::Path> {
        self.shared.trace_dir.as_deref()
    }
}

impl Transport for TcpBackend {
    /// Sends `data` to `dst` on `tag` with sixteen bytes of `meta` for the receiver (the
    /// collectives use it for their call descriptor).
    fn send_meta(&self, data: &[u8], dst: usize, tag: Tag, meta: Meta) -> Result<()> {
        let op = || format!("send to {dst} (tag {tag}, {} bytes)", data.len());
        let deadline = deadline_after(self.shared.rank, self.shared.timeout, op)?;
        self.peer(dst, &op)?
            .send(FrameKind::Data, tag.to_wire(), data, meta, &op, deadline)
    }

    /// Receives from `src` on `tag` into `buf` by `deadline`; returns the sender's meta.
    fn recv_meta(&self, buf: &mut [u8], src: usize, tag: Tag, deadline: Instant) -> Result<Meta> {
        let len = buf.len();
        let op = || format!("recv from {src} (tag {tag}, {len} bytes)");
        self.peer(src, &op)?.recv(buf, tag.to_wire(), deadline, &op)
    }

    /// Sends `send` to `dst` while receiving `recv` from `src`, both on `tag`: the receive is
    /// posted first, so the payload lands in `recv` as it arrives, with no copy, while this
    /// thread writes; then runs `meanwhile` while the receive may still be arriving. Returns the
    /// received message's meta.
    fn send_recv_meta_while(
        &self,
        (send, dst): (&[u8], usize),
        (recv, src): (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Meta> {
        let rlen = recv.len();
        let rop = || format!("recv from {src} (tag {tag}, {rlen} bytes)");
        let src_peer = self.peer(src, &rop)?;
        let sop = || format!("send to {dst} (tag {tag}, {} bytes)", send.len());
        let dst_peer = self.peer(dst, &sop)?;
        // With cores to spare, a large send and its receive run on two threads at once (this
        // one writes, the peer's reader thread reads); otherwise one thread moves both without
        // blocking, which avoids the thread switches a crowded machine pays for.
        let parallel = send.len() >= PARALLEL_MIN && self.shared.parallel;
        src_peer.recv_overlapped(recv, tag.to_wire(), deadline, &rop, parallel, |posted| {
            match posted {
                Some(id) if !parallel => dst_peer.send_while_receiving(
                    tag.to_wire(),
                    send,
                    meta,
                    &sop,
                    src_peer,
                    id,
                    deadline,
                ),
                _ => dst_peer.send(FrameKind::Data, tag.to_wire(), send, meta, &sop, deadline),
            }?;
            meanwhile()
        })
    }

    /// The length and meta of the next message queued from `src` on `tag`, if one has arrived
    /// that no receive has taken (after a [`DistError::SizeMismatch`], the message that did not
    /// fit).
    fn peek_meta(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        self.shared.peers.get(src)?.peek(tag.to_wire())
    }

    /// Tells every other rank that this rank's operation on `tag` failed with `reason`; they see
    /// it in [`TcpBackend::abort_notices`] and their waits on system tags end early. Only the
    /// first call sends anything: a rank reports its first failure (its own, or one it heard of
    /// and passes on, so that ranks that have not heard yet do before they see this one leave).
    fn broadcast_abort(&self, tag: Tag, reason: &str) {
        self.broadcast_abort_naming(tag, reason, None);
    }

    /// [`Transport::broadcast_abort`] naming the rank at fault: the notice carries it (abort
    /// frame meta bytes 0..8, rank + 1), and the other ranks' errors name it as the origin.
    /// Notices go out from threads of their own; this waits for them 500 ms at most, so a
    /// peer that does not read (stopped, or its buffers full) holds nobody up.
    fn broadcast_abort_naming(&self, tag: Tag, reason: &str, culprit: Option<usize>) {
        if self.shared.abort_sent.swap(true, Ordering::AcqRel) {
            return;
        }
        // Remember it here too: this rank's later collectives (and other threads' waits on
        // system tags) fail at once with it, as they do on the ranks that hear of it.
        if self.shared.aborts.notices().is_empty() {
            self.shared.note_abort(AbortNotice {
                from: self.shared.rank,
                culprit,
                tag,
                reason: reason.to_string(),
            });
        }
        // Receivers refuse a longer notice (a protocol error): send at most that much of it.
        let mut cut = reason.len().min(peer::ABORT_MAX);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        self.shared.send_abort_notices(tag, &reason[..cut], culprit);
        self.shared.write_trace();
    }

    fn flight(&self) -> Option<&FlightRecorder> {
        Some(&self.shared.flight)
    }

    /// This rank's position from its own record, every live peer's from a heartbeat it sends
    /// when asked (within [`record::ASK_WAIT`]; else from its last one).
    fn positions(&self) -> Option<String> {
        Some(self.shared.positions_text())
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        // Every collective asks: the common answer costs one atomic load.
        if !self.shared.aborts.raised() {
            return None;
        }
        self.shared
            .aborts
            .notices()
            .into_iter()
            .next()
            .map(|n| (n.origin(), n.reason))
    }

    fn next_collective(&self) -> u64 {
        self.shared.collectives.fetch_add(1, Ordering::Relaxed)
    }

    fn ring_piece(&self) -> usize {
        (self.shared.tuning.ring_piece_kb as usize) << 10
    }

    fn lanes(&self) -> usize {
        self.shared.tuning.lanes as usize
    }

    fn run_beside(&self, first: &mut dyn FnMut(), second: &mut (dyn FnMut() + Send)) {
        // A caller that is itself a worker of some rayon pool would, waiting for the lane, run
        // other jobs of its own pool in the meantime (rayon's scopes wait by working), which
        // could be another collective on this thread: there the lane gets a thread of its own.
        if rayon::current_thread_index().is_some() {
            return dist_core::run_beside_scoped(first, second);
        }
        let me = self.shared.rank;
        let pool = self.shared.lane.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(move |_| format!("dist-lane-{me}"))
                .build()
                .map_err(|e| tracing::debug!(rank = me, error = %e, "no lane thread"))
                .ok()
        });
        match pool {
            Some(pool) => pool.in_place_scope(|s| {
                s.spawn(|_| second());
                first();
            }),
            None => dist_core::run_beside_scoped(first, second),
        }
    }
}

impl Shared {
    fn note_abort(&self, n: AbortNotice) {
        tracing::debug!(rank = self.rank, from = n.from, reason = %n.reason, "abort notice");
        self.aborts.raise(n);
        for p in &self.peers {
            p.wake();
        }
    }
}

impl Backend for TcpBackend {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn default_timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> Result<()> {
        self.recorded("send", data.len(), dst, || {
            self.send_meta(data, dst, tag, [0; 16])
        })
    }

    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<()> {
        let len = buf.len();
        let deadline = deadline_after(self.shared.rank, timeout, || {
            format!("recv from {src} (tag {tag}, {len} bytes)")
        })?;
        self.recorded("recv", len, src, || {
            self.recv_meta(buf, src, tag, deadline).map(|_| ())
        })
    }

    /// A collective: see [`dist_core::collectives::barrier`].
    fn barrier_timeout(&self, timeout: Duration) -> Result<()> {
        dist_core::collectives::barrier(self, timeout)
    }
}

/// The instant `timeout` from now, or an error naming the timeout if that is past what an
/// [`Instant`] can hold (e.g. `Duration::MAX`).
fn deadline_after(rank: usize, timeout: Duration, op: impl FnOnce() -> String) -> Result<Instant> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| DistError::InvalidArgument {
            rank,
            op: op(),
            reason: format!("timeout {timeout:?} is too far in the future to be a deadline"),
        })
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        // Connections ending from here on are no faults; heartbeats go on while we linger.
        self.shared.closing.store(true, Ordering::Release);
        let at = self.shared.whereabouts();
        for p in &self.shared.peers {
            p.goodbye(at);
        }
        // Close our sending side, then wait (up to the linger time) for each peer to close
        // theirs, so that nothing they sent us is cut off by a reset, and nothing we sent them is
        // lost. Then close everything.
        for p in &self.shared.peers {
            p.shutdown(Shutdown::Write);
        }
        // `validate` bounds the linger; were it still too far out, wait as long as one can.
        let now = Instant::now();
        let deadline = now
            .checked_add(self.shared.linger)
            .unwrap_or(now + dist_core::MAX_TIMEOUT);
        for p in &self.shared.peers {
            if !p.wait_closed(deadline) {
                tracing::debug!(
                    rank = self.shared.rank,
                    peer = p.rank,
                    "peer did not close in time"
                );
            }
        }
        if let Some(l) = self.liveness.take() {
            let events = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
            let _ = events.send(liveness::Event::Stop);
            drop(events);
            let _ = l.join();
        }
        for p in &self.shared.peers {
            p.shutdown(Shutdown::Both);
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_come_from_the_builder_and_the_environment() {
        let cfg = TcpConfig::new(0, 1, "127.0.0.1:1");
        assert_eq!(cfg.max_message, DEFAULT_MAX_MESSAGE);
        assert_eq!(cfg.unexpected_limit, DEFAULT_UNEXPECTED_LIMIT);
        assert_eq!(
            cfg.clone().max_message(u64::MAX).max_message,
            isize::MAX as u64
        );
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let cfg = limits_from_env(
            cfg,
            &env(&[
                ("DIST_MAX_MESSAGE", "1048576"),
                ("DIST_UNEXPECTED_LIMIT", "4096"),
            ]),
        )
        .unwrap();
        assert_eq!((cfg.max_message, cfg.unexpected_limit), (1 << 20, 4096));
        for bad in ["0", "-1", "1e9", "99999999999999999999"] {
            let pairs: &'static [(&str, &str)] = Box::leak(Box::new([("DIST_MAX_MESSAGE", bad)]));
            match limits_from_env(cfg.clone(), &env(pairs)) {
                Err(DistError::Config { what, .. }) => assert_eq!(what, "DIST_MAX_MESSAGE"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}

//! The TCP backend's flight record: point-to-point operations recorded, where every rank is
//! (for the errors of timed-out collectives: asked of the peers by heartbeat, with a short
//! deadline), and the record written to `DIST_TRACE_DIR`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dist_core::Result;
use dist_core::flight::{OpInfo, OpState, Position, describe_positions};

use crate::liveness::Event;
use crate::peer::{Beat, Whereabouts};
use crate::{Shared, TcpBackend};

/// How long gathering positions waits for the peers' answers: a live peer's reader and
/// liveness threads answer in well under a millisecond; a stopped one never does, and is then
/// described from its last heartbeat.
pub(crate) const ASK_WAIT: Duration = Duration::from_millis(200);

/// Where the calls beside a backend are (see [`TcpBackend::report_beside`]).
pub(crate) type BesideSource = Arc<dyn Fn() -> Option<Position> + Send + Sync>;

/// Lets a thread gathering positions sleep until heartbeats arrive (see
/// [`Shared::gather`]); costs a heartbeat one atomic load while no one waits.
#[derive(Default)]
pub(crate) struct BeatWait {
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
}

impl TcpBackend {
    /// Makes this rank's heartbeats also say where the calls made *beside* this backend are:
    /// `source` returns the latest one (its sequence number, kind and state), e.g. from the
    /// flight recorder of a `HybridBackend`'s NCCL calls. Peers read it with
    /// [`TcpBackend::positions_beside`]. Set once; later calls are ignored.
    pub fn report_beside(&self, source: impl Fn() -> Option<Position> + Send + Sync + 'static) {
        let _ = self.shared.beside.set(Arc::new(source));
    }

    /// Every rank's latest call beside its backend (see [`TcpBackend::report_beside`]), this
    /// rank's from its own source: each live peer is asked for a heartbeat and answers within
    /// `wait` (a stopped or dead one is given as its last heartbeat said, or `None`).
    pub fn positions_beside(&self, wait: Duration) -> Vec<(usize, Option<Position>)> {
        let s = &self.shared;
        s.gather(wait);
        let mine = s.whereabouts().beside;
        let near = mine.map_or(0, |p| p.seq);
        s.peers
            .iter()
            .map(|p| {
                if p.rank == s.rank {
                    (p.rank, mine)
                } else {
                    (p.rank, p.remote_beside(near))
                }
            })
            .collect()
    }

    /// Runs a point-to-point operation, recorded in the flight recorder (two uncontended locks,
    /// no allocation unless it fails).
    pub(crate) fn recorded(
        &self,
        op: &'static str,
        bytes: usize,
        peer: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let info = OpInfo {
            seq: 0,
            op,
            dtype: "",
            count: bytes,
            peer: Some(peer),
        };
        let flight = &self.shared.flight;
        let entry = flight.begin(info, OpState::Started);
        let r = f();
        flight.finish(
            entry,
            r.as_ref().map_err(|e| e as &dyn std::fmt::Display).copied(),
        );
        r
    }
}

impl Shared {
    /// Writes the flight record to `DIST_TRACE_DIR`, if set (on a failure).
    pub(crate) fn write_trace(&self) {
        if let Some(dir) = &self.trace_dir {
            let _one_at_a_time = self.trace_lock.lock().unwrap_or_else(|p| p.into_inner());
            match self.flight.write_json(dir, self.rank, self.world) {
                Ok(path) => {
                    tracing::info!(rank = self.rank, path = %path.display(), "flight record written")
                }
                Err(e) => {
                    tracing::warn!(rank = self.rank, dir = %dir.display(), error = %e, "flight record not written")
                }
            }
        }
    }

    /// Where this rank is, as its heartbeats say.
    pub(crate) fn whereabouts(&self) -> Whereabouts {
        Whereabouts {
            collective: self.flight.position(),
            beside: self.beside.get().and_then(|f| f()),
        }
    }

    /// A heartbeat came from `from` (the I/O thread's hook): answer one that asks (on the
    /// liveness thread, which owns the writing of heartbeats), and wake a gathering thread.
    pub(crate) fn heard_beat(&self, from: usize, asked: bool) {
        if asked {
            self.post_event(Event::Answer(from));
        }
        if self.beats.waiters.load(Ordering::SeqCst) > 0 {
            let _held = self.beats.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.beats.cond.notify_all();
        }
    }

    /// Asks every live peer for a heartbeat and waits (at most `wait`) until each asked one
    /// has answered, so that their positions are fresh. Returns whether all answered.
    pub(crate) fn gather(&self, wait: Duration) -> bool {
        let at = self.whereabouts();
        let asked: Vec<(usize, u64)> = self
            .peers
            .iter()
            .filter(|p| {
                p.rank != self.rank
                    && p.is_connected()
                    && p.is_open()
                    && !p.declared_silent()
                    && !p.leaving()
            })
            .filter_map(|p| {
                let before = p.beats.load(Ordering::SeqCst);
                (p.ask(at) == Beat::Sent).then_some((p.rank, before))
            })
            .collect();
        let deadline = Instant::now() + wait;
        let answered = || {
            asked
                .iter()
                .all(|&(r, before)| self.peers[r].beats.load(Ordering::SeqCst) > before)
        };
        self.beats.waiters.fetch_add(1, Ordering::SeqCst);
        let mut held = self.beats.lock.lock().unwrap_or_else(|p| p.into_inner());
        let all = loop {
            // Checked with the lock held: a heartbeat counted after this check notifies only
            // after taking the lock, so after this thread waits on the condvar.
            if answered() {
                break true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            held = self
                .beats
                .cond
                .wait_timeout(held, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        drop(held);
        self.beats.waiters.fetch_sub(1, Ordering::SeqCst);
        all
    }

    /// Where every rank is: this one from its own record, every live peer from the heartbeat
    /// it sends when asked (within [`ASK_WAIT`]), the others from their last one; the peers this
    /// rank has no connection to are listed as "not connected".
    pub(crate) fn positions_text(&self) -> String {
        self.gather(ASK_WAIT);
        let mut apart = Vec::new();
        let all: Vec<_> = self
            .peers
            .iter()
            .filter_map(|p| {
                if p.rank == self.rank {
                    Some((p.rank, self.flight.position()))
                } else if !p.is_connected() {
                    apart.push(p.rank);
                    None
                } else {
                    Some((p.rank, p.remote_position()))
                }
            })
            .collect();
        with_apart(describe_positions(&all), &apart)
    }
}

/// `text` followed by the ranks in `apart` described as not connected.
fn with_apart(text: String, apart: &[usize]) -> String {
    if apart.is_empty() {
        return text;
    }
    let ranks: Vec<String> = apart.iter().map(usize::to_string).collect();
    let (noun, list) = if apart.len() == 1 {
        ("rank", ranks[0].clone())
    } else {
        ("ranks", ranks.join(", "))
    };
    format!("{text}; {noun} {list}: not connected")
}

#[cfg(test)]
mod tests {
    use super::with_apart;

    #[test]
    fn peers_without_a_connection_are_described_as_not_connected() {
        assert_eq!(
            with_apart("0 waits in #3 barrier".into(), &[]),
            "0 waits in #3 barrier"
        );
        assert_eq!(
            with_apart("0 waits in #3 barrier".into(), &[5]),
            "0 waits in #3 barrier; rank 5: not connected"
        );
        assert_eq!(
            with_apart("x".into(), &[2, 7]),
            "x; ranks 2, 7: not connected"
        );
    }
}

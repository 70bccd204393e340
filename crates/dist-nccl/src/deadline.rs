//! The deadline thread: one per process, it aborts every communicator whose watched work has
//! been pending past its timeout, deciding from host state alone.
//!
//! Why not the watchdog: the watchdog learns whether work completed by asking CUDA (event
//! queries and records), and a CUDA call can block. While `ncclCommAbort` of one communicator
//! frees host memory, the driver blocks every call on the context until the device is idle.
//! When one dead peer stalls two communicators of a device, the first one's abort therefore
//! waits for the second one's kernel, which only the second one's abort ends, while the second
//! one's watchdog sits in an event query behind the first abort. So the watchdog only *arms* a
//! [`Deadline`] (when it marks pending work) and disarms it (when the mark completes); this
//! thread, which makes no CUDA call, compares the time and starts the abort on a thread of its
//! own (an abort can take seconds, and must not hold up the others).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::shared::{Abort, Shared};
use crate::watchdog::WATCH_EVERY;

/// The pending-work clock of one communicator, shared by its watchdog (which arms and disarms
/// it) and the deadline thread (which reads it).
pub(crate) struct Deadline {
    /// When the oldest pending mark was recorded, in nanoseconds since [`epoch`] plus one; zero
    /// when nothing is pending.
    since: AtomicU64,
    /// The call the pending work belongs to, for the error.
    op: Mutex<&'static str>,
    timeout: Duration,
    /// Set once the abort was started, so it starts once.
    fired: AtomicBool,
    shared: OnceLock<Weak<Shared>>,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn stamp(at: Instant) -> u64 {
    let ns = at.saturating_duration_since(epoch()).as_nanos();
    u64::try_from(ns).unwrap_or(u64::MAX - 1) + 1
}

impl Deadline {
    pub(crate) fn new(timeout: Duration) -> Arc<Deadline> {
        Arc::new(Deadline {
            since: AtomicU64::new(0),
            op: Mutex::new("none"),
            timeout,
            fired: AtomicBool::new(false),
            shared: OnceLock::new(),
        })
    }

    /// Ties the clock to its communicator and has the deadline thread watch it.
    pub(crate) fn register(self: &Arc<Deadline>, shared: &Arc<Shared>) {
        let _ = self.shared.set(Arc::downgrade(shared));
        registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(self));
    }

    /// Work of `op` has been pending since `since` (the oldest pending mark); `None`: none is.
    pub(crate) fn set(&self, since: Option<Instant>, op: &'static str) {
        match since {
            Some(at) => {
                *self.op.lock().unwrap_or_else(|p| p.into_inner()) = op;
                self.since.store(stamp(at), Ordering::Release);
            }
            None => self.since.store(0, Ordering::Release),
        }
    }

    /// How long the pending work has been waiting past the timeout, if it has.
    fn overdue(&self, now: Instant) -> Option<Duration> {
        let since = self.since.load(Ordering::Acquire);
        if since == 0 {
            return None;
        }
        let waited = Duration::from_nanos(stamp(now).saturating_sub(since));
        (waited > self.timeout).then_some(waited)
    }

    /// Starts the abort on a thread of its own, once.
    fn fire(&self, waited: Duration) {
        if self.fired.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(shared) = self.shared.get().cloned() else {
            return;
        };
        let op = (*self.op.lock().unwrap_or_else(|p| p.into_inner())).to_string();
        abort_on_own_thread(shared, Abort::Timeout { op, waited });
    }

    /// The communicator this clock belongs to, while it lives.
    pub(crate) fn shared(&self) -> Option<Weak<Shared>> {
        self.shared.get().cloned()
    }
}

/// Aborts `shared` (if it still lives) on a thread of its own, which may wait: for a call inside
/// NCCL to return, and inside `ncclCommAbort` for every CUDA graph holding the communicator to
/// be destroyed (`shared.rs`).
pub(crate) fn abort_on_own_thread(shared: Weak<Shared>, why: Abort) {
    let started = std::thread::Builder::new()
        .name("dist-nccl-abort".into())
        .spawn(move || {
            crate::shared::mark_abort_thread();
            if let Some(shared) = shared.upgrade() {
                shared.abort_waiting(why);
            }
        });
    if let Err(e) = started {
        tracing::error!(error = %e, "cannot start a thread to abort a communicator");
    }
}

fn registry() -> &'static Mutex<Vec<Weak<Deadline>>> {
    static REGISTRY: OnceLock<Mutex<Vec<Weak<Deadline>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let started = std::thread::Builder::new()
            .name("dist-nccl-deadline".into())
            .spawn(run);
        if let Err(e) = started {
            // The watchdogs still abort for asynchronous errors, and every wait has its own
            // deadline; only the case described above is then unguarded.
            tracing::error!(error = %e, "cannot start the NCCL deadline thread");
        }
        Mutex::new(Vec::new())
    })
}

fn run() {
    loop {
        std::thread::sleep(WATCH_EVERY);
        let due: Vec<(Arc<Deadline>, Duration)> = {
            let mut list = registry().lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|d| d.strong_count() > 0);
            let now = Instant::now();
            list.iter()
                .filter_map(Weak::upgrade)
                .filter(|d| !d.fired.load(Ordering::Acquire))
                .filter_map(|d| d.overdue(now).map(|w| (d, w)))
                .collect()
        };
        for (d, waited) in due {
            d.fire(waited);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_overdue_only_while_armed_and_past_its_timeout() {
        let d = Deadline::new(Duration::from_millis(100));
        let now = Instant::now();
        assert_eq!(d.overdue(now), None, "nothing pending");
        d.set(Some(now), "all_reduce");
        assert_eq!(d.overdue(now + Duration::from_millis(50)), None);
        let late = d
            .overdue(now + Duration::from_millis(150))
            .expect("overdue");
        assert!(late >= Duration::from_millis(149), "{late:?}");
        assert_eq!(*d.op.lock().unwrap(), "all_reduce");
        d.set(None, "all_reduce");
        assert_eq!(d.overdue(now + Duration::from_secs(10)), None, "disarmed");
    }
}

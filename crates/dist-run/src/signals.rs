//! The launcher's signals: SIGINT, SIGTERM and SIGHUP caught while a `Caught` guard lives (a
//! run that forwards signals, or simulated hosts that must be deleted), counted, and sent on to
//! the ranks by the run loop; the dispositions the guard replaced come back when it drops.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// The signals a guard catches.
pub(crate) const CAUGHT: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The last signal caught (0: none yet).
static LAST: AtomicI32 = AtomicI32::new(0);
/// How many signals were caught in this process.
static COUNT: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Atomic stores are async-signal-safe; nothing else runs here.
    LAST.store(sig, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// How many of SIGINT, SIGTERM and SIGHUP arrived in this process while a guard lived.
pub fn received() -> usize {
    COUNT.load(Ordering::SeqCst)
}

/// The last of them, if any arrived.
pub fn last() -> Option<libc::c_int> {
    match LAST.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name (`SIGINT`), or its number.
pub fn name(sig: libc::c_int) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGKILL => "SIGKILL".into(),
        s => format!("signal {s}"),
    }
}

/// While it lives, [`CAUGHT`] are counted instead of ending the process.
#[derive(Debug)]
pub(crate) struct Caught {
    saved: Vec<(libc::c_int, libc::sighandler_t)>,
}

/// Starts catching [`CAUGHT`].
pub(crate) fn catch() -> Caught {
    let mut saved = Vec::new();
    for sig in CAUGHT {
        // SAFETY: `on_signal` only stores to atomics, which is async-signal-safe; the previous
        // disposition is kept and restored when the guard drops (the integration test
        // `sigint_and_sigterm_reach_every_rank` and the multirank target's trial
        // `hosts_interrupted_run_leaves_nothing` send signals to a launcher).
        let old = unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
        if old != libc::SIG_ERR {
            saved.push((sig, old));
        }
    }
    Caught { saved }
}

impl Drop for Caught {
    fn drop(&mut self) {
        // Guards nest (simulated hosts, then a run): the inner one restores the outer's handler.
        for (sig, old) in self.saved.drain(..).rev() {
            // SAFETY: restores the disposition `catch` replaced, which was a valid one.
            unsafe { libc::signal(sig, old) };
        }
    }
}

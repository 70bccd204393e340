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
pub(crate) struct Caught {
    /// Each signal with the whole disposition it had (handler, flags such as `SA_SIGINFO` and
    /// `SA_ONSTACK`, and mask), put back as it was when the guard drops.
    saved: Vec<(libc::c_int, libc::sigaction)>,
}

impl std::fmt::Debug for Caught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let signals: Vec<_> = self.saved.iter().map(|(s, _)| *s).collect();
        f.debug_struct("Caught").field("signals", &signals).finish()
    }
}

/// Starts catching [`CAUGHT`].
pub(crate) fn catch() -> Caught {
    let mut saved = Vec::new();
    for sig in CAUGHT {
        // SAFETY: `on_signal` takes one argument and is installed without `SA_SIGINFO`, and it
        // only stores to atomics, which is async-signal-safe. `new` and `old` are initialised
        // `sigaction`s (all-zero is a valid one: no handler flags, an empty mask) that outlive
        // the call. The whole previous disposition is kept in `old` and restored when the guard
        // drops (the unit test `a_siginfo_handler_keeps_its_flags`; the integration test
        // `sigint_and_sigterm_reach_every_rank` and the multirank target's trial
        // `hosts_interrupted_run_leaves_nothing` send signals to a launcher).
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            new.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut new.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &new, &mut old) == 0 {
                saved.push((sig, old));
            }
        }
    }
    Caught { saved }
}

impl Drop for Caught {
    fn drop(&mut self) {
        // Guards nest (simulated hosts, then a run): the inner one restores the outer's handler.
        for (sig, old) in self.saved.drain(..).rev() {
            // SAFETY: restores, flags and mask included, the disposition the kernel gave back
            // in `catch`, which was a valid one (the unit test
            // `a_siginfo_handler_keeps_its_flags` checks a `SA_SIGINFO | SA_ONSTACK` handler
            // comes back with its flags).
            unsafe { libc::sigaction(sig, &old, std::ptr::null_mut()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" fn three_args(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

    /// The disposition of `sig` now.
    fn current(sig: libc::c_int) -> libc::sigaction {
        // SAFETY: reads the disposition only, into an initialised struct that outlives the call.
        unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut cur), 0);
            cur
        }
    }

    /// A three-argument handler installed with `SA_SIGINFO` (as signal-hook's safe API does)
    /// comes back with its flags and mask after a guard, so the kernel still calls it with a
    /// `siginfo_t`. (SIGHUP: no other test in this binary takes a guard.)
    #[test]
    fn a_siginfo_handler_keeps_its_flags() {
        let sig = libc::SIGHUP;
        // SAFETY: test setup; the handler does nothing, SIGHUP is not raised, and the default
        // disposition is put back at the end.
        let before = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = three_args as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaddset(&mut sa.sa_mask, libc::SIGUSR2);
            assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
            current(sig)
        };
        let guard = catch();
        assert_eq!(
            current(sig).sa_sigaction,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            "the guard catches the signal"
        );
        drop(guard);
        let after = current(sig);
        // SAFETY: puts the default disposition back; nothing raises SIGHUP meanwhile.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
        assert_eq!(
            after.sa_sigaction, three_args as *const () as usize,
            "the handler is restored"
        );
        let flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        assert_eq!(
            after.sa_flags & flags,
            flags,
            "SA_SIGINFO or SA_ONSTACK lost: flags {:#x}",
            after.sa_flags
        );
        assert_eq!(after.sa_flags, before.sa_flags, "the flags are restored");
        // SAFETY: reads a mask the kernel filled in.
        let usr2 = unsafe { libc::sigismember(&after.sa_mask, libc::SIGUSR2) };
        assert_eq!(usr2, 1, "the handler's mask is restored");
    }
}

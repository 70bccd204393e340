//! Who is inside a call on a group, and the threads that run its async work.
//!
//! A group takes calls from one thread at a time. Each thread has a token; a call (a blocking
//! collective, or a [`Scope`](super::Scope), which holds the group for as long as it is open)
//! claims the group by writing its token and its kind into one word. A call from another thread
//! that finds the word taken marks it and fails at once; the call that holds it sees the mark as
//! it leaves, and fails too. A call from the thread that holds the group through a scope waits
//! until the scope's queued work has run, then runs (issue order). The work a scope queues runs
//! on the group's executor threads, under the scope's claim.
//!
//! Owned work ([`Collectives::all_reduce_owned`](crate::Collectives::all_reduce_owned)) claims
//! the group for the thread that issues it, as a call of kind [`OWNED_KIND`], and keeps the
//! claim until the last owned work queued has ended (the count and the release under one
//! lock, so that an issue and the last end never cross). A later call of the same thread
//! waits for that (issue order) and claims the group afresh; one of another thread meanwhile is
//! refused, as any call is while another thread's is inside.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

use crate::collectives::Kind;
use crate::error::{DistError, Result};

/// The kind code that marks a scope in the occupant word (no collective has it).
pub(crate) const SCOPE_KIND: u8 = 0xff;

/// The kind code that marks owned work in the occupant word (no collective has it).
pub(crate) const OWNED_KIND: u8 = 0xfe;

/// Bits of the occupant word below the token: the kind (8) and the refused mark (1).
const TOKEN_SHIFT: u32 = 9;
const REFUSED: u64 = 1;

thread_local! {
    /// This thread's token (never 0, which marks a free group).
    static TOKEN: u64 = {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    };
    /// Whether this thread is running a scope's work on an executor (under the scope's claim).
    static EXECUTING: Cell<bool> = const { Cell::new(false) };
}

fn token() -> u64 {
    TOKEN.with(|t| *t)
}

/// Runs `f` as a scope's work: the calls it makes are under the scope's claim.
pub(crate) fn executing<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            EXECUTING.with(|e| e.set(self.0));
        }
    }
    let _reset = Reset(EXECUTING.with(|e| e.replace(true)));
    f()
}

/// How a call entered the group ([`Occupancy::enter`]); given back to [`Occupancy::leave`].
#[derive(Debug)]
#[must_use]
pub(crate) enum Entry {
    /// This call claimed the group and frees it as it leaves.
    Claimed,
    /// This thread already held the group (its scope is open): nothing to free.
    Held,
    /// A scope's work, on an executor: it runs under the scope's claim.
    Executor,
}

/// The three threads a group's async work runs on, one rayon pool of one thread each:
/// collectives in issue order on one, sends in issue order on another, receives on the third
/// (so that a receive waiting for its message never holds up a send, nor a send a receive).
pub(crate) struct Executors {
    pub(crate) collectives: rayon::ThreadPool,
    pub(crate) sends: rayon::ThreadPool,
    pub(crate) recvs: rayon::ThreadPool,
}

/// A group's occupant, its queued async work and its executors.
#[derive(Default)]
pub(crate) struct Occupancy {
    /// `token << 9 | kind << 1 | refused`, 0 when no call is inside.
    word: AtomicU64,
    /// Async collectives queued and not yet finished.
    pending: Mutex<Pending>,
    drained: Condvar,
    executors: OnceLock<std::result::Result<Executors, String>>,
}

impl std::fmt::Debug for Occupancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Occupancy")
            .field("word", &self.word.load(Ordering::Relaxed))
            .finish()
    }
}

/// The async collectives queued on a group and not yet finished.
#[derive(Default)]
struct Pending {
    /// All of them: a scope's and owned work.
    all: usize,
    /// Owned work: while there is some, the group is claimed for it.
    owned: usize,
}

fn kind_text(code: u8) -> &'static str {
    if code == SCOPE_KIND {
        return "an async scope (its queued work)";
    }
    if code == OWNED_KIND {
        return "owned async work (queued, not yet ended)";
    }
    Kind::from_code(code).map_or("a collective", Kind::name)
}

impl Occupancy {
    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        // Only counts are updated under the lock; a panic leaves it whole.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enters a call of kind `kind` (a [`Kind`] code, or [`SCOPE_KIND`]) on rank `rank`:
    /// claims the group, or finds this thread holding it (then, with `drain`, waits until the
    /// scope's queued work has run), or fails at once with [`DistError::ConcurrentUse`] when
    /// another thread holds it, marking the word so that the holder fails too.
    pub(crate) fn enter(
        &self,
        rank: usize,
        kind: u8,
        drain: bool,
        op: impl FnOnce() -> String,
    ) -> Result<Entry> {
        if EXECUTING.with(Cell::get) {
            return Ok(Entry::Executor);
        }
        let me = token();
        let mine = me << TOKEN_SHIFT | u64::from(kind) << 1;
        let mut cur = 0;
        loop {
            match self.word.compare_exchange(
                cur,
                if cur == 0 { mine } else { cur | REFUSED },
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(0) => return Ok(Entry::Claimed),
                Ok(_) => {
                    let other = kind_text(((cur >> 1) & 0xff) as u8);
                    return Err(DistError::ConcurrentUse {
                        rank,
                        op: op(),
                        detail: format!("another thread is inside {other} on this group"),
                    });
                }
                Err(now)
                    if now >> TOKEN_SHIFT == me && (now >> 1) & 0xff == u64::from(OWNED_KIND) =>
                {
                    // This thread's owned work holds the group: this call comes after it
                    // (issue order), and then claims the group as any call does.
                    self.wait_drained();
                    cur = 0;
                }
                Err(now) if now >> TOKEN_SHIFT == me => {
                    if drain {
                        self.wait_drained();
                    }
                    return Ok(Entry::Held);
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Leaves a call entered with [`Occupancy::enter`]; whether another thread's call was
    /// refused while this one held the group (then this one must fail too).
    pub(crate) fn leave(&self, entry: Entry) -> bool {
        match entry {
            Entry::Claimed => self.word.swap(0, Ordering::AcqRel) & REFUSED != 0,
            Entry::Held | Entry::Executor => false,
        }
    }

    /// The error of a call that held the group while another thread's call was refused.
    pub(crate) fn refused_meanwhile(rank: usize, op: String) -> DistError {
        DistError::ConcurrentUse {
            rank,
            op,
            detail: "another thread called into this group while this call ran (that call was \
                     refused and the group aborted)"
                .into(),
        }
    }

    /// One more async collective is queued.
    pub(crate) fn queued(&self) {
        self.lock_pending().all += 1;
    }

    /// An async collective has finished.
    pub(crate) fn finished(&self) {
        let mut p = self.lock_pending();
        p.all = p.all.saturating_sub(1);
        if p.all == 0 {
            self.drained.notify_all();
        }
    }

    /// Queues one piece of owned work of this thread's: claims the group for it (or finds this
    /// thread holding it: its owned work, or its open scope), counted until
    /// [`Occupancy::owned_finished`]. Fails at once with [`DistError::ConcurrentUse`] when
    /// another thread holds it, marking the word so that the holder fails too.
    pub(crate) fn owned_queued(&self, rank: usize, op: impl FnOnce() -> String) -> Result<()> {
        let mut p = self.lock_pending();
        let me = token();
        let mine = me << TOKEN_SHIFT | u64::from(OWNED_KIND) << 1;
        let mut cur = 0;
        loop {
            match self.word.compare_exchange(
                cur,
                if cur == 0 { mine } else { cur | REFUSED },
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(0) => break,
                Ok(_) => {
                    let other = kind_text(((cur >> 1) & 0xff) as u8);
                    return Err(DistError::ConcurrentUse {
                        rank,
                        op: op(),
                        detail: format!("another thread is inside {other} on this group"),
                    });
                }
                Err(now) if now >> TOKEN_SHIFT == me => break,
                Err(now) => cur = now,
            }
        }
        p.all += 1;
        p.owned += 1;
        Ok(())
    }

    /// A piece of owned work has ended: the last frees the group if its claim is owned work's
    /// (not a scope that was open when it was queued, whose end frees it).
    pub(crate) fn owned_finished(&self) {
        let mut p = self.lock_pending();
        p.all = p.all.saturating_sub(1);
        p.owned = p.owned.saturating_sub(1);
        if p.owned == 0 {
            let w = self.word.load(Ordering::Acquire);
            if w != 0 && (w >> 1) & 0xff == u64::from(OWNED_KIND) {
                self.word.store(0, Ordering::Release);
            }
        }
        if p.all == 0 {
            self.drained.notify_all();
        }
    }

    /// Whether a call is inside the group (for tests that need one to be).
    #[cfg(test)]
    pub(crate) fn occupied(&self) -> bool {
        self.word.load(Ordering::Acquire) != 0
    }

    /// The async collectives queued and not yet finished.
    pub(crate) fn pending(&self) -> usize {
        self.lock_pending().all
    }

    /// Waits until no async collective is queued. Each ends by its own deadline, so this does.
    pub(crate) fn wait_drained(&self) {
        let mut p = self.lock_pending();
        while p.all > 0 {
            p = self.drained.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The group's executors, started on first use; an error naming why they could not be.
    pub(crate) fn executors(&self, rank: usize) -> Result<&Executors> {
        let built = self.executors.get_or_init(|| {
            let pool = |what: &'static str| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(move |_| format!("dist-{what}-{rank}"))
                    .start_handler(|_| super::WORK_THREAD.set(true))
                    .build()
                    .map_err(|e| format!("{what} thread: {e}"))
            };
            Ok(Executors {
                collectives: pool("work")?,
                sends: pool("isend")?,
                recvs: pool("irecv")?,
            })
        });
        built.as_ref().map_err(|e| DistError::Io {
            rank,
            context: "start the group's async work threads".into(),
            source: std::io::Error::other(e.clone()),
        })
    }
}

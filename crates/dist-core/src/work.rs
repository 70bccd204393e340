//! Async work: collectives and point-to-point messages that run while the caller computes,
//! each returning a [`Work`] handle.
//!
//! Work is issued inside a [`Scope`], opened with
//! [`Collectives::scope`](crate::Collectives::scope) in the style of `std::thread::scope`:
//! every buffer handed to the scope's calls stays borrowed until the scope ends (or until its
//! work's [`Work::wait`] gives it back), and the scope waits for all of its work before it
//! returns. That, not the handles' `Drop`, is what keeps the buffers safe: a handle that is
//! leaked (`mem::forget`) leaves its work running, and the scope still waits for it.
//!
//! ```
//! use std::time::Duration;
//! use dist_core::testing::run_group;
//! use dist_core::{Backend, Collectives, ReduceOp, Tuning};
//!
//! let results = run_group(3, |_| Tuning::default(), Duration::from_secs(10), |g| {
//!     let mut grads = vec![vec![g.rank() as f32; 1000]; 4];
//!     g.scope(|s| {
//!         // Each bucket's all_reduce starts as soon as it is issued and runs beside the
//!         // computation of the next bucket.
//!         let mut work = Vec::new();
//!         for bucket in grads.iter_mut() {
//!             bucket.iter_mut().for_each(|x| *x += 1.0); // "compute" the bucket
//!             work.push(s.all_reduce(bucket, ReduceOp::Sum));
//!         }
//!         for w in work {
//!             let bucket = w.wait()?; // the buffer back, reduced
//!             assert_eq!(bucket[0], 6.0); // (0+1) + (1+1) + (2+1)
//!         }
//!         Ok(())
//!     })
//! });
//! assert!(results.into_iter().all(|r| r.is_ok()));
//! ```
//!
//! The compiler enforces the borrows. A buffer cannot be touched while its work may run:
//!
//! ```compile_fail
//! # use std::time::Duration;
//! # use dist_core::{testing::MemLink, Collectives, Group, ReduceOp, Tuning};
//! # let link = MemLink::mesh(1).remove(0);
//! # let g = Group::form(link, Tuning::default(), Duration::from_secs(1)).unwrap();
//! let mut x = vec![1.0f32; 8];
//! g.scope(|s| {
//!     let w = s.all_reduce(&mut x, ReduceOp::Sum);
//!     x[0] = 2.0; // error: `x` is borrowed by the scope
//!     w.wait().map(|_| ())
//! })?;
//! # Ok::<(), dist_core::DistError>(())
//! ```
//!
//! a handle cannot leave its scope:
//!
//! ```compile_fail
//! # use std::time::Duration;
//! # use dist_core::{testing::MemLink, Collectives, Group, ReduceOp, Tuning};
//! # let link = MemLink::mesh(1).remove(0);
//! # let g = Group::form(link, Tuning::default(), Duration::from_secs(1)).unwrap();
//! let w = g.scope(|s| Ok(s.barrier()))?; // error: the handle borrows the scope
//! # Ok::<(), dist_core::DistError>(())
//! ```
//!
//! and a scope cannot be used from another thread (the order of its work is one thread's):
//!
//! ```compile_fail
//! # use std::time::Duration;
//! # use dist_core::{testing::MemLink, Collectives, Group, ReduceOp, Tuning};
//! # let link = MemLink::mesh(1).remove(0);
//! # let g = Group::form(link, Tuning::default(), Duration::from_secs(1)).unwrap();
//! g.scope(|s| {
//!     std::thread::scope(|t| {
//!         t.spawn(|| s.barrier()); // error: `Scope` is not `Sync`
//!     });
//!     Ok(())
//! })?;
//! # Ok::<(), dist_core::DistError>(())
//! ```
//!
//! The same programs without the offending line compile and run:
//!
//! ```
//! # use std::time::Duration;
//! # use dist_core::{testing::MemLink, Collectives, Group, ReduceOp, Tuning};
//! # let link = MemLink::mesh(1).remove(0);
//! # let g = Group::form(link, Tuning::default(), Duration::from_secs(1)).unwrap();
//! let mut x = vec![1.0f32; 8];
//! g.scope(|s| {
//!     let w = s.all_reduce(&mut x, ReduceOp::Sum);
//!     let x = w.wait()?; // the buffer back
//!     x[0] = 2.0;
//!     s.barrier().wait()
//! })?;
//! x[0] += 1.0; // the scope has ended
//! # Ok::<(), dist_core::DistError>(())
//! ```
//!
//! Where it runs: the group's collectives run in issue order on one executor thread of the
//! group, its sends in issue order on a second and its receives in issue order on a third, so a
//! receive waiting for its message holds up neither a send nor a collective. Different groups
//! have their own executors: their work runs at once. Each piece's deadline (the scope's
//! timeout) starts when it starts to run.
//!
//! Threads: a group takes calls from one thread at a time; a scope holds its group for as long
//! as it is open. See [`Collectives`](crate::Collectives) for the rule.
//!
//! Outside a scope, [`Collectives::all_reduce_owned`](crate::Collectives::all_reduce_owned)
//! takes its buffer by value and returns a `Work<'static, Vec<T>>` that borrows nothing: it can
//! be kept past the call that issued it and waited on anywhere (the backward-hook pattern).

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{DistError, Result};

mod occupancy;
mod owned;
mod scope;

pub(crate) use occupancy::Occupancy;
pub(crate) use owned::all_reduce_owned;

thread_local! {
    /// Set on the threads that run a group's async work.
    static WORK_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is one of the threads that run groups' async work. A transport waiting
/// for a message there should sleep rather than spin: the thread that issued the work is
/// computing beside it, and a spinning wait would take that computation's core.
pub fn on_work_thread() -> bool {
    WORK_THREAD.get()
}
pub use scope::Scope;
pub(crate) use scope::scope;

/// Where a piece of work is.
enum State<R> {
    /// Queued or running.
    Running,
    /// Finished, its result not yet taken.
    Done(Result<R>),
    /// Finished, its result taken by [`Work::wait`].
    Taken,
}

/// What a piece of work and its handle share: its state and a condition variable to wait on.
pub(crate) struct Slot<R> {
    state: Mutex<State<R>>,
    ended: Condvar,
}

impl<R> Slot<R> {
    pub(crate) fn new() -> Slot<R> {
        Slot {
            state: Mutex::new(State::Running),
            ended: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<R>> {
        // The state is replaced whole under the lock; a panic cannot leave half of it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error of a wait that finds no result (never, while the handle lives: it is the
    /// only taker, and waits until the work has ended).
    fn gone() -> DistError {
        DistError::InvalidArgument {
            rank: usize::MAX,
            op: "wait for async work".into(),
            reason: "its result was already taken".into(),
        }
    }

    /// The work has ended with `r`; `also` runs before anyone waiting on this slot can see
    /// it (the group's count of queued work goes down first).
    pub(crate) fn complete(&self, r: Result<R>, also: impl FnOnce()) {
        let mut st = self.lock();
        *st = State::Done(r);
        also();
        drop(st);
        self.ended.notify_all();
    }

    /// Waits until the work has ended, or until `deadline` (`None`: no deadline); the state
    /// then (still `Running` only if the deadline passed first).
    fn wait_until(&self, deadline: Option<Instant>) -> MutexGuard<'_, State<R>> {
        let mut st = self.lock();
        while matches!(*st, State::Running) {
            st = match deadline {
                None => self.ended.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    self.ended
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        st
    }
}

/// A piece of work as its scope sees it, whatever its result's type: the scope waits for every
/// one, and reports the error of any whose handle did not take it.
pub(crate) trait Issued: Send + Sync {
    /// Whether its result has been taken by [`Work::wait`].
    fn taken(&self) -> bool;
    /// Waits for it to end; its error, if it failed and no handle took the result.
    fn unclaimed_error(&self) -> Option<DistError>;
}

impl<R: Send> Issued for Slot<R> {
    fn taken(&self) -> bool {
        matches!(*self.lock(), State::Taken)
    }

    fn unclaimed_error(&self) -> Option<DistError> {
        let mut st = self.wait_until(None);
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(Err(e)) => Some(e),
            // An unclaimed result stays where it was (a buffer, given back to nobody).
            other => {
                *st = other;
                None
            }
        }
    }
}

/// A handle to one piece of async work: a collective, a send or a receive issued in a
/// [`Scope`], or owned work
/// ([`Collectives::all_reduce_owned`](crate::Collectives::all_reduce_owned)).
/// [`Work::wait`] gives its result (for work that fills a buffer, the buffer back); its error,
/// if it failed, comes from there too.
///
/// A scope's work: dropping a handle whose work has not ended **waits** for the work to end
/// (nothing is cancelled: the other ranks are part of the same collective). The result of a
/// dropped handle's work is not lost: if it failed and nobody took the error, the scope
/// returns it. Leaking a handle (`mem::forget`) is safe: its work still runs, and its scope
/// waits for it. `'s` is the scope's own lifetime: a handle cannot outlive its scope.
///
/// Owned work (`Work<'static, Vec<T>>`): the work owns its buffer and a share of its group, so
/// the handle borrows nothing and may be kept anywhere. Dropping it unwaited neither waits nor
/// cancels: the work runs to its end (its deadline bounds it) and frees the buffer then; a
/// failure is not lost, since it aborts the group as any collective's does, and the group's
/// next call reports it.
#[must_use = "work runs to its end whatever happens to the handle; wait on it for its result"]
pub struct Work<'s, R = ()> {
    slot: Option<Arc<Slot<R>>>,
    /// Whether dropping the handle waits for the work (a scope's work, whose buffers are
    /// borrowed) or lets it run on (owned work, which owns what it uses).
    wait_on_drop: bool,
    _scope: PhantomData<&'s ()>,
}

impl<R> std::fmt::Debug for Work<'_, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<'s, R> Work<'s, R> {
    pub(crate) fn new(slot: Arc<Slot<R>>) -> Work<'s, R> {
        Work {
            slot: Some(slot),
            wait_on_drop: true,
            _scope: PhantomData,
        }
    }

    /// A handle whose drop does not wait: for owned work.
    pub(crate) fn detached(slot: Arc<Slot<R>>) -> Work<'s, R> {
        Work {
            slot: Some(slot),
            wait_on_drop: false,
            _scope: PhantomData,
        }
    }

    /// Waits until the work has ended and returns its result: for a collective or receive that
    /// fills a buffer, that buffer (borrowed again for the rest of the scope), for the others
    /// `()`. A failed work's error: the same the blocking call would have returned.
    pub fn wait(mut self) -> Result<R> {
        let Some(slot) = self.slot.take() else {
            return Err(Slot::<R>::gone());
        };
        let mut st = slot.wait_until(None);
        match std::mem::replace(&mut *st, State::Taken) {
            State::Done(r) => r,
            // A handle is the only taker while it lives, and it waits until the work ends.
            State::Running | State::Taken => Err(Slot::<R>::gone()),
        }
    }

    /// Waits at most `timeout` for the work to end: `Ok` with its result (as [`Work::wait`])
    /// if it did, else `Err` with this handle back, the work still running (a timeout here
    /// loses nothing; the work keeps its own deadline).
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<R>, Self> {
        let deadline = Instant::now().checked_add(timeout);
        let ended = match &self.slot {
            Some(slot) => !matches!(*slot.wait_until(deadline), State::Running),
            None => true,
        };
        if ended { Ok(self.wait()) } else { Err(self) }
    }

    /// Whether the work has ended (successfully or not); [`Work::wait`] then returns at once.
    pub fn is_completed(&self) -> bool {
        self.slot
            .as_ref()
            .is_none_or(|s| !matches!(*s.lock(), State::Running))
    }
}

impl<R> Drop for Work<'_, R> {
    /// Waits for a scope's work to end; lets owned work run on (see [`Work`]).
    fn drop(&mut self) {
        if !self.wait_on_drop {
            return;
        }
        if let Some(slot) = self.slot.take() {
            let mut st = slot.wait_until(None);
            // A success nobody will take is done with: marked taken, so that the scope prunes
            // its slot (a long scope dropping its handles otherwise kept one per piece of
            // work). A failure stays for the scope to return.
            if matches!(*st, State::Done(Ok(_))) {
                *st = State::Taken;
            }
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_concurrency;
#[cfg(test)]
mod tests_owned;

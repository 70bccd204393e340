//! What a communicator, its watchdog and its groups share: the NCCL handle behind one lock,
//! under which every NCCL call on it runs, why it was aborted, and the streams it enqueued on.
//!
//! The rules this file upholds come from NCCL's documentation:
//! - Thread safety (docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/threadsafety.html):
//!   "it is not allowed to issue NCCL operations to a single communicator in parallel with
//!   multiple threads"; "it is safe to operate a communicator from multiple threads as long as
//!   users can guarantee only one thread operates the communicator at a time"; "for any grouped
//!   NCCL operations, users need to ensure only one thread issues all the operations in the
//!   group". Hence: every call runs with [`Shared::lock`] held, and a thread that opened a group
//!   owns the communicator (`State::owner`) until its `ncclGroupEnd`.
//! - Nonblocking communicators (ncclCommGetAsyncError in the API reference, and nccl4py's
//!   `get_async_error`): "If any NCCL function returns ncclInProgress, users must query the
//!   communicator state until it becomes ncclSuccess before calling another NCCL function."
//!   Hence: an `ncclInProgress` is polled with the lock still held, and within a deadline.
//! - `ncclCommAbort` is an NCCL call on the communicator like any other; nothing in the
//!   documentation allows it while another thread is inside a call on the same communicator.
//!   Hence: [`Shared::abort_locked`] runs with the lock held (so no thread is inside NCCL on
//!   this communicator), and never while a group is open over it (the group's ops reference the
//!   communicator until `ncclGroupEnd`): then the abort is deferred to the group's end.

use std::cell::Cell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use dist_nccl_sys::{Library as Nccl, ncclComm_t, ncclResult_t};

use crate::deadline::Deadline;
use crate::error::{NcclCode, NcclError, Result};

thread_local! {
    /// Whether this thread exists to abort (`deadline::abort_on_own_thread`): there an abort
    /// may wait for the communicator's CUDA graphs to be dropped.
    static ABORT_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as one that exists to abort.
pub(crate) fn mark_abort_thread() {
    ABORT_THREAD.with(|t| t.set(true));
}

/// Why a communicator was aborted.
#[derive(Clone, Debug)]
pub(crate) enum Abort {
    Timeout {
        op: String,
        waited: Duration,
    },
    Error(String),
    User,
    /// [`crate::Communicator::revoke`]: the calls' handle is revoked (`ncclCommRevoke`) where
    /// the library has it, not aborted.
    Revoked(String),
}

impl Abort {
    pub(crate) fn reason(&self) -> String {
        match self {
            Abort::Timeout { op, waited } => format!("{op} made no progress for {waited:.1?}"),
            Abort::Error(e) => e.clone(),
            Abort::User => "abort() was called".into(),
            Abort::Revoked(r) => format!("revoked: {r}"),
        }
    }
}

/// A stream the communicator enqueued on, and how many calls it enqueued there.
pub(crate) struct Used {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) enqueued: u64,
}

/// The state behind the lock.
pub(crate) struct State {
    /// The NCCL handle of the calls; valid while `aborted` is `None`, and while `revoked`
    /// (then only for a shrink, or to be freed); null once shrunk.
    pub(crate) comm: ncclComm_t,
    /// The nonblocking communicator `comm` was split from (null if none): only splits and
    /// shrinks run on it (`split.rs`, `shrink.rs`), under this same lock. It has no work of the
    /// calls, so it outlives their abort, for a shrink; freed by [`Shared::release_kept`]
    /// (at the drop or the shrink).
    pub(crate) nb: ncclComm_t,
    /// The nonblocking communicator whose resources `comm` shares (it connected every pair of
    /// ranks when the communicator formed, see `connect.rs`; null if none); never used after
    /// that, and aborted after `comm`.
    pub(crate) sharing: ncclComm_t,
    pub(crate) aborted: Option<Abort>,
    /// `comm` was revoked (`ncclCommRevoke`), not aborted: its work is stopped and it is never
    /// used for a call again, but it is still allocated (a shrink may run on it where `nb` is
    /// null), until [`Shared::release_kept`] aborts it.
    pub(crate) revoked: bool,
    /// The thread whose open group holds the communicator: other threads' calls wait for the
    /// group to end, and an abort meanwhile is deferred into `deferred`.
    pub(crate) owner: Option<ThreadId>,
    pub(crate) deferred: Option<Abort>,
    /// Threads waiting for a group to release the communicator (notified only when some are,
    /// so a group's end costs no futex wake when none waits).
    waiters: usize,
    /// The last call enqueued, for timeout messages.
    pub(crate) last_op: &'static str,
    /// Every stream work was enqueued on; the first is the communicator's own.
    pub(crate) streams: Vec<Used>,
}

impl State {
    /// One more enqueue on `stream` (a call, or a graph's replay), for the watchdog and for
    /// the drop; allocates only on a stream's first use.
    pub(crate) fn note_enqueued(&mut self, stream: &Arc<CudaStream>) {
        let cu = stream.cu_stream();
        match self.streams.iter_mut().find(|u| u.stream.cu_stream() == cu) {
            Some(u) => u.enqueued += 1,
            None => self.streams.push(Used {
                stream: stream.clone(),
                enqueued: 1,
            }),
        }
    }
}

// SAFETY: `ncclComm_t` is a pointer NCCL lets any thread use, one thread at a time (thread
// safety page quoted above). The handle is only ever used with the `Mutex<State>` around it held
// (see `Shared::lock` and every caller), so one thread at a time uses it.
unsafe impl Send for State {}

/// What the communicator, its watchdog, its `Ops` and its groups share.
pub(crate) struct Shared {
    pub(crate) nccl: Arc<Nccl>,
    state: Mutex<State>,
    /// Signalled when a group releases the communicator.
    freed: Condvar,
    pub(crate) who: String,
    pub(crate) timeout: Duration,
    pub(crate) stop: Mutex<bool>,
    pub(crate) wake: Condvar,
    pub(crate) stream: Arc<CudaStream>,
    /// An abort asked for while a thread was inside NCCL (holding the lock): whoever takes the
    /// lock next applies it, so asking never waits behind a call.
    requested: Mutex<Option<Abort>>,
    requested_any: AtomicBool,
    /// The first abort decided (asked for, or applied), set before `ncclCommAbort` runs: calls
    /// and synchronizes refuse from then on, without waiting for the abort (which takes NCCL
    /// about a second) to finish under the lock.
    pub(crate) doomed: OnceLock<Abort>,
    /// The pending-work clock the watchdog arms and the deadline thread reads
    /// (`deadline.rs`).
    pub(crate) deadline: Arc<Deadline>,
    /// CUDA graphs holding NCCL work of the communicator, captured or being captured
    /// (`capture.rs`). While there are any, `ncclCommAbort` waits inside NCCL until they are
    /// all destroyed, so an abort runs on a thread of its own and a call waiting for the lock
    /// gives up once an abort is decided.
    pub(crate) graphs: AtomicUsize,
    /// An abort was handed to a thread of its own (once).
    abort_spawned: AtomicBool,
}

impl Shared {
    pub(crate) fn new(
        nccl: Arc<Nccl>,
        comm: ncclComm_t,
        who: String,
        timeout: Duration,
        stream: Arc<CudaStream>,
    ) -> Shared {
        Shared {
            nccl,
            state: Mutex::new(State {
                comm,
                nb: std::ptr::null_mut(),
                sharing: std::ptr::null_mut(),
                aborted: None,
                revoked: false,
                owner: None,
                deferred: None,
                waiters: 0,
                last_op: "none",
                streams: vec![Used {
                    stream: stream.clone(),
                    enqueued: 0,
                }],
            }),
            freed: Condvar::new(),
            who,
            timeout,
            stop: Mutex::new(false),
            wake: Condvar::new(),
            stream,
            requested: Mutex::new(None),
            requested_any: AtomicBool::new(false),
            doomed: OnceLock::new(),
            deadline: Deadline::new(timeout),
            graphs: AtomicUsize::new(0),
            abort_spawned: AtomicBool::new(false),
        }
    }

    /// Aborts now if no thread is inside NCCL on the communicator; else records the abort for
    /// whoever takes the lock next (the call's own thread, another caller or the watchdog), so
    /// that it never waits behind a call.
    pub(crate) fn request_abort(&self, why: Abort) {
        let _ = self.doomed.set(why.clone());
        match self.try_lock() {
            Some(mut st) => self.abort_locked(&mut st, why),
            None => {
                {
                    // The flag changes only with `requested` locked, so it never disagrees
                    // with what is stored there.
                    let mut r = self.requested.lock().unwrap_or_else(|p| p.into_inner());
                    r.get_or_insert(why);
                    self.requested_any.store(true, Ordering::Release);
                }
                // The holder may have released the lock meanwhile: apply it if we can now.
                if let Some(mut st) = self.try_lock() {
                    self.apply_requested(&mut st);
                }
            }
        }
    }

    /// Aborts, waiting for a thread inside NCCL on the communicator to return first (never
    /// aborting under it); for a thread of its own (the deadline thread's), which may wait.
    pub(crate) fn abort_waiting(&self, why: Abort) {
        let _ = self.doomed.set(why.clone());
        let mut st = self.lock();
        self.apply_requested(&mut st);
        self.abort_locked(&mut st, why);
    }

    /// Applies an abort asked for while the lock was held (see `request_abort`).
    pub(crate) fn apply_requested(&self, st: &mut State) {
        if self.requested_any.load(Ordering::Acquire) {
            let why = {
                let mut r = self.requested.lock().unwrap_or_else(|p| p.into_inner());
                self.requested_any.store(false, Ordering::Release);
                r.take()
            };
            if let Some(why) = why {
                self.abort_locked(st, why);
            }
        }
    }

    /// The state, locked. Poisoning is ignored: the state is updated only by assignments that
    /// cannot be left half-done.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn aborted_error(&self, op: &str, why: &Abort) -> NcclError {
        match why {
            Abort::Timeout { op: slow, waited } => NcclError::Timeout {
                comm: self.who.clone(),
                op: format!("{op} (after {slow})"),
                waited: *waited,
            },
            other => NcclError::Aborted {
                comm: self.who.clone(),
                op: op.to_string(),
                reason: other.reason(),
            },
        }
    }

    /// The lock if no one holds it now (the watchdog's way in: it never waits behind a call).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The lock, for a call by this thread: waits (within the timeout) while another thread's
    /// group holds the communicator, and refuses once it was aborted.
    pub(crate) fn lock_for_call(&self, op: &str) -> Result<MutexGuard<'_, State>> {
        if let Some(why) = self.doomed.get() {
            return Err(self.aborted_error(op, why));
        }
        let st = self.lock_between_groups(op)?;
        if let Some(why) = &st.aborted {
            return Err(self.aborted_error(op, why));
        }
        Ok(st)
    }

    /// The lock, with an abort asked for meanwhile applied and no other thread's group open
    /// (waited for within the timeout); an aborted communicator is not refused (a shrink runs
    /// on the handles its abort kept).
    pub(crate) fn lock_between_groups(&self, op: &str) -> Result<MutexGuard<'_, State>> {
        let mut st = if self.graphs.load(Ordering::Acquire) == 0 {
            self.lock()
        } else {
            self.lock_unless_doomed(op)?
        };
        self.apply_requested(&mut st);
        if let Some(owner) = st.owner
            && owner != std::thread::current().id()
        {
            let started = Instant::now();
            while st.owner.is_some() {
                let left = self.timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    return Err(NcclError::Timeout {
                        comm: self.who.clone(),
                        op: format!("{op} (waiting for another thread's group to end)"),
                        waited: started.elapsed(),
                    });
                }
                st.waiters += 1;
                st = self
                    .freed
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                st.waiters -= 1;
            }
        }
        Ok(st)
    }

    /// The lock, waited for only until an abort is decided: while the communicator has CUDA
    /// graphs, the thread holding it may be an abort that waits inside NCCL for those graphs to
    /// be dropped, perhaps by this thread.
    fn lock_unless_doomed(&self, op: &str) -> Result<MutexGuard<'_, State>> {
        let mut spins = 0u32;
        loop {
            if let Some(st) = self.try_lock() {
                return Ok(st);
            }
            if let Some(why) = self.doomed.get() {
                return Err(self.aborted_error(op, why));
            }
            spins += 1;
            if spins < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Releases a group's hold on the communicator and applies an abort deferred meanwhile.
    pub(crate) fn release(&self, st: &mut State) {
        st.owner = None;
        if let Some(why) = st.deferred.take() {
            self.abort_locked(st, why);
        }
        if st.waiters > 0 {
            self.freed.notify_all();
        }
    }

    /// Runs one NCCL call on the live communicator, under the lock, and settles an
    /// `ncclInProgress` (polling, within the timeout) before the lock is released.
    pub(crate) fn call(&self, op: &str, f: impl FnOnce(ncclComm_t) -> ncclResult_t) -> Result<()> {
        let mut st = self.lock_for_call(op)?;
        let r = f(st.comm);
        self.settle(&mut st, op, r)
    }

    /// An NCCL call's result: success, an error naming the call, or (nonblocking) a wait for
    /// the communicator to leave `ncclInProgress`.
    pub(crate) fn settle(&self, st: &mut State, op: &str, r: ncclResult_t) -> Result<()> {
        match NcclCode::check(r) {
            Ok(()) => Ok(()),
            Err(NcclCode::InProgress) => self.wait_ready(st, op, self.timeout),
            Err(code) => Err(nccl_error(&self.nccl, &self.who, op, code, Some(st.comm))),
        }
    }

    /// Polls `ncclCommGetAsyncError`, with the lock held (no other call may run meanwhile),
    /// until the communicator is no longer in progress; aborts it at `limit`.
    pub(crate) fn wait_ready(&self, st: &mut State, op: &str, limit: Duration) -> Result<()> {
        let get = dist_nccl_sys::nccl_fn!(&self.nccl, ncclCommGetAsyncError)?;
        let started = Instant::now();
        loop {
            let mut state = ncclResult_t::ncclInProgress;
            // SAFETY: the communicator is live (callers checked `aborted` under this lock, and
            // only `abort_locked`, under the lock, ends it); the pointer is valid for one result.
            // Run by every drop's finalize (the multirank trials `nccl_drop_bounded`, which
            // bounds it, and every other GPU trial at its end).
            let r = unsafe { get(st.comm, &mut state) };
            let fail = |code| Err(nccl_error(&self.nccl, &self.who, op, code, Some(st.comm)));
            if let Err(code) = NcclCode::check(r) {
                return fail(code);
            }
            match NcclCode::check(state) {
                Ok(()) => return Ok(()),
                Err(NcclCode::InProgress) => {}
                Err(code) => return fail(code),
            }
            if started.elapsed() > limit {
                let why = Abort::Timeout {
                    op: op.to_string(),
                    waited: started.elapsed(),
                };
                self.abort_locked(st, why.clone());
                return Err(self.aborted_error(op, &why));
            }
            std::thread::yield_now();
        }
    }

    /// `ncclCommAbort`, once; afterwards the handle is dead and every call refuses. Called with
    /// the lock held, so no thread is inside an NCCL call on this communicator. While a group is
    /// open over it, the abort is deferred to the group's end (its `ncclGroupEnd` still needs
    /// the communicator).
    pub(crate) fn abort_locked(&self, st: &mut State, why: Abort) {
        if st.aborted.is_some() {
            return;
        }
        let _ = self.doomed.set(why.clone());
        if st.owner.is_some() {
            st.deferred.get_or_insert(why);
            return;
        }
        // `ncclCommAbort` waits until every CUDA graph holding the communicator's work is
        // destroyed (NCCL 2.26 and newer poll for it), and this thread may hold one: abort on a
        // thread of its own, which waits for them (a graph's drop takes no lock). Calls refuse
        // meanwhile (`doomed` is set).
        if self.graphs.load(Ordering::Acquire) > 0 && !ABORT_THREAD.with(Cell::get) {
            if !self.abort_spawned.swap(true, Ordering::AcqRel)
                && let Some(me) = self.deadline.shared()
            {
                crate::deadline::abort_on_own_thread(me, why);
            }
            return;
        }
        tracing::warn!(comm = %self.who, reason = %why.reason(), "aborting NCCL communicator");
        let t0 = Instant::now();
        if matches!(why, Abort::Revoked(_)) && self.revoke_calls(st) {
            st.revoked = true;
        } else {
            // The communicator whose resources `comm` shares (its connections) first, then
            // `comm`: each is aborted once, under the lock, and never used again. (On 2 x H200
            // both orders ended within 1.1 s:
            // docs/results/2026-11-30-2xH200-efd5e41/diagnostic-transcript.txt.)
            crate::split::abort_handle(
                &self.nccl,
                std::mem::replace(&mut st.sharing, std::ptr::null_mut()),
            );
            if let Ok(f) = dist_nccl_sys::nccl_fn!(&self.nccl, ncclCommAbort) {
                // SAFETY: the communicator is live (`aborted` is None); we hold its lock, so no
                // other thread is inside an NCCL call on it, and no group is open over it
                // (`owner` is None). After this the handle is never used again: `aborted` is
                // set below, under the same lock, and every use checks it first. The multirank
                // trials `nccl_split_absent` (an explicit abort), `nccl_connect_absent` and
                // `nccl_two_stalled` (aborts at the timeout, then calls refused and the drop)
                // run it, and the GPU case `shrink_after_a_timeout` on one rank.
                let _ = unsafe { f(st.comm) };
            }
        }
        // The nonblocking handle kept for splits (`nb`) has none of the calls' work: it stays,
        // so that the survivors can still shrink (`shrink.rs`), and is freed with the rest of
        // what was kept by `release_kept` (at the drop or the shrink).
        tracing::debug!(comm = %self.who, took = ?t0.elapsed(), revoked = st.revoked, "abort: done");
        st.aborted = Some(why);
    }

    /// [`Shared::abort_locked`], then [`Shared::release_kept`]: nothing is kept, for a
    /// communicator that will never be shrunk (one that failed to form).
    pub(crate) fn abort_all_locked(&self, st: &mut State, why: Abort) {
        self.abort_locked(st, why);
        self.release_kept(st);
    }
}

/// `ncclGetErrorString` of `code` (its meaning where the library lacks the function).
pub(crate) fn error_text(nccl: &Nccl, code: NcclCode) -> String {
    match dist_nccl_sys::nccl_fn!(nccl, ncclGetErrorString) {
        // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any code
        // (dist-nccl-sys's `real_library_reports_version_errors_and_ids` calls it on the real
        // library, no GPU needed; here it runs for any NCCL error code a trial meets).
        Ok(f) => unsafe { CStr::from_ptr(f(code.result())) }
            .to_string_lossy()
            .into_owned(),
        Err(_) => code.meaning().into(),
    }
}

fn last_error(nccl: &Nccl, comm: Option<ncclComm_t>) -> String {
    match dist_nccl_sys::nccl_fn!(nccl, ncclGetLastError) {
        Ok(f) => {
            // SAFETY: ncclGetLastError takes a communicator or null and returns a C string
            // owned by NCCL (possibly empty), valid until the next NCCL call on this thread;
            // callers pass a communicator only while holding its lock, and it is copied below
            // before any other call (dist-nccl-sys's `real_library_reports_version_errors_and_ids`
            // calls it with null on the real library; with a communicator it runs for any NCCL
            // error code a multirank trial meets).
            let p = unsafe { f(comm.unwrap_or(std::ptr::null_mut())) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated, see above (same tests).
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => String::new(),
    }
}

/// The error for `code`, returned by `op` (on `comm`, where given, whose lock the caller holds).
pub(crate) fn nccl_error(
    nccl: &Nccl,
    who: &str,
    op: &str,
    code: NcclCode,
    comm: Option<ncclComm_t>,
) -> NcclError {
    NcclError::Nccl {
        comm: who.to_string(),
        op: op.to_string(),
        code,
        text: error_text(nccl, code),
        last: last_error(nccl, comm),
    }
}

pub(crate) fn cuda(who: &str, op: &str) -> impl FnOnce(cudarc::driver::DriverError) -> NcclError {
    let (comm, op) = (who.to_string(), op.to_string());
    move |source| NcclError::Cuda { comm, op, source }
}

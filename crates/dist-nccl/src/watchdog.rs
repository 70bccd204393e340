//! The watchdog thread of a communicator: it aborts the communicator when NCCL reports an
//! asynchronous error, and it marks the work enqueued on every stream the communicator used and
//! arms the communicator's [`Deadline`](crate::deadline::Deadline) while a mark is pending; the
//! deadline thread aborts when work stops completing for the whole timeout (`deadline.rs` says
//! why the decision is not made here), so a dead peer never hangs the process.
//!
//! It never aborts under a thread that is inside NCCL: it takes the communicator's lock first,
//! and every NCCL call on the communicator runs with that lock held (see `shared.rs`). It
//! notices a call that stays inside NCCL (holding the lock) for the whole timeout only by
//! failing to take the lock; it then logs it, once (a call that returns was not dead; one that
//! never returns cannot be aborted under). An abort asked for meanwhile ([`Shared::request_abort`])
//! is applied by the first to take the lock, the watchdog included.
//!
//! CUDA graphs (`capture.rs`): a mark recorded on a capturing stream would be recorded into the
//! capture, and querying it would invalidate the capture. So the watchdog does not mark a
//! stream while it is capturing, and a mark recorded just as a capture began (the stream was
//! capturing right after the record) is not queried while the stream captures, nor counted
//! toward the timeout; once the stream has left capture it is queried: an answer makes it an
//! ordinary mark again, and an error (CUDA's answer for an event recorded in a capture) drops
//! it and the work is marked again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use dist_nccl_sys::ncclResult_t;

use cudarc::driver::sys::CUresult;

use crate::capture::{capturing, relax_this_thread};
use crate::error::NcclCode;
use crate::shared::{Abort, Shared, nccl_error};

/// How often the watchdog looks at a communicator.
pub(crate) const WATCH_EVERY: Duration = Duration::from_millis(10);

/// One watched stream: a marker event recorded behind its work, the enqueue count behind it,
/// and when it was recorded.
struct Watched {
    stream: Arc<CudaStream>,
    marker: CudaEvent,
    marked: u64,
    pending: Option<Instant>,
    /// The stream was capturing right after the mark was recorded: the mark may be in the
    /// capture.
    maybe_captured: bool,
}

pub(crate) fn watch(shared: &Shared, ctx: &Arc<CudaContext>) {
    relax_this_thread();
    let mut watched: Vec<Watched> = Vec::new();
    let mut busy_since: Option<Instant> = None;
    let mut reported = false;
    loop {
        {
            let stop = shared.stop.lock().unwrap_or_else(|p| p.into_inner());
            let (stop, _) = shared
                .wake
                .wait_timeout(stop, WATCH_EVERY)
                .unwrap_or_else(|p| p.into_inner());
            if *stop {
                return;
            }
        }
        // A thread inside NCCL holds the lock: never abort under it.
        let mut st = match shared.try_lock() {
            Some(st) => {
                busy_since = None;
                reported = false;
                st
            }
            None => {
                let since = *busy_since.get_or_insert_with(Instant::now);
                if since.elapsed() > shared.timeout && !reported {
                    reported = true;
                    tracing::error!(
                        comm = %shared.who,
                        "a call has been inside NCCL for {:.1?}; it cannot be aborted while \
                         it is (NCCL forbids concurrent calls on one communicator)",
                        since.elapsed()
                    );
                }
                continue;
            }
        };
        shared.apply_requested(&mut st);
        if st.aborted.is_some() {
            return;
        }
        // While a group is open its ops are recorded but not launched (and it owns the
        // communicator): leave it be until it ends.
        if st.owner.is_some() {
            continue;
        }
        if let Ok(get) = dist_nccl_sys::nccl_fn!(&shared.nccl, ncclCommGetAsyncError) {
            let mut state = ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live (`aborted` is None) and we hold its lock, so no
            // other thread is inside NCCL on it and no group is open over it; valid pointer.
            // Every GPU trial runs a watchdog; in `nccl_connect_absent` it finds the stalled
            // communicator.
            let r = unsafe { get(st.comm, &mut state) };
            if let Err(code) = NcclCode::check_started(r).and(NcclCode::check_started(state)) {
                let e = nccl_error(
                    &shared.nccl,
                    &shared.who,
                    "asynchronous error",
                    code,
                    Some(st.comm),
                );
                shared.abort_locked(&mut st, Abort::Error(e.to_string()));
                return;
            }
        }
        // The streams and the work enqueued on each, read under the lock; the CUDA calls below
        // run after it is released. While `ncclCommAbort` of another communicator of this
        // context frees host memory, the driver blocks every call on the context until the
        // device is idle; if this communicator has a kernel that only its own abort can end
        // (a receive from a peer that never sends), a CUDA call made under this lock would
        // keep that abort out for ever (seen on 2 x H200, run 0aa176d-diag-b of
        // docs/results/2026-11-30-2xH200-8c8398a/: the watchdog in `cuEventRecord` under the lock,
        // the other communicator's abort in `cuMemFreeHost`, this one's abort deferred behind the
        // lock).
        let streams: Vec<(Arc<CudaStream>, u64)> = st
            .streams
            .iter()
            .map(|u| (u.stream.clone(), u.enqueued))
            .collect();
        let last_op = st.last_op;
        drop(st);
        match check_streams(&mut watched, &streams, ctx, &shared.who) {
            Ok(oldest) => shared.deadline.set(oldest, last_op),
            Err(why) => {
                // Aborts now if no call is inside NCCL, else when the lock is next taken (by
                // this loop, the call's own thread or another caller).
                shared.request_abort(why);
            }
        }
    }
}

/// Marks the new work on each stream and looks at the marks: when the oldest pending one was
/// recorded (`None`: none is), or the CUDA error that makes the communicator unusable. Called
/// without the communicator's lock (it makes CUDA calls, which can block).
fn check_streams(
    watched: &mut Vec<Watched>,
    streams: &[(Arc<CudaStream>, u64)],
    ctx: &Arc<CudaContext>,
    who: &str,
) -> Result<Option<Instant>, Abort> {
    for (i, (stream, enqueued)) in streams.iter().enumerate() {
        if i >= watched.len() {
            match ctx.new_event(None) {
                Ok(marker) => watched.push(Watched {
                    stream: stream.clone(),
                    marker,
                    marked: 0,
                    pending: None,
                    maybe_captured: false,
                }),
                Err(e) => {
                    tracing::error!(comm = %who, error = %e, "watchdog cannot create an event");
                    break;
                }
            }
        }
        let w = &mut watched[i];
        // A failed query counts as capturing: no mark is recorded or queried on its strength.
        let now_capturing = capturing(&w.stream).unwrap_or(true);
        if w.pending.is_some() && !(w.maybe_captured && now_capturing) {
            match w.marker.try_is_complete() {
                // Answered: the mark is an ordinary event, recorded before any capture.
                Ok(true) => {
                    w.pending = None;
                    w.maybe_captured = false;
                }
                Ok(false) => w.maybe_captured = false,
                // The mark went into a capture after all: it never completes; mark the work
                // again.
                Err(e) if w.maybe_captured || e.0 == CUresult::CUDA_ERROR_CAPTURED_EVENT => {
                    w.pending = None;
                    w.marked = 0;
                }
                Err(e) => {
                    return Err(Abort::Error(format!(
                        "CUDA error while watching the communicator's work: {e}"
                    )));
                }
            }
            if w.pending.is_none() {
                w.maybe_captured = false;
            }
        }
        // A mark recorded now follows at least the `enqueued` calls read under the lock (and
        // any enqueued since, which it then waits for too). Unmarked work is marked again on
        // the next look if recording fails. Never on a capturing stream.
        if w.pending.is_none() && *enqueued > w.marked && !now_capturing {
            match w.marker.record(&w.stream) {
                Ok(()) => {
                    w.pending = Some(Instant::now());
                    w.marked = *enqueued;
                    // A capture may have begun between the look and the record.
                    w.maybe_captured = capturing(&w.stream).unwrap_or(true);
                }
                Err(e) => tracing::warn!(comm = %who, error = %e, "watchdog cannot record a mark"),
            }
        }
    }
    // A mark that may be in a capture says nothing about the work's progress.
    Ok(watched
        .iter()
        .filter(|w| !w.maybe_captured)
        .filter_map(|w| w.pending)
        .min())
}

//! Splitting a communicator within a deadline, on raw handles that the caller uses alone (it
//! holds the communicator's lock, or no one else has the handle yet).
//!
//! Why a nonblocking handle: NCCL blocks inside `ncclCommSplit` issued on a blocking
//! communicator until every rank joins (run 4 of `docs/results/2026-11-30-2xH200-a84be05/`: a split
//! with a nonblocking child, issued on the blocking parent, stayed inside NCCL for 60 s, until
//! the absent peer's process exited). A communicator whose config has `blocking = 0` lets
//! NCCL "never block in any NCCL call" (NCCL user guide, "Creating a communication with
//! options"), and "if any NCCL function returns ncclInProgress, users must query the
//! communicator state until it becomes ncclSuccess before calling another NCCL function"
//! (ncclCommGetAsyncError). So every split is issued on a nonblocking handle (each
//! [`crate::Communicator`] keeps the one it formed from), its state is polled against the
//! deadline, and at the deadline the handles are aborted by the thread that polls them, with no
//! thread inside an NCCL call on them. Aborting a communicator that is still `ncclInProgress` is
//! what NCCL's user guide shows for nonblocking communicators (its "Fault Tolerance" example
//! polls `ncclCommGetAsyncError` while the state is `ncclInProgress` and the application's own
//! timeout has not passed, then calls `ncclCommAbort`); NCCL's thread working on the split is
//! NCCL's own, not a caller inside a call. Run 5: that abort returned within 2 s.

use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use dist_nccl_sys::{Library as Nccl, nccl_fn, ncclComm_t, ncclConfig_t, ncclResult_t};

use crate::communicator::Communicator;
use crate::config::{CommConfig, config};
use crate::connect::connect_peers;
use crate::error::{NcclCode, NcclError, Result};
use crate::shared::{Abort, cuda, nccl_error};

impl Communicator {
    /// Splits this communicator: ranks passing the same `color` form a new one, ordered by
    /// `key` (then by rank). Every rank of this communicator must call it, within the init
    /// deadline of `cfg`: where a peer never does, the split returns [`NcclError::Timeout`]
    /// naming `split` at that deadline, and this communicator is aborted (NCCL's thread may
    /// still be using it for the half-done split).
    ///
    /// Bounded: the split is issued on the nonblocking communicator this one was formed from
    /// (see `split.rs`), into a nonblocking child polled against the deadline; unless
    /// [`CommConfig::nonblocking_calls`], that child is then split (color 0, same order) into
    /// the blocking communicator returned, once every rank has joined.
    #[doc(alias = "ncclCommSplit")]
    pub fn split(&self, color: u32, key: i32, cfg: CommConfig) -> Result<Communicator> {
        if color > i32::MAX as u32 {
            return Err(self.invalid("split", format!("color {color} is over 2^31-1")));
        }
        let nb = self.split_raw(color as i32, key, &cfg)?;
        let who = self.split_name(&cfg, &color.to_string());
        Self::from_nonblocking(self.shared.nccl.clone(), self.ctx.clone(), nb, who, &cfg)
    }

    /// Takes part in a split of this communicator without joining any of the communicators it
    /// makes (`NCCL_SPLIT_NOCOLOR`, MPI_UNDEFINED's meaning): what a rank outside every new
    /// group calls while the others call [`Communicator::split`], since the split is collective
    /// over this communicator. The same deadline and errors as [`Communicator::split`].
    #[doc(alias = "NCCL_SPLIT_NOCOLOR")]
    pub fn split_none(&self, cfg: CommConfig) -> Result<()> {
        let nb = self.split_raw(dist_nccl_sys::NCCL_SPLIT_NOCOLOR, 0, &cfg)?;
        debug_assert!(nb.is_null(), "NCCL made a communicator for no color");
        Ok(())
    }

    fn split_name(&self, cfg: &CommConfig, color: &str) -> String {
        format!(
            "nccl comm {}(split {color} of {})",
            cfg.name
                .as_ref()
                .map_or(String::new(), |x| format!("'{x}' ")),
            self.shared.who
        )
    }

    /// `ncclCommSplit` on this communicator's nonblocking handle, within the init deadline:
    /// the new nonblocking handle (null for `NCCL_SPLIT_NOCOLOR`). Aborts this communicator
    /// where NCCL may still be using it after a failure.
    fn split_raw(&self, color: i32, key: i32, cfg: &CommConfig) -> Result<ncclComm_t> {
        const OP: &str = "split";
        let nccl = self.shared.nccl.clone();
        if crate::group::in_group() {
            return Err(self.invalid(OP, "not inside a group".into()));
        }
        let shown = if color == dist_nccl_sys::NCCL_SPLIT_NOCOLOR {
            "no color".to_string()
        } else {
            color.to_string()
        };
        let who = self.split_name(cfg, &shown);
        let mut conf = config(nccl.version(), cfg, false);
        // The parent's lock is held until the child is ready or given up on: NCCL's thread
        // uses the parent for the split meanwhile, so no other call may run on it.
        let mut st = self.shared.lock_for_call(OP)?;
        let parent = if st.nb.is_null() { st.comm } else { st.nb };
        match split_handle(&nccl, parent, &who, color, key, &mut conf, cfg.init_timeout) {
            Ok(c) => Ok(c),
            Err((e, poisoned)) => {
                if poisoned {
                    // NCCL's thread may still be using the parent for the half-done split: it
                    // is aborted now, and no shrink may run on it later.
                    if parent == st.nb {
                        abort_handle(&nccl, std::mem::replace(&mut st.nb, std::ptr::null_mut()));
                    }
                    self.shared
                        .abort_locked(&mut st, Abort::Error(e.to_string()));
                }
                Err(e)
            }
        }
    }

    /// The communicator made from `nb`, a ready nonblocking handle no one else has: `nb` itself
    /// ([`CommConfig::nonblocking_calls`]), or a blocking split of it (color 0, same order) for
    /// the calls, keeping `nb` for later splits.
    pub(crate) fn from_nonblocking(
        nccl: Arc<Nccl>,
        ctx: Arc<CudaContext>,
        nb: ncclComm_t,
        who: String,
        cfg: &CommConfig,
    ) -> Result<Communicator> {
        let fail = |e: NcclError, comm: ncclComm_t| {
            abort_handle(&nccl, comm);
            abort_handle(&nccl, nb);
            e
        };
        let (count, user_rank) = (
            nccl_fn!(&nccl, ncclCommCount),
            nccl_fn!(&nccl, ncclCommUserRank),
        );
        let (count, user_rank) = match (count, user_rank) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(fail(e.into(), std::ptr::null_mut())),
        };
        let (mut n, mut r) = (0i32, 0i32);
        // SAFETY: `nb` is a ready communicator used by this thread alone; the pointers are
        // valid for one int each. Every init and split comes here (the multirank trials
        // `nccl_collectives` and `nccl_split`).
        let (a, b) = unsafe { (count(nb, &mut n), user_rank(nb, &mut r)) };
        if let Err(code) = NcclCode::check(a).and(NcclCode::check(b)) {
            let e = nccl_error(&nccl, &who, "query the communicator", code, Some(nb));
            return Err(fail(e, std::ptr::null_mut()));
        }
        let who = format!("{} rank {r}/{n} on cuda:{}", who.trim_end(), ctx.ordinal());
        let stream = match crate::config::comm_stream(&ctx, cfg) {
            Ok(s) => s,
            Err(e) => return Err(fail(cuda(&who, "create a stream")(e), std::ptr::null_mut())),
        };
        let (rank, size) = (r as usize, n as usize);
        if cfg.nonblocking_calls {
            let none = std::ptr::null_mut();
            return Self::finish(nccl, ctx, stream, nb, None, none, rank, size, who, cfg);
        }
        // With `connect_peers`, every pair of ranks connects now, on a nonblocking split of
        // `nb` whose children share its connections (`connect.rs`).
        let started = Instant::now();
        let sharing = if cfg.connect_peers && size > 1 {
            let mut conf = config(nccl.version(), cfg, false);
            conf.splitShare = 1;
            let s = match split_handle(&nccl, nb, &who, 0, r, &mut conf, cfg.init_timeout) {
                Ok(c) => c,
                Err((e, _)) => return Err(fail(e, std::ptr::null_mut())),
            };
            let limit = cfg.init_timeout;
            match connect_peers(&nccl, s, &ctx, &who, (rank, size), started, limit) {
                Ok(s) => s,
                // `connect_peers` aborted `s` before freeing the buffer its transfers use.
                Err(e) => return Err(fail(e, std::ptr::null_mut())),
            }
        } else {
            std::ptr::null_mut()
        };
        // Calls on a nonblocking communicator each go through an NCCL thread (tens of µs); a
        // blocking child with the same ranks makes them as cheap as plain NCCL's. Every rank
        // has joined `nb` by now.
        let parent = if sharing.is_null() { nb } else { sharing };
        let mut conf = config(nccl.version(), cfg, true);
        let comm = match split_handle(&nccl, parent, &who, 0, r, &mut conf, cfg.init_timeout) {
            Ok(c) => c,
            Err((e, _)) => return Err(fail(e, sharing)),
        };
        Self::finish(
            nccl,
            ctx,
            stream,
            comm,
            Some(nb),
            sharing,
            rank,
            size,
            who,
            cfg,
        )
    }
}

/// One poll of `ncclCommGetAsyncError`: `Ok(true)` ready, `Ok(false)` in progress.
pub(crate) fn ready(nccl: &Nccl, comm: ncclComm_t, who: &str, op: &str) -> Result<bool> {
    let get = nccl_fn!(nccl, ncclCommGetAsyncError)?;
    let mut state = ncclResult_t::ncclInProgress;
    // SAFETY: `comm` is a live handle the caller uses alone (module doc); valid pointer. Polled
    // by every init and split (the multirank trials `nccl_split` and `nccl_split_absent`, which
    // polls until the deadline).
    let r = unsafe { get(comm, &mut state) };
    match NcclCode::check(r).map(|()| NcclCode::check(state)) {
        Ok(Ok(())) => Ok(true),
        Ok(Err(NcclCode::InProgress)) => Ok(false),
        Ok(Err(code)) | Err(code) => Err(nccl_error(nccl, who, op, code, Some(comm))),
    }
}

/// `ncclCommAbort` on a handle the caller uses alone and never uses again.
pub(crate) fn abort_handle(nccl: &Nccl, comm: ncclComm_t) {
    if comm.is_null() {
        return;
    }
    if let Ok(f) = nccl_fn!(nccl, ncclCommAbort) {
        // SAFETY: live handle, used by this thread alone (no thread inside a call on it), and
        // never used again (the caller's contract). Every GPU trial's drop aborts the handles it
        // kept through it, and `nccl_split_absent` a split given up at its deadline.
        let _ = unsafe { f(comm) };
    }
}

/// Polls `comm` until ready; aborts it on an error or at `deadline` (the error names `op`).
pub(crate) fn wait_handle(
    nccl: &Nccl,
    comm: ncclComm_t,
    who: &str,
    op: &str,
    started: Instant,
    limit: Duration,
) -> Result<()> {
    loop {
        match ready(nccl, comm, who, op) {
            Ok(true) => return Ok(()),
            Ok(false) if started.elapsed() > limit => {
                abort_handle(nccl, comm);
                return Err(NcclError::Timeout {
                    comm: who.to_string(),
                    op: op.to_string(),
                    waited: started.elapsed(),
                });
            }
            Ok(false) => std::thread::yield_now(),
            Err(e) => {
                abort_handle(nccl, comm);
                return Err(e);
            }
        }
    }
}

/// `ncclCommSplit` of `parent` (nonblocking, or blocking for the final step that only runs
/// once every rank has joined the nonblocking split) into a child of the mode in `conf`, both
/// polled until ready within `limit`. On an error the child (if NCCL made one) is aborted; the
/// parent is the caller's to abort (`Err(_, true)`) when NCCL may still be using it.
pub(crate) fn split_handle(
    nccl: &Nccl,
    parent: ncclComm_t,
    who: &str,
    color: i32,
    key: i32,
    conf: &mut ncclConfig_t,
    limit: Duration,
) -> std::result::Result<ncclComm_t, (NcclError, bool)> {
    const OP: &str = "split";
    let f = nccl_fn!(nccl, ncclCommSplit).map_err(|e| (e.into(), false))?;
    // NCCL writes the new handle into the slot, possibly from its own thread: the slot is an
    // atomic on the heap, read with acquire ordering, and leaked if we give up waiting, so
    // that a late write lands in memory that is still allocated.
    let slot = Box::new(AtomicPtr::new(std::ptr::null_mut()));
    let started = Instant::now();
    // SAFETY: `parent` is live and used by this thread alone (module doc); the slot is valid,
    // aligned memory for one handle that outlives any write NCCL makes to it (see above); the
    // config is valid for the call and NCCL copies it, but keeps the name it points to, which
    // lives for the process (`config::nccl_name`, the only way a config is built). The
    // multirank trials `nccl_split`, `nccl_split_absent` and `hybrid_groups_gpu` (no color
    // too) split.
    let r = unsafe { f(parent, color, key, slot.as_ptr(), conf) };
    if let Err(code) = NcclCode::check_started(r) {
        return Err((nccl_error(nccl, who, OP, code, Some(parent)), false));
    }
    let none = color == dist_nccl_sys::NCCL_SPLIT_NOCOLOR;
    await_child(nccl, parent, who, OP, slot, started, limit, none)
}

/// After a split or shrink of `parent` was issued into `slot`: waits (within `limit` of
/// `started`) for NCCL to be done with the parent, then for the child's handle and its
/// readiness. `none`: this rank joins no child (a split's `NCCL_SPLIT_NOCOLOR`), so the result
/// is null. On an error the child (if NCCL made one) is aborted; the parent is the caller's to
/// abort (`Err(_, true)`) when NCCL may still be using it. The slot is leaked if the parent
/// never finishes, so that a late write by NCCL's thread lands in allocated memory.
#[allow(
    clippy::too_many_arguments,
    reason = "one call per use, each argument named"
)]
pub(crate) fn await_child(
    nccl: &Nccl,
    parent: ncclComm_t,
    who: &str,
    op: &str,
    slot: Box<AtomicPtr<dist_nccl_sys::ncclComm>>,
    started: Instant,
    limit: Duration,
    none: bool,
) -> std::result::Result<ncclComm_t, (NcclError, bool)> {
    // The parent first (NCCL's thread uses it until its part of the split is done), then the
    // child's handle and its readiness.
    let parent_done = loop {
        match ready(nccl, parent, who, op) {
            Ok(true) => break Ok(()),
            Ok(false) if started.elapsed() > limit => {
                break Err(NcclError::Timeout {
                    comm: who.to_string(),
                    op: op.to_string(),
                    waited: started.elapsed(),
                });
            }
            Ok(false) => std::thread::yield_now(),
            Err(e) => break Err(e),
        }
    };
    if let Err(e) = parent_done {
        Box::leak(slot);
        return Err((e, true));
    }
    let child = slot.load(Ordering::Acquire);
    if none {
        // This rank joins no new communicator: NCCL makes none for it.
        if !child.is_null() {
            abort_handle(nccl, child);
        }
        return Ok(std::ptr::null_mut());
    }
    if child.is_null() {
        // NCCL is done with the split and made no handle.
        return Err((
            NcclError::InvalidArgument {
                comm: who.to_string(),
                op: op.to_string(),
                reason: "NCCL returned no communicator".into(),
            },
            false,
        ));
    }
    drop(slot);
    wait_handle(nccl, child, who, op, started, limit).map_err(|e| (e, false))?;
    Ok(child)
}

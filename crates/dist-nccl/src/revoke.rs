//! Revoking a communicator after a failure: its calls end at once, without freeing what a
//! shrink needs; and freeing what an abort or a revoke kept, at the shrink or the drop.

use std::time::{Duration, Instant};

use crate::abort_handle::AbortHandle;
use crate::communicator::Communicator;
use crate::error::{NcclCode, NcclError};
use crate::shared::{Abort, Shared, State, nccl_error};

impl Communicator {
    /// Revokes the communicator: every call waiting now (a `synchronize`, a [`crate::Work`]
    /// wait) and every later call fails at once with
    /// [`NcclError::Aborted`](crate::NcclError::Aborted), whose reason is `revoked: <reason>`
    /// (say what happened: "epoch 3 revoked: rank 5 died"), and the work in flight is stopped.
    /// What remains is for [`Communicator::shrink`] (the survivors' new communicator) or for
    /// the drop, which frees it without waiting on the dead.
    ///
    /// Where the loaded NCCL has `ncclCommRevoke` (2.28 and newer) the calls' handle is revoked:
    /// its kernels and NCCL's threads stop, and its memory is freed only at the shrink or the
    /// drop, so the revoke itself does not wait for the frees. An older NCCL gets
    /// `ncclCommAbort` instead (said in the log), with the same errors for the calls. Either
    /// way the nonblocking handle the communicator keeps for splits and shrinks stays, so a
    /// shrink can follow; with [`CommConfig::nonblocking_calls`](crate::CommConfig) the calls'
    /// handle is the only one, and a shrink can follow only where it was revoked (NCCL 2.28).
    ///
    /// Never waits behind a call: while another thread is inside an NCCL call on the
    /// communicator, the revoke is applied when that call returns (calls and waits already
    /// refuse meanwhile), and while a group is open over it, at the group's end. Only the
    /// first abort or revoke counts.
    #[doc(alias = "ncclCommRevoke")]
    pub fn revoke(&self, reason: impl Into<String>) {
        self.shared.request_abort(Abort::Revoked(reason.into()));
    }
}

impl AbortHandle {
    /// [`Communicator::revoke`] from another thread (a watcher of the job's peers, say).
    pub fn revoke(&self, reason: impl Into<String>) {
        self.shared.request_abort(Abort::Revoked(reason.into()));
    }
}

impl Shared {
    /// `ncclCommRevoke` of the calls' handle (live, under the lock, no group open over it),
    /// settled: a nonblocking handle is polled until it is quiescent, within the timeout (at
    /// most 30 s). True if it is revoked; false where the library lacks the function (older
    /// than 2.28, said in the log) or the revoke failed or did not settle: the caller then
    /// aborts the handle.
    pub(crate) fn revoke_calls(&self, st: &mut State) -> bool {
        let f = match dist_nccl_sys::nccl_fn!(&self.nccl, ncclCommRevoke) {
            Ok(f) => f,
            Err(e) => {
                tracing::info!(comm = %self.who, "{e}: aborting the calls' handle instead");
                return false;
            }
        };
        let flags = dist_nccl_sys::NCCL_REVOKE_DEFAULT as i32;
        // SAFETY: the calls' handle is live (the caller, `abort_locked`, found `aborted` None),
        // we hold the communicator's lock, so no other thread is inside an NCCL call on it, and
        // no group is open over it (`owner` is None). It is revoked once (`aborted` is set right
        // after, under the lock, and `abort_locked` returns early from then on), never
        // finalized after it (the drop finalizes only a communicator that was not aborted), and
        // afterwards only polled here, used as a shrink's parent (`shrink.rs`) or aborted by
        // `release_kept`, each under the lock. The GPU cases `revoke_ends_pending_and_later_calls`
        // and `shrink_after_revoke` (both modes) run it.
        let r = unsafe { f(st.comm, flags) };
        let settled = match NcclCode::check(r) {
            Ok(()) => Ok(()),
            Err(NcclCode::InProgress) => {
                let limit = self.timeout.min(Duration::from_secs(30));
                let started = Instant::now();
                loop {
                    match crate::split::ready(&self.nccl, st.comm, &self.who, "revoke") {
                        Ok(true) => break Ok(()),
                        Ok(false) if started.elapsed() > limit => {
                            break Err(NcclError::Timeout {
                                comm: self.who.clone(),
                                op: "revoke".into(),
                                waited: started.elapsed(),
                            });
                        }
                        Ok(false) => std::thread::yield_now(),
                        Err(e) => break Err(e),
                    }
                }
            }
            Err(code) => Err(nccl_error(
                &self.nccl,
                &self.who,
                "revoke",
                code,
                Some(st.comm),
            )),
        };
        match settled {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(comm = %self.who, error = %e, "revoke failed; aborting instead");
                false
            }
        }
    }

    /// Frees what an abort kept, once the calls have ended (`aborted` is set; otherwise it does
    /// nothing): the handle whose resources the calls' one shared, the calls' handle if it was
    /// revoked rather than aborted, and the nonblocking handle kept for splits and shrinks.
    /// Each is aborted once, under the lock, and nulled (never used again).
    pub(crate) fn release_kept(&self, st: &mut State) {
        if st.aborted.is_none() {
            return;
        }
        crate::split::abort_handle(
            &self.nccl,
            std::mem::replace(&mut st.sharing, std::ptr::null_mut()),
        );
        if std::mem::take(&mut st.revoked) {
            // Aborting a revoked handle frees it (NCCL's `commReclaim` skips the teardown the
            // revoke already did).
            crate::split::abort_handle(&self.nccl, st.comm);
        }
        crate::split::abort_handle(
            &self.nccl,
            std::mem::replace(&mut st.nb, std::ptr::null_mut()),
        );
    }
}

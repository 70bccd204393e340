//! Revoking a communicator after a failure: its calls end at once, without freeing what a
//! shrink needs.

use crate::abort_handle::AbortHandle;
use crate::communicator::Communicator;
use crate::shared::Abort;

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

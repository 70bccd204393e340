//! Revoking a backend: the revocation's state and errors, the failures noted for the next
//! agreement, and the public `revoke`, `epoch` and `members`.

use std::collections::BTreeSet;
use std::net::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::collectives::COLLECTIVE_TAG;
use dist_core::transport::Link;
use dist_core::{DistError, Result};

use super::{NOTICE_GRACE, Revocation};
use crate::link::TcpLink;
use crate::peer::AbortNotice;
use crate::{Shared, TcpBackend};

impl Shared {
    /// Notes that rank `r` failed (its connection closed or broke while it had not said it
    /// was leaving, it went silent, or a notice names it at fault), for the next agreement.
    /// This rank itself is never noted.
    pub(crate) fn note_failed(&self, r: usize, why: impl FnOnce() -> String) {
        let Some(p) = self.peers.get(r) else { return };
        if r == self.rank || p.leaving_within(self.closing_excuse(), Instant::now()) {
            return;
        }
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_empty() {
            let _ = self.first_failure.set((r, why()));
        }
        failed.insert(r);
    }

    /// The ranks noted failed so far.
    pub(crate) fn failed_ranks(&self) -> BTreeSet<usize> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// An abort notice came from a peer: the rank it names at fault is noted failed, and an
    /// elastic backend is revoked (without telling the others again: the notice's sender
    /// did). Runs on the I/O thread: sends nothing, waits for nothing.
    pub(crate) fn heard_abort(&self, n: &AbortNotice) {
        if let Some(c) = n.culprit {
            self.note_failed(c, || n.reason.clone());
        }
        if self.elastic {
            // A revocation's notice says the epoch already.
            let prefix = format!("group epoch {} revoked: ", self.epoch);
            let reason = n.reason.strip_prefix(&prefix).unwrap_or(&n.reason);
            // The rank at fault is the one the notice names, if any: its sender (or a rank
            // whose call failed first, passed on) only reports a failure, and may live.
            self.mark_revoked(n.culprit, reason.to_string());
        }
    }

    /// Sets the revocation (the first one stays) and ends every wait; true if it was the
    /// first.
    fn mark_revoked(&self, culprit: Option<usize>, reason: String) -> bool {
        if self.revoked.set(Revocation { culprit, reason }).is_err() {
            return false;
        }
        tracing::debug!(rank = self.rank, epoch = self.epoch, ?culprit, "revoked");
        self.aborts.revoke();
        for p in &self.peers {
            p.wake();
        }
        true
    }

    /// Revokes the backend (a later call changes nothing): every wait ends, the other ranks
    /// are told with an abort notice naming `culprit`, and the connections of the ranks
    /// known failed are shut.
    pub(crate) fn revoke(self: &Arc<Self>, culprit: Option<usize>, reason: String) {
        if !self.mark_revoked(culprit, reason.clone()) {
            return;
        }
        let text = format!("group epoch {} revoked: {reason}", self.epoch);
        TcpLink(self.clone()).abort(COLLECTIVE_TAG, None, &text, culprit);
        for r in self.failed_ranks() {
            self.peers[r].shutdown(Shutdown::Both);
        }
    }

    /// Whether the end of `peer`'s connection, seen now, is a failure: not if, by `until` (a
    /// [`NOTICE_GRACE`] from when it was seen), this backend is revoked or `peer` sends an abort notice (a rank that
    /// revokes, then closes its connections to recover, may have its notice still on the way
    /// over a shared-memory ring while the close comes over TCP).
    fn failure_unexplained(&self, peer: usize, until: Instant) -> bool {
        let explained = || {
            self.revoked.get().is_some()
                || (self.aborts.raised() && self.aborts.notices().iter().any(|n| n.from == peer))
        };
        while !explained() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        !explained()
    }

    /// On the liveness thread, after the hooks heard that `peer`'s connection ended (`why`):
    /// noted failed unless a revocation explains it by `until` ([`Shared::failure_unexplained`]).
    pub(crate) fn after_close(&self, peer: usize, why: String, until: Instant) {
        if self.failure_unexplained(peer, until) {
            self.note_failed(peer, || why);
        }
    }

    /// On the liveness thread, after faults: an elastic backend with a rank noted failed is
    /// revoked naming the first.
    pub(crate) fn revoke_if_failed(self: &Arc<Self>) {
        if !self.elastic || self.revoked.get().is_some() {
            return;
        }
        if let Some((r, why)) = self.first_failure.get() {
            self.revoke(Some(*r), why.clone());
        }
    }

    /// `e` as this backend reports it: on an elastic backend a failure it names (a peer gone
    /// or silent, an abort) revokes the backend first; on a revoked backend, the error of a
    /// call (not a caller's mistake) is [`DistError::Revoked`].
    pub(crate) fn label(self: &Arc<Self>, e: DistError) -> DistError {
        if self.elastic && self.revoked.get().is_none() {
            match &e {
                // A peer that revoked and then closed its connections (to recover) may have
                // its notice still on the way (over a shared-memory ring, while the close
                // comes over TCP): it gets a moment to land, and is then the cause.
                DistError::PeerGone { peer, .. } | DistError::PeerUnresponsive { peer, .. }
                    if self.failure_unexplained(*peer, Instant::now() + NOTICE_GRACE) =>
                {
                    self.note_failed(*peer, || e.to_string());
                    self.revoke(Some(*peer), e.to_string());
                }
                DistError::Aborted {
                    culprit, reason, ..
                } => {
                    self.revoke(*culprit, reason.clone());
                }
                _ => {}
            }
        }
        self.revoked_error(e)
    }

    /// `e` said as a revocation, where the backend is revoked and `e` is no caller's mistake.
    pub(crate) fn revoked_error(&self, e: DistError) -> DistError {
        let Some(r) = self.revoked.get() else {
            return e;
        };
        match e {
            DistError::Revoked { .. }
            | DistError::Excluded { .. }
            | DistError::InvalidRank { .. }
            | DistError::InvalidArgument { .. }
            | DistError::ConcurrentUse { .. }
            | DistError::Config { .. } => e,
            _ => self.revoked_now(e.op().unwrap_or("an operation").to_string(), r),
        }
    }

    /// The error of an operation `op` started on a revoked backend, if it is.
    pub(crate) fn refuse_if_revoked(&self, op: impl FnOnce() -> String) -> Result<()> {
        match self.revoked.get() {
            Some(r) => Err(self.revoked_now(op(), r)),
            None => Ok(()),
        }
    }

    fn revoked_now(&self, op: String, r: &Revocation) -> DistError {
        DistError::Revoked {
            rank: self.rank,
            op,
            epoch: self.epoch,
            culprit: r.culprit,
            reason: r.reason.clone(),
        }
    }
}

impl TcpBackend {
    /// Revokes this backend's group, naming `culprit` (a rank this rank judges failed, such as
    /// one its own checks found too slow) or none: every pending and later operation of the
    /// backend fails at once with [`DistError::Revoked`], here and, through an abort notice,
    /// on the other ranks (where their collectives fail; with
    /// [`TcpConfig::elastic`](crate::TcpConfig::elastic) they are revoked as well). Then
    /// [`TcpBackend::recover`]. A `culprit` that is no rank of the job is refused with
    /// [`DistError::InvalidRank`]; a second revocation changes nothing.
    pub fn revoke(&self, culprit: Option<usize>, reason: &str) -> Result<()> {
        let (me, n) = (self.shared.rank, self.shared.world);
        if let Some(c) = culprit.filter(|&c| c >= n) {
            return Err(DistError::InvalidRank {
                rank: me,
                op: "revoke".into(),
                given: c,
                world_size: n,
            });
        }
        if let Some(c) = culprit {
            self.shared.note_failed(c, || reason.to_string());
        }
        self.shared
            .revoke(culprit, format!("rank {me} revoked it: {reason}"));
        Ok(())
    }

    /// This backend's epoch: 0 for one formed by [`TcpBackend::with_config`] (or `new`,
    /// `from_env`), one more than the last for each [`TcpBackend::recover`] (more where a
    /// recovery had to agree again).
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// Each rank's job rank, in this epoch's rank order: the rank it had in the epoch the job
    /// began with. Rank `r` of this epoch was rank `members()[r]` then.
    pub fn members(&self) -> &[usize] {
        &self.shared.members
    }
}

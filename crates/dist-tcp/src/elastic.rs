//! Revoking a backend after a failure, and recovering: the survivors agree through the job's
//! store on the next epoch's members, then form that epoch's backend.
//!
//! **Revoke.** A backend is revoked by [`TcpBackend::revoke`], by [`TcpBackend::recover`], or,
//! with [`TcpConfig::elastic`](crate::TcpConfig::elastic), by the first failure it sees or
//! hears of. Revoking marks every wait on the backend's peers as ended (user tags' too: the
//! peers' shared abort list, `peer/aborts.rs`), wakes them, tells the other ranks with an
//! abort notice naming the rank at fault, and shuts the connections of the ranks known failed,
//! so that nothing waits for them (the backend's drop included). Every error of the backend
//! from then on is [`DistError::Revoked`], naming the epoch and the rank at fault.
//!
//! **Agree.** The keys of epoch `e` lie under `<job prefix>/elastic/<e>` in the job's store:
//!
//! | key | set by | value |
//! | --- | --- | --- |
//! | `here/<id>` | each rank that recovers into epoch `e` | `1` |
//! | `members` | the first rank done gathering (`compare_set` from empty: the first writer wins) | the members' job ranks, ascending, comma-separated |
//!
//! A rank checks in (`here`), then, unless `members` is set already, waits (at most the peer
//! timeout, and its deadline) for the check-in of every rank of the last epoch it does not
//! know failed, and proposes those that checked in, less those it knows failed, itself
//! included. Whatever its proposal, every rank takes the value `members` holds: one decision
//! per epoch, so two ranks that saw different failures never form two groups. A rank not in
//! it fails with [`DistError::Excluded`]. The rank that serves the store (job rank 0 where rank
//! 0 serves it) is never judged failed, and its check-in is waited for until the deadline.
//!
//! **Form.** The members form a new backend through the same store under
//! `<job prefix>/elastic/<e>/form`, with new connections (and new shared memory) and a new job
//! id, so no frame of an older epoch can reach it: its handshakes refuse a rank of another
//! epoch. Should forming fail (a member died meanwhile), the survivors agree on epoch `e + 1`,
//! until the deadline.

mod agree;
mod recover;
mod revoke;

use std::time::{Duration, Instant};

use crate::init::JobStore;

/// Why and by whom a backend was revoked (the first revocation wins).
#[derive(Clone, Debug)]
pub(crate) struct Revocation {
    /// The rank at fault, where known.
    pub(crate) culprit: Option<usize>,
    /// The failure, or why it was revoked.
    pub(crate) reason: String,
}

/// A later epoch's formation: its store, its number and its members.
pub(crate) struct Next {
    pub(crate) store: JobStore,
    pub(crate) epoch: u64,
    pub(crate) members: Vec<usize>,
}

/// How long a recovering rank waits, at most, for its live peers to close their side of the
/// old connections (they recover too, and close at once; one that does not is not waited for).
pub(crate) const DISMANTLE_LINGER: Duration = Duration::from_millis(500);

/// How long a peer's end, seen before any revocation, waits for a revocation notice that may
/// explain it ([`Shared::label`]).
pub(crate) const NOTICE_GRACE: Duration = Duration::from_millis(100);

/// The shortest time a formation of a later epoch is given.
pub(crate) const FORM_AT_LEAST: Duration = Duration::from_secs(2);

/// The time left to `deadline`, at least a millisecond.
pub(crate) fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

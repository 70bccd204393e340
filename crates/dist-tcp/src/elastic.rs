//! Revoking a backend after a failure, recovering (the survivors agree through the job's store
//! on the next epoch's members, then form that epoch's backend), and growing (a new process
//! joins, and is taken in at the next epoch).
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
//!
//! **Grow.** A process joins a running job with [`TcpBackend::join`], through keys under
//! `<job prefix>/elastic`:
//!
//! | key | set by | value |
//! | --- | --- | --- |
//! | `job` | rank 0 of an elastic job's epoch 0 | the job's size at epoch 0 and the job rank serving the store (`-`: none) |
//! | `epoch` | rank 0 of each epoch, once formed | the epoch and its members |
//! | `joiners` | each joiner (`add`) | how many registered: the k-th takes job rank `size at epoch 0 + k - 1` |
//! | `join/<id>` | joiner `id` | its ticket: `open <nonce>`, or `proof <nonce> <HMAC-SHA256 of prefix, id, nonce under the secret>` |
//! | `join/<id>/verdict` | `compare_set` from empty, the first stands: the members after an agreement that took it in, a member that found its proof wrong, or the joiner at its deadline | the epoch, `refused: <why>`, or `withdrawn` |
//!
//! The members never look for joiners on their own. They look when they move to a new epoch:
//! at [`TcpBackend::admit`] (a collective between steps: rank 0 looks, and a broadcast tells
//! the others whether to move) and at [`TcpBackend::recover`]; the proposer of an agreement
//! adds the joiners waiting (those with a ticket that passes and no verdict) after the
//! survivors, as the policy ([`Admission`]) says. After the agreement every member sets each
//! new member's verdict to the epoch; a joiner that withdrew first is read as such by every
//! member, and all agree again without it. The joiner reads the members of its epoch and
//! forms it with them; from then on it is a member like any other.

mod admission;
mod agree;
mod join;
mod joiners;
mod recover;
mod revoke;

pub use admission::Admission;
pub use join::{JOIN_ENV, joining};
pub(crate) use joiners::announce;

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

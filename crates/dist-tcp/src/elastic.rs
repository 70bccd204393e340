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

use std::collections::BTreeSet;
use std::net::Shutdown;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::collectives::COLLECTIVE_TAG;
use dist_core::transport::Link;
use dist_core::{DistError, Result};
use dist_store::{PrefixStore, Store, StoreError, TcpStore};

use crate::init::JobStore;
use crate::link::TcpLink;
use crate::peer::AbortNotice;
use crate::{Shared, TcpBackend};

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
const DISMANTLE_LINGER: Duration = Duration::from_millis(500);

/// How long a peer's end, seen before any revocation, waits for a revocation notice that may
/// explain it ([`Shared::label`]).
pub(crate) const NOTICE_GRACE: Duration = Duration::from_millis(100);

/// The shortest time a formation of a later epoch is given.
const FORM_AT_LEAST: Duration = Duration::from_secs(2);

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

/// The key of job rank `id`'s check-in.
fn here_key(id: usize) -> String {
    format!("here/{id}")
}

/// The members as the `members` key holds them.
fn encode(members: &[usize]) -> String {
    members
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The members a `members` value names: ranks of `current`, ascending, none twice, at least
/// one; `None` for anything else.
fn decode(v: &[u8], current: &[usize]) -> Option<Vec<usize>> {
    let text = std::str::from_utf8(v).ok()?;
    let ids = text
        .split(',')
        .map(|t| t.parse::<usize>().ok())
        .collect::<Option<Vec<usize>>>()?;
    let ascending = ids.windows(2).all(|w| w[0] < w[1]);
    (!ids.is_empty() && ascending && ids.iter().all(|i| current.contains(i))).then_some(ids)
}

/// What this rank proposes: itself, and every rank of `current` that checked in (`here`) and
/// that it does not know failed.
fn proposal(
    current: &[usize],
    me: usize,
    failed: &BTreeSet<usize>,
    mut here: impl FnMut(usize) -> bool,
) -> Vec<usize> {
    current
        .iter()
        .copied()
        .filter(|&id| id == me || (!failed.contains(&id) && here(id)))
        .collect()
}

/// The members of epoch `epoch` (job ranks), agreed through `keys` (`<job prefix>/elastic/<epoch>`):
/// see the module's text.
#[allow(clippy::too_many_arguments)]
fn agree(
    keys: &PrefixStore<&TcpStore>,
    rank: usize,
    epoch: u64,
    me: usize,
    current: &[usize],
    failed: &BTreeSet<usize>,
    keeper: Option<usize>,
    window: Duration,
    deadline: Instant,
) -> Result<Vec<usize>> {
    let err = |e: StoreError| DistError::Io {
        rank,
        context: format!("agree on group epoch {epoch} through the job's store"),
        source: std::io::Error::other(crate::init::store_error_text(&e)),
    };
    keys.set(&here_key(me), b"1").map_err(err)?;
    if crate::testing::dies_in_recovery() {
        tracing::warn!(rank, epoch, "exiting after the check-in, as a test asked");
        std::process::exit(0);
    }
    let decided = if keys.check(&["members"]).map_err(err)? {
        keys.get("members", left(deadline)).map_err(err)?
    } else {
        let expected: Vec<String> = current
            .iter()
            .filter(|id| **id != me && !failed.contains(id))
            .map(|&id| here_key(id))
            .collect();
        let refs: Vec<&str> = expected.iter().map(String::as_str).collect();
        let until = deadline.min(Instant::now() + window);
        match keys.wait(&refs, left(until)) {
            Ok(()) | Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(err(e)),
        }
        // The rank that serves the store lives while the store answers: its check-in is
        // waited for until the deadline, not the window, so that it is always a member (a
        // survivor left without it would have no store).
        if let Some(k) = keeper.filter(|&k| k != me && current.contains(&k)) {
            match keys.wait(&[&here_key(k)], left(deadline)) {
                Ok(()) | Err(StoreError::Timeout { .. }) => {}
                Err(e) => return Err(err(e)),
            }
        }
        let mut checks = Ok(());
        let mine = proposal(current, me, failed, |id| {
            match keys.check(&[&here_key(id)]) {
                Ok(there) => there,
                Err(e) => {
                    checks = Err(e);
                    false
                }
            }
        });
        checks.map_err(err)?;
        tracing::debug!(rank, epoch, ?mine, ?failed, "proposing");
        keys.compare_set("members", b"", encode(&mine).as_bytes())
            .map_err(err)?
    };
    decode(&decided, current).ok_or_else(|| DistError::InvalidArgument {
        rank,
        op: format!("agree on group epoch {epoch}"),
        reason: format!(
            "the store's members key holds {:?}, not ascending job ranks of the last epoch \
             {current:?}",
            String::from_utf8_lossy(&decided)
        ),
    })
}

/// The time left to `deadline`, at least a millisecond.
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
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

    /// Recovers from a failure: revokes this backend (if it is not already), agrees with the
    /// other survivors, through the job's store, on the members of the next epoch, and
    /// returns that epoch's backend, whose ranks are the members renumbered densely in their
    /// old order ([`TcpBackend::members`] says who is who). Every survivor calls it, within
    /// the peer timeout ([`TcpConfig::peer_timeout`](crate::TcpConfig::peer_timeout)) of the
    /// first: a rank whose check-in is later than that may be left out.
    ///
    /// One agreement per epoch: the first survivor done gathering the others' check-ins
    /// decides, and every survivor takes its decision, so survivors that saw different
    /// failures still form one group. A rank left out gets [`DistError::Excluded`] and must
    /// stop. The new epoch forms over new connections (and new shared memory) through the
    /// store; should a member fail meanwhile, the survivors agree again, on the epoch after,
    /// until `timeout` has passed. What the failed step did is not undone: redo it on the new
    /// backend. Sub-groups of this backend stay revoked; split the new one.
    ///
    /// The store must outlive the failure: a job whose rank 0 serves it (the default) cannot
    /// recover from rank 0's death; a store served apart (torchrun's agent, `cargo xtask
    /// store`) can.
    pub fn recover(self, timeout: Duration) -> Result<TcpBackend> {
        let me = self.shared.rank;
        let now = Instant::now();
        let deadline = now
            .checked_add(timeout)
            .ok_or_else(|| DistError::InvalidArgument {
                rank: me,
                op: "recover".into(),
                reason: format!("timeout {timeout:?} is too far in the future to be a deadline"),
            })?;
        self.shared
            .revoke(None, format!("rank {me} began to recover"));
        let mut current = self.shared.members.clone();
        let mut epoch = self.shared.epoch + 1;
        let my_id = current[me];
        let mut failed: BTreeSet<usize> = self
            .shared
            .failed_ranks()
            .into_iter()
            .map(|r| current[r])
            .collect();
        let keeper = self.keeper;
        let (cfg, kept) = self.dismantle();
        let (client, base, mut server) = kept.into_parts();
        let window = cfg.peer_timeout;
        loop {
            if let Some(k) = keeper {
                failed.remove(&k);
            }
            // Over a connection of its own, each operation bounded by the time left: not
            // behind a user's wait on the backend's connection, nor past `timeout` while the
            // store is slow or cut off.
            let agreed = agree_through(client.server(), &base, me, epoch, deadline, |keys| {
                agree(
                    keys, me, epoch, my_id, &current, &failed, keeper, window, deadline,
                )
            })
            .inspect_err(|_| keep_serving(server.take()))?;
            let Some(rank) = agreed.iter().position(|&id| id == my_id) else {
                keep_serving(server.take());
                return Err(DistError::Excluded {
                    rank: me,
                    epoch,
                    members: agreed,
                    reason: "the survivors judged it failed, or it checked in too late".into(),
                });
            };
            let form_by = deadline.min(Instant::now() + (2 * window).max(FORM_AT_LEAST));
            let mut c = cfg.clone();
            c.rank = rank;
            c.world_size = agreed.len();
            c.serve_store = false;
            c.init_timeout = left(form_by);
            let store = JobStore::reconnect(
                client.server(),
                format!("{base}/elastic/{epoch}/form"),
                rank,
                form_by,
            )
            .inspect_err(|_| keep_serving(server.take()))?;
            let next = Next {
                store,
                epoch,
                members: agreed.clone(),
            };
            match TcpBackend::build(c, Some(next), keeper) {
                Ok(mut b) => {
                    b.store = b.store.reparented(base, server.take());
                    tracing::info!(
                        rank = b.shared.rank,
                        epoch,
                        members = ?agreed,
                        "recovered"
                    );
                    return Ok(b);
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(rank = me, epoch, error = %e, "forming the epoch failed; agreeing again");
                    if let DistError::RendezvousFailed { missing, .. } = &e {
                        failed.extend(missing.iter().filter_map(|&r| agreed.get(r)));
                    }
                    failed.remove(&my_id);
                    current = agreed;
                    epoch += 1;
                }
                Err(e) => {
                    keep_serving(server.take());
                    return Err(e);
                }
            }
        }
    }

    /// Takes the backend apart for a recovery: its connections closed (waiting at most
    /// [`DISMANTLE_LINGER`] for the live peers to close theirs), its threads stopped; the
    /// configuration and the store are kept.
    fn dismantle(self) -> (crate::TcpConfig, crate::init::Kept) {
        let TcpBackend {
            shared,
            group,
            mut _threads,
            store,
            cfg,
            ..
        } = self;
        drop(group);
        _threads.linger_cap = Some(DISMANTLE_LINGER);
        drop(_threads);
        drop(shared);
        (cfg, store)
    }
}

/// Store servers whose rank failed or was left out of a recovery: they serve the job's
/// other ranks (their next epochs, and recoveries after) until the process exits.
static SERVING: std::sync::Mutex<Vec<dist_store::StoreServer>> = std::sync::Mutex::new(Vec::new());

/// A store server a failed or excluded recovery holds keeps serving the others until the
/// process exits ([`SERVING`]).
fn keep_serving(server: Option<dist_store::StoreServer>) {
    if let Some(s) = server {
        tracing::warn!(
            at = %s.local_addr(),
            "this rank is out of the job; it serves the job's store until it exits"
        );
        SERVING.lock().unwrap_or_else(|p| p.into_inner()).push(s);
    }
}

/// Runs `f` on the keys of epoch `epoch` (`<base>/elastic/<epoch>`) through a new connection to
/// the store at `server`, its operations bounded by the time left to `deadline`.
fn agree_through<T>(
    server: &str,
    base: &str,
    rank: usize,
    epoch: u64,
    deadline: Instant,
    f: impl FnOnce(&PrefixStore<&TcpStore>) -> Result<T>,
) -> Result<T> {
    let client = TcpStore::connect(server, left(deadline))
        .map_err(|e| DistError::Io {
            rank,
            context: format!(
                "connect to the job's store at {server} to agree on group epoch {epoch}"
            ),
            source: std::io::Error::other(crate::init::store_error_text(&e)),
        })?
        .with_timeout(left(deadline));
    f(&PrefixStore::new(
        format!("{base}/elastic/{epoch}"),
        &client,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_bad_values_are_refused() {
        let current = [0, 2, 3, 5];
        assert_eq!(
            decode(encode(&[0, 3]).as_bytes(), &current),
            Some(vec![0, 3])
        );
        for bad in ["", "3,0", "0,0", "0,1", "x", "0,,3", "-1"] {
            assert_eq!(decode(bad.as_bytes(), &current), None, "{bad:?}");
        }
    }

    #[test]
    fn a_proposal_keeps_this_rank_and_drops_the_failed_and_the_absent() {
        let failed: BTreeSet<usize> = [3].into();
        // 5 never checked in; 3 checked in but this rank knows it failed; 2 is this rank,
        // counted whether or not its own check-in is seen.
        let here = |id: usize| id == 0 || id == 3;
        assert_eq!(proposal(&[0, 2, 3, 5], 2, &failed, here), vec![0, 2]);
        // A rank others blame still proposes itself.
        let failed: BTreeSet<usize> = [2].into();
        assert_eq!(proposal(&[0, 2], 2, &failed, |_| true), vec![0, 2]);
    }
}

//! Recovering: the survivors agree on the next epoch's members, then form it
//! ([`TcpBackend::recover`]).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};

use super::agree::{agree, agree_through};
use super::{DISMANTLE_LINGER, FORM_AT_LEAST, Next, left};
use crate::TcpBackend;
use crate::init::JobStore;

impl TcpBackend {
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

//! Moving to the next epoch: the members (and the joiners taken in) agree on who is in, then
//! form it; [`TcpBackend::recover`] after a failure, [`TcpBackend::admit`] to take joiners in,
//! [`TcpBackend::join`] from a joiner's side.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};
use dist_store::{Store, StoreServer};

use super::admission::Moment;
use super::agree::{agree, agree_through, encode};
use super::joiners::{EPOCH, Facts, Intake, settle};
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
    /// backend. Sub-groups of this backend stay revoked; split the new one. Processes waiting
    /// to join ([`TcpBackend::join`]) are taken in at the agreement as the policy says
    /// ([`TcpConfig::admission`](crate::TcpConfig::admission)), after the survivors.
    ///
    /// The store must outlive the failure: a job whose rank 0 serves it (the default) cannot
    /// recover from rank 0's death; a store served apart (torchrun's agent, `cargo xtask
    /// store`) can.
    pub fn recover(self, timeout: Duration) -> Result<TcpBackend> {
        let me = self.shared.rank;
        let deadline = deadline_in(me, "recover", timeout)?;
        self.shared
            .revoke(None, format!("rank {me} began to recover"));
        self.move_on(deadline, Moment::Recovery)
    }

    /// Recovers as [`TcpBackend::recover`] does, but takes in no joiner, whatever the policy
    /// ([`TcpConfig::admission`](crate::TcpConfig::admission)): the next epoch's members are
    /// survivors of this one only, and the processes waiting to join go on waiting (for a
    /// later [`TcpBackend::admit`] or [`TcpBackend::recover`], or their own deadline). For a
    /// layer that keeps its own group beside this one, of the same members (the hybrid
    /// backend shrinks its NCCL communicator to the survivors), and has no way to take a
    /// joiner in.
    pub fn recover_members(self, timeout: Duration) -> Result<TcpBackend> {
        let me = self.shared.rank;
        let deadline = deadline_in(me, "recover", timeout)?;
        self.shared
            .revoke(None, format!("rank {me} began to recover"));
        self.move_on(deadline, Moment::MembersOnly)
    }

    /// Moves this rank to the next epoch: takes the backend apart, then agrees on the
    /// members with the others (the joiners waiting included, as the policy says at `moment`)
    /// and forms the epoch.
    pub(super) fn move_on(self, deadline: Instant, moment: Moment) -> Result<TcpBackend> {
        let me = self.shared.rank;
        let current = self.shared.members.clone();
        let epoch = self.shared.epoch + 1;
        let my_id = current[me];
        let failed: BTreeSet<usize> = self
            .shared
            .failed_ranks()
            .into_iter()
            .map(|r| current[r])
            .collect();
        let keeper = self.keeper;
        let (cfg, kept) = self.dismantle();
        let (client, base, server) = kept.into_parts();
        Mover {
            cfg,
            store_at: client.server().to_string(),
            base,
            server,
            keeper,
            my_id,
            me,
            deadline,
            moment,
        }
        .advance(epoch, current, failed, None)
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
pub(super) fn keep_serving(server: Option<dist_store::StoreServer>) {
    if let Some(s) = server {
        tracing::warn!(
            at = %s.local_addr(),
            "this rank is out of the job; it serves the job's store until it exits"
        );
        SERVING.lock().unwrap_or_else(|p| p.into_inner()).push(s);
    }
}

/// The instant `timeout` from now, for `op` on rank `rank`.
pub(super) fn deadline_in(rank: usize, op: &str, timeout: Duration) -> Result<Instant> {
    Instant::now()
        .checked_add(timeout)
        .ok_or_else(|| DistError::InvalidArgument {
            rank,
            op: op.into(),
            reason: format!("timeout {timeout:?} is too far in the future to be a deadline"),
        })
}

/// What a rank carries from one epoch to the next: how to reach the store, who it is, until
/// when it may try, and which call moves it (for the admission policy).
pub(super) struct Mover {
    pub(super) cfg: crate::TcpConfig,
    /// The store's address.
    pub(super) store_at: String,
    /// `<job prefix>`.
    pub(super) base: String,
    /// The store's server, on the rank that serves it.
    pub(super) server: Option<StoreServer>,
    pub(super) keeper: Option<usize>,
    /// This rank's job rank.
    pub(super) my_id: usize,
    /// The rank its errors name (its rank in the last epoch; a joiner's job rank).
    pub(super) me: usize,
    pub(super) deadline: Instant,
    pub(super) moment: Moment,
}

impl Mover {
    /// Agrees on epoch `epoch` with the other members of `current` (less those `failed`; the
    /// joiners waiting included), then forms it; should forming fail, agrees again on the
    /// epoch after, until the deadline. With `agreed`, the first agreement is taken as made
    /// (a joiner's: it reads the decision).
    pub(super) fn advance(
        mut self,
        mut epoch: u64,
        mut current: Vec<usize>,
        mut failed: BTreeSet<usize>,
        mut agreed: Option<Vec<usize>>,
    ) -> Result<TcpBackend> {
        let (me, my_id, deadline) = (self.me, self.my_id, self.deadline);
        let window = self.cfg.peer_timeout;
        loop {
            if let Some(k) = self.keeper {
                failed.remove(&k);
            }
            // Over a connection of its own, each operation bounded by the time left: not
            // behind a user's wait on the backend's connection, nor past the deadline while
            // the store is slow or cut off. The joiners' verdicts are settled through it too.
            let (agreed, gone) = agree_through(
                &self.store_at,
                &self.base,
                me,
                epoch,
                deadline,
                |keys, root| {
                    let err = super::joiners::store_err(me, "settle the joiners' verdicts");
                    let facts = Facts::read(root).map_err(&err)?;
                    let first_new = facts.map_or(usize::MAX, |f| f.first_world);
                    let agreed = match agreed.take() {
                        Some(a) => a,
                        None => {
                            let intake = Intake {
                                root,
                                base: &self.base,
                                secret: self.cfg.secret.as_deref(),
                                policy: self.cfg.admission,
                                moment: self.moment,
                                deadline,
                            };
                            agree(
                                keys,
                                me,
                                epoch,
                                my_id,
                                &current,
                                &failed,
                                self.keeper,
                                window,
                                deadline,
                                first_new,
                                &mut || intake.waiting(&current),
                            )?
                        }
                    };
                    let gone = if agreed.contains(&my_id) {
                        settle(root, epoch, &agreed, &current).map_err(&err)?
                    } else {
                        Vec::new()
                    };
                    Ok((agreed, gone))
                },
            )
            .inspect_err(|_| keep_serving(self.server.take()))?;
            let Some(rank) = agreed.iter().position(|&id| id == my_id) else {
                keep_serving(self.server.take());
                return Err(DistError::Excluded {
                    rank: me,
                    epoch,
                    members: agreed,
                    reason: "the survivors judged it failed, or it checked in too late".into(),
                });
            };
            if !gone.is_empty() {
                // A joiner withdrew before its verdict: every rank reads the same verdicts, and
                // every rank agrees again without it.
                tracing::warn!(rank = me, epoch, ?gone, "joiners withdrew; agreeing again");
                failed.extend(gone);
                current = agreed;
                epoch += 1;
                continue;
            }
            let form_by = deadline.min(Instant::now() + (2 * window).max(FORM_AT_LEAST));
            let mut c = self.cfg.clone();
            c.rank = rank;
            c.world_size = agreed.len();
            c.serve_store = false;
            c.init_timeout = left(form_by);
            let store = JobStore::reconnect(
                &self.store_at,
                format!("{}/elastic/{epoch}/form", self.base),
                rank,
                form_by,
            )
            .inspect_err(|_| keep_serving(self.server.take()))?;
            let next = Next {
                store,
                epoch,
                members: agreed.clone(),
            };
            match TcpBackend::build(c, Some(next), self.keeper) {
                Ok(mut b) => {
                    b.store = b.store.reparented(self.base.clone(), self.server.take());
                    tracing::info!(
                        rank = b.shared.rank,
                        epoch,
                        members = ?agreed,
                        "formed"
                    );
                    if rank == 0 {
                        // For joiners' errors: the last epoch formed.
                        let text = format!("{epoch} {}", encode(&agreed));
                        if let Err(e) = b.store_under("elastic").set(EPOCH, text.as_bytes()) {
                            tracing::warn!(epoch, error = %e, "could not note the epoch formed");
                        }
                    }
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
                    keep_serving(self.server.take());
                    return Err(e);
                }
            }
        }
    }
}

//! Recovering the job's hybrid backend after a failure: the TCP side through
//! `TcpBackend::recover` (the survivors agree on the members through the job's store), the NCCL
//! side shrunk to the same members (`Communicator::shrink`), or formed anew from a unique id
//! sent over the new TCP backend where a shrink cannot be made (an NCCL older than 2.27, or a
//! shrink that failed on some member).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError};
use dist_nccl::{Communicator, UniqueId};
use dist_tcp::TcpBackend;

use crate::{HybridBackend, HybridError, Result, nccl_config_for};

/// How long the check's threads have to let go of the TCP backend once stopped.
const LET_GO: Duration = Duration::from_secs(5);

impl HybridBackend {
    /// Recovers from a failure, as [`TcpBackend::recover_members`] does for the TCP side (no
    /// process waiting to join is taken in: it goes on waiting): the NCCL
    /// side is revoked at once ([`Communicator::revoke`]: its pending and later calls fail),
    /// the survivors agree through the job's store on the next epoch's members and form its
    /// TCP backend, and the NCCL communicator is shrunk to the same members, renumbered alike
    /// (ranks the agreement left out are excluded; with none left out, the same members form
    /// a new communicator). Where the shrink cannot be made on every member (an NCCL older
    /// than 2.27, a shrink that failed somewhere), every member drops what it got and they
    /// form a new communicator from a unique id that the new rank 0 makes and broadcasts over
    /// the new TCP backend, on the same GPU. Every survivor calls it, within the TCP peer
    /// timeout of the first; a rank left out gets [`DistError::Excluded`] (as
    /// [`HybridError::Tcp`]) and must stop.
    ///
    /// Only the job's own backend recovers: drop its [`crate::HybridGroup`]s first (they hold
    /// its TCP backend; refused, after the revoke, if they still do), and split the new one.
    /// What the failed step did is not undone: redo it on the new backend. `timeout` bounds
    /// the TCP side's agreement and forming; the NCCL side then has the NCCL config's init
    /// timeout ([`nccl_config_for`]).
    pub fn recover(mut self, timeout: Duration) -> Result<HybridBackend> {
        let me = self.tcp.rank();
        let started = Instant::now();
        let comm = self.nccl.take();
        if let Some(c) = &comm {
            c.revoke(format!("rank {me} began to recover"));
        }
        let check_calls = self.check_calls;
        let why_no_nccl = std::mem::take(&mut self.why_no_nccl);
        // The check's threads and the record hold the TCP backend: stopped and dropped.
        if let Some(mut c) = self.checker.take() {
            c.stop(Instant::now() + Duration::from_secs(2));
        }
        self.watch = None;
        let tcp = self.root.clone();
        drop(self);
        let tcp = sole_owner(tcp, me)?;
        let old_members = tcp.members().to_vec();
        // No joiner: the NCCL side is shrunk to survivors, and a joiner has no GPU rank.
        let tcp = tcp.recover_members(timeout)?;
        let Some(comm) = comm else {
            return Ok(Self::tcp_only(tcp, why_no_nccl));
        };
        let exclude: Vec<usize> = (0..old_members.len())
            .filter(|&r| !tcp.members().contains(&old_members[r]))
            .collect();
        let cfg = nccl_config_for(&tcp);
        let (rank, size) = (tcp.rank(), tcp.world_size());
        let shrunk = comm
            .shrink(&exclude, cfg.clone())
            .and_then(|c| {
                if (c.rank(), c.size()) == (rank, size) {
                    Ok(c)
                } else {
                    Err(dist_nccl::NcclError::Config {
                        what: format!("rank {me}: recover"),
                        reason: format!(
                            "the shrunk communicator numbers this rank {} of {}, the TCP \
                             backend {rank} of {size}",
                            c.rank(),
                            c.size()
                        ),
                    })
                }
            })
            .inspect_err(|e| {
                tracing::warn!(rank = me, error = %e, "NCCL shrink failed; forming anew");
            });
        // Every member takes the shrunk communicator only where every one has it.
        let mut all = vec![0u8; size];
        tcp.all_gather(&[u8::from(shrunk.is_ok())], &mut all)?;
        let fresh = if all.iter().all(|&b| b == 1) {
            shrunk?
        } else {
            drop(shrunk);
            formed_anew(&tcp, &comm, cfg)?
        };
        tracing::info!(
            rank = rank,
            epoch = tcp.epoch(),
            excluded = ?exclude,
            took = ?started.elapsed(),
            "hybrid backend recovered"
        );
        drop(comm);
        Ok(Self::with_comm(tcp, fresh, check_calls))
    }
}

/// The TCP backend out of its `Arc`, once the check's threads (stopped) have let go of it,
/// within [`LET_GO`].
fn sole_owner(mut tcp: Arc<TcpBackend>, me: usize) -> Result<TcpBackend> {
    let until = Instant::now() + LET_GO;
    loop {
        match Arc::try_unwrap(tcp) {
            Ok(t) => return Ok(t),
            Err(back) if Instant::now() < until => {
                tcp = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => {
                return Err(HybridError::Tcp(DistError::InvalidArgument {
                    rank: me,
                    op: "recover".into(),
                    reason: format!(
                        "the backend's TCP side is still held elsewhere after {LET_GO:?} (its \
                         groups, or a thread of its own): drop the groups before recovering"
                    ),
                }));
            }
        }
    }
}

/// A new communicator of `tcp`'s ranks, on `old`'s GPU and library, from a unique id the new
/// rank 0 makes and broadcasts over `tcp` (a flag byte first: whether it could make one).
fn formed_anew(
    tcp: &TcpBackend,
    old: &Communicator,
    cfg: dist_nccl::CommConfig,
) -> Result<Communicator> {
    let (me, n) = (tcp.rank(), tcp.world_size());
    let mut buf = [0u8; 129];
    if me == 0 {
        match UniqueId::new(old.nccl()) {
            Ok(id) => {
                buf[0] = 1;
                buf[1..].copy_from_slice(id.as_bytes());
            }
            Err(e) => tracing::warn!(rank = me, error = %e, "cannot make an NCCL unique id"),
        }
    }
    tcp.broadcast(&mut buf[..], 0)?;
    if buf[0] != 1 {
        return Err(HybridError::NcclSetup {
            rank: me,
            failed: vec![(0, "made no NCCL unique id for the recovered epoch".into())],
        });
    }
    let id = UniqueId::from_bytes(&buf[1..])?;
    Ok(Communicator::init_rank(
        old.nccl().clone(),
        old.context(),
        me,
        n,
        &id,
        cfg,
    )?)
}

//! Sub-groups of a hybrid backend ([`HybridGroup`]): the TCP sub-group of `dist-core`'s
//! [`Subgroups`] for host buffers and point-to-point messages, beside an NCCL sub-communicator
//! made with `ncclCommSplit` for device buffers. A group is a [`HybridBackend`] whose TCP side
//! is a [`TcpGroup`], so every call of the backend (the dispatch on the buffer's type, the
//! argument checks, the `_async` device calls and their [`GpuWork`](crate::GpuWork)) is the
//! group's too.
//!
//! ```no_run
//! use dist_core::{Backend, ReduceOp};
//! use dist_hybrid::HybridBackend;
//!
//! # fn main() -> Result<(), dist_hybrid::HybridError> {
//! let h = HybridBackend::from_env()?;
//! // 4 ranks as 2 × 2: ranks {0, 1} and {2, 3} form rows, {0, 2} and {1, 3} columns.
//! let row = h.split(Some((h.rank() / 2) as u32), 0)?.expect("every rank has a row");
//! let col = h.split(Some((h.rank() % 2) as u32), 0)?.expect("and a column");
//! let mut x = vec![1.0f32; 8];
//! row.all_reduce(&mut x[..], ReduceOp::Sum)?; // over the row's TCP sub-group
//! col.all_reduce(&mut x[..], ReduceOp::Sum)?; // now 4.0 everywhere
//! # Ok(()) }
//! ```

use std::sync::Arc;

use dist_core::{Backend, SplitLink, Subgroups, Transport};
use dist_tcp::{TcpGroup, TcpLink};

use crate::{HybridBackend, Result, nccl_config_for, watch};

/// A sub-group of a [`HybridBackend`]: a TCP sub-group beside an NCCL sub-communicator (when
/// the backend has NCCL), with every call of the backend. Made by [`HybridBackend::split`] and
/// [`HybridBackend::new_group`]; its groups are made the same way.
pub type HybridGroup = HybridBackend<TcpGroup>;

impl<H> HybridBackend<H>
where
    H: Transport<Link: SplitLink<Root = TcpLink>>,
{
    /// MPI_Comm_split over this backend's (or group's) ranks, as
    /// [`Subgroups::split`]: the ranks passing the same `color`
    /// form a group, ordered by `(key, rank here)`; a rank passing `None` takes part and gets
    /// `Ok(None)`. Collective: every rank here must call it, in the same order as its other
    /// collectives.
    ///
    /// With NCCL, the group's NCCL communicator is split from this one's (`ncclCommSplit`,
    /// collective over this communicator: a rank outside every group passes
    /// `NCCL_SPLIT_NOCOLOR`), its ranks in the TCP group's order, within the NCCL init
    /// timeout. Without NCCL the group is TCP-only, for the same reason as this backend.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<HybridGroup>> {
        let host = self.tcp.split(color, key)?;
        self.with_sub_nccl(host)
    }

    /// PyTorch's `new_group`, as [`Subgroups::new_group`]:
    /// every rank here passes the same list of distinct ranks; group rank `i` is `ranks[i]`,
    /// and the ranks not listed get `Ok(None)`. A bad or differing list is an error on every
    /// rank. The NCCL side as for [`HybridBackend::split`].
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<HybridGroup>> {
        let host = self.tcp.new_group(ranks)?;
        self.with_sub_nccl(host)
    }

    /// [`HybridBackend::split`], the group named `name` in its host errors, as
    /// [`Subgroups::split_named`] names a TCP group.
    pub fn split_named(
        &self,
        color: Option<u32>,
        key: i64,
        name: &str,
    ) -> Result<Option<HybridGroup>> {
        let host = self.tcp.split_named(color, key, name)?;
        self.with_sub_nccl(host)
    }

    /// [`HybridBackend::new_group`], the group named `name` in its host errors, as
    /// [`Subgroups::new_group_named`] names a TCP group.
    pub fn new_group_named(&self, ranks: &[usize], name: &str) -> Result<Option<HybridGroup>> {
        let host = self.tcp.new_group_named(ranks, name)?;
        self.with_sub_nccl(host)
    }

    /// The group for `host` (this rank's TCP group, if it has one), with the NCCL
    /// sub-communicator split from this one's. Every rank here calls it after the TCP split,
    /// which every rank passed (or failed on) alike.
    fn with_sub_nccl(&self, host: Option<TcpGroup>) -> Result<Option<HybridGroup>> {
        let Some(comm) = &self.nccl else {
            return Ok(host.map(|g| self.group_of(g, None)));
        };
        let cfg = nccl_config_for(&self.root);
        let Some(g) = host else {
            comm.split_none(cfg).map_err(|e| self.explain_nccl(e))?;
            return Ok(None);
        };
        // The color: the job rank of the group's rank 0, distinct between groups and under
        // NCCL's 2^31; the key: the rank in the TCP group, so both sides number ranks alike.
        let color = g.link().root_rank(0) as u32;
        let key = i32::try_from(g.rank()).expect("a group rank fits an i32");
        let sub = comm
            .split(color, key, cfg)
            .map_err(|e| self.explain_nccl(e))?;
        Ok(Some(self.group_of(g, Some(sub))))
    }

    fn group_of(&self, g: TcpGroup, nccl: Option<dist_nccl::Communicator>) -> HybridGroup {
        // The group's own record of its NCCL calls (failures abort its communicator); no trace
        // file, which is the job's communicator's.
        let watch = nccl
            .as_ref()
            .map(|c| Arc::new(watch::Watch::new(g.rank(), c.abort_handle(), None)));
        HybridBackend {
            tcp: Arc::new(g),
            root: self.root.clone(),
            whole_job: false,
            nccl,
            why_no_nccl: self.why_no_nccl.clone(),
            watch,
            checker: None,
            check_calls: false,
        }
    }
}

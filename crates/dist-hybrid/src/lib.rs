//! `HybridBackend`: TCP for point-to-point messages, barriers and host-memory collectives, NCCL
//! for GPU collectives, like PyTorch's ProcessGroupNCCL with Gloo beside it. One call forms
//! both from the launcher's environment (torchrun, Slurm, Open MPI, `cargo xtask run`).
//!
//! ```no_run
//! use dist_core::{Backend, ReduceOp};
//! use dist_hybrid::HybridBackend;
//!
//! # fn main() -> Result<(), dist_hybrid::HybridError> {
//! let h = HybridBackend::from_env()?;          // TCP mesh, then NCCL if a GPU is here
//! let mut host = vec![1.0f32; 1024];
//! h.all_reduce(&mut host[..], ReduceOp::Sum)?;  // a host buffer: over TCP
//! if let Some(nccl) = h.nccl() {
//!     let mut dev = nccl.stream().clone_htod(&host).unwrap();
//!     h.all_reduce(&mut dev, ReduceOp::Sum)?;   // a device buffer: over NCCL
//!     h.synchronize_nccl()?;
//! }
//! h.send(b"done", (h.rank() + 1) % h.world_size())?; // point-to-point: over TCP
//! # Ok(()) }
//! ```
//!
//! Every collective takes host slices or device buffers alike ([`Buffer`]): all_reduce,
//! broadcast, reduce, all_gather, reduce_scatter, all_to_all(_v), gather, scatter, the uneven
//! all_gather_v, gather_v and scatter_v, and `send_to`/`recv_from` (TCP messages, or NCCL's
//! point-to-point for device buffers). The `_async` variants on device buffers return a
//! [`GpuWork`] to wait on while the host computes; [`HybridBackend::scope`] runs async host
//! work. [`HybridBackend::split`] and [`HybridBackend::new_group`] make [`HybridGroup`]s: a TCP
//! sub-group beside an NCCL sub-communicator, with all of these calls.

#![deny(missing_docs)]

mod buffer;
mod capture;
mod check;
mod device;
mod gpu_work;
mod groups;
mod host;
mod recover;
mod setup;
mod watch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use dist_core::collectives::Kind;
use dist_core::{Backend, Collectives, DistError, Tag, Transport};
use dist_nccl::{CommConfig, Communicator, Nccl, NcclError, NcclType, UniqueId};
use dist_tcp::{LaunchEnv, TcpBackend, TcpConfig};

pub use buffer::Buffer;
pub use capture::{HybridCapture, HybridGraph};
pub use gpu_work::GpuWork;
pub use groups::HybridGroup;
pub use host::{HostId, LocalRanks, local_ranks};

/// Everything that can go wrong in a hybrid backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HybridError {
    /// From the TCP side (rendezvous, messages, host collectives).
    #[error(transparent)]
    Tcp(#[from] DistError),
    /// From the NCCL side.
    #[error(transparent)]
    Nccl(#[from] NcclError),
    /// A GPU collective was asked for where no NCCL communicator was formed.
    #[error(
        "rank {rank}: {op} on a device buffer, but this backend has no NCCL communicator ({why})"
    )]
    NoNccl {
        /// The rank.
        rank: usize,
        /// The call.
        op: String,
        /// Why there is none.
        why: String,
    },
    /// An NCCL call or synchronize timed out (no rank was seen to fail and no mismatch was
    /// found): where every rank's NCCL calls were then, asked over the TCP mesh. The ranks
    /// furthest behind come first, e.g. "rank 1 finished #41 all_reduce; rank 0 waits in #42
    /// all_reduce".
    #[error("{source}; where the ranks' NCCL calls are: {positions}")]
    NcclTimeout {
        /// The rank reporting.
        rank: usize,
        /// NCCL's timeout.
        source: Box<NcclError>,
        /// Every rank's latest NCCL call and its state.
        positions: String,
    },
    /// NCCL was asked for (a unique id given, or [`GpuChoice::Device`] on some rank) but not
    /// every rank can have a GPU of its own; every rank gets this error.
    #[error(
        "rank {rank}: NCCL was asked for (by ranks {asked:?}) but ranks {without:?} have no GPU \
         of their own (no CUDA device, more ranks on their host than GPUs, or a device ordinal \
         past the last); use GpuChoice::Auto to fall back to TCP"
    )]
    GpuMissing {
        /// The rank reporting.
        rank: usize,
        /// The ranks that asked for NCCL explicitly.
        asked: Vec<usize>,
        /// The ranks without a GPU.
        without: Vec<usize>,
    },
    /// Setting up NCCL failed on some rank (loading the library, opening its device, or rank
    /// 0 making the unique id); the ranks agree on that before NCCL init, so every rank gets
    /// this error, naming each rank that failed and why.
    #[error("rank {rank}: NCCL setup failed: {}", setup::describe(failed))]
    NcclSetup {
        /// The rank reporting.
        rank: usize,
        /// Each rank that failed, with its reason.
        failed: Vec<(usize, String)>,
    },
}

/// Shorthand for results whose error is [`HybridError`].
pub type Result<T, E = HybridError> = std::result::Result<T, E>;

/// How to form the NCCL side.
#[derive(Clone, Debug)]
pub enum GpuChoice {
    /// The GPU of the local rank; no NCCL communicator (for any rank) when some rank has none
    /// of its own: no GPU, or more ranks on its host than visible GPUs (NCCL refuses two ranks
    /// of one communicator on one GPU). That fallback to TCP is logged as a warning.
    Auto,
    /// This device ordinal. NCCL is then required: if any rank cannot have its GPU, every rank
    /// gets [`HybridError::GpuMissing`].
    Device(usize),
    /// TCP only.
    None,
}

/// TCP and NCCL, formed together.
///
/// With NCCL, two background threads check every NCCL call made through the backend against
/// the previous rank's (see the crate's guide, "when something goes wrong"): a mismatch, or a
/// rank whose TCP connection closes, aborts the communicator on every rank with an error
/// naming the ranks, the calls and the NCCL op in flight. `DIST_NCCL_CHECK=0` turns the
/// comparison off (a dead rank is still reported).
pub struct HybridBackend<H: Transport = TcpBackend> {
    tcp: Arc<H>,
    /// The whole job's TCP mesh (the same as `tcp` on the backend itself; a group's parent
    /// mesh): where every rank's NCCL calls are is asked over it.
    root: Arc<TcpBackend>,
    /// Whether this is the job's own backend (not a group): its NCCL calls' positions are
    /// the ones the TCP heartbeats carry.
    whole_job: bool,
    nccl: Option<Communicator>,
    why_no_nccl: String,
    watch: Option<Arc<watch::Watch>>,
    checker: Option<check::Checker>,
    check_calls: bool,
}

impl<H: Transport> Drop for HybridBackend<H> {
    /// Stops the check's threads (within 2 s) before the communicator and the TCP mesh go.
    fn drop(&mut self) {
        if let Some(mut c) = self.checker.take() {
            c.stop(Instant::now() + Duration::from_secs(2));
        }
    }
}

/// Whether `DIST_NCCL_CHECK` leaves the call check on (anything but `0`, `off`, `false`).
fn check_from_env() -> bool {
    !matches!(
        std::env::var("DIST_NCCL_CHECK").as_deref(),
        Ok("0" | "off" | "false")
    )
}

impl<H: Transport + std::fmt::Debug> std::fmt::Debug for HybridBackend<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridBackend")
            .field("tcp", &self.tcp)
            .field("nccl", &self.nccl)
            .finish()
    }
}

/// The NCCL configuration that matches a TCP job's: the same operation timeout
/// (`DIST_TIMEOUT` or the builder's), so one deadline bounds every operation.
pub fn nccl_config_for(tcp: &TcpBackend) -> CommConfig {
    CommConfig {
        timeout: tcp.default_timeout(),
        ..CommConfig::default()
    }
}

/// The device for `local_rank` when `devices` are visible: the one of that ordinal, if there
/// is one. Sharing a GPU between ranks is not an option: NCCL refuses a communicator with two
/// ranks on one device.
pub fn pick_device(local_rank: usize, devices: usize) -> Option<usize> {
    (local_rank < devices).then_some(local_rank)
}

impl HybridBackend {
    /// Forms the job as `rank` of `world_size` with rank 0 at `master`, using the NCCL id given
    /// (every rank passes the same one; see [`UniqueId`]). Each rank takes the GPU of its local
    /// rank, the number of lower ranks on its host ([`local_ranks`]). An id means NCCL is
    /// wanted: if some rank has no GPU of its own, every rank gets
    /// [`HybridError::GpuMissing`].
    pub fn new(
        rank: usize,
        world_size: usize,
        master: &str,
        unique_id: &UniqueId,
    ) -> Result<HybridBackend> {
        let tcp = TcpBackend::new(rank, world_size, master)?;
        let local = local_ranks(&tcp, HostId::here())?.local_rank;
        let cfg = nccl_config_for(&tcp);
        Self::with_nccl(tcp, local, GpuChoice::Auto, Some(*unique_id), cfg)
    }

    /// Forms the job: the TCP mesh, then a NCCL id made by rank 0 and put in the job's store
    /// ([`TcpBackend::store`]'s, under a prefix of its own), then the
    /// NCCL communicator on the GPU of this rank's local rank (if every rank has one; TCP only
    /// otherwise, with a warning).
    pub fn init(rank: usize, world_size: usize, master: &str) -> Result<HybridBackend> {
        let tcp = TcpBackend::new(rank, world_size, master)?;
        let local = local_ranks(&tcp, HostId::here())?.local_rank;
        let cfg = nccl_config_for(&tcp);
        Self::with_nccl(tcp, local, GpuChoice::Auto, None, cfg)
    }

    /// [`HybridBackend::init`] from the launcher's environment (torchrun, Slurm, Open MPI; see
    /// [`LaunchEnv`]), choosing the GPU from the local rank (the launcher's, else the one
    /// [`local_ranks`] finds). `DIST_TIMEOUT` bounds the NCCL side's work too.
    pub fn from_env() -> Result<HybridBackend> {
        Self::from_env_inner(GpuChoice::Auto, None)
    }

    /// [`HybridBackend::from_env`] with a GPU choice and an NCCL configuration (whose
    /// `timeout` is used as given).
    pub fn from_env_with(gpu: GpuChoice, nccl: CommConfig) -> Result<HybridBackend> {
        Self::from_env_inner(gpu, Some(nccl))
    }

    fn from_env_inner(gpu: GpuChoice, nccl: Option<CommConfig>) -> Result<HybridBackend> {
        let env = LaunchEnv::from_env()?;
        let cfg = TcpConfig::from_launch(&env, |k| std::env::var(k).ok())?;
        let tcp = TcpBackend::with_config(cfg)?;
        // Every rank runs the exchange (it is collective), even where the launcher gave the
        // local rank, so that no rank waits on another that skipped it.
        let found = local_ranks(&tcp, HostId::here())?.local_rank;
        let local = env.local_rank.unwrap_or(found);
        let nccl = nccl.unwrap_or_else(|| nccl_config_for(&tcp));
        Self::with_nccl(tcp, local, gpu, None, nccl)
    }

    /// Adds NCCL to a formed TCP job. Collective over the TCP ranks: every rank must call it.
    pub fn with_nccl(
        tcp: TcpBackend,
        local_rank: usize,
        gpu: GpuChoice,
        id: Option<UniqueId>,
        cfg: CommConfig,
    ) -> Result<HybridBackend> {
        let (me, n) = (tcp.rank(), tcp.world_size());
        let devices = dist_nccl::cuda_device_count();
        let asked = id.is_some() || matches!(gpu, GpuChoice::Device(_));
        let device = match gpu {
            GpuChoice::None => None,
            GpuChoice::Device(d) => (d < devices).then_some(d),
            GpuChoice::Auto => {
                let d = pick_device(local_rank, devices);
                if d.is_none() && devices > 0 {
                    tracing::warn!(
                        rank = me,
                        local_rank,
                        devices,
                        "more local ranks than visible GPUs: NCCL off, TCP only"
                    );
                }
                d
            }
        };
        // Every rank must agree on whether NCCL is formed: a rank without a GPU makes it TCP-only
        // for all, or an error on all where some rank asked for NCCL explicitly.
        let mine = [u8::from(device.is_some()) | (u8::from(asked) << 1)];
        let mut all = vec![0u8; n];
        tcp.all_gather(&mine, &mut all)?;
        let without: Vec<usize> = (0..n).filter(|&r| all[r] & 1 == 0).collect();
        let askers: Vec<usize> = (0..n).filter(|&r| all[r] & 2 != 0).collect();
        if !without.is_empty() && !askers.is_empty() {
            return Err(HybridError::GpuMissing {
                rank: me,
                asked: askers,
                without,
            });
        }
        let Some(device) = device.filter(|_| without.is_empty()) else {
            let why = if devices == 0 {
                "no CUDA device here".to_string()
            } else if device.is_none() && matches!(gpu, GpuChoice::Auto) {
                format!("local rank {local_rank} has no GPU of its own ({devices} visible)")
            } else {
                format!(
                    "ranks {without:?} have no GPU of their own (none there, more ranks on \
                     their host than GPUs, or GPUs turned off)"
                )
            };
            if !matches!(gpu, GpuChoice::None) {
                tracing::warn!(rank = me, why = %why, "NCCL off, TCP only");
            }
            return Ok(Self::tcp_only(tcp, why));
        };
        // This rank's setup (the library, the device, rank 0's unique id where none was given),
        // agreed by every rank before NCCL init: a rank that failed is named, with its reason,
        // on every rank (not left to a closed connection or an init timeout naming no rank).
        let local = (|| -> std::result::Result<_, String> {
            let nccl = Nccl::load()
                .map(Arc::new)
                .map_err(|e| format!("cannot load NCCL: {}", NcclError::from(e)))?;
            let ctx =
                CudaContext::new(device).map_err(|e| format!("cannot open cuda:{device}: {e}"))?;
            let made = match id {
                None if me == 0 => Some(
                    *UniqueId::new(&nccl)
                        .map_err(|e| format!("cannot make the NCCL unique id: {e}"))?
                        .as_bytes(),
                ),
                _ => None,
            };
            Ok((nccl, ctx, made))
        })();
        let outcome = local
            .as_ref()
            .map(|(_, _, made)| *made)
            .map_err(String::clone);
        let rank0_id = setup::agree(&tcp, outcome)?;
        let (nccl, ctx) = match local {
            Ok((nccl, ctx, _)) => (nccl, ctx),
            // `agree` has failed every rank where one failed.
            Err(why) => {
                return Err(HybridError::NcclSetup {
                    rank: me,
                    failed: vec![(me, why)],
                });
            }
        };
        let id = match (id, rank0_id) {
            (Some(id), _) => id,
            (None, Some(bytes)) => UniqueId::from_bytes(&bytes)?,
            (None, None) => {
                return Err(HybridError::NcclSetup {
                    rank: me,
                    failed: vec![(
                        0,
                        "made no NCCL unique id (it was given one, this rank was not)".into(),
                    )],
                });
            }
        };
        let comm = Communicator::init_rank(nccl, &ctx, me, n, &id, cfg)?;
        Ok(Self::with_comm(tcp, comm, check_from_env()))
    }
}

impl<H: Transport> HybridBackend<H> {
    /// The TCP side: the whole job's mesh, or a group's sub-group of it.
    pub fn tcp(&self) -> &H {
        &self.tcp
    }

    /// The job's store under a prefix of the job's own, for user code to coordinate beside
    /// the collectives (the TCP mesh's: [`TcpBackend::store`]; a group's is its job's).
    pub fn store(&self) -> dist_tcp::dist_store::PrefixStore<Arc<dist_tcp::dist_store::TcpStore>> {
        self.root.store()
    }

    /// Opens a `dist-core` [`Scope`](dist_core::Scope) for async host work on the TCP side
    /// (collectives on host buffers, sends and receives, each returning a
    /// [`Work`](dist_core::Work) handle), as [`Collectives::scope`]: every piece of work has
    /// ended when it returns. Device buffers' async calls are the `_async` methods
    /// ([`GpuWork`]), which may be issued inside the scope.
    pub fn scope<'scope, R>(
        &'scope self,
        f: impl for<'s> FnOnce(&'s dist_core::Scope<'s, 'scope, H::Link>) -> dist_core::Result<R>,
    ) -> Result<R> {
        Ok(self.tcp.scope(f)?)
    }

    /// The NCCL side, if formed.
    pub fn nccl(&self) -> Option<&Communicator> {
        self.nccl.as_ref()
    }

    /// Why there is no NCCL communicator (`None` when there is one).
    pub fn why_no_nccl(&self) -> Option<&str> {
        self.nccl.is_none().then_some(self.why_no_nccl.as_str())
    }

    /// Waits for the NCCL work enqueued so far (no-op without NCCL), within the NCCL timeout
    /// (`DIST_TIMEOUT`'s, see [`nccl_config_for`]).
    pub fn synchronize_nccl(&self) -> Result<()> {
        self.sync_with(|c| c.synchronize())
    }

    /// [`HybridBackend::synchronize_nccl`] with a deadline of its own (capped at the NCCL
    /// timeout): past it, the communicator is aborted and this returns the timeout.
    pub fn synchronize_nccl_timeout(&self, timeout: Duration) -> Result<()> {
        self.sync_with(|c| c.synchronize_timeout(timeout))
    }

    fn sync_with(&self, f: impl FnOnce(&Communicator) -> dist_nccl::Result<()>) -> Result<()> {
        let (Some(c), Some(w)) = (&self.nccl, &self.watch) else {
            return Ok(());
        };
        let r = f(c);
        match &r {
            Ok(()) => w.synced(Ok(())),
            Err(e) => w.synced(Err(e)),
        }
        r.map_err(|e| self.explain_nccl(e))
    }

    /// The hybrid's error for an NCCL error: on the job's own backend, a timeout says where
    /// every rank's NCCL calls are (asked of the peers over TCP, within 200 ms). A group's
    /// calls are not in the positions the heartbeats carry, so its errors are NCCL's.
    pub(crate) fn explain_nccl(&self, e: NcclError) -> HybridError {
        if !matches!(e, NcclError::Timeout { .. }) || !self.whole_job {
            return e.into();
        }
        let positions = self
            .root
            .positions_beside(std::time::Duration::from_millis(200));
        HybridError::NcclTimeout {
            rank: self.tcp.rank(),
            source: Box::new(e),
            positions: dist_core::flight::describe_positions(&positions),
        }
    }

    /// Aborts the NCCL communicator at once because rank `peer` failed (`cause` says how):
    /// the calls and the synchronize of this rank fail from now on with an error naming
    /// `peer`, `cause` and the NCCL op in flight here. No-op without NCCL.
    pub fn peer_failed(&self, peer: usize, cause: &str) {
        if let Some(w) = &self.watch {
            w.peer_failed(peer, cause);
        }
    }

    /// The first failure the NCCL side was aborted for (a mismatch, a failed peer), with the
    /// NCCL op in flight then.
    pub fn nccl_failure(&self) -> Option<&str> {
        self.watch.as_ref().and_then(|w| w.failure())
    }

    /// The flight recorder of the NCCL calls made through this backend (sequence number,
    /// collective, type, count, root; queued until a synchronize sees them done).
    pub fn nccl_flight(&self) -> Option<&dist_core::flight::FlightRecorder> {
        self.watch.as_ref().map(|w| &w.flight)
    }

    /// NCCL calls the check did not compare: dropped because its queue or its record was
    /// full (4,096 of each), on this rank or the previous one.
    pub fn unchecked_calls(&self) -> u64 {
        self.checker.as_ref().map_or(0, |c| {
            c.dropped.load(std::sync::atomic::Ordering::Relaxed)
                + c.matcher
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .unchecked
        })
    }

    /// Turns the comparison of NCCL calls on or off (initially on unless `DIST_NCCL_CHECK=0`).
    /// Every rank must switch between the same two calls; calls made while it is off are not
    /// compared (they still count in the sequence, so the ranks stay in step). A failed rank is
    /// reported either way.
    pub fn set_nccl_check(&mut self, on: bool) {
        self.check_calls = on && self.checker.is_some();
    }

    /// Runs one NCCL collective `f` through the record and the check. `op` is what the check
    /// compares beside the kind, type, count and root: the reduce op's name, or the uneven
    /// collectives' counts' fingerprint.
    pub(crate) fn nccl_call<T: NcclType>(
        &self,
        coll: Kind,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
        f: impl FnOnce(&Communicator) -> dist_nccl::Result<()>,
    ) -> Result<()> {
        let c = self.need_nccl(coll.name())?;
        self.checked(coll.name(), T::NAME, count, op, root, || f(c))
    }

    /// Records one enqueue of NCCL work (a collective, or a graph's replay) with the record
    /// and hands its descriptor to the check, then runs `f`, which enqueues it.
    pub(crate) fn checked(
        &self,
        coll: &'static str,
        dtype: &'static str,
        count: usize,
        op: Option<&str>,
        root: Option<usize>,
        f: impl FnOnce() -> dist_nccl::Result<()>,
    ) -> Result<()> {
        let Some(w) = &self.watch else {
            return Ok(f()?);
        };
        let d = w.begin(coll, dtype, count, op, root);
        self.note_for_check(w, d);
        f().map_err(|e| {
            w.failed_call(&e);
            self.explain_nccl(e)
        })
    }

    /// Hands `d` to the check, where it is on.
    pub(crate) fn note_for_check(&self, w: &watch::Watch, d: check::Desc) {
        // Once aborted, the calls only fail here: nothing more to compare.
        if self.check_calls
            && w.failure().is_none()
            && let Some(k) = &self.checker
        {
            k.note(d);
        }
    }

    /// Runs one NCCL point-to-point call (`send` or `recv` with `peer`) through the record;
    /// the check does not compare it (only the two ranks make it).
    pub(crate) fn nccl_p2p<T: NcclType>(
        &self,
        op: &'static str,
        count: usize,
        peer: usize,
        f: impl FnOnce(&Communicator) -> dist_nccl::Result<()>,
    ) -> Result<()> {
        let c = self.need_nccl(op)?;
        let Some(w) = &self.watch else {
            return Ok(f(c)?);
        };
        w.begin_p2p(op, T::NAME, count, peer);
        f(c).map_err(|e| {
            w.failed_call(&e);
            self.explain_nccl(e)
        })
    }

    pub(crate) fn need_nccl(&self, op: &str) -> Result<&Communicator> {
        self.nccl.as_ref().ok_or_else(|| HybridError::NoNccl {
            rank: self.tcp.rank(),
            op: op.into(),
            why: self.why_no_nccl.clone(),
        })
    }
}

/// Point-to-point messages and the barrier go over TCP.
impl<H: Transport> Backend for HybridBackend<H> {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world_size(&self) -> usize {
        self.tcp.world_size()
    }

    fn default_timeout(&self) -> Duration {
        self.tcp.default_timeout()
    }

    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> dist_core::Result<()> {
        self.tcp.send_tagged(data, dst, tag)
    }

    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> dist_core::Result<()> {
        self.tcp.recv_tagged_timeout(buf, src, tag, timeout)
    }

    fn barrier_timeout(&self, timeout: Duration) -> dist_core::Result<()> {
        self.tcp.barrier_timeout(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_from_local_rank() {
        assert_eq!(pick_device(1, 2), Some(1));
        // Four ranks on a host with two GPUs: ranks 2 and 3 must not share ranks 0 and 1's
        // devices (NCCL fails the whole communicator with "Duplicate GPU detected").
        assert_eq!(pick_device(2, 2), None);
        assert_eq!(pick_device(5, 4), None);
        assert_eq!(pick_device(0, 0), None);
    }
}

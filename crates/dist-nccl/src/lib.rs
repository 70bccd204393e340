//! Safe NCCL on cudarc device buffers: communicators with deadlines, every collective and
//! point-to-point call with its arguments checked before NCCL sees them, and a watchdog that
//! aborts a communicator whose work stops making progress (once no thread is inside an NCCL
//! call on it: a call that NCCL itself blocks in on the blocking communicator, such as the
//! first connect to a peer that never calls, is reported, not ended; see
//! `CommConfig::nonblocking_calls`).
//!
//! ```no_run
//! use std::sync::Arc;
//! use cudarc::driver::CudaContext;
//! use dist_core::ReduceOp;
//! use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let nccl = Arc::new(Nccl::load()?);
//! // Rank 0 makes the id and every rank gets it (over TCP, from the launcher, ...).
//! let id = UniqueId::new(&nccl)?;
//! let ctx = CudaContext::new(0)?;
//! let comm = Communicator::init_rank(nccl, &ctx, 0, 1, &id, CommConfig::default())?;
//! let mut x = comm.stream().clone_htod(&[1.0f32; 1024])?;
//! comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
//! comm.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! A communicator forms in NCCL's nonblocking mode, so that init is polled against its deadline,
//! and is then split into a blocking communicator, whose calls cost what plain NCCL's do; the
//! nonblocking one is kept for [`Communicator::split`], which is polled against its deadline too
//! (NCCL blocks inside a split issued on a blocking communicator until every rank joins). Every
//! NCCL call on a communicator runs under its lock, one at a time, as NCCL requires; the
//! watchdog takes the same lock before it aborts, so it never frees a communicator under a
//! thread that is inside NCCL. After an abort (a timeout, an asynchronous error, or
//! [`Communicator::abort`]) every call returns [`NcclError::Aborted`].
//!
//! Every call only enqueues its work; [`Communicator::record_work`] gives a [`Work`] handle on
//! what was enqueued so far, to wait on (with the deadline) or poll while the host computes.
//!
//! Calls fused into one launch go through a [`Group`] ([`Communicator::group`], [`group()`]),
//! which borrows their buffers until the launch.
//!
//! What is not bounded: on the blocking communicator, a call that NCCL blocks inside (the
//! first call that connects to a peer, a group's end) waits for that peer; if the peer never
//! makes the matching call, the thread stays inside NCCL and the watchdog only reports it
//! (aborting under it is not allowed). NCCL 2.28 has no cheap way out: on a nonblocking
//! communicator every call, collectives included, ends its implicit group in a new NCCL thread
//! (tens of µs), and one group cannot mix blocking and nonblocking communicators.
//! [`CommConfig::nonblocking_calls`] makes every call return at once and be polled against the
//! timeout, at that cost. The split of an [`Communicator::init_all`] communicator (blocking,
//! with no nonblocking one kept) is not bounded either.

#![deny(missing_docs)]

mod abort_handle;
mod args;
mod calls;
mod capture;
mod communicator;
mod config;
mod connect;
mod deadline;
mod error;
mod group;
mod id;
mod ops;
mod revoke;
mod shared;
mod shrink;
mod split;
mod types;
mod watchdog;
mod work;

pub use abort_handle::AbortHandle;
pub use capture::{Capture, Graph};
pub use communicator::Communicator;
pub use config::CommConfig;
pub use dist_nccl_sys::{Library as Nccl, LoadError};
pub use error::{NcclCode, NcclError, Result};
pub use group::{Group, GroupOps, group};
pub use id::UniqueId;
pub use ops::Ops;
pub use types::{F8E4M3, F8E5M2, NcclType, nccl_size};
pub use work::Work;

/// Whether a CUDA device can be used here: the driver loads and reports at least one device.
/// Tests and benchmarks use it to skip themselves on machines without a GPU.
pub fn cuda_device_count() -> usize {
    // cudarc panics when it cannot find the driver library: look for it first.
    // SAFETY: loading the CUDA driver library runs only its own initialisers (dist-hybrid's
    // test `a_unique_id_means_nccl_is_required` and every multirank GPU trial call this, with
    // or without a GPU).
    let present = ["libcuda.so.1", "libcuda.so"]
        .iter()
        .any(|n| unsafe { libloading::Library::new(n) }.is_ok());
    if !present {
        return 0;
    }
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init()
            .ok()
            .and_then(|()| cudarc::driver::result::device::get_count().ok())
    })
    .ok()
    .flatten()
    .map_or(0, |n| n.max(0) as usize)
}

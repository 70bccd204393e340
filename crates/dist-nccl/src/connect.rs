//! Connecting every pair of ranks while a communicator forms, so that no later call connects.
//!
//! NCCL connects two ranks for point-to-point the first time one sends to the other, inside
//! `ncclGroupEnd` (and, unless `NCCL_RUNTIME_CONNECT=0`, a collective's rings or trees the
//! first time an algorithm is used). On a blocking communicator that call then waits inside
//! NCCL for the peer to make its matching call, for ever if it never does; and dist aborts a
//! communicator only when no thread is inside NCCL on it (`shared.rs`), so such a wait could
//! not be ended. Hence, when [`crate::CommConfig::connect_peers`] is on (the default):
//! 1. the nonblocking communicator the ranks formed is split (nonblocking, polled within the
//!    init deadline) into a second nonblocking one with `splitShare = 1`, whose children share
//!    its resources, the point-to-point connections among them (NCCL keeps them per pair of
//!    ranks in the shared resources and skips a pair already connected);
//! 2. on that one every rank sends one byte to and receives one byte from every other rank, in
//!    one group, polled within the init deadline, then waits (within it) for the transfers;
//! 3. the blocking communicator for the calls is split from it, and so finds every pair
//!    connected.
//!
//! The first communicator stays unshared, for [`crate::Communicator::split`]: communicators that
//! share resources must not be used at once, and user splits are used beside the main one.
//! The cost is one connection per pair of ranks made at once (NCCL makes them on demand
//! otherwise): buffers per peer that a large job may not want; `connect_peers = false` keeps
//! NCCL's on-demand connections (and their unbounded first call).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, DevicePtrMut};
use dist_nccl_sys::{Library as Nccl, cudaStream_t, nccl_fn, ncclComm_t, ncclDataType_t};

use crate::error::{NcclCode, NcclError, Result};
use crate::shared::{cuda, nccl_error};
use crate::split::ready;

/// Sends one byte to and receives one from every other rank on `comm` (nonblocking, used by
/// this thread alone), and waits for the transfers, all before `started + limit`. On an error
/// the caller aborts `comm` (nothing here does).
pub(crate) fn connect_peers(
    nccl: &Nccl,
    comm: ncclComm_t,
    ctx: &Arc<CudaContext>,
    who: &str,
    (rank, size): (usize, usize),
    started: Instant,
    limit: Duration,
) -> Result<()> {
    const OP: &str = "connect to every peer";
    if size < 2 {
        return Ok(());
    }
    let start = nccl_fn!(nccl, ncclGroupStart)?;
    let end = nccl_fn!(nccl, ncclGroupEnd)?;
    let send = nccl_fn!(nccl, ncclSend)?;
    let recv = nccl_fn!(nccl, ncclRecv)?;
    let stream = ctx.default_stream();
    // Byte 0 is sent to every peer; byte 1 + p receives from peer p.
    let mut buf = stream
        .alloc_zeros::<u8>(size + 1)
        .map_err(cuda(who, "allocate the connecting buffer"))?;
    let (ptr, guard) = buf.device_ptr_mut(&stream);
    let cu = stream.cu_stream() as cudaStream_t;
    let u8t = ncclDataType_t::ncclUint8;
    // SAFETY: ncclGroupStart takes no arguments and only touches this thread's group state;
    // the group is ended below on every path (no early return between the two).
    let opened = unsafe { start() };
    NcclCode::check(opened)
        .map_err(|code| nccl_error(nccl, who, "ncclGroupStart", code, Some(comm)))?;
    let mut first_err = None;
    for peer in (0..size).filter(|p| *p != rank) {
        // SAFETY: `comm` is live and used by this thread alone; `ptr` is a device buffer of
        // this context of size + 1 bytes, alive (and its guard held) until the transfers are
        // seen complete below; the send reads byte 0, the receive from `peer` writes byte
        // 1 + peer < size + 1; both on the default stream of this context; peer < size.
        let (s, r) = unsafe {
            let base = ptr as *mut u8;
            let s = send(base as *const c_void, 1, u8t, peer as i32, comm, cu);
            let r = recv(base.add(1 + peer).cast(), 1, u8t, peer as i32, comm, cu);
            (s, r)
        };
        if let Err(code) = NcclCode::check_started(s).and(NcclCode::check_started(r)) {
            first_err.get_or_insert(code);
        }
    }
    // SAFETY: this thread opened the group above; `comm` is live and used by it alone.
    let ended = unsafe { end() };
    if let Some(code) = first_err {
        return Err(nccl_error(nccl, who, OP, code, Some(comm)));
    }
    NcclCode::check_started(ended).map_err(|code| nccl_error(nccl, who, OP, code, Some(comm)))?;
    // The group's connections are made on NCCL's thread: poll until it is done.
    while !ready(nccl, comm, who, OP)? {
        if started.elapsed() > limit {
            return Err(NcclError::Timeout {
                comm: who.to_string(),
                op: OP.to_string(),
                waited: started.elapsed(),
            });
        }
        std::thread::yield_now();
    }
    // Then the transfers themselves, which need every peer's part.
    let done = ctx.new_event(None).map_err(cuda(who, "create an event"))?;
    done.record(&stream).map_err(cuda(who, "record an event"))?;
    loop {
        if done
            .try_is_complete()
            .map_err(cuda(who, "query an event"))?
        {
            break;
        }
        if started.elapsed() > limit {
            return Err(NcclError::Timeout {
                comm: who.to_string(),
                op: OP.to_string(),
                waited: started.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    drop(guard);
    Ok(())
}

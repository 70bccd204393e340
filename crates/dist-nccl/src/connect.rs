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

use cudarc::driver::{CudaContext, CudaSlice, DevicePtrMut};
use dist_nccl_sys::{Library as Nccl, cudaStream_t, nccl_fn, ncclComm_t, ncclDataType_t};

use crate::error::{NcclCode, NcclError, Result};
use crate::shared::{cuda, nccl_error};
use crate::split::{abort_handle, ready};

/// A communicator handle that NCCL may still be working on, with what that work may write
/// into (`keep`). Dropped without [`AbortFirst::release`], it aborts the handle in `drop`,
/// which Rust runs before it drops the fields: `keep` is freed only once the abort has
/// returned, when NCCL's threads for the handle are stopped and launch nothing more. (Kernels
/// launched before are on the buffer's stream, ahead of its free.)
pub(crate) struct AbortFirst<K, A: FnMut(ncclComm_t)> {
    comm: ncclComm_t,
    abort: A,
    keep: K,
}

impl<K, A: FnMut(ncclComm_t)> AbortFirst<K, A> {
    pub(crate) fn new(comm: ncclComm_t, keep: K, abort: A) -> Self {
        AbortFirst { comm, abort, keep }
    }

    /// The handle, whose work is done: not aborted; `keep` is dropped now.
    pub(crate) fn release(mut self) -> ncclComm_t {
        std::mem::replace(&mut self.comm, std::ptr::null_mut())
    }
}

impl<K, A: FnMut(ncclComm_t)> Drop for AbortFirst<K, A> {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            (self.abort)(self.comm);
        }
        // `keep` is dropped after this, by the fields' drop.
    }
}

/// Sends one byte to and receives one from every other rank on `comm` (nonblocking, used by
/// this thread alone, and owned from here), and waits for the transfers, all before
/// `started + limit`. Returns `comm` once done. On an error `comm` is aborted here, before the
/// device buffer the transfers use is freed (NCCL's thread may still connect the last peer and
/// launch the kernels that write into it): the caller must not abort it again.
pub(crate) fn connect_peers(
    nccl: &Nccl,
    comm: ncclComm_t,
    ctx: &Arc<CudaContext>,
    who: &str,
    (rank, size): (usize, usize),
    started: Instant,
    limit: Duration,
) -> Result<ncclComm_t> {
    const OP: &str = "connect to every peer";
    // The group opened below must be the outermost: nested in another, its `ncclGroupEnd`
    // would launch nothing, and the buffer could be freed while the transfers stay recorded.
    // `init_rank` and `split` refuse to run inside a group, so no caller gets here in one.
    debug_assert!(!crate::group::in_group(), "connect_peers inside a group");
    // Every return below drops `owned` (aborting `comm`, then freeing the buffer) unless it
    // was released.
    let mut owned = AbortFirst::new(comm, None::<CudaSlice<u8>>, |c| abort_handle(nccl, c));
    if size < 2 {
        return Ok(owned.release());
    }
    let start = nccl_fn!(nccl, ncclGroupStart)?;
    let end = nccl_fn!(nccl, ncclGroupEnd)?;
    let send = nccl_fn!(nccl, ncclSend)?;
    let recv = nccl_fn!(nccl, ncclRecv)?;
    let stream = ctx.default_stream();
    // Byte 0 is sent to every peer; byte 1 + p receives from peer p. The buffer is owned by
    // `owned`, so it outlives the abort on every error path.
    let buf = owned.keep.insert(
        stream
            .alloc_zeros::<u8>(size + 1)
            .map_err(cuda(who, "allocate the connecting buffer"))?,
    );
    let (ptr, guard) = buf.device_ptr_mut(&stream);
    let cu = stream.cu_stream() as cudaStream_t;
    let u8t = ncclDataType_t::ncclUint8;
    // SAFETY: ncclGroupStart takes no arguments and only touches this thread's group state;
    // the group is ended below on every path (no early return between the two). No outer group
    // is open (the callers refuse one, asserted above), so this group's end launches its
    // transfers. Run by the multirank trial `nccl_connect_absent` and by every GPU trial's
    // init (`connect_peers` is on in `nccl_tests.rs`'s rig).
    let opened = unsafe { start() };
    NcclCode::check(opened)
        .map_err(|code| nccl_error(nccl, who, "ncclGroupStart", code, Some(comm)))?;
    let mut first_err = None;
    for peer in (0..size).filter(|p| *p != rank) {
        // SAFETY: `comm` is live and used by this thread alone; `ptr` is a device buffer of
        // this context of size + 1 bytes, owned by `owned`, which on every path either sees
        // the transfers complete (below) or aborts `comm` before freeing it (`AbortFirst`),
        // so no transfer NCCL launches writes into freed memory; the send reads byte 0, the
        // receive from `peer` writes byte 1 + peer < size + 1; both on the default stream of
        // this context; peer < size (the multirank trials `nccl_connect_absent`, whose
        // bound rests on these connections, and `nccl_collectives`, whose init connects).
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
    // SAFETY: this thread opened the group above, the outermost one (no caller runs inside a
    // group), so this end launches the transfers; `comm` is live and used by it alone (the
    // multirank trial `nccl_connect_absent`).
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
    Ok(owned.release())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Records its drop in the shared log.
    struct Buffer<'a>(&'a RefCell<Vec<&'static str>>);

    impl Drop for Buffer<'_> {
        fn drop(&mut self) {
            self.0.borrow_mut().push("free");
        }
    }

    fn handle() -> ncclComm_t {
        std::ptr::NonNull::<dist_nccl_sys::ncclComm>::dangling().as_ptr()
    }

    /// An error path (an early return, a `?`, a panic) drops the handle's owner: the abort
    /// comes first, the buffer NCCL's work writes into is freed after it. Before, the buffer
    /// was a local of `connect_peers`, freed on return, and the caller aborted afterwards.
    #[test]
    fn an_unreleased_handle_is_aborted_before_its_buffer_is_freed() {
        let log = RefCell::new(Vec::new());
        let owned = AbortFirst::new(handle(), Some(Buffer(&log)), |c| {
            assert_eq!(c, handle());
            log.borrow_mut().push("abort");
        });
        let failing = |o: AbortFirst<_, _>| -> std::result::Result<(), ()> {
            let _o = o;
            Err(())
        };
        assert!(failing(owned).is_err());
        assert_eq!(*log.borrow(), ["abort", "free"]);
        // A panic while the owner is alive unwinds the same way.
        log.borrow_mut().clear();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _o = AbortFirst::new(handle(), Buffer(&log), |_| log.borrow_mut().push("abort"));
            panic!("inside");
        }));
        assert!(caught.is_err());
        assert_eq!(*log.borrow(), ["abort", "free"]);
    }

    /// A released handle is the caller's: no abort, and the buffer (its work complete) is freed.
    #[test]
    fn a_released_handle_is_not_aborted() {
        let log = RefCell::new(Vec::new());
        let owned = AbortFirst::new(handle(), Buffer(&log), |_| log.borrow_mut().push("abort"));
        assert_eq!(owned.release(), handle());
        assert_eq!(*log.borrow(), ["free"]);
    }
}

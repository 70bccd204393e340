//! Shrinking a communicator after a failure (`ncclCommShrink`, NCCL 2.27 and newer): the
//! survivors form a new communicator without the ranks they agreed to leave out, and the old
//! one ends.
//!
//! The shrink runs on the nonblocking handle each [`Communicator`] keeps for splits (see
//! `split.rs`), never on the handle the calls use: that one may hold work that waits on a dead
//! peer, so it is aborted first (`ncclCommAbort`, which cancels its work in flight), and the
//! shrink is asked to terminate whatever the kept handle has going too
//! (`NCCL_SHRINK_ABORT`). `ncclCommRevoke` (NCCL 2.28) would stop the calls' handle without
//! freeing it, which matters only to a caller that goes on using that handle afterwards; no
//! one here does, so the abort is used on every version.
//!
//! The excluded ranks do not take part: a shrink is collective over the survivors only, who
//! must pass the same list (agreed elsewhere, e.g. through the job's store, as `dist-tcp`'s
//! `recover` does).

use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Instant;

use dist_nccl_sys::nccl_fn;

use crate::communicator::Communicator;
use crate::config::{CommConfig, config};
use crate::error::{NcclCode, Result};
use crate::shared::{Abort, nccl_error};
use crate::split::{abort_handle, await_child};

impl Communicator {
    /// Shrinks this communicator: every rank not in `exclude` (ranks of this communicator, at
    /// least one) calls it with the same list, and gets a new communicator of the others,
    /// renumbered densely in the old order. The excluded ranks (dead, stopped or cut off) take
    /// no part.
    ///
    /// This communicator ends at the call: its work in flight is cancelled and every later
    /// call on it fails with [`NcclError::Aborted`](crate::NcclError::Aborted) ("shrunk").
    /// The shrink, and then each step of forming the new communicator (as for
    /// [`Communicator::split`]), has `cfg`'s init timeout; where a survivor never calls, it
    /// returns [`NcclError::Timeout`](crate::NcclError::Timeout). A library older than 2.27
    /// returns [`NcclError::Load`](crate::NcclError::Load) (`TooOld`): form a new communicator
    /// from a fresh [`crate::UniqueId`] instead.
    ///
    /// Refused, leaving this communicator as it was: an empty list (NCCL shrinks only by
    /// leaving ranks out), a rank out of range or listed twice, this rank itself in `exclude`;
    /// a call inside a group; CUDA graphs that hold this communicator's work (drop them first:
    /// aborting waits for them). Refused as [`NcclError::Aborted`](crate::NcclError::Aborted):
    /// a communicator already aborted, by the caller, its watchdog (an asynchronous NCCL error
    /// such as a peer's death) or its timeout, since the abort frees the handle the shrink runs
    /// on. Shrink as soon as the failure is known (e.g. from `dist-tcp`'s revocation), or form
    /// a new communicator from a fresh unique id. Waiting for the communicator's lock is not
    /// bounded: a thread inside an NCCL call on it (one NCCL itself blocks in) holds it.
    #[doc(alias = "ncclCommShrink")]
    pub fn shrink(&self, exclude: &[usize], cfg: CommConfig) -> Result<Communicator> {
        const OP: &str = "shrink";
        let list = self.exclude_list(exclude)?;
        if crate::group::in_group() {
            return Err(self.invalid(OP, "not inside a group".into()));
        }
        let nccl = self.shared.nccl.clone();
        let f = nccl_fn!(&nccl, ncclCommShrink)?;
        let who = format!(
            "nccl comm {}(shrink of {} without ranks {exclude:?})",
            cfg.name
                .as_ref()
                .map_or(String::new(), |x| format!("'{x}' ")),
            self.shared.who
        );
        let mut conf = config(nccl.version(), &cfg, false);
        let mut st = self.shared.lock_for_call(OP)?;
        // Asked under the lock: a graph records this communicator's work only inside a call,
        // which takes the lock, so no graph can gain work between this check and the abort.
        if self.shared.graphs.load(Ordering::Acquire) > 0 {
            return Err(self.invalid(
                OP,
                "CUDA graphs hold this communicator's work: drop them before shrinking".into(),
            ));
        }
        // From here on this communicator is over, whatever the shrink's outcome: calls refuse
        // (`doomed`, then `aborted` below, under this lock).
        let why = Abort::Error(format!(
            "shrunk into a new communicator without ranks {exclude:?}"
        ));
        let _ = self.shared.doomed.set(why.clone());
        // The handle the shrink runs on: the kept nonblocking one, or the calls' own where
        // there is no other (`CommConfig::nonblocking_calls`).
        let parent = if st.nb.is_null() { st.comm } else { st.nb };
        if !st.nb.is_null() {
            // The calls' handles end first: work in flight on them (perhaps waiting on a dead
            // peer) is cancelled, and they are never used again (`aborted` is set below before
            // the lock is released).
            abort_handle(
                &nccl,
                std::mem::replace(&mut st.sharing, std::ptr::null_mut()),
            );
            abort_handle(&nccl, st.comm);
        }
        let slot = Box::new(AtomicPtr::new(std::ptr::null_mut()));
        let started = Instant::now();
        // The calls' handles are over (aborted above, or the parent itself): no call may use
        // them once the lock is released, whatever happens below.
        st.aborted = Some(why.clone());
        let mut list = list;
        let flags = dist_nccl_sys::NCCL_SHRINK_ABORT as i32;
        // SAFETY: `parent` is live (`lock_for_call` refused an aborted communicator, and only
        // the calls' handles were aborted above when `parent` is the kept one) and used by
        // this thread alone: we hold the communicator's lock, no group is open over it (checked
        // above for this thread; `lock_for_call` waited out other threads' groups). `list`
        // holds `list.len()` ints, valid and writable for the call (NCCL sorts it in place and
        // copies it before returning, so its drop after a timeout is sound). The
        // slot is valid, aligned memory for one handle that outlives any write NCCL makes
        // (leaked by `await_child` if NCCL is not done with it). The config is valid for the
        // call and its only pointer is the interned name, which lives for the process. One GPU
        // cannot reach this call (NCCL refuses an empty list, and one device holds one rank of
        // a communicator): a shrink that leaves a rank out needs two GPUs, and no case runs
        // one yet; `shrink_refuses_bad_lists_leaving_the_communicator_working` checks the
        // refusals before it.
        let r = unsafe {
            f(
                parent,
                list.as_mut_ptr(),
                list.len() as i32,
                slot.as_ptr(),
                &mut conf,
                flags,
            )
        };
        let child = match NcclCode::check_started(r) {
            Err(code) => Err(nccl_error(&nccl, &who, OP, code, Some(parent))),
            Ok(()) => await_child(
                &nccl,
                parent,
                &who,
                OP,
                slot,
                started,
                cfg.init_timeout,
                false,
            )
            .map_err(|(e, _)| e),
        };
        // The parent is never used again: NCCL is done with it (or given up on, at the
        // deadline), and the child does not share its resources (NCCL shares none under
        // `NCCL_SHRINK_ABORT`, whatever `shrinkShare` says).
        abort_handle(&nccl, parent);
        st.nb = std::ptr::null_mut();
        drop(st);
        let child = child?;
        Self::from_nonblocking(nccl, self.ctx.clone(), child, who, &cfg)
    }

    /// `exclude` as NCCL takes it, after the checks `shrink` documents.
    fn exclude_list(&self, exclude: &[usize]) -> Result<Vec<i32>> {
        let (rank, size) = (self.rank(), self.size());
        if exclude.is_empty() {
            let reason = "no rank to leave out: NCCL shrinks only by excluding ranks".into();
            return Err(self.invalid("shrink", reason));
        }
        let mut list: Vec<i32> = Vec::with_capacity(exclude.len());
        for (i, &r) in exclude.iter().enumerate() {
            let reason = if r >= size {
                format!("rank {r} (exclude[{i}]) is not in this communicator of {size}")
            } else if r == rank {
                format!("this rank ({rank}) is in the list: a rank left out does not call shrink")
            } else if exclude[..i].contains(&r) {
                format!("rank {r} is listed twice")
            } else {
                list.push(r as i32);
                continue;
            };
            return Err(self.invalid("shrink", reason));
        }
        Ok(list)
    }
}

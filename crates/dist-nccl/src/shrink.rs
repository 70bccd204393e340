//! Shrinking a communicator after a failure (`ncclCommShrink`, NCCL 2.27 and newer): the
//! survivors form a new communicator without the ranks they agreed to leave out, and the old
//! one ends.
//!
//! The shrink runs on the nonblocking handle each [`Communicator`] keeps for splits (see
//! `split.rs`), never on the handle the calls use: that one may hold work that waits on a dead
//! peer, so it ends first (aborted here, or already aborted or revoked by the failure: the
//! watchdog's abort, a timeout's, [`Communicator::revoke`]), and the shrink is asked to
//! terminate whatever the kept handle has going too (`NCCL_SHRINK_ABORT`). The kept handle
//! outlives every abort of the calls (`shared.rs`), so a shrink can follow the common failure:
//! work that stopped completing, a peer's death reported by NCCL. Where there is no kept handle
//! ([`CommConfig::nonblocking_calls`]), the shrink runs on the calls' handle: while it lives,
//! or after a revoke (which stops it without freeing it); an abort freed it.
//!
//! NCCL shrinks only by leaving ranks out (`ncclCommShrink` refuses an empty list). An empty
//! list here forms the same members again: a split of the kept handle (color 0, same order),
//! what the survivors do when the agreement kept everyone (a rank suspected but only slow).
//!
//! The excluded ranks do not take part: a shrink is collective over the survivors only, who
//! must pass the same list (agreed elsewhere, e.g. through the job's store, as `dist-tcp`'s
//! `recover` does).

use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Instant;

use dist_nccl_sys::{nccl_fn, ncclComm_t};

use crate::communicator::Communicator;
use crate::config::{CommConfig, config};
use crate::error::{NcclCode, NcclError, Result};
use crate::shared::{Abort, nccl_error};
use crate::split::{abort_handle, await_child, split_handle};

impl Communicator {
    /// Shrinks this communicator: every rank not in `exclude` (ranks of this communicator)
    /// calls it with the same list, and gets a new communicator of the others, renumbered
    /// densely in the old order. The excluded ranks (dead, stopped or cut off) take no part. An
    /// empty list forms the same members again (a split: NCCL's shrink refuses an empty list),
    /// and every rank takes part.
    ///
    /// This communicator ends at the call, if it had not already: its work in flight is
    /// cancelled and every later call on it fails with
    /// [`NcclError::Aborted`](crate::NcclError::Aborted) ("shrunk"). A communicator already
    /// aborted (by [`Communicator::abort`], its watchdog on an asynchronous NCCL error such as
    /// a peer's death, or its timeout) or revoked ([`Communicator::revoke`]) can still be
    /// shrunk, once: the abort kept the handle the shrink runs on. Its calls keep failing with
    /// the first reason.
    ///
    /// The shrink, and then each step of forming the new communicator (as for
    /// [`Communicator::split`]), has `cfg`'s init timeout; where a survivor never calls, it
    /// returns [`NcclError::Timeout`](crate::NcclError::Timeout). With a non-empty list, a
    /// library older than 2.27 returns [`NcclError::Load`](crate::NcclError::Load) (`TooOld`,
    /// naming the version needed and the one loaded), before anything changes: form a new
    /// communicator from a fresh [`crate::UniqueId`] instead.
    ///
    /// Refused, leaving this communicator as it was: a rank out of range or listed twice, this
    /// rank itself in `exclude`; a call inside a group; CUDA graphs that hold this
    /// communicator's work (drop them first: aborting waits for them). Refused as
    /// [`NcclError::Aborted`](crate::NcclError::Aborted): a communicator already shrunk, and
    /// one with [`CommConfig::nonblocking_calls`] that was aborted rather than revoked (its
    /// only handle is freed; revoke it instead, on NCCL 2.28 or newer). Waiting for the
    /// communicator's lock is not bounded: a thread inside an NCCL call on it (one NCCL itself
    /// blocks in) holds it.
    #[doc(alias = "ncclCommShrink")]
    pub fn shrink(&self, exclude: &[usize], cfg: CommConfig) -> Result<Communicator> {
        const OP: &str = "shrink";
        let nccl = self.shared.nccl.clone();
        // The library first: its refusal names the version needed and the one loaded.
        let f = if exclude.is_empty() {
            None
        } else {
            Some(nccl_fn!(&nccl, ncclCommShrink)?)
        };
        let mut list = self.exclude_list(exclude)?;
        if crate::group::in_group() {
            return Err(self.invalid(OP, "not inside a group".into()));
        }
        let who = format!(
            "nccl comm {}(shrink of {} without ranks {exclude:?})",
            cfg.name
                .as_ref()
                .map_or(String::new(), |x| format!("'{x}' ")),
            self.shared.who
        );
        let graphs = || {
            self.invalid(
                OP,
                "CUDA graphs hold this communicator's work: drop them before shrinking".into(),
            )
        };
        // Asked before the lock too: an abort waiting for graphs to be dropped may hold it.
        if self.shared.graphs.load(Ordering::Acquire) > 0 {
            return Err(graphs());
        }
        let mut st = self.shared.lock_between_groups(OP)?;
        // Asked under the lock: a graph records this communicator's work only inside a call,
        // which takes the lock, so no graph can gain work between this check and the abort.
        if self.shared.graphs.load(Ordering::Acquire) > 0 {
            return Err(graphs());
        }
        // The calls' handle is the parent (no kept one), live: freed after the shrink.
        let calls_are_parent = st.aborted.is_none() && st.nb.is_null();
        let parent: ncclComm_t = match &st.aborted {
            None => {
                // From here on this communicator is over, whatever the shrink's outcome: calls
                // refuse (`doomed`, then `aborted` below, under this lock).
                let why = Abort::Error(format!(
                    "shrunk into a new communicator without ranks {exclude:?}"
                ));
                let _ = self.shared.doomed.set(why.clone());
                let parent = if st.nb.is_null() { st.comm } else { st.nb };
                if !st.nb.is_null() {
                    // The calls' handles end first: work in flight on them (perhaps waiting on
                    // a dead peer) is cancelled, and they are never used again (`aborted` is
                    // set below before the lock is released).
                    abort_handle(
                        &nccl,
                        std::mem::replace(&mut st.sharing, std::ptr::null_mut()),
                    );
                    abort_handle(&nccl, st.comm);
                }
                st.aborted = Some(why);
                parent
            }
            Some(_) if !st.nb.is_null() => st.nb,
            Some(_) if st.revoked => st.comm,
            Some(why) => {
                let reason = format!(
                    "it was aborted ({}) and has no handle left to shrink: {}",
                    why.reason(),
                    if st.comm.is_null() {
                        "it was shrunk already"
                    } else {
                        "the abort freed the calls' handle and there is no other (none is \
                         kept with CommConfig::nonblocking_calls or init_all, where revoke() \
                         keeps the calls' one, on NCCL 2.28 or newer; a split that failed \
                         midway frees the kept one)"
                    }
                );
                return Err(NcclError::Aborted {
                    comm: self.shared.who.clone(),
                    op: OP.into(),
                    reason,
                });
            }
        };
        let started = Instant::now();
        let child = match f {
            // The same members again: a split of the parent (which NCCL allows after a revoke,
            // and which the kept handle, without the calls' work, always allows).
            None => {
                let mut conf = config(nccl.version(), &cfg, false);
                let key = self.rank() as i32;
                split_handle(&nccl, parent, &who, 0, key, &mut conf, cfg.init_timeout)
                    .map_err(|(e, _)| e)
            }
            Some(f) => {
                let mut conf = config(nccl.version(), &cfg, false);
                let slot = Box::new(AtomicPtr::new(std::ptr::null_mut()));
                let flags = dist_nccl_sys::NCCL_SHRINK_ABORT as i32;
                // SAFETY: `parent` is live (the kept handle, which no abort of the calls frees;
                // or the calls' own while not aborted, or revoked, which stops it without
                // freeing it) and used by this thread alone: we hold the communicator's lock,
                // no group is open over it (checked above for this thread;
                // `lock_between_groups` waited out other threads' groups). `list` holds
                // `list.len()` ints, valid and writable for the call (NCCL sorts it in place
                // and copies it before returning, so its drop after a timeout is sound). The
                // slot is valid, aligned memory for one handle that outlives any write NCCL
                // makes (leaked by `await_child` if NCCL is not done with it). The config is
                // valid for the call and its only pointer is the interned name, which lives
                // for the process. One GPU cannot reach this call (a one-rank communicator has
                // no rank to leave out, and one device holds one rank of a communicator): it
                // needs two GPUs; `shrink_refuses_bad_lists_leaving_the_communicator_working`
                // checks the refusals before it.
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
                match NcclCode::check_started(r) {
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
                }
            }
        };
        // What the old communicator kept, the parent among it, is never used again: NCCL is
        // done with the parent (or given up on, at the deadline), and the child does not share
        // its resources (NCCL shares none under `NCCL_SHRINK_ABORT` or after a revoke, and a
        // split shares none unless `splitShare` is set, which `config` leaves unset).
        if calls_are_parent {
            abort_handle(&nccl, parent);
        }
        self.shared.release_kept(&mut st);
        st.comm = std::ptr::null_mut();
        drop(st);
        let child = child?;
        Self::from_nonblocking(nccl, self.ctx.clone(), child, who, &cfg)
    }

    /// `exclude` as NCCL takes it, after the checks `shrink` documents.
    fn exclude_list(&self, exclude: &[usize]) -> Result<Vec<i32>> {
        let (rank, size) = (self.rank(), self.size());
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

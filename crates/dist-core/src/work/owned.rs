//! Owned async work: an all_reduce whose handle owns its buffer and borrows nothing, so it can
//! be started in one place (a backward hook) and waited on in another (the optimizer step).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use super::occupancy::executing;
use super::{Slot, Work};
use crate::backend::Backend;
use crate::collectives::ops;
use crate::error::DistError;
use crate::group::Group;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

/// [`Collectives::all_reduce_owned`](crate::Collectives::all_reduce_owned) on `g`, each run
/// waiting at most `timeout` from when it starts.
///
/// The group is claimed for the calling thread (refused at once, and the group aborted, if
/// another thread is inside a call on it), the work queued on the group's collectives
/// executor after everything queued before it, and the handle returned. The job holds a
/// shared handle on the group's state and owns `data`: neither the caller's handle, nor the
/// group's, nor the buffer can go away under it.
pub(crate) fn all_reduce_owned<L: Link + 'static, T: Element>(
    g: &Group<L>,
    timeout: Duration,
    mut data: Vec<T>,
    op: ReduceOp,
) -> Work<'static, Vec<T>> {
    let slot = Arc::new(Slot::new());
    let work = Work::detached(slot.clone());
    let me = g.rank();
    let describe = || format!("all_reduce_owned({} x {}, {op})", T::DTYPE, data.len());
    let occupancy = g.occupancy();
    if let Err(e) = occupancy.owned_queued(me, describe) {
        let e = g.link().label_error(e);
        // As a refused blocking call: no rank waits for this one.
        crate::collectives::abort_all(g, &e, None);
        slot.complete(Err(e), || {});
        return work;
    }
    let ex = match occupancy.executors(me) {
        Ok(ex) => ex,
        Err(e) => {
            occupancy.owned_finished();
            slot.complete(Err(e), || {});
            return work;
        }
    };
    let shared = g.share();
    ex.collectives.spawn_fifo(move || {
        let run = || ops::all_reduce(&shared, timeout, &mut data, op);
        let r = match executing(|| catch_unwind(AssertUnwindSafe(run))) {
            Ok(r) => r.map(|()| data),
            // Not passed on: nobody waits for this job as a scope waits for its work (and a
            // panic on a rayon worker would end the process). The handle gets an error.
            Err(_) => Err(DistError::InvalidArgument {
                rank: me,
                op: "all_reduce_owned".into(),
                reason: "it panicked".into(),
            }),
        };
        slot.complete(r, || shared.occupancy().owned_finished());
    });
    work
}

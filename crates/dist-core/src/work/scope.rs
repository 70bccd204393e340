//! A [`Scope`]: where async work is issued, and the calls that issue it (every collective,
//! `isend`, `irecv`, their typed forms and `barrier`), each queued on one of the group's
//! executors.

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::ScopeFifo;

use super::occupancy::{Entry, Occupancy, SCOPE_KIND, executing};
use super::{Issued, Slot, Work};
use crate::backend::{Backend, Tag};
use crate::collectives::{ops, uneven};
use crate::error::{DistError, Result};
use crate::group::Group;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

/// Which executor a piece of work runs on.
#[derive(Clone, Copy)]
enum Lane {
    Collectives = 0,
    Sends = 1,
    Recvs = 2,
}

/// Issues async work on one group: each call queues its work and returns a [`Work`] handle at
/// once. Made by [`Collectives::scope`](crate::Collectives::scope), for the thread that opened
/// it only (a scope cannot be shared with or sent to another thread, so the order in which
/// work is issued is one thread's program order, the same on every rank). Buffers are
/// borrowed for `'scope`: the scope's end waits for every piece of work.
///
/// Collectives run in issue order, one at a time, with the same algorithms, checks and errors
/// as the blocking calls (a failure aborts the group as theirs does). Sends run in issue order,
/// and so do receives, each beside the other and beside the collectives: an `irecv` followed by
/// an `isend` that the peer's `irecv` waits for does not deadlock. Point-to-point work is not
/// ordered against the blocking `send`/`recv` of the same peer and tag: wait for it first.
pub struct Scope<'s, 'scope, L: Link> {
    group: &'scope Group<L>,
    timeout: Duration,
    lanes: [&'s ScopeFifo<'scope>; 3],
    /// Every piece issued whose result may still be unclaimed (pruned as they are waited on).
    issued: RefCell<Vec<Arc<dyn Issued + 'scope>>>,
    /// The length at which `issued` is next pruned.
    prune_at: std::cell::Cell<usize>,
}

impl<L: Link> std::fmt::Debug for Scope<'_, '_, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("rank", &self.group.rank())
            .field("timeout", &self.timeout)
            .field("pending", &self.pending())
            .finish()
    }
}

/// Frees the group when the scope ends, even by a panic.
struct Leave<'a> {
    occupancy: &'a Occupancy,
    entry: Option<Entry>,
}

impl Leave<'_> {
    /// Frees the group; whether another thread's call was refused while the scope held it.
    fn now(mut self) -> bool {
        self.entry.take().is_some_and(|e| self.occupancy.leave(e))
    }
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if let Some(e) = self.entry.take() {
            self.occupancy.leave(e);
        }
    }
}

/// Opens a scope on `g` whose work waits at most `timeout` each, runs `f` in it, waits for all
/// of its work, and returns `f`'s result; or, if `f` succeeded, the error of the first piece of
/// work that failed without a handle taking the error. Fails at once (aborting the group) if
/// another thread is inside a call on `g`.
pub(crate) fn scope<'scope, L: Link, R>(
    g: &'scope Group<L>,
    timeout: Duration,
    f: impl for<'s> FnOnce(&'s Scope<'s, 'scope, L>) -> Result<R>,
) -> Result<R> {
    let me = g.rank();
    let occupancy = g.occupancy();
    let op = || "open an async scope".to_string();
    let entry = occupancy
        .enter(me, SCOPE_KIND, false, op)
        .map_err(|e| g.link().label_error(e))
        .inspect_err(|e| crate::collectives::abort_all(g, e, None))?;
    let leave = Leave {
        occupancy,
        entry: Some(entry),
    };
    let ex = occupancy.executors(me)?;
    let r = ex.collectives.in_place_scope_fifo(|c: &ScopeFifo<'scope>| {
        ex.sends.in_place_scope_fifo(|s: &ScopeFifo<'scope>| {
            ex.recvs.in_place_scope_fifo(|v: &ScopeFifo<'scope>| {
                let scope = Scope {
                    group: g,
                    timeout,
                    lanes: [c, s, v],
                    issued: RefCell::new(Vec::new()),
                    prune_at: std::cell::Cell::new(64),
                };
                let r = f(&scope);
                // Owned work this thread queued while the scope was open ends before the
                // scope gives up its claim on the group.
                occupancy.wait_drained();
                // Every piece ends here, before the scope's end: the first unclaimed error.
                let issued = scope.issued.take();
                let unclaimed = issued.iter().filter_map(|i| i.unclaimed_error()).next();
                match (r, unclaimed) {
                    (Ok(_), Some(e)) => Err(e),
                    (r, _) => r,
                }
            })
        })
    });
    let refused = leave.now();
    match r {
        Ok(_) if refused => Err(Occupancy::refused_meanwhile(me, op())),
        r => r,
    }
}

impl<'s, 'scope, L: Link> Scope<'s, 'scope, L> {
    /// The async collectives queued on this scope's group and not yet ended (sends and
    /// receives are not counted).
    pub fn pending(&self) -> usize {
        self.group.occupancy().pending()
    }

    /// How many pieces of work the scope keeps track of now (tests: it must not grow with
    /// handles dropped after their work succeeded).
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.issued.borrow().len()
    }

    /// The timeout each piece of this scope's work runs under (from when it starts to run).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Queues `job` on `lane`; its handle.
    fn submit<R: Send + 'scope>(
        &'s self,
        lane: Lane,
        job: impl FnOnce() -> Result<R> + Send + 'scope,
    ) -> Work<'s, R> {
        let slot = Arc::new(Slot::new());
        {
            let mut issued = self.issued.borrow_mut();
            issued.push(slot.clone());
            if issued.len() >= self.prune_at.get() {
                issued.retain(|i| !i.taken());
                self.prune_at.set((2 * issued.len()).max(64));
            }
        }
        let (occupancy, rank) = (self.group.occupancy(), self.group.rank());
        // Only collectives are counted: a blocking collective waits for them (issue order),
        // not for a receive that may wait for what a peer sends after that collective.
        let counted = matches!(lane, Lane::Collectives);
        if counted {
            occupancy.queued();
        }
        let done = slot.clone();
        self.lanes[lane as usize].spawn_fifo(move |_| {
            let r = executing(|| catch_unwind(AssertUnwindSafe(job)));
            let (r, panic) = match r {
                Ok(r) => (r, None),
                Err(p) => {
                    let e = DistError::InvalidArgument {
                        rank,
                        op: "async work".into(),
                        reason: "it panicked".into(),
                    };
                    (Err(e), Some(p))
                }
            };
            // Whoever sees the work ended (a handle, or a blocking call waiting for the queue
            // to drain) sees both: the result, and the count without it.
            done.complete(r, || {
                if counted {
                    occupancy.finished();
                }
            });
            // The scope's end panics with it, as `std::thread::scope` does.
            if let Some(p) = panic {
                resume_unwind(p);
            }
        });
        Work::new(slot)
    }

    fn collective<R: Send + 'scope>(
        &'s self,
        job: impl FnOnce(&'scope Group<L>, Duration) -> Result<R> + Send + 'scope,
    ) -> Work<'s, R> {
        let (g, t) = (self.group, self.timeout);
        self.submit(Lane::Collectives, move || job(g, t))
    }

    /// [`Collectives::all_reduce`](crate::Collectives::all_reduce), async: `data` comes back
    /// reduced from [`Work::wait`].
    pub fn all_reduce<T: Element>(
        &'s self,
        data: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::all_reduce(g, t, data, op).map(|()| data))
    }

    /// [`Collectives::all_reduce_into`](crate::Collectives::all_reduce_into), async.
    pub fn all_reduce_into<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::all_reduce_into(g, t, input, output, op).map(|()| output))
    }

    /// [`Collectives::broadcast`](crate::Collectives::broadcast), async.
    pub fn broadcast<T: Element>(
        &'s self,
        data: &'scope mut [T],
        root: usize,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::broadcast(g, t, data, root).map(|()| data))
    }

    /// [`Collectives::reduce`](crate::Collectives::reduce), async.
    pub fn reduce<T: Element>(
        &'s self,
        data: &'scope mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::reduce(g, t, data, op, root).map(|()| data))
    }

    /// [`Collectives::reduce_into`](crate::Collectives::reduce_into), async.
    pub fn reduce_into<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| {
            ops::reduce_into(g, t, input, output, op, root).map(|()| output)
        })
    }

    /// [`Collectives::all_gather`](crate::Collectives::all_gather), async.
    pub fn all_gather<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::all_gather(g, t, input, output).map(|()| output))
    }

    /// [`Collectives::gather`](crate::Collectives::gather), async.
    pub fn gather<T: Element>(
        &'s self,
        input: &'scope [T],
        mut output: Option<&'scope mut [T]>,
        root: usize,
    ) -> Work<'s, Option<&'scope mut [T]>> {
        self.collective(move |g, t| {
            ops::gather(g, t, input, output.as_deref_mut(), root).map(|()| output)
        })
    }

    /// [`Collectives::scatter`](crate::Collectives::scatter), async.
    pub fn scatter<T: Element>(
        &'s self,
        input: Option<&'scope [T]>,
        output: &'scope mut [T],
        root: usize,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::scatter(g, t, input, output, root).map(|()| output))
    }

    /// [`Collectives::reduce_scatter`](crate::Collectives::reduce_scatter), async.
    pub fn reduce_scatter<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
        op: ReduceOp,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::reduce_scatter(g, t, input, output, op).map(|()| output))
    }

    /// [`Collectives::all_to_all`](crate::Collectives::all_to_all), async.
    pub fn all_to_all<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| ops::all_to_all(g, t, input, output).map(|()| output))
    }

    /// [`Collectives::all_to_all_v`](crate::Collectives::all_to_all_v), async.
    pub fn all_to_all_v<T: Element>(
        &'s self,
        input: &'scope [T],
        send_counts: &'scope [usize],
        output: &'scope mut [T],
        recv_counts: &'scope [usize],
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| {
            ops::all_to_all_v(g, t, input, send_counts, output, recv_counts).map(|()| output)
        })
    }

    /// [`Collectives::all_gather_v`](crate::Collectives::all_gather_v), async.
    pub fn all_gather_v<T: Element>(
        &'s self,
        input: &'scope [T],
        output: &'scope mut [T],
        counts: &'scope [usize],
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| {
            uneven::all_gather_v(g, t, input, output, counts).map(|()| output)
        })
    }

    /// [`Collectives::gather_v`](crate::Collectives::gather_v), async.
    pub fn gather_v<T: Element>(
        &'s self,
        input: &'scope [T],
        mut output: Option<&'scope mut [T]>,
        counts: &'scope [usize],
        root: usize,
    ) -> Work<'s, Option<&'scope mut [T]>> {
        self.collective(move |g, t| {
            uneven::gather_v(g, t, input, output.as_deref_mut(), counts, root).map(|()| output)
        })
    }

    /// [`Collectives::scatter_v`](crate::Collectives::scatter_v), async.
    pub fn scatter_v<T: Element>(
        &'s self,
        input: Option<&'scope [T]>,
        counts: &'scope [usize],
        output: &'scope mut [T],
        root: usize,
    ) -> Work<'s, &'scope mut [T]> {
        self.collective(move |g, t| {
            uneven::scatter_v(g, t, input, counts, output, root).map(|()| output)
        })
    }

    /// [`barrier`](crate::collectives::barrier), async: ends once every rank has entered it.
    pub fn barrier(&'s self) -> Work<'s> {
        self.collective(ops::barrier)
    }

    /// Sends `data` to `dst` on `tag` (as [`Backend::send_tagged`]), after this scope's
    /// earlier sends.
    pub fn isend(&'s self, data: &'scope [u8], dst: usize, tag: Tag) -> Work<'s> {
        let (g, t) = (self.group, self.timeout);
        self.submit(Lane::Sends, move || {
            let op = || format!("isend to {dst} (tag {tag}, {} bytes)", data.len());
            let deadline = crate::transport::deadline_after(Instant::now(), t, g.rank(), op)?;
            g.link().send(data, dst, tag, [0; 16], deadline, None)
        })
    }

    /// Sends the elements of `data` to `dst` on `tag` (as
    /// [`TypedMessages::send_slice`](crate::TypedMessages::send_slice)), after this scope's
    /// earlier sends.
    pub fn isend_slice<T: Element>(&'s self, data: &'scope [T], dst: usize, tag: Tag) -> Work<'s> {
        let (g, t) = (self.group, self.timeout);
        self.submit(Lane::Sends, move || {
            let op = || {
                format!(
                    "isend_slice to {dst} (tag {tag}, {} x {})",
                    T::DTYPE,
                    data.len()
                )
            };
            let deadline = crate::transport::deadline_after(Instant::now(), t, g.rank(), op)?;
            // The error said as this call (a sub-group's link names itself again).
            g.link()
                .send(
                    bytemuck::cast_slice(data),
                    dst,
                    tag,
                    [0; 16],
                    deadline,
                    None,
                )
                .map_err(|e| g.link().label_error(e.map_op(|_| op())))
        })
    }

    /// Receives the next message from `src` on `tag` into `buf`, which it must fill exactly
    /// (as [`TypedMessages::recv_slice`](crate::TypedMessages::recv_slice)), after this
    /// scope's earlier receives; `buf` comes back from [`Work::wait`]. A message of another
    /// length is a [`DistError::SizeMismatch`] (in bytes, its operation naming the element
    /// type and count) and stays queued; the sender must use the same element type (nothing
    /// on the wire says which it was).
    pub fn irecv_slice<T: Element>(
        &'s self,
        buf: &'scope mut [T],
        src: usize,
        tag: Tag,
    ) -> Work<'s, &'scope mut [T]> {
        let (g, t) = (self.group, self.timeout);
        self.submit(Lane::Recvs, move || {
            let what = format!(
                "irecv_slice from {src} (tag {tag}, {} x {} = {} bytes)",
                T::DTYPE,
                buf.len(),
                std::mem::size_of_val(buf)
            );
            g.recv_tagged_timeout(bytemuck::cast_slice_mut(buf), src, tag, t)
                .map_err(|e| g.link().label_error(e.map_op(|_| what)))?;
            Ok(buf)
        })
    }

    /// Receives the next message from `src` on `tag` into `buf` (as
    /// [`Backend::recv_tagged`]), after this scope's earlier receives; `buf` comes back from
    /// [`Work::wait`].
    pub fn irecv(
        &'s self,
        buf: &'scope mut [u8],
        src: usize,
        tag: Tag,
    ) -> Work<'s, &'scope mut [u8]> {
        let (g, t) = (self.group, self.timeout);
        self.submit(Lane::Recvs, move || {
            g.recv_tagged_timeout(buf, src, tag, t).map(|()| buf)
        })
    }
}

//! NCCL groups (`ncclGroupStart` … `ncclGroupEnd`) whose buffers the type system keeps alive
//! until the launch.
//!
//! Inside a group NCCL only records each call; the kernels launch at `ncclGroupEnd`. So:
//! - every buffer given to a group is borrowed for `'buf`, a lifetime that outlives the whole
//!   [`group`] call, which ends the group before it returns: a buffer made inside the closure
//!   does not live long enough, and one outside cannot be dropped or touched until the launch;
//! - cudarc's stream-ordering guards of those buffers are kept until after the launch, so a
//!   later use on another stream waits for the group's kernels, not only for their recording;
//! - `ncclGroupEnd` runs exactly once for every group started: on success, when the closure
//!   returns an error, and when it panics (unwinding runs the guard's drop);
//! - a group belongs to its thread (NCCL's group state is thread-local): [`Group`] is neither
//!   `Send` nor `Sync`, and while it is open it owns its communicators, so other threads'
//!   calls on them wait for its end and no abort frees them under it.
//!
//! ```no_run
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let s = comm.stream();
//! let a = s.alloc_zeros::<f32>(1024).unwrap();
//! let mut b = s.alloc_zeros::<f32>(1024).unwrap();
//! let (right, left) = ((comm.rank() + 1) % comm.size(), (comm.rank() + comm.size() - 1) % comm.size());
//! comm.group(|g| {
//!     g.send(&a, right)?;
//!     g.recv(&mut b, left)
//! })?;
//! # Ok(()) }
//! ```
//!
//! A buffer made inside the group would be freed before the launch; it does not compile:
//!
//! ```compile_fail,E0597
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! comm.group(|g| {
//!     let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//!     g.send(&a, 0)
//! })?;
//! # Ok(()) }
//! ```
//!
//! Nor does handing the group to another thread:
//!
//! ```compile_fail,E0277
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//! comm.group(|g| {
//!     std::thread::scope(|s| {
//!         s.spawn(|| g.send(&a, 0));
//!     });
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! The same group on its own thread compiles:
//!
//! ```no_run
//! # fn demo(comm: &dist_nccl::Communicator) -> dist_nccl::Result<()> {
//! let a = comm.stream().alloc_zeros::<f32>(1024).unwrap();
//! comm.group(|g| {
//!     g.send(&a, 0)?;
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, SyncOnDrop};
use dist_nccl_sys::nccl_fn;

use crate::capture::Captured;
use crate::communicator::Communicator;
use crate::error::{NcclCode, NcclError, Result};
use crate::ops::{Guards, Ops};
use crate::shared::nccl_error;

thread_local! {
    /// Whether this thread has a group open (dist refuses to nest them, and refuses calls that
    /// would be recorded into it without going through it).
    static IN_GROUP: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread has a group open: a call made now, not through the [`Group`], would be
/// recorded into it with buffers the group does not keep alive, so it is refused.
pub(crate) fn in_group() -> bool {
    IN_GROUP.with(Cell::get)
}

/// An open NCCL group over one or more communicators (see [`group`]). Calls made through it
/// are recorded and launched together when the group ends; the buffers they name are borrowed
/// for `'buf`, until after the launch.
pub struct Group<'buf> {
    comms: Vec<&'buf Communicator>,
    guards: RefCell<Vec<SyncOnDrop<'buf>>>,
    ended: Cell<bool>,
    /// Opened by a [`crate::Capture`]: its calls are recorded into the capture's graph, which
    /// takes the guards at the end.
    capture: Option<Captured<'buf>>,
    /// NCCL's group state belongs to the thread that opened it: not `Send`, not `Sync`.
    _thread: PhantomData<*const ()>,
    /// Invariant in `'buf` (the `RefCell` makes it so too; this says it on purpose): were it
    /// covariant, a `&Group<'long>` could be used as a `&Group<'short>` and take guards of
    /// buffers that die before the group's launch.
    _invariant: PhantomData<fn(&'buf ()) -> &'buf ()>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({:?})", self.comms)
    }
}

/// One communicator's calls inside a [`Group`], on one stream.
#[derive(Clone, Copy)]
pub struct GroupOps<'g, 'buf> {
    pub(crate) group: &'g Group<'buf>,
    pub(crate) ops: Ops<'buf>,
}

impl std::fmt::Debug for GroupOps<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GroupOps({:?})", self.ops)
    }
}

impl<'g, 'buf> GroupOps<'g, 'buf> {
    /// The same communicator's calls on `stream` (of its context) instead.
    pub fn on(self, stream: &'buf Arc<CudaStream>) -> GroupOps<'g, 'buf> {
        GroupOps {
            group: self.group,
            ops: Ops {
                grouped: true,
                capture: self.group.capture,
                ..self.ops.comm.on(stream)
            },
        }
    }
}

/// Runs `f` inside one NCCL group over `comms` (several communicators of one process, from
/// [`Communicator::init_all`], or one) and launches what it recorded. `ncclGroupEnd` runs
/// whatever `f` does: returns, fails or panics. While the group is open it owns its
/// communicators: another thread's call on one of them waits for the group's end (within the
/// timeout), and an abort meanwhile (the watchdog's or [`Communicator::abort`]) takes effect
/// right after the launch. Groups do not nest.
#[doc(alias = "ncclGroupStart")]
#[doc(alias = "ncclGroupEnd")]
pub fn group<'buf, R>(
    comms: &[&'buf Communicator],
    f: impl FnOnce(&Group<'buf>) -> Result<R>,
) -> Result<R> {
    // The guards come back only from a captured group; here they were released at the launch.
    group_in(comms, None, f).map(|(r, _)| r)
}

/// [`group`], recorded into `capture` where given: then the buffers' guards are returned for
/// the capture's graph to keep, and nothing is counted as enqueued.
pub(crate) fn group_in<'buf, R>(
    comms: &[&'buf Communicator],
    capture: Option<Captured<'buf>>,
    f: impl FnOnce(&Group<'buf>) -> Result<R>,
) -> Result<(R, Vec<SyncOnDrop<'buf>>)> {
    let Some(first) = comms.first() else {
        return Err(NcclError::InvalidArgument {
            comm: "nccl group".into(),
            op: "group".into(),
            reason: "no communicator".into(),
        });
    };
    if IN_GROUP.with(Cell::get) {
        return Err(first.invalid(
            "group",
            "a group is already open on this thread (dist does not nest groups)".into(),
        ));
    }
    let mut unique: Vec<&'buf Communicator> = Vec::with_capacity(comms.len());
    for c in comms {
        if !unique.iter().any(|u| std::ptr::eq(*u, *c)) {
            unique.push(c);
        }
    }
    // Own each communicator, in address order (two threads' groups over the same
    // communicators then cannot each hold one the other waits for).
    unique.sort_by_key(|c| std::ptr::from_ref::<Communicator>(c) as usize);
    let me = std::thread::current().id();
    for (i, c) in unique.iter().enumerate() {
        match c.shared.lock_for_call("group") {
            Ok(mut st) => st.owner = Some(me),
            Err(e) => {
                for done in &unique[..i] {
                    done.shared.release(&mut done.shared.lock());
                }
                return Err(e);
            }
        }
    }
    let nccl = &first.shared.nccl;
    let start = match nccl_fn!(nccl, ncclGroupStart) {
        // SAFETY: ncclGroupStart takes no arguments and only touches this thread's group state
        // (the multirank trials `nccl_group_paths` and `nccl_uneven_grouped`).
        Ok(f) => NcclCode::check(unsafe { f() })
            .map_err(|code| nccl_error(nccl, &first.shared.who, "ncclGroupStart", code, None)),
        Err(e) => Err(e.into()),
    };
    if let Err(e) = start {
        for c in &unique {
            c.shared.release(&mut c.shared.lock());
        }
        return Err(e);
    }
    IN_GROUP.with(|g| g.set(true));
    // From here `g`'s drop ends the group, also when `f` panics.
    let g = Group {
        comms: unique,
        guards: RefCell::new(Vec::with_capacity(4)),
        ended: Cell::new(false),
        capture,
        _thread: PhantomData,
        _invariant: PhantomData,
    };
    let out = f(&g);
    let ended = g.end();
    let kept = g.guards.take();
    match (out, ended) {
        (Ok(v), Ok(())) => Ok((v, kept)),
        (Err(e), end) => {
            if let Err(end) = end {
                tracing::warn!(error = %end, "ncclGroupEnd after a failed group");
            }
            Err(e)
        }
        (Ok(_), Err(e)) => Err(e),
    }
}

impl<'buf> Group<'buf> {
    /// Calls on `comm` (one of the group's) on its stream.
    pub fn with(&self, comm: &'buf Communicator) -> Result<GroupOps<'_, 'buf>> {
        if self.index_of(comm).is_none() {
            return Err(comm.invalid(
                "group",
                "this communicator is not one of the group's".into(),
            ));
        }
        Ok(GroupOps {
            group: self,
            ops: self.ops_of(comm),
        })
    }

    /// The group's communicators (each once, in address order).
    pub fn communicators(&self) -> &[&'buf Communicator] {
        &self.comms
    }

    pub(crate) fn first(&self) -> GroupOps<'_, 'buf> {
        GroupOps {
            group: self,
            ops: self.ops_of(self.comms[0]),
        }
    }

    fn ops_of(&self, comm: &'buf Communicator) -> Ops<'buf> {
        match self.capture {
            Some(c) => Ops {
                grouped: true,
                capture: Some(c),
                ..comm.on(c.stream)
            },
            None => Ops {
                grouped: true,
                ..comm.ops()
            },
        }
    }

    pub(crate) fn keep(&self, g: Guards<'buf>) {
        let mut v = self.guards.borrow_mut();
        v.extend(g.0);
        v.extend(g.1);
    }

    fn index_of(&self, comm: &Communicator) -> Option<usize> {
        self.comms.iter().position(|c| std::ptr::eq(*c, comm))
    }

    /// `ncclGroupEnd`, once, with every communicator's lock held (no other thread is inside
    /// NCCL on them, and none can be aborted meanwhile); then each nonblocking one is polled
    /// out of `ncclInProgress`, the buffers' guards are released (after the launch), the
    /// communicators are released and aborts deferred meanwhile are applied.
    fn end(&self) -> Result<()> {
        if self.ended.replace(true) {
            return Ok(());
        }
        IN_GROUP.with(|g| g.set(false));
        let first = &self.comms[0].shared;
        let mut states: Vec<_> = self.comms.iter().map(|c| c.shared.lock()).collect();
        let r = match nccl_fn!(&first.nccl, ncclGroupEnd) {
            // SAFETY: this thread opened the group (ncclGroupStart in `group`, and a Group never
            // leaves its thread); every communicator recorded in it is live: each was live when
            // the group took it, and an abort is deferred while the group owns it (`owner`);
            // we hold every one's lock, so no other thread is inside NCCL on them. The
            // multirank trial `nccl_group_paths` ends groups after an error and a panic;
            // `nccl_uneven_grouped` and `nccl_collectives` end groups of sends and receives.
            Ok(f) => unsafe { f() },
            Err(e) => {
                for (c, st) in self.comms.iter().zip(states.iter_mut()) {
                    c.shared.release(st);
                }
                return Err(e.into());
            }
        };
        let mut result = Ok(());
        for (c, st) in self.comms.iter().zip(states.iter_mut()) {
            let settled = match NcclCode::check(r) {
                Ok(()) => Ok(()),
                Err(NcclCode::InProgress) => c.shared.wait_ready(st, "group end", c.shared.timeout),
                Err(code) => Err(nccl_error(
                    &c.shared.nccl,
                    &c.shared.who,
                    "ncclGroupEnd",
                    code,
                    Some(st.comm),
                )),
            };
            // The group's kernels are on the streams now: let the watchdog watch them (a
            // captured group's are not, until a replay).
            if self.capture.is_none() {
                for u in &mut st.streams {
                    u.enqueued += 1;
                }
            }
            st.last_op = "group";
            if result.is_ok() {
                result = settled;
            }
        }
        // The buffers' guards record cudarc's events (CUDA calls): after the locks are released,
        // never under them (a CUDA call can block behind another communicator's abort, which
        // may need this one's: `deadline.rs`).
        // A captured group's guards go to the graph instead (taken by `group_in`).
        let guards = if self.capture.is_none() {
            std::mem::take(&mut *self.guards.borrow_mut())
        } else {
            Vec::new()
        };
        for (c, st) in self.comms.iter().zip(states.iter_mut()) {
            c.shared.release(st);
        }
        drop(states);
        drop(guards);
        result
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.end() {
            tracing::warn!(error = %e, "ncclGroupEnd while unwinding");
        }
    }
}

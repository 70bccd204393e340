//! `Communicator`: one rank of an NCCL communicator on one GPU, how it forms (with a
//! deadline), splits, synchronizes, aborts and is dropped (within its timeout).

use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use dist_nccl_sys::{Library as Nccl, nccl_fn, ncclComm_t, ncclResult_t};

use crate::abort_handle::AbortHandle;
use crate::config::{CommConfig, comm_stream, config, runtime_connect_note};
use crate::error::{NcclCode, NcclError, Result};
use crate::group::Group;
use crate::id::UniqueId;
use crate::ops::Ops;
use crate::shared::{Abort, Shared, cuda, nccl_error};
use crate::split;
use crate::watchdog::{WATCH_EVERY, watch};

/// Why an init is refused while this thread has a group open.
const IN_GROUP_REASON: &str =
    "not inside a group: this thread has a group open, which would record the init into it";

/// A member of an NCCL communicator, bound to one GPU, with its stream and watchdog.
///
/// `Communicator` is `Sync`: threads may share one, and every NCCL call on it runs under its
/// lock, one at a time, as NCCL requires. Calls from several threads are enqueued in the order
/// they take the lock, which need not be the same on every rank: give each thread its own
/// communicator (or order the calls) where the matching of collectives across ranks matters.
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    device: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// The event a `synchronize` waits on; a second concurrent one makes its own (an event
    /// re-recorded by another thread would let a wait end early).
    sync_event: Mutex<CudaEvent>,
    /// The stream captured calls take their buffers' pointers on (`capture.rs`), made at the
    /// first capture.
    pub(crate) scratch: OnceLock<Arc<CudaStream>>,
    watchdog: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shared.who)
    }
}

impl Communicator {
    /// Joins communicator `id` as `rank` of `size`, on the GPU of `ctx`. Every rank must call
    /// this with the same id; it returns when all have joined, or fails at the init deadline
    /// (aborting the half-made communicator). Refused while this thread has a group open.
    pub fn init_rank(
        nccl: Arc<Nccl>,
        ctx: &Arc<CudaContext>,
        rank: usize,
        size: usize,
        id: &UniqueId,
        cfg: CommConfig,
    ) -> Result<Communicator> {
        let device = ctx.ordinal();
        let who = format!(
            "nccl comm {}rank {rank}/{size} on cuda:{device}",
            cfg.name
                .as_ref()
                .map_or(String::new(), |n| format!("'{n}' "))
        );
        // Inside an open group NCCL would record the init as one of the group's jobs, and the
        // connecting sends and receives (`connect_peers`) would outlive their buffer until the
        // outer group ends: refused before NCCL or CUDA is called, as splits are.
        if crate::group::in_group() {
            return Err(NcclError::InvalidArgument {
                comm: who,
                op: "init".into(),
                reason: IN_GROUP_REASON.into(),
            });
        }
        if size == 0 || size > i32::MAX as usize || rank >= size {
            return Err(NcclError::InvalidArgument {
                comm: who,
                op: "init".into(),
                reason: format!("rank {rank} of size {size}: need 0 <= rank < size <= 2^31-1"),
            });
        }
        let init = nccl_fn!(&nccl, ncclCommInitRankConfig)?;
        runtime_connect_note();
        ctx.bind_to_thread()
            .map_err(cuda(&who, "bind the CUDA context"))?;
        let mut conf = config(nccl.version(), &cfg, false);
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let started = Instant::now();
        // SAFETY: every pointer is valid for the call (NCCL reads the config during it); the name
        // the config points to, which NCCL keeps, lives for the process (`config::nccl_name`).
        // No group is open on this thread (refused above). Every multirank GPU trial forms its
        // communicator here (`rig` in `nccl_tests.rs`, e.g. `nccl_collectives`).
        let r = unsafe { init(&mut comm, size as i32, id.raw(), rank as i32, &mut conf) };
        NcclCode::check_started(r)
            .map_err(|code| nccl_error(&nccl, &who, "ncclCommInitRankConfig", code, None))?;
        // The communicator forms in nonblocking mode, so that init has a deadline and can be
        // aborted; it is kept for splits, which then have a deadline too.
        split::wait_handle(&nccl, comm, &who, "init", started, cfg.init_timeout)?;
        let base = format!(
            "nccl comm {}",
            cfg.name
                .as_ref()
                .map_or(String::new(), |n| format!("'{n}' "))
        );
        Self::from_nonblocking(nccl, ctx.clone(), comm, base, &cfg)
    }

    /// One process driving several GPUs (`ncclCommInitAll`): a communicator per device of
    /// `devices`, rank i on `devices[i]`. Drive them from one thread inside a
    /// [`Communicator::group`], or from a thread each. All ranks are in this process, so the
    /// init (blocking) has no remote peer to wait for. Refused while this thread has a group
    /// open.
    pub fn init_all(
        nccl: Arc<Nccl>,
        devices: &[usize],
        cfg: CommConfig,
    ) -> Result<Vec<Communicator>> {
        let who = format!("nccl init_all on devices {devices:?}");
        // As in `init_rank`: an init inside an open group would be recorded into it.
        if crate::group::in_group() {
            return Err(NcclError::InvalidArgument {
                comm: who,
                op: "init_all".into(),
                reason: IN_GROUP_REASON.into(),
            });
        }
        let f = nccl_fn!(&nccl, ncclCommInitAll)?;
        if devices.is_empty() || devices.len() > i32::MAX as usize {
            return Err(NcclError::InvalidArgument {
                comm: who,
                op: "init_all".into(),
                reason: format!("{} devices", devices.len()),
            });
        }
        let ctxs = devices
            .iter()
            .map(|d| CudaContext::new(*d).map_err(cuda(&who, &format!("open cuda:{d}"))))
            .collect::<Result<Vec<_>>>()?;
        let list: Vec<i32> = devices.iter().map(|d| *d as i32).collect();
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one handle per device in `list`; no group is open on this
        // thread (refused above). The multirank trial `nccl_init_all_fp8` runs it.
        let r = unsafe { f(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) };
        NcclCode::check(r)
            .map_err(|code| nccl_error(&nccl, &who, "ncclCommInitAll", code, None))?;
        let n = devices.len();
        let mut out = Vec::with_capacity(n);
        for (i, (comm, ctx)) in comms.into_iter().zip(ctxs).enumerate() {
            let stream = comm_stream(&ctx, &cfg).map_err(cuda(&who, "create a stream"))?;
            let name = format!("nccl comm rank {i}/{n} on cuda:{} (init_all)", devices[i]);
            out.push(Self::finish(
                nccl.clone(),
                ctx,
                stream,
                comm,
                None,
                std::ptr::null_mut(),
                i,
                n,
                name,
                &cfg,
            )?);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments, reason = "one private constructor's parts")]
    pub(crate) fn finish(
        nccl: Arc<Nccl>,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        comm: ncclComm_t,
        nb: Option<ncclComm_t>,
        sharing: ncclComm_t,
        rank: usize,
        size: usize,
        who: String,
        cfg: &CommConfig,
    ) -> Result<Communicator> {
        let shared = Arc::new(Shared::new(nccl, comm, who.clone(), cfg.timeout, stream));
        shared.deadline.register(&shared);
        {
            let mut st = shared.lock();
            st.nb = nb.unwrap_or(std::ptr::null_mut());
            st.sharing = sharing;
            if let Err(e) = shared.wait_ready(&mut st, "init", cfg.init_timeout) {
                shared.abort_all_locked(&mut st, Abort::Error(e.to_string()));
                return Err(e);
            }
        }
        let abort_with = |e: NcclError| {
            shared.abort_all_locked(&mut shared.lock(), Abort::Error(e.to_string()));
            e
        };
        let sync_event = ctx
            .new_event(None)
            .map_err(cuda(&who, "create an event"))
            .map_err(abort_with)?;
        let watchdog = {
            let shared = shared.clone();
            let ctx = ctx.clone();
            std::thread::Builder::new()
                .name(format!("dist-nccl-watchdog-{rank}"))
                .spawn(move || watch(&shared, &ctx))
                .map_err(|e| NcclError::Config {
                    what: who.clone(),
                    reason: format!("cannot start the watchdog thread: {e}"),
                })
                .map_err(abort_with)?
        };
        tracing::debug!(comm = %shared.who, "communicator ready");
        Ok(Communicator {
            shared,
            rank,
            size,
            device: ctx.ordinal(),
            ctx,
            sync_event: Mutex::new(sync_event),
            scratch: OnceLock::new(),
            watchdog: Some(watchdog),
        })
    }

    /// This rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The CUDA context. Buffers and streams given to the communicator must belong to this
    /// context object (another `CudaContext` of the same device is refused: cudarc orders a
    /// buffer's uses only through its own context's events).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream [`Communicator`]'s calls run on: one of its own, or the context's default
    /// stream without [`CommConfig::own_stream`].
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// The NCCL library it runs on.
    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.shared.nccl
    }

    /// Collectives on the communicator's stream.
    pub fn ops(&self) -> Ops<'_> {
        Ops {
            comm: self,
            stream: &self.shared.stream,
            grouped: false,
            capture: None,
        }
    }

    /// Collectives on `stream` (of this communicator's context) instead. The communicator keeps
    /// the stream alive, watches the work enqueued on it, and waits for it (within the timeout)
    /// when dropped. They are ordered with the caller's own work on that stream: after what was
    /// enqueued there before, before what is enqueued after. A call on a stream that is
    /// capturing a CUDA graph is refused; record calls into a graph with
    /// [`Communicator::capture`].
    pub fn on<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Ops<'a> {
        Ops {
            comm: self,
            stream,
            grouped: false,
            capture: None,
        }
    }

    /// Runs `f` inside one NCCL group on this communicator (see [`crate::group()`]): the calls
    /// it makes through the [`Group`] are launched together when it returns, and the buffers
    /// they name stay borrowed until then.
    pub fn group<'buf, R>(&'buf self, f: impl FnOnce(&Group<'buf>) -> Result<R>) -> Result<R> {
        crate::group::group(&[self], f)
    }

    /// The communicator's asynchronous error, if NCCL reports one (`ncclCommGetAsyncError`),
    /// or why it was aborted.
    #[doc(alias = "ncclCommGetAsyncError")]
    pub fn async_error(&self) -> Option<NcclError> {
        let st = match self.shared.lock_for_call("async_error") {
            Ok(st) => st,
            Err(e) => return Some(e),
        };
        let get = match nccl_fn!(&self.shared.nccl, ncclCommGetAsyncError) {
            Ok(g) => g,
            Err(e) => return Some(e.into()),
        };
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live (`lock_for_call` checked `aborted`) and we hold its
        // lock, so no other thread is inside NCCL on it; valid pointer (the multirank trial
        // `nccl_misuse` asks for it).
        let r = unsafe { get(st.comm, &mut state) };
        let code = NcclCode::check_started(r)
            .and(NcclCode::check_started(state))
            .err()?;
        Some(nccl_error(
            &self.shared.nccl,
            &self.shared.who,
            "async_error",
            code,
            Some(st.comm),
        ))
    }

    /// Aborts the communicator (`ncclCommAbort`): work in flight is cancelled and every later
    /// call fails with [`NcclError::Aborted`]. Never waits: while another thread is inside an
    /// NCCL call on it, the abort happens as soon as that call returns (NCCL does not allow it
    /// under the call), and while a group is open over it, at the group's end.
    #[doc(alias = "ncclCommAbort")]
    pub fn abort(&self) {
        self.shared.request_abort(Abort::User);
    }

    /// [`Communicator::abort`] with a reason: every later call (and a `synchronize` waiting
    /// now) fails with [`NcclError::Aborted`] carrying `reason` and naming the refused call.
    /// Only the first abort's reason is kept.
    pub fn abort_with(&self, reason: impl Into<String>) {
        self.shared.request_abort(Abort::Error(reason.into()));
    }

    /// A handle that aborts this communicator from another thread (a watchdog of the caller's
    /// own, e.g. a peer-failure or mismatch check) without borrowing it; it keeps only the
    /// shared state alive, and aborting after the communicator was dropped does nothing.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: self.shared.clone(),
        }
    }

    /// Waits until everything enqueued on the communicator's stream so far has completed, or
    /// the communicator fails: never longer than its timeout (then the watchdog aborts it).
    pub fn synchronize(&self) -> Result<()> {
        self.synchronize_stream(&self.shared.stream)
    }

    /// [`Communicator::synchronize`] with a deadline of its own: if the work has not completed
    /// within `timeout` (capped at the communicator's timeout), the communicator is aborted
    /// and this returns [`NcclError::Timeout`].
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_stream(&self.shared.stream, timeout.min(self.shared.timeout))
    }

    /// [`Communicator::synchronize`] for another stream of this communicator's context.
    pub fn synchronize_stream(&self, stream: &CudaStream) -> Result<()> {
        self.wait_stream(stream, self.shared.timeout + WATCH_EVERY * 10)
    }

    fn wait_stream(&self, stream: &CudaStream, limit: Duration) -> Result<()> {
        // An abort decided on another thread: refuse now, while NCCL may still be tearing the
        // communicator down under the lock. Checked before every CUDA call here, not after:
        // while `ncclCommAbort` frees the communicator's device resources, a CUDA call on this
        // context can block until it is done (seen on 2 x H200: an event query that began just
        // after the decision returned 1.3 s later, the length of the abort). The work left on
        // the stream is cancelled by that abort; a buffer dropped now is freed only after its
        // last use on the stream (cudarc waits for its events, then frees in stream order or
        // after a sync).
        if let Some(why) = self.shared.doomed.get() {
            return Err(self.shared.aborted_error("synchronize", why));
        }
        // An event recorded on a capturing stream would be captured, and querying it would
        // invalidate the capture: nothing on it runs until a replay.
        if crate::capture::capturing(stream)
            .map_err(cuda(&self.shared.who, "query the stream's capture state"))?
        {
            return Err(self.invalid(
                "synchronize",
                "the stream is capturing a CUDA graph: nothing recorded runs until a replay \
                 (wait for replays with Graph::synchronize)"
                    .into(),
            ));
        }
        let fresh;
        let held = self.sync_event.try_lock().ok();
        let event: &CudaEvent = match &held {
            Some(own) => own,
            None => {
                fresh = self
                    .ctx
                    .new_event(None)
                    .map_err(cuda(&self.shared.who, "create an event"))?;
                &fresh
            }
        };
        event
            .record(stream)
            .map_err(cuda(&self.shared.who, "record an event"))?;
        self.wait_event(event, limit, "synchronize")
    }

    /// Waits until `event` (recorded on a stream of this communicator's context) has
    /// completed, or the communicator fails, or `limit` passes: then the communicator is
    /// aborted (at once if no call is inside NCCL, else when that call returns) and this
    /// returns the timeout, as `op`.
    pub(crate) fn wait_event(&self, event: &CudaEvent, limit: Duration, op: &str) -> Result<()> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(why) = self.shared.doomed.get() {
                return Err(self.shared.aborted_error(op, why));
            }
            if event
                .try_is_complete()
                .map_err(cuda(&self.shared.who, "query an event"))?
            {
                return Ok(());
            }
            // try_lock: a call another thread has inside NCCL must not hold this wait past its
            // deadline.
            if let Some(st) = self.shared.try_lock()
                && let Some(why) = &st.aborted
            {
                return Err(self.shared.aborted_error(op, why));
            }
            if started.elapsed() > limit {
                // The watchdog should have acted by now; do it here (at once if no call is
                // inside NCCL, else when that call returns; deferred while a group is open).
                let why = Abort::Timeout {
                    op: op.into(),
                    waited: started.elapsed(),
                };
                self.shared.request_abort(why.clone());
                return Err(self.shared.aborted_error(op, &why));
            }
            spins += 1;
            if spins < 20_000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    pub(crate) fn invalid(&self, op: &str, reason: String) -> NcclError {
        NcclError::InvalidArgument {
            comm: self.shared.who.clone(),
            op: op.to_string(),
            reason,
        }
    }

    /// Why `what`, of context `other`, is refused.
    pub(crate) fn foreign(&self, what: &str, other: &Arc<CudaContext>) -> String {
        let d = other.ordinal();
        if d != self.device {
            format!(
                "{what} is on cuda:{d}, the communicator on cuda:{}",
                self.device
            )
        } else {
            format!(
                "{what} belongs to another CudaContext of cuda:{d} than the communicator's \
                 (allocate it from Communicator::context() or its streams: cudarc orders a \
                 buffer's uses only within its own context object)"
            )
        }
    }

    /// Waits (until `deadline`) for the work enqueued so far on every stream the communicator
    /// used; false if some did not complete.
    fn drain(&self, deadline: Instant) -> bool {
        let streams: Vec<Arc<CudaStream>> = self
            .shared
            .lock()
            .streams
            .iter()
            .map(|u| u.stream.clone())
            .collect();
        let event = self.sync_event.lock().unwrap_or_else(|p| p.into_inner());
        for s in &streams {
            // Work recorded into a capture does not run; a mark there would never complete.
            if matches!(crate::capture::capturing(s), Ok(true)) {
                tracing::warn!(comm = %self.shared.who, "drop: a stream it used is capturing");
                continue;
            }
            if event.record(s).is_err() {
                return false;
            }
            loop {
                if event.is_complete() {
                    break;
                }
                if Instant::now() > deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        true
    }
}

impl Drop for Communicator {
    /// Bounded: waits (within the timeout, at most 30 s) for the work on every stream the
    /// communicator enqueued on, then finalizes and destroys it; if the work does not complete
    /// (a dead peer), aborts it instead.
    fn drop(&mut self) {
        *self.shared.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.shared.wake.notify_all();
        let t0 = Instant::now();
        tracing::debug!(comm = %self.shared.who, "drop: joining the watchdog");
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        tracing::debug!(comm = %self.shared.who, took = ?t0.elapsed(), "drop: watchdog joined");
        if crate::group::in_group() {
            // This thread has a group open (over other communicators): finalize or abort now
            // would be recorded into that group. Leaking the communicator is the safe choice.
            tracing::error!(
                comm = %self.shared.who,
                "dropped inside another communicator's group; leaking it instead of calling NCCL"
            );
            return;
        }
        // An abort decided meanwhile (asked for while a call held the lock, or by the deadline
        // thread) is applied now rather than after draining work it has given up on.
        if let Some(why) = self.shared.doomed.get().cloned() {
            self.shared.abort_waiting(why);
            self.shared.release_kept(&mut self.shared.lock());
            return;
        }
        let limit = self.shared.timeout.min(Duration::from_secs(30));
        let drained = self.drain(Instant::now() + limit);
        tracing::debug!(comm = %self.shared.who, drained, took = ?t0.elapsed(), "drop: drained");
        let mut st = self.shared.lock();
        if st.aborted.is_some() {
            tracing::debug!(comm = %self.shared.who, "drop: was aborted; freeing what it kept");
            self.shared.release_kept(&mut st);
            return;
        }
        if !drained {
            tracing::warn!(comm = %self.shared.who, "work still in flight at drop; aborting");
            let why = Abort::Timeout {
                op: "drop".into(),
                waited: limit,
            };
            self.shared.abort_locked(&mut st, why);
            self.shared.release_kept(&mut st);
            return;
        }
        let nccl = self.shared.nccl.clone();
        // Graceful: finalize (flushes outstanding work), then destroy; abort if that fails.
        let finalized = match nccl_fn!(&nccl, ncclCommFinalize) {
            Ok(f) => {
                // SAFETY: live communicator (`aborted` is None) under its lock; no group can be
                // open over it (a group borrows the communicator, which is being dropped). Every
                // GPU trial drops its communicator; `nccl_drop_bounded` bounds it.
                let r = unsafe { f(st.comm) };
                self.shared
                    .settle(&mut st, "finalize", r)
                    .and_then(|()| self.shared.wait_ready(&mut st, "finalize", limit))
            }
            Err(e) => Err(e.into()),
        };
        if let Err(e) = finalized {
            tracing::warn!(comm = %self.shared.who, error = %e, "finalize failed; aborting");
            self.shared
                .abort_locked(&mut st, Abort::Error(e.to_string()));
            self.shared.release_kept(&mut st);
            return;
        }
        if st.aborted.is_some() {
            self.shared.release_kept(&mut st);
            return;
        }
        if let Ok(f) = nccl_fn!(&nccl, ncclCommDestroy) {
            // SAFETY: finalized, live communicator under its lock, never used again (`aborted`
            // is set right after, under the same lock). Every GPU trial's drop, e.g.
            // `nccl_drop_bounded`.
            let _ = unsafe { f(st.comm) };
            st.aborted = Some(Abort::Error("destroyed".into()));
        }
        // The nonblocking communicators kept (the one whose resources `comm` shared, and the
        // one for splits) have no work left: aborting them (under the lock, never used again)
        // only frees them.
        self.shared.release_kept(&mut st);
    }
}

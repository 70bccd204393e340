//! Communicators, their watchdog, and the collectives.

use std::ffi::{CStr, CString, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use dist_core::ReduceOp;
use dist_nccl_sys::{
    Library as Nccl, cudaStream_t, ncclComm_t, ncclConfig_t, ncclRedOp_t, ncclResult_t,
    ncclScalarResidence_t, ncclUniqueId, version_code,
};

use crate::error::{NcclError, Result};
use crate::types::NcclType;

/// How often the watchdog looks at a communicator.
const WATCH_EVERY: Duration = Duration::from_millis(10);

/// The 128 opaque bytes that let ranks find each other. Rank 0 makes one and every rank passes
/// the same one to [`Communicator::init_rank`]; move it as bytes (over TCP, through the
/// launcher...).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "...)")
    }
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (works without a GPU).
    pub fn new(nccl: &Nccl) -> Result<UniqueId> {
        let f = nccl.get("ncclGetUniqueId", &nccl.raw().ncclGetUniqueId)?;
        let mut raw = ncclUniqueId::default();
        // SAFETY: the pointer is valid for one ncclUniqueId, which NCCL fills.
        let r = unsafe { f(&mut raw) };
        if r != ncclResult_t::ncclSuccess {
            return Err(nccl_error(
                nccl,
                "ncclGetUniqueId",
                "ncclGetUniqueId",
                r,
                None,
            ));
        }
        Ok(UniqueId(bytemuck::cast(raw.internal)))
    }

    /// The id from its 128 bytes.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let a: [u8; 128] = b.try_into().map_err(|_| NcclError::Config {
            what: "NCCL unique id".into(),
            reason: format!("{} bytes, expected 128", b.len()),
        })?;
        Ok(UniqueId(a))
    }

    /// Its 128 bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: bytemuck::cast(self.0),
        }
    }
}

/// How to create a communicator.
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// Deadline for the communicator to form (default 120 s).
    pub init_timeout: Duration,
    /// Deadline for enqueued work to complete, and for each call (default 300 s). Work that
    /// makes no progress for this long makes the watchdog abort the communicator.
    pub timeout: Duration,
    /// NCCL's minimum number of CTAs, if set.
    pub min_ctas: Option<i32>,
    /// NCCL's maximum number of CTAs, if set.
    pub max_ctas: Option<i32>,
    /// A name for logs and errors.
    pub name: Option<String>,
    /// Keep NCCL's nonblocking mode for every call (each call then goes through an NCCL
    /// thread, tens of µs). By default the communicator forms in nonblocking mode (so init has
    /// a deadline) and is then split into a blocking one, whose calls cost what plain NCCL's do.
    pub nonblocking_calls: bool,
}

impl Default for CommConfig {
    fn default() -> CommConfig {
        CommConfig {
            init_timeout: Duration::from_secs(120),
            timeout: Duration::from_secs(300),
            min_ctas: None,
            max_ctas: None,
            name: None,
            nonblocking_calls: false,
        }
    }
}

fn error_text(nccl: &Nccl, r: ncclResult_t) -> String {
    match nccl.get("ncclGetErrorString", &nccl.raw().ncclGetErrorString) {
        // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any code.
        Ok(f) => unsafe { CStr::from_ptr(f(r)) }
            .to_string_lossy()
            .into_owned(),
        Err(_) => format!("code {}", r.0),
    }
}

fn last_error(nccl: &Nccl, comm: Option<ncclComm_t>) -> String {
    match nccl.get("ncclGetLastError", &nccl.raw().ncclGetLastError) {
        Ok(f) => {
            // SAFETY: ncclGetLastError takes a communicator or null and returns a C string
            // owned by NCCL (possibly empty), valid until the next NCCL call on this thread.
            let p = unsafe { f(comm.unwrap_or(std::ptr::null_mut())) };
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, NUL-terminated, see above.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => String::new(),
    }
}

fn nccl_error(
    nccl: &Nccl,
    who: &str,
    op: &str,
    r: ncclResult_t,
    comm: Option<ncclComm_t>,
) -> NcclError {
    NcclError::Nccl {
        comm: who.to_string(),
        op: op.to_string(),
        code: r.0,
        text: error_text(nccl, r),
        last: last_error(nccl, comm),
    }
}

/// Why a communicator was aborted.
#[derive(Clone, Debug)]
enum Abort {
    Timeout { op: String, waited: Duration },
    Error(String),
    User,
}

impl Abort {
    fn reason(&self) -> String {
        match self {
            Abort::Timeout { op, waited } => format!("{op} made no progress for {waited:.1?}"),
            Abort::Error(e) => e.clone(),
            Abort::User => "abort() was called".into(),
        }
    }
}

struct Handle {
    comm: ncclComm_t,
    aborted: Option<Abort>,
}

// SAFETY: an NCCL communicator may be used from any thread. The mutex around this handle
// guards its state; calls run outside it, counted in `Shared::in_flight`, so that one blocked
// inside NCCL can be aborted from another thread (which NCCL supports). A call is admitted only
// under the mutex and while the handle is live; an abort, under the mutex, first lets calls in
// flight reach NCCL, so none enters after the communicator is freed.
unsafe impl Send for Handle {}

/// What the communicator, its watchdog and its `Ops` share.
struct Shared {
    nccl: Arc<Nccl>,
    handle: Mutex<Handle>,
    who: String,
    timeout: Duration,
    /// Calls enqueued so far, and the last one's name (an index into `OP_NAMES`).
    enqueued: AtomicU64,
    last_op: AtomicUsize,
    stop: Mutex<bool>,
    wake: Condvar,
    stream: Arc<CudaStream>,
    _name: Option<CString>,
    /// NCCL calls running now (outside the mutex), and calls started so far.
    in_flight: AtomicUsize,
    calls: AtomicU64,
}

const OP_NAMES: &[&str] = &[
    "none",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
];

fn op_index(op: &str) -> usize {
    OP_NAMES.iter().position(|o| *o == op).unwrap_or(0)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Handle> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted_error(&self, op: &str, why: &Abort) -> NcclError {
        match why {
            Abort::Timeout { op: slow, waited } => NcclError::Timeout {
                comm: self.who.clone(),
                op: format!("{op} (after {slow})"),
                waited: *waited,
            },
            other => NcclError::Aborted {
                comm: self.who.clone(),
                op: op.to_string(),
                reason: other.reason(),
            },
        }
    }

    /// Runs one NCCL call on the communicator, refusing if it was aborted, and waits (polling,
    /// within the timeout) while a nonblocking call is still in progress. The call itself runs
    /// outside the mutex: if it blocks (a blocking communicator), the watchdog can still abort.
    fn call(&self, op: &str, f: impl FnOnce(ncclComm_t) -> ncclResult_t) -> Result<()> {
        let comm = {
            let h = self.lock();
            if let Some(why) = &h.aborted {
                return Err(self.aborted_error(op, why));
            }
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            self.calls.fetch_add(1, Ordering::AcqRel);
            h.comm
        };
        let r = f(comm);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if r == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        let mut h = self.lock();
        if let Some(why) = &h.aborted {
            return Err(self.aborted_error(op, why));
        }
        self.settle(&mut h, op, r)
    }

    fn settle(&self, h: &mut Handle, op: &str, r: ncclResult_t) -> Result<()> {
        match r {
            ncclResult_t::ncclSuccess => Ok(()),
            ncclResult_t::ncclInProgress => self.wait_ready(h, op, self.timeout),
            other => Err(nccl_error(&self.nccl, &self.who, op, other, Some(h.comm))),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress.
    fn wait_ready(&self, h: &mut Handle, op: &str, limit: Duration) -> Result<()> {
        let get = self.nccl.get(
            "ncclCommGetAsyncError",
            &self.nccl.raw().ncclCommGetAsyncError,
        )?;
        let started = Instant::now();
        loop {
            let mut state = ncclResult_t::ncclInProgress;
            // SAFETY: the communicator is live (not aborted: we hold its lock) and the pointer
            // is valid for one result.
            let r = unsafe { get(h.comm, &mut state) };
            if r != ncclResult_t::ncclSuccess {
                return Err(nccl_error(&self.nccl, &self.who, op, r, Some(h.comm)));
            }
            match state {
                ncclResult_t::ncclSuccess => return Ok(()),
                ncclResult_t::ncclInProgress => {}
                other => return Err(nccl_error(&self.nccl, &self.who, op, other, Some(h.comm))),
            }
            if started.elapsed() > limit {
                let why = Abort::Timeout {
                    op: op.to_string(),
                    waited: started.elapsed(),
                };
                self.abort_locked(h, why.clone());
                return Err(self.aborted_error(op, &why));
            }
            std::thread::yield_now();
        }
    }

    /// `ncclCommAbort`, once; afterwards the handle is dead and every call refuses. Called with
    /// the mutex held, so no new call is admitted meanwhile.
    fn abort_locked(&self, h: &mut Handle, why: Abort) {
        if h.aborted.is_some() {
            return;
        }
        tracing::warn!(comm = %self.who, reason = %why.reason(), "aborting NCCL communicator");
        // Calls admitted a moment ago reach NCCL (or finish) first; one still in flight after
        // that is blocked inside NCCL, which ncclCommAbort then releases.
        let until = Instant::now() + Duration::from_millis(200);
        while self.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::yield_now();
        }
        if let Ok(f) = self
            .nccl
            .get("ncclCommAbort", &self.nccl.raw().ncclCommAbort)
        {
            // SAFETY: the communicator is live and no other call runs on it (we hold its lock);
            // after this the handle is never used again (`aborted` is set).
            let _ = unsafe { f(h.comm) };
        }
        h.aborted = Some(why);
    }
}

/// A member of an NCCL communicator, bound to one GPU, with its own stream and watchdog.
pub struct Communicator {
    shared: Arc<Shared>,
    rank: usize,
    size: usize,
    device: usize,
    ctx: Arc<CudaContext>,
    sync_event: CudaEvent,
    watchdog: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shared.who)
    }
}

fn cuda(who: &str, op: &str) -> impl FnOnce(cudarc::driver::DriverError) -> NcclError {
    let (comm, op) = (who.to_string(), op.to_string());
    move |source| NcclError::Cuda { comm, op, source }
}

fn config(nccl: &Nccl, cfg: &CommConfig, name: Option<&CString>, blocking: bool) -> ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        // The struct's version is the older of the header's and the library's, so that an
        // older NCCL reads only the fields it knows.
        version: nccl.version().min(version_code(2, 28, 9)) as u32,
        blocking: i32::from(blocking),
        cgaClusterSize: UNDEF,
        minCTAs: cfg.min_ctas.unwrap_or(UNDEF),
        maxCTAs: cfg.max_ctas.unwrap_or(UNDEF),
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: name.map_or(std::ptr::null(), |n| n.as_ptr()),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

impl Communicator {
    /// Joins communicator `id` as `rank` of `size`, on the GPU of `ctx`. Every rank must call
    /// this with the same id; it returns when all have joined, or fails at the init deadline
    /// (aborting the half-made communicator).
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
        if size == 0 || size > i32::MAX as usize || rank >= size {
            return Err(NcclError::InvalidArgument {
                comm: who,
                op: "init".into(),
                reason: format!("rank {rank} of size {size}: need 0 <= rank < size <= 2^31-1"),
            });
        }
        let init = nccl.get("ncclCommInitRankConfig", &nccl.raw().ncclCommInitRankConfig)?;
        ctx.bind_to_thread()
            .map_err(cuda(&who, "bind the CUDA context"))?;
        let stream = ctx.new_stream().map_err(cuda(&who, "create a stream"))?;
        let name = cfg
            .name
            .as_ref()
            .map(|n| CString::new(n.replace('\0', " ")).expect("NULs replaced"));
        let mut conf = config(&nccl, &cfg, name.as_ref(), false);
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; NCCL copies the config and the name.
        let r = unsafe { init(&mut comm, size as i32, id.raw(), rank as i32, &mut conf) };
        if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
            return Err(nccl_error(&nccl, &who, "ncclCommInitRankConfig", r, None));
        }
        let formed = Self::finish(nccl, ctx.clone(), stream, comm, rank, size, who, name, &cfg)?;
        if cfg.nonblocking_calls {
            return Ok(formed);
        }
        // The communicator formed in nonblocking mode, so that init had a deadline and could be
        // aborted. Calls on a nonblocking communicator each go through an NCCL thread (tens of
        // µs); a blocking child with the same ranks (split, color 0, same order) makes them as
        // cheap as plain NCCL. The watchdog can still abort a call that blocks.
        let child = formed.split_mode(0, rank as i32, cfg, true)?;
        drop(formed);
        Ok(child)
    }

    /// One process driving several GPUs (`ncclCommInitAll`): a communicator per device of
    /// `devices`, rank i on `devices[i]`. Drive them from one thread inside a
    /// [`Communicator::group`], or from a thread each. All ranks are in this process, so the
    /// init (blocking) has no remote peer to wait for.
    pub fn init_all(
        nccl: Arc<Nccl>,
        devices: &[usize],
        cfg: CommConfig,
    ) -> Result<Vec<Communicator>> {
        let f = nccl.get("ncclCommInitAll", &nccl.raw().ncclCommInitAll)?;
        let who = format!("nccl init_all on devices {devices:?}");
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
        // SAFETY: `comms` has room for one handle per device in `list`.
        let r = unsafe { f(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) };
        if r != ncclResult_t::ncclSuccess {
            return Err(nccl_error(&nccl, &who, "ncclCommInitAll", r, None));
        }
        let n = devices.len();
        let mut out = Vec::with_capacity(n);
        for (i, (comm, ctx)) in comms.into_iter().zip(ctxs).enumerate() {
            let stream = ctx.new_stream().map_err(cuda(&who, "create a stream"))?;
            let name = format!("nccl comm rank {i}/{n} on cuda:{} (init_all)", devices[i]);
            out.push(Self::finish(
                nccl.clone(),
                ctx,
                stream,
                comm,
                i,
                n,
                name,
                None,
                &cfg,
            )?);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments, reason = "one private constructor's parts")]
    fn finish(
        nccl: Arc<Nccl>,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        comm: ncclComm_t,
        rank: usize,
        size: usize,
        who: String,
        name: Option<CString>,
        cfg: &CommConfig,
    ) -> Result<Communicator> {
        let shared = Arc::new(Shared {
            nccl,
            handle: Mutex::new(Handle {
                comm,
                aborted: None,
            }),
            who: who.clone(),
            timeout: cfg.timeout,
            enqueued: AtomicU64::new(0),
            last_op: AtomicUsize::new(0),
            stop: Mutex::new(false),
            wake: Condvar::new(),
            stream,
            _name: name,
            in_flight: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
        });
        {
            let mut h = shared.lock();
            if let Err(e) = shared.wait_ready(&mut h, "init", cfg.init_timeout) {
                if h.aborted.is_none() {
                    shared.abort_locked(&mut h, Abort::Error(e.to_string()));
                }
                return Err(e);
            }
        }
        let sync_event = ctx.new_event(None).map_err(cuda(&who, "create an event"))?;
        let watchdog = {
            let shared = shared.clone();
            let ctx = ctx.clone();
            std::thread::Builder::new()
                .name(format!("dist-nccl-watchdog-{rank}"))
                .spawn(move || watch(&shared, &ctx))
                .map_err(|e| NcclError::Config {
                    what: who.clone(),
                    reason: format!("cannot start the watchdog thread: {e}"),
                })?
        };
        tracing::debug!(comm = %shared.who, "communicator ready");
        Ok(Communicator {
            shared,
            rank,
            size,
            device: ctx.ordinal(),
            ctx,
            sync_event,
            watchdog: Some(watchdog),
        })
    }

    /// Splits this communicator: ranks passing the same `color` form a new one, ordered by
    /// `key` (then by rank). Every rank of this communicator must call it, within the init
    /// deadline of `cfg`.
    pub fn split(&self, color: u32, key: i32, cfg: CommConfig) -> Result<Communicator> {
        let blocking = !cfg.nonblocking_calls;
        self.split_mode(color, key, cfg, blocking)
    }

    fn split_mode(
        &self,
        color: u32,
        key: i32,
        cfg: CommConfig,
        blocking: bool,
    ) -> Result<Communicator> {
        let nccl = self.shared.nccl.clone();
        let f = nccl.get("ncclCommSplit", &nccl.raw().ncclCommSplit)?;
        if color > i32::MAX as u32 {
            return Err(self.invalid("split", format!("color {color} is over 2^31-1")));
        }
        let name = cfg
            .name
            .as_ref()
            .map(|n| CString::new(n.replace('\0', " ")).expect("NULs replaced"));
        let mut conf = config(&nccl, &cfg, name.as_ref(), blocking);
        // A nonblocking split writes the new handle when it completes, from NCCL's thread:
        // the slot lives on the heap and is only read through volatile loads, and if we give
        // up waiting it is leaked, so that a late write lands in memory that is still ours.
        let slot: &'static mut ncclComm_t = Box::leak(Box::new(std::ptr::null_mut()));
        let slot_ptr: *mut ncclComm_t = slot;
        self.shared.call("split", |c| {
            // SAFETY: `c` is live (checked under the lock); the slot and config are valid,
            // and the slot outlives any write NCCL makes to it (see above).
            unsafe { f(c, color as i32, key, slot_ptr, &mut conf) }
        })?;
        let started = Instant::now();
        let new = loop {
            // SAFETY: the slot is valid memory; NCCL may write it concurrently, hence volatile.
            let v = unsafe { std::ptr::read_volatile(slot_ptr) };
            if !v.is_null() {
                break v;
            }
            if let Some(e) = self.async_error() {
                return Err(e);
            }
            if started.elapsed() > cfg.init_timeout {
                let mut h = self.shared.lock();
                let why = Abort::Timeout {
                    op: "split".into(),
                    waited: started.elapsed(),
                };
                self.shared.abort_locked(&mut h, why.clone());
                return Err(self.shared.aborted_error("split", &why));
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        // The handle is ours now; the slot can go.
        // SAFETY: NCCL wrote the slot once, on completion, and will not write it again.
        drop(unsafe { Box::from_raw(slot_ptr) });
        let (count, rank) = (
            nccl.get("ncclCommCount", &nccl.raw().ncclCommCount)?,
            nccl.get("ncclCommUserRank", &nccl.raw().ncclCommUserRank)?,
        );
        let stream = self
            .ctx
            .new_stream()
            .map_err(cuda(&self.shared.who, "create a stream"))?;
        let (mut n, mut r) = (0i32, 0i32);
        // SAFETY: `new` is a communicator NCCL handed back; the pointers are valid. Both calls
        // wait for its initialisation to finish.
        let (a, b) = unsafe { (count(new, &mut n), rank(new, &mut r)) };
        let who = format!(
            "nccl comm {}rank {r}/{n} on cuda:{} (split {color} of {})",
            cfg.name
                .as_ref()
                .map_or(String::new(), |x| format!("'{x}' ")),
            self.device,
            self.shared.who
        );
        if let Some(bad) = [a, b].into_iter().find(|x| *x != ncclResult_t::ncclSuccess) {
            return Err(nccl_error(
                &nccl,
                &who,
                "query the split communicator",
                bad,
                Some(new),
            ));
        }
        Self::finish(
            nccl,
            self.ctx.clone(),
            stream,
            new,
            r as usize,
            n as usize,
            who,
            name,
            &cfg,
        )
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

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The communicator's own stream, on which [`Communicator`]'s calls run.
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
        }
    }

    /// Collectives on `stream` (of this communicator's device) instead.
    pub fn on<'a>(&'a self, stream: &'a CudaStream) -> Ops<'a> {
        Ops { comm: self, stream }
    }

    /// The communicator's asynchronous error, if NCCL reports one (`ncclCommGetAsyncError`),
    /// or why it was aborted.
    pub fn async_error(&self) -> Option<NcclError> {
        let h = self.shared.lock();
        if let Some(why) = &h.aborted {
            return Some(self.shared.aborted_error("async_error", why));
        }
        let get = match self.shared.nccl.get(
            "ncclCommGetAsyncError",
            &self.shared.nccl.raw().ncclCommGetAsyncError,
        ) {
            Ok(g) => g,
            Err(e) => return Some(e.into()),
        };
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: live communicator under its lock; valid pointer.
        let r = unsafe { get(h.comm, &mut state) };
        [r, state]
            .into_iter()
            .find(|x| *x != ncclResult_t::ncclSuccess && *x != ncclResult_t::ncclInProgress)
            .map(|x| {
                nccl_error(
                    &self.shared.nccl,
                    &self.shared.who,
                    "async_error",
                    x,
                    Some(h.comm),
                )
            })
    }

    /// Aborts the communicator (`ncclCommAbort`): work in flight is cancelled and every later
    /// call fails with [`NcclError::Aborted`].
    pub fn abort(&self) {
        let mut h = self.shared.lock();
        self.shared.abort_locked(&mut h, Abort::User);
    }

    /// Waits until everything enqueued on the communicator's stream so far has completed, or
    /// the communicator fails: never longer than its timeout (then the watchdog aborts it).
    pub fn synchronize(&self) -> Result<()> {
        self.synchronize_stream(&self.shared.stream)
    }

    /// [`Communicator::synchronize`] for another stream of this device.
    pub fn synchronize_stream(&self, stream: &CudaStream) -> Result<()> {
        self.sync_event
            .record(stream)
            .map_err(cuda(&self.shared.who, "record an event"))?;
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.sync_event.is_complete() {
                return Ok(());
            }
            if let Some(why) = &self.shared.lock().aborted {
                return Err(self.shared.aborted_error("synchronize", why));
            }
            if started.elapsed() > self.shared.timeout + WATCH_EVERY * 10 {
                // The watchdog should have acted by now; do it here.
                let mut h = self.shared.lock();
                let why = Abort::Timeout {
                    op: "synchronize".into(),
                    waited: started.elapsed(),
                };
                self.shared.abort_locked(&mut h, why.clone());
                return Err(self.shared.aborted_error("synchronize", &why));
            }
            spins += 1;
            if spins < 20_000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Starts a group: the calls made until [`Group::end`] (or the guard's drop) are fused.
    pub fn group(&self) -> Result<Group<'_>> {
        let nccl = &self.shared.nccl;
        let f = nccl.get("ncclGroupStart", &nccl.raw().ncclGroupStart)?;
        // SAFETY: ncclGroupStart takes no arguments.
        let r = unsafe { f() };
        if r != ncclResult_t::ncclSuccess {
            return Err(nccl_error(
                nccl,
                &self.shared.who,
                "ncclGroupStart",
                r,
                None,
            ));
        }
        Ok(Group {
            comm: self,
            ended: false,
        })
    }

    fn invalid(&self, op: &str, reason: String) -> NcclError {
        NcclError::InvalidArgument {
            comm: self.shared.who.clone(),
            op: op.to_string(),
            reason,
        }
    }
}

/// The watchdog: every `WATCH_EVERY`, checks NCCL's asynchronous error, and whether the work
/// enqueued on the stream keeps completing (by an event it records behind it). A communicator
/// with an error, or with work that has not completed for its whole timeout, is aborted, which
/// ends NCCL's kernels and makes every later call fail: a dead peer never hangs the process.
fn watch(shared: &Shared, ctx: &Arc<CudaContext>) {
    let marker = match ctx.new_event(None) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(comm = %shared.who, error = %e, "watchdog cannot create an event; not watching");
            return;
        }
    };
    // The enqueue count behind the marker, and when the marker was recorded.
    let mut pending: Option<(u64, Instant)> = None;
    let mut marked = 0u64;
    // A host call seen in flight: which one (by count), and since when.
    let mut stuck: Option<(u64, Instant)> = None;
    loop {
        {
            let stop = shared.stop.lock().unwrap_or_else(|p| p.into_inner());
            let (stop, _) = shared
                .wake
                .wait_timeout(stop, WATCH_EVERY)
                .unwrap_or_else(|p| p.into_inner());
            if *stop {
                return;
            }
        }
        let mut h = shared.lock();
        if h.aborted.is_some() {
            return;
        }
        if let Ok(get) = shared.nccl.get(
            "ncclCommGetAsyncError",
            &shared.nccl.raw().ncclCommGetAsyncError,
        ) {
            let mut state = ncclResult_t::ncclSuccess;
            // SAFETY: live communicator under its lock; valid pointer.
            let r = unsafe { get(h.comm, &mut state) };
            if let Some(bad) = [r, state]
                .into_iter()
                .find(|x| *x != ncclResult_t::ncclSuccess && *x != ncclResult_t::ncclInProgress)
            {
                let e = nccl_error(
                    &shared.nccl,
                    &shared.who,
                    "asynchronous error",
                    bad,
                    Some(h.comm),
                );
                shared.abort_locked(&mut h, Abort::Error(e.to_string()));
                return;
            }
        }
        // A call blocked inside NCCL for the whole timeout (a blocking communicator waiting on a
        // peer that is gone) is ended by aborting.
        if shared.in_flight.load(Ordering::Acquire) > 0 {
            let g = shared.calls.load(Ordering::Acquire);
            match stuck {
                Some((sg, since)) if sg == g && since.elapsed() > shared.timeout => {
                    let op = OP_NAMES[shared
                        .last_op
                        .load(Ordering::Relaxed)
                        .min(OP_NAMES.len() - 1)];
                    shared.abort_locked(
                        &mut h,
                        Abort::Timeout {
                            op: format!("a call after {op}"),
                            waited: since.elapsed(),
                        },
                    );
                    return;
                }
                Some((sg, _)) if sg == g => {}
                _ => stuck = Some((g, Instant::now())),
            }
        } else {
            stuck = None;
        }
        drop(h);
        match pending {
            Some((_, at)) if marker.is_complete() => {
                pending = None;
                let _ = at;
            }
            Some((_, at)) if at.elapsed() > shared.timeout => {
                let op = OP_NAMES[shared
                    .last_op
                    .load(Ordering::Relaxed)
                    .min(OP_NAMES.len() - 1)];
                let mut h = shared.lock();
                shared.abort_locked(
                    &mut h,
                    Abort::Timeout {
                        op: op.to_string(),
                        waited: at.elapsed(),
                    },
                );
                return;
            }
            Some(_) => {}
            None => {
                let n = shared.enqueued.load(Ordering::Acquire);
                if n > marked {
                    if marker.record(&shared.stream).is_ok() {
                        pending = Some((n, Instant::now()));
                    }
                    marked = n;
                }
            }
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        *self.shared.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.shared.wake.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        // A blocking communicator's finalize waits for the work in flight, which never ends if
        // a peer is gone: wait for it here, within the deadline, and abort instead if it does
        // not end.
        let limit = self.shared.timeout.min(Duration::from_secs(30));
        let drained = self.sync_event.record(&self.shared.stream).is_ok() && {
            let started = Instant::now();
            loop {
                if self.sync_event.is_complete() {
                    break true;
                }
                if started.elapsed() > limit {
                    break false;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        let mut h = self.shared.lock();
        if h.aborted.is_some() {
            return;
        }
        if !drained {
            tracing::warn!(comm = %self.shared.who, "work still in flight at drop; aborting");
            let why = Abort::Timeout {
                op: "drop".into(),
                waited: limit,
            };
            self.shared.abort_locked(&mut h, why);
            return;
        }
        let nccl = self.shared.nccl.clone();
        // Graceful: finalize (flushes outstanding work), then destroy; abort if that fails.
        let finalized = match nccl.get("ncclCommFinalize", &nccl.raw().ncclCommFinalize) {
            Ok(f) => {
                // SAFETY: live communicator under its lock.
                let r = unsafe { f(h.comm) };
                self.shared.settle(&mut h, "finalize", r).and_then(|()| {
                    self.shared.wait_ready(
                        &mut h,
                        "finalize",
                        self.shared.timeout.min(Duration::from_secs(30)),
                    )
                })
            }
            Err(e) => Err(e.into()),
        };
        if let Err(e) = finalized {
            tracing::warn!(comm = %self.shared.who, error = %e, "finalize failed; aborting");
            self.shared
                .abort_locked(&mut h, Abort::Error(e.to_string()));
            return;
        }
        if h.aborted.is_some() {
            return;
        }
        if let Ok(f) = nccl.get("ncclCommDestroy", &nccl.raw().ncclCommDestroy) {
            // SAFETY: finalized communicator, never used again.
            let _ = unsafe { f(h.comm) };
            h.aborted = Some(Abort::Error("destroyed".into()));
        }
    }
}

/// An NCCL group: calls made while it is open are fused; [`Group::end`] launches them (dropping
/// the guard ends it too, logging any error).
pub struct Group<'a> {
    comm: &'a Communicator,
    ended: bool,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({:?})", self.comm)
    }
}

impl Group<'_> {
    /// Ends the group (`ncclGroupEnd`) and waits for its launch to settle.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        self.finish()
    }

    fn finish(&self) -> Result<()> {
        let shared = &self.comm.shared;
        let f = shared
            .nccl
            .get("ncclGroupEnd", &shared.nccl.raw().ncclGroupEnd)?;
        // Outside the lock, like every call: a blocking group end that waits on a dead peer
        // can then be aborted by the watchdog.
        // SAFETY: ncclGroupEnd takes no arguments; `call` admits it only while this
        // communicator is live.
        shared.call("group end", |_| unsafe { f() })
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        if !self.ended
            && let Err(e) = self.finish()
        {
            tracing::warn!(comm = %self.comm.shared.who, error = %e, "ncclGroupEnd failed");
        }
    }
}

/// The collectives and point-to-point calls of one communicator on one stream. Every size,
/// root, peer, device and stream is checked before NCCL is called: misuse is an error with
/// nothing enqueued, never a GPU write out of bounds.
#[derive(Clone, Copy)]
pub struct Ops<'a> {
    comm: &'a Communicator,
    stream: &'a CudaStream,
}

impl std::fmt::Debug for Ops<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ops({:?})", self.comm)
    }
}

/// A reduce op as NCCL takes it; a `PreMulSum` op is created for the call and destroyed after.
struct RedOp<'a> {
    op: ncclRedOp_t,
    premul: Option<&'a Shared>,
}

impl Drop for RedOp<'_> {
    fn drop(&mut self) {
        if let Some(shared) = self.premul
            && let Ok(f) = shared
                .nccl
                .get("ncclRedOpDestroy", &shared.nccl.raw().ncclRedOpDestroy)
        {
            let h = shared.lock();
            if h.aborted.is_none() {
                // SAFETY: the op was created on this live communicator; NCCL allows destroying it
                // once the calls using it are enqueued.
                let _ = unsafe { f(self.op, h.comm) };
            }
        }
    }
}

impl<'a> Ops<'a> {
    fn shared(&self) -> &'a Shared {
        &self.comm.shared
    }

    fn invalid(&self, op: &str, reason: String) -> NcclError {
        self.comm.invalid(op, reason)
    }

    fn check_stream(&self, op: &str) -> Result<()> {
        let d = self.stream.context().ordinal();
        if d != self.comm.device {
            return Err(self.invalid(
                op,
                format!(
                    "the stream is on cuda:{d}, the communicator on cuda:{}",
                    self.comm.device
                ),
            ));
        }
        Ok(())
    }

    fn check_buf<T>(&self, op: &str, what: &str, b: &CudaSlice<T>) -> Result<()> {
        let d = b.stream().context().ordinal();
        if d != self.comm.device {
            return Err(self.invalid(
                op,
                format!(
                    "{what} is on cuda:{d}, the communicator on cuda:{}",
                    self.comm.device
                ),
            ));
        }
        Ok(())
    }

    fn check_len(&self, op: &str, what: &str, got: usize, want: usize) -> Result<()> {
        len_ok(what, got, want).map_err(|r| self.invalid(op, r))
    }

    fn check_rank(&self, op: &str, what: &str, r: usize) -> Result<i32> {
        rank_ok(what, r, self.comm.size).map_err(|e| self.invalid(op, e))
    }

    fn red_op<T: NcclType>(&self, op_name: &str, op: ReduceOp) -> Result<RedOp<'a>> {
        if let Some(code) = builtin_op(op).map_err(|e| self.invalid(op_name, e))? {
            return Ok(RedOp {
                op: ncclRedOp_t(code),
                premul: None,
            });
        }
        match op {
            ReduceOp::PreMulSum(s) => {
                let shared = self.shared();
                let f = shared.nccl.get(
                    "ncclRedOpCreatePreMulSum",
                    &shared.nccl.raw().ncclRedOpCreatePreMulSum,
                )?;
                let mut scalar = T::scalar(s).ok_or_else(|| {
                    self.invalid(op_name, format!("PreMulSum is not offered for {}", T::NAME))
                })?;
                let mut out = ncclRedOp_t(0);
                shared.call(op_name, |c| {
                    // SAFETY: the scalar is one T on the host, read during the call
                    // (host-immediate); `out` is valid; `c` is live.
                    unsafe {
                        f(
                            &mut out,
                            scalar.as_mut_ptr().cast::<c_void>(),
                            T::NCCL,
                            ncclScalarResidence_t::ncclScalarHostImmediate,
                            c,
                        )
                    }
                })?;
                Ok(RedOp {
                    op: out,
                    premul: Some(shared),
                })
            }
            other => unreachable!("builtin_op accepted {other}"),
        }
    }

    /// Runs one enqueueing call and counts it for the watchdog.
    fn enqueue<T: NcclType>(
        &self,
        op: &'static str,
        f: impl FnOnce(ncclComm_t, cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        let have = self.shared().nccl.version();
        if have < T::MIN_VERSION {
            return Err(self.invalid(
                op,
                format!(
                    "{} needs NCCL {} or newer; this is {}",
                    T::NAME,
                    dist_nccl_sys::version_string(T::MIN_VERSION),
                    dist_nccl_sys::version_string(have)
                ),
            ));
        }
        let stream = self.stream.cu_stream() as cudaStream_t;
        self.shared().call(op, |c| f(c, stream))?;
        self.shared().last_op.store(op_index(op), Ordering::Relaxed);
        self.shared().enqueued.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Reduces `send` over all ranks with `op` into `recv` (same length).
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "recv", recv.len(), send.len())?;
        let red = self.red_op::<T>(OP, op)?;
        let f = self
            .shared()
            .nccl
            .get("ncclAllReduce", &self.shared().nccl.raw().ncclAllReduce)?;
        let (s, _rs) = send.device_ptr(self.stream);
        let (r, _rr) = recv.device_ptr_mut(self.stream);
        // SAFETY: both buffers are on this device and hold `send.len()` elements of T (checked
        // above); they stay alive (borrowed) until the call is enqueued and cudarc orders later
        // uses after it (the guards record events on this stream).
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                send.len(),
                T::NCCL,
                red.op,
                c,
                st,
            )
        })
    }

    /// [`Ops::all_reduce`] in place.
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = self
            .shared()
            .nccl
            .get("ncclAllReduce", &self.shared().nccl.raw().ncclAllReduce)?;
        let n = buf.len();
        let (p, _g) = buf.device_ptr_mut(self.stream);
        // SAFETY: one buffer of `n` elements on this device, used in place as NCCL allows.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                p as *const c_void,
                p as *mut c_void,
                n,
                T::NCCL,
                red.op,
                c,
                st,
            )
        })
    }

    /// Copies `buf` on `root` into `buf` on every rank.
    pub fn broadcast<T: NcclType>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let root = self.check_rank(OP, "root", root)?;
        let f = self
            .shared()
            .nccl
            .get("ncclBroadcast", &self.shared().nccl.raw().ncclBroadcast)?;
        let n = buf.len();
        let (p, _g) = buf.device_ptr_mut(self.stream);
        // SAFETY: one buffer of `n` elements on this device, in place.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                p as *const c_void,
                p as *mut c_void,
                n,
                T::NCCL,
                root,
                c,
                st,
            )
        })
    }

    /// Reduces `send` over all ranks into `recv` on `root` (`recv` is required there, of the
    /// same length, and ignored elsewhere).
    pub fn reduce<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: Option<&mut CudaSlice<T>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "reduce";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        let root_i = self.check_rank(OP, "root", root)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = self
            .shared()
            .nccl
            .get("ncclReduce", &self.shared().nccl.raw().ncclReduce)?;
        let (s, _gs) = send.device_ptr(self.stream);
        match recv {
            Some(recv) => {
                self.check_buf(OP, "recv", recv)?;
                self.check_len(OP, "recv", recv.len(), send.len())?;
                let (r, _gr) = recv.device_ptr_mut(self.stream);
                // SAFETY: both buffers hold `send.len()` elements on this device.
                self.enqueue::<T>(OP, |c, st| unsafe {
                    f(
                        s as *const c_void,
                        r as *mut c_void,
                        send.len(),
                        T::NCCL,
                        red.op,
                        root_i,
                        c,
                        st,
                    )
                })
            }
            None if self.comm.rank == root => {
                Err(self.invalid(OP, "the root must pass a receive buffer".into()))
            }
            // SAFETY: off the root NCCL does not touch the receive buffer.
            None => self.enqueue::<T>(OP, |c, st| unsafe {
                f(
                    s as *const c_void,
                    std::ptr::null_mut(),
                    send.len(),
                    T::NCCL,
                    red.op,
                    root_i,
                    c,
                    st,
                )
            }),
        }
    }

    /// Every rank's `send` (length k) in rank order into `recv` (k × size).
    pub fn all_gather<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "recv", recv.len(), send.len() * self.comm.size)?;
        let f = self
            .shared()
            .nccl
            .get("ncclAllGather", &self.shared().nccl.raw().ncclAllGather)?;
        let (s, _gs) = send.device_ptr(self.stream);
        let (r, _gr) = recv.device_ptr_mut(self.stream);
        // SAFETY: `recv` holds size × `send.len()` elements, as NCCL writes.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                send.len(),
                T::NCCL,
                c,
                st,
            )
        })
    }

    /// Reduces `send` (k × size) over all ranks and leaves block `rank` in `recv` (k).
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "send", send.len(), recv.len() * self.comm.size)?;
        let red = self.red_op::<T>(OP, op)?;
        let f = self.shared().nccl.get(
            "ncclReduceScatter",
            &self.shared().nccl.raw().ncclReduceScatter,
        )?;
        let (s, _gs) = send.device_ptr(self.stream);
        let n = recv.len();
        let (r, _gr) = recv.device_ptr_mut(self.stream);
        // SAFETY: `send` holds size × n elements, `recv` n, on this device.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(
                s as *const c_void,
                r as *mut c_void,
                n,
                T::NCCL,
                red.op,
                c,
                st,
            )
        })
    }

    /// Block j of `send` (k × size) to rank j, landing in block `rank` of its `recv`
    /// (NCCL 2.28 or newer).
    pub fn all_to_all<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        self.check_buf(OP, "recv", recv)?;
        self.check_len(OP, "recv", recv.len(), send.len())?;
        if !send.len().is_multiple_of(self.comm.size) {
            return Err(self.invalid(
                OP,
                format!(
                    "{} elements do not split into {} equal blocks",
                    send.len(),
                    self.comm.size
                ),
            ));
        }
        let f = self
            .shared()
            .nccl
            .get("ncclAlltoAll", &self.shared().nccl.raw().ncclAlltoAll)?;
        let k = send.len() / self.comm.size;
        let (s, _gs) = send.device_ptr(self.stream);
        let (r, _gr) = recv.device_ptr_mut(self.stream);
        // SAFETY: both buffers hold size × k elements on this device.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(s as *const c_void, r as *mut c_void, k, T::NCCL, c, st)
        })
    }

    /// Every rank's `send` (k) in rank order into `recv` (k × size) on `root` (NCCL 2.28+).
    pub fn gather<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: Option<&mut CudaSlice<T>>,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "gather";
        self.check_stream(OP)?;
        self.check_buf(OP, "send", send)?;
        let root_i = self.check_rank(OP, "root", root)?;
        let f = self
            .shared()
            .nccl
            .get("ncclGather", &self.shared().nccl.raw().ncclGather)?;
        let (s, _gs) = send.device_ptr(self.stream);
        match recv {
            Some(recv) => {
                self.check_buf(OP, "recv", recv)?;
                self.check_len(OP, "recv", recv.len(), send.len() * self.comm.size)?;
                let (r, _gr) = recv.device_ptr_mut(self.stream);
                // SAFETY: `recv` holds size × `send.len()` elements on this device.
                self.enqueue::<T>(OP, |c, st| unsafe {
                    f(
                        s as *const c_void,
                        r as *mut c_void,
                        send.len(),
                        T::NCCL,
                        root_i,
                        c,
                        st,
                    )
                })
            }
            None if self.comm.rank == root => {
                Err(self.invalid(OP, "the root must pass a receive buffer".into()))
            }
            // SAFETY: off the root NCCL does not touch the receive buffer.
            None => self.enqueue::<T>(OP, |c, st| unsafe {
                f(
                    s as *const c_void,
                    std::ptr::null_mut(),
                    send.len(),
                    T::NCCL,
                    root_i,
                    c,
                    st,
                )
            }),
        }
    }

    /// Block r of `send` (k × size) on `root` into rank r's `recv` (k) (NCCL 2.28+).
    pub fn scatter<T: NcclType>(
        &self,
        send: Option<&CudaSlice<T>>,
        recv: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "scatter";
        self.check_stream(OP)?;
        self.check_buf(OP, "recv", recv)?;
        let root_i = self.check_rank(OP, "root", root)?;
        let f = self
            .shared()
            .nccl
            .get("ncclScatter", &self.shared().nccl.raw().ncclScatter)?;
        let n = recv.len();
        let (r, _gr) = recv.device_ptr_mut(self.stream);
        match send {
            Some(send) => {
                self.check_buf(OP, "send", send)?;
                self.check_len(OP, "send", send.len(), n * self.comm.size)?;
                let (s, _gs) = send.device_ptr(self.stream);
                // SAFETY: `send` holds size × n elements, `recv` n, on this device.
                self.enqueue::<T>(OP, |c, st| unsafe {
                    f(
                        s as *const c_void,
                        r as *mut c_void,
                        n,
                        T::NCCL,
                        root_i,
                        c,
                        st,
                    )
                })
            }
            None if self.comm.rank == root => {
                Err(self.invalid(OP, "the root must pass a send buffer".into()))
            }
            // SAFETY: off the root NCCL does not read the send buffer.
            None => self.enqueue::<T>(OP, |c, st| unsafe {
                f(
                    std::ptr::null(),
                    r as *mut c_void,
                    n,
                    T::NCCL,
                    root_i,
                    c,
                    st,
                )
            }),
        }
    }

    /// Sends `buf` to `peer`, which must post a matching [`Ops::recv`].
    pub fn send<T: NcclType>(&self, buf: &CudaSlice<T>, peer: usize) -> Result<()> {
        const OP: &str = "send";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = self
            .shared()
            .nccl
            .get("ncclSend", &self.shared().nccl.raw().ncclSend)?;
        let (p, _g) = buf.device_ptr(self.stream);
        // SAFETY: `buf` holds `buf.len()` elements on this device.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(p as *const c_void, buf.len(), T::NCCL, peer, c, st)
        })
    }

    /// Receives into `buf` from `peer`.
    pub fn recv<T: NcclType>(&self, buf: &mut CudaSlice<T>, peer: usize) -> Result<()> {
        const OP: &str = "recv";
        self.check_stream(OP)?;
        self.check_buf(OP, "buffer", buf)?;
        let peer = self.check_rank(OP, "peer", peer)?;
        let f = self
            .shared()
            .nccl
            .get("ncclRecv", &self.shared().nccl.raw().ncclRecv)?;
        let n = buf.len();
        let (p, _g) = buf.device_ptr_mut(self.stream);
        // SAFETY: `buf` holds n elements on this device.
        self.enqueue::<T>(OP, |c, st| unsafe {
            f(p as *mut c_void, n, T::NCCL, peer, c, st)
        })
    }
}

/// `got` elements where `want` are needed, or why not.
fn len_ok(what: &str, got: usize, want: usize) -> std::result::Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what} has {got} elements, expected {want}"))
    }
}

/// A rank (root or peer) in `0..size`, as NCCL's `int`.
fn rank_ok(what: &str, r: usize, size: usize) -> std::result::Result<i32, String> {
    if r < size && r <= i32::MAX as usize {
        Ok(r as i32)
    } else {
        Err(format!("{what} {r} is out of range for {size} ranks"))
    }
}

/// NCCL's code for a built-in op; `None` for `PreMulSum`, which is created per call; an error
/// for the ops NCCL does not have.
fn builtin_op(op: ReduceOp) -> std::result::Result<Option<u32>, String> {
    match op {
        ReduceOp::Sum => Ok(Some(0)),
        ReduceOp::Prod => Ok(Some(1)),
        ReduceOp::Max => Ok(Some(2)),
        ReduceOp::Min => Ok(Some(3)),
        ReduceOp::Avg => Ok(Some(4)),
        ReduceOp::PreMulSum(_) => Ok(None),
        other => Err(format!("NCCL has no reduce op {}", other.name())),
    }
}

/// Communicator-level shorthands for the calls on its own stream.
macro_rules! on_own_stream {
    ($($(#[$m:meta])* fn $name:ident<T>($($arg:ident: $ty:ty),*);)*) => {
        impl Communicator {
            $(
                $(#[$m])*
                pub fn $name<T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    self.ops().$name($($arg),*)
                }
            )*
        }
    };
}

on_own_stream! {
    /// [`Ops::all_reduce`] on the communicator's stream.
    fn all_reduce<T>(send: &CudaSlice<T>, recv: &mut CudaSlice<T>, op: ReduceOp);
    /// [`Ops::all_reduce_in_place`] on the communicator's stream.
    fn all_reduce_in_place<T>(buf: &mut CudaSlice<T>, op: ReduceOp);
    /// [`Ops::broadcast`] on the communicator's stream.
    fn broadcast<T>(buf: &mut CudaSlice<T>, root: usize);
    /// [`Ops::reduce`] on the communicator's stream.
    fn reduce<T>(send: &CudaSlice<T>, recv: Option<&mut CudaSlice<T>>, op: ReduceOp, root: usize);
    /// [`Ops::all_gather`] on the communicator's stream.
    fn all_gather<T>(send: &CudaSlice<T>, recv: &mut CudaSlice<T>);
    /// [`Ops::reduce_scatter`] on the communicator's stream.
    fn reduce_scatter<T>(send: &CudaSlice<T>, recv: &mut CudaSlice<T>, op: ReduceOp);
    /// [`Ops::all_to_all`] on the communicator's stream.
    fn all_to_all<T>(send: &CudaSlice<T>, recv: &mut CudaSlice<T>);
    /// [`Ops::gather`] on the communicator's stream.
    fn gather<T>(send: &CudaSlice<T>, recv: Option<&mut CudaSlice<T>>, root: usize);
    /// [`Ops::scatter`] on the communicator's stream.
    fn scatter<T>(send: Option<&CudaSlice<T>>, recv: &mut CudaSlice<T>, root: usize);
    /// [`Ops::send`] on the communicator's stream.
    fn send<T>(buf: &CudaSlice<T>, peer: usize);
    /// [`Ops::recv`] on the communicator's stream.
    fn recv<T>(buf: &mut CudaSlice<T>, peer: usize);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_is_128_bytes_and_round_trips() {
        let mut b = [0u8; 128];
        b[0] = 0xff;
        b[127] = 7;
        let id = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(id.as_bytes(), &b);
        let raw = id.raw();
        // Bytes travel unchanged whatever the sign of c_char on this target.
        assert_eq!(raw.internal[0] as u8, 0xff);
        assert_eq!(raw.internal[127] as u8, 7);
        let e = UniqueId::from_bytes(&b[..100]).unwrap_err();
        assert!(e.to_string().contains("100 bytes, expected 128"), "{e}");
    }

    #[test]
    fn argument_checks_without_a_gpu() {
        assert_eq!(len_ok("recv", 20, 20), Ok(()));
        assert_eq!(
            len_ok("recv", 21, 20).unwrap_err(),
            "recv has 21 elements, expected 20"
        );
        assert_eq!(rank_ok("root", 1, 2), Ok(1));
        assert_eq!(
            rank_ok("peer", 2, 2).unwrap_err(),
            "peer 2 is out of range for 2 ranks"
        );
        assert_eq!(builtin_op(ReduceOp::Min), Ok(Some(3)));
        assert_eq!(builtin_op(ReduceOp::Avg), Ok(Some(4)));
        assert_eq!(builtin_op(ReduceOp::PreMulSum(0.5)), Ok(None));
        assert_eq!(
            builtin_op(ReduceOp::BitXor).unwrap_err(),
            "NCCL has no reduce op bxor"
        );
        // The values NCCL's header gives these ops.
        assert_eq!(dist_nccl_sys::ncclRedOp_t::ncclMin.0, 3);
        assert_eq!(dist_nccl_sys::ncclRedOp_t::ncclAvg.0, 4);
    }

    #[test]
    fn op_names_index_back() {
        for (i, n) in OP_NAMES.iter().enumerate() {
            assert_eq!(op_index(n), i);
        }
        assert_eq!(op_index("nope"), 0);
    }
}

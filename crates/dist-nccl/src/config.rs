//! How a communicator is made: [`CommConfig`], NCCL's `ncclConfig_t` built from it, and the
//! stream its calls go on.
//!
//! NCCL keeps the pointers of a config's strings, not copies (`comm->config.commName =
//! config->commName` in NCCL's `init.cc`; a profiler plugin is handed the name at init, and the
//! communicator's thread may still be initialising after a deadline made dist give up on it).
//! So every string a config points to lives for the rest of the process: [`config`] takes the
//! name from the [`CommConfig`] and points at an interned copy (`&'static CStr`), one per
//! distinct name, never freed; no caller hands NCCL a string of its own.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use dist_nccl_sys::ncclConfig_t;

/// Says once per process, at info level, when NCCL will connect collectives inside their first
/// call (`NCCL_RUNTIME_CONNECT` not `0`): such a call waits inside NCCL for every peer, and a
/// peer that never makes it cannot be aborted under it (see `connect.rs`).
pub(crate) fn runtime_connect_note() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var("NCCL_RUNTIME_CONNECT").map_or(true, |v| v.trim() != "0") {
            tracing::info!(
                "NCCL_RUNTIME_CONNECT is not 0: NCCL connects each collective algorithm inside \
                 its first call, where a peer that never makes that call holds the caller; set \
                 NCCL_RUNTIME_CONNECT=0 to connect while communicators form"
            );
        }
    });
}

/// The stream a communicator's calls go on (see [`CommConfig::own_stream`]).
pub(crate) fn comm_stream(
    ctx: &Arc<CudaContext>,
    cfg: &CommConfig,
) -> std::result::Result<Arc<CudaStream>, cudarc::driver::DriverError> {
    if cfg.own_stream {
        ctx.new_stream()
    } else {
        Ok(ctx.default_stream())
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
    /// Give the communicator a stream of its own (created with it; the default). Calls then
    /// overlap with work on the context's default stream, and the watchdog watches only this
    /// communicator's work; but the context has two streams, which puts cudarc in multi-stream
    /// mode: every use of a buffer (every call's, and every kernel's on it) then waits on and
    /// records cudarc events (stream commands; `docs/benchmarks.md` measures them). `false`:
    /// the calls go on the context's default stream, where a program that uses that one stream
    /// pays none of this; the watchdog then watches that stream as a whole, so a kernel of
    /// yours (or another communicator's work) queued there within a few milliseconds after a
    /// call counts toward this communicator's timeout.
    pub own_stream: bool,
    /// Connect every pair of ranks while the communicator forms (within `init_timeout`), so
    /// that no later call connects: NCCL otherwise connects two ranks inside the first call
    /// between them, and a blocking call waiting there for a peer that never calls cannot be
    /// ended (see `connect.rs`). On by default; a large job that does not want a connection per
    /// pair of ranks turns it off. Collectives' rings and trees are connected at init by NCCL
    /// itself when `NCCL_RUNTIME_CONNECT=0` is set (see the guide).
    pub connect_peers: bool,
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
            own_stream: true,
            connect_peers: true,
        }
    }
}

/// The name NCCL is given for `name` (NULs replaced by spaces): a copy that lives for the rest
/// of the process, one per distinct name (interned), so that NCCL may keep the pointer.
pub(crate) fn nccl_name(name: &str) -> &'static CStr {
    static NAMES: Mutex<Option<HashSet<&'static CStr>>> = Mutex::new(None);
    let owned = CString::new(name.replace('\0', " ")).expect("NULs replaced");
    let mut names = NAMES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let names = names.get_or_insert_with(HashSet::new);
    if let Some(kept) = names.get(owned.as_c_str()) {
        return kept;
    }
    let kept: &'static CStr = Box::leak(owned.into_boxed_c_str());
    names.insert(kept);
    kept
}

/// NCCL's config for a communicator made with `cfg` from a library of `version`. Its only
/// pointer (`commName`, null without [`CommConfig::name`]) points at [`nccl_name`]'s copy,
/// which outlives every communicator; `netName` stays null.
pub(crate) fn config(version: i32, cfg: &CommConfig, blocking: bool) -> ncclConfig_t {
    const HEADER: i32 = dist_nccl_sys::NCCL_VERSION_CODE as i32;
    const UNDEF: i32 = i32::MIN;
    let name = cfg.name.as_deref().map(nccl_name);
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        // The struct's version is the older of the header's and the library's, so that an
        // older NCCL reads only the fields it knows.
        version: version.min(HEADER) as u32,
        blocking: i32::from(blocking),
        cgaClusterSize: UNDEF,
        minCTAs: cfg.min_ctas.unwrap_or(UNDEF),
        maxCTAs: cfg.max_ctas.unwrap_or(UNDEF),
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: name.map_or(std::ptr::null(), CStr::as_ptr),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dist_nccl_sys::version_code;

    /// The name a config points to outlives the `CommConfig` it came from and everything the
    /// caller built it with: NCCL keeps the pointer for the communicator's life (before, the
    /// caller passed a `CString` of its own, and `split_raw` dropped its copy at return while
    /// the child communicator kept pointing at it).
    #[test]
    fn the_name_outlives_everything_the_caller_made() {
        let conf = {
            let cfg = CommConfig {
                name: Some(format!("child\0of {}", 7)),
                ..CommConfig::default()
            };
            config(version_code(2, 28, 9), &cfg, false)
        };
        // Allocate and drop strings of the same size meanwhile, so that a freed copy would
        // likely have been overwritten.
        let noise: Vec<String> = (0..1000).map(|i| format!("xxxxxxxxxx{i:04}")).collect();
        drop(noise);
        assert!(!conf.commName.is_null());
        // SAFETY: `commName` points at `nccl_name`'s interned copy, which is never freed.
        let name = unsafe { CStr::from_ptr(conf.commName) };
        assert_eq!(name.to_str().unwrap(), "child of 7");
        // One copy per distinct name: the same pointer again, however often it is asked for.
        let again = config(
            version_code(2, 28, 9),
            &CommConfig {
                name: Some("child of 7".into()),
                ..CommConfig::default()
            },
            true,
        );
        assert_eq!(again.commName, conf.commName);
        assert_ne!(nccl_name("another").as_ptr(), conf.commName);
        // No name, no pointer; the version is capped at the header's.
        let plain = config(version_code(2, 31, 0), &CommConfig::default(), true);
        assert!(plain.commName.is_null() && plain.netName.is_null());
        assert_eq!(plain.version, version_code(2, 29, 2) as u32);
        // An older library is told its own version, so that it reads only what it knows.
        let older = config(version_code(2, 28, 9), &CommConfig::default(), true);
        assert_eq!(older.version, version_code(2, 28, 9) as u32);
    }
}

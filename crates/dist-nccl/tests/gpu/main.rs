//! dist-nccl on one GPU, one rank: every call on a stream the caller owns, between the
//! caller's own kernels (`stream.rs`), and recorded into CUDA graphs and replayed
//! (`graph.rs`), revoked (`revoke.rs`) and shrunk (`shrink.rs`). Each case runs twice where it matters: with cudarc's event tracking (the
//! default) and without it, where only the stream orders the work. Where no CUDA device or no
//! NCCL is found, every case is reported ignored after "skipped: <reason>", never passed.
//!
//! Release binary: `cargo test --release -p dist-nccl --test gpu --no-run` builds it; run it
//! with `--test-threads 1` or without (the harness runs one case at a time), NCCL found through
//! `DIST_NCCL_LIBRARY` or the system's `libnccl.so.2`. A case that needs a newer NCCL than the
//! one loaded, or more GPUs than there are, is reported ignored after "skipped: <case>:
//! <reason>".

// A test binary: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod calls;
mod graph;
mod kernel;
mod revoke;
mod shrink;
mod stream;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::CudaContext;
use dist_nccl::{CommConfig, Communicator, Nccl, UniqueId};
use libtest_mimic::{Arguments, Trial};

use kernel::Kernels;

/// A one-rank communicator on GPU 0, its context and the caller's kernels loaded there.
#[allow(missing_debug_implementations, reason = "a test fixture")]
pub struct Rig {
    pub ctx: Arc<CudaContext>,
    pub comm: Communicator,
    pub k: Kernels,
}

pub fn nccl() -> Arc<Nccl> {
    static NCCL: OnceLock<Arc<Nccl>> = OnceLock::new();
    NCCL.get_or_init(|| Arc::new(Nccl::load().expect("NCCL loads (checked before the cases)")))
        .clone()
}

/// With `tracked` false, the context orders nothing with events: only stream order does.
pub fn rig(tracked: bool, timeout: Duration) -> Rig {
    let ctx = CudaContext::new(0).unwrap();
    if !tracked {
        // SAFETY: every buffer of an untracked case is allocated after this and used on one
        // stream only (the case's), or, for a buffer a call reads on another stream, after a
        // synchronize of the stream that wrote it; nothing else shares this context object.
        unsafe { ctx.disable_event_tracking() };
    }
    let nccl = nccl();
    let id = UniqueId::new(&nccl).unwrap();
    let cfg = CommConfig {
        timeout,
        ..CommConfig::default()
    };
    let comm = Communicator::init_rank(nccl, &ctx, 0, 1, &id, cfg).unwrap();
    let k = Kernels::load(&ctx);
    Rig { ctx, comm, k }
}

/// A one-rank communicator on GPU 0 from `nccl` (the loaded library, or one
/// [`Nccl::limited_to`] an older version) with `cfg`, and the caller's kernels.
pub fn rig_with(nccl: Arc<Nccl>, cfg: CommConfig) -> Result<Rig, String> {
    let ctx = CudaContext::new(0).map_err(|e| format!("context: {e}"))?;
    let id = UniqueId::new(&nccl).map_err(|e| format!("unique id: {e}"))?;
    let comm =
        Communicator::init_rank(nccl, &ctx, 0, 1, &id, cfg).map_err(|e| format!("init: {e}"))?;
    let k = Kernels::load(&ctx);
    Ok(Rig { ctx, comm, k })
}

/// The NCCL a case needs (a version code) and the GPUs.
#[derive(Clone, Copy, Debug)]
pub struct Need {
    pub nccl: i32,
    pub gpus: usize,
}

/// Any NCCL this crate runs on, one GPU.
const ANY: Need = Need { nccl: 0, gpus: 1 };

/// Why a case that needs `need` cannot run here, if it cannot.
fn lacking(need: Need) -> Option<String> {
    let have = Nccl::load().ok()?.version();
    if have < need.nccl {
        return Some(format!(
            "needs NCCL {} or newer, the one loaded is {}",
            dist_nccl_sys::version_string(need.nccl),
            dist_nccl_sys::version_string(have)
        ));
    }
    let gpus = dist_nccl::cuda_device_count();
    (gpus < need.gpus).then(|| format!("needs {} GPUs, {gpus} here", need.gpus))
}

/// Why the cases cannot run here, if they cannot.
fn unusable() -> Option<String> {
    if dist_nccl::cuda_device_count() == 0 {
        return Some("no CUDA device".into());
    }
    if let Err(e) = Nccl::load() {
        return Some(format!("NCCL does not load: {e}"));
    }
    None
}

fn main() -> std::process::ExitCode {
    let mut args = Arguments::from_args();
    // One case at a time: the timing of the ordering and timeout cases assumes an idle GPU.
    args.test_threads = Some(1);
    type Case = fn() -> Result<(), String>;
    let mut cases: Vec<(&str, Case)> = vec![
        ("callers_stream_orders_every_call", || {
            stream::every_call(true)
        }),
        ("callers_stream_orders_every_call_untracked", || {
            stream::every_call(false)
        }),
        ("graph_replays_every_call", || graph::every_call(true)),
        ("graph_replays_every_call_untracked", || {
            graph::every_call(false)
        }),
        ("graph_group_of_send_and_recv", graph::group_send_recv),
        ("graph_refuses_what_it_cannot_capture", graph::refusals),
        (
            "graph_captured_right_after_eager_calls",
            graph::after_eager_calls,
        ),
        ("graph_replay_bounded_by_the_timeout", graph::bounded_replay),
        (
            "shrink_refuses_bad_lists_leaving_the_communicator_working",
            shrink::refusals,
        ),
    ];
    let revoke_nccl = Need {
        nccl: dist_nccl_sys::introduced("ncclCommRevoke").unwrap_or(i32::MAX),
        gpus: 1,
    };
    // Recovery: revoke, shrink, and the versions they need.
    let recovery: Vec<(&str, Case, Need)> = vec![
        (
            "revoke_ends_pending_and_later_calls",
            revoke::ends_pending_and_later_calls,
            ANY,
        ),
        (
            "revoke_with_an_older_nccl_aborts_and_can_still_shrink",
            revoke::older_nccl_aborts,
            ANY,
        ),
        (
            "shrink_of_one_rank_excluding_nobody",
            shrink::excluding_nobody,
            ANY,
        ),
        ("shrink_after_revoke", || shrink::after_revoke(false), ANY),
        (
            "shrink_after_revoke_nonblocking_calls",
            || shrink::after_revoke(true),
            revoke_nccl,
        ),
        ("shrink_after_a_timeout", shrink::after_timeout, ANY),
        (
            "shrink_after_an_abort_that_freed_the_only_handle",
            shrink::after_abort_without_kept_handle,
            ANY,
        ),
        (
            "shrink_refuses_what_an_older_nccl_lacks",
            shrink::older_nccl_refused,
            Need {
                nccl: dist_nccl_sys::introduced("ncclCommShrink").unwrap_or(i32::MAX),
                gpus: 1,
            },
        ),
        (
            "shrink_leaving_out_a_rank_that_never_calls",
            shrink::leaving_out_a_rank,
            Need {
                nccl: dist_nccl_sys::introduced("ncclCommShrink").unwrap_or(i32::MAX),
                gpus: 2,
            },
        ),
    ];
    let skip = unusable();
    if let Some(why) = &skip
        && !args.list
    {
        eprintln!("skipped: {why}: every GPU case is ignored here");
    }
    let mut needs: Vec<Need> = vec![ANY; cases.len()];
    for (name, case, need) in recovery {
        cases.push((name, case));
        needs.push(need);
    }
    let trials = cases
        .into_iter()
        .zip(needs)
        .map(|((name, case), need)| {
            let lacks = if skip.is_some() { None } else { lacking(need) };
            if let Some(why) = &lacks
                && !args.list
            {
                eprintln!("skipped: {name}: {why}");
            }
            Trial::test(name, move || case().map_err(Into::into))
                .with_ignored_flag(skip.is_some() || lacks.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

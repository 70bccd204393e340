//! dist-nccl on one GPU, one rank: every call on a stream the caller owns, between the
//! caller's own kernels (`stream.rs`), and recorded into CUDA graphs and replayed
//! (`graph.rs`), and shrunk (`shrink.rs`). Each case runs twice where it matters: with cudarc's event tracking (the
//! default) and without it, where only the stream orders the work. Where no CUDA device or no
//! NCCL is found, every case is reported ignored after "skipped: <reason>", never passed.
//!
//! Release binary: `cargo test --release -p dist-nccl --test gpu --no-run` builds it; run it
//! with `--test-threads 1` or without (the harness runs one case at a time), NCCL found through
//! `DIST_NCCL_LIBRARY` or the system's `libnccl.so.2`.

// A test binary: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod calls;
mod graph;
mod kernel;
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

fn nccl() -> Arc<Nccl> {
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
    let cases: Vec<(&str, Case)> = vec![
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
    let skip = unusable();
    if let Some(why) = &skip
        && !args.list
    {
        eprintln!("skipped: {why}: every GPU case is ignored here");
    }
    let trials = cases
        .into_iter()
        .map(|(name, case)| {
            Trial::test(name, move || case().map_err(Into::into)).with_ignored_flag(skip.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

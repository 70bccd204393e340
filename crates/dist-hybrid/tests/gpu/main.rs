//! `HybridBackend`'s CUDA graphs on one GPU, one rank (`HybridBackend::capture`): every
//! device collective and a send/receive pair captured and replayed with the right result after
//! each replay, the record of the captured calls and of each replay, what a capture refuses,
//! and a replay that hangs, ended by the NCCL timeout with the hybrid's timeout error; and a
//! recovery of the one rank, whose NCCL side is shrunk (`recover.rs`). Where no
//! CUDA device or no NCCL is found, every case is reported ignored after "skipped: <reason>",
//! never passed.
//!
//! Release binary: `cargo test --release -p dist-hybrid --test gpu --no-run` builds it; the
//! harness runs one case at a time; NCCL found through `DIST_NCCL_LIBRARY` or the system's
//! `libnccl.so.2`.

// A test binary: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

#[allow(
    dead_code,
    reason = "the caller's kernels of dist-nccl's GPU cases; these cases use the spinning one"
)]
#[path = "../../../dist-nccl/tests/gpu/kernel.rs"]
mod kernel;
mod recover;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use dist_core::ReduceOp;
use dist_core::flight::OpState;
use dist_hybrid::{GpuChoice, HybridBackend, HybridError};
use dist_nccl::{CommConfig, Nccl};
use dist_tcp::TcpBackend;
use libtest_mimic::{Arguments, Trial};

/// Elements a buffer.
const K: usize = 8;

/// A job of one rank with NCCL on GPU 0, whose NCCL work times out after `timeout`.
fn one_rank(timeout: Duration) -> Result<HybridBackend, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("a free port: {e}"))?
        .port();
    let tcp = TcpBackend::with_config(
        TcpBackend::builder(0, 1, format!("127.0.0.1:{port}"))
            .init_timeout(Duration::from_secs(20))
            .timeout(Duration::from_secs(20)),
    )
    .map_err(|e| format!("tcp: {e}"))?;
    let cfg = CommConfig {
        timeout,
        ..CommConfig::default()
    };
    HybridBackend::with_nccl(tcp, 0, GpuChoice::Device(0), None, cfg)
        .map_err(|e| format!("hybrid with NCCL: {e}"))
}

fn h(what: &str) -> impl Fn(HybridError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn d(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn expect(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, HybridError>) -> Result<(), String> {
    match r {
        Err(e) if e.to_string().contains("capturing a CUDA graph") => Ok(()),
        other => Err(format!(
            "{what} inside a capture: want it refused, got {other:?}"
        )),
    }
}

/// Every device collective in one graph, chained so that each reads what the one before it
/// wrote, the first doubling its buffer (`PreMulSum(2)` at one rank): after r replays every
/// buffer holds the input × 2^r. A send/receive pair to itself ends the graph. The record
/// holds each captured collective (done at the capture's end) and each replay as one call.
fn replays_every_call() -> Result<(), String> {
    let hy = one_rank(Duration::from_secs(30))?;
    let s = hy.nccl().ok_or("no NCCL")?.stream().clone();
    let x0: Vec<f32> = (0..K).map(|j| 1.0 + j as f32).collect();
    let a = s.clone_htod(&x0).map_err(d("a"))?;
    let zeros = || s.alloc_zeros::<f32>(K).map_err(d("alloc"));
    let (g, rs, red, at, ga, sc, agv) = (
        zeros()?,
        zeros()?,
        zeros()?,
        zeros()?,
        zeros()?,
        zeros()?,
        zeros()?,
    );
    let mut sr = zeros()?;
    let before = hy.nccl_flight().ok_or("no record")?.snapshot().len();
    {
        let graph = hy
            .capture(|cap| {
                cap.all_reduce_in_place(&a, ReduceOp::PreMulSum(2.0))?;
                cap.all_gather(&a, &g)?;
                cap.reduce_scatter(&g, &rs, ReduceOp::Sum)?;
                cap.reduce(&rs, Some(&red), ReduceOp::Sum, 0)?;
                cap.broadcast(&red, 0)?;
                cap.all_to_all(&red, &at)?;
                cap.gather(&at, Some(&ga), 0)?;
                cap.scatter(Some(&ga), &sc, 0)?;
                cap.all_gather_v(&sc, &agv, &[K])?;
                cap.send_recv(&agv, 0, &mut sr, 0)
            })
            .map_err(h("capture"))?;
        expect(graph.calls() == 9, || {
            format!("{} collectives counted, 9 captured", graph.calls())
        })?;
        let check = |replays: i32| -> Result<(), String> {
            let want: Vec<f32> = x0.iter().map(|x| x * 2f32.powi(replays)).collect();
            for (name, buf) in [
                ("all_reduce", &a),
                ("all_gather", &g),
                ("reduce_scatter", &rs),
                ("reduce+broadcast", &red),
                ("all_to_all", &at),
                ("gather", &ga),
                ("scatter", &sc),
                ("all_gather_v", &agv),
            ] {
                // On the graph's stream: after the replays enqueued there.
                let got = s.clone_dtoh(buf).map_err(d("read"))?;
                expect(got == want, || {
                    format!("{name} after {replays} replays: got {got:?}, want {want:?}")
                })?;
            }
            Ok(())
        };
        for r in 1..=3 {
            graph.launch().map_err(h("launch"))?;
            check(r)?;
        }
        for _ in 0..4 {
            graph.launch().map_err(h("launch"))?;
        }
        graph.synchronize().map_err(h("graph synchronize"))?;
        check(7)?;
    }
    let got = s.clone_dtoh(&sr).map_err(d("read sr"))?;
    let want: Vec<f32> = x0.iter().map(|x| x * 128.0).collect();
    expect(got == want, || {
        format!("send_recv after 7 replays: got {got:?}, want {want:?}")
    })?;

    // The record: 9 captured collectives (seq 1..=9) and 2 captured point-to-point calls, all
    // done; then 7 replays (seq 10..=16), each `graph calls x 9`, done after the synchronize.
    let recs = hy.nccl_flight().ok_or("no record")?.snapshot();
    let ours = &recs[before..];
    let shape: Vec<(u64, &str, usize, OpState)> = ours
        .iter()
        .map(|r| (r.info.seq, r.info.op, r.info.count, r.state))
        .collect();
    expect(ours.len() == 18, || format!("record: {shape:?}"))?;
    for (i, r) in ours[..9].iter().enumerate() {
        expect(
            r.info.seq == i as u64 + 1 && r.state == OpState::Done,
            || format!("captured call {i}: {shape:?}"),
        )?;
    }
    for r in &ours[9..11] {
        expect(r.info.seq == 0 && r.state == OpState::Done, || {
            format!("captured send/recv: {shape:?}")
        })?;
    }
    for (i, r) in ours[11..].iter().enumerate() {
        expect(
            r.info.seq == 10 + i as u64
                && r.info.op == "graph"
                && r.info.dtype == "calls"
                && r.info.count == 9
                && r.state == OpState::Done,
            || format!("replay {i}: {shape:?}"),
        )?;
    }

    // Eager calls go on, numbered after the replays.
    let mut x = s.clone_htod(&x0).map_err(d("x"))?;
    hy.all_reduce(&mut x, ReduceOp::Sum)
        .map_err(h("eager after"))?;
    hy.synchronize_nccl().map_err(h("synchronize"))?;
    let last = hy.nccl_flight().ok_or("no record")?.snapshot();
    let last = last.last().ok_or("no record")?;
    expect(last.info.seq == 17 && last.info.op == "all_reduce", || {
        format!("the eager call after: {last:?}")
    })
}

/// Inside a capture the backend's own device calls, its async calls and its synchronize are
/// refused (the capture goes on and replays); an error inside the closure ends the capture
/// and is returned, and the backend's calls work after it.
fn refusals() -> Result<(), String> {
    let hy = one_rank(Duration::from_secs(30))?;
    let s = hy.nccl().ok_or("no NCCL")?.stream().clone();
    let z = s.clone_htod(&[3.0f32; K]).map_err(d("z"))?;
    let mut y = s.clone_htod(&[1.0f32; K]).map_err(d("y"))?;
    let short: CudaSlice<f32> = s.alloc_zeros(K - 1).map_err(d("short"))?;
    let mut inside = Vec::new();
    let graph = hy
        .capture(|cap| {
            inside.push(("all_reduce", hy.all_reduce(&mut y, ReduceOp::Sum).map(drop)));
            inside.push(("synchronize_nccl", hy.synchronize_nccl()));
            inside.push((
                "all_reduce_async",
                hy.all_reduce_async(&mut y, ReduceOp::Sum).map(drop),
            ));
            cap.all_reduce_in_place(&z, ReduceOp::PreMulSum(2.0))
        })
        .map_err(h("capture"))?;
    for (what, r) in inside {
        refused(what, r)?;
    }
    graph.replay().map_err(h("replay"))?;
    drop(graph);
    let got = s.clone_dtoh(&z).map_err(d("read"))?;
    expect(got == [6.0; K], || format!("replayed once: {got:?}"))?;

    let failed = hy.capture(|cap| cap.all_reduce(&z, &short, ReduceOp::Sum));
    match failed {
        Err(e) if e.to_string().contains("recv") => {}
        other => return Err(format!("a bad call inside a capture: {other:?}")),
    }
    hy.all_reduce(&mut y, ReduceOp::Sum)
        .map_err(h("a call after the failed capture"))?;
    hy.synchronize_nccl().map_err(h("synchronize"))?;
    let got = s.clone_dtoh(&y).map_err(d("read y"))?;
    expect(got == [1.0; K], || format!("y: {got:?}"))
}

/// A replay whose work does not complete (the caller's kernel, captured before the call,
/// spins for 4 s) ends at the NCCL timeout (1 s) with the hybrid's timeout error, and the
/// record marks the replay failed.
fn bounded_replay() -> Result<(), String> {
    let hy = one_rank(Duration::from_secs(1))?;
    let comm = hy.nccl().ok_or("no NCCL")?;
    let s = comm.stream().clone();
    let k = kernel::Kernels::load(comm.context());
    let a = s.clone_htod(&[1.0f32; K]).map_err(d("a"))?;
    hy.synchronize_nccl().map_err(h("synchronize"))?;
    let graph = hy
        .capture(|cap| {
            // SAFETY: no element is written (n = 0): the kernel only spins.
            unsafe { k.spin_fill_raw(cap.stream(), 0, 0, 0.0, 4_000_000_000) };
            cap.all_reduce_in_place(&a, ReduceOp::Sum)
        })
        .map_err(h("capture"))?;
    graph.launch().map_err(h("launch"))?;
    let t0 = Instant::now();
    let waited = graph.synchronize();
    let took = t0.elapsed();
    expect(
        matches!(waited, Err(HybridError::NcclTimeout { .. })),
        || format!("want the hybrid's NCCL timeout, got {waited:?}"),
    )?;
    expect(took < Duration::from_millis(2500), || {
        format!("the timeout took {took:?} (the kernel spins 4 s)")
    })?;
    let recs = hy.nccl_flight().ok_or("no record")?.snapshot();
    let replay = recs.iter().rev().find(|r| r.info.op == "graph");
    expect(replay.is_some_and(|r| r.state == OpState::Failed), || {
        format!("the replay's record: {replay:?}")
    })?;
    expect(graph.launch().is_err(), || {
        "a launch after the timeout was not refused".into()
    })
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
    // One case at a time: the timeout case assumes an idle GPU.
    args.test_threads = Some(1);
    type Case = fn() -> Result<(), String>;
    let cases: Vec<(&str, Case)> = vec![
        ("hybrid_graph_replays_every_call", replays_every_call),
        ("hybrid_graph_refusals", refusals),
        ("hybrid_graph_replay_bounded_by_the_timeout", bounded_replay),
        (
            "hybrid_recover_of_one_rank_shrinks_its_nccl_side",
            recover::one_rank_recovers_twice,
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

//! `DIST_PERF_HYBRID_CHECK=1 dist-nccl-perf`: what `HybridBackend`'s NCCL call check costs per
//! call, instead of the table. 8 B all_reduces through the hybrid in rounds alternating the
//! check on and off, and the communicator's own call (no flight record, no check) beside them;
//! each round is `ITERS` calls then one synchronize; each rank prints the medians of its
//! per-call times. A measurement, not a test: it asserts nothing about the figures.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use dist_core::{Backend, ReduceOp};
use dist_hybrid::{GpuChoice, HybridBackend};
use dist_nccl::CommConfig;

const ITERS: usize = 20_000;
const ROUNDS: usize = 5;

/// Whether this run measures the check (`DIST_PERF_HYBRID_CHECK=1`).
pub fn wanted() -> bool {
    std::env::var_os("DIST_PERF_HYBRID_CHECK").is_some_and(|v| v == "1")
}

/// Runs the measurement as the rank the launcher describes.
pub fn run() -> ExitCode {
    let tcp_cfg = dist_tcp::TcpConfig::from_env().unwrap_or_else(|e| panic!("{e}"));
    let local = tcp_cfg.local_rank().unwrap_or(tcp_cfg.rank());
    let devices = dist_nccl::cuda_device_count();
    if dist_hybrid::pick_device(local, devices).is_none() {
        println!("skipped: local rank {local} has no GPU of its own ({devices} visible)");
        return ExitCode::from(dist_multirank::SKIP_STATUS);
    }
    let tcp = dist_tcp::TcpBackend::with_config(tcp_cfg).unwrap_or_else(|e| panic!("{e}"));
    let cfg = CommConfig {
        timeout: Duration::from_secs(120),
        name: Some("check-cost".into()),
        ..CommConfig::default()
    };
    let mut h = HybridBackend::with_nccl(tcp, local, GpuChoice::Auto, None, cfg)
        .unwrap_or_else(|e| panic!("{e}"));
    let me = h.rank();
    let s = h
        .nccl()
        .expect("a GPU per rank, so NCCL was formed")
        .stream();
    let mut x = s.clone_htod(&[1.0f32; 2]).unwrap_or_else(|e| panic!("{e}"));
    // [check on, check off, the Communicator directly]: µs per call, one entry per round.
    let mut times: [Vec<f64>; 3] = Default::default();
    let mut round = |h: &mut HybridBackend, which: usize| {
        h.barrier().unwrap_or_else(|e| panic!("{e}"));
        let t = Instant::now();
        for _ in 0..ITERS {
            let r = match which {
                2 => h
                    .nccl()
                    .unwrap()
                    .all_reduce_in_place(&mut x, ReduceOp::Sum)
                    .map_err(|e| e.to_string()),
                _ => h
                    .all_reduce(&mut x, ReduceOp::Sum)
                    .map_err(|e| e.to_string()),
            };
            r.unwrap_or_else(|e| panic!("{e}"));
        }
        h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
        times[which].push(t.elapsed().as_secs_f64() * 1e6 / ITERS as f64);
    };
    for _ in 0..ROUNDS {
        h.set_nccl_check(true);
        round(&mut h, 0);
        h.set_nccl_check(false);
        round(&mut h, 1);
        round(&mut h, 2);
    }
    h.set_nccl_check(true);
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [on, off, bare] = &mut times;
    let (on, off, bare) = (med(on), med(off), med(bare));
    println!(
        "rank {me}: all_reduce 8 B, median of {ROUNDS} rounds of {ITERS}: check on {on:.2} us/call, \
         check off {off:.2} us/call, Communicator directly {bare:.2} us/call; check on - off = \
         {:+.2} us; calls not compared: {}",
        on - off,
        h.unchecked_calls()
    );
    h.barrier().unwrap_or_else(|e| panic!("{e}"));
    ExitCode::SUCCESS
}

//! `dist-chaos`: one rank of `cargo xtask chaos`'s soak. It runs checked all_reduces on an
//! elastic `TcpBackend` (the job's store served by the driver, so that any rank may die) and
//! recovers from every failure, printing one line per event for the driver to read:
//!
//! - `beat EPOCH CALLS`: alive and completing calls (at most every 100 ms);
//! - `failed EPOCH MS`: its call failed, MS after the last completed one, with the error;
//! - `epoch EPOCH RANK MEMBERS RECOVER_MS THREADS FDS MEMFDS`: it recovered into EPOCH (members
//!   as job ranks, comma-separated), with its thread, descriptor and shared-memory mapping
//!   counts once the new epoch's first call completed;
//! - `excluded EPOCH`: the agreement left it out (it exits with status 3);
//! - `done EPOCH CALLS THREADS FDS MEMFDS`: the driver's deadline passed on some rank, and
//!   every member stopped at the same call; its resources then.
//!
//! Every all_reduce sums each member's job rank + 1 over [`COUNT`] floats; a wrong sum ends
//! the process with status 1 and a `wrong` line. `CHAOS_UNTIL` (seconds since the Unix epoch)
//! is when to stop; `CHAOS_PEER_TIMEOUT_MS` the peer timeout (default 1000).

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_tcp::{TcpBackend, TcpConfig};

/// Floats per all_reduce, the last one the stop flag.
const COUNT: usize = 1 << 14;
/// How long one recovery may take.
const RECOVER: Duration = Duration::from_secs(30);
/// Status of a rank the agreement left out.
const EXCLUDED: u8 = 3;

fn env_u64(k: &str, default: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// This process's threads, open descriptors and memfd mappings (the shared memory it holds).
fn resources() -> (usize, usize, usize) {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
    let memfds = std::fs::read_to_string("/proc/self/maps")
        .map_or(0, |m| m.lines().filter(|l| l.contains("/memfd:")).count());
    (count("/proc/self/task"), count("/proc/self/fd"), memfds)
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            println!("error {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<u8, String> {
    let until = env_u64("CHAOS_UNTIL", now_s() + 60);
    let peer_timeout = Duration::from_millis(env_u64("CHAOS_PEER_TIMEOUT_MS", 1000));
    let cfg = TcpConfig::from_env()
        .map_err(|e| e.to_string())?
        .peer_timeout(peer_timeout)
        .elastic(true);
    let mut b = TcpBackend::with_config(cfg).map_err(|e| format!("init: {e}"))?;
    let mut calls: u64 = 0;
    let mut last_ok = Instant::now();
    let mut last_beat = Instant::now();
    let mut report_epoch = true;
    let mut recovered_ms = 0u128;
    let mut x = vec![0f32; COUNT];
    loop {
        let mine = (b.members()[b.rank()] + 1) as f32;
        let want: f32 = b.members().iter().map(|&m| (m + 1) as f32).sum();
        x.fill(mine);
        x[COUNT - 1] = f32::from(now_s() >= until);
        match b.all_reduce(&mut x, ReduceOp::Sum) {
            Ok(()) => {
                if let Some(i) = x[..COUNT - 1].iter().position(|&v| v != want) {
                    println!(
                        "wrong {} element {i}: {} where members {:?} sum to {want}",
                        b.epoch(),
                        x[i],
                        b.members()
                    );
                    return Ok(1);
                }
                calls += 1;
                last_ok = Instant::now();
                if report_epoch {
                    report_epoch = false;
                    let (threads, fds, memfds) = resources();
                    let members: Vec<String> = b.members().iter().map(|m| m.to_string()).collect();
                    println!(
                        "epoch {} {} {} {recovered_ms} {threads} {fds} {memfds}",
                        b.epoch(),
                        b.rank(),
                        members.join(",")
                    );
                }
                if x[COUNT - 1] > 0.0 {
                    // The earlier epochs' backends are dropped: their threads and mappings
                    // must be gone by the end (the driver compares with the first epoch's).
                    b.barrier().map_err(|e| format!("the last barrier: {e}"))?;
                    let (threads, fds, memfds) = resources();
                    println!("done {} {calls} {threads} {fds} {memfds}", b.epoch());
                    return Ok(0);
                }
                if last_beat.elapsed() >= Duration::from_millis(100) {
                    last_beat = Instant::now();
                    println!("beat {} {calls}", b.epoch());
                }
            }
            Err(e) => {
                println!("failed {} {} {e}", b.epoch(), last_ok.elapsed().as_millis());
                let t = Instant::now();
                b = match b.recover(RECOVER) {
                    Ok(next) => next,
                    Err(e @ DistError::Excluded { .. }) => {
                        println!("excluded {} {e}", excluded_epoch(&e));
                        return Ok(EXCLUDED);
                    }
                    Err(e) => return Err(format!("recover: {e}")),
                };
                recovered_ms = t.elapsed().as_millis();
                report_epoch = true;
            }
        }
    }
}

/// The epoch an `Excluded` error names (0 if it names none).
fn excluded_epoch(e: &DistError) -> u64 {
    match e {
        DistError::Excluded { epoch, .. } => *epoch,
        _ => 0,
    }
}

//! `dist-chaos`: one rank of `cargo xtask chaos`'s soak. It runs checked all_reduces on an
//! elastic `TcpBackend` (the job's store served by the driver, so that any rank may die),
//! recovers from every failure and takes in joiners between steps (`admit`), printing one line
//! per event for the driver to read:
//!
//! - `joined EPOCH JOB_RANK MEMBERS MS`: started with `DIST_JOIN=1` (a replacement), it joined
//!   the running job (`TcpBackend::join`), taken in at EPOCH after MS in `join`;
//! - `beat EPOCH CALLS`: alive and completing calls (at most every 100 ms);
//! - `failed EPOCH MS`: its call failed, MS after the last completed one, with the error;
//! - `epoch EPOCH RANK MEMBERS RECOVER_MS THREADS FDS MEMFDS`: it moved into EPOCH (members as
//!   job ranks, comma-separated; by a recovery or an admission, RECOVER_MS in that call), with
//!   its thread, descriptor and shared-memory mapping counts once the new epoch's first call
//!   completed;
//! - `excluded EPOCH`: the agreement left it out (it exits with status 3);
//! - `done EPOCH CALLS THREADS FDS MEMFDS`: the driver's deadline passed on some rank, and
//!   every member stopped at the same call; its resources then.
//!
//! Every all_reduce sums each member's job rank + 1 over most of [`COUNT`] floats, and the
//! step (handed from rank 0 to every member by a broadcast after each change of epoch, as a
//! training job hands its weights to a joiner) in one more; a wrong sum of either ends the
//! process with status 1 and a `wrong` line. Two more floats carry rank 0's "admit now" (set
//! every `CHAOS_ADMIT_MS`, default 50, so every member calls `admit` at the same step) and the
//! stop flag. `CHAOS_UNTIL` (seconds since the Unix epoch) is when to stop;
//! `CHAOS_PEER_TIMEOUT_MS` the peer timeout (default 1000).

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_tcp::{TcpBackend, TcpConfig};

/// Floats per all_reduce, the last three the step, the admit flag and the stop flag.
const COUNT: usize = 1 << 14;
/// How long one recovery may take.
const RECOVER: Duration = Duration::from_secs(30);
/// The step goes into the sum modulo this, exact in f32 at any number of ranks up to 256.
const STEP_WRAP: u64 = 1 << 16;
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
    let admit_every = Duration::from_millis(env_u64("CHAOS_ADMIT_MS", 50));
    let cfg = TcpConfig::from_env()
        .map_err(|e| e.to_string())?
        .peer_timeout(peer_timeout)
        .elastic(true);
    let joiner = dist_tcp::joining();
    let mut b = if joiner {
        let t = Instant::now();
        let b = TcpBackend::join(cfg, RECOVER).map_err(|e| format!("join: {e}"))?;
        println!(
            "joined {} {} {} {}",
            b.epoch(),
            b.members()[b.rank()],
            members_text(&b),
            t.elapsed().as_millis()
        );
        b
    } else {
        TcpBackend::with_config(cfg).map_err(|e| format!("init: {e}"))?
    };
    let mut calls: u64 = 0;
    // The job's step: every member's is the same (checked by every all_reduce).
    let mut step: u64 = 0;
    // A joiner receives the step before its first all_reduce; the members send it after
    // every change of epoch.
    let mut need_state = joiner;
    let mut last_ok = Instant::now();
    let mut last_beat = Instant::now();
    let mut last_admit = Instant::now();
    let mut report_epoch = true;
    let mut moved_ms = 0u128;
    let mut x = vec![0f32; COUNT];
    loop {
        let syncing = need_state;
        let result = if syncing {
            let mut s = [step];
            b.broadcast(&mut s, 0).map(|()| {
                step = s[0];
                need_state = false;
            })
        } else {
            let mine = (b.members()[b.rank()] + 1) as f32;
            let want: f32 = b.members().iter().map(|&m| (m + 1) as f32).sum();
            let world = b.world_size() as f32;
            let stamp = (step % STEP_WRAP) as f32;
            x[..COUNT - 3].fill(mine);
            x[COUNT - 3] = stamp;
            x[COUNT - 2] = f32::from(b.rank() == 0 && last_admit.elapsed() >= admit_every);
            x[COUNT - 1] = f32::from(now_s() >= until);
            b.all_reduce(&mut x, ReduceOp::Sum).map(|()| {
                if let Some(i) = x[..COUNT - 3].iter().position(|&v| v != want) {
                    println!(
                        "wrong {} element {i}: {} where members {:?} sum to {want}",
                        b.epoch(),
                        x[i],
                        b.members()
                    );
                    std::process::exit(1);
                }
                if x[COUNT - 3] != stamp * world {
                    println!(
                        "wrong {} step: {} summed where {} members at step {step} give {}",
                        b.epoch(),
                        x[COUNT - 3],
                        b.world_size(),
                        stamp * world
                    );
                    std::process::exit(1);
                }
            })
        };
        match result {
            Ok(()) if syncing => {}
            Ok(()) => {
                calls += 1;
                step += 1;
                last_ok = Instant::now();
                if report_epoch {
                    report_epoch = false;
                    let (threads, fds, memfds) = resources();
                    println!(
                        "epoch {} {} {} {moved_ms} {threads} {fds} {memfds}",
                        b.epoch(),
                        b.rank(),
                        members_text(&b)
                    );
                }
                if x[COUNT - 1] > 0.0 {
                    // The earlier epochs' backends are dropped: their threads and mappings
                    // must be gone by the end (the driver compares with an earlier epoch's).
                    b.barrier().map_err(|e| format!("the last barrier: {e}"))?;
                    let (threads, fds, memfds) = resources();
                    println!("done {} {calls} {threads} {fds} {memfds}", b.epoch());
                    return Ok(0);
                }
                if last_beat.elapsed() >= Duration::from_millis(100) {
                    last_beat = Instant::now();
                    println!("beat {} {calls}", b.epoch());
                }
                if x[COUNT - 2] > 0.0 {
                    // Every member saw rank 0's flag in the same sum: all admit here.
                    last_admit = Instant::now();
                    let epoch = b.epoch();
                    let t = Instant::now();
                    b = match b.admit(RECOVER) {
                        Ok(next) => next,
                        Err(e @ DistError::Excluded { .. }) => {
                            println!("excluded {} {e}", excluded_epoch(&e));
                            return Ok(EXCLUDED);
                        }
                        Err(e) => return Err(format!("admit: {e}")),
                    };
                    if b.epoch() != epoch {
                        moved_ms = t.elapsed().as_millis();
                        report_epoch = true;
                        need_state = true;
                    }
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
                moved_ms = t.elapsed().as_millis();
                report_epoch = true;
                need_state = true;
            }
        }
    }
}

/// The members as job ranks, comma-separated.
fn members_text(b: &TcpBackend) -> String {
    let m: Vec<String> = b.members().iter().map(|m| m.to_string()).collect();
    m.join(",")
}

/// The epoch an `Excluded` error names (0 if it names none).
fn excluded_epoch(e: &DistError) -> u64 {
    match e {
        DistError::Excluded { epoch, .. } => *epoch,
        _ => 0,
    }
}

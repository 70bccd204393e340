//! One rank of `cargo xtask scale`: forms the job from the torchrun environment, runs a barrier,
//! an 8 B all_reduce and a 1 MiB all_reduce (each result checked), and prints one line with the
//! wall-clock time (ns since the Unix epoch) at which each phase ended on this rank, its peak
//! resident memory and the most threads it was seen to have (and, as it goes, a `scale-phase`
//! line as each phase ends). With `--idle-ms N` it stays idle for N ms after forming (before the
//! barrier, so that phase then includes the idle time) and reports the CPU time it used meanwhile. Exits 1 with the error otherwise.
//! With `--form-only` it only forms the job (`DIST_FORMATION=lazy`: lazily), with no backend on
//! top, and reports the later phases as ending when formation did.

use std::time::{SystemTime, UNIX_EPOCH};

use dist_core::{Backend, Collectives, ReduceOp};
use dist_tcp::TcpBackend;

/// Nanoseconds since the Unix epoch (one clock for every rank of a host).
fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// A field of `/proc/self/status` (`VmHWM` in KiB, `Threads`), or 0 where there is none.
fn status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Says on stdout (line-buffered) that this rank ended `phase`, so that a supervisor that kills
/// a run past its deadline can say where each rank was.
fn ended(phase: &str) -> u128 {
    println!("scale-phase {phase}");
    now_ns()
}

/// CPU time this process has used, all its threads, in ms (`/proc/self/stat`'s utime and stime,
/// in Linux's fixed 100 ticks a second), or 0 where it cannot be read.
fn cpu_ms() -> u64 {
    let text = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (which may hold spaces) end with ')'.
    let Some((_, rest)) = text.rsplit_once(')') else {
        return 0;
    };
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    f.iter().sum::<u64>() * 10
}

/// `--idle-ms N` on the command line: how long to stay idle after forming, 0 if not given.
fn idle_ms() -> Result<u64, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--idle-ms") {
        None => Ok(0),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| "--idle-ms takes a whole number of milliseconds".to_string()),
    }
}

/// `--form-only`: form the job through `dist_tcp::testing` and stop there.
fn form_only() -> Result<String, String> {
    let cfg = dist_tcp::TcpConfig::from_env().map_err(|e| format!("formation: {e}"))?;
    let me = cfg.rank();
    let held = if cfg.formation_mode() == dist_tcp::Formation::Lazy {
        let f = dist_tcp::testing::form_lazy(&cfg, Box::new(|_, _| false))
            .map_err(|e| format!("formation: {e}"))?;
        f.streams.iter().filter(|s| s.is_some()).count()
    } else {
        let s = dist_tcp::testing::form_raw(&cfg).map_err(|e| format!("formation: {e}"))?;
        s.iter().filter(|s| s.is_some()).count()
    };
    let formed = ended("formation");
    let threads = status("Threads");
    Ok(format!(
        "scale-result rank={me} formed={formed} barrier={formed} small={formed} \
         large={formed} hwm_kib={} threads={threads} idle_cpu_ms=0 connections={held}",
        status("VmHWM")
    ))
}

fn run() -> Result<String, String> {
    if std::env::args().any(|a| a == "--form-only") {
        return form_only();
    }
    let idle = idle_ms()?;
    let mut threads = status("Threads");
    let b = TcpBackend::from_env().map_err(|e| format!("formation: {e}"))?;
    let formed = ended("formation");
    threads = threads.max(status("Threads"));

    // Idle: what the backend costs while the program does nothing (its threads' CPU time).
    let before = cpu_ms();
    std::thread::sleep(std::time::Duration::from_millis(idle));
    let idle_cpu = cpu_ms().saturating_sub(before);
    let (me, n) = (b.rank(), b.world_size());

    b.barrier().map_err(|e| format!("barrier: {e}"))?;
    let barrier = ended("barrier");
    threads = threads.max(status("Threads"));

    // 8 B: the sum of rank + 1 over the ranks.
    let mut small = [me as u64 + 1];
    b.all_reduce(&mut small, ReduceOp::Sum)
        .map_err(|e| format!("8 B all_reduce: {e}"))?;
    let want = (n as u64) * (n as u64 + 1) / 2;
    if small[0] != want {
        return Err(format!("8 B all_reduce: got {}, want {want}", small[0]));
    }
    let small_done = ended("all_reduce-8B");
    threads = threads.max(status("Threads"));

    // 1 MiB of u32: element i is (i mod 1024) + rank on each rank.
    let len = (1 << 20) / 4;
    let mut large: Vec<u32> = (0..len).map(|i| (i % 1024 + me) as u32).collect();
    b.all_reduce(&mut large, ReduceOp::Sum)
        .map_err(|e| format!("1 MiB all_reduce: {e}"))?;
    let base = (n * (n - 1) / 2) as u64;
    if let Some(i) = (0..len).find(|&i| u64::from(large[i]) != (n * (i % 1024)) as u64 + base) {
        return Err(format!(
            "1 MiB all_reduce: element {i} is {}, want {}",
            large[i],
            (n * (i % 1024)) as u64 + base
        ));
    }
    let large_done = ended("all_reduce-1MiB");
    threads = threads.max(status("Threads"));

    Ok(format!(
        "scale-result rank={me} formed={formed} barrier={barrier} small={small_done} \
         large={large_done} hwm_kib={} threads={threads} idle_cpu_ms={idle_cpu}",
        status("VmHWM")
    ))
}

fn main() {
    match run() {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

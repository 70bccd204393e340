//! The run: start every rank with its environment, follow them every few milliseconds, and stop
//! them on the first failure (after the grace period), a caught signal or the timeout.

use std::os::unix::process::CommandExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::output::{Pipes, Stream};
use crate::{Error, Hosts, Launch, RankExit, Report, Signals, port, signals};

/// How often the run looks at its ranks.
const POLL: Duration = Duration::from_millis(5);
/// How long the pipes may stay open after every rank has ended (a process a rank started in
/// the background may hold them).
const DRAIN: Duration = Duration::from_secs(2);
/// Variables that would override the port or the store the launcher gives: dist reads
/// `DIST_MASTER_PORT` before `MASTER_PORT`, and under torchrun's agent store
/// (`TORCHELASTIC_USE_AGENT_STORE`, or `DIST_SERVE_STORE=0`) its rank 0 serves no store.
const REMOVED: [&str; 4] = [
    "DIST_MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "DIST_SERVE_STORE",
];

struct Rank {
    child: Child,
    exit: Option<RankExit>,
    killed: bool,
}

/// Runs `launch` to its end, on simulated `hosts` where given: each rank under `ip netns exec`
/// in its host's namespace ([`Hosts::host_of`]), `MASTER_ADDR` host 0's address, `LOCAL_RANK`
/// and `LOCAL_WORLD_SIZE` within its host, and `DIST_TEST_HOST`, `DIST_TEST_HOSTS` and
/// `DIST_TEST_NETNS` saying where it runs.
///
/// The ranks are started from the calling thread, which stays in `run` until every rank has
/// been waited for. That matters on Linux: a rank is killed when the *thread* that started it
/// ends (`PR_SET_PDEATHSIG` follows the thread, not the process), so starting ranks from a
/// helper thread that ends before them would kill them. Calling `run` from a short-lived thread
/// is fine: the thread lives as long as the run.
pub fn run(launch: &Launch, hosts: Option<&Hosts>) -> Result<Report, Error> {
    if launch.world == 0 {
        return Err(Error::NoRanks);
    }
    let master = match hosts {
        Some(h) => h.addr(0),
        None => launch
            .master_addr
            .clone()
            .unwrap_or_else(|| "127.0.0.1".into()),
    };
    let port = match (launch.master_port, hosts) {
        // On simulated hosts rank 0 binds in host 0's namespace, where nothing else runs.
        (Some(p), Some(_)) => p,
        (Some(p), None) => port::check(p)?,
        (None, _) => port::free_port()?,
    };
    let forward = launch.signals == Signals::Forward;
    let _caught = forward.then(signals::catch);
    // A signal that came after the simulated hosts were made stops the run, even one that came
    // before it began.
    let mut seen = hosts.map_or_else(signals::received, Hosts::signals_before);
    let mut pipes = Pipes::new();
    let mut ranks: Vec<Rank> = Vec::with_capacity(launch.world);
    let started = Instant::now();
    for rank in 0..launch.world {
        match start(launch, hosts, rank, None, &master, port, &mut pipes) {
            Ok(r) => ranks.push(r),
            Err(source) => {
                for r in &mut ranks {
                    signal(r, libc::SIGKILL, forward);
                    let _ = r.child.wait();
                }
                return Err(Error::Spawn {
                    rank,
                    program: launch.program.display().to_string(),
                    source,
                });
            }
        }
    }
    let mut report = Report {
        port,
        ranks: Vec::new(),
        replaced: Vec::new(),
        first_failure: None,
        tolerated: Vec::new(),
        interrupted: None,
        timed_out: None,
        grace: launch.grace,
        lines: Vec::new(),
        skip_status: launch.skip_status,
    };
    let mut kill_at: Option<Instant> = None;
    // A replacement needs its rank's death tolerated.
    let tolerate = launch.tolerate.max(launch.replace);
    loop {
        let mut to_replace = Vec::new();
        for (r, rank) in ranks.iter_mut().enumerate() {
            if rank.exit.is_some() {
                continue;
            }
            let status = match rank.child.try_wait() {
                Ok(None) => continue,
                Ok(Some(s)) => Some(s),
                Err(_) => {
                    signal(rank, libc::SIGKILL, forward);
                    rank.child.wait().ok()
                }
            };
            rank.exit = Some(RankExit {
                status,
                killed: rank.killed,
                after: started.elapsed(),
            });
            // A rank a signal ended has no exit code: never the skip status.
            let skipped =
                |s: std::process::ExitStatus| s.code().is_some() && s.code() == launch.skip_status;
            let ok = status.is_some_and(|s| s.success() || skipped(s));
            // An elastic job's allowance: a rank that dies (a signal ends it, not the
            // launcher) while others go on and recover. A rank that exits with a status of its
            // own (a failed check, a survivor left out) always counts.
            let died = status.is_some_and(|s| s.signal().is_some()) && !rank.killed;
            if !ok && died && report.tolerated.len() < tolerate {
                report.tolerated.push(r);
                if report.replaced.len() + to_replace.len() < launch.replace && kill_at.is_none() {
                    // The rank it stands for: a replacement's own, if it was one.
                    let of = r
                        .checked_sub(launch.world)
                        .map_or(r, |k| report.replaced[k]);
                    to_replace.push(of);
                }
            } else if !ok && report.first_failure.is_none() {
                report.first_failure = Some(r);
                kill_at.get_or_insert(Instant::now() + launch.grace);
            }
        }
        for of in to_replace {
            let k = report.replaced.len() + 1;
            match start(launch, hosts, of, Some(k), &master, port, &mut pipes) {
                Ok(r) => {
                    ranks.push(r);
                    report.replaced.push(of);
                }
                // Not started: the job goes on without it (its rank's death was tolerated).
                Err(e) => eprintln!(
                    "{}dist-run: cannot start replacement {k} of rank {of}: {e}",
                    launch.prefix(of)
                ),
            }
        }
        if ranks.iter().all(|r| r.exit.is_some()) {
            break;
        }
        let caught = signals::received();
        if caught > seen {
            seen = caught;
            let sig = signals::last().unwrap_or(libc::SIGTERM);
            let first = report.interrupted.is_none();
            report.interrupted = Some(sig);
            if forward && first {
                for rank in ranks.iter_mut().filter(|r| r.exit.is_none()) {
                    signal(rank, sig, true);
                }
                let at = Instant::now() + launch.grace;
                kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
            } else {
                kill_at = Some(Instant::now());
            }
        }
        if let Some(t) = launch.timeout
            && report.timed_out.is_none()
            && started.elapsed() > t
        {
            report.timed_out = Some(t);
            kill_at = Some(Instant::now());
        }
        if kill_at.is_some_and(|k| Instant::now() >= k) {
            for rank in ranks.iter_mut().filter(|r| r.exit.is_none() && !r.killed) {
                rank.killed = true;
                signal(rank, libc::SIGKILL, forward);
            }
        }
        // A supervisor's poll: ranks are looked at every few milliseconds.
        std::thread::sleep(POLL);
    }
    report.ranks = ranks.into_iter().filter_map(|r| r.exit).collect();
    report.lines = pipes.finish(DRAIN);
    Ok(report)
}

/// Starts rank `rank`, or (with `replacement`, counted from 1) a replacement in its place
/// (`DIST_JOIN=1` in its environment: dist-tcp's `JOIN_ENV`), its output forwarded.
#[allow(clippy::too_many_arguments)] // Each is one fact about the process to start.
fn start(
    launch: &Launch,
    hosts: Option<&Hosts>,
    rank: usize,
    replacement: Option<usize>,
    master: &str,
    port: u16,
    pipes: &mut Pipes,
) -> std::io::Result<Rank> {
    let forward = launch.signals == Signals::Forward;
    let mut cmd = command(launch, hosts, rank, master, port);
    if replacement.is_some() {
        cmd.env("DIST_JOIN", "1");
    }
    if forward {
        cmd.process_group(0);
    }
    die_with_launcher(&mut cmd);
    let mut child = cmd.spawn()?;
    let prefix = match replacement {
        Some(k) => launch.replacement_prefix(rank, k),
        None => launch.prefix(rank),
    };
    let out_prefix = if launch.plain_rank0 && rank == 0 && replacement.is_none() {
        String::new()
    } else {
        prefix.clone()
    };
    let echo = |s| launch.echo.then_some(s);
    if let Some(out) = child.stdout.take() {
        pipes.forward(out, out_prefix, echo(Stream::Out));
    }
    if let Some(err) = child.stderr.take() {
        pipes.forward(err, prefix, echo(Stream::Err));
    }
    Ok(Rank {
        child,
        exit: None,
        killed: false,
    })
}

/// Rank `rank`'s command: the program (under `ip netns exec` on simulated hosts), its
/// arguments, the launcher's variables, then the launch's own.
fn command(
    launch: &Launch,
    hosts: Option<&Hosts>,
    rank: usize,
    master: &str,
    port: u16,
) -> Command {
    let world = launch.world;
    let (mut cmd, local) = match hosts {
        None => (Command::new(&launch.program), 0..world),
        Some(h) => {
            let host = h.host_of(rank, world);
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &h.netns(host)])
                .arg(&launch.program)
                .env("DIST_TEST_HOST", host.to_string())
                .env("DIST_TEST_HOSTS", h.count().to_string())
                .env("DIST_TEST_NETNS", h.netns(host));
            (cmd, h.ranks_of(host, world))
        }
    };
    for k in REMOVED {
        cmd.env_remove(k);
    }
    cmd.args(&launch.args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", (rank - local.start).to_string())
        .env("LOCAL_WORLD_SIZE", local.len().to_string())
        .env("MASTER_ADDR", master)
        .env("MASTER_PORT", port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in &launch.env {
        cmd.env(k, v);
    }
    cmd
}

/// On Linux, the rank is killed if the launcher dies (even by SIGKILL, which it cannot catch),
/// so that no rank outlives it; elsewhere, nothing. The kernel ties this to the thread that
/// spawns the rank, so [`run`] spawns every rank from its own thread, which outlives them (the
/// test `ranks_started_from_a_thread_that_ends_live_until_the_run_ends`).
fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        let launcher = std::process::id();
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it calls prctl and getppid, allocates nothing
        // (the error is built from a code) and touches only the copied `launcher`. If the
        // launcher died before prctl took effect, the child's parent is no longer the launcher
        // and it does not start. The integration test
        // `ranks_do_not_outlive_a_killed_launcher` kills a launcher with SIGKILL.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() as u32 != launcher {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Sends `sig` to a rank not yet waited for: to its process group when it has one of its own
/// (`group`), so that what it started gets it too.
fn signal(rank: &mut Rank, sig: libc::c_int, group: bool) {
    if rank.exit.is_some() {
        return;
    }
    let Ok(pid) = libc::pid_t::try_from(rank.child.id()) else {
        return;
    };
    let target = if group { -pid } else { pid };
    // SAFETY: kill has no memory-safety preconditions. The rank has not been waited for, so its
    // pid (and, with `group`, the process group it leads, made by `process_group(0)`) still
    // names our child, not a process that reused the number. The integration tests
    // `a_survivor_that_hangs_is_killed_after_the_grace_period` (SIGKILL) and
    // `sigint_and_sigterm_reach_every_rank` (forwarded to each rank's group) send them.
    unsafe { libc::kill(target, sig) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` called from a thread that ends when the run returns: every rank lives its whole
    /// life (the death signal is tied to the thread that spawned it, which must outlive it).
    #[test]
    fn ranks_started_from_a_thread_that_ends_live_until_the_run_ends() {
        let mut launch = Launch::new("sh", 2);
        launch.args = ["-c", "sleep 0.5; echo alive"]
            .into_iter()
            .map(Into::into)
            .collect();
        // No signal guard: the signal tests of this binary own the dispositions.
        launch.signals = Signals::Stop;
        launch.echo = false;
        launch.timeout = Some(Duration::from_secs(60));
        let report = std::thread::spawn(move || run(&launch, None))
            .join()
            .expect("the launching thread does not panic")
            .expect("the run starts");
        assert_eq!(report.ranks.len(), 2);
        for (r, exit) in report.ranks.iter().enumerate() {
            let status = exit.status.expect("the rank was waited for");
            assert!(
                status.success(),
                "rank {r} ended with {status:?} after {:?}",
                exit.after
            );
            assert!(!exit.killed, "rank {r} was killed by the launcher");
            assert!(
                exit.after >= Duration::from_millis(500),
                "rank {r} ran its sleep"
            );
        }
        let alive = report.lines.iter().filter(|l| l.ends_with("alive")).count();
        assert_eq!(alive, 2, "every rank reached its end: {:?}", report.lines);
    }
}

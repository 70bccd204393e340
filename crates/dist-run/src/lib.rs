//! Launching N local ranks of any program, as `torchrun --standalone` does without Python:
//! each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (the variables `dist_tcp::LaunchEnv::from_env` reads), rank 0's port is picked
//! free and outside the kernel's ephemeral range, every output line is prefixed with its rank,
//! SIGINT, SIGTERM and SIGHUP are forwarded to the ranks, and when a rank fails the others get a
//! grace period to report their own errors before they are killed; the [`Report`] then gives
//! every rank's exit. On Linux no rank outlives the launcher, even one killed by SIGKILL (the
//! ranks get the parent-death signal).
//!
//! The `dist-run` binary is this library behind a command line (`dist-run -n 4 -- PROGRAM
//! ARGS`); dist's own test harness uses it too. Ranks can also be spread over simulated hosts
//! ([`Hosts`]: network namespaces on this machine, root only).
//!
//! ```no_run
//! use std::time::Duration;
//!
//! let mut launch = dist_run::Launch::new("./target/release/examples/train", 4);
//! launch.grace = Duration::from_secs(5);
//! let report = dist_run::run(&launch, None)?;
//! for line in report.describe() {
//!     eprintln!("{line}");
//! }
//! std::process::exit(report.exit_code());
//! # Ok::<(), dist_run::Error>(())
//! ```

#![deny(missing_docs)]

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

mod delay;
pub mod hosts;
pub mod output;
pub mod port;
pub mod rate;
mod run;
pub mod signals;

pub use hosts::{Hosts, Link};
pub use output::KEPT_LINES;
pub use port::free_port;
pub use run::run;

/// Why a launch could not start, or could not follow its ranks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Zero ranks were asked for.
    #[error("a launch needs at least one rank")]
    NoRanks,
    /// The port asked for is in use.
    #[error(
        "port {port} is in use ({source}); name another with --master-port, or leave it out for a free one"
    )]
    PortTaken {
        /// The port.
        port: u16,
        /// What binding it said.
        source: std::io::Error,
    },
    /// No port could be bound at all.
    #[error("cannot find a free port: {0}")]
    NoPort(std::io::Error),
    /// A rank's process could not be started.
    #[error("rank {rank}: cannot start {program}: {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program, as given.
        program: String,
        /// Why.
        source: std::io::Error,
    },
}

/// What the launcher does when it catches SIGINT, SIGTERM or SIGHUP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signals {
    /// Catch them (for the run's duration), send each one on to every running rank, and kill the
    /// ranks still running after the grace period; a second signal kills them at once. Each rank
    /// runs in a process group of its own, so that a terminal's Ctrl-C reaches it once, through
    /// the launcher, and a kill reaches the processes it started too.
    Forward,
    /// Leave the dispositions as they are (the ranks share the launcher's process group, so a
    /// terminal's Ctrl-C reaches them directly); if a guard such as [`Hosts`] catches one, kill
    /// every rank at once.
    Stop,
}

/// One launch of `world` ranks of a program.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Launch {
    /// The program every rank runs (looked up in `PATH` if it has no `/`).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// The number of ranks.
    pub world: usize,
    /// Extra environment for every rank, set after the launcher's own variables.
    pub env: Vec<(OsString, OsString)>,
    /// Rank 0's address (default `127.0.0.1`; host 0's address on simulated hosts).
    pub master_addr: Option<String>,
    /// Rank 0's port (default: a free one, see [`port::free_port`]); checked free before the
    /// ranks start.
    pub master_port: Option<u16>,
    /// How long the ranks may run before every one is killed (default: no limit).
    pub timeout: Option<Duration>,
    /// After the first failure (or a forwarded signal), how long the other ranks may run to
    /// report their own errors before they are killed (default 10 s).
    pub grace: Duration,
    /// Put in front of every output line, before the rank: `[LABELr3] `.
    pub label: String,
    /// Print rank 0's stdout without a prefix (for tables) and the others' prefixed.
    pub plain_rank0: bool,
    /// Print every rank's output as it comes; when false it is only kept (the last
    /// [`KEPT_LINES`] lines), for the report.
    pub echo: bool,
    /// An exit status that is not a failure though not 0 (a test's "skipped"): it does not
    /// start the grace period.
    pub skip_status: Option<i32>,
    /// How many ranks may die without ending the job (an elastic job, whose survivors
    /// recover; default 0): a rank ended by a signal (not by the launcher) within this count
    /// starts no grace period, and the launch passes when every other rank exits 0 (see
    /// [`Report::tolerated`]). A rank that exits with a non-zero status always fails the job.
    pub tolerate: usize,
    /// How many replacements the launcher may start (default 0): when a rank dies within the
    /// allowance (see [`Launch::tolerate`], which is taken to be at least this), the launcher
    /// starts the same command again with the same `RANK` and `DIST_JOIN=1` in its
    /// environment, so that it joins the running job (dist-tcp's `TcpBackend::join`) rather
    /// than form one. A replacement that dies may be replaced in turn, while any are left.
    /// Replacements are reported after the ranks ([`Report::replaced`]).
    pub replace: usize,
    /// What a caught signal does.
    pub signals: Signals,
}

impl Launch {
    /// `world` ranks of `program`, with no arguments, every line echoed and prefixed, signals
    /// forwarded, a 10 s grace period and no timeout.
    pub fn new(program: impl Into<PathBuf>, world: usize) -> Launch {
        Launch {
            program: program.into(),
            args: Vec::new(),
            world,
            env: Vec::new(),
            master_addr: None,
            master_port: None,
            timeout: None,
            grace: Duration::from_secs(10),
            label: String::new(),
            plain_rank0: false,
            echo: true,
            skip_status: None,
            tolerate: 0,
            replace: 0,
            signals: Signals::Forward,
        }
    }

    /// The prefix of rank `rank`'s lines.
    pub fn prefix(&self, rank: usize) -> String {
        format!("[{}r{rank}] ", self.label)
    }

    /// The prefix of the lines of the `k`-th replacement (from 1) started in rank `rank`'s
    /// place.
    pub fn replacement_prefix(&self, rank: usize, k: usize) -> String {
        format!("[{}r{rank}+{k}] ", self.label)
    }
}

/// How one rank ended.
#[derive(Debug, Clone)]
pub struct RankExit {
    /// Its exit status (`None`: it could not be waited for).
    pub status: Option<ExitStatus>,
    /// Whether the launcher killed it (after the grace period, the timeout or a second signal).
    pub killed: bool,
    /// When it ended, from the launch.
    pub after: Duration,
}

impl RankExit {
    /// Whether it exited with 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// How a launch ended: every rank's exit, what stopped it early, the last lines of output.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Report {
    /// Rank 0's port.
    pub port: u16,
    /// Each rank's end, by rank, then each replacement's, in the order started (see
    /// [`Report::replaced`]).
    pub ranks: Vec<RankExit>,
    /// For each replacement, in the order started: the rank it took the place of (its entry in
    /// [`Report::ranks`] is the world size plus its place in this list).
    pub replaced: Vec<usize>,
    /// The first rank seen to fail beyond the [`Launch::tolerate`] allowance, if one did.
    pub first_failure: Option<usize>,
    /// The ranks that died (a signal ended them) within the [`Launch::tolerate`] allowance, in
    /// the order seen.
    pub tolerated: Vec<usize>,
    /// The signal the launcher caught (and forwarded, with [`Signals::Forward`]), if one came.
    pub interrupted: Option<i32>,
    /// The timeout, if the ranks ran past it.
    pub timed_out: Option<Duration>,
    /// The grace period the ranks had after the first failure or signal.
    pub grace: Duration,
    /// The last [`KEPT_LINES`] lines of output, prefixed.
    pub lines: Vec<String>,
    skip_status: Option<i32>,
}

impl Report {
    /// Whether the rank's exit is a failure (neither 0 nor the skip status), tolerated or not.
    pub fn failed(&self, rank: usize) -> bool {
        let e = &self.ranks[rank];
        // A rank a signal ended has no exit code: never the skip status.
        let code = e.status.and_then(|s| s.code());
        !e.success() && (code.is_none() || code != self.skip_status || e.killed)
    }

    /// Whether the rank failed and its failure ends the job (it is not one of
    /// [`Report::tolerated`]).
    pub fn failed_untolerated(&self, rank: usize) -> bool {
        self.failed(rank) && !self.tolerated.contains(&rank)
    }

    /// Whether every rank exited with 0 (or the skip status) but the tolerated failures,
    /// untimed and uninterrupted.
    pub fn passed(&self) -> bool {
        self.interrupted.is_none()
            && self.timed_out.is_none()
            && (0..self.ranks.len()).all(|r| !self.failed_untolerated(r))
    }

    /// The ranks the launcher killed.
    pub fn killed(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&r| self.ranks[r].killed)
            .collect()
    }

    /// The launcher's exit status: 0 when [`Report::passed`]; 128 + the signal when
    /// interrupted; 124 when timed out; else the first failed rank's exit code (128 + its
    /// signal if a signal ended it).
    pub fn exit_code(&self) -> i32 {
        if let Some(sig) = self.interrupted {
            return 128 + sig;
        }
        if self.timed_out.is_some() {
            return 124;
        }
        let Some(r) = (0..self.ranks.len()).find(|&r| self.failed_untolerated(r)) else {
            return 0;
        };
        let r = self.first_failure.unwrap_or(r);
        match self.ranks[r].status {
            Some(s) => match (s.code(), std::os::unix::process::ExitStatusExt::signal(&s)) {
                (Some(c), _) if c != 0 => c,
                (_, Some(sig)) => 128 + sig,
                _ => 1,
            },
            None => 1,
        }
    }

    /// What went wrong, one line each, then every rank's exit; nothing when it passed.
    pub fn describe(&self) -> Vec<String> {
        if self.passed() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if let Some(sig) = self.interrupted {
            out.push(format!(
                "interrupted by {}: sent on to the ranks",
                signals::name(sig)
            ));
        }
        if let Some(t) = self.timed_out {
            out.push(format!("timed out after {t:?}"));
        }
        if !self.tolerated.is_empty() {
            out.push(format!(
                "ranks {:?} died within the allowance of {}",
                self.tolerated,
                self.tolerated.len()
            ));
        }
        if let Some(r) = self.first_failure {
            out.push(format!(
                "{} failed first{} ({}, after {:.2?})",
                self.who(r),
                if self.tolerated.is_empty() {
                    ""
                } else {
                    " beyond the allowance"
                },
                status_text(&self.ranks[r]),
                self.ranks[r].after
            ));
        }
        if let Some(hint) = self.port_hint() {
            out.push(hint);
        }
        for (r, e) in self.ranks.iter().enumerate() {
            let who = self.who(r);
            let how = if e.killed {
                "killed by the launcher: still running after the grace period, the timeout or a \
                 second signal"
                    .to_string()
            } else {
                status_text(e)
            };
            out.push(format!("{who}: {how} (after {:.2?})", e.after));
        }
        out
    }
}

impl Report {
    /// Entry `r` of [`Report::ranks`] in words: `rank R`, or `replacement K of rank R`.
    pub fn who(&self, r: usize) -> String {
        let world = self.ranks.len().saturating_sub(self.replaced.len());
        match r.checked_sub(world) {
            Some(k) if k < self.replaced.len() => {
                format!("replacement {} of rank {}", k + 1, self.replaced[k])
            }
            _ => format!("rank {r}"),
        }
    }

    /// When a rank said that rank 0's port was in use: the port was free when the launcher
    /// checked it, and another program bound it before rank 0 did.
    fn port_hint(&self) -> Option<String> {
        let addr_port = format!(":{} ", self.port);
        let taken = self.lines.iter().any(|l| {
            (l.contains("Address already in use") || l.contains("os error 98"))
                && (l.contains(&addr_port) || l.contains(&format!(":{}:", self.port)))
        });
        taken.then(|| {
            format!(
                "port {} was free when the launcher checked it, but another program bound it \
                 before rank 0 did: run again (a new port is picked), or name a free one with \
                 --master-port",
                self.port
            )
        })
    }
}

fn status_text(e: &RankExit) -> String {
    e.status
        .map_or_else(|| "could not be waited for".into(), |s| s.to_string())
}

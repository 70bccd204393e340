//! The multi-rank test plan: the cases a test program lists (`PROGRAM --list`), each with the
//! world sizes, environment and needs it declares, as one trial per case × world size; and the
//! jobs that run them, started by dist-run's launcher (a free port, the torchrun environment,
//! each output line prefixed with its rank or kept for the failure report, every rank's exit
//! reported). `cargo xtask` and the `multirank` test target both use it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub use dist_run::hosts;
pub use dist_run::rate;
pub use dist_run::{Hosts, KEPT_LINES, Link};

/// One launch of `world` ranks of a program.
#[derive(Debug, Clone)]
pub struct Job {
    /// The program every rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The number of ranks.
    pub world: usize,
    /// How long the ranks may run before every one is killed.
    pub timeout: Duration,
    /// Put in front of every output line, before the rank.
    pub label: String,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Print rank 0's stdout without a prefix (for tables) and others' prefixed.
    pub plain_rank0: bool,
    /// Print every rank's output as it comes; when false it is only kept (the last
    /// [`KEPT_LINES`] lines), for the failure report.
    pub echo: bool,
    /// How many ranks may fail without failing the job (an elastic job's; see dist-run's
    /// `Launch::tolerate`).
    pub tolerate: usize,
    /// How many replacements the launcher may start for ranks that die (dist-run's
    /// `Launch::replace`).
    pub replace: usize,
}

/// How a launch ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every rank exited with 0.
    Passed,
    /// Some rank said it cannot run here (exit status 77), none failed; the reason is the
    /// ranks' "skipped: …" lines.
    Skipped(String),
    /// A rank failed, or the deadline passed: why, every rank's exit, then the last lines of
    /// output.
    Failed(String),
}

/// The exit status with which a test program says "skipped" (automake's convention).
pub const SKIP_STATUS: i32 = 77;

/// After a rank fails, how long the others may run to print their own errors before they are
/// killed (dist's survivors notice a failed peer within milliseconds; a rank that hangs costs
/// this much).
pub const GRACE: Duration = Duration::from_secs(5);

/// A port that was free a moment ago (outside the ephemeral range where it can be).
pub fn free_port() -> std::io::Result<u16> {
    dist_run::free_port().map_err(std::io::Error::other)
}

/// Runs the job to completion, failure or deadline.
pub fn run(job: &Job) -> Result<Outcome, String> {
    run_on(job, None)
}

/// The launch that runs `job`: echoed or kept as it says, exit status 77 a skip, signals
/// caught only by a [`Hosts`] guard (the ranks share the caller's process group, so a
/// terminal's Ctrl-C reaches them directly), and the environment every process this project
/// starts gets.
fn launch(job: &Job) -> dist_run::Launch {
    let mut l = dist_run::Launch::new(&job.program, job.world);
    l.args = job.args.iter().map(Into::into).collect();
    l.timeout = Some(job.timeout);
    l.grace = GRACE;
    l.label = job.label.clone();
    l.plain_rank0 = job.plain_rank0;
    l.echo = job.echo;
    l.skip_status = Some(SKIP_STATUS);
    l.tolerate = job.tolerate;
    l.replace = job.replace;
    l.signals = dist_run::Signals::Stop;
    // NVLink SHARP (NVLS) stays off in every process we start, as in every GPU run that
    // docs/benchmarks.md records.
    l.env.push(("NCCL_NVLS_ENABLE".into(), "0".into()));
    // NCCL connects collectives' rings and trees while a communicator forms, within its init
    // deadline, not inside the first call that needs them (see dist-nccl's `connect.rs`),
    // unless the caller's environment says otherwise.
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        l.env.push(("NCCL_RUNTIME_CONNECT".into(), "0".into()));
    }
    l.env
        .extend(job.env.iter().map(|(k, v)| (k.into(), v.into())));
    l
}

/// [`run`], on simulated `hosts` where given: each rank under `ip netns exec` in its host's
/// namespace ([`Hosts::host_of`]), MASTER_ADDR host 0's address, LOCAL_RANK and
/// LOCAL_WORLD_SIZE within its host, and `DIST_TEST_HOST`, `DIST_TEST_HOSTS` and
/// `DIST_TEST_NETNS` saying where it runs.
pub fn run_on(job: &Job, hosts: Option<&Hosts>) -> Result<Outcome, String> {
    let report = dist_run::run(&launch(job), hosts).map_err(|e| e.to_string())?;
    Ok(outcome(job, report))
}

/// The test's view of a report: a failure names the first failed rank (`rank R failed
/// (exit status: S)`), then every rank's exit, then (when not echoed) the last lines.
fn outcome(job: &Job, report: dist_run::Report) -> Outcome {
    let still = report.killed();
    let why = if report.interrupted.is_some() {
        format!("interrupted; ranks {still:?} still running")
    } else if let Some(t) = report.timed_out {
        format!("timed out after {t:?}; ranks {still:?} still running")
    } else if let Some(r) = report.first_failure {
        let status = report.ranks[r]
            .status
            .map_or_else(|| "could not be waited for".into(), |s| s.to_string());
        format!("rank {r} failed ({status})")
    } else if (0..report.ranks.len())
        .any(|r| !report.ranks[r].success() && !report.tolerated.contains(&r))
    {
        return Outcome::Skipped(skip_reasons(&report.lines));
    } else {
        return Outcome::Passed;
    };
    let ranks = report.describe().join("\n");
    if job.echo {
        Outcome::Failed(format!("{why}\n{ranks}"))
    } else {
        Outcome::Failed(format!(
            "{why}\n{ranks}\nthe last lines of output:\n{}",
            report.lines.join("\n")
        ))
    }
}

/// The ranks' "skipped: …" lines, each reason once, with `; ` between.
fn skip_reasons(lines: &[String]) -> String {
    let mut reasons: Vec<&str> = Vec::new();
    for l in lines {
        if let Some(i) = l.find("skipped: ") {
            let r = &l[i + "skipped: ".len()..];
            if !reasons.contains(&r) {
                reasons.push(r);
            }
        }
    }
    if reasons.is_empty() {
        "skipped (exit status 77, no reason printed)".into()
    } else {
        reasons.join("; ")
    }
}

/// One case as a test program lists it (`PROGRAM --list`, one line each:
/// `NAME [variant=V] sizes=2,3,4 [env=K=V,K=V] [needs=gpu-per-rank,root] [hosts=H] [fixed]`), or one of
/// its variants (the same case again with more environment, at sizes of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The case's name, as the program takes it.
    pub case: String,
    /// The variant's name, if this is one.
    pub variant: Option<String>,
    /// The world sizes it runs at.
    pub sizes: Vec<usize>,
    /// Environment for every rank.
    pub env: Vec<(String, String)>,
    /// What it needs besides (for the listing: the program checks it and skips, saying why).
    pub needs: Vec<String>,
    /// Whether it works only at [`Listed::sizes`] (otherwise at any world size).
    pub fixed: bool,
    /// It runs on this many simulated hosts ([`Hosts`]), its ranks spread over them.
    pub hosts: Option<usize>,
}

impl Listed {
    /// Parses one line of `--list`.
    pub fn parse(line: &str) -> Result<Listed, String> {
        let mut words = line.split_whitespace();
        let case = words.next().ok_or("an empty line")?.to_string();
        let mut l = Listed {
            case,
            variant: None,
            sizes: Vec::new(),
            env: Vec::new(),
            needs: Vec::new(),
            fixed: false,
            hosts: None,
        };
        for w in words {
            match w.split_once('=') {
                Some(("variant", v)) => l.variant = Some(v.to_string()),
                Some(("sizes", v)) => {
                    l.sizes = items(v)
                        .map(|s| s.parse().map_err(|_| format!("bad size {s:?} in {line:?}")))
                        .collect::<Result<_, _>>()?;
                }
                Some(("env", v)) => {
                    l.env = items(v)
                        .map(|kv| {
                            kv.split_once('=')
                                .map(|(k, v)| (k.to_string(), v.to_string()))
                                .ok_or_else(|| format!("bad env {kv:?} in {line:?}"))
                        })
                        .collect::<Result<_, _>>()?;
                }
                Some(("needs", v)) => l.needs = items(v).collect(),
                Some(("hosts", v)) => {
                    l.hosts = Some(
                        v.parse()
                            .map_err(|_| format!("bad hosts {v:?} in {line:?}"))?,
                    );
                }
                None if w == "fixed" => l.fixed = true,
                _ => return Err(format!("unknown field {w:?} in {line:?}")),
            }
        }
        if l.sizes.is_empty() {
            return Err(format!("no sizes in {line:?}"));
        }
        Ok(l)
    }

    /// The name of its trial at world size `n`: `CASE::nN` or `CASE::VARIANT::nN`.
    pub fn trial_name(&self, n: usize) -> String {
        match &self.variant {
            Some(v) => format!("{}::{v}::n{n}", self.case),
            None => format!("{}::n{n}", self.case),
        }
    }

    /// The world sizes to run: its own, or `asked` where given (for a [`Listed::fixed`] case,
    /// only those of `asked` it works at).
    pub fn sizes_for(&self, asked: &[usize]) -> Vec<usize> {
        match (asked.is_empty(), self.fixed) {
            (true, _) => self.sizes.clone(),
            (false, false) => asked.to_vec(),
            (false, true) => asked
                .iter()
                .copied()
                .filter(|n| self.sizes.contains(n))
                .collect(),
        }
    }

    /// The job that runs it at world size `n`, with the environment every test rank gets.
    pub fn job(&self, program: &Path, n: usize, timeout: Duration, echo: bool) -> Job {
        let mut env = test_env();
        env.extend(self.env.iter().cloned());
        Job {
            program: program.to_path_buf(),
            args: vec![self.case.clone()],
            world: n,
            timeout,
            label: format!("{} ", self.trial_name(n)),
            env,
            plain_rank0: false,
            echo,
            tolerate: 0,
            replace: 0,
        }
    }
}

/// The comma-separated items of `v`.
fn items(v: &str) -> impl Iterator<Item = String> + '_ {
    v.split(',').filter(|s| !s.is_empty()).map(str::to_owned)
}

/// The cases `program` lists.
pub fn list(program: &Path) -> Result<Vec<Listed>, String> {
    let out = Command::new(program)
        .arg("--list")
        .output()
        .map_err(|e| format!("list the cases of {}: {e}", program.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} --list failed ({}): {}",
            program.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(Listed::parse)
        .collect()
}

/// The environment of every test rank: a fixed glibc mmap threshold. Some cases
/// (`flow_unexpected`, `hostile_peer`) check their peak RSS against dist's unexpected-message
/// budget; with glibc's default, the threshold rises after the first large block is freed, so
/// later 1 MiB messages come from a heap that keeps freed memory, and the high-water mark then
/// measures the allocator's retention (seen: 111 MiB at world size 8 for 64 MiB queued), not what
/// dist holds. A fixed threshold returns every freed large block to the system.
pub fn test_env() -> Vec<(String, String)> {
    vec![(
        "MALLOC_MMAP_THRESHOLD_".to_string(),
        (128 << 10).to_string(),
    )]
}

/// The last line of a run: a skipped case is counted apart, never as passed.
pub fn summary(passed: usize, skipped: usize, failed: usize) -> String {
    format!("{passed} passed, {skipped} skipped, {failed} failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of two ranks of `sh -c SCRIPT` (RANK tells them apart).
    fn job(script: &str) -> Job {
        Job {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            world: 2,
            timeout: Duration::from_secs(20),
            label: "t ".into(),
            env: Vec::new(),
            plain_rank0: false,
            echo: false,
            tolerate: 0,
            replace: 0,
        }
    }

    /// With an allowance of one, a rank that dies leaves the job passed (not skipped: a death
    /// is not a skip); without it, the same job fails naming the rank.
    #[test]
    fn a_tolerated_failure_passes() {
        let script = r#"[ "$RANK" = 1 ] && kill -KILL $$; sleep 0.2"#;
        let tolerant = Job {
            tolerate: 1,
            replace: 0,
            ..job(script)
        };
        assert!(matches!(run(&tolerant), Ok(Outcome::Passed)));
        match run(&job(script)) {
            Ok(Outcome::Failed(why)) => assert!(why.contains("rank 1 failed"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// A rank that exits 77 makes the case skipped, never passed, with the ranks' reasons; a
    /// failure still wins, and its report carries the output.
    #[test]
    fn exit_77_counts_as_skipped_never_passed() {
        let outcome = |script: &str| run(&job(script)).unwrap();
        assert!(matches!(outcome("exit 0"), Outcome::Passed));
        assert!(
            matches!(outcome("echo 'c: skipped: no GPU'; exit 77"), Outcome::Skipped(ref w) if w == "no GPU")
        );
        let one_skips = r#"[ "$RANK" = 0 ] && exit 77; exit 0"#;
        assert!(matches!(outcome(one_skips), Outcome::Skipped(ref w) if w.contains("no reason")));
        let skip_and_fail = r#"[ "$RANK" = 0 ] && exit 77; echo oops >&2; exit 3"#;
        assert!(
            matches!(outcome(skip_and_fail),
                Outcome::Failed(ref w) if w.contains("rank 1") && w.contains("[t r1] oops")),
            "a failure beside a skip must fail the case: {:?}",
            outcome(skip_and_fail)
        );
    }

    #[test]
    fn the_summary_counts_skipped_cases_apart() {
        assert_eq!(summary(3, 0, 0), "3 passed, 0 skipped, 0 failed");
        assert_eq!(summary(5, 2, 1), "5 passed, 2 skipped, 1 failed");
    }

    #[test]
    fn listed_cases_parse_into_trials() {
        let l = Listed::parse(
            "coll_x variant=lanes2 sizes=3,4 env=DIST_TCP_LANES=2,A=b=c needs=gpu-per-rank",
        )
        .unwrap();
        assert_eq!(l.trial_name(3), "coll_x::lanes2::n3");
        assert_eq!(
            l.env,
            [("DIST_TCP_LANES", "2"), ("A", "b=c")].map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(l.needs, ["gpu-per-rank"]);
        assert_eq!(l.sizes_for(&[]), [3, 4]);
        assert_eq!(l.sizes_for(&[16]), [16]);
        let spread = Listed::parse("h_x sizes=4 needs=root hosts=2").unwrap();
        assert_eq!((spread.hosts, l.hosts), (Some(2), None));
        let fixed = Listed::parse("fail_x sizes=4 fixed").unwrap();
        assert_eq!(fixed.trial_name(4), "fail_x::n4");
        assert_eq!(fixed.sizes_for(&[2, 4]), [4]);
        assert!(fixed.sizes_for(&[2]).is_empty());
        for bad in [
            "",
            "x",
            "x sizes=",
            "x sizes=a",
            "x what=1",
            "x sizes=2 env=K",
            "x sizes=2 hosts=two",
        ] {
            assert!(Listed::parse(bad).is_err(), "{bad:?}");
        }
        let job = l.job(Path::new("/p"), 3, Duration::from_secs(1), false);
        assert_eq!(
            (job.world, job.args.as_slice()),
            (3, ["coll_x".to_string()].as_slice())
        );
        assert!(job.env.iter().any(|(k, _)| k == "MALLOC_MMAP_THRESHOLD_"));
        assert!(
            job.env
                .iter()
                .any(|(k, v)| k == "DIST_TCP_LANES" && v == "2")
        );
    }
}

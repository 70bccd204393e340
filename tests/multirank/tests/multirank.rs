//! The multi-rank cases as a test target (`harness = false`, run by `cargo test` and by
//! nextest): one trial per case × world size, named `CASE::nN` (or `CASE::VARIANT::nN`), each
//! launching N local processes of the test program (`dist-multirank`, `dist-nccl-tests`) with
//! the case's environment. The world sizes, variants and needs are those each case declares
//! beside it (`--list`). A trial whose needs are not met here (a CUDA device per rank, root) is
//! ignored, with the reason printed first; a case that skips itself at run time is reported
//! ignored with its reason. Never a pass.
//!
//! `cargo test -p dist-multirank --test multirank -- coll_` runs a subset; `--nocapture`
//! prints every rank's output as it comes (otherwise only a failure's last lines are shown).
//! Trials run one at a time (they time themselves and use every core), unless
//! `--test-threads` says otherwise.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use dist_launch::{Listed, Outcome};
use libtest_mimic::{Arguments, Completion, Failed, Trial};

#[path = "multirank/hosts.rs"]
mod hosts;
#[path = "multirank/on_path.rs"]
mod on_path;

/// How long one trial may run before every rank is killed.
const TIMEOUT: Duration = Duration::from_secs(300);

/// The test programs, as cargo built them for this target.
const PROGRAMS: &[&str] = &[
    env!("CARGO_BIN_EXE_dist-multirank"),
    env!("CARGO_BIN_EXE_dist-nccl-tests"),
];

/// What this host offers, against which the cases' needs are checked before they run.
struct Host {
    gpus: usize,
    root: bool,
    /// Why network namespaces cannot be made here, if they cannot.
    netns: Option<String>,
}

impl Host {
    fn here() -> Host {
        Host {
            gpus: dist_nccl::cuda_device_count(),
            // SAFETY: geteuid has no preconditions and cannot fail.
            root: unsafe { libc::geteuid() } == 0,
            netns: dist_launch::hosts::unavailable(),
        }
    }

    /// Why `listed` cannot run at world size `n` here, if it cannot.
    fn unmet(&self, listed: &Listed, n: usize) -> Option<String> {
        let mut why = Vec::new();
        for need in &listed.needs {
            match need.as_str() {
                "gpu-per-rank" if self.gpus < n => why.push(format!(
                    "needs a CUDA device per rank: {n} ranks, {} devices",
                    self.gpus
                )),
                "root" if !self.root => why.push("needs root".to_string()),
                "netns" => why.extend(self.netns.clone().filter(|_| self.root)),
                "gpu-per-rank" | "root" => {}
                other => why.push(format!("needs {other:?}, which this harness does not know")),
            }
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// Runs one trial: a skip is ignored with its reason (under nextest, which cannot report a
/// skip decided at run time, a failure that says so), never a pass.
fn run(job: dist_launch::Job, hosts: Option<usize>) -> Result<Completion, Failed> {
    let outcome = match hosts {
        Some(h) => hosts::run_on(&job, h)?,
        None => dist_launch::run(&job)?,
    };
    match outcome {
        Outcome::Passed => Ok(Completion::Completed),
        Outcome::Skipped(why) if std::env::var_os("NEXTEST").is_some() => Err(format!(
            "skipped at run time ({why}); nextest would count it passed, so it fails: declare the \
             need beside the case, or run it with cargo test"
        )
        .into()),
        Outcome::Skipped(why) => Ok(Completion::ignored_with(why)),
        Outcome::Failed(why) => Err(why.into()),
    }
}

fn main() -> ExitCode {
    if let Some(code) = hosts::child() {
        return code;
    }
    let mut args = Arguments::from_args();
    args.test_threads.get_or_insert(1);
    let host = Host::here();
    let mut trials = Vec::new();
    let mut unmet: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for program in PROGRAMS.iter().map(Path::new) {
        let listed = match dist_launch::list(program) {
            Ok(l) if !l.is_empty() => l,
            Ok(_) => {
                eprintln!("error: {} lists no case", program.display());
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        for l in listed {
            for &n in &l.sizes {
                let name = l.trial_name(n);
                let why = host.unmet(&l, n);
                let job = l.job(program, n, TIMEOUT, args.nocapture);
                let spread = l.hosts;
                let trial = Trial::ignorable_test(name.clone(), move || run(job, spread))
                    .with_ignored_flag(why.is_some());
                if let Some(why) = why
                    && !args.is_filtered_out(&trial)
                {
                    unmet.entry(why).or_default().push(name);
                }
                trials.push(trial);
            }
        }
    }
    // The simulated hosts' guard: nothing left after a failed or an interrupted run; the
    // delay and the rate cap hold (the rate cap needs tc and the kernel's tbf besides); and a
    // sealed connection refuses what a hub on the path forges, replays, reorders or cuts.
    let why = host.netns.clone();
    let rate_why = why.clone().or_else(dist_launch::rate::unavailable);
    for (name, test, why) in [
        (
            "hosts_failed_run_leaves_nothing",
            hosts::a_failed_run_leaves_nothing as fn() -> _,
            &why,
        ),
        (
            "hosts_interrupted_run_leaves_nothing",
            hosts::an_interrupted_run_leaves_nothing,
            &why,
        ),
        (
            "hosts_delay_holds_every_frame",
            hosts::a_delay_holds_every_frame,
            &why,
        ),
        (
            "hosts_rate_holds_through_the_bridge",
            hosts::a_rate_holds_through_the_bridge,
            &rate_why,
        ),
        (
            "hosts_rate_holds_through_the_hub",
            hosts::a_rate_holds_through_the_hub,
            &rate_why,
        ),
        (
            "hosts_sealed_path_refuses_a_forged_segment",
            on_path::a_forged_segment_is_refused,
            &why,
        ),
        (
            "hosts_sealed_path_refuses_a_replayed_segment",
            on_path::a_replayed_segment_is_refused,
            &why,
        ),
        (
            "hosts_sealed_path_refuses_reordered_segments",
            on_path::reordered_segments_are_refused,
            &why,
        ),
        (
            "hosts_sealed_path_refuses_a_truncated_stream",
            on_path::a_truncated_stream_is_refused,
            &why,
        ),
    ] {
        let trial = Trial::test(name, test).with_ignored_flag(why.is_some());
        if let Some(why) = why
            && !args.is_filtered_out(&trial)
        {
            unmet.entry(why.clone()).or_default().push(name.into());
        }
        trials.push(trial);
    }
    if !args.list {
        for (why, names) in &unmet {
            eprintln!("ignored here ({why}): {}", names.join(", "));
        }
    }
    libtest_mimic::run(&args, trials).exit_code()
}

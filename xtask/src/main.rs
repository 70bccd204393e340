//! `cargo xtask`: the project's own tooling. `test-multirank` launches the multi-process tests,
//! `demo` runs the main job for a new user, `test` runs every test.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod bindgen;
mod bundle;
mod chaos;
mod chaos_launch;
mod chaos_report;
mod multirank;
mod package;
mod plot;
mod public_api;
mod scale;
mod store;
#[cfg(test)]
mod tidy;
mod torch_venv;
mod trace;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use dist_launch as launch;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "dist's project tooling")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Launch the multi-rank test programs for several world sizes.
    TestMultirank(multirank::Args),
    /// Four local ranks exchange messages, verify them, and print latency and bandwidth.
    Demo {
        /// Number of ranks.
        #[arg(short = 'n', long, default_value_t = 4)]
        ranks: usize,
    },
    /// Every test: formatting, clippy, unit tests and the multi-rank tests.
    Test,
    /// `cargo publish --dry-run` of every published crate, then the README's example built
    /// outside the workspace from the packages and run under the packaged dist-run.
    Package,
    /// Point-to-point latency and throughput of two ranks beside a plain socket pair.
    BenchP2p {
        /// Pin rank r (all its threads) to the r-th CPU this process may run on, as `mpirun`
        /// binds two ranks to cores by default; unpinned, the scheduler may put both on one.
        #[arg(long)]
        pin: bool,
        /// Latency only, no throughput rounds.
        #[arg(long)]
        latency_only: bool,
    },
    /// A bucketed all_reduce overlapped with compute: async against blocking, side by side.
    BenchOverlap {
        /// Number of ranks.
        #[arg(short = 'n', long, default_value_t = 4)]
        ranks: usize,
        /// Rounds of each (their medians are printed).
        #[arg(long, default_value_t = 11)]
        rounds: usize,
        /// Compute passes over each bucket (more: more compute to hide the all_reduces behind).
        #[arg(long, default_value_t = 4)]
        passes: usize,
    },
    /// The nccl-tests table for one collective over a range of sizes.
    Perf(PerfArgs),
    /// Build an example in release mode and run it as N local ranks.
    Run {
        /// Number of ranks.
        #[arg(short = 'n', long, default_value_t = 4)]
        ranks: usize,
        /// The example (of dist-hybrid) to run.
        #[arg(long)]
        example: String,
        /// How many ranks may fail without failing the run (for `elastic_train`).
        #[arg(long, default_value_t = 0)]
        tolerate: usize,
        /// How many replacements the launcher may start for ranks that die (dist-run's
        /// `--replace`; for `elastic_train`).
        #[arg(long, default_value_t = 0)]
        replace: usize,
    },
    /// A soak of recovery: N elastic ranks in a checked all_reduce loop while ranks are killed
    /// and stopped at random.
    Chaos(chaos::Args),
    /// docs/benchmarks.md's plots (docs/plots/*.png) from the raw files in docs/results/.
    Plot(plot::Args),
    /// Where each rank was when a job failed, from the flight records in DIST_TRACE_DIR.
    Trace(trace::Args),
    /// Start N ranks on this host (form, barrier, 8 B and 1 MiB all_reduce) and print each
    /// phase's wall time and the ranks' peak memory and threads.
    Scale(scale::Args),
    /// Write (or --check) the list of every public item of each library crate, docs/api/.
    PublicApi(public_api::Args),
    /// Regenerate (or --check) dist-nccl-sys's bindings from nccl.h.
    Bindgen(bindgen::Args),
    /// Serve a TCPStore on --port until stopped (SIGINT/SIGTERM), for jobs started by hand
    /// (their ranks set DIST_SERVE_STORE=0 and form through it).
    Store(store::Args),
    /// Prepare (or reuse) a venv with torch outside the repository, for dist-store's interop
    /// tests, and print its python (`DIST_TORCH_PYTHON=$(cargo xtask torch-venv)`; `--torch
    /// newest` for the newest release tested, which the tests take from `DIST_TORCH_PYTHONS`).
    TorchVenv(torch_venv::Args),
    /// Put the test and bench binaries, this launcher and a manifest into one folder that runs
    /// on a host with no Rust toolchain: `FOLDER/run test-multirank --backend nccl`.
    Bundle {
        /// Where (default: bundle/ in the workspace).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct PerfArgs {
    /// Transport: tcp.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all or sendrecv.
    #[arg(long, default_value = "all_reduce")]
    op: String,
    /// Number of ranks.
    #[arg(short = 'n', long = "nranks", default_value_t = 4)]
    ranks: usize,
    /// Smallest size (bytes; K, M, G suffixes).
    #[arg(short = 'b', default_value = "8")]
    min: String,
    /// Largest size.
    #[arg(short = 'e', default_value = "64M")]
    max: String,
    /// Factor between sizes.
    #[arg(short = 'f', default_value = "4")]
    factor: String,
    /// Element type (f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Verify one call's result at every size.
    #[arg(long)]
    check: bool,
    /// Timed iterations per size (default: by size, 5 to 1000).
    #[arg(long)]
    iters: Option<usize>,
    /// nccl: also time a bare NCCL loop of the op (all_reduce, all_gather, reduce_scatter,
    /// broadcast, sendrecv) beside dist-nccl's, 3 rounds, in the same program.
    #[arg(long)]
    bare: bool,
    /// Spread the ranks over this many simulated hosts (network namespaces; needs root and
    /// iproute2), as `test-multirank --hosts`.
    #[arg(long)]
    hosts: Option<usize>,
    /// With hosts: add this many milliseconds to every frame between hosts (a hub in the
    /// launcher instead of the bridge).
    #[arg(long, requires = "hosts")]
    delay_ms: Option<f64>,
    /// With hosts: cap what each host sends at this rate (1gbit, 100mbit; `tc tbf` on its
    /// link, see `dist_launch::rate`).
    #[arg(long, requires = "hosts")]
    rate: Option<launch::rate::Rate>,
}

/// `count` simulated hosts (see `dist_launch::hosts`), with `delay_ms` added between them and
/// each host's link capped at `rate`; deleted when dropped.
pub fn simulated_hosts(
    count: usize,
    delay_ms: Option<f64>,
    rate: Option<launch::rate::Rate>,
) -> Result<launch::Hosts> {
    let delay = match delay_ms {
        None => None,
        Some(ms) => Some(
            std::time::Duration::try_from_secs_f64(ms / 1e3)
                .map_err(|_| anyhow::anyhow!("bad --delay-ms {ms}"))?,
        ),
    };
    launch::Hosts::with_link(count, launch::Link { delay, rate }).map_err(anyhow::Error::msg)
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Where cargo puts release binaries.
pub fn release_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join("release")
}

/// Formats Rust source with the toolchain's rustfmt.
pub fn rustfmt(src: &str) -> Result<String> {
    use std::io::Write;
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2024", "--emit", "stdout"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("run rustfmt")?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(src.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("rustfmt failed on the generated bindings");
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// Runs `cargo ARGS` in the workspace root and fails if it fails.
pub fn cargo(args: &[&str]) -> Result<()> {
    cargo_with(args, &[])
}

/// [`cargo`] with extra environment variables.
pub fn cargo_with(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("$ {}cargo {}", shown.concat(), args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root())
        .status()
        .context("run cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match dispatch(Cli::parse().cmd) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::TestMultirank(args) => multirank::run(&args),
        Cmd::Demo { ranks } => launch_release("dist-demo", ranks, Vec::new(), None),
        Cmd::Test => test(),
        Cmd::Package => package::run(),
        Cmd::Bindgen(a) => bindgen::run(&a),
        Cmd::PublicApi(a) => public_api::run(&a),
        Cmd::Scale(a) => scale::run(&a),
        Cmd::Trace(a) => trace::run(&a),
        Cmd::Plot(a) => plot::run(&a),
        Cmd::TorchVenv(a) => torch_venv::run(&a),
        Cmd::Store(a) => store::run(&a),
        Cmd::Chaos(a) => chaos::run(&a),
        Cmd::Run {
            ranks,
            example,
            tolerate,
            replace,
        } => {
            // elastic_train waits for the replacement (and checks the group is whole again)
            // when told one comes.
            let env = (replace > 0)
                .then(|| ("ELASTIC_REPLACED".to_string(), "1".to_string()))
                .into_iter()
                .collect();
            run_example(&example, ranks, tolerate, replace, env)
        }
        Cmd::BenchP2p { pin, latency_only } => {
            let mut args = Vec::new();
            if pin {
                args.push("--pin".to_string());
            }
            if latency_only {
                args.push("--latency-only".to_string());
            }
            launch_release("dist-p2p-bench", 2, args, None)
        }
        Cmd::BenchOverlap {
            ranks,
            rounds,
            passes,
        } => {
            let args = [
                "--rounds",
                &rounds.to_string(),
                "--passes",
                &passes.to_string(),
            ]
            .map(String::from)
            .to_vec();
            launch_release("dist-overlap-bench", ranks, args, None)
        }
        Cmd::Bundle { out } => bundle::run(out),
        Cmd::Perf(a) => {
            let bin = match a.backend.as_str() {
                "tcp" => "dist-perf",
                "nccl" => "dist-nccl-perf",
                other => bail!("unknown backend {other:?} (tcp or nccl)"),
            };
            let mut args: Vec<String> = [
                "--op", &a.op, "-b", &a.min, "-e", &a.max, "-f", &a.factor, "--dtype", &a.dtype,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            if a.check {
                args.push("--check".into());
            }
            if let Some(i) = a.iters {
                args.extend(["--iters".into(), i.to_string()]);
            }
            if a.bare {
                args.push("--bare".into());
            }
            let hosts = match a.hosts {
                Some(h) => Some(simulated_hosts(h, a.delay_ms, a.rate)?),
                None => None,
            };
            launch_release(bin, a.ranks, args, hosts.as_ref())
        }
    }
}

/// Builds `example` of dist-hybrid in release mode (unless in a bundle) and runs `ranks` ranks,
/// `tolerate` of which may fail, with up to `replace` replacements and `env` besides.
fn run_example(
    example: &str,
    ranks: usize,
    tolerate: usize,
    replace: usize,
    env: Vec<(String, String)>,
) -> Result<()> {
    let program = bundled_or_built(
        example,
        &["-p", "dist-hybrid", "--example", example],
        || release_dir().join("examples").join(example),
    )?;
    launch_ranks(program, ranks, Vec::new(), None, (tolerate, replace), env)
}

/// Builds a release binary of dist-tools (unless in a bundle) and runs `ranks` ranks of it,
/// rank 0's output unprefixed, on simulated `hosts` where given.
fn launch_release(
    bin: &str,
    ranks: usize,
    args: Vec<String>,
    hosts: Option<&launch::Hosts>,
) -> Result<()> {
    let program = bundled_or_built(bin, &["-p", "dist-tools", "--bin", bin], || {
        release_dir().join(bin)
    })?;
    launch_ranks(program, ranks, args, hosts, (0, 0), Vec::new())
}

/// `name` from the bundle when running inside one (a host with no Rust toolchain), else built
/// here with `cargo build --release --quiet SELECT`.
fn bundled_or_built(
    name: &str,
    select: &[&str],
    built: impl FnOnce() -> PathBuf,
) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("DIST_BUNDLE_DIR") {
        return Ok(PathBuf::from(dir).join(name));
    }
    let mut args = vec!["build", "--release", "--quiet"];
    args.extend_from_slice(select);
    cargo(&args)?;
    Ok(built())
}

fn launch_ranks(
    program: PathBuf,
    ranks: usize,
    args: Vec<String>,
    hosts: Option<&launch::Hosts>,
    (tolerate, replace): (usize, usize),
    env: Vec<(String, String)>,
) -> Result<()> {
    let name = program.display().to_string();
    let job = launch::Job {
        program,
        args,
        world: ranks,
        timeout: std::time::Duration::from_secs(600),
        label: String::new(),
        env,
        plain_rank0: true,
        echo: true,
        tolerate,
        replace,
    };
    match launch::run_on(&job, hosts).map_err(anyhow::Error::msg)? {
        launch::Outcome::Passed => Ok(()),
        launch::Outcome::Skipped(why) => {
            println!("{name}: skipped: {why}");
            Ok(())
        }
        launch::Outcome::Failed(why) => bail!("{name} failed: {why}"),
    }
}

fn test() -> Result<()> {
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    // The API docs build with no broken links.
    cargo_with(
        &["doc", "--workspace", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    check_other_unix()?;
    // Every published crate packages and builds from its package, and a program outside the
    // workspace builds the README's example from the packages (needs crates.io's index).
    package::run()?;
    // The loader against the real library: ignored by `cargo test` (reported as ignored, not
    // passed), run here when there is a library to run it against.
    if std::env::var_os("DIST_NCCL_LIBRARY").is_some() {
        cargo(&["test", "-p", "dist-nccl-sys", "--", "--ignored"])?;
    } else {
        println!(
            "skipped: dist-nccl-sys's real-library test (DIST_NCCL_LIBRARY not set; .ci/run sets it)"
        );
    }
    match bindgen::find_header(None) {
        Some(_) => bindgen::run(&bindgen::Args {
            header: None,
            check: true,
        })?,
        None => println!(
            "skipped: cargo xtask bindgen --check (no nccl.h: set DIST_NCCL_WHEEL_DIR or \
             NCCL_HEADER, as .ci/run does)"
        ),
    }
    // The training example, as a test (on the CPU here; on GPUs where there are some).
    run_example("train", 4, 0, 0, Vec::new())?;
    // The elastic example, as a test: one rank of four killed with SIGKILL at a random step,
    // the survivors recover and must end where an undisturbed run ends; then again with a
    // replacement started by the launcher, which the group takes in (it must end at four).
    run_example("elastic_train", 4, 1, 0, Vec::new())?;
    run_example(
        "elastic_train",
        4,
        1,
        1,
        vec![("ELASTIC_REPLACED".into(), "1".into())],
    )?;
    // Every test, last, so that their counts close the run: the unit and integration tests,
    // the tidy tests, and the multi-rank cases (tests/multirank/tests/multirank.rs), each at
    // the world sizes it declares (2, 3, 4, 5, 8 for most TCP cases; the collectives again
    // with two lanes at 3, 4, 5; the GPU cases at 2, reported ignored with the reason where
    // there is no GPU for every rank).
    cargo(&["test", "--workspace", "--no-fail-fast"])
}

/// A Unix that is not Linux, whose socket flags differ (MSG_DONTWAIT is Linux's MSG_WAITALL
/// elsewhere): dist-tcp must build there too. Needs that target's standard library, which
/// `.ci/run` installs where rustup can fetch it; skipped (and said so) where it cannot.
const OTHER_UNIX: &str = "x86_64-unknown-freebsd";

fn check_other_unix() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(root())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == OTHER_UNIX)
        })
        .unwrap_or(false);
    if !installed {
        println!(
            "skipped: cargo check -p dist-tcp --target {OTHER_UNIX} (its standard library is not \
             installed: rustup target add {OTHER_UNIX})"
        );
        return Ok(());
    }
    cargo(&[
        "check",
        "-p",
        "dist-tcp",
        "--all-targets",
        "--target",
        OTHER_UNIX,
    ])
}

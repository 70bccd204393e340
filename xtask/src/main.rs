//! `cargo xtask`: the project's own tooling. `test-multirank` launches the multi-process tests,
//! `demo` runs the main job for a new user, `test` runs every test.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod launch;
mod multirank;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

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
    /// Point-to-point latency and throughput of two ranks beside a plain socket pair.
    BenchP2p,
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

/// Runs `cargo ARGS` in the workspace root and fails if it fails.
pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
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
        Cmd::Demo { ranks } => launch_release("dist-demo", ranks, Vec::new()),
        Cmd::Test => test(),
        Cmd::BenchP2p => launch_release("dist-p2p-bench", 2, Vec::new()),
    }
}

/// Builds a release binary of the multi-rank package and runs `ranks` ranks of it, rank 0's
/// output unprefixed.
fn launch_release(bin: &str, ranks: usize, args: Vec<String>) -> Result<()> {
    cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "dist-multirank",
        "--bin",
        bin,
    ])?;
    let job = launch::Job {
        program: release_dir().join(bin),
        args,
        world: ranks,
        timeout: std::time::Duration::from_secs(600),
        label: String::new(),
        env: Vec::new(),
        plain_rank0: true,
    };
    match launch::run(&job)? {
        launch::Outcome::Passed => Ok(()),
        launch::Outcome::Failed(why) => bail!("{bin} failed: {why}"),
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
    cargo(&["test", "--workspace"])?;
    multirank::run(&multirank::Args {
        world_sizes: vec![2, 3, 4, 5, 8],
        ..multirank::Args::default()
    })
}

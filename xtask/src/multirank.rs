//! `cargo xtask test-multirank`: builds a multi-rank test program in release mode (or takes it
//! from the bundle), then runs each case it lists as N local processes, at the world sizes the
//! case declares or those asked for, printing every rank's output as it comes. `cargo test`
//! runs the same cases through the `multirank` test target (tests/multirank/tests/multirank.rs);
//! this command is for a release build, other world sizes, and bundles on hosts with no Rust
//! toolchain.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use dist_launch::{self as launch, Outcome};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// World sizes to run (repeatable; default: each case's own, 2, 3, 4, 5, 8 for most TCP
    /// cases and 2 for the GPU cases). A case that works only at some sizes runs only at those.
    #[arg(short = 'n', long = "world-size")]
    pub world_sizes: Vec<usize>,
    /// Transport under test: tcp, or nccl (one process per GPU).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Seconds one case may take at one world size before every rank is killed.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Run only trials whose name (`CASE::nN`, `CASE::VARIANT::nN`) contains this.
    pub filter: Option<String>,
}

pub fn run(args: &Args) -> Result<()> {
    let bin = match args.backend.as_str() {
        "tcp" => "dist-multirank",
        "nccl" => "dist-nccl-tests",
        other => bail!("unknown backend {other:?} (tcp or nccl)"),
    };
    let program = crate::bundled_or_built(bin, &["-p", "dist-multirank", "--bin", bin], || {
        crate::release_dir().join(bin)
    })?;
    let mut trials = Vec::new();
    for listed in launch::list(&program).map_err(anyhow::Error::msg)? {
        for n in listed.sizes_for(&args.world_sizes) {
            let name = listed.trial_name(n);
            if args
                .filter
                .as_ref()
                .is_none_or(|f| name.contains(f.as_str()))
            {
                trials.push((
                    name,
                    listed.job(&program, n, Duration::from_secs(args.timeout), true),
                ));
            }
        }
    }
    if trials.is_empty() {
        bail!(
            "no trial matches {:?} at world sizes {:?}",
            args.filter,
            args.world_sizes
        );
    }
    let (mut passed, mut skipped, mut failed) = (0, 0, Vec::new());
    for (name, job) in &trials {
        let t = Instant::now();
        match launch::run(job).map_err(anyhow::Error::msg)? {
            Outcome::Passed => {
                passed += 1;
                println!("test {name} ... ok ({:.1?})", t.elapsed());
            }
            Outcome::Skipped(why) => {
                skipped += 1;
                println!("test {name} ... skipped: {why}");
            }
            Outcome::Failed(why) => {
                println!("test {name} ... FAILED: {why}");
                failed.push(format!("{name}: {why}"));
            }
        }
    }
    if !failed.is_empty() {
        println!("\nfailures:");
        for f in &failed {
            println!("    {f}");
        }
    }
    println!("{}", launch::summary(passed, skipped, failed.len()));
    if !failed.is_empty() {
        bail!("{} multi-rank trial(s) failed", failed.len());
    }
    Ok(())
}

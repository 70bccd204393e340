//! `cargo xtask test-multirank`: builds a multi-rank test program in release mode (or takes it
//! from the bundle), then runs each case it lists as N local processes, at the world sizes the
//! case declares or those asked for, printing every rank's output as it comes. `cargo test`
//! runs the same cases through the `multirank` test target (tests/multirank/tests/multirank.rs);
//! this command is for a release build, other world sizes, and bundles on hosts with no Rust
//! toolchain.
//!
//! `--hosts H` runs every trial on H simulated hosts: network namespaces joined by a bridge, made
//! for the trial and deleted after it (`dist_launch::hosts`; needs root and iproute2, else every
//! trial is reported skipped with the reason; `--delay-ms` and `--rate` shape the links between
//! them). Cases that declare hosts of their own
//! (`hosts2_…`, `hosts3_…`) run on them without `--hosts`.

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
    /// Spread each trial's ranks over this many simulated hosts (network namespaces; needs
    /// root and iproute2): blocks of consecutive ranks per host, MASTER_ADDR host 0's address.
    #[arg(long)]
    pub hosts: Option<usize>,
    /// With hosts: add this many milliseconds to every frame between hosts (a hub in the
    /// launcher instead of the bridge).
    #[arg(long, requires = "hosts")]
    pub delay_ms: Option<f64>,
    /// With hosts: cap what each host sends at this rate (1gbit, 100mbit; `tc tbf` on its
    /// link; needs tc, else every trial is reported skipped with the reason).
    #[arg(long, requires = "hosts")]
    pub rate: Option<launch::rate::Rate>,
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
                    args.hosts.or(listed.hosts),
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
    // Asked once, and only if some trial needs simulated hosts.
    let mut no_hosts: Option<Option<String>> = None;
    for (name, job, hosts) in &trials {
        let t = Instant::now();
        let outcome = match hosts {
            None => launch::run(job).map_err(anyhow::Error::msg)?,
            Some(h) => {
                let why = no_hosts.get_or_insert_with(|| match args.rate {
                    Some(_) => launch::rate::unavailable(),
                    None => launch::hosts::unavailable(),
                });
                match why {
                    Some(why) => Outcome::Skipped(why.clone()),
                    None if job.world < *h => {
                        Outcome::Skipped(format!("{} ranks cannot fill {h} hosts", job.world))
                    }
                    None => {
                        let hosts = crate::simulated_hosts(*h, args.delay_ms, args.rate)?;
                        launch::run_on(job, Some(&hosts)).map_err(anyhow::Error::msg)?
                    }
                }
            }
        };
        match outcome {
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

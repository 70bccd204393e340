//! `cargo xtask test-multirank`: builds the multi-rank test program once, then runs each of its
//! cases as N local processes for every world size asked for.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::{self, Job, Outcome};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// World sizes to run (repeatable; default 2, 3, 4, 8 for tcp, 2 for nccl).
    #[arg(short = 'n', long = "world-size")]
    pub world_sizes: Vec<usize>,
    /// Transport under test: tcp, or nccl (one process per GPU).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Seconds one case may take at one world size before every rank is killed.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Run only cases whose name contains this.
    pub filter: Option<String>,
    /// Extra environment for every rank (set by `cargo xtask test`, not on the command line).
    #[arg(skip)]
    pub env: Vec<(String, String)>,
}

impl Default for Args {
    fn default() -> Args {
        Args {
            world_sizes: Vec::new(),
            backend: "tcp".into(),
            timeout: 300,
            filter: None,
            env: Vec::new(),
        }
    }
}

pub fn run(args: &Args) -> Result<()> {
    let (bin, default_sizes): (&str, &[usize]) = match args.backend.as_str() {
        "tcp" => ("dist-multirank", &[2, 3, 4, 8]),
        "nccl" => ("dist-nccl-tests", &[2]),
        other => bail!("unknown backend {other:?} (tcp or nccl)"),
    };
    let world_sizes = if args.world_sizes.is_empty() {
        default_sizes.to_vec()
    } else {
        args.world_sizes.clone()
    };
    let program = crate::bundled_or_built(bin, &["-p", "dist-multirank", "--bin", bin], || {
        crate::release_dir().join(bin)
    })?;
    let listed = std::process::Command::new(&program)
        .arg("--list")
        .output()
        .with_context(|| format!("list the cases of {}", program.display()))?;
    let cases: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_owned)
        .filter(|c| args.filter.as_ref().is_none_or(|f| c.contains(f.as_str())))
        .collect();
    if cases.is_empty() {
        bail!("no case matches {:?}", args.filter);
    }
    let (mut passed, mut skipped, mut failed) = (0, 0, Vec::new());
    for &n in &world_sizes {
        for case in &cases {
            let job = Job {
                program: program.clone(),
                args: vec![case.clone()],
                world: n,
                timeout: Duration::from_secs(args.timeout),
                label: format!("{case} n={n} "),
                env: rank_env(&args.env),
                plain_rank0: false,
            };
            let t = Instant::now();
            match launch::run(&job)? {
                Outcome::Passed => {
                    passed += 1;
                    println!("test {case} (world size {n}) ... ok ({:.1?})", t.elapsed());
                }
                Outcome::Skipped => {
                    skipped += 1;
                    println!("test {case} (world size {n}) ... skipped");
                }
                Outcome::Failed(why) => {
                    println!("test {case} (world size {n}) ... FAILED: {why}");
                    failed.push(format!("{case} (world size {n}): {why}"));
                }
            }
        }
    }
    if !failed.is_empty() {
        println!("\nfailures:");
        for f in &failed {
            println!("    {f}");
        }
    }
    println!("{}", summary(passed, skipped, failed.len()));
    if !failed.is_empty() {
        bail!("{} multi-rank case(s) failed", failed.len());
    }
    Ok(())
}

/// The environment of every rank: `extra`, and a fixed glibc mmap threshold. Some cases
/// (`flow_unexpected`, `hostile_peer`) check their peak RSS against dist's unexpected-message
/// budget; with glibc's default, the threshold rises after the first large block is freed, so
/// later 1 MiB messages come from a heap that keeps freed memory, and the high-water mark then
/// measures the allocator's retention (seen: 111 MiB at world size 8 for 64 MiB queued), not what
/// dist holds. A fixed threshold returns every freed large block to the system.
fn rank_env(extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env = vec![(
        "MALLOC_MMAP_THRESHOLD_".to_string(),
        (128 << 10).to_string(),
    )];
    env.extend(extra.iter().cloned());
    env
}

/// The last line of a run: a skipped case is counted apart, never as passed.
fn summary(passed: usize, skipped: usize, failed: usize) -> String {
    format!("{passed} passed, {skipped} skipped, {failed} failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_skipped_cases_apart() {
        assert_eq!(summary(3, 0, 0), "3 passed, 0 skipped, 0 failed");
        assert_eq!(summary(5, 2, 1), "5 passed, 2 skipped, 1 failed");
    }
}

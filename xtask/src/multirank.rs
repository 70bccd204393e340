//! `cargo xtask test-multirank`: builds the multi-rank test program once, then runs each of its
//! cases as N local processes for every world size asked for.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::{self, Job, Outcome};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// World sizes to run (repeatable).
    #[arg(short = 'n', long = "world-size", default_values_t = [2, 3, 4, 8])]
    pub world_sizes: Vec<usize>,
    /// Transport under test.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Seconds one case may take at one world size before every rank is killed.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Run only cases whose name contains this.
    pub filter: Option<String>,
}

impl Default for Args {
    fn default() -> Args {
        Args {
            world_sizes: vec![2, 3, 4, 8],
            backend: "tcp".into(),
            timeout: 300,
            filter: None,
        }
    }
}

pub fn run(args: &Args) -> Result<()> {
    if args.backend != "tcp" {
        bail!("unknown backend {:?} (this build knows: tcp)", args.backend);
    }
    crate::cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "dist-multirank",
        "--bin",
        "dist-multirank",
    ])?;
    let program = crate::release_dir().join("dist-multirank");
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
    let (mut passed, mut failed) = (0, Vec::new());
    for &n in &args.world_sizes {
        for case in &cases {
            let job = Job {
                program: program.clone(),
                args: vec![case.clone()],
                world: n,
                timeout: Duration::from_secs(args.timeout),
                label: format!("{case} n={n} "),
                env: Vec::new(),
                plain_rank0: false,
            };
            let t = Instant::now();
            match launch::run(&job)? {
                Outcome::Passed => {
                    passed += 1;
                    println!("test {case} (world size {n}) ... ok ({:.1?})", t.elapsed());
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
    println!("{passed} passed, {} failed", failed.len());
    if !failed.is_empty() {
        bail!("{} multi-rank case(s) failed", failed.len());
    }
    Ok(())
}

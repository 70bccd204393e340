//! `cargo xtask plot`: docs/benchmarks.md's plots (docs/plots/*.png), drawn from the raw files
//! under docs/results/ by tools/plot/plot.py with matplotlib.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// What to draw and with which Python.
#[derive(clap::Args)]
pub struct Args {
    /// The Python that has matplotlib (a virtual environment's `bin/python`, for example).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Print each figure's markdown tables (the medians, ratios and bus bandwidths) instead
    /// of drawing; needs no matplotlib.
    #[arg(long)]
    tables: bool,
    /// One figure by name (gpu-nccl, openmpi-tcp, openmpi-shm, gloo, many-ranks, store).
    #[arg(long)]
    only: Option<String>,
}

/// The command line that installs matplotlib where the system's Python has none.
const INSTALL: &str = "python3 -m venv ~/plot-venv && ~/plot-venv/bin/pip install matplotlib";

/// Runs the plotting script from the workspace root, after checking that `python` has
/// matplotlib when it is to draw.
pub fn run(a: &Args) -> Result<()> {
    let root = crate::root();
    if !a.tables {
        let has = Command::new(&a.python)
            .args(["-c", "import matplotlib"])
            .output()
            .with_context(|| format!("run {}", a.python.display()))?;
        if !has.status.success() {
            bail!(
                "{} has no matplotlib. Install it, for example:\n    {INSTALL}\nthen run:\n    \
                 cargo xtask plot --python ~/plot-venv/bin/python",
                a.python.display()
            );
        }
    }
    let mut cmd = Command::new(&a.python);
    cmd.arg("tools/plot/plot.py").current_dir(&root);
    if a.tables {
        cmd.arg("--tables");
    }
    if let Some(name) = &a.only {
        cmd.args(["--only", name]);
    }
    let status = cmd
        .status()
        .with_context(|| format!("run {} tools/plot/plot.py", a.python.display()))?;
    if !status.success() {
        bail!("tools/plot/plot.py failed ({status})");
    }
    Ok(())
}

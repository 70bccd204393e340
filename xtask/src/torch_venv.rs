//! `cargo xtask torch-venv`: prepares (or reuses) a Python virtual environment with PyTorch,
//! outside the repository, for dist-store's interop tests and load benchmark, and prints its
//! python's path (on stdout, alone, so that `DIST_TORCH_PYTHON=$(cargo xtask torch-venv)` works).
//! Two releases are tested: [`DEFAULT`] and [`NEWEST`] (`--torch newest`), each in a venv of
//! its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The release the interop tests and the torchrun tests use by default (the lent GPU hosts have
/// it too).
pub const DEFAULT: &str = "2.11.0";
/// The newest release on the package registry that dist is tested against (`--torch newest`);
/// CI runs the interop tests with it as well.
pub const NEWEST: &str = "2.15.0";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Where the environment lives (default: `$DIST_TORCH_VENV` for the default release, else
    /// `$XDG_CACHE_HOME/dist/torch-venv-VERSION`, else `~/.cache/dist/torch-venv-VERSION`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The torch release to install: a version, or `newest` (the newest release dist is
    /// tested against).
    #[arg(long, default_value = DEFAULT)]
    pub torch: String,
    /// The python that creates the environment.
    #[arg(long, default_value = "python3")]
    pub python: String,
}

fn default_dir(version: &str) -> Result<PathBuf> {
    // `DIST_TORCH_VENV` names the default release's venv: another release installed there
    // would replace it.
    if let Some(d) = std::env::var_os("DIST_TORCH_VENV").filter(|d| !d.is_empty())
        && version == DEFAULT
    {
        return Ok(PathBuf::from(d));
    }
    let cache = match std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cache"),
    };
    Ok(cache.join("dist").join(format!("torch-venv-{version}")))
}

/// The torch version `python` imports, if it imports torch at all.
fn torch_version(python: &Path) -> Option<String> {
    let out = Command::new(python)
        .args([
            "-c",
            "import torch, torch.distributed as d; d.TCPStore; print(torch.__version__)",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn run(args: &Args) -> Result<()> {
    let mut args = args.clone();
    if args.torch == "newest" {
        args.torch = NEWEST.to_string();
    }
    let args = &args;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => default_dir(&args.torch)?,
    };
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    if dir.starts_with(crate::root()) {
        bail!(
            "{} is inside the repository; keep the environment (4-5 GB) outside it",
            dir.display()
        );
    }
    let python = dir.join("bin").join("python");
    // The local part of "2.11.0+cu130" is the build; the release is what was asked for.
    let wanted = |v: &str| v.split('+').next() == Some(args.torch.as_str());
    if let Some(v) = torch_version(&python) {
        if wanted(&v) {
            eprintln!("torch-venv: reusing {} (torch {v})", dir.display());
            println!("{}", python.display());
            return Ok(());
        }
        eprintln!(
            "torch-venv: {} has torch {v}, not {}; installing over it",
            dir.display(),
            args.torch
        );
    }
    if !python.exists() {
        eprintln!("torch-venv: creating {}", dir.display());
        std::fs::create_dir_all(dir.parent().unwrap_or(Path::new("/")))?;
        let ok = Command::new(&args.python)
            .args(["-m", "venv"])
            .arg(&dir)
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("running {} -m venv", args.python))?
            .success();
        if !ok {
            bail!("{} -m venv {} failed", args.python, dir.display());
        }
    }
    eprintln!(
        "torch-venv: pip install torch=={} (about 5 GB with its CUDA libraries)",
        args.torch
    );
    // pip's own output goes to stderr, so stdout carries the python's path alone.
    let ok = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet"])
        .arg(format!("torch=={}", args.torch))
        .stdout(std::io::stderr())
        .status()
        .context("running pip")?
        .success();
    if !ok {
        bail!(
            "pip install torch=={} into {} failed",
            args.torch,
            dir.display()
        );
    }
    match torch_version(&python) {
        Some(v) if wanted(&v) => {
            println!("{}", python.display());
            Ok(())
        }
        other => bail!(
            "after installing, {} imports torch {:?}, not {}",
            python.display(),
            other,
            args.torch
        ),
    }
}

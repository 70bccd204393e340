//! `cargo xtask bundle`: the test and bench binaries, this launcher and a manifest in one folder
//! that runs, by one command, on a host with no Rust toolchain (GPU hosts often have none).
//!
//! `FOLDER/run ARGS…` runs `xtask ARGS…` with `DIST_BUNDLE_DIR` set, so that the launcher runs
//! the bundled binaries instead of building them: `FOLDER/run test-multirank --backend nccl`,
//! `FOLDER/run perf --backend nccl --op all_reduce -n 2 -b 8 -e 1G -f 4`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

const BINS: &[&str] = &[
    "dist-multirank",
    "dist-nccl-tests",
    "dist-nccl-perf",
    "dist-perf",
    "dist-demo",
    "dist-p2p-bench",
    "dist-overlap-bench",
];

pub fn run(out: Option<PathBuf>) -> Result<()> {
    let out = out.unwrap_or_else(|| crate::root().join("bundle"));
    crate::cargo(&[
        "build",
        "--release",
        "-p",
        "dist-multirank",
        "-p",
        "dist-tools",
        "--bins",
    ])?;
    crate::cargo(&["build", "--release", "-p", "xtask"])?;
    crate::cargo(&[
        "build",
        "--release",
        "-p",
        "dist-hybrid",
        "--example",
        "train",
    ])?;
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let mut manifest =
        String::from("# dist bundle: run `./run ARGS` (xtask's commands) on the target host\n");
    let git = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(crate::root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    manifest += &format!("commit {git}\n");
    for bin in BINS.iter().copied().chain(["xtask"]) {
        let src = crate::release_dir().join(bin);
        let dst = out.join(bin);
        std::fs::copy(&src, &dst).with_context(|| format!("copy {}", src.display()))?;
        // Keep the bundle small: no symbols.
        let _ = Command::new("strip").arg(&dst).status();
        let len = std::fs::metadata(&dst)?.len();
        manifest += &format!("{bin} {len}\n");
    }
    // The criterion benchmark of the NCCL collectives, as cargo builds it (deps/nccl-HASH).
    crate::cargo(&["bench", "-p", "dist-benches", "--bench", "nccl", "--no-run"])?;
    let deps = crate::release_dir().join("deps");
    let newest = std::fs::read_dir(&deps)?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("nccl-") && !name.contains('.')
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .with_context(|| format!("no nccl benchmark binary in {}", deps.display()))?;
    let bench = out.join("nccl-bench");
    std::fs::copy(newest.path(), &bench)?;
    let _ = Command::new("strip").arg(&bench).status();
    manifest += &format!("nccl-bench {}\n", std::fs::metadata(&bench)?.len());
    let train = out.join("train");
    std::fs::copy(crate::release_dir().join("examples/train"), &train)?;
    let _ = Command::new("strip").arg(&train).status();
    manifest += &format!("train {}\n", std::fs::metadata(&train)?.len());
    let peer = crate::root().join("benches/peers/torch_allreduce.py");
    std::fs::copy(&peer, out.join("torch_allreduce.py"))?;
    manifest += "torch_allreduce.py\n";
    let run = out.join("run");
    std::fs::write(
        &run,
        "#!/usr/bin/env bash\n# Runs the bundled launcher on the bundled binaries.\nset -euo pipefail\n\
         here=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\nexport DIST_BUNDLE_DIR=\"$here\"\n\
         export NCCL_NVLS_ENABLE=0\nexec \"$here/xtask\" \"$@\"\n",
    )?;
    let _ = Command::new("chmod")
        .args(["+x", &run.to_string_lossy()])
        .status();
    std::fs::write(out.join("MANIFEST"), manifest)?;
    println!(
        "bundle in {}: run `{}/run test-multirank --backend nccl`",
        out.display(),
        out.display()
    );
    Ok(())
}

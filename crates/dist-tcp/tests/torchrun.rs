//! Jobs torchrun launches: Rust ranks (the `mixed_store` example) form through the store
//! torchrun's agent serves on MASTER_PORT, alone and beside a Python rank that trades keys with
//! them through `torch.distributed.TCPStore`. Runs where a python with torch is found
//! (`DIST_TORCH_PYTHON`, else `$DIST_TORCH_VENV/bin/python`, else `python3`); elsewhere each
//! case is reported ignored, with "skipped: <reason>" printed first, never passed. (A harness
//! of its own, libtest-mimic's: libtest cannot report a skip.)

use std::path::PathBuf;
use std::process::Command;

use libtest_mimic::{Arguments, Trial};

/// A python that imports torch.distributed, or why there is none.
fn torch_python() -> Result<String, String> {
    let py = match (
        std::env::var("DIST_TORCH_PYTHON"),
        std::env::var("DIST_TORCH_VENV"),
    ) {
        (Ok(p), _) if !p.is_empty() => p,
        (_, Ok(v)) if !v.is_empty() => format!("{v}/bin/python"),
        _ => "python3".into(),
    };
    match Command::new(&py)
        .args(["-c", "import torch.distributed.run"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(py),
        Ok(o) => Err(format!(
            "{py} cannot import torch.distributed.run ({}); set DIST_TORCH_PYTHON (`cargo xtask \
             torch-venv` prints one)",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("{py} does not run: {e}")),
    }
}

/// The example binary, which `cargo test` builds beside this test (`target/<profile>/examples`).
fn example() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .ok_or("no target directory")?;
    let p = dir.join("examples").join("mixed_store");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is not built (cargo test builds it; cargo build --example mixed_store)",
            p.display()
        ))
    }
}

/// Runs torchrun (`python -m torch.distributed.run --standalone`) with `args`; returns its
/// output, or panics with it if the job failed.
fn torchrun(py: &str, nproc: usize, args: &[&str]) -> String {
    let out = Command::new(py)
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            &nproc.to_string(),
        ])
        .args(args)
        // Both bound the job: dist's formation (the agent waits for its workers).
        .env("DIST_INIT_TIMEOUT", "60")
        .env("DIST_TIMEOUT", "60")
        .output()
        .expect("start torchrun");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "torchrun failed: {}\n{text}",
        out.status
    );
    text
}

/// Three Rust ranks under torchrun: they form through its agent's store (keys under
/// `dist/<run id>/attempt_0`), on the one port torchrun gave, and all_reduce.
fn rust_ranks_form_through_torchruns_store(py: &str) {
    let bin = example().unwrap();
    let out = torchrun(py, 3, &["--no-python", bin.to_str().unwrap()]);
    for r in 0..3 {
        let line = format!("rust rank {r} of 3: formed through the store at ");
        let l = out.lines().find(|l| l.starts_with(&line));
        let l = l.unwrap_or_else(|| panic!("no line for rank {r}:\n{out}"));
        assert!(
            l.contains("(keys under dist/") && l.contains("/attempt_0/0/user), all_reduce 6"),
            "{l}"
        );
    }
}

/// A Python rank and two Rust ranks in one torchrun job: the Python rank sets a key through
/// `torch.distributed.TCPStore`, each Rust rank reads it through dist and sets one back, which
/// the Python rank reads and checks.
fn python_and_rust_ranks_trade_keys(py: &str) {
    let bin = example().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/mixed_store.py");
    let out = torchrun(py, 3, &[script.to_str().unwrap(), bin.to_str().unwrap()]);
    for r in 0..2 {
        let want = format!("python rank 0 read: rust rank {r} read \"hello from python rank 0\"");
        assert!(out.contains(&want), "no {want:?} in:\n{out}");
        assert!(
            out.contains(&format!("rust rank {r} of 2: formed")),
            "rust rank {r}:\n{out}"
        );
    }
}

/// One case: given the python that runs torchrun.
type Case = fn(&str);

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let need = torch_python().and_then(|py| example().map(|_| py));
    if let Err(why) = &need
        && !args.list
    {
        eprintln!("skipped: {why}: every torchrun case is ignored here");
    }
    let cases: [(&str, Case); 2] = [
        (
            "rust_ranks_form_through_torchruns_store",
            rust_ranks_form_through_torchruns_store,
        ),
        (
            "python_and_rust_ranks_trade_keys",
            python_and_rust_ranks_trade_keys,
        ),
    ];
    let trials = cases
        .into_iter()
        .map(|(name, case)| {
            let py = need.clone().unwrap_or_default();
            let skip = py.is_empty();
            Trial::test(name, move || {
                case(&py);
                Ok(())
            })
            .with_ignored_flag(skip)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

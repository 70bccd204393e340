//! `cargo xtask package`: the published crates as crates.io would get them. It checks that every
//! crate under `crates/` is published with its metadata (and nothing else is), runs `cargo
//! publish --dry-run` for all of them at once (cargo packages them in dependency order and
//! builds each from its package against the others' packages), checks what each `.crate`
//! carries, then builds a program outside the workspace from the README's first Rust example
//! against the unpacked packages (`[patch.crates-io]`) and runs it as 4 ranks under the
//! packaged `dist-run`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{cargo, root};

/// Files every package must carry, besides its sources.
const EVERY_PACKAGE: [&str; 4] = ["Cargo.toml", "README.md", "LICENSE-MIT", "LICENSE-APACHE"];

/// Files particular packages must carry: what their builds and tests need.
const CARRIED: [(&str, &str); 7] = [
    ("dist-nccl-sys", "src/bindings.rs"),
    ("dist-nccl-sys", "cuda-stub/cuda_runtime.h"),
    ("dist-tcp", "tests/common/mod.rs"),
    ("dist-tcp", "examples/grid.rs"),
    ("dist-hybrid", "examples/train.rs"),
    ("dist-run", "tests/cli.rs"),
    ("dist-run", "src/main.rs"),
];

/// How many ranks run the README's example.
const RANKS: &str = "4";

/// One published crate.
#[derive(Debug)]
struct Published {
    name: String,
    version: String,
    /// The names of its normal dependencies.
    deps: Vec<String>,
}

impl Published {
    fn stem(&self) -> String {
        format!("{}-{}", self.name, self.version)
    }
}

/// Every step; see the module docs.
pub fn run() -> Result<()> {
    let published = check_metadata()?;
    let target = target_dir();
    // The dry run builds each package against the others as unpacked from a local registry,
    // all at version 0.1.0. Cargo takes a registry crate of a given version to be unchanging,
    // so in a shared target directory it would reuse what it built from an earlier run's
    // packages (a trait as it was then) and fail, or pass, on stale code. So the dry run has a
    // target directory of its own, where every `dist-*` artifact is a package's, and those
    // are removed first (the third-party ones are kept).
    let verify = target.join("publish-check");
    forget_packaged_builds(&verify.join("debug"))?;
    // Cargo also unpacks each package once into its registry source folder and, finding the
    // folder there, never unpacks that version again: an earlier run's sources would be built.
    forget_unpacked_sources(&cargo_home().join("registry").join("src"), &published)?;
    let verify_dir = verify.display().to_string();
    let mut args = vec!["publish", "--dry-run", "--allow-dirty", "--target-dir"];
    args.push(&verify_dir);
    for p in &published {
        args.extend(["-p", p.name.as_str()]);
    }
    cargo(&args)?;
    // The .crate files themselves (the dry run verified them; this only writes them out).
    let mut args = vec!["package", "--no-verify", "--allow-dirty"];
    for p in &published {
        args.extend(["-p", p.name.as_str()]);
    }
    cargo(&args)?;
    for p in &published {
        check_contents(
            p,
            &target.join("package").join(format!("{}.crate", p.stem())),
        )?;
    }
    readme_example(&published, &target)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Cargo's home: `CARGO_HOME`, else `~/.cargo`.
fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from(".cargo"))
}

/// Removes the unpacked sources of the packages in `published` (`NAME-VERSION` folders) from
/// every registry folder under `src` (cargo's `registry/src`), so that the dry run unpacks the
/// packages it just made rather than building an earlier run's.
fn forget_unpacked_sources(src: &Path, published: &[Published]) -> Result<()> {
    let Ok(registries) = std::fs::read_dir(src) else {
        return Ok(());
    };
    for registry in registries.flatten() {
        for p in published {
            let dir = registry.path().join(p.stem());
            if dir.is_dir() {
                std::fs::remove_dir_all(&dir)
                    .with_context(|| format!("remove {}", dir.display()))?;
            }
        }
    }
    Ok(())
}

/// Removes what a build in `profile_dir` made of the project's own crates (`dist-*`): their
/// fingerprints, build-script outputs and compiled files.
fn forget_packaged_builds(profile_dir: &Path) -> Result<()> {
    for sub in [".fingerprint", "build", "deps"] {
        let Ok(entries) = std::fs::read_dir(profile_dir.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ours = ["dist-", "dist_", "libdist_"]
                .iter()
                .any(|prefix| name.starts_with(prefix));
            if !ours {
                continue;
            }
            let path = e.path();
            let gone = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            gone.with_context(|| format!("remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// The published crates (every package under `crates/`), after checking that each has the
/// metadata crates.io and the docs site show and that every other package is unpublished.
fn check_metadata() -> Result<Vec<Published>> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root())
        .output()
        .context("run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("read cargo metadata")?;
    let crates_dir = root().join("crates");
    let mut problems = Vec::new();
    let mut published = Vec::new();
    for p in meta["packages"].as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or("?").to_string();
        let manifest = Path::new(p["manifest_path"].as_str().unwrap_or(""));
        // `publish`: null means any registry, [] none.
        let publishes = !matches!(&p["publish"], Value::Array(a) if a.is_empty());
        if !manifest.starts_with(&crates_dir) {
            if publishes {
                problems.push(format!(
                    "{name}: only crates under crates/ are published; say publish = false"
                ));
            }
            continue;
        }
        if !publishes {
            problems.push(format!(
                "{name}: every crate under crates/ is published; say publish = true and give it \
                 the metadata the others have"
            ));
        }
        for field in ["description", "license", "repository", "readme"] {
            if p[field].as_str().is_none_or(str::is_empty) {
                problems.push(format!("{name}: no {field}"));
            }
        }
        for field in ["keywords", "categories"] {
            if p[field].as_array().is_none_or(Vec::is_empty) {
                problems.push(format!("{name}: no {field}"));
            }
        }
        if p["metadata"]["docs"]["rs"].is_null() {
            problems.push(format!(
                "{name}: no [package.metadata.docs.rs] (the targets and features docs.rs builds)"
            ));
        }
        let deps = p["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect();
        published.push(Published {
            name,
            version: p["version"].as_str().unwrap_or("").to_string(),
            deps,
        });
    }
    if !problems.is_empty() {
        bail!("package metadata:\n  {}", problems.join("\n  "));
    }
    Ok(published)
}

/// The file names in a `.crate` (a gzipped tar of `NAME-VERSION/...`).
fn contents(file: &Path) -> Result<BTreeSet<String>> {
    let out = Command::new("tar")
        .arg("tzf")
        .arg(file)
        .output()
        .context("run tar")?;
    if !out.status.success() {
        bail!(
            "tar tzf {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('/').map(|(_, rest)| rest.to_string()))
        .collect())
}

/// The package carries its licenses, README and what its build and tests need.
fn check_contents(p: &Published, file: &Path) -> Result<()> {
    let have = contents(file)?;
    let wanted = EVERY_PACKAGE.iter().copied().chain(
        CARRIED
            .iter()
            .filter(|(n, _)| *n == p.name)
            .map(|(_, f)| *f),
    );
    let missing: Vec<&str> = wanted.filter(|f| !have.contains(*f)).collect();
    if !missing.is_empty() {
        bail!("{} does not carry {missing:?}", file.display());
    }
    println!(
        "{}: {} files, licenses and README among them",
        p.stem(),
        have.len()
    );
    Ok(())
}

/// The README's first Rust block that has a `main`.
fn example_from_readme() -> Result<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).context("read README.md")?;
    let mut block = None;
    let mut lines = readme.lines();
    while let Some(l) = lines.next() {
        if l.trim_start().starts_with("```rust") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            let body = body.join("\n");
            if body.contains("fn main") {
                block = Some(body);
                break;
            }
        }
    }
    block.context("README.md has no ```rust block with a fn main")
}

/// Builds the README's example outside the workspace, against the unpacked packages, and runs
/// it as [`RANKS`] ranks under the packaged dist-run.
fn readme_example(published: &[Published], target: &Path) -> Result<()> {
    let source = example_from_readme()?;
    let dir = target.join("package-check");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
    }
    let crates = dir.join("crates");
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::create_dir_all(&crates)?;
    // The crates the example names, and those they depend on: the ones to patch.
    let named = |p: &Published| source.contains(&p.name.replace('-', "_"));
    let mut used: BTreeSet<&str> = published
        .iter()
        .filter(|p| named(p) || p.name == "dist-run")
        .map(|p| p.name.as_str())
        .collect();
    loop {
        let more: Vec<&str> = published
            .iter()
            .filter(|p| used.contains(p.name.as_str()))
            .flat_map(|p| p.deps.iter().map(String::as_str))
            .filter(|d| published.iter().any(|p| p.name == *d) && !used.contains(d))
            .collect();
        if more.is_empty() {
            break;
        }
        used.extend(more);
    }
    let mut deps = String::new();
    let mut patch = String::new();
    for p in published.iter().filter(|p| used.contains(p.name.as_str())) {
        let file = target.join("package").join(format!("{}.crate", p.stem()));
        let status = Command::new("tar")
            .arg("xzf")
            .arg(&file)
            .arg("-C")
            .arg(&crates)
            .status()
            .context("run tar")?;
        if !status.success() {
            bail!("tar xzf {} failed ({status})", file.display());
        }
        patch.push_str(&format!(
            "{} = {{ path = \"crates/{}\" }}\n",
            p.name,
            p.stem()
        ));
        if named(p) {
            deps.push_str(&format!("{} = \"={}\"\n", p.name, p.version));
        }
    }
    let run = published
        .iter()
        .find(|p| p.name == "dist-run")
        .context("dist-run is not among the published crates")?;
    // A workspace of its own: the example and the packaged dist-run (for its binary).
    let manifest = format!(
        "[package]\nname = \"readme-example\"\nversion = \"0.0.0\"\nedition = \"2024\"\n\
         publish = false\n\n[dependencies]\n{deps}\n[patch.crates-io]\n{patch}\n\
         [workspace]\nmembers = [\".\", \"crates/{}\"]\n",
        run.stem()
    );
    std::fs::write(dir.join("Cargo.toml"), manifest)?;
    std::fs::write(dir.join("src/main.rs"), &source)?;
    // The workspace's versions of everything else, so the example builds what CI tests.
    std::fs::copy(root().join("Cargo.lock"), dir.join("Cargo.lock"))?;
    // Beside the example, not in it, so that a second run reuses what the first built.
    let build_dir = target.join("package-check-build");
    let cargo_bin = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!(
        "$ cargo build (in {}) -p readme-example -p dist-run",
        dir.display()
    );
    let status = Command::new(&cargo_bin)
        .args(["build", "-p", "readme-example", "-p", "dist-run"])
        .env("CARGO_TARGET_DIR", &build_dir)
        .current_dir(&dir)
        .status()
        .context("run cargo")?;
    if !status.success() {
        bail!(
            "the README's example does not build against the packages ({status}); see {}",
            dir.display()
        );
    }
    let bin = build_dir.join("debug");
    eprintln!("$ dist-run -n {RANKS} readme-example (both from the packages)");
    let status = Command::new(bin.join("dist-run"))
        .args(["-n", RANKS, "--timeout", "300", "--"])
        .arg(bin.join("readme-example"))
        .status()
        .context("run the packaged dist-run")?;
    if !status.success() {
        bail!("the README's example, built from the packages, failed under dist-run ({status})");
    }
    println!(
        "the README's example, built outside the workspace from the packages, ran as {RANKS} ranks"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Published, forget_unpacked_sources};

    /// An earlier run's unpacked package (the same name and version) is removed from every
    /// registry folder, so the dry run unpacks the new one; other crates stay. Without the
    /// removal the dry run built a stale dist-store (a `use polling` its new sources no longer
    /// have) and failed.
    #[test]
    fn earlier_unpacked_packages_are_forgotten() {
        let src = std::env::temp_dir().join(format!("dist-xtask-src-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&src);
        for dir in [
            "-a1/dist-store-0.1.0/src",
            "-b2/dist-store-0.1.0",
            "-a1/other-1.0.0",
        ] {
            std::fs::create_dir_all(src.join(dir)).unwrap();
        }
        let published = [Published {
            name: "dist-store".into(),
            version: "0.1.0".into(),
            deps: vec![],
        }];
        forget_unpacked_sources(&src, &published).unwrap();
        assert!(!src.join("-a1/dist-store-0.1.0").exists());
        assert!(!src.join("-b2/dist-store-0.1.0").exists());
        assert!(src.join("-a1/other-1.0.0").is_dir());
        // A missing registry folder is no error.
        forget_unpacked_sources(&src.join("none"), &published).unwrap();
        std::fs::remove_dir_all(&src).unwrap();
    }
}

//! Tidy tests: the docs kept true by the code, as rust-analyzer's `tidy.rs` does it. Each test
//! reads the repository's own files, so that `cargo test` fails when a doc and the code part:
//! a path a doc names that does not exist, a protocol version the handshake does not speak, a
//! source file without its `//!` line; in `tidy_names.rs`, a variable or API item a doc names
//! that the code does not define, a variable without its one row in `docs/config.md`; in
//! `tidy_figures.rs`, a figure a doc quotes from a raw result file that the file does not hold; in
//! `tidy_nccl.rs`, an NCCL function that `dist-nccl-sys`'s version table and the calls disagree on.

#[path = "tidy_counters.rs"]
mod counters;
#[path = "tidy_figures.rs"]
mod figures;
#[path = "tidy_names.rs"]
mod names;
#[path = "tidy_nccl.rs"]
mod nccl;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Files the tests flag that their owners fix (each entry says why it is here). A listed file
/// that no longer fails makes the test fail too, so that this list only shrinks.
const KNOWN: &[(&str, &str)] = &[];

/// The repository's files, as `git` sees them (tracked, and untracked but not ignored), with
/// `/` separators, relative to the root.
fn files() -> Vec<String> {
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(crate::root())
        .output()
        .expect("run git ls-files (the tidy tests read the repository's files)");
    assert!(out.status.success(), "git ls-files failed: {out:?}");
    String::from_utf8(out.stdout)
        .expect("UTF-8 file names")
        .split('\0')
        .filter(|p| !p.is_empty() && crate::root().join(p).exists())
        .map(str::to_owned)
        .collect()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(crate::root().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The docs whose statements these tests check: the README and `docs/*.md` (not the results
/// folders, which record runs as they were).
fn docs(files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| {
            *f == "README.md"
                || (f.starts_with("docs/") && f.ends_with(".md") && f.matches('/').count() == 1)
        })
        .cloned()
        .collect()
}

/// Fails with every finding, less the [`KNOWN`] ones of `check`; fails too on a [`KNOWN`] entry
/// of `check` that was not found.
fn report(check: &str, found: Vec<String>) {
    let known: Vec<&str> = KNOWN
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{check}: ")))
        .map(|(k, _)| *k)
        .collect();
    let new: Vec<&String> = found
        .iter()
        .filter(|f| !known.contains(&f.as_str()))
        .collect();
    let fixed: Vec<&&str> = known
        .iter()
        .filter(|k| !found.iter().any(|f| f == *k))
        .collect();
    assert!(
        new.is_empty() && fixed.is_empty(),
        "{check}:\n  found:\n    {}\n  listed in tidy.rs's KNOWN but no longer found (remove them):\n    {}",
        new.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n    "),
        fixed.iter().map(|s| **s).collect::<Vec<_>>().join("\n    "),
    );
}

/// The words of `text` that may be paths: runs of path characters, trailing punctuation cut.
fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || "_./*-".contains(c)))
        .map(|w| w.trim_end_matches(['.', '-']))
        .filter(|w| !w.is_empty())
}

/// Whether `word` names a file or folder of the repository (see
/// [`every_path_a_doc_names_exists`]), or `None` when it is not read as a repository path.
fn names_existing_path(word: &str, files: &[String], top: &BTreeSet<&str>) -> Option<bool> {
    if word.starts_with("./") || word.starts_with("../") {
        return None; // ../shared/…, ./run: outside the repository, or relative to a folder
    }
    let first = word.split('/').next().unwrap_or_default();
    let rooted = word.contains('/') && top.contains(first);
    let source = [".rs", ".md", ".toml", ".sh", ".py"]
        .iter()
        .any(|e| word.ends_with(e));
    if !rooted && !source && !top.contains(word) {
        return None;
    }
    // `final-*`: some file starts with the part before the star.
    let (stem, glob) = match word.find('*') {
        Some(i) => (&word[..i], true),
        None => (word, false),
    };
    let dir = stem.ends_with('/');
    Some(files.iter().any(|f| {
        let at = |p: &str| {
            if glob || dir {
                p.starts_with(stem)
            } else {
                p == stem || p.starts_with(&format!("{stem}/"))
            }
        };
        // A rooted path from the root; a bare name (`peer.rs`, `examples/train.rs`) anywhere.
        at(f) || (!rooted && f.match_indices('/').any(|(i, _)| at(&f[i + 1..])))
    }))
}

/// Every repository path the README, `docs/*.md` and the Rust sources' comments name exists: a word that starts with a
/// top-level entry of the repository and a `/` (`crates/…`, `docs/results/…/`, `.ci/run`) from
/// the root, a file name ending in `.rs`, `.md`, `.toml`, `.sh` or `.py` (`peer/slots.rs`,
/// `DESIGN.md`) as the end of some path; `*` matches the rest of a name.
#[test]
fn every_path_a_doc_names_exists() {
    let files = files();
    let top: BTreeSet<&str> = files
        .iter()
        .map(|f| f.split('/').next().unwrap_or_default())
        .collect();
    assert!(top.contains("crates") && top.contains("docs"), "{top:?}");
    let mut found = Vec::new();
    let mut checked = 0;
    // The docs, and the comments of the Rust sources (not the tidy tests' own, which name
    // missing paths on purpose).
    let rust = files
        .iter()
        .filter(|f| f.ends_with(".rs") && !f.starts_with("xtask/src/tidy"));
    for doc in docs(&files).iter().chain(rust) {
        let comments_only = doc.ends_with(".rs");
        for (n, line) in read(doc).lines().enumerate() {
            if comments_only && !line.trim_start().starts_with("//") {
                continue;
            }
            for word in words(line) {
                match names_existing_path(word, &files, &top) {
                    Some(true) => checked += 1,
                    Some(false) => found.push(format!(
                        "paths: {doc}:{} names {word}, which does not exist",
                        n + 1
                    )),
                    None => {}
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} paths checked: is the scan broken?"
    );
    report("paths", found);
}

/// The protocol version dist-tcp's handshake speaks: its `PROTOCOL_VERSION` constant.
fn protocol_version(files: &[String]) -> u16 {
    let decl = "const PROTOCOL_VERSION: u16 =";
    let values: Vec<u16> = files
        .iter()
        .filter(|f| f.starts_with("crates/dist-tcp/src/") && f.ends_with(".rs"))
        .flat_map(|f| {
            read(f)
                .lines()
                .filter_map(|l| {
                    let v = l.split(decl).nth(1)?;
                    Some(v.trim().trim_end_matches(';').trim().parse().unwrap())
                })
                .collect::<Vec<u16>>()
        })
        .collect();
    assert_eq!(values.len(), 1, "one `{decl}` in dist-tcp: {values:?}");
    values[0]
}

/// The numbers that follow "protocol version" in `text` ("protocol version 4", "protocol
/// version (4)"); none where no number follows.
fn stated_versions(text: &str) -> Vec<u16> {
    let text = text.replace('\n', " ");
    text.to_ascii_lowercase()
        .match_indices("protocol version")
        .filter_map(|(i, m)| {
            let after = text[i + m.len()..]
                .trim_start()
                .trim_start_matches(['(', '`']);
            let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// `docs/architecture.md` states the protocol version dist-tcp speaks, and no doc states
/// another.
#[test]
fn the_docs_state_the_codes_protocol_version() {
    let files = files();
    let version = protocol_version(&files);
    assert!(
        !stated_versions(&read("docs/architecture.md")).is_empty(),
        "docs/architecture.md states no protocol version (\"protocol version (N)\")"
    );
    let found = docs(&files)
        .iter()
        .flat_map(|d| {
            stated_versions(&read(d))
                .into_iter()
                .filter(|v| *v != version)
                .map(move |v| format!("version: {d} states protocol version {v}, not {version}"))
        })
        .collect();
    report("version", found);
}

/// What is wrong with `readme` as the one page to start: longer than [`README_LINES`], or its
/// first lines after the title are not the two commands.
fn readme_problems(readme: &str) -> Vec<String> {
    let mut found = Vec::new();
    let lines = readme.lines().count();
    if lines > README_LINES {
        found.push(format!(
            "readme: README.md has {lines} lines, over {README_LINES}: move reference to docs/"
        ));
    }
    let commands: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("```"))
        .skip(1)
        .take(2)
        .collect();
    let first = |l: &&str, c: &str| l.starts_with(c);
    if commands.len() != 2
        || !first(&commands[0], "cargo xtask demo")
        || !first(&commands[1], "cargo xtask test")
    {
        found.push(format!(
            "readme: README.md's first block does not start with `cargo xtask demo` and `cargo xtask test`: {commands:?}"
        ));
    }
    found
}

/// The most lines the README may have: it is one page to start, and the reference is in `docs/`.
const README_LINES: usize = 120;

/// The README is one page, and its first block is the two commands to try.
#[test]
fn the_readme_is_one_page_that_starts_with_the_two_commands() {
    report("readme", readme_problems(&read("README.md")));
}

/// Every Rust source file starts with a `//!` line saying what it is for (the generated
/// bindings too: `cargo xtask bindgen` writes one).
#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let files = files();
    let rust: Vec<&String> = files.iter().filter(|f| f.ends_with(".rs")).collect();
    assert!(
        rust.len() > 50,
        "{} Rust files: is the scan broken?",
        rust.len()
    );
    let found = rust
        .iter()
        .filter(|f| !read(f).starts_with("//!"))
        .map(|f| format!("module docs: {f} does not start with `//!`"))
        .collect();
    report("module docs", found);
}

#[test]
fn the_scanners_read_what_the_docs_write() {
    assert!(readme_problems("# d\n\n```sh\ncargo xtask demo\ncargo xtask test\n```\n").is_empty());
    assert_eq!(
        readme_problems("# d\n```sh\ncargo xtask test\ncargo xtask demo\n```\n").len(),
        1
    );
    assert_eq!(readme_problems(&"x\n".repeat(121)).len(), 2);
    assert_eq!(
        stated_versions("the Protocol version (4), protocol\nversion 12 and protocol versions"),
        vec![4, 12]
    );
    let files: Vec<String> = ["crates/a/src/peer/rx.rs", "docs/results/r1/final-1.txt"]
        .map(String::from)
        .to_vec();
    let top = BTreeSet::from(["crates", "docs"]);
    let exists = |w| names_existing_path(w, &files, &top);
    assert_eq!(exists("peer/rx.rs"), Some(true));
    assert_eq!(exists("rx.rs"), Some(true));
    assert_eq!(exists("x.rs"), Some(false));
    assert_eq!(exists("DESIGN.md"), Some(false));
    assert_eq!(exists("crates/a/src"), Some(true));
    assert_eq!(exists("crates/a/sr"), Some(false));
    assert_eq!(exists("docs/results/r1/"), Some(true));
    assert_eq!(exists("docs/results/r1/final-*"), Some(true));
    assert_eq!(exists("docs/results/r2/"), Some(false));
    assert_eq!(exists("target/release/x"), None);
    assert_eq!(exists("../shared/anchors/README.md"), None);
    assert_eq!(exists("./run"), None);
    let w: Vec<&str> = words("see `crates/a.rs`, then (docs/x.md).").collect();
    assert_eq!(w, ["see", "crates/a.rs", "then", "docs/x.md"]);
    // Paths are relative to the root.
    assert!(Path::new(&crate::root()).join("Cargo.toml").exists());
}

//! Tidy tests of the names the docs use: every environment variable the code reads has one row
//! in `docs/config.md` and every one a doc names is read; every API item a doc names in
//! backticks (`TcpConfig::direct_min_kb`, `DistError::ConcurrentUse`, `ncclGroupEnd`,
//! `from_env()`, a test's or multi-rank case's name) is defined in the repository's Rust
//! sources; every `cargo xtask NAME` a doc runs is a subcommand.

use std::collections::{BTreeMap, BTreeSet};

use super::{docs, files, read, report};

/// Docs that record what was measured when, in the words of the time (a renamed variable
/// included), rather than what the code does now: the name checks skip them, as they skip
/// `docs/results/`.
const RECORDS: &[&str] = &["docs/benchmarks.md"];

/// The docs that say what the code does now: [`docs`] less [`RECORDS`].
pub(super) fn current_docs(files: &[String]) -> Vec<String> {
    docs(files)
        .into_iter()
        .filter(|d| !RECORDS.contains(&d.as_str()))
        .collect()
}

/// The Rust files whose strings and definitions count as the code: every `.rs` file but the
/// tidy tests' own, which name missing things on purpose.
fn rust_files(files: &[String]) -> Vec<&String> {
    files
        .iter()
        .filter(|f| f.ends_with(".rs") && !f.starts_with("xtask/src/tidy"))
        .collect()
}

fn is_variable(name: &str) -> bool {
    name.len() >= 3
        && name.starts_with(|c: char| c.is_ascii_uppercase())
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && !name.ends_with('_')
}

/// Every string literal of `text` that looks like an environment variable (`"DIST_SHM"`,
/// `"RANK"`).
pub(super) fn variable_literals(text: &str) -> BTreeSet<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| is_variable(s))
        .map(str::to_owned)
        .collect()
}

/// Every `DIST_…` word of `text` (not `DIST_*` or a bare `DIST_`).
pub(super) fn dist_words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("DIST_") && is_variable(w))
        .map(str::to_owned)
        .collect()
}

/// The variables of `config`'s table rows (the backticked names of each row's first cell),
/// with the number of rows each is in.
pub(super) fn config_rows(config: &str) -> BTreeMap<String, usize> {
    let mut rows = BTreeMap::new();
    for line in config.lines() {
        let Some(first) = line.strip_prefix('|').and_then(|l| l.split('|').next()) else {
            continue;
        };
        for name in first.split('`').skip(1).step_by(2) {
            if is_variable(name) {
                *rows.entry(name.to_owned()).or_insert(0) += 1;
            }
        }
    }
    rows
}

/// Variables read by a library rather than by a string of ours, and the code that reads them.
const READ_BY_LIBRARIES: &[(&str, &str)] = &[("RUST_LOG", "EnvFilter::try_from_default_env")];

/// Every `DIST_*` variable the libraries, tools and xtask read (not `DIST_TEST_*`, which the
/// test launcher sets for the test programs) has exactly one row in `docs/config.md`, every variable
/// there is read somewhere in the Rust code, and no variable has two rows.
#[test]
fn every_variable_the_code_reads_has_one_row_in_config_md() {
    let files = files();
    let rust = rust_files(&files);
    let mut read_by_users = BTreeSet::new();
    let mut read_anywhere = BTreeSet::new();
    let mut sources = String::new();
    for f in &rust {
        let text = read(f);
        let vars = variable_literals(&text);
        if ["crates/", "tools/", "xtask/", "benches/"]
            .iter()
            .any(|p| f.starts_with(p))
        {
            read_by_users.extend(
                vars.iter()
                    .filter(|v| v.starts_with("DIST_") && !v.starts_with("DIST_TEST_"))
                    .cloned(),
            );
        }
        read_anywhere.extend(vars);
        sources.push_str(&text);
    }
    assert!(
        read_by_users.len() >= 20,
        "found only {read_by_users:?}: is the scan broken?"
    );
    let rows = config_rows(&read("docs/config.md"));
    let mut found = Vec::new();
    for v in &read_by_users {
        match rows.get(v).copied().unwrap_or(0) {
            1 => {}
            0 => found.push(format!(
                "config: {v} is read by the code but has no row in docs/config.md"
            )),
            n => found.push(format!(
                "config: {v} has {n} rows in docs/config.md, not one"
            )),
        }
    }
    for (v, n) in &rows {
        if *n > 1 && !v.starts_with("DIST_") {
            found.push(format!(
                "config: {v} has {n} rows in docs/config.md, not one"
            ));
        }
        let by_library = READ_BY_LIBRARIES
            .iter()
            .any(|(name, how)| name == v && sources.contains(how));
        if !read_anywhere.contains(v) && !by_library {
            found.push(format!(
                "config: {v} has a row in docs/config.md but no Rust code reads it"
            ));
        }
    }
    report("config", found);
}

/// Every `DIST_*` variable the README and `docs/*.md` name (in prose too) is read by some Rust
/// code of the repository.
#[test]
fn every_variable_a_doc_names_is_read_by_the_code() {
    let files = files();
    let read_anywhere: BTreeSet<String> = rust_files(&files)
        .iter()
        .flat_map(|f| variable_literals(&read(f)))
        .collect();
    let mut found = Vec::new();
    let mut checked = 0;
    for doc in current_docs(&files) {
        for (n, line) in read(&doc).lines().enumerate() {
            for v in dist_words(line) {
                checked += 1;
                if !read_anywhere.contains(&v) {
                    found.push(format!(
                        "variables: {doc}:{} names {v}, which no Rust code reads",
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} variables named: is the scan broken?"
    );
    report("variables", found);
}

/// Names defined outside the repository (the standard library, cudarc, libc, the kernel) that
/// the docs name in backticks: the API-item check does not look for them here.
const EXTERNAL: &[&str] = &[
    "std",
    "core",
    "alloc",
    "mem",
    "ptr",
    "slice",
    "libc",
    "rayon",
    "cudarc",
    "socket2",
    "bytemuck",
    "tracing",
    "tracing_subscriber",
    "AtomicU32",
    "AtomicU64",
    "AtomicPtr",
    "AtomicBool",
    "SeqCst",
    "OnceLock",
    "OwnedFd",
    "CudaContext",
    "CudaSlice",
    "CudaStream",
    "DeviceRepr",
    "MaybeUninit",
    "TcpStream",
    "VmHWM",
    "process_vm_readv",
    "in_place_scope_fifo",
];

/// What the Rust sources define: per file, the names it defines and the types (and enum
/// variants) whose members it may define.
pub(super) struct Definitions {
    files: Vec<(BTreeSet<String>, BTreeSet<String>)>,
    /// `use … X as Y`: Y's members are X's.
    aliases: BTreeMap<String, String>,
    /// Every name defined anywhere, and the workspace's crate names (`dist_core`).
    all: BTreeSet<String>,
    /// Every string literal that is one identifier: the multi-rank cases' names
    /// (`"fail_sigkill"`).
    literals: BTreeSet<String>,
}

fn idents(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
}

fn camel(w: &str) -> bool {
    w.starts_with(|c: char| c.is_ascii_uppercase()) && w.chars().any(|c| c.is_ascii_lowercase())
}

impl Definitions {
    /// Reads the definitions of `sources` (`(path, text)`).
    pub(super) fn of<'a>(sources: impl Iterator<Item = (&'a str, String)>) -> Definitions {
        let mut files = Vec::new();
        let mut aliases = BTreeMap::new();
        let mut all = BTreeSet::new();
        let mut literals = BTreeSet::new();
        for (path, text) in sources {
            literals.extend(
                text.split('"')
                    .skip(1)
                    .step_by(2)
                    .filter(|l| idents(l).next() == Some(*l))
                    .map(str::to_owned),
            );
            if let Some(krate) = path
                .strip_prefix("crates/")
                .and_then(|p| p.split('/').next())
            {
                all.insert(krate.replace('-', "_"));
            }
            let (mut defined, mut owners) = (BTreeSet::new(), BTreeSet::new());
            for line in text.lines() {
                let t = line.trim_start();
                if t.starts_with("//") {
                    continue;
                }
                let words: Vec<&str> = idents(t).collect();
                for w in words.windows(2) {
                    let keyword = matches!(
                        w[0],
                        "fn" | "struct"
                            | "enum"
                            | "trait"
                            | "type"
                            | "const"
                            | "static"
                            | "mod"
                            | "union"
                            | "macro_rules"
                    );
                    if keyword && w[1] != "fn" {
                        defined.insert(w[1].to_owned());
                        if ["struct", "enum", "trait", "union", "type"].contains(&w[0]) {
                            owners.insert(w[1].to_owned());
                        }
                    }
                }
                // `pub use dist_nccl_sys::{Library as Nccl, …}`: Nccl is defined, as Library.
                if t.starts_with("pub use") || t.starts_with("use") {
                    for (i, w) in words.iter().enumerate() {
                        if *w == "as" && i > 0 && i + 1 < words.len() {
                            defined.insert(words[i + 1].to_owned());
                            aliases.insert(words[i + 1].to_owned(), words[i - 1].to_owned());
                        }
                    }
                }
                if t.starts_with("impl") || t.starts_with("unsafe impl") {
                    owners.extend(words.iter().filter(|w| camel(w)).map(|w| w.to_string()));
                }
                // A field, an enum variant or a named argument at the start of its line:
                // `pub(crate) rank: usize,`, `Ring {`, `Timeout { peer, .. }`.
                let bare = t
                    .strip_prefix("pub(crate) ")
                    .or_else(|| t.strip_prefix("pub(super) "))
                    .or_else(|| t.strip_prefix("pub "))
                    .unwrap_or(t);
                let head: String = bare
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let rest = bare[head.len()..].trim_start();
                if !head.is_empty()
                    && !head.starts_with(|c: char| c.is_ascii_digit())
                    && (rest.is_empty() || rest.starts_with([',', '(', '{', ':', '=']))
                    && !rest.starts_with("::")
                {
                    defined.insert(head.clone());
                    if camel(&head) {
                        owners.insert(head);
                    }
                }
            }
            all.extend(defined.iter().cloned());
            files.push((defined, owners));
        }
        Definitions {
            files,
            aliases,
            all,
            literals,
        }
    }

    /// Whether some file defines `member` beside an `impl`, a definition or a variant of
    /// `owner` (or of the type `owner` aliases).
    fn member(&self, owner: &str, member: &str) -> bool {
        let names = [Some(owner), self.aliases.get(owner).map(String::as_str)];
        self.files.iter().any(|(defined, owners)| {
            defined.contains(member) && names.iter().flatten().any(|o| owners.contains(*o))
        })
    }

    /// Whether `span` names an API item (`TcpConfig::direct_min_kb`, `Communicator::on()`,
    /// `ConcurrentUse`, `ncclGroupEnd`, `from_env()`) and, if so, what is wrong with it:
    /// `None` where it is not read as one, `Some(Ok(()))` where it is defined.
    pub(super) fn check(&self, span: &str) -> Option<Result<(), String>> {
        // `Tag::user(7)`, `comm.on(&stream)`: the path before the arguments.
        let (path, called) = match span.find('(') {
            Some(i) if span.ends_with(')') => (&span[..i], true),
            Some(_) => return None,
            None => (span, false),
        };
        let segments: Vec<&str> = path.split("::").collect();
        let ident = |s: &&str| {
            !s.is_empty()
                && s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        if !segments.iter().all(ident) || EXTERNAL.contains(&segments[0]) {
            return None;
        }
        let last = segments[segments.len() - 1];
        if segments.len() == 1 {
            let api = (camel(last) && last.chars().filter(char::is_ascii_uppercase).count() >= 2)
                || (last.starts_with("nccl") && camel(&last[4..]))
                || (called
                    && span.ends_with("()")
                    && last.contains('_')
                    && last == last.to_ascii_lowercase());
            // A test's or a multi-rank case's name (`a_corrupt_position_is_an_error`; with one
            // underscore, as `fail_sigkill`, it is not read as one).
            let test = !called
                && last.matches('_').count() >= 2
                && last.starts_with(|c: char| c.is_ascii_lowercase())
                && last == last.to_ascii_lowercase();
            if test {
                return Some(if self.all.contains(last) || self.literals.contains(last) {
                    Ok(())
                } else {
                    Err(format!(
                        "{last} is neither a function nor a case of that name"
                    ))
                });
            }
            return api.then(|| {
                if self.all.contains(last) {
                    Ok(())
                } else {
                    Err(format!("{last} is defined nowhere"))
                }
            });
        }
        // Test trials (`coll_reductions::lanes2::n3`, `CASE::nN`) are not API items.
        if last.starts_with('n') && last[1..].chars().all(|c| c.is_ascii_digit() || c == 'N') {
            return None;
        }
        for pair in segments.windows(2) {
            let (owner, member) = (pair[0], pair[1]);
            let ok = if owner.starts_with(|c: char| c.is_ascii_uppercase()) {
                self.member(owner, member)
            } else {
                self.all.contains(member)
            };
            if !ok {
                return Some(Err(format!(
                    "{member} is not defined as a member of {owner}"
                )));
            }
        }
        Some(Ok(()))
    }
}

/// The spans between backticks of `line`.
pub(super) fn backticked(line: &str) -> impl Iterator<Item = &str> {
    line.split('`').skip(1).step_by(2)
}

/// Every API item the README and `docs/*.md` name in backticks is defined in the Rust sources:
/// a path's type (`TcpConfig`) beside its member (`direct_min_kb`: defined in a file that has an
/// `impl` or the definition of that type), an enum's variant, a single CamelCase name
/// (`ConcurrentUse`), an NCCL function (`ncclGroupEnd`, from the bindings), a snake_case call
/// (`from_env()`). Names from outside the repository are in [`EXTERNAL`].
#[test]
fn every_api_item_a_doc_names_is_defined() {
    let files = files();
    let defs = Definitions::of(
        rust_files(&files)
            .into_iter()
            .map(|f| (f.as_str(), read(f))),
    );
    let mut found = Vec::new();
    let mut items = 0;
    for doc in current_docs(&files) {
        for (n, line) in read(&doc).lines().enumerate() {
            for span in backticked(line) {
                match defs.check(span) {
                    None => {}
                    Some(Ok(())) => items += 1,
                    Some(Err(why)) => {
                        found.push(format!("api: {doc}:{} names `{span}`: {why}", n + 1))
                    }
                }
            }
        }
    }
    assert!(
        items > 200,
        "only {items} API items checked: is the scan broken?"
    );
    report("api", found);
}

/// The subcommands of `cargo xtask`: the variants of `enum Cmd` in `xtask/src/main.rs`, in
/// clap's kebab case (`TestMultirank` is `test-multirank`).
pub(super) fn xtask_commands(main: &str) -> BTreeSet<String> {
    let start = main
        .find("enum Cmd {")
        .expect("xtask/src/main.rs has `enum Cmd`");
    let body = &main[start..];
    let body = &body[..body.find("\n}").unwrap_or(body.len())];
    body.lines()
        .filter(|l| l.starts_with("    ") && l[4..].starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|l| {
            let name: String = l[4..]
                .chars()
                .take_while(char::is_ascii_alphanumeric)
                .collect();
            let mut kebab = String::new();
            for (i, c) in name.chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    kebab.push('-');
                }
                kebab.push(c.to_ascii_lowercase());
            }
            kebab
        })
        .collect()
}

/// The subcommands `text` runs as `cargo xtask NAME`.
pub(super) fn xtask_uses(text: &str) -> Vec<String> {
    text.match_indices("cargo xtask ")
        .map(|(i, m)| {
            text[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect::<String>()
        })
        .filter(|w| !w.is_empty() && !w.starts_with('-'))
        .collect()
}

/// Every `cargo xtask NAME` the README and `docs/*.md` run is a subcommand of xtask.
#[test]
fn every_xtask_command_a_doc_runs_exists() {
    let files = files();
    let commands = xtask_commands(&read("xtask/src/main.rs"));
    assert!(commands.len() >= 8, "{commands:?}: is the scan broken?");
    let mut found = Vec::new();
    for doc in current_docs(&files) {
        for (n, line) in read(&doc).lines().enumerate() {
            for c in xtask_uses(line) {
                if !commands.contains(&c) {
                    found.push(format!(
                        "xtask: {doc}:{} runs `cargo xtask {c}`, which is no subcommand",
                        n + 1
                    ));
                }
            }
        }
    }
    report("xtask", found);
}

#[test]
fn the_name_scanners_read_what_the_docs_write() {
    assert_eq!(
        variable_literals(r#"get("DIST_SHM") + "RANK" + "Rank" "DIST_" "x""#),
        BTreeSet::from(["DIST_SHM".to_string(), "RANK".to_string()])
    );
    assert_eq!(
        dist_words("`DIST_*`, DIST_TIMEOUT=5 and `DIST_A`"),
        BTreeSet::from(["DIST_A".to_string(), "DIST_TIMEOUT".to_string()])
    );
    let config = "| variable | default |\n| --- | --- |\n| `RANK`, `WORLD_SIZE` | x |\n\
                  | `DIST_X` | `DIST_Y` |\n| `DIST_X` | |\nprose `DIST_Z`\n";
    assert_eq!(
        config_rows(config),
        BTreeMap::from([
            ("DIST_X".to_string(), 2),
            ("RANK".to_string(), 1),
            ("WORLD_SIZE".to_string(), 1)
        ])
    );
    let src = "pub struct Conf { pub(crate) rank: usize }\nimpl Conf {\n    pub fn direct_min_kb(self) {}\n}\n\
               pub enum Error {\n    ConcurrentUse { op: String },\n    Gone,\n}\n\
               pub use inner::{Library as Nccl};\nimpl Library { pub fn load() {} }\n\
               pub unsafe fn ncclGroupEnd() {}\n";
    let other = "pub fn un_related() {}\nstruct Other;\nCase::new(\"shm_arena_sigkill\", f)\n#[test]\nfn a_test_of_it() {}\n";
    let defs = Definitions::of(
        [
            ("crates/dist-x/src/a.rs", src.to_string()),
            ("crates/dist-x/src/b.rs", other.to_string()),
        ]
        .into_iter(),
    );
    assert_eq!(defs.check("Conf::direct_min_kb"), Some(Ok(())));
    assert_eq!(defs.check("Conf::direct_min_kb(kb)"), Some(Ok(())));
    assert!(matches!(defs.check("Conf::direct_max_kb"), Some(Err(_))));
    assert!(
        matches!(defs.check("Other::direct_min_kb"), Some(Err(_))),
        "a member of another type"
    );
    assert_eq!(defs.check("Error::ConcurrentUse"), Some(Ok(())));
    assert_eq!(defs.check("ConcurrentUse"), Some(Ok(())));
    assert!(matches!(defs.check("ConcurrentUsage"), Some(Err(_))));
    assert_eq!(defs.check("Nccl::load"), Some(Ok(())));
    assert_eq!(defs.check("dist_x::Conf"), Some(Ok(())));
    assert_eq!(defs.check("ncclGroupEnd"), Some(Ok(())));
    assert!(matches!(defs.check("ncclGroupStart"), Some(Err(_))));
    assert_eq!(defs.check("un_related()"), Some(Ok(())));
    assert!(matches!(defs.check("related_to()"), Some(Err(_))));
    assert_eq!(defs.check("a_test_of_it"), Some(Ok(())));
    assert_eq!(defs.check("shm_arena_sigkill"), Some(Ok(())));
    assert!(matches!(defs.check("a_test_of_that"), Some(Err(_))));
    assert_eq!(
        defs.check("fail_sigkill"),
        None,
        "one underscore: not read as a name"
    );
    let main = "enum Other {\n    Nope,\n}\nenum Cmd {\n    /// Doc.\n    TestMultirank(Args),\n    Demo {\n        n: usize,\n    },\n    Test,\n}\n";
    assert_eq!(
        xtask_commands(main),
        BTreeSet::from([
            "demo".to_string(),
            "test".to_string(),
            "test-multirank".to_string()
        ])
    );
    assert_eq!(
        xtask_uses("`cargo xtask test-multirank -n 4`, cargo xtask --help, cargo xtask demo."),
        ["test-multirank", "demo"]
    );
    assert_eq!(defs.check("coll_x::lanes2::n3"), None);
    assert_eq!(defs.check("std::thread::scope"), None);
    assert_eq!(defs.check("cargo xtask test"), None);
    assert_eq!(
        defs.check("Conf"),
        None,
        "one hump: not read as an API item"
    );
}

//! Tidy test of `dist-nccl-sys`'s table of NCCL functions (`INTRODUCED`, the version that
//! introduced each function the project calls): every function it lists is called somewhere
//! in the workspace, and every one the workspace calls is listed. A test of the workspace, not
//! of the crate, so it lives here: the packaged crate has no workspace to scan.

use std::collections::BTreeSet;

use super::{files, read};

const TABLE: &str = "crates/dist-nccl-sys/src/lib.rs";

/// `ncclX...`: an identifier that can name an NCCL function.
fn is_nccl_name(s: &str) -> bool {
    s.starts_with("nccl")
        && s.chars().nth(4).is_some_and(|c| c.is_ascii_uppercase())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The names in `pub const INTRODUCED: &[(&str, i32)] = &[ ... ];`, one `("ncclName", ...)` a
/// line.
fn listed() -> BTreeSet<String> {
    let text = read(TABLE);
    let start = text
        .find("pub const INTRODUCED")
        .unwrap_or_else(|| panic!("{TABLE} has no `pub const INTRODUCED`"));
    let block = &text[start..];
    let block = &block[..block.find("];").expect("the table ends with `];`")];
    block
        .lines()
        .filter_map(|l| l.trim().strip_prefix("(\""))
        .map(|l| l[..l.find('"').expect("a quoted name")].to_string())
        .collect()
}

/// The NCCL functions the workspace's Rust code reaches: the name in every
/// `nccl_fn!(lib, name)` and every `.name` field access (`raw().ncclSend`), outside
/// comments (doc examples included) and outside the generated bindings.
fn called() -> BTreeSet<String> {
    let mut called = BTreeSet::new();
    for f in files()
        .iter()
        .filter(|f| f.ends_with(".rs") && !f.ends_with("/bindings.rs"))
    {
        let code: String = read(f)
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        // `nccl_fn!(` ... `, name)`: the last identifier before the closing parenthesis.
        for (i, _) in code.match_indices("nccl_fn!(") {
            let rest = &code[i..];
            let Some(end) = rest.find(')') else { continue };
            let name = rest[..end].rsplit(',').next().unwrap_or("").trim();
            if is_nccl_name(name) {
                called.insert(name.to_string());
            }
        }
        // `.ncclName` (a field of the raw table, or a method of it).
        for (i, _) in code.match_indices(".nccl") {
            let name: String = code[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if is_nccl_name(&name) {
                called.insert(name);
            }
        }
    }
    called
}

#[test]
fn the_nccl_table_lists_exactly_the_functions_called() {
    let (listed, called) = (listed(), called());
    // Both scans see what they should: the table's first and last rows, a macro call and a
    // field reached through `raw`.
    for name in ["ncclGetVersion", "ncclScatter"] {
        assert!(
            listed.contains(name),
            "{name} not read from {TABLE}: {listed:?}"
        );
    }
    for name in ["ncclAllReduce", "ncclGetVersion"] {
        assert!(called.contains(name), "{name} not seen called: {called:?}");
    }
    let never: Vec<_> = listed.difference(&called).collect();
    assert!(
        never.is_empty(),
        "{TABLE}'s INTRODUCED lists functions the project never calls: {never:?}"
    );
    let unlisted: Vec<_> = called.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "functions called but not in {TABLE}'s INTRODUCED: {unlisted:?}"
    );
}

//! Tidy test of the figures the docs quote from raw result files: in a sentence (or table row)
//! that cites a file under `docs/results/`, every measured figure (a decimal number with a
//! unit: `17.39 s`, `10.0 MiB`, `313.36 GB/s`) is one of that file's numbers, as written or
//! rounded, or scaled by a thousand or 1,024 (a file's `17390.4` ms is `17.39 s`).

use std::path::Path;

use super::names::current_docs;
use super::{files, read, report};

/// The units after which a decimal number is a measured figure.
const UNITS: &[&str] = &[
    "GB/s", "MB/s", "µs", "us", "ms", "s", "MiB", "GiB", "KiB", "MB", "GB", "KB",
];

/// The pieces of `text` a citation covers: each table row, and each sentence of the other
/// paragraphs (a sentence ends at `.`, `;` or `:` before a capital, a backtick or a
/// parenthesis).
pub(super) fn units(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for para in text.split("\n\n") {
        if para.trim_start().starts_with('|') {
            out.extend(para.lines().map(str::to_owned));
            continue;
        }
        let flat = para.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut start = 0;
        let bytes = flat.as_bytes();
        for (i, c) in flat.char_indices() {
            let next = bytes.get(i + 2).copied().map(char::from);
            if matches!(c, '.' | ';' | ':')
                && bytes.get(i + 1) == Some(&b' ')
                && next.is_some_and(|n| n.is_ascii_uppercase() || n == '`' || n == '(')
            {
                out.push(flat[start..=i].to_owned());
                start = i + 2;
            }
        }
        out.push(flat[start..].to_owned());
    }
    out
}

/// `unit` without its backticked spans (paths and commands hold numbers that are no figures).
fn prose(unit: &str) -> String {
    unit.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// The measured figures of `prose`: decimal numbers (`1,640.8`, `17.39`) followed by a unit.
pub(super) fn figures(prose: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = prose.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || ".,_-/".contains(chars[i - 1])));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len()
            && (chars[j].is_ascii_digit()
                || (".,".contains(chars[j]) && chars.get(j + 1).is_some_and(char::is_ascii_digit)))
        {
            j += 1;
        }
        let number: String = chars[i..j].iter().collect();
        let after: String = chars[j..].iter().collect();
        let after = after.strip_prefix(' ').unwrap_or(&after);
        let unit = UNITS.iter().any(|u| {
            after.starts_with(u) && !after[u.len()..].starts_with(|c: char| c.is_alphanumeric())
        });
        if unit && number.matches('.').count() == 1 {
            out.push(number.replace(',', ""));
        }
        i = j.max(i + 1);
    }
    out
}

/// Every number of `text` (commas in thousands removed).
pub(super) fn numbers(text: &str) -> Vec<f64> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','))
        .filter_map(|w| w.trim_matches(['.', ',']).replace(',', "").parse().ok())
        .collect()
}

/// Whether `figure` (as the doc writes it, commas removed) is one of `numbers`, rounded to the
/// figure's decimals, as it is or scaled by a thousand or 1,024.
pub(super) fn quotes(figure: &str, numbers: &[f64]) -> bool {
    let decimals = figure.split('.').nth(1).map_or(0, str::len);
    numbers.iter().any(|v| {
        [1.0, 1e-3, 1e3, 1.0 / 1024.0, 1024.0]
            .iter()
            .any(|m| format!("{:.*}", decimals, v * m) == figure)
    })
}

/// In the README and `docs/*.md` (not the records), every measured figure of a sentence or
/// table row that cites a raw file under `docs/results/` is one of that file's numbers.
#[test]
fn every_figure_quoted_from_a_raw_file_is_in_it() {
    let files = files();
    let mut found = Vec::new();
    let mut checked = 0;
    for doc in current_docs(&files) {
        for unit in units(&read(&doc)) {
            let cited: Vec<&str> = unit
                .split('`')
                .skip(1)
                .step_by(2)
                .filter(|p| p.starts_with("docs/results/") && !p.ends_with('/'))
                .filter(|p| crate::root().join(p).is_file())
                .collect();
            if cited.is_empty() {
                continue;
            }
            let numbers: Vec<f64> = cited.iter().flat_map(|p| numbers(&read(p))).collect();
            for figure in figures(&prose(&unit)) {
                checked += 1;
                if !quotes(&figure, &numbers) {
                    found.push(format!(
                        "figures: {doc} quotes {figure} from {}, which does not hold it: \"{}\"",
                        cited.join(", "),
                        unit.chars().take(160).collect::<String>()
                    ));
                }
            }
        }
    }
    assert!(
        checked >= 3,
        "only {checked} quoted figures checked: is the scan broken?"
    );
    report("figures", found);
}

#[test]
fn the_figure_scanners_read_what_the_docs_write() {
    assert_eq!(
        figures("in 17.39 s and 10.0 MiB (5.9 MiB), 1,640.8 µs, 2.5× and 4 ranks, v2.28 s"),
        ["17.39", "10.0", "5.9", "1640.8"]
    );
    assert_eq!(figures("313.36 GB/s, 1.5 seconds, 2.28.9 s"), ["313.36"]);
    let text = "A run took 17.39 s (`docs/results/x/a.txt`). Then 3.5 s: more.\n\n| a | 1.0 s |\n| b | 2.0 s |\n";
    assert_eq!(
        units(text),
        [
            "A run took 17.39 s (`docs/results/x/a.txt`).",
            "Then 3.5 s: more.",
            "| a | 1.0 s |",
            "| b | 2.0 s |",
        ]
    );
    assert_eq!(prose("in `docs/results/2026-11-30/` 1.5 s"), "in   1.5 s");
    let raw = numbers("total                           17390.4\npeak RSS 10.0 5.9 at 1,024.5");
    assert_eq!(raw, [17390.4, 10.0, 5.9, 1024.5]);
    assert!(quotes("17.39", &raw), "ms as s");
    assert!(quotes("10.0", &raw));
    assert!(quotes("1.0", &raw), "1,024.5 KiB as MiB");
    assert!(!quotes("10.3", &raw));
    assert!(!quotes("15.0", &raw));
    assert!(Path::new(&crate::root()).join("docs/results").is_dir());
}

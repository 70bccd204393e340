//! Tidy test: no work-period counters in the repository. Results and the history are named by
//! date and commit (`docs/results/README.md`'s headings, `docs/results/DATE-MACHINE-COMMIT/`),
//! so a text that cites a numbered work session, an issue by its number, a run by a running
//! counter (`s` and a number, then a letter: the GPU runs' old names) or a results folder by one
//! (a name ending in `-s` and a number) names something a reader of the repository cannot find.
//! The numbered "Trust" issues count too: say what they checked instead. Every tracked or
//! untracked-but-not-ignored text file is read, raw result files included (none needs an
//! exception today; [`super::KNOWN`] is where one would go, with its reason). The patterns are
//! spelled out piecewise below so that this file passes its own test.

use super::{files, report};

/// What `line` cites by a counter, or `None`: the first match of any pattern, as found.
fn counter_in(line: &str) -> Option<String> {
    let lower = line.to_ascii_lowercase();
    let b = lower.as_bytes();
    let word_start = |i: usize| i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
    let digits_at = |i: usize| b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    let spaces_at = |i: usize| b[i..].iter().take_while(|c| **c == b' ').count();
    let found = |i: usize, end: usize| Some(line[i..end.min(line.len())].to_owned());
    for i in 0..b.len() {
        if !word_start(i) || !line.is_char_boundary(i) {
            continue;
        }
        let rest = &lower[i..];
        // A work session by its number, one or a range.
        for word in [concat!("sess", "ions"), concat!("sess", "ion")] {
            if let Some(after) = rest.strip_prefix(word) {
                let j = i + word.len();
                let s = spaces_at(j);
                if s > 0 && !after.is_empty() && digits_at(j + s) > 0 {
                    return found(i, j + s + digits_at(j + s));
                }
            }
        }
        // An issue by its number, with or without `#`.
        for word in [concat!("iss", "ues"), concat!("iss", "ue")] {
            if rest.starts_with(word) {
                let j = i + word.len();
                let s = spaces_at(j);
                let hash = usize::from(b.get(j + s) == Some(&b'#'));
                if s > 0 && digits_at(j + s + hash) > 0 {
                    return found(i, j + s + hash + digits_at(j + s + hash));
                }
            }
        }
        // The numbered "Trust" issues (case kept: only their capitalised names).
        let trust = concat!("Tru", "st I");
        if line[i..].starts_with(trust) {
            let j = i + trust.len();
            let k = j + b[j..].iter().take_while(|c| **c == b'i').count();
            if k - j <= 2 && !b.get(k).is_some_and(|c| c.is_ascii_alphanumeric()) {
                return found(i, k);
            }
        }
        // A run counter: `s`, one or two digits, a dash, a letter or digit.
        if b[i] == b's' {
            let d = digits_at(i + 1);
            if (1..=2).contains(&d)
                && b.get(i + 1 + d) == Some(&b'-')
                && b.get(i + 2 + d).is_some_and(|c| c.is_ascii_alphanumeric())
            {
                return found(i, i + 3 + d);
            }
        }
    }
    // A folder or bundle name that ends in `-s` and one or two digits.
    for (i, _) in lower.match_indices("-s") {
        let d = digits_at(i + 2);
        let after = b.get(i + 2 + d);
        if i > 0
            && b[i - 1].is_ascii_alphanumeric()
            && (1..=2).contains(&d)
            && !after.is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            return found(i, i + 2 + d);
        }
    }
    None
}

/// No text file of the repository cites a work period, an issue number or a run by a counter.
#[test]
fn no_work_period_counters_in_the_repository() {
    let files = files();
    let mut found = Vec::new();
    let mut read = 0;
    for file in &files {
        // Binary files (plots, archives) are not text and cite nothing.
        let Ok(text) = std::fs::read_to_string(crate::root().join(file)) else {
            continue;
        };
        read += 1;
        for (n, line) in text.lines().enumerate() {
            if let Some(what) = counter_in(line) {
                found.push(format!("counters: {file}:{} cites \"{what}\"", n + 1));
            }
        }
    }
    assert!(
        read > 100,
        "only {read} text files read: is the scan broken?"
    );
    report("counters", found);
}

/// The scanner finds each kind of counter in the forms the repository once had, and leaves
/// alone the numbers that are not counters (sequence numbers, variables, dated folders).
#[test]
fn the_counter_scanner_finds_planted_lines() {
    let session = concat!("Sess", "ion");
    let issue = concat!("iss", "ue");
    let trust = concat!("Tru", "st");
    for (line, want) in [
        (
            format!("/// (`docs/benchmarks.md`, \"{session} 13\")"),
            format!("{session} 13"),
        ),
        (
            format!("measured in {} 12-16", session.to_lowercase() + "s"),
            format!("{}s 12", session.to_lowercase()),
        ),
        (
            format!("//! Property tests ({issue} 10, point 17)"),
            format!("{issue} 10"),
        ),
        (
            format!("/// {} 13: 32 quiet connections", "Iss".to_owned() + "ue"),
            format!("{} 13", "Iss".to_owned() + "ue"),
        ),
        (format!("fixed in {issue} #34"), format!("{issue} #34")),
        (
            format!("With all of {trust} I and II merged"),
            format!("{trust} I"),
        ),
        (format!("the {trust} III review"), format!("{trust} III")),
        (
            format!("(2 x H200, run {}: the watchdog", "s3".to_owned() + "-b"),
            "s3".to_owned() + "-b",
        ),
        (
            format!("see bench {}", "s13".to_owned() + "-run"),
            "s13".to_owned() + "-r",
        ),
        (
            format!("docs/results/2026-12-01{}/", "-s".to_owned() + "13"),
            "-s".to_owned() + "13",
        ),
    ] {
        assert_eq!(counter_in(&line).as_deref(), Some(want.as_str()), "{line}");
    }
    for line in [
        "rank 3 finished #41 all_reduce; ranks 0–2 wait in #42 barrier",
        "collectives run in issue order on one thread",
        "let (s2, _raw2) = socket_pair();",
        "s2.set_read_timeout(Some(Duration::from_secs(2))).unwrap();",
        "docs/results/2026-12-01-2core-0436ad0/README.md",
        "files `t2-run1-*`: the run at 2626657",
        "the session's log, a trusted peer, Trust is earned",
        "x86_64-linux-gnu, ssh -s 2, ls -s1",
    ] {
        assert_eq!(counter_in(line), None, "{line}");
    }
}

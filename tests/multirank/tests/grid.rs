//! dist-tcp's `grid` example (named data x tensor groups, owned async buckets, a typed
//! isend/irecv ring) run by the launcher, dist-run, at 4 and 8 ranks: every rank passes its
//! checks; and with `--die`, the last rank exits at step 2, every survivor reports an error
//! naming it, and the launcher reports every rank's exit.

use std::time::Duration;

use dist_run::{Launch, Report};

const GRID: &str = env!("CARGO_BIN_EXE_dist-grid");

/// `n` ranks of the example with `args`, their output kept (not echoed), bounded in time.
fn launch(n: usize, args: &[&str]) -> Report {
    let mut l = Launch::new(GRID, n);
    l.args = args.iter().map(Into::into).collect();
    l.echo = false;
    l.timeout = Some(Duration::from_secs(120));
    // Whatever goes wrong, no wait of the program outlasts this.
    l.env.push(("DIST_TIMEOUT".into(), "30".into()));
    dist_run::run(&l, None).expect("dist-run starts the ranks")
}

/// The lines rank `r` printed, without the launcher's prefix.
fn lines_of(report: &Report, r: usize) -> Vec<&str> {
    let prefix = format!("[r{r}] ");
    report
        .lines
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .collect()
}

#[test]
fn every_rank_passes_its_checks_at_4_and_8_ranks() {
    for n in [4, 8] {
        let report = launch(n, &[]);
        assert!(
            report.passed(),
            "{n} ranks: {:#?}\n{}",
            report.describe(),
            report.lines.join("\n")
        );
        for r in 0..n {
            let want = format!(
                "rank {r}: 5 steps ok (tensor rank {} of 2, data rank {} of {})",
                r % 2,
                r / 2,
                n / 2
            );
            assert!(
                lines_of(&report, r).contains(&want.as_str()),
                "{n} ranks, rank {r}: {:?}",
                report.lines
            );
        }
    }
}

#[test]
fn a_rank_that_exits_is_named_by_every_survivor_and_every_exit_is_reported() {
    for n in [4, 8] {
        let dead = n - 1;
        let report = launch(n, &["--die"]);
        let all = report.lines.join("\n");
        // (Which rank dist-run saw fail first is not asserted: it polls the ranks in order,
        // and the survivors exit within milliseconds of the dead one.)
        assert!(report.first_failure.is_some(), "{n} ranks:\n{all}");
        assert_eq!(report.ranks[dead].status.and_then(|s| s.code()), Some(3));
        assert!(
            lines_of(&report, dead)
                .contains(&format!("rank {dead}: exiting at step 2 (--die)").as_str()),
            "{all}"
        );
        let mut errors = std::collections::BTreeMap::new();
        for r in (0..n).filter(|&r| r != dead) {
            let e = &report.ranks[r];
            assert!(
                !e.killed,
                "{n} ranks: rank {r} was killed, not ended:\n{all}"
            );
            assert_eq!(e.status.and_then(|s| s.code()), Some(1), "rank {r}:\n{all}");
            let prefix = format!("rank {r} failed: ");
            let error = lines_of(&report, r)
                .into_iter()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("{n} ranks: rank {r} said no error:\n{all}"));
            errors.insert(r, (named_ranks(error, r), error.to_string()));
        }
        // Every survivor's error leads to the dead rank: it names it, or names a survivor
        // whose error does (a survivor that failed and exited closes its connections, and a
        // peer still waiting on it may see that first: the cause is then one step away).
        let mut leads: std::collections::BTreeSet<usize> = errors
            .iter()
            .filter(|(_, (named, _))| named.contains(&dead))
            .map(|(&r, _)| r)
            .collect();
        assert!(
            !leads.is_empty(),
            "{n} ranks: no survivor names rank {dead}:\n{all}"
        );
        loop {
            let more: Vec<usize> = errors
                .iter()
                .filter(|(r, (named, _))| {
                    !leads.contains(*r) && named.iter().any(|k| leads.contains(k))
                })
                .map(|(&r, _)| r)
                .collect();
            if more.is_empty() {
                break;
            }
            leads.extend(more);
        }
        for (r, (_, error)) in &errors {
            assert!(
                leads.contains(r),
                "{n} ranks: rank {r}'s error leads to no rank {dead}: {error}"
            );
        }
        // The launcher's report: the first failure, then one line per rank.
        let described = report.describe();
        assert!(
            described[0].contains("failed first (exit status: "),
            "{described:#?}"
        );
        for r in 0..n {
            let line = format!("rank {r}: exit status: {}", if r == dead { 3 } else { 1 });
            assert!(
                described.iter().any(|l| l.starts_with(&line)),
                "{described:#?}"
            );
        }
    }
}

/// The backend ranks an error of rank `me` names, other than `me`: every `backend rank N` (a
/// sub-group's errors), and in an error of the backend's own group every `peer N ` and
/// `because rank N failed`.
fn named_ranks(error: &str, me: usize) -> std::collections::BTreeSet<usize> {
    let number_after = |pat: &str| -> Vec<usize> {
        error
            .match_indices(pat)
            .filter_map(|(i, _)| {
                let rest = &error[i + pat.len()..];
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .collect()
    };
    let mut named: std::collections::BTreeSet<usize> =
        number_after("backend rank ").into_iter().collect();
    named.extend(number_after("because rank "));
    if !error.contains(" in group ") {
        named.extend(number_after("peer "));
    }
    named.remove(&me);
    named
}

/// What [`named_ranks`] reads from a sub-group's error and from the backend's own.
#[test]
fn named_ranks_reads_both_numberings() {
    let sub = "rank 1: peer 0 gone during all_reduce(f32 x 1000, sum) in group \"data\" (rank 1 \
               of 4 = backend rank 2; peer 0 = backend rank 0): connection closed by peer";
    assert_eq!(named_ranks(sub, 2).into_iter().collect::<Vec<_>>(), [0]);
    let own = "rank 3: peer 7 gone during barrier: connection closed by peer";
    assert_eq!(named_ranks(own, 3).into_iter().collect::<Vec<_>>(), [7]);
}

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
            // A sub-group's error gives the backend rank; the backend's own, its rank.
            let names_it = [
                format!("backend rank {dead}"),
                format!("peer {dead} "),
                format!("because rank {dead} failed"),
            ]
            .iter()
            .any(|w| error.contains(w.as_str()));
            assert!(
                names_it,
                "{n} ranks: rank {r}'s error names no rank {dead}: {error}"
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

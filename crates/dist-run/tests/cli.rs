//! The `dist-run` binary, run on shell one-liners: the environment each rank gets, prefixed
//! output, every rank's exit reported with the survivors' own messages, the grace period, signals
//! sent on to the ranks, a taken port, and simulated hosts (as root).

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_dist-run");

/// `dist-run ARGS -- sh -c SCRIPT`, with a timeout so that no test waits forever.
fn sh(args: &[&str], script: &str) -> Output {
    Command::new(BIN)
        .args(["--timeout", "60"])
        .args(args)
        .args(["--", "sh", "-c", script])
        .output()
        .expect("run dist-run")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_rank_gets_the_torchrun_environment() {
    let out = Command::new(BIN)
        .args(["-n", "3", "--timeout", "60", "sh", "-c"])
        .arg(
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT \
             ${DIST_MASTER_PORT:-unset} ${TORCHELASTIC_RUN_ID:-unset}\"",
        )
        // Both would make dist use another port than the one dist-run gives.
        .env("DIST_MASTER_PORT", "1")
        .env("TORCHELASTIC_RUN_ID", "x")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{stdout}");
    let port: u16 = lines[0].split(' ').nth(6).unwrap().parse().unwrap();
    for (r, l) in lines.iter().enumerate() {
        assert_eq!(
            *l,
            format!("[r{r}] {r} 3 {r} 3 127.0.0.1 {port} unset unset"),
            "{stdout}"
        );
    }
    let eph = dist_run::port::ephemeral_range();
    assert!(
        !eph.contains(&port),
        "port {port} is in the ephemeral range {eph:?}"
    );
}

#[test]
fn each_line_carries_its_rank_and_lines_never_mix() {
    // 4 ranks write 300 long lines each to stdout and stderr at once.
    let script = r#"i=0; while [ $i -lt 300 ]; do
        echo "rank $RANK out $i aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        echo "rank $RANK err $i bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb" >&2
        i=$((i+1)); done"#;
    let out = sh(&["-n", "4", "--label", "job "], script);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for (stream, bytes) in [("out", &out.stdout), ("err", &out.stderr)] {
        let t = text(bytes);
        let mut count = [0usize; 4];
        for l in t.lines() {
            let (prefix, rest) = l.split_once("] ").unwrap_or_else(|| panic!("{l:?}"));
            let r: usize = prefix.strip_prefix("[job r").unwrap().parse().unwrap();
            assert!(rest.starts_with(&format!("rank {r} {stream} ")), "{l:?}");
            assert_eq!(l.len(), prefix.len() + 2 + rest.len());
            assert!(rest.ends_with("aaaa") || rest.ends_with("bbbb"), "{l:?}");
            count[r] += 1;
        }
        assert_eq!(count, [300; 4], "{stream}");
    }
}

#[test]
fn a_failure_reports_every_rank_and_the_survivors_speak_first() {
    let dir = std::env::temp_dir().join(format!("dist-run-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join("gone");
    let _ = std::fs::remove_file(&marker);
    // Rank 1 fails; the others notice (the marker), say so and fail on their own, a moment
    // after rank 1 has exited (so that rank 1 is the first failure the launcher sees).
    let script = format!(
        r#"if [ "$RANK" = 1 ]; then echo "rank 1: boom" >&2; touch {m}; exit 3; fi
        while [ ! -e {m} ]; do sleep 0.01; done; sleep 0.3
        echo "rank $RANK: peer 1 gone" >&2; exit 1"#,
        m = marker.display()
    );
    let out = sh(&["-n", "3"], &script);
    let _ = std::fs::remove_dir_all(&dir);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    for want in [
        "[r1] rank 1: boom",
        "[r0] rank 0: peer 1 gone",
        "[r2] rank 2: peer 1 gone",
        "dist-run: rank 1 failed first (exit status: 3",
        "dist-run: rank 0: exit status: 1",
        "dist-run: rank 1: exit status: 3",
        "dist-run: rank 2: exit status: 1",
    ] {
        assert!(err.contains(want), "no {want:?} in:\n{err}");
    }
    assert!(!err.contains("killed"), "{err}");
}

#[test]
fn a_survivor_that_hangs_is_killed_after_the_grace_period() {
    let started = Instant::now();
    let out = sh(
        &["-n", "2", "--grace", "0.5"],
        r#"[ "$RANK" = 1 ] && exit 4; exec sleep 50"#,
    );
    let took = started.elapsed();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("rank 0: killed by the launcher"), "{err}");
    assert!(err.contains("rank 1: exit status: 4"), "{err}");
    assert!(
        took >= Duration::from_millis(500),
        "{took:?}: before the grace period"
    );
    assert!(took < Duration::from_secs(30), "{took:?}: not killed");
}

/// A rank ended by a signal has failed (it has no exit code, which once compared equal to
/// the absent skip status): the job fails with 128 + the signal, naming the rank.
#[test]
fn a_rank_killed_by_a_signal_fails_the_job() {
    let out = sh(
        &["-n", "2", "--grace", "0.2"],
        r#"[ "$RANK" = 1 ] && kill -KILL $$; exec sleep 50"#,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{err}");
    assert!(
        err.contains("dist-run: rank 1 failed first (signal: 9"),
        "{err}"
    );
    assert!(err.contains("rank 0: killed by the launcher"), "{err}");
}

/// `--replace 1`: rank 1 dies by SIGKILL; the launcher starts one replacement with the same
/// RANK and DIST_JOIN=1, prefixed `[r1+1]`, and the job passes once it and the others exit 0.
/// The replacement dying too is a second death beyond the allowance of one: the job fails, and
/// no second replacement starts.
#[test]
fn a_rank_that_dies_is_replaced_up_to_the_bound() {
    let dir = std::env::temp_dir().join(format!("dist-run-replace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join("replaced");
    let _ = std::fs::remove_file(&marker);
    // The others wait until the replacement has said it is there.
    let script = format!(
        r#"if [ "${{DIST_JOIN:-0}}" = 1 ]; then echo "replacement of $RANK"; touch {m}; exit 0; fi
        if [ "$RANK" = 1 ]; then kill -KILL $$; fi
        while [ ! -e {m} ]; do sleep 0.01; done
        echo "rank $RANK: done""#,
        m = marker.display()
    );
    let out = sh(&["-n", "3", "--grace", "0.2", "--replace", "1"], &script);
    let err = text(&out.stderr);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        stdout.contains("[r1+1] replacement of 1"),
        "{stdout}\n{err}"
    );
    for r in [0, 2] {
        let want = format!("[r{r}] rank {r}: done");
        assert!(stdout.contains(&want), "no {want:?} in:\n{stdout}\n{err}");
    }
    assert!(
        err.contains("dist-run: replacement 1 started for rank 1"),
        "{err}"
    );
    let _ = std::fs::remove_file(&marker);

    // Every process of rank 1 dies: the replacement's death is the second.
    let out = sh(
        &["-n", "2", "--grace", "0.2", "--replace", "1"],
        r#"[ "$RANK" = 1 ] && kill -KILL $$; exec sleep 50"#,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{err}");
    for want in [
        "dist-run: replacement 1 of rank 1 failed first beyond the allowance (signal: 9",
        "dist-run: replacement 1 of rank 1: signal: 9",
    ] {
        assert!(err.contains(want), "no {want:?} in:\n{err}");
    }
    assert!(!err.contains("replacement 2"), "{err}");
}

/// `--tolerate 1`: rank 2 dies by SIGKILL; the others go on (no grace period starts: they are
/// not killed though they outlive it) and the job passes with a note naming rank 2. A second
/// death ends the job with its signal; a rank that exits 5 ends it at once.
#[test]
fn tolerated_failures_leave_the_survivors_running() {
    let dir = std::env::temp_dir().join(format!("dist-run-tolerate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join("gone");
    let _ = std::fs::remove_file(&marker);
    // The survivors outlive the grace period (0.2 s) by far after rank 2's death.
    let script = format!(
        r#"if [ "$RANK" = 2 ]; then touch {m}; kill -KILL $$; fi
        while [ ! -e {m} ]; do sleep 0.01; done; sleep 1
        echo "rank $RANK: done without rank 2""#,
        m = marker.display()
    );
    let out = sh(&["-n", "3", "--grace", "0.2", "--tolerate", "1"], &script);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let stdout = text(&out.stdout);
    for r in [0, 1] {
        let want = format!("[r{r}] rank {r}: done without rank 2");
        assert!(stdout.contains(&want), "no {want:?} in:\n{stdout}\n{err}");
    }
    assert!(
        err.contains("dist-run: rank 2 died (signal: 9 (SIGKILL)), within --tolerate 1"),
        "{err}"
    );
    assert!(!err.contains("killed by the launcher"), "{err}");
    let _ = std::fs::remove_file(&marker);

    // Two deaths with an allowance of one: the second ends the job, with its signal.
    let script = format!(
        r#"if [ "$RANK" = 2 ]; then touch {m}; kill -KILL $$; fi
        while [ ! -e {m} ]; do sleep 0.01; done
        if [ "$RANK" = 1 ]; then sleep 0.3; kill -TERM $$; fi
        exec sleep 50"#,
        m = marker.display()
    );
    let out = sh(&["-n", "3", "--grace", "0.2", "--tolerate", "1"], &script);
    let _ = std::fs::remove_file(&marker);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    for want in [
        "dist-run: ranks [2] died within the allowance of 1",
        "dist-run: rank 1 failed first beyond the allowance (signal: 15",
        "dist-run: rank 0: killed by the launcher",
    ] {
        assert!(err.contains(want), "no {want:?} in:\n{err}");
    }

    // A rank that exits with a status of its own is no death: it fails the job at once.
    let out = sh(
        &["-n", "2", "--grace", "0.2", "--tolerate", "1"],
        r#"[ "$RANK" = 1 ] && exit 5; exec sleep 50"#,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert!(
        err.contains("dist-run: rank 1 failed first (exit status: 5"),
        "{err}"
    );
}

/// Starts `dist-run -n 2` on a script that says "ready" and then waits for `sig`, sends `sig`
/// to the launcher (only: the ranks are in process groups of their own), and returns its
/// output and exit status.
fn interrupt(sig: libc::c_int, name: &str) -> (Vec<String>, Option<i32>) {
    let script = format!(
        r#"trap 'echo "rank $RANK got {name}"; exit 5' {name}; echo ready
        while :; do sleep 0.02; done"#
    );
    let mut child = Command::new(BIN)
        .args([
            "-n",
            "2",
            "--timeout",
            "60",
            "--grace",
            "20",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx2.send(l);
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while lines
        .iter()
        .filter(|l: &&String| l.ends_with("] ready"))
        .count()
        < 2
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!("the ranks did not start: {lines:?}");
            }
        }
    }
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's, not yet waited
    // for, so it names that process.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("dist-run did not end: {lines:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // The readers end with the pipes.
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
        lines.push(l);
    }
    (lines, status.code())
}

#[test]
fn sigint_and_sigterm_reach_every_rank() {
    for (sig, name) in [(libc::SIGINT, "INT"), (libc::SIGTERM, "TERM")] {
        let (lines, code) = interrupt(sig, name);
        assert_eq!(code, Some(128 + sig), "{name}: {lines:#?}");
        for r in 0..2 {
            let want = format!("[r{r}] rank {r} got {name}");
            assert!(lines.contains(&want), "{name}: no {want:?} in {lines:#?}");
            let status = format!("dist-run: rank {r}: exit status: 5");
            assert!(
                lines.iter().any(|l| l.starts_with(&status)),
                "{name}: {lines:#?}"
            );
        }
        assert!(
            lines
                .iter()
                .any(|l| l == &format!("dist-run: interrupted by SIG{name}: sent on to the ranks")),
            "{lines:#?}"
        );
    }
}

#[test]
fn a_taken_port_is_refused_before_any_rank_starts() {
    let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let out = sh(&["-n", "2", "--master-port", &port], "echo started");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("port {port} is in use")), "{err}");
    assert!(
        out.stdout.is_empty(),
        "a rank started: {}",
        text(&out.stdout)
    );
}

#[test]
fn usage_errors_and_a_missing_program_are_told_apart() {
    let out = Command::new(BIN).args(["--bogus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown option --bogus"));
    let out = Command::new(BIN)
        .args(["-n", "2", "/nonexistent/program"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{err}");
    assert!(
        err.contains("rank 0: cannot start /nonexistent/program"),
        "{err}"
    );
}

#[test]
fn simulated_hosts_place_ranks_in_blocks() {
    if let Some(why) = dist_run::hosts::unavailable() {
        println!("skipped: {why}");
        return;
    }
    let out = sh(
        &["-n", "4", "--hosts", "2"],
        r#"echo "$RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $DIST_TEST_HOST $(ip netns identify $$)""#,
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 4, "{stdout}");
    for (r, l) in lines.iter().enumerate() {
        let host = r / 2;
        let start = format!("[r{r}] {r} {} 2 10.213.0.1 {host} dist-", r % 2);
        assert!(l.starts_with(&start), "{l:?}, not {start:?}");
        assert!(l.ends_with(&format!("-h{host}")), "{l:?}");
    }
}

/// `--rate` puts a token bucket filter at that rate on every host's `eth0`, on the bridge's veth
/// and on the delay hub's TAP alike. (That the cap holds for traffic: the multirank target's
/// `hosts_rate_holds_*` trials.)
#[test]
fn a_rate_caps_every_hosts_link() {
    if let Some(why) = dist_run::rate::unavailable() {
        println!("skipped: {why}");
        return;
    }
    for extra in [&[][..], &["--delay-ms", "1"]] {
        let mut args = vec!["-n", "3", "--hosts", "3", "--rate", "250mbit"];
        args.extend(extra);
        let out = sh(&args, "tc qdisc show dev eth0");
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 3, "{stdout}");
        for l in lines {
            assert!(
                l.contains("qdisc tbf") && l.contains("rate 250Mbit") && l.contains("lat 50ms"),
                "{extra:?}: {l}"
            );
        }
    }
}

#[test]
fn a_port_taken_after_the_check_is_explained() {
    // What dist's rank 0 prints when its bind fails.
    let out = sh(
        &["-n", "2", "--grace", "0.2"],
        r#"if [ "$RANK" = 0 ]; then
            echo "rank 0: bind 127.0.0.1:$MASTER_PORT: Address already in use (os error 98)" >&2
            exit 1
        fi
        exec sleep 50"#,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("but another program bound it before rank 0 did"),
        "{err}"
    );
    assert!(err.contains("rank 1: killed by the launcher"), "{err}");
}

/// Whether process `pid` is gone (or a zombie no one has reaped yet, which runs nothing).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // `PID (COMM) STATE ...`
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

#[test]
fn ranks_do_not_outlive_a_killed_launcher() {
    if !cfg!(target_os = "linux") {
        println!("skipped: the parent-death signal is Linux's");
        return;
    }
    let mut child = Command::new(BIN)
        .args([
            "-n",
            "2",
            "--timeout",
            "60",
            "sh",
            "-c",
            "echo \"pid $$\"; exec sleep 50",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut pids = Vec::new();
    while pids.len() < 2 {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => pids.push(l.rsplit(' ').next().unwrap().parse::<i32>().unwrap()),
            Err(e) => {
                let _ = child.kill();
                panic!("the ranks did not start: {e}");
            }
        }
    }
    assert!(pids.iter().all(|&p| !gone(p)), "{pids:?} ended early");
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pids.iter().all(|&p| gone(p)) {
        assert!(
            Instant::now() < deadline,
            "ranks {pids:?} outlived their launcher by 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

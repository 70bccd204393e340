//! The simulated hosts' part of the harness: cases that declare `hosts=H` run on H network
//! namespaces ([`dist_launch::Hosts`]), made for the trial and deleted after it; and the guard's
//! own tests, that a failed run and an interrupted one leave no namespace, bridge or veth.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dist_launch::{Hosts, Job, Outcome};
use libtest_mimic::Failed;

/// Set in the environment of the copy of this program that `an_interrupted_run_leaves_nothing`
/// starts and interrupts.
const CHILD: &str = "DIST_TEST_HOSTS_CHILD";

/// Runs `job` on `count` simulated hosts, made for it and deleted after.
pub(crate) fn run_on(job: &dist_launch::Job, count: usize) -> Result<Outcome, String> {
    let hosts = Hosts::create(count)?;
    dist_launch::run_on(job, Some(&hosts))
}

/// The interface names of the root namespace.
fn root_links() -> Result<BTreeSet<String>, String> {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .map_err(|e| format!("run ip: {e}"))?;
    // Lines are `N: NAME[@PEER]: <FLAGS> ...`.
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .collect())
}

/// What of the run named `prefix` is left: its namespaces, and links of the root namespace that
/// were not there `before`.
fn leftovers(prefix: &str, before: &BTreeSet<String>) -> Result<Vec<String>, String> {
    let mut left: Vec<String> = dist_launch::hosts::namespaces()?
        .into_iter()
        .filter(|n| n.starts_with(prefix))
        .map(|n| format!("namespace {n}"))
        .collect();
    left.extend(
        root_links()?
            .difference(before)
            .map(|l| format!("link {l} in the root namespace")),
    );
    Ok(left)
}

fn sh(script: &str, world: usize) -> Job {
    Job {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        world,
        timeout: Duration::from_secs(60),
        label: "hosts ".into(),
        env: Vec::new(),
        plain_rank0: false,
        echo: false,
        tolerate: 0,
        replace: 0,
    }
}

/// Ranks on 3 hosts see their host's address and loopback, reach host 0, and fail; the failed
/// run leaves nothing behind.
pub(crate) fn a_failed_run_leaves_nothing() -> Result<(), Failed> {
    let before = root_links()?;
    let hosts = Hosts::create(3)?;
    let prefix = hosts.prefix().to_string();
    // Each rank checks where it is, then fails (rank 2, on host 2, with status 3).
    let script = r#"
        ip -o addr show dev eth0 | grep -q "inet 10.213.0.$((DIST_TEST_HOST + 1))/" || exit 10
        ip -o link show lo | grep -q "UP" || exit 11
        [ "$(ip netns identify $$)" = "$DIST_TEST_NETNS" ] || exit 12
        [ "$MASTER_ADDR" = 10.213.0.1 ] || exit 13
        [ "$RANK" = 2 ] && exit 3
        exit 0"#;
    let outcome = dist_launch::run_on(&sh(script, 3), Some(&hosts))?;
    match &outcome {
        Outcome::Failed(why) if why.contains("rank 2 failed") && why.contains("status: 3") => {}
        other => return Err(format!("expected rank 2 to fail with 3, got {other:?}").into()),
    }
    let during = dist_launch::hosts::namespaces()?;
    if during.iter().filter(|n| n.starts_with(&prefix)).count() != 4 {
        return Err(format!("expected 3 hosts and a bridge named {prefix}*: {during:?}").into());
    }
    drop(hosts);
    let left = leftovers(&prefix, &before)?;
    if !left.is_empty() {
        return Err(format!("a failed run left {left:?}").into());
    }
    Ok(())
}

/// SIGINT to a launcher with ranks running on 2 hosts: it stops them, deletes the namespaces and
/// exits with 130.
pub(crate) fn an_interrupted_run_leaves_nothing() -> Result<(), Failed> {
    let before = root_links()?;
    let mut child = Command::new(std::env::current_exe()?)
        .env(CHILD, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let Some(prefix) = line.trim().strip_prefix("hosts ").map(str::to_owned) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("the child did not name its hosts: {line:?}").into());
    };
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child's, not yet
    // waited for, so it names that process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the interrupted launcher did not exit within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let left = leftovers(&prefix, &before)?;
    if status.code() != Some(130) || !left.is_empty() {
        return Err(format!("interrupted launcher: {status}, left {left:?}").into());
    }
    Ok(())
}

/// Set in the environment of the two ranks of `a_delay_holds_every_frame`.
const RTT: &str = "DIST_TEST_HOSTS_RTT";
/// The delay `a_delay_holds_every_frame` asks for.
const DELAY: Duration = Duration::from_millis(20);

/// Hosts made with a 20 ms delay: every TCP round trip between them takes at least 40 ms, and
/// the run leaves nothing behind.
pub(crate) fn a_delay_holds_every_frame() -> Result<(), Failed> {
    let before = root_links()?;
    let hosts = Hosts::with_delay(2, DELAY)?;
    let prefix = hosts.prefix().to_string();
    let job = Job {
        program: std::env::current_exe()?,
        args: Vec::new(),
        world: 2,
        timeout: Duration::from_secs(60),
        label: "rtt ".into(),
        env: vec![(RTT.into(), "1".into())],
        plain_rank0: false,
        echo: false,
        tolerate: 0,
        replace: 0,
    };
    let outcome = dist_launch::run_on(&job, Some(&hosts))?;
    drop(hosts);
    if !matches!(outcome, Outcome::Passed) {
        return Err(format!("{outcome:?}").into());
    }
    let left = leftovers(&prefix, &before)?;
    if !left.is_empty() {
        return Err(format!("a delayed run left {left:?}").into());
    }
    Ok(())
}

/// A rank of `a_delay_holds_every_frame`: rank 1 echoes bytes on MASTER_PORT of its host;
/// rank 0 connects to it from host 0 and times 5 round trips of one byte.
fn rtt_rank() -> Result<(), String> {
    use std::io::{Read, Write};
    let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} is not set"));
    let port: u16 = var("MASTER_PORT")?.parse().map_err(|e| format!("{e}"))?;
    let mut b = [0u8; 1];
    if var("RANK")? == "1" {
        let l = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| e.to_string())?;
        let (mut s, _) = l.accept().map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        for _ in 0..5 {
            s.read_exact(&mut b).map_err(|e| e.to_string())?;
            s.write_all(&b).map_err(|e| e.to_string())?;
        }
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        // Retried until rank 1 listens, within the deadline.
        match std::net::TcpStream::connect_timeout(
            &format!("10.213.0.2:{port}").parse().expect("an address"),
            Duration::from_secs(5),
        ) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(format!("connect: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    for i in 0..5 {
        let t = Instant::now();
        s.write_all(&b).map_err(|e| e.to_string())?;
        s.read_exact(&mut b).map_err(|e| e.to_string())?;
        let rtt = t.elapsed();
        println!("round trip {i}: {rtt:.2?}");
        if rtt < 2 * DELAY {
            return Err(format!(
                "a round trip took {rtt:?}, under twice the delay {DELAY:?}"
            ));
        }
    }
    Ok(())
}

/// Set in the environment of the two ranks of `a_rate_holds_*`: the bytes rank 0 sends.
const RATE_SEND: &str = "DIST_TEST_HOSTS_RATE_SEND";
/// The cap `a_rate_holds_*` asks for, in bits per second.
const RATE: u64 = 100_000_000;
/// What rank 0 sends through the cap: at 100 Mbit/s about 0.66 s.
const RATE_BYTES: u64 = 8 << 20;

/// Two hosts capped at 100 Mbit/s, joined by the bridge or (`delay`) by the hub: 8 MiB sent
/// from host 0 to host 1 take at least (8 MiB − the bucket) · 8 / 100 Mbit/s (the cap's
/// property: its bucket is all that may pass faster), and the run leaves nothing behind.
/// (Ignored, with the reason, where `tc` or the kernel's tbf is missing.)
fn a_rate_holds(delay: Option<Duration>) -> Result<(), Failed> {
    let rate = dist_launch::rate::Rate::new(RATE)?;
    let before = root_links()?;
    let link = dist_launch::Link {
        delay,
        rate: Some(rate),
    };
    let hosts = Hosts::with_link(2, link)?;
    let prefix = hosts.prefix().to_string();
    let job = Job {
        program: std::env::current_exe()?,
        args: Vec::new(),
        world: 2,
        timeout: Duration::from_secs(60),
        label: "rate ".into(),
        env: vec![(RATE_SEND.into(), RATE_BYTES.to_string())],
        plain_rank0: false,
        echo: false,
        tolerate: 0,
        replace: 0,
    };
    let outcome = dist_launch::run_on(&job, Some(&hosts))?;
    drop(hosts);
    if !matches!(outcome, Outcome::Passed) {
        return Err(format!("{outcome:?}").into());
    }
    let left = leftovers(&prefix, &before)?;
    if !left.is_empty() {
        return Err(format!("a rate-capped run left {left:?}").into());
    }
    Ok(())
}

/// [`a_rate_holds`] on hosts joined by the bridge (the cap on each host's veth).
pub(crate) fn a_rate_holds_through_the_bridge() -> Result<(), Failed> {
    a_rate_holds(None)
}

/// [`a_rate_holds`] on hosts joined by the delay hub, 1 ms apart (the cap on each host's TAP).
pub(crate) fn a_rate_holds_through_the_hub() -> Result<(), Failed> {
    a_rate_holds(Some(Duration::from_millis(1)))
}

/// A rank of `a_rate_holds_*`: rank 1 reads the bytes on MASTER_PORT of its host and answers
/// one byte; rank 0 connects from host 0, sends them and times until the answer, which must
/// come no sooner than the cap allows.
fn rate_rank(bytes: u64) -> Result<(), String> {
    use std::io::{Read, Write};
    let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} is not set"));
    let port: u16 = var("MASTER_PORT")?.parse().map_err(|e| format!("{e}"))?;
    let rate = dist_launch::rate::Rate::new(RATE)?;
    let io = |e: std::io::Error| e.to_string();
    if var("RANK")? == "1" {
        let l = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(io)?;
        let (mut s, _) = l.accept().map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0u64;
        while got < bytes {
            let n = s.read(&mut buf).map_err(io)?;
            if n == 0 {
                return Err(format!("the sender closed after {got} of {bytes} bytes"));
            }
            got += n as u64;
        }
        return s.write_all(&[1]).map_err(io);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        // Retried until rank 1 listens, within the deadline.
        match std::net::TcpStream::connect_timeout(
            &format!("10.213.0.2:{port}").parse().expect("an address"),
            Duration::from_secs(5),
        ) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(format!("connect: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io)?;
    s.set_write_timeout(Some(Duration::from_secs(30)))
        .map_err(io)?;
    let chunk = vec![7u8; 1 << 16];
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        let n = chunk.len().min((bytes - sent) as usize);
        s.write_all(&chunk[..n]).map_err(io)?;
        sent += n as u64;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).map_err(io)?;
    let took = t.elapsed();
    let least = rate.least_time(bytes);
    let mbit = bytes as f64 * 8.0 / took.as_secs_f64() / 1e6;
    println!(
        "{bytes} bytes in {took:.3?} ({mbit:.1} Mbit/s), the cap {rate}: at least {least:.3?}"
    );
    if took < least {
        return Err(format!(
            "{bytes} bytes took {took:?} through a cap of {rate}, under the least {least:?}"
        ));
    }
    Ok(())
}

/// The child of `an_interrupted_run_leaves_nothing` (or a rank of `a_delay_holds_every_frame`
/// or of `a_rate_holds_*`), when this program runs as one: makes 2
/// hosts, says their prefix, and runs 4 ranks that wait until killed.
pub(crate) fn child() -> Option<std::process::ExitCode> {
    if let Some(bytes) = std::env::var(RATE_SEND).ok().and_then(|b| b.parse().ok()) {
        return Some(match rate_rank(bytes) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{e}");
                std::process::ExitCode::FAILURE
            }
        });
    }
    if std::env::var_os(RTT).is_some() {
        return Some(match rtt_rank() {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{e}");
                std::process::ExitCode::FAILURE
            }
        });
    }
    std::env::var_os(CHILD)?;
    let hosts = match Hosts::create(2) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("{e}");
            return Some(std::process::ExitCode::FAILURE);
        }
    };
    println!("hosts {}", hosts.prefix());
    let r = dist_launch::run_on(&sh("exec sleep 60", 4), Some(&hosts));
    eprintln!("the ranks ended: {r:?}");
    drop(hosts);
    Some(std::process::ExitCode::FAILURE)
}

//! `cargo xtask store`: serves a store that clients use, until SIGINT or SIGTERM stops it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dist_store::{Store, TcpStore};

const WAIT: Duration = Duration::from_secs(10);

/// Starts `xtask store` on a free loopback port; returns it and the address it printed.
fn serve() -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["store", "--port", "0", "--bind", "127.0.0.1"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("store serving on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

/// Sends `signal` to `child` and waits (at most 10 s) for it to end; returns how it ended.
fn stop(child: &mut Child, signal: &str) -> std::process::ExitStatus {
    let ok = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill {signal}");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "still serving after {signal}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serves_until_sigterm_or_sigint() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, number) in [("-TERM", 15), ("-INT", 2)] {
        let (mut child, addr) = serve();
        let a = TcpStore::connect(addr.as_str(), WAIT).unwrap();
        let b = TcpStore::connect(addr.as_str(), WAIT).unwrap();
        a.set("job/leader", b"rank 3").unwrap();
        assert_eq!(b.get("job/leader", WAIT).unwrap(), b"rank 3");
        assert_eq!(a.add("n", 2).unwrap() + b.add("n", 1).unwrap(), 5);
        let status = stop(&mut child, signal);
        assert_eq!(status.signal(), Some(number), "{status:?}");
        // The server is gone: its clients' next operation fails.
        let e = a.get("job/leader", WAIT).unwrap_err();
        assert!(e.to_string().contains(&addr), "{e}");
    }
}

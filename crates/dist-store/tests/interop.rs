//! Interop with PyTorch itself: PyTorch's Python TCPStore client against dist's server, and
//! dist's client against PyTorch's libuv and legacy servers. Runs where a python with torch is
//! found (`DIST_TORCH_PYTHON`, else `python3`), and once more for each other torch version in
//! `DIST_TORCH_PYTHONS` (pythons separated by `:`); each case is named `torch_<version>::<case>`.
//! Elsewhere every case is reported ignored, with "skipped: <reason>" printed first, as is a
//! case the version lacks the query for. Never a pass. (A harness of its own, libtest-mimic's,
//! as the multi-rank tests have: libtest cannot report a skip.)

mod barrier;
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Caps, T, Torch, connect, exercise, torch_pythons};
use dist_store::proto::{self, Request, query};
use dist_store::{Store, StoreError, StoreServer};
use libtest_mimic::{Arguments, Trial};

fn py_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py")
}

/// A PyTorch TCPStore server in a child python; it serves until dropped.
struct TorchServer {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl TorchServer {
    fn start(py: &str, backend: &str) -> TorchServer {
        let mut child = Command::new(py)
            .arg(py_dir().join("torch_server.py"))
            .arg(backend)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python");
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port: u16 = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("torch_server.py printed {line:?}"));
        TorchServer {
            child,
            stdin,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        self.kill();
    }
}

fn dists_client_against_pytorchs_libuv_server(t: &Torch) {
    let server = TorchServer::start(&t.python, "libuv");
    // BARRIER came with PyTorch 2.15; queues are libuv's alone.
    exercise(
        server.addr,
        "rs",
        Caps {
            queues: true,
            server_barrier: t.has_barrier(),
        },
    );
}

fn dists_client_against_pytorchs_legacy_server(t: &Torch) {
    let server = TorchServer::start(&t.python, "legacy");
    exercise(
        server.addr,
        "rs",
        Caps {
            queues: false,
            server_barrier: t.has_barrier(),
        },
    );
    // The legacy server knows no queue queries: it closes the connection, and dist's client
    // reports that as the operation's failure.
    let c = connect(server.addr);
    c.queue_push("q", b"x").unwrap();
    let e = c.queue_len("q").unwrap_err();
    assert!(matches!(e, StoreError::Io { .. }), "{e:?}");
}

fn pytorchs_server_going_away_mid_wait_ends_the_wait(t: &Torch) {
    for backend in ["libuv", "legacy"] {
        let mut server = TorchServer::start(&t.python, backend);
        let c = connect(server.addr);
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            (c.get("never", Duration::from_secs(60)), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        server.kill();
        let (r, took) = waiter.join().unwrap();
        let e = r.unwrap_err();
        assert!(
            matches!(e, StoreError::Io { op: "get", .. }),
            "{backend}: {e:?}"
        );
        assert!(took < Duration::from_secs(10), "{backend}: {took:?}");
    }
}

fn pytorchs_client_against_dists_server(t: &Torch) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let rs = connect(addr);
    rs.set("from_rust", b"hello from rust").unwrap();
    let out = Command::new(&t.python)
        .arg(py_dir().join("torch_client.py"))
        .arg("127.0.0.1")
        .arg(addr.port().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("done"),
        "torch_client.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 25,
        "{stdout}"
    );
    // The script runs its barrier checks where its torch has `Store.barrier` (2.15 and later).
    assert_eq!(
        stdout.contains("ok barrier"),
        t.has_barrier(),
        "torch {}:\n{stdout}",
        t.version
    );
    assert_eq!(rs.get("from_python", T).unwrap(), b"hello from python");
    assert_eq!(rs.get("ctr", T).unwrap(), b"640");
}

fn dists_server_going_away_mid_wait_ends_pytorchs_wait(t: &Torch) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let mut child = Command::new(&t.python)
        .arg(py_dir().join("torch_wait.py"))
        .arg("127.0.0.1")
        .arg(server.local_addr().port().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "waiting");
    std::thread::sleep(Duration::from_millis(300));
    server.stop();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    child.wait().unwrap();
    let secs: f64 = rest
        .strip_prefix("raised after ")
        .and_then(|r| r.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("torch_wait.py said {rest:?}"));
    assert!(secs < 10.0, "{rest}");
}

/// Copies one connection to `upstream`, recording what the client sent.
fn recording_proxy(upstream: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        let (mut down, _) = l.accept().unwrap();
        let mut up = TcpStream::connect(upstream).unwrap();
        let (mut down2, mut up2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut up2, &mut down2));
        let mut b = [0u8; 65536];
        while let Ok(n) = down.read(&mut b) {
            if n == 0 {
                break;
            }
            log2.lock().unwrap().extend_from_slice(&b[..n]);
            if up.write_all(&b[..n]).is_err() {
                break;
            }
        }
        let _ = up.shutdown(std::net::Shutdown::Both);
    });
    (addr, log)
}

/// The bytes PyTorch's client sends, read back with dist's parser: VALIDATE with the magic,
/// PING, keys under "/", a `get` as WAIT then GET, ADD's delta as an i64, a timed-out wait as
/// CANCEL_WAIT; from 2.15 on, `barrier` as BARRIER with the world size as an i64, and a
/// timed-out one as BARRIER, then CANCEL_WAIT.
fn pytorchs_client_sends_what_dists_parser_reads(t: &Torch) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let (proxy, log) = recording_proxy(server.local_addr());
    let barriers = if t.has_barrier() {
        "s.barrier('b', 1)\n\
         try:\n    s.barrier('tb', 2, datetime.timedelta(milliseconds=100))\n\
         except Exception: pass\n"
    } else {
        ""
    };
    let script = format!(
        "import datetime, torch.distributed as d\n\
         s = d.TCPStore('127.0.0.1', {}, is_master=False, timeout=datetime.timedelta(seconds=30))\n\
         s.set('k', 'v'); s.get('k'); s.add('n', 7)\n\
         try:\n    s.wait(['never'], datetime.timedelta(milliseconds=100))\n\
         except Exception: pass\n\
         {barriers}\
         s.num_keys()\n",
        proxy.port()
    );
    let out = Command::new(&t.python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The proxy has seen the last request once the client's answer came through it.
    let bytes = log.lock().unwrap().clone();
    let limits = proto::WireLimits::default();
    let mut reqs = Vec::new();
    let mut at = 0;
    while let Some((r, n)) = proto::parse_request(&bytes[at..], &limits).unwrap() {
        reqs.push(format!("{r:?}"));
        at += n;
    }
    assert_eq!(at, bytes.len(), "every byte is part of a request");
    let mut want = vec![
        format!("{:?}", Request::Validate(proto::VALIDATION_MAGIC)),
        "Ping(".to_string(),
        format!("{:?}", Request::Set(b"/k", b"v")),
        format!("{:?}", Request::Wait(vec![b"/k"])),
        format!("{:?}", Request::Get(b"/k")),
        format!("{:?}", Request::Add(b"/n", 7)),
        format!("{:?}", Request::Wait(vec![b"/never"])),
        format!("{:?}", Request::CancelWait),
    ];
    if t.has_barrier() {
        want.extend([
            format!("{:?}", Request::Barrier(b"/b", 1)),
            format!("{:?}", Request::Barrier(b"/tb", 2)),
            format!("{:?}", Request::CancelWait),
        ]);
    }
    want.push(format!("{:?}", Request::NumKeys));
    assert_eq!(reqs.len(), want.len(), "{reqs:#?}");
    for (got, want) in reqs.iter().zip(&want) {
        assert!(got.starts_with(want.as_str()), "{got} is not {want}");
    }
    assert_eq!(bytes[0], query::VALIDATE);
}

/// What a raw request gets from a server: its answer bytes (up to `want`), or `None` if the
/// server closed the connection instead.
fn raw_exchange(
    addr: SocketAddr,
    validate: bool,
    reqs: &[Request<'_>],
    want: usize,
) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect(addr).unwrap();
    // PyTorch's libuv server looks up each new client's name (reverse DNS) on its loop
    // thread, which can stall it for seconds: a generous deadline.
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut buf = Vec::new();
    if validate {
        proto::encode_request(&mut buf, &Request::Validate(proto::VALIDATION_MAGIC));
    }
    for r in reqs {
        proto::encode_request(&mut buf, r);
    }
    if s.write_all(&buf).is_err() {
        return None;
    }
    let mut got = vec![0u8; want];
    let mut at = 0;
    while at < want {
        match s.read(&mut got[at..]) {
            Ok(0) => return None,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("{addr}: {reqs:?}: {e}"),
        }
    }
    Some(got)
}

/// The servers' differences, checked with raw requests (docs/store.md lists them): a GET of a
/// missing key, a client that skips VALIDATE, libuv's key and value caps, BARRIER (a query type
/// 2.11 does not know).
fn pytorchs_servers_quirks_and_dists_choices(t: &Torch) {
    let libuv = TorchServer::start(&t.python, "libuv");
    let legacy = TorchServer::start(&t.python, "legacy");
    let dist = StoreServer::bind("127.0.0.1:0").unwrap();
    let servers = [
        ("libuv", libuv.addr),
        ("legacy", legacy.addr),
        ("dist", dist.local_addr()),
    ];
    let ping = Request::Ping(9);
    for (name, addr) in servers {
        // GET of a missing key: libuv and dist answer an empty value, legacy closes.
        let got = raw_exchange(addr, true, &[Request::Get(b"/missing"), ping.clone()], 12);
        match name {
            "legacy" => assert_eq!(got, None, "{name}"),
            _ => assert_eq!(
                got.as_deref(),
                Some(&[0u8, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0][..]),
                "{name}"
            ),
        }
        // No VALIDATE first: legacy and dist close the client. libuv neither answers nor closes:
        // it returns from the "miscellaneous client" check leaving the byte unread and the
        // client no longer marked, so the query runs (unvalidated) once more bytes arrive.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut buf = Vec::new();
        proto::encode_request(&mut buf, &Request::Ping(9));
        let first = s.write_all(&buf);
        // Let the first PING arrive alone (the condition under test), then send a second.
        std::thread::sleep(Duration::from_millis(500));
        buf.clear();
        proto::encode_request(&mut buf, &Request::Ping(10));
        let second = s.write_all(&buf);
        let mut got = [0u8; 8];
        let read = first.and(second).and_then(|()| s.read_exact(&mut got));
        match name {
            "libuv" => {
                read.unwrap();
                assert_eq!(got, [9, 0, 0, 0, 10, 0, 0, 0], "{name}");
            }
            _ => assert!(read.is_err(), "{name}: {got:?}"),
        }
        // A key of 8 KiB + 1: past libuv's cap (closed); legacy takes it; dist keeps libuv's cap.
        let long = vec![b'k'; 8 * 1024 + 1];
        let got = raw_exchange(addr, true, &[Request::Set(&long, b"v"), ping.clone()], 4);
        match name {
            "legacy" => assert!(got.is_some(), "{name}"),
            _ => assert_eq!(got, None, "{name}"),
        }
        // A value of 8 MiB + 1: past libuv's cap.
        let big = vec![1u8; 8 * 1024 * 1024 + 1];
        let got = raw_exchange(addr, true, &[Request::Set(b"/big", &big), ping.clone()], 4);
        match name {
            "legacy" => assert!(got.is_some(), "{name}"),
            _ => assert_eq!(got, None, "{name}"),
        }
        // BARRIER (query 18) came with PyTorch 2.15: earlier servers close the client.
        let got = raw_exchange(addr, true, &[Request::Barrier(b"/b", 1)], 1);
        if name == "dist" || t.has_barrier() {
            assert_eq!(got.as_deref(), Some(&[proto::STOP_WAITING][..]), "{name}");
        } else {
            assert_eq!(got, None, "{name}");
        }
        // GETNUMKEYS counts values, not queues (legacy has no queues).
        if name != "legacy" {
            let got = raw_exchange(
                addr,
                true,
                &[
                    Request::QueuePush(b"/numkeys_q", b"x"),
                    Request::NumKeys,
                    Request::QueueLen(b"/numkeys_q"),
                ],
                16,
            )
            .unwrap();
            let before = i64::from_le_bytes(got[..8].try_into().unwrap());
            let c = connect(addr);
            c.set("numkeys_v", b"1").unwrap();
            assert_eq!(c.num_keys().unwrap(), before + 1, "{name}");
            assert_eq!(
                i64::from_le_bytes(got[8..].try_into().unwrap()),
                1,
                "{name}"
            );
        }
    }
}

/// One interop case, given the torch to run.
type Case = fn(&Torch);

fn main() -> std::process::ExitCode {
    let args = Arguments::from_args();
    let cases: [(&str, Case); 8] = [
        (
            "dists_client_against_pytorchs_libuv_server",
            dists_client_against_pytorchs_libuv_server,
        ),
        (
            "dists_client_against_pytorchs_legacy_server",
            dists_client_against_pytorchs_legacy_server,
        ),
        (
            "pytorchs_server_going_away_mid_wait_ends_the_wait",
            pytorchs_server_going_away_mid_wait_ends_the_wait,
        ),
        (
            "pytorchs_client_against_dists_server",
            pytorchs_client_against_dists_server,
        ),
        (
            "dists_server_going_away_mid_wait_ends_pytorchs_wait",
            dists_server_going_away_mid_wait_ends_pytorchs_wait,
        ),
        (
            "pytorchs_client_sends_what_dists_parser_reads",
            pytorchs_client_sends_what_dists_parser_reads,
        ),
        (
            "pytorchs_servers_quirks_and_dists_choices",
            pytorchs_servers_quirks_and_dists_choices,
        ),
        (
            "barrier_behaves_as_pytorchs_servers",
            barrier::barrier_behaves_as_pytorchs_servers,
        ),
    ];
    let (torches, bad) = torch_pythons();
    // A python listed in DIST_TORCH_PYTHONS that imports no torch was asked for: a failure.
    let mut trials: Vec<Trial> = bad
        .into_iter()
        .map(|why| Trial::test("listed_pythons_import_torch", move || Err(why.into())))
        .collect();
    let torches = match torches {
        Ok(t) => t,
        Err(why) => {
            if !args.list {
                eprintln!("skipped: {why}: every interop case is ignored here");
            }
            // Listed under a placeholder version, every one ignored.
            trials.extend(cases.into_iter().map(|(name, _)| {
                Trial::test(format!("torch_none::{name}"), || Ok(())).with_ignored_flag(true)
            }));
            return libtest_mimic::run(&args, trials).exit_code();
        }
    };
    for t in torches {
        for (name, case) in cases {
            let needs_barrier = name.starts_with("barrier_");
            let skip = needs_barrier && !t.has_barrier();
            if skip && !args.list {
                eprintln!(
                    "skipped: torch_{}::{name}: torch {} has no BARRIER (it came with 2.15)",
                    t.label(),
                    t.version
                );
            }
            let t = t.clone();
            trials.push(
                Trial::test(format!("torch_{}::{name}", t.label()), move || {
                    case(&t);
                    Ok(())
                })
                .with_ignored_flag(skip),
            );
        }
    }
    libtest_mimic::run(&args, trials).exit_code()
}

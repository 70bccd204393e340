//! Load on a TCPStore server (dist's or PyTorch's): `serve` runs dist's server until stdin
//! closes; `storm` opens N connections at once, each VALIDATE + PING + ADD of one counter, and
//! reports when the last was answered and whether the counter is exact; `roundtrips` runs
//! set + get pairs from C clients for a while and reports pairs a second.
//!
//! ```text
//! cargo run --release -p dist-store --example store_load -- serve
//! cargo run --release -p dist-store --example store_load -- storm 127.0.0.1:PORT 10000
//! cargo run --release -p dist-store --example store_load -- roundtrips 127.0.0.1:PORT 64 16 5
//! ```

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use dist_store::proto::{self, Request, VALIDATION_MAGIC};
use dist_store::{Store, StoreServer, TcpStore};
use polling::{Event, Events, Poller};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, what: &str| -> String {
        args.get(i)
            .cloned()
            .unwrap_or_else(|| panic!("missing argument {i}: {what}"))
    };
    match args.first().map(String::as_str) {
        Some("serve") => serve(args.get(1).map_or(0, |p| p.parse().expect("port"))),
        Some("storm") => storm(
            arg(1, "addr").parse().expect("addr"),
            arg(2, "clients").parse().expect("clients"),
            args.get(3)
                .map_or(600.0, |s| s.parse().expect("deadline seconds")),
        ),
        Some("roundtrips") => roundtrips(
            arg(1, "addr").parse().expect("addr"),
            arg(2, "clients").parse().expect("clients"),
            arg(3, "value bytes").parse().expect("bytes"),
            arg(4, "seconds").parse().expect("seconds"),
        ),
        _ => {
            eprintln!(
                "usage: store_load serve [PORT] | storm ADDR N [DEADLINE_S] | roundtrips ADDR C BYTES SECS"
            );
            std::process::exit(2);
        }
    }
}

fn serve(port: u16) {
    let server = StoreServer::bind(("127.0.0.1", port)).expect("bind");
    println!("{}", server.local_addr().port());
    let _ = io::stdin().read_to_end(&mut Vec::new());
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting,
    Pinged,
    Added,
    Done,
}

struct Client {
    s: TcpStream,
    phase: Phase,
    got: Vec<u8>,
    answered: Option<Duration>,
    value: i64,
}

/// N connections at once; each sends VALIDATE + PING, waits for the nonce, sends ADD, waits for
/// the sum; all stay open until the last is answered (or the deadline passes: then the count
/// answered by then is reported).
fn storm(addr: SocketAddr, n: usize, deadline_s: f64) {
    let key = b"/storm_counter";
    let base = TcpStore::connect(addr, Duration::from_secs(30))
        .and_then(|c| c.add("storm_counter", 0))
        .expect("read the counter");
    let poller = Poller::new().expect("poller");
    let mut clients: Vec<Client> = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket (is the descriptor limit high enough?)");
        sock.set_nonblocking(true).unwrap();
        sock.set_tcp_nodelay(true).unwrap();
        match sock.connect(&addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc_einprogress()) => {}
            Err(e) => panic!("connect {i}: {e}"),
        }
        let s: TcpStream = sock.into();
        // SAFETY: every stream stays in `clients` until after the poller is dropped below.
        unsafe { poller.add(&s, Event::writable(i)) }.expect("register");
        clients.push(Client {
            s,
            phase: Phase::Connecting,
            got: Vec::new(),
            answered: None,
            value: 0,
        });
    }
    let opened = start.elapsed();
    let mut done = 0;
    let mut events = Events::new();
    let mut failed = 0;
    let deadline = start + Duration::from_secs_f64(deadline_s);
    while done + failed < n && Instant::now() < deadline {
        events.clear();
        poller
            .wait(&mut events, Some(Duration::from_secs(1)))
            .expect("wait");
        for ev in events.iter() {
            let c = &mut clients[ev.key];
            let r = step(c, key, start);
            match r {
                Ok(true) => {
                    if c.phase == Phase::Done {
                        done += 1;
                        continue;
                    }
                    let interest = if c.phase == Phase::Connecting {
                        Event::writable(ev.key)
                    } else {
                        Event::readable(ev.key)
                    };
                    poller.modify(&c.s, interest).expect("modify");
                }
                Ok(false) => poller
                    .modify(&c.s, Event::readable(ev.key))
                    .expect("modify"),
                Err(e) => {
                    failed += 1;
                    if failed <= 5 {
                        eprintln!("client {}: {e}", ev.key);
                    }
                }
            }
        }
    }
    let all = start.elapsed();
    let mut lat: Vec<Duration> = clients.iter().filter_map(|c| c.answered).collect();
    lat.sort();
    let values: HashSet<i64> = clients
        .iter()
        .filter(|c| c.phase == Phase::Done)
        .map(|c| c.value)
        .collect();
    let expect: HashSet<i64> = (base + 1..=base + n as i64).collect();
    drop(poller);
    // Answers that came back are exact or not whatever the server does next; the final read
    // may fail if the server is still busy with the storm's leftovers.
    let after = TcpStore::connect(addr, Duration::from_secs(30))
        .and_then(|c| c.add("storm_counter", 0))
        .unwrap_or_else(|e| {
            eprintln!("final read of the counter failed: {e}");
            -1
        });
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    println!(
        "storm clients={n} answered={} failed={failed} opened_in={:.3}s all_answered_in={:.3}s \
         p50={:.3}s p99={:.3}s max={:.3}s counter_exact={} (counter {} -> {}, answers a \
         permutation of {}..={}: {})",
        lat.len(),
        opened.as_secs_f64(),
        all.as_secs_f64(),
        pct(0.5).as_secs_f64(),
        pct(0.99).as_secs_f64(),
        lat.last().copied().unwrap_or_default().as_secs_f64(),
        after == base + n as i64 && values == expect && lat.len() == n,
        base,
        after,
        base + 1,
        base + n as i64,
        values == expect,
    );
    drop(clients);
}

fn libc_einprogress() -> i32 {
    115 // EINPROGRESS on Linux
}

/// Advances one client; `Ok(true)` when it moved to a new phase or finished.
fn step(c: &mut Client, key: &[u8], start: Instant) -> io::Result<bool> {
    match c.phase {
        Phase::Connecting => {
            if let Some(e) = c.s.take_error()? {
                return Err(e);
            }
            let mut buf = Vec::new();
            proto::encode_request(&mut buf, &Request::Validate(VALIDATION_MAGIC));
            proto::encode_request(&mut buf, &Request::Ping(7));
            match c.s.write(&buf) {
                Ok(n) if n == buf.len() => {
                    c.phase = Phase::Pinged;
                    Ok(true)
                }
                Ok(_) => Err(io::Error::other("short write")),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(true),
                Err(e) => Err(e),
            }
        }
        Phase::Pinged | Phase::Added => {
            let want = if c.phase == Phase::Pinged { 4 } else { 8 };
            let mut b = [0u8; 16];
            loop {
                match c.s.read(&mut b[..want - c.got.len()]) {
                    Ok(0) => return Err(io::Error::other("server closed")),
                    Ok(k) => c.got.extend_from_slice(&b[..k]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(e),
                }
                if c.got.len() == want {
                    break;
                }
            }
            if c.phase == Phase::Pinged {
                if c.got != 7u32.to_le_bytes() {
                    return Err(io::Error::other("wrong nonce"));
                }
                c.got.clear();
                let mut buf = Vec::new();
                proto::encode_request(&mut buf, &Request::Add(key, 1));
                c.s.write_all(&buf)?;
                c.phase = Phase::Added;
            } else {
                c.value = i64::from_le_bytes(c.got[..8].try_into().unwrap());
                c.answered = Some(start.elapsed());
                c.phase = Phase::Done;
            }
            Ok(true)
        }
        Phase::Done => Ok(true),
    }
}

/// C clients, each its own connection and key, set + get of `bytes` bytes for `secs` seconds.
fn roundtrips(addr: SocketAddr, clients: usize, bytes: usize, secs: f64) {
    let value: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let stores: Vec<TcpStore> = (0..clients)
        .map(|_| TcpStore::connect(addr, Duration::from_secs(60)).expect("connect"))
        .collect();
    let barrier = std::sync::Barrier::new(clients);
    let t0 = Instant::now();
    let counts: Vec<(u64, Duration)> = std::thread::scope(|sc| {
        let hs: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let value = &value;
                let barrier = &barrier;
                sc.spawn(move || {
                    let key = format!("rt{i}");
                    barrier.wait();
                    let start = Instant::now();
                    let end = start + Duration::from_secs_f64(secs);
                    let mut n = 0u64;
                    while Instant::now() < end {
                        s.set(&key, value).expect("set");
                        let got = s.get(&key, Duration::from_secs(60)).expect("get");
                        assert_eq!(got.len(), value.len());
                        n += 1;
                    }
                    (n, start.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let total: u64 = counts.iter().map(|c| c.0).sum();
    let wall = counts.iter().map(|c| c.1).max().unwrap_or_default();
    println!(
        "roundtrips clients={clients} value_bytes={bytes} pairs={total} seconds={:.2} \
         set+get_pairs_per_s={:.0} MB/s={:.1} (wall {:.1}s)",
        wall.as_secs_f64(),
        total as f64 / wall.as_secs_f64(),
        2.0 * (total as f64) * bytes as f64 / wall.as_secs_f64() / 1e6,
        t0.elapsed().as_secs_f64()
    );
}

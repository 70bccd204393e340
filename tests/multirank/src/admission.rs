//! Admission under a flood: idle and garbage connections on rank 0's listener while the ranks
//! join.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use dist_core::{Collectives, ReduceOp};
use dist_tcp::TcpBackend;
use dist_tcp::wire::{HELLO_LEN, REPLY_LEN, Refusal, Reply};

use dist_multirank::{self as common, fill};

/// Idle connections in the flood.
const IDLE: usize = 2000;
/// Connections that send garbage.
const GARBAGE: usize = 200;
/// The most handshakes a listener runs at once (dist-tcp's `MAX_HANDSHAKES`).
const CAP: usize = 64;
/// Rank 0's handshake deadline in this case.
const HANDSHAKE: Duration = Duration::from_secs(2);

/// Connects, waiting for rank 0 to bind its port.
fn first_connection(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut backoff = Duration::from_millis(5);
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return s,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "rank 0's listener never opened: {e}"
                );
                // Rank 0 may not have bound its port yet: retry with backoff.
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// Whether rank 0 still holds `s` open (it has sent nothing on an idle connection, so a
/// readable socket is a closed one).
fn still_open(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let open = matches!(s.peek(&mut [0u8; 1]),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

/// How a peer ended a connection: the bytes it sent first, and whether it reset the
/// connection rather than closing it (a socket closed with bytes unread sends a reset).
pub struct Ended {
    pub bytes: Vec<u8>,
    pub reset: bool,
}

/// Reads `s` until the other side closes it, by end of stream or reset. Panics, naming `what`,
/// if it is still open after `within` (a read timeout is no close), or on any other error.
pub fn read_until_closed(s: &mut TcpStream, within: Duration, what: &str) -> Ended {
    let deadline = Instant::now() + within;
    let open = |bytes: &[u8]| -> ! {
        panic!(
            "{what}: still open after {within:?} ({} bytes read)",
            bytes.len()
        )
    };
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // At least a moment: a connection closed already reads as such at once.
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => {
                return Ended {
                    bytes,
                    reset: false,
                };
            }
            Ok(k) if Instant::now() < deadline => bytes.extend_from_slice(&buf[..k]),
            Ok(_) => open(&bytes),
            Err(e) => match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted => {
                    return Ended { bytes, reset: true };
                }
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => open(&bytes),
                _ => panic!("{what}: {e}"),
            },
        }
    }
}

/// The last rank, before it joins (so while the others are joining and rank 0 cannot have
/// finished the rendezvous), opens 2,000 idle connections and 200 that send garbage to rank
/// 0's listener (its address from the job's store; rank 0 accepts on it from the start). Rank 0 holds at most 64 of them open at any time, closing the rest at once (on
/// main it gave each a thread and held all of them until its handshake deadline); the garbage
/// is refused or closed, each by its handshake deadline; then the job forms and an all_reduce
/// is checked.
pub fn flood() -> Result<(), String> {
    let mut cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    if me == 0 {
        cfg = cfg.handshake_timeout(HANDSHAKE);
    }
    let mut flood = Vec::new();
    if me == n - 1 {
        let addr = common::rank0_listener();
        let t = Instant::now();
        flood.push(first_connection(addr));
        // Garbage among the idle connections: early garbage finds a free place and is refused
        // as not a dist peer, later garbage is closed at once like the idle connections.
        let mut garbage = Vec::new();
        let mut failed = 0;
        for i in 1..IDLE + GARBAGE {
            let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
                failed += 1;
                continue;
            };
            let every = (IDLE + GARBAGE) / GARBAGE;
            if i % every == every - 1 {
                let mut junk = [0u8; HELLO_LEN];
                fill(&mut junk, i as u64);
                let _ = s.write_all(&junk);
                garbage.push(s);
            } else {
                flood.push(s);
            }
        }
        assert!(
            flood.len() > 4 * CAP,
            "only {} of {IDLE} idle connections connected",
            flood.len()
        );
        let flooded = t.elapsed();
        // Rank 0 drains its backlog, closing what is over the cap, well within the handshake
        // deadline of the connections it holds.
        let held = loop {
            let held = flood.iter().filter(|s| still_open(s)).count();
            if held <= CAP || t.elapsed() > flooded + HANDSHAKE / 2 {
                break held;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let drained = t.elapsed();
        assert!(
            held <= CAP,
            "rank 0 holds {held} of {} idle connections open {:?} after the flood",
            flood.len(),
            drained - flooded
        );
        // Each garbage connection is refused or closed by its handshake deadline (counted from
        // its accept, which came before the backlog was drained): a read that times out is a
        // connection left open, not one closed.
        let (mut refused, mut closed) = (0, 0);
        for (i, s) in garbage.iter_mut().enumerate() {
            let left = (drained + HANDSHAKE + Duration::from_secs(1)).saturating_sub(t.elapsed());
            let got = read_until_closed(s, left, &format!("garbage connection {i}")).bytes;
            match got.len() {
                0 => closed += 1,
                REPLY_LEN => {
                    let r = Reply::decode(&got).unwrap();
                    assert_eq!(r.refusal, Some(Refusal::BadMagic), "{}", r.reason);
                    refused += 1;
                }
                k => panic!("{k} bytes back for garbage"),
            }
        }
        println!(
            "{} idle connections ({failed} failed to connect) and {} garbage in {flooded:.1?}; \
             {held} held open; garbage: {refused} refused, {closed} closed unanswered",
            flood.len(),
            garbage.len()
        );
    }
    let t = Instant::now();
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    println!("joined in {:.1?}", t.elapsed());
    let mut x = vec![me as u64 + 1; 1000];
    b.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    let want = (n * (n + 1) / 2) as u64;
    assert!(
        x.iter().all(|v| *v == want),
        "all_reduce: {} != {want}",
        x[0]
    );
    drop(flood);
    Ok(())
}

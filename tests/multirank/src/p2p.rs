//! Point-to-point cases: contents, concurrency, barriers, deadlines, dead peers, strangers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use dist_core::{Backend, DistError, Tag};
use dist_tcp::TcpBackend;
use dist_tcp::wire::{Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, REPLY_LEN, Refusal, Reply};

use dist_multirank::{self as common, fill, first_difference, join, seed};

/// Every ordered pair exchanges messages of 0 B, 1 B, 4 KiB, 16 MiB and 256 MiB; every byte is
/// checked.
pub fn pairs() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    for (k, &size) in [0usize, 1, 4 << 10, 16 << 20, 256 << 20].iter().enumerate() {
        let mut out = vec![0u8; size];
        let mut inb = vec![0u8; size];
        let tag = Tag::user(k as u32);
        for shift in 1..n {
            let (dst, src) = ((me + shift) % n, (me + n - shift) % n);
            fill(&mut out, seed(me, dst, size as u64));
            inb.fill(0xAA);
            std::thread::scope(|s| {
                let sender = s.spawn(|| b.send_tagged(&out, dst, tag));
                b.recv_tagged(&mut inb, src, tag)
                    .unwrap_or_else(|e| panic!("{e}"));
                sender.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
            });
            if let Some(at) = first_difference(&inb, seed(src, me, size as u64)) {
                panic!("{size} bytes from rank {src}: wrong byte at offset {at}");
            }
        }
        b.barrier().unwrap();
    }
}

/// Four threads per rank, each on its own tag, exchange messages with every peer at once.
pub fn threads() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    const THREADS: u32 = 4;
    const MESSAGES: u64 = 25;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let b = &b;
            s.spawn(move || {
                let tag = Tag::user(100 + t);
                let size = |k: u64| 64 + ((k as usize * 7919 + t as usize * 104_729) % 65_536);
                let mut out = Vec::new();
                for k in 0..MESSAGES {
                    for p in (0..n).filter(|p| *p != me) {
                        out.resize(size(k), 0);
                        fill(&mut out, seed(me, p, u64::from(t) << 32 | k));
                        b.send_tagged(&out, p, tag)
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                }
                let mut inb = Vec::new();
                for k in 0..MESSAGES {
                    for p in (0..n).filter(|p| *p != me) {
                        inb.resize(size(k), 0);
                        b.recv_tagged(&mut inb, p, tag)
                            .unwrap_or_else(|e| panic!("{e}"));
                        if let Some(at) =
                            first_difference(&inb, seed(p, me, u64::from(t) << 32 | k))
                        {
                            panic!("thread {t}, message {k} from {p}: wrong byte at {at}");
                        }
                    }
                }
            });
        }
    });
    b.barrier().unwrap();
}

/// A thousand barriers in a row.
pub fn barriers() {
    let b = join();
    let t = Instant::now();
    for _ in 0..1000 {
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    println!("1000 barriers in {:.1?}", t.elapsed());
}

/// A receive from a peer that never sends ends with a timeout naming it, on time.
pub fn timeout() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let silent = (me + 1) % n;
    let deadline = Duration::from_secs(1);
    let t = Instant::now();
    let e = b
        .recv_tagged_timeout(&mut [0u8; 8], silent, Tag::user(77), deadline)
        .unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(&e, DistError::Timeout { peer, .. } if *peer == silent),
        "expected a timeout naming peer {silent}, got: {e}"
    );
    assert!(e.to_string().contains(&format!("peer {silent}")), "{e}");
    assert!(
        waited >= deadline && waited < deadline + Duration::from_millis(500),
        "timed out after {waited:?}, deadline {deadline:?}"
    );
    b.barrier().unwrap();
}

/// The last rank exits abruptly while streaming to every other rank; each of them gets "peer
/// gone" naming it within a second.
pub fn peer_death() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let victim = n - 1;
    const CHUNK: usize = 1 << 20;
    b.barrier().unwrap();
    if me == victim {
        for p in 0..n - 1 {
            b.send_tagged(&[1], p, Tag::user(50)).unwrap();
        }
        let b = &b;
        std::thread::scope(|s| {
            for p in 0..n - 1 {
                s.spawn(move || {
                    let data = vec![7u8; CHUNK];
                    while b.send_tagged(&data, p, Tag::user(51)).is_ok() {}
                });
            }
            // Mid-exchange, without dropping anything: the kernel closes the sockets.
            println!("exiting abruptly");
            std::process::exit(0);
        });
    }
    b.recv_tagged(&mut [0u8; 1], victim, Tag::user(50)).unwrap();
    let t = Instant::now();
    let mut buf = vec![0u8; CHUNK];
    let mut chunks = 0u64;
    let e = loop {
        match b.recv_tagged(&mut buf, victim, Tag::user(51)) {
            Ok(()) => chunks += 1,
            Err(e) => break e,
        }
    };
    let waited = t.elapsed();
    assert!(
        matches!(&e, DistError::PeerGone { peer, .. } if *peer == victim),
        "expected peer {victim} gone, got: {e}"
    );
    assert!(waited < Duration::from_secs(1), "noticed after {waited:?}");
    println!("after {chunks} chunks: {e} (noticed in {waited:.1?})");
    // The survivors still talk to each other.
    let m = n - 1;
    if m > 1 {
        let (to, from) = ((me + 1) % m, (me + m - 1) % m);
        b.send_tagged(&[me as u8], to, Tag::user(52)).unwrap();
        let mut got = [0u8];
        b.recv_tagged(&mut got, from, Tag::user(52)).unwrap();
        assert_eq!(got[0] as usize, from);
    }
}

fn master_port() -> u16 {
    std::env::var("MASTER_PORT").unwrap().parse().unwrap()
}

fn connect(port: u16) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut backoff = Duration::from_millis(5);
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                return s;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "rank 0's port never opened: {e}");
                // Rank 0 may not have bound its port yet: retry with backoff.
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

fn hello(rank: u32, world: u32) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        purpose: Purpose::Rendezvous,
        has_secret: false,
        world_size: world,
        rank,
        listen_port: 9,
        job_id: 0,
        nonce: [3; NONCE_LEN],
    }
}

/// Sends `bytes` as a stranger and returns rank 0's refusal.
fn refusal_for(port: u16, bytes: &[u8]) -> Reply {
    let mut s = connect(port);
    s.write_all(bytes).unwrap();
    let mut r = [0u8; REPLY_LEN];
    s.read_exact(&mut r)
        .unwrap_or_else(|e| panic!("no refusal: {e}"));
    let reply = Reply::decode(&r).unwrap();
    // And then the connection is closed.
    let mut more = [0u8; 1];
    assert_eq!(s.read(&mut more).unwrap_or(0), 0, "connection left open");
    reply
}

/// Raw clients hit rank 0's port while the job forms: each is refused, and the job forms.
pub fn strangers() {
    let mut cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    if me == 0 {
        cfg = cfg.handshake_timeout(Duration::from_secs(2));
    }
    if me == n - 1 {
        // Rank 0 cannot finish the rendezvous before this rank joins, so these all arrive during it.
        let port = master_port();
        let silent = std::thread::spawn(move || {
            let mut s = connect(port);
            let t = Instant::now();
            let mut b = [0u8; 1];
            let r = s.read(&mut b);
            assert!(matches!(r, Ok(0) | Err(_)), "silent client got data");
            let waited = t.elapsed();
            assert!(
                waited < Duration::from_secs(4),
                "silent client dropped after {waited:?}"
            );
            println!("silent client dropped after {waited:.1?}");
        });
        let n32 = n as u32;
        let mut garbage = [0u8; 64];
        fill(&mut garbage, 99);
        // The only size a hello claims is the world's (rank 0 would size its tables by it if
        // it trusted it): a real magic and version, and a world of 2^32 - 1 ranks. On main this
        // case sent a bad magic and only exercised the magic check.
        let huge = hello(u32::MAX - 1, u32::MAX);
        let mut http = [b' '; 64];
        http[..18].copy_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        let mut wrong_magic = hello(1, n32).encode();
        wrong_magic[0] ^= 0xff;
        let mut wrong_version = hello(1, n32);
        wrong_version.version = PROTOCOL_VERSION + 1;
        let huge_text = format!("world size {} does not match rank 0's {n}", u32::MAX);
        let cases: [(&str, Vec<u8>, Refusal, &str); 8] = [
            (
                "garbage",
                garbage.to_vec(),
                Refusal::BadMagic,
                "not a dist peer",
            ),
            (
                "huge world size",
                huge.encode().to_vec(),
                Refusal::WorldSize,
                &huge_text,
            ),
            ("http", http.to_vec(), Refusal::BadMagic, "not a dist peer"),
            (
                "wrong magic",
                wrong_magic.to_vec(),
                Refusal::BadMagic,
                "not a dist peer",
            ),
            (
                "wrong version",
                wrong_version.encode().to_vec(),
                Refusal::Version,
                "protocol version",
            ),
            (
                "wrong world size",
                hello(1, n32 + 3).encode().to_vec(),
                Refusal::WorldSize,
                "does not match",
            ),
            (
                "duplicate rank 0",
                hello(0, n32).encode().to_vec(),
                Refusal::RankOutOfRange,
                "duplicate rank 0",
            ),
            (
                "rank out of range",
                hello(n32, n32).encode().to_vec(),
                Refusal::RankOutOfRange,
                "may not connect",
            ),
        ];
        for (what, bytes, code, text) in cases {
            let r = refusal_for(port, &bytes);
            assert_eq!(r.refusal, Some(code), "{what}: {}", r.reason);
            assert!(r.reason.contains(text), "{what}: {}", r.reason);
            println!("{what}: refused: {}", r.reason);
        }
        // A stranger that trickles a partial hello and stops is dropped too.
        let mut partial = connect(port);
        partial.write_all(&hello(1, n32).encode()[..10]).unwrap();
        silent.join().unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(partial.read(&mut b), Ok(0) | Err(_)));
    }
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    ring_check(&b);
}

fn ring_check(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    b.send(&[me as u8; 3], (me + 1) % n).unwrap();
    let mut got = [0u8; 3];
    b.recv(&mut got, (me + n - 1) % n).unwrap();
    assert_eq!(got, [((me + n - 1) % n) as u8; 3]);
    b.barrier().unwrap();
}

/// With a shared secret configured, a rank with the wrong one is refused with an error saying
/// so; with the right one, the job forms.
pub fn secret() {
    let cfg = common::config().secret("correct horse battery");
    let (me, n) = (cfg.rank(), cfg.world_size());
    if me == n - 1 {
        let e = TcpBackend::with_config(cfg.clone().secret("battery staple horse")).unwrap_err();
        assert!(matches!(e, DistError::HandshakeRefused { .. }), "{e}");
        assert!(e.to_string().contains("wrong shared secret"), "{e}");
        println!("wrong secret: {e}");
        let e = TcpBackend::with_config(common::config()).unwrap_err();
        assert!(e.to_string().contains("requires a shared secret"), "{e}");
        println!("no secret: {e}");
        let e = TcpBackend::with_config(common::config().secret("horse")).unwrap_err();
        assert!(
            matches!(e, DistError::Config { .. }) && e.to_string().contains("at least 16 bytes"),
            "{e}"
        );
        println!("short secret: {e}");
    }
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    ring_check(&b);
}

//! Point-to-point cases: contents, concurrency, barriers, deadlines, dead peers, strangers, the
//! ranks' start order.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp, Tag};
use dist_tcp::TcpBackend;
use dist_tcp::wire::{Hello, NONCE_LEN, PROTOCOL_VERSION, Purpose, REPLY_LEN, Refusal, Reply};

use dist_multirank::{self as common, fill, first_difference, join, seed};

use crate::admission::read_until_closed;

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

/// A thousand barriers in a row, each holding every rank until the last has entered. Before
/// each, a rank writes how many it has entered to a file of its own (in a directory of this
/// job's); after it, every rank reads every count, which must show the barrier entered by all.
/// In each of the first `n` barriers one rank enters 20 ms late, so that a barrier which lets a
/// rank out early is caught, whichever rank it fails to wait for.
pub fn barriers() {
    const BARRIERS: u64 = 1000;
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let dir = job_dir("barriers");
    let count = |rank: usize| -> u64 {
        match std::fs::read_to_string(dir.join(format!("rank-{rank}"))) {
            Ok(text) => text.parse().unwrap(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => panic!("rank {rank}'s count: {e}"),
        }
    };
    let t = Instant::now();
    for i in 1..=BARRIERS {
        if i as usize == me + 1 {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Written whole, then renamed over the last: a reader sees one count or the other.
        let tmp = dir.join(format!("rank-{me}.tmp"));
        std::fs::write(&tmp, i.to_string()).unwrap();
        std::fs::rename(&tmp, dir.join(format!("rank-{me}"))).unwrap();
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
        for k in 0..n {
            let entered = count(k);
            assert!(
                entered >= i,
                "barrier {i} of {n} ranks: rank {me} left it before rank {k} entered \
                 (rank {k} has entered {entered})"
            );
        }
    }
    println!("{BARRIERS} barriers, each checked, in {:.1?}", t.elapsed());
    b.barrier().unwrap();
    if me == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
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

/// Rank 0's handshake deadline in [`strangers`].
const STRANGER_HANDSHAKE: Duration = Duration::from_secs(2);

/// How soon after it connects a stranger must have been dropped: its handshake deadline and a
/// margin, well under the strangers' 10 s read timeout.
const STRANGER_DROPPED: Duration = Duration::from_secs(4);

fn master_port() -> u16 {
    std::env::var("MASTER_PORT").unwrap().parse().unwrap()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut backoff = Duration::from_millis(5);
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                return s;
            }
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

fn hello(rank: u32, world: u32) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        purpose: Purpose::Mesh,
        has_secret: false,
        sealed: false,
        world_size: world,
        rank,
        listen_port: 9,
        job_id: 0,
        nonce: [3; NONCE_LEN],
    }
}

/// Sends `bytes` as a stranger and returns rank 0's refusal.
fn refusal_for(port: SocketAddr, bytes: &[u8]) -> Reply {
    let mut s = connect(port);
    s.write_all(bytes).unwrap();
    let mut r = [0u8; REPLY_LEN];
    s.read_exact(&mut r)
        .unwrap_or_else(|e| panic!("no refusal: {e}"));
    let reply = Reply::decode(&r).unwrap();
    // And then the connection is closed (within rank 0's handshake deadline), nothing more sent.
    let more = read_until_closed(&mut s, STRANGER_DROPPED, "a refused stranger").bytes;
    assert!(more.is_empty(), "{} bytes after the refusal", more.len());
    reply
}

/// Raw clients hit rank 0's listener (its address from the job's store) while the job forms:
/// each is refused, and the job forms.
pub fn strangers() {
    let mut cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    if me == 0 {
        cfg = cfg.handshake_timeout(STRANGER_HANDSHAKE);
    }
    if me == n - 1 {
        // Rank 0 cannot finish the rendezvous before this rank joins, so these all arrive during it.
        let port = common::rank0_listener();
        let silent = std::thread::spawn(move || {
            let mut s = connect(port);
            let t = Instant::now();
            // Dropped (end of stream or reset, not a read timeout), by its handshake deadline.
            let end = read_until_closed(&mut s, STRANGER_DROPPED, "a silent stranger");
            assert!(end.bytes.is_empty(), "silent client got data");
            println!(
                "silent client dropped after {:.1?} (reset: {})",
                t.elapsed(),
                end.reset
            );
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
        // A stranger that trickles a partial hello and stops is dropped too, by its handshake
        // deadline, with nothing sent back.
        let t = Instant::now();
        let mut partial = connect(port);
        partial.write_all(&hello(1, n32).encode()[..10]).unwrap();
        silent.join().unwrap();
        let within = STRANGER_DROPPED.saturating_sub(t.elapsed());
        let end = read_until_closed(&mut partial, within, "a stranger with a partial hello");
        assert!(end.bytes.is_empty(), "partial hello answered");
        println!(
            "partial hello dropped after {:.1?} (reset: {})",
            t.elapsed(),
            end.reset
        );
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

/// How long rank 0 waits, once every other rank has started joining, before it joins in
/// [`rank0_last`]; and how long each rank waits after the one above it in [`reverse_start`].
const LATE: Duration = Duration::from_millis(1500);
const STEP: Duration = Duration::from_millis(300);

/// A directory the ranks of this job share (they run on one host, children of one launcher).
fn job_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "dist-{what}-{}-{}",
        master_port(),
        std::os::unix::process::parent_id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Says that `rank` starts joining now.
fn started(dir: &Path, rank: usize) {
    std::fs::write(dir.join(format!("started-{rank}")), b"").unwrap();
}

/// Waits (at most 60 s) until `rank` has started joining.
fn wait_started(dir: &Path, rank: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir.join(format!("started-{rank}")).exists() {
        assert!(Instant::now() < deadline, "rank {rank} never started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rank 0 joins last: [`LATE`] after every other rank has started joining (dialing rank 0's
/// port, which nothing listens on until then, so they retry with backoff). The group forms and
/// works.
pub fn rank0_last() {
    let dir = job_dir("rank0-last");
    let n = common::config().world_size();
    staggered(&dir, |me| {
        if me == 0 {
            (1..n).for_each(|r| wait_started(&dir, r));
            // The start order under test, not a wait for an event.
            std::thread::sleep(LATE);
        }
        // The others wait for rank 0's late start.
        if me == 0 { Duration::ZERO } else { LATE }
    });
}

/// The ranks join in reverse order, the last first and rank 0 last, each [`STEP`] after the one
/// above it has started joining. The group forms and works.
pub fn reverse_start() {
    let dir = job_dir("reverse-start");
    let n = common::config().world_size();
    staggered(&dir, |me| {
        if me + 1 < n {
            wait_started(&dir, me + 1);
            // The start order under test, not a wait for an event.
            std::thread::sleep(STEP);
        }
        // Rank 0 starts at least this long after this rank.
        STEP * me as u32
    });
}

/// Each rank runs `before` (which waits for its turn and returns how long it will wait for
/// rank 0 at least) and joins; the join must have taken that long (the scenario happened),
/// then an all_reduce and a ring of messages are checked.
fn staggered(dir: &Path, before: impl FnOnce(usize) -> Duration) {
    let cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    let wait = before(me);
    started(dir, me);
    let t = Instant::now();
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    let joined = t.elapsed();
    println!("joined in {joined:.1?}, of which at least {wait:.1?} waiting for rank 0");
    assert!(
        joined >= wait,
        "rank {me} joined in {joined:?}, before rank 0 started ({wait:?} after it)"
    );
    let mut x = vec![me as u64 + 1; 1000];
    b.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    let want = (n * (n + 1) / 2) as u64;
    assert!(
        x.iter().all(|v| *v == want),
        "all_reduce: {} != {want}",
        x[0]
    );
    ring_check(&b);
    if me == 0 {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A rank with a wrong secret, then one with none: each time the handshake refuses it, and
/// the whole job fails at once, every rank naming the last rank (its claim in the store is
/// final: a refused rank fails the formation, as one that crashed would); a short secret is
/// refused before anything is sent; then the job forms with the right secret. Every attempt
/// forms through one store rank 0 serves for the whole case (`DIST_SERVE_STORE=0` semantics),
/// each under a prefix of its own.
pub fn secret() {
    let base = common::config();
    let (me, n) = (base.rank(), base.world_size());
    let server = (me == 0).then(|| {
        let port: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
        dist_tcp::dist_store::StoreServer::bind(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("{e}"))
    });
    let attempt = |prefix: &str, secret: Option<&str>| {
        let mut c = base.clone().serve_store(false).store_prefix(prefix);
        if let Some(s) = secret {
            c = c.secret(s);
        }
        TcpBackend::with_config(c)
    };
    let right = "correct horse battery";
    let last = n - 1;
    for (prefix, theirs, refusal) in [
        ("wrong", Some("battery staple horse"), "wrong shared secret"),
        ("none", None, "requires a shared secret"),
    ] {
        let e = attempt(prefix, if me == last { theirs } else { Some(right) }).unwrap_err();
        if me == last {
            assert!(matches!(e, DistError::HandshakeRefused { .. }), "{e}");
            assert!(e.to_string().contains(refusal), "{e}");
        } else {
            assert!(
                matches!(&e, DistError::Aborted { origin, .. } if *origin == last)
                    && e.to_string().contains(refusal),
                "{prefix}: {e}"
            );
        }
        println!("{prefix}: {e}");
    }
    let e = TcpBackend::with_config(base.clone().secret("horse")).unwrap_err();
    assert!(
        matches!(e, DistError::Config { .. }) && e.to_string().contains("at least 16 bytes"),
        "{e}"
    );
    let b = attempt("right", Some(right)).unwrap_or_else(|e| panic!("init failed: {e}"));
    ring_check(&b);
    drop(b);
    drop(server);
}

//! The lazy formation, the long-lived acceptor's refusals and the dialer, over real sockets.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::*;
use crate::wire::{
    FRAME_HEADER_LEN, FrameHeader, FrameKind, HELLO_LEN, NONCE_LEN, REPLY_LEN, Refusal, Reply,
};

const KEY: &[u8] = b"a shared secret of 16+ bytes";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One rank of a lazy job run as a thread: what it formed, and the connections its acceptor
/// handed to `on_incoming`.
struct Rank {
    formed: Formed,
    incoming: Receiver<(usize, TcpStream)>,
}

/// Forms a lazy job of `n` ranks, each on a thread; returns them by rank and the time the
/// slowest took.
fn lazy_job(n: usize, secret: Option<&[u8]>) -> (Vec<Rank>, Duration) {
    let port = free_port();
    let t = Instant::now();
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let secret = secret.map(<[u8]>::to_vec);
            std::thread::Builder::new()
                .name(format!("lazy-rank-{r}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    let mut cfg = TcpConfig::new(r, n, format!("127.0.0.1:{port}"))
                        .init_timeout(Duration::from_secs(60));
                    if let Some(s) = secret {
                        cfg = cfg.secret(s);
                    }
                    let (tx, incoming) = crossbeam_channel::unbounded();
                    let formed = form_lazy(&cfg, Box::new(move |p, s| tx.send((p, s)).is_ok()))
                        .unwrap_or_else(|e| panic!("{e}"));
                    Rank { formed, incoming }
                })
                .unwrap()
        })
        .collect();
    let ranks = threads.into_iter().map(|t| t.join().unwrap()).collect();
    (ranks, t.elapsed())
}

fn ping(s: &mut TcpStream, from: usize) {
    let h = FrameHeader {
        kind: FrameKind::Data,
        tag: from as u64,
        len: 0,
        meta: [0; 16],
    };
    s.write_all(&h.encode()).unwrap();
}

fn pong(s: &mut TcpStream) -> u64 {
    let mut b = [0u8; FRAME_HEADER_LEN];
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.read_exact(&mut b).unwrap();
    FrameHeader::decode(&b).unwrap().tag
}

/// Every pair of 16 ranks (all 120 of them, a round at a time: in round `k` rank `r` pairs
/// with `r ^ k`), both ranks released together and dialing each other: each pair ends with
/// exactly one connection (the one each side holds is the other side's), and a frame each way
/// arrives. Formation connected no pair. Five jobs, each afresh.
#[test]
fn pairs_dialing_each_other_end_with_one_connection() {
    for _ in 0..5 {
        pairs_dial_each_other();
    }
}

fn pairs_dial_each_other() {
    const N: usize = 16;
    let (ranks, took) = lazy_job(N, Some(KEY));
    eprintln!("{N} ranks formed lazily in {took:.2?}");
    // Formation, through the store, connected no pair of ranks.
    for (r, rank) in ranks.iter().enumerate() {
        for p in (0..N).filter(|p| *p != r) {
            assert!(!rank.formed.mesh.is_connected(p), "{r} to {p}");
            assert!(rank.formed.streams[p].is_none(), "{r} to {p}");
        }
        assert!(rank.incoming.try_recv().is_err(), "rank {r}: a connection");
    }
    let ranks = Arc::new(ranks);
    let go = Arc::new(Barrier::new(N));
    let crossed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = (0..N)
        .map(|me| {
            let (ranks, go, crossed) = (ranks.clone(), go.clone(), crossed.clone());
            std::thread::spawn(move || {
                let rank = &ranks[me];
                let mut held: Vec<Option<TcpStream>> = (0..N).map(|_| None).collect();
                for k in 1..N {
                    let peer = me ^ k;
                    go.wait();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let mut s = match rank.formed.mesh.dial(peer, deadline) {
                        Ok(Dialed::Stream(s)) => s,
                        Ok(Dialed::Elsewhere) => {
                            crossed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            // It went to on_incoming before dial returned.
                            let (p, s) = rank.incoming.try_recv().expect("delivered");
                            assert_eq!(p, peer);
                            s
                        }
                        Err(e) => panic!("{e}"),
                    };
                    ping(&mut s, me);
                    assert_eq!(pong(&mut s), peer as u64, "rank {me} from {peer}");
                    held[peer] = Some(s);
                }
                // Nothing else arrived: one connection per pair.
                assert!(
                    rank.incoming.try_recv().is_err(),
                    "rank {me}: a spare connection"
                );
                held
            })
        })
        .collect();
    let held: Vec<Vec<Option<TcpStream>>> =
        threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (a, b) in (0..N).flat_map(|a| (a + 1..N).map(move |b| (a, b))) {
        let (x, y) = (held[a][b].as_ref().unwrap(), held[b][a].as_ref().unwrap());
        assert_eq!(
            x.local_addr().unwrap(),
            y.peer_addr().unwrap(),
            "{a} and {b}"
        );
        assert_eq!(
            x.peer_addr().unwrap(),
            y.local_addr().unwrap(),
            "{a} and {b}"
        );
    }
    eprintln!(
        "{} of {} dials got the peer's connection through on_incoming",
        crossed.load(std::sync::atomic::Ordering::Relaxed),
        N * (N - 1)
    );
}

/// Rank 2 of 4 (job 7) with its long-lived acceptor; ranks 0 and 3 are connected already.
fn mesh_of_rank2(secret: Option<&[u8]>, timeout: Duration) -> (Mesh, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let spec = MeshSpec {
        me: 2,
        world: 4,
        job_id: 7,
        secret: secret.map(<[u8]>::to_vec),
        seal: false,
        handshake_timeout: timeout,
        addrs: vec![addr; 4],
    };
    let mesh = Mesh::start(spec, Some(l), |r| r == 0 || r == 3, Box::new(|_, _| true)).unwrap();
    (mesh, addr)
}

fn hello(rank: u32, has_secret: bool) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        purpose: Purpose::Mesh,
        has_secret,
        sealed: false,
        world_size: 4,
        rank,
        listen_port: 0,
        job_id: 7,
        nonce: [rank as u8; NONCE_LEN],
    }
}

/// Sends `hello` (and a zero proof if challenged); returns the refusal.
fn refusal(addr: SocketAddr, hello: &Hello) -> Option<(Refusal, String)> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&hello.encode()).unwrap();
    let mut b = [0u8; REPLY_LEN];
    s.read_exact(&mut b).unwrap();
    let r = Reply::decode(&b).unwrap();
    if let Some(why) = r.refusal {
        return Some((why, r.reason));
    }
    s.write_all(&[0; NONCE_LEN]).unwrap();
    s.read_exact(&mut b).unwrap();
    let r = Reply::decode(&b).unwrap();
    r.refusal.map(|why| (why, r.reason))
}

/// Every refusal of the long-lived acceptor, each with its code and a reason that says why.
#[test]
fn the_long_lived_acceptor_refuses_what_it_must() {
    let (_mesh, addr) = mesh_of_rank2(None, Duration::from_secs(2));
    let h = hello(1, false);
    let cases: Vec<(Hello, Refusal, &str)> = vec![
        (
            Hello { version: 5, ..h },
            Refusal::Version,
            "protocol version 5",
        ),
        (
            Hello {
                purpose: Purpose::Rendezvous,
                ..h
            },
            Refusal::Protocol,
            "accepts Mesh connections",
        ),
        (
            Hello { world_size: 5, ..h },
            Refusal::WorldSize,
            "world size 5",
        ),
        (hello(2, false), Refusal::RankOutOfRange, "own rank"),
        (hello(4, false), Refusal::RankOutOfRange, "rank 4 may not"),
        (Hello { job_id: 8, ..h }, Refusal::WrongJob, "job id 0x8"),
        (hello(1, true), Refusal::SecretConfig, "has a shared secret"),
        // Rank 0 is connected already (the rendezvous connection) and lower: a duplicate.
        (hello(0, false), Refusal::DuplicateRank, "already connected"),
        // Rank 3 is connected already and higher: crossed, it waits for ours.
        (hello(3, false), Refusal::Crossed, "crossed"),
    ];
    for (h, want, text) in cases {
        let (why, reason) = refusal(addr, &h).unwrap_or_else(|| panic!("{h:?} accepted"));
        assert_eq!(why, want, "{reason}");
        assert!(reason.contains(text), "{reason:?} lacks {text:?}");
    }
    // Not a dist peer.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&[0x42; HELLO_LEN]).unwrap();
    let mut b = [0u8; REPLY_LEN];
    s.read_exact(&mut b).unwrap();
    assert_eq!(Reply::decode(&b).unwrap().refusal, Some(Refusal::BadMagic));
    // Rank 1 itself is accepted (and only once).
    assert_eq!(refusal(addr, &h), None);
    let (why, _) = refusal(addr, &h).unwrap();
    assert_eq!(why, Refusal::DuplicateRank);
}

/// With a secret: a wrong proof is refused; a connection that sends nothing is closed at the
/// handshake deadline, having been sent nothing.
#[test]
fn the_long_lived_acceptor_checks_the_secret_and_the_deadline() {
    let (_mesh, addr) = mesh_of_rank2(Some(KEY), Duration::from_millis(500));
    let (why, reason) = refusal(addr, &hello(1, true)).unwrap();
    assert_eq!(why, Refusal::WrongSecret, "{reason}");
    let (why, _) = refusal(addr, &hello(1, false)).unwrap();
    assert_eq!(why, Refusal::SecretConfig);
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "{} bytes to a silent client", got.len());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "held {:?}",
        t.elapsed()
    );
}

/// A dial to a rank whose listener is gone fails at once, naming the rank, the peer and the
/// operation (no retry: after formation every listener is up); a dial to a listener that
/// never answers fails at the deadline.
#[test]
fn a_dial_to_a_gone_rank_fails_at_once() {
    let gone = TcpListener::bind("127.0.0.1:0").unwrap();
    let gone_addr = gone.local_addr().unwrap();
    drop(gone);
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let spec = MeshSpec {
        me: 1,
        world: 3,
        job_id: 7,
        secret: None,
        seal: false,
        handshake_timeout: Duration::from_secs(1),
        addrs: vec![gone_addr, gone_addr, mute.local_addr().unwrap()],
    };
    let mesh = Mesh::start(spec, None, |_| false, Box::new(|_, _| false)).unwrap();
    let t = Instant::now();
    let e = mesh
        .dial(0, Instant::now() + Duration::from_secs(30))
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let text = e.to_string();
    assert!(
        text.contains("rank 1: peer 0 gone during connect to rank 0") && text.contains("refused"),
        "{text}"
    );
    let e = mesh
        .dial(2, Instant::now() + Duration::from_millis(300))
        .unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert!(matches!(
        mesh.dial(1, Instant::now()),
        Err(DistError::InvalidRank { .. })
    ));
    assert!(matches!(
        mesh.dial(3, Instant::now()),
        Err(DistError::InvalidRank { .. })
    ));
    drop(mute);
}

/// Dropping a mesh stops its acceptor at once (it blocks in accept, no polling) and closes
/// the listener: a later connection is refused.
#[test]
fn dropping_the_mesh_closes_the_listener() {
    let (mesh, addr) = mesh_of_rank2(None, Duration::from_secs(2));
    let t = Instant::now();
    drop(mesh);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        t.elapsed()
    );
    let e = TcpStream::connect(addr).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
}

/// The peer layer shares one mesh between its threads (the dialing callers, the I/O thread).
#[test]
fn a_mesh_is_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Mesh>();
    shared::<Formed>();
}

//! Unit tests of `init`.

use std::io::{ErrorKind, Read, Write};
use std::time::Duration;

use super::*;
use crate::Formation;
use crate::wire::{HELLO_LEN, NONCE_LEN, REPLY_LEN, Refusal, Reply, Side};

const KEY: &[u8] = b"a shared secret of 16+ bytes";
const ZERO: Duration = Duration::ZERO;

/// A mesh listener of rank 1 in a job of 4 (job id 7), accepting ranks 2 and 3.
fn mesh_acceptor(
    secret: Option<&[u8]>,
    handshake_timeout: Duration,
) -> (Acceptor, crossbeam_channel::Receiver<Joined>, SocketAddr) {
    let l = bind_listener("127.0.0.1:0".parse().unwrap(), 1).unwrap();
    let addr = l.local_addr().unwrap();
    let (gate, rx) = Gate::once(4);
    let a = Acceptor::start(
        l,
        Rules {
            me: 1,
            world: 4,
            purpose: Purpose::Mesh,
            ranks: 2..4,
            job_id: 7,
            secret: secret.map(<[u8]>::to_vec),
            seal: false,
            handshake_timeout,
            gate,
        },
    )
    .unwrap();
    (a, rx, addr)
}

fn mesh_hello(rank: u32, has_secret: bool) -> Hello {
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

fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads `s` until the listener closes it, by end of stream or reset (a socket closed with
/// bytes unread resets), and returns what came first. Panics if it is still open after
/// `within`: a read that times out is a connection left open, not one closed.
fn read_until_closed(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let deadline = Instant::now() + within;
    let mut all = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        // At least a moment: a connection closed already reads as such at once.
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return all,
            Ok(k) if Instant::now() < deadline => all.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return all,
            Err(e) if !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("reading until closed: {e}")
            }
            _ => panic!("still open after {within:?} ({} bytes read)", all.len()),
        }
    }
}

/// The listener sends its proof only after checking the connecting side's: a client that
/// sends a wrong proof, or none, gets no proof at all (on main the challenge carried the
/// listener's proof, so any stranger got an HMAC of the secret to test guesses against).
#[test]
fn the_listener_proves_only_after_the_client_has() {
    let (_acceptor, joins, addr) = mesh_acceptor(Some(KEY), Duration::from_secs(1));
    let hello = mesh_hello(3, true);

    // A wrong proof: refused, and nothing it received is the listener's proof.
    let mut s = raw(addr);
    s.write_all(&hello.encode()).unwrap();
    s.write_all(&[0x55; NONCE_LEN]).unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(3));
    assert_eq!(got.len(), 2 * REPLY_LEN, "challenge then verdict");
    let challenge = Reply::decode(&got[..REPLY_LEN]).unwrap();
    let verdict = Reply::decode(&got[REPLY_LEN..]).unwrap();
    assert_eq!(challenge.refusal, None);
    assert_eq!(
        challenge.proof, [0; NONCE_LEN],
        "the challenge carries a proof"
    );
    assert_eq!(
        verdict.refusal,
        Some(Refusal::WrongSecret),
        "{}",
        verdict.reason
    );
    assert_eq!(verdict.proof, [0; NONCE_LEN], "a refusal carries a proof");
    let server_proof = wire::proof(KEY, Side::Server, &hello, 1, &challenge.nonce);
    assert!(!got.windows(NONCE_LEN).any(|w| w == server_proof));

    // No proof at all: after the challenge the listener waits out the handshake deadline (1 s)
    // and closes, having sent nothing more.
    let mut s = raw(addr);
    s.write_all(&hello.encode()).unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(3));
    assert_eq!(got.len(), REPLY_LEN, "sent more than the challenge");
    assert_eq!(Reply::decode(&got).unwrap().proof, [0; NONCE_LEN]);

    // A wrong secret through the real client: refused, saying why.
    let mut s = raw(addr);
    let deadline = Instant::now() + Duration::from_secs(5);
    let wrong = b"another secret of 16+ bytes";
    match client_handshake(&mut s, &hello, Some(wrong), 1, deadline, ZERO, 3, "rank 1") {
        Err(Failed::Final(e)) => {
            assert!(
                e.to_string().contains("wrong shared secret from rank 3"),
                "{e}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A right secret, but a proof meant for another listener (rank 2): refused too.
    let mut s = raw(addr);
    assert!(matches!(
        client_handshake(&mut s, &hello, Some(KEY), 2, deadline, ZERO, 3, "rank 1"),
        Err(Failed::Final(_))
    ));
    // The right secret for this listener: both proofs check, and rank 3 has joined.
    let mut s = raw(addr);
    client_handshake(&mut s, &hello, Some(KEY), 1, deadline, ZERO, 3, "rank 1").unwrap();
    let j = joins.recv_deadline(deadline).unwrap();
    assert_eq!(j.rank, 3);
    assert!(joins.try_recv().is_err(), "a refused client joined");
}

/// The client checks the listener's proof: a listener that accepts any proof but cannot
/// prove the secret itself is refused by the client.
#[test]
fn the_client_refuses_a_listener_that_cannot_prove() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; HELLO_LEN + NONCE_LEN];
        s.read_exact(&mut b[..HELLO_LEN]).unwrap();
        s.write_all(&Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode())
            .unwrap();
        s.read_exact(&mut b[HELLO_LEN..]).unwrap();
        s.write_all(&Reply::accept([0; NONCE_LEN], [2; NONCE_LEN]).encode())
            .unwrap();
    });
    let mut s = raw(addr);
    let deadline = Instant::now() + Duration::from_secs(5);
    match client_handshake(
        &mut s,
        &mesh_hello(3, true),
        Some(KEY),
        1,
        deadline,
        ZERO,
        3,
        "x",
    ) {
        Err(Failed::Final(e)) => assert!(
            e.to_string().contains("failed to prove the shared secret"),
            "{e}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    fake.join().unwrap();
}

/// A listener that sends its verdict (an acceptance) only after the client's deadline: a
/// client without grace gives up and drops a connection the listener has accepted (which it
/// then holds as connected to a peer that is gone: the race found in review); with grace it
/// waits for the verdict and keeps the connection.
#[test]
fn a_verdict_after_the_deadline_is_awaited_within_the_grace() {
    let run = |grace: Duration| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_millis(300);
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; HELLO_LEN + NONCE_LEN];
            s.read_exact(&mut b[..HELLO_LEN]).unwrap();
            s.write_all(&Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode())
                .unwrap();
            s.read_exact(&mut b[HELLO_LEN..]).unwrap();
            // The verdict goes out past the client's deadline: the scenario under test, not a
            // wait for an event.
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()) * 2);
            let _ = s.write_all(&Reply::accept([0; NONCE_LEN], [0; NONCE_LEN]).encode());
        });
        let mut s = raw(addr);
        let r = client_handshake(
            &mut s,
            &mesh_hello(3, false),
            None,
            1,
            deadline,
            grace,
            3,
            "x",
        );
        fake.join().unwrap();
        r
    };
    match run(Duration::ZERO) {
        Err(Failed::Final(e)) => assert!(e.to_string().contains("no verdict"), "{e}"),
        other => panic!("without grace the client should give up, got {other:?}"),
    }
    run(Duration::from_secs(10)).expect("with grace the late verdict is taken");
}

/// A listener that closes the connection after the proof instead of answering (it gave up on
/// the handshake, as rank 0 does past its handshake timeout under load) turns the client away:
/// it connects again, where it used to give up (`admission_flood::n8` failed so in CI).
#[test]
fn a_connection_closed_instead_of_a_verdict_is_turned_away() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; HELLO_LEN + NONCE_LEN];
        s.read_exact(&mut b[..HELLO_LEN]).unwrap();
        s.write_all(&Reply::accept([1; NONCE_LEN], [0; NONCE_LEN]).encode())
            .unwrap();
        s.read_exact(&mut b[HELLO_LEN..]).unwrap();
        drop(s);
    });
    let mut s = raw(addr);
    let r = client_handshake(
        &mut s,
        &mesh_hello(3, false),
        None,
        1,
        Instant::now() + Duration::from_secs(10),
        Duration::ZERO,
        3,
        "x",
    );
    fake.join().unwrap();
    match r {
        Err(Failed::TurnedAway(e)) => assert!(e.to_string().contains("no verdict"), "{e}"),
        other => panic!("a closed connection should turn the client away, got {other:?}"),
    }
}

/// Open connections a listener holds: `false` for one it has closed.
fn still_open(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let open =
        matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

/// A flood of idle and garbage connections holds at most [`acceptor::MAX_HANDSHAKES`] of them open
/// (the rest are closed at once, long before the handshake deadline), and a real rank still
/// gets through. On main every connection got a thread and was held until its deadline.
#[test]
fn admission_is_capped_and_a_rank_gets_through_a_flood() {
    let timeout = Duration::from_secs(3);
    let (_acceptor, joins, addr) = mesh_acceptor(None, timeout);
    let t = Instant::now();
    const IDLE: usize = 500;
    const {
        assert!(
            acceptor::MAX_HANDSHAKES < IDLE / 2,
            "the flood must be well over the cap"
        )
    };
    let idle: Vec<TcpStream> = (0..IDLE).map(|_| raw(addr)).collect();
    let mut garbage: Vec<TcpStream> = (0..50)
        .map(|i| {
            let mut s = raw(addr);
            let _ = s.write_all(&[i as u8; HELLO_LEN]);
            s
        })
        .collect();
    let held = loop {
        let held = idle.iter().filter(|s| still_open(s)).count();
        if held <= acceptor::MAX_HANDSHAKES || t.elapsed() > timeout - Duration::from_millis(500) {
            break held;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let drained = t.elapsed();
    assert!(
        held <= acceptor::MAX_HANDSHAKES,
        "{held} of {IDLE} idle connections held open after {drained:?}"
    );
    for s in &mut garbage {
        // Refused as not a dist peer, or closed unread: never left hanging past its handshake
        // deadline (counted from its accept, which came before the backlog was drained).
        let within = (drained + timeout + Duration::from_secs(1)).saturating_sub(t.elapsed());
        let got = read_until_closed(s, within);
        if !got.is_empty() {
            let r = Reply::decode(&got).unwrap();
            assert_eq!(r.refusal, Some(Refusal::BadMagic), "{}", r.reason);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = join_listener(
        addr,
        &mut || Ok(mesh_hello(2, false)),
        None,
        1,
        deadline,
        2,
        "rank 1",
        &|detail| panic!("{detail}"),
        &|| None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let j = joins.recv_deadline(deadline).unwrap();
    assert_eq!(j.rank, 2);
    drop((s, idle));
}

/// Sends a garbage hello on a new connection and waits for the listener to turn it away.
fn refused_garbage(addr: SocketAddr) {
    let mut s = raw(addr);
    let _ = s.write_all(&[0xAB; HELLO_LEN]);
    let got = read_until_closed(&mut s, Duration::from_secs(3));
    if !got.is_empty() {
        assert_eq!(
            Reply::decode(&got).unwrap().refusal,
            Some(Refusal::BadMagic)
        );
    }
}

/// Connections that come one after another are served by one handshake worker, which waits
/// for the next one; a worker starts only when none is idle, and connections held in their
/// handshake at once still get a worker each, up to [`acceptor::HANDSHAKE_WORKERS`]. Before,
/// every connection that arrived while fewer than that many workers lived started one, idle
/// ones or not: four thread starts for four connections one after another.
#[test]
fn a_worker_starts_only_when_none_is_idle() {
    let (a, _joins, addr) = mesh_acceptor(None, Duration::from_secs(5));
    // Waits until the worker that turned a connection away is idle again (it counts as busy
    // from its refusal until it takes the lock to wait).
    let settled = || {
        let deadline = Instant::now() + Duration::from_secs(4);
        while a.workers().2 < a.workers().1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for _ in 0..6 {
        refused_garbage(addr);
        settled();
    }
    assert_eq!(
        a.workers(),
        (1, 1, 1),
        "(started, alive, idle) after six connections in turn"
    );
    // Connections that send nothing hold a worker each in its handshake until the deadline.
    let held: Vec<TcpStream> = (0..acceptor::HANDSHAKE_WORKERS)
        .map(|_| raw(addr))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(4);
    while a.workers().0 < acceptor::HANDSHAKE_WORKERS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (started, alive, _) = a.workers();
    assert_eq!(
        (started, alive),
        (acceptor::HANDSHAKE_WORKERS, acceptor::HANDSHAKE_WORKERS),
        "one worker a held connection"
    );
    drop(held);
}

/// The lazy entry point forms a lazily configured job (a world of one: no connection at all).
#[test]
fn the_lazy_entry_point_forms_a_world_of_one() {
    let cfg = TcpConfig::new(0, 1, "127.0.0.1:1").formation(Formation::Lazy);
    let f = form_lazy(&cfg, Box::new(|_, _| false)).unwrap();
    assert!(f.streams.iter().all(Option::is_none));
}

/// A dial to a listener that is gone (its rank failed) retries with backoff, asking between
/// attempts whether another rank has failed the job: it stops at the first such answer, long
/// before its deadline, with that failure as its error.
#[test]
fn a_dial_that_keeps_failing_stops_when_abandoned() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    let e = join_listener(
        addr,
        &mut || Ok(mesh_hello(2, false)),
        None,
        1,
        t + Duration::from_secs(20),
        2,
        "rank 1",
        &|detail| panic!("gave up instead: {detail}"),
        &|| {
            let n = asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (n >= 1).then(|| DistError::Aborted {
                rank: 2,
                op: "init".into(),
                origin: 1,
                culprit: None,
                reason: "rank 1 failed".into(),
            })
        },
    )
    .unwrap_err();
    assert!(matches!(e, DistError::Aborted { origin: 1, .. }), "{e}");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// The formation's outcome is decided once, in the store: a rank whose deadline passes while
/// `init/go` is unset sets it to its failure (and fails the rendezvous), so that the last rank
/// ready, setting `go` after, reads that failure instead of completing a formation without it;
/// a rank that finds `go` goes.
#[test]
fn a_rank_out_of_time_decides_the_formation_failed_for_everyone() {
    let server = dist_store::StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let client =
        dist_store::TcpStore::connect(server.local_addr(), Duration::from_secs(10)).unwrap();
    let late = dist_store::PrefixStore::new("job/0", &client);
    let soon = Instant::now() + Duration::from_millis(50);
    assert_eq!(decide_go(&late, 2, soon).unwrap(), None);
    let last = late.compare_set("init/go", b"", b"go").unwrap();
    let text = String::from_utf8_lossy(&last);
    assert!(text.starts_with("failed 2: "), "{text}");
    let formed = dist_store::PrefixStore::new("job/1", &client);
    formed.compare_set("init/go", b"", b"go").unwrap();
    assert_eq!(decide_go(&formed, 2, soon).unwrap(), Some(b"go".to_vec()));
}

//! Liveness: heartbeats, silent peers declared unresponsive within the peer timeout, live but
//! busy peers never reported, the peer-fault hook, and abort notices that never block.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp, Tag, Transport};
use dist_tcp::wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind};
use dist_tcp::{FaultCause, PeerFault, TcpBackend, TcpConfig};

const PEER_TIMEOUT: Duration = Duration::from_millis(400);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .init_timeout(Duration::from_secs(20))
        .timeout(Duration::from_secs(10))
        .peer_timeout(PEER_TIMEOUT)
        .linger(Duration::from_secs(2))
}

/// Rank 0 as a real backend, the other ranks as raw connections that neither read nor write
/// (stopped processes, as far as rank 0 can tell).
fn real_and_raw(world: usize, peer_timeout: Duration) -> (TcpBackend, Vec<Option<TcpStream>>) {
    let port = free_port();
    let raws: Vec<_> = (1..world)
        .map(|r| thread::spawn(move || dist_tcp::testing::form_raw(&cfg(r, world, port)).unwrap()))
        .collect();
    let b = TcpBackend::with_config(cfg(0, world, port).peer_timeout(peer_timeout)).unwrap();
    let mut streams = vec![None];
    for h in raws {
        let mut s = h.join().unwrap();
        streams.push(s[0].take());
    }
    (b, streams)
}

fn faults(b: &TcpBackend) -> Arc<Mutex<Vec<(PeerFault, Instant)>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    b.on_peer_fault(move |f| s.lock().unwrap().push((f.clone(), Instant::now())));
    seen
}

#[test]
fn a_silent_peer_is_declared_unresponsive_within_the_peer_timeout() {
    let (b, _raw) = real_and_raw(2, PEER_TIMEOUT);
    let seen = faults(&b);
    let t = Instant::now();
    let e = b.recv(&mut [0u8; 4], 1).unwrap_err();
    let waited = t.elapsed();
    eprintln!("{e} (after {waited:.2?})");
    match &e {
        DistError::PeerUnresponsive {
            rank: 0,
            peer: 1,
            silent,
            ..
        } => {
            assert!(*silent >= PEER_TIMEOUT, "{silent:?}")
        }
        other => panic!("expected PeerUnresponsive, got {other}"),
    }
    assert!(
        e.to_string()
            .contains("stopped, partitioned, or its host down"),
        "{e}"
    );
    // Within the peer timeout and a heartbeat interval or two, far below the 10 s op timeout.
    assert!(waited < PEER_TIMEOUT * 3, "{waited:?}");
    // Later calls fail at once, naming it; collectives too.
    let e = b.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err();
    assert_eq!(e.peer(), Some(1), "{e}");
    let f = seen.lock().unwrap().clone();
    assert!(
        matches!(
            &f[..],
            [(
                PeerFault {
                    rank: 0,
                    peer: 1,
                    cause: FaultCause::Silent(_),
                    ..
                },
                _
            )]
        ),
        "{f:?}"
    );
}

#[test]
fn a_live_peer_busy_computing_is_never_reported() {
    let port = free_port();
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            thread::spawn(move || {
                let b = TcpBackend::with_config(cfg(r, 3, port)).unwrap();
                let seen = faults(&b);
                if r == 2 {
                    // Computing, making no call, for eight peer timeouts.
                    thread::sleep(PEER_TIMEOUT * 8);
                }
                let mut x = [r as f32; 8];
                b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, [3.0; 8]);
                b.barrier().unwrap();
                let f = seen.lock().unwrap().clone();
                assert!(f.is_empty(), "rank {r}: {f:?}");
            })
        })
        .collect();
    for h in ranks {
        h.join().unwrap();
    }
}

#[test]
fn a_closed_connection_reaches_the_hook_at_once() {
    let (b, mut raw) = real_and_raw(3, PEER_TIMEOUT);
    let seen = faults(&b);
    let t = Instant::now();
    drop(raw[2].take());
    let e = b
        .recv_tagged_timeout(&mut [0u8; 4], 2, Tag::user(1), Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(e, DistError::PeerGone { peer: 2, .. }), "{e}");
    // The hook runs on the liveness thread: give it until well under the peer timeout.
    let until = Instant::now() + PEER_TIMEOUT / 2;
    while seen.lock().unwrap().is_empty() && Instant::now() < until {
        thread::yield_now();
    }
    let f = seen.lock().unwrap().clone();
    match &f[..] {
        [
            (
                PeerFault {
                    rank: 0,
                    peer: 2,
                    cause: FaultCause::Closed(_),
                    ..
                },
                at,
            ),
        ] => {
            assert!(at.duration_since(t) < PEER_TIMEOUT / 2)
        }
        other => panic!("{other:?}"),
    }
    // A hook that calls back into the backend does not deadlock: register one late, it hears
    // the past fault at once and can use the backend.
    let b = Arc::new(b);
    let inner = Arc::downgrade(&b);
    let calls = Arc::new(Mutex::new(0));
    let c = calls.clone();
    b.on_peer_fault(move |_| {
        if let Some(b) = inner.upgrade() {
            let _ = b.abort_notices();
            let _ = b.send_tagged(b"x", 0, Tag::user(3));
        }
        *c.lock().unwrap() += 1;
    });
    assert_eq!(*calls.lock().unwrap(), 1);
}

#[test]
fn an_abort_notice_reaches_the_hook() {
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            thread::spawn(move || {
                let b = TcpBackend::with_config(cfg(r, 2, port)).unwrap();
                let seen = faults(&b);
                if r == 1 {
                    b.broadcast_abort(Tag::user(0), "rank 1 gave up");
                }
                b.barrier_timeout(Duration::from_secs(2)).ok();
                if r == 0 {
                    let until = Instant::now() + Duration::from_secs(2);
                    while seen.lock().unwrap().is_empty() && Instant::now() < until {
                        thread::yield_now();
                    }
                    let f = seen.lock().unwrap().clone();
                    assert!(
                        matches!(&f[..], [(PeerFault { peer: 1, cause: FaultCause::Aborted(r), .. }, _)] if r == "rank 1 gave up"),
                        "{f:?}"
                    );
                }
            })
        })
        .collect();
    for h in ranks {
        h.join().unwrap();
    }
}

#[test]
fn an_abort_notice_is_not_held_up_by_a_peer_that_does_not_read() {
    // Rank 1 reads nothing; a send of 256 MiB to it holds rank 0's writer (and fills the
    // socket) until the 10 s send timeout. Rank 2 reads. An abort must go out to rank 2 and
    // return to the caller at once. (A peer timeout past the test, so that the silent rank 1 is
    // not cut off meanwhile, which would free the writer.)
    let (b, mut raw) = real_and_raw(3, Duration::from_secs(60));
    let b = Arc::new(b);
    let big = {
        let b = b.clone();
        thread::spawn(move || b.send(&vec![0u8; 256 << 20], 1))
    };
    // Wait until the big send has filled the socket and holds the writer (it cannot finish).
    thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    b.broadcast_abort(Tag::user(0), "gave up");
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "broadcast_abort took {took:?}"
    );
    let mut s2 = raw[2].take().unwrap();
    s2.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    // Rank 0's tuning (the group forming) and heartbeats may come first; the abort notice
    // follows within the read timeout.
    loop {
        let mut h = [0u8; FRAME_HEADER_LEN];
        s2.read_exact(&mut h).unwrap();
        let h = FrameHeader::decode(&h).unwrap();
        let mut payload = vec![0u8; h.len as usize];
        s2.read_exact(&mut payload).unwrap();
        match h.kind {
            FrameKind::Abort => {
                assert_eq!(payload, b"gave up");
                break;
            }
            FrameKind::Data => assert_eq!(h.tag, dist_core::collectives::GROUP_TAG.to_wire()),
            kind => assert_eq!(kind, FrameKind::Heartbeat),
        }
    }
    drop(raw);
    assert!(big.join().unwrap().is_err());
}

/// A peer's abort notice that names a "rank at fault" outside the job (1000 of 2) is taken as
/// the sender's own failure: the error names rank 1, the sender, as its origin. Before, the
/// number went into `DistError::Aborted { origin: 1000 }` unchecked.
#[test]
fn an_abort_naming_no_rank_of_the_job_is_the_senders() {
    use std::io::Write;
    let (b, mut raw) = real_and_raw(2, Duration::from_secs(60));
    let text = b"bogus";
    let mut meta = [0u8; 16];
    meta[..8].copy_from_slice(&1001u64.to_le_bytes());
    let h = FrameHeader {
        kind: FrameKind::Abort,
        tag: dist_core::collectives::COLLECTIVE_TAG.to_wire(),
        len: text.len() as u64,
        meta,
    };
    let s = raw[1].as_mut().unwrap();
    s.write_all(&h.encode()).unwrap();
    s.write_all(text).unwrap();
    let e = b.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err();
    eprintln!("{e}");
    match e {
        DistError::Aborted { origin, .. } => assert_eq!(origin, 1, "{e}"),
        other => panic!("expected Aborted, got {other}"),
    }
}

//! Two peers of one process over a real shared-memory negotiation: frames larger than the ring
//! arrive whole, and a ring whose header the "peer" corrupts ends the connection with an error
//! that names the peer, never a fault.

use std::net::TcpListener;

use super::*;

/// Rank 0's view of rank 1 (driven by an I/O thread) and rank 1's view of rank 0, both over
/// shared memory.
fn pair() -> (Arc<Peer>, Arc<Peer>, IoThread) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    let host = crate::shm::host_identity(None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let limits = Limits {
        max_message: 1 << 30,
        unexpected: 64 << 20,
    };
    let make = |me, rank, s| {
        let aborts = Arc::new(Aborts::default());
        let t = Duration::from_secs(10);
        Peer::connected_shm(me, rank, s, t, aborts, limits, host, None, deadline).unwrap()
    };
    let (p0, p1) = std::thread::scope(|sc| {
        let t = sc.spawn(|| make(1, 0, b));
        (make(0, 1, a), t.join().unwrap())
    });
    let (p0, p1) = (Arc::new(p0), Arc::new(p1));
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&p0);
    (p0, p1, io)
}

fn send(p: &Peer, tag: u64, data: &[u8]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    p.send(
        FrameKind::Data,
        tag,
        data,
        [7; 16],
        &|| "send".into(),
        deadline,
    )
}

#[test]
fn frames_larger_than_the_ring_arrive_whole_over_shared_memory() {
    let (p0, p1, _io) = pair();
    assert_eq!(p0.shared_memory(), (true, true));
    assert_eq!(p1.shared_memory(), (true, true));
    let data: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i * 31 % 251) as u8).collect();
    std::thread::scope(|s| {
        s.spawn(|| send(&p1, 5, &data).unwrap());
        let mut got = vec![0u8; data.len()];
        let deadline = Instant::now() + Duration::from_secs(20);
        let meta = p0.recv(&mut got, 5, deadline, &|| "recv".into()).unwrap();
        assert_eq!(meta, [7; 16]);
        assert!(got == data, "payload differs");
    });
}

#[test]
fn a_corrupt_ring_header_is_an_error_naming_the_peer() {
    let (p0, p1, _io) = pair();
    send(&p1, 1, b"before").unwrap();
    let mut b = [0u8; 6];
    let deadline = Instant::now() + Duration::from_secs(10);
    p0.recv(&mut b, 1, deadline, &|| "recv".into()).unwrap();
    assert_eq!(&b, b"before");
    // The peer's side writes a position far beyond the ring into the header.
    if let Source::Ring { ring, .. } = &p0.rx().unwrap().lock().unwrap().sock {
        ring.corrupt_tail_for_test();
    } else {
        panic!("not over shared memory");
    }
    let e = p0.recv(&mut b, 2, deadline, &|| "recv".into()).unwrap_err();
    match &e {
        DistError::PeerGone { peer: 1, cause, .. } => {
            assert!(
                cause.contains("corrupt shared-memory ring from peer 1"),
                "{e}"
            )
        }
        other => panic!("expected PeerGone, got {other}"),
    }
}

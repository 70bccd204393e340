//! Two peers of one process over a real shared-memory negotiation: frames larger than the ring
//! arrive whole, and a ring whose header the "peer" corrupts ends the connection with an error
//! that names the peer, never a fault.

use std::net::TcpListener;

use crate::shm::RxRing;

use super::*;

/// Rank 0's view of rank 1 (driven by an I/O thread) and rank 1's view of rank 0, both over
/// shared memory.
fn pair() -> (Arc<Peer>, Arc<Peer>, IoThread) {
    let (p0, p1) = pair_unwatched();
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&p0);
    (p0, p1, io)
}

/// As [`pair`], with no I/O thread: nothing reads either ring unless the test does.
fn pair_unwatched() -> (Arc<Peer>, Arc<Peer>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    let host = crate::shm::host_identity(None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let limits = Limits {
        max_message: 1 << 30,
        unexpected: 64 << 20,
        sealed: false,
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
    (Arc::new(p0), Arc::new(p1))
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
            // This rank, the peer, the operation, and the positions against the capacity.
            assert!(
                cause.contains("rank 0: corrupt shared-memory ring from peer 1 while reading"),
                "{e}"
            );
            assert!(
                cause.contains("bytes ahead of this rank's read position")
                    && cause.contains("at most the ring's"),
                "{e}"
            );
        }
        other => panic!("expected PeerGone, got {other}"),
    }
}

/// Runs `f` on rank 0's end of the ring from rank 1.
fn with_ring<T>(p0: &Peer, f: impl FnOnce(&mut RxRing) -> T) -> T {
    match &mut p0.rx().unwrap().lock().unwrap().sock {
        Source::Ring { ring, .. } => f(ring),
        _ => panic!("not over shared memory"),
    }
}

/// A sender waiting for room in a full ring to a peer that dies fails within a second with
/// `PeerGone` naming the peer (the room wait used to look only for a connection hung up in both
/// directions, which a dead peer's end of stream is not: the send waited out its deadline).
#[test]
fn a_sender_on_a_full_ring_sees_its_peer_die_within_a_second() {
    let (p0, p1) = pair_unwatched();
    // More than the ring holds, and nobody reads it.
    let data = vec![1u8; 4 << 20];
    let deadline = Instant::now() + Duration::from_secs(5);
    let (r, took) = std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let t = Instant::now();
            let r = p1.send(
                FrameKind::Data,
                3,
                &data,
                [0; 16],
                &|| "send".into(),
                deadline,
            );
            (r, t.elapsed())
        });
        // Rank 0 dies: the kernel closes its socket (its ring stays mapped on this side).
        p0.shutdown(Shutdown::Both);
        sender.join().unwrap()
    });
    assert!(took < Duration::from_secs(1), "took {took:?}: {r:?}");
    match r {
        Err(DistError::PeerGone {
            rank: 1,
            peer: 0,
            cause,
            ..
        }) => assert!(cause.contains("shared-memory ring"), "{cause}"),
        other => panic!("expected PeerGone from peer 0, got {other:?}"),
    }
}

/// An abort notice to a peer whose ring is full sleeps on the ring's wake-up, not in 1 ms
/// polls: the notice's loop takes a few passes however long the ring stays full.
#[test]
fn a_notice_to_a_full_ring_waits_on_the_ring() {
    let (p0, p1) = pair_unwatched();
    // Fill the ring from rank 1 with raw bytes (nobody parses them here).
    {
        let mut w = p1.writer().unwrap().lock_by(Instant::now()).unwrap();
        let chunk = vec![0u8; 64 << 10];
        loop {
            match w.try_write(&[IoSlice::new(&chunk)]) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => panic!("{e}"),
            }
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // Make room once the notice's sender waits for it (or after 200 ms, when it polls
            // instead: then its passes show it).
            let t = Instant::now();
            while !with_ring(&p0, |r| r.producer_waiting_for_test())
                && t.elapsed() < Duration::from_millis(200)
            {
                std::thread::yield_now();
            }
            if t.elapsed() < Duration::from_millis(200) {
                // Seen waiting: let it sleep a while on the futex before the room comes.
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut buf = vec![0u8; 64 << 10];
            let n = with_ring(&p0, |r| r.read(&mut buf)).unwrap();
            assert!(n > 0);
        });
        super::notices::SEND_TO_ALL_PASSES.with(|p| p.set(0));
        let t = Instant::now();
        Peer::send_to_all(
            &[&p1],
            FrameKind::Abort,
            Tag::system(2).to_wire(),
            b"stop",
            [0; 16],
            t + Duration::from_secs(5),
            &|r| format!("abort notice to {r}"),
        );
        let passes = super::notices::SEND_TO_ALL_PASSES.with(std::cell::Cell::get);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(passes <= 5, "{passes} passes of the notice's loop");
    });
    // Written whole: the ring holds the notice's frame after the bytes read.
    assert!(with_ring(&p0, |r| r.available(&String::new)).unwrap() > 0);
}

/// Fills the socket under rank 1's ring to rank 0 with doorbell bytes until it takes no more
/// (`stop` unset: once), or until `stop` is set; returns how many went.
fn ring_bells(p1: &Peer, stop: Option<&AtomicBool>) -> usize {
    let mut s = p1.stream().unwrap().try_clone().unwrap();
    let chunk = [0u8; 64 << 10];
    let mut sent = 0;
    loop {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return sent;
        }
        match std::io::Write::write(&mut s, &chunk) {
            Ok(n) => sent += n,
            Err(e) if would_block(&e) => match stop {
                None => return sent,
                Some(_) => std::thread::yield_now(),
            },
            Err(e) => panic!("{e}"),
        }
    }
}

/// One read from an empty ring drains at most [`DOORBELL_READS`] x 64 doorbell bytes from the
/// socket and says it stopped there; the rest waits for the next read (it used to read until
/// the socket was empty, which a flooding peer could put off for ever).
#[test]
fn a_read_from_a_ring_drains_a_bounded_number_of_doorbells() {
    let (p0, p1) = pair_unwatched();
    let sent = ring_bells(&p1, None);
    // More than one bounded drain takes (16 x 64 bytes).
    assert!(sent > 64 << 10, "{sent} bytes");
    let rx = p0.rx().unwrap();
    let mut r = rx.lock().unwrap();
    let Source::Ring { io_turn, .. } = &mut r.sock else {
        panic!("not over shared memory");
    };
    *io_turn = true;
    let mut buf = [0u8; 16];
    let e = recv_now(&mut r.sock, &mut buf).unwrap_err();
    assert!(would_block(&e), "{e}");
    let Source::Ring { bells_left, .. } = &r.sock else {
        unreachable!()
    };
    assert!(*bells_left, "the drain did not say it stopped at its bound");
    // Bytes are left in the socket.
    let mut one = [0u8; 1];
    let left = p0.stream().unwrap().peek(&mut one);
    assert!(
        matches!(left, Ok(1)),
        "{left:?} after a drain of {sent} bytes"
    );
}

/// While rank 1's socket is flooded with doorbell bytes, the I/O thread still reads what the
/// ring brings: a message from rank 1 arrives well within its deadline, and a turn of rank 0's
/// read side lets go of it (a receive on another tag ends at its own, short, deadline).
#[test]
fn a_doorbell_flood_leaves_the_ring_read() {
    let (p0, p1, _io) = pair();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let flood = s.spawn(|| ring_bells(&p1, Some(&stop)));
        // The flood is under way (the I/O thread is in its drains) before the message goes.
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let mut none = [0u8; 4];
        let short = Instant::now() + Duration::from_millis(300);
        let e = p0
            .recv(&mut none, 8, short, &|| "recv (nothing sent)".into())
            .unwrap_err();
        let late = t.elapsed();
        assert!(
            matches!(e, DistError::Timeout { .. }),
            "expected a timeout, got {e}"
        );
        assert!(
            late < Duration::from_secs(2),
            "ended {late:?} after its start"
        );
        send(&p1, 6, b"through the flood").unwrap();
        let mut got = [0u8; 17];
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = p0.recv(&mut got, 6, deadline, &|| "recv".into());
        stop.store(true, Ordering::Relaxed);
        let sent = flood.join().unwrap();
        r.unwrap_or_else(|e| panic!("{e} (flood of {sent} bytes)"));
        assert_eq!(&got, b"through the flood");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    });
}

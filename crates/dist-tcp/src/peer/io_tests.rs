//! Tests of the I/O thread with many peers: quiet connections cost no turns, and a peer that
//! floods, or whose frames are held back, does not hold up the others.

use std::io::Write;
use std::net::TcpListener;

use super::*;

fn limits(unexpected: usize) -> Limits {
    Limits {
        max_message: 1 << 30,
        unexpected,
        sealed: false,
    }
}

/// `n` connected peers (ranks 1..=n) on one I/O thread, with the test's end of each.
fn peers(n: usize, unexpected: usize) -> (IoThread, Vec<Arc<Peer>>, Vec<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let io = IoThread::spawn("test-io".into()).unwrap();
    let mut ps = Vec::new();
    let mut raws = Vec::new();
    for rank in 1..=n {
        let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let p = Arc::new(
            Peer::connected(
                0,
                rank,
                s,
                Duration::from_secs(10),
                Arc::new(Aborts::default()),
                limits(unexpected),
            )
            .unwrap(),
        );
        io.adopt(&p);
        ps.push(p);
        raws.push(raw);
    }
    (io, ps, raws)
}

fn frame(tag: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = FrameHeader {
        kind: FrameKind::Data,
        tag,
        len: payload.len() as u64,
        meta: [0; 16],
    }
    .encode()
    .to_vec();
    f.extend_from_slice(payload);
    f
}

fn turns(ps: &[Arc<Peer>]) -> u64 {
    ps.iter()
        .map(|p| p.reader_turns.load(Ordering::Relaxed))
        .sum()
}

/// Many ranks on one host: 32 quiet connections on one I/O thread cost nothing once quiet: no turn
/// at all over a second (the reader thread per peer looked every 250 ms each, IDLE_POLL; before
/// that every 20 ms). A frame arriving then is still read at once.
#[test]
fn quiet_connections_cost_no_turns() {
    let (io, ps, mut raws) = peers(32, 1 << 20);
    // Past IDLE_QUIET every peer waits for its socket alone. These two sleeps are not waits
    // for an event (there is none to wait for): the first lets the peers' quiet period pass,
    // the second is the window over which the test asserts that nothing happens.
    std::thread::sleep(IDLE_QUIET * 3);
    let before = turns(&ps);
    std::thread::sleep(Duration::from_secs(1));
    let quiet = turns(&ps) - before;
    assert_eq!(quiet, 0, "32 quiet peers took {quiet} turns in 1 s");
    raws[7].write_all(&frame(5, b"late")).unwrap();
    let mut buf = [0u8; 4];
    let d = Instant::now() + Duration::from_secs(10);
    ps[7].recv(&mut buf, 5, d, &|| "recv".into()).unwrap();
    assert_eq!(&buf, b"late");
    drop(io);
}

/// One peer floods frames as fast as it can and another's frames are held back for flow
/// control (its queue full, nobody receiving): a third peer's messages still arrive at once,
/// many times over. Fails if a turn of one peer ran until its socket was empty (the flood
/// would hold the thread) or a held frame made the thread wait.
#[test]
fn a_flooding_or_held_peer_does_not_hold_up_the_others() {
    let (io, ps, mut raws) = peers(3, 4096);
    // Peer 2: more than its budget, nobody receives: the last frame is held.
    for _ in 0..4 {
        raws[1].write_all(&frame(1, &[2; 2000])).unwrap();
    }
    // Peer 1: a flood of small frames nobody receives (queued up to its budget, then held),
    // and behind it, without end, more on a tag that is received and dropped at once.
    let mut flood = raws[0].try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let f = frame(9, &[1; 64]);
            let mut chunk = Vec::new();
            for _ in 0..256 {
                chunk.extend_from_slice(&f);
            }
            while !stop.load(Ordering::Relaxed) {
                if flood.write_all(&chunk).is_err() {
                    break;
                }
            }
        })
    };
    let drain = {
        let p = ps[0].clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut b = [0u8; 64];
            while !stop.load(Ordering::Relaxed) {
                let d = Instant::now() + Duration::from_millis(100);
                let _ = p.recv(&mut b, 9, d, &|| "drain".into());
            }
        })
    };
    let started = Instant::now();
    for i in 0..200u64 {
        raws[2].write_all(&frame(i, &i.to_le_bytes())).unwrap();
        let mut b = [0u8; 8];
        let d = Instant::now() + Duration::from_secs(5);
        ps[2].recv(&mut b, i, d, &|| format!("recv {i}")).unwrap();
        assert_eq!(u64::from_le_bytes(b), i);
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    assert!(
        took < Duration::from_secs(5),
        "200 round trips took {took:?}"
    );
    // The held frame of peer 2 is still served once received.
    let mut b = [0u8; 2000];
    let d = Instant::now() + Duration::from_secs(5);
    for _ in 0..4 {
        ps[1].recv(&mut b, 1, d, &|| "recv held".into()).unwrap();
    }
    let _ = raws[0].shutdown(Shutdown::Both);
    drain.join().unwrap();
    flooder.join().unwrap();
    drop(io);
}

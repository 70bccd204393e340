//! What a peer's bytes can make a rank believe about it: a peer that said "closing" and then
//! went silent, or that went silent behind a held frame header, is still declared unresponsive.

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use dist_core::{Backend, DistError};
use dist_tcp::wire::{FrameHeader, FrameKind, HEARTBEAT_CLOSING};
use dist_tcp::{FaultCause, PeerFault, TcpBackend, TcpConfig};

const PEER_TIMEOUT: Duration = Duration::from_millis(400);
const OP_TIMEOUT: Duration = Duration::from_secs(6);
const LINGER: Duration = Duration::from_secs(1);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cfg(rank: usize, world: usize, port: u16, peer_timeout: Duration) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .init_timeout(Duration::from_secs(20))
        .timeout(OP_TIMEOUT)
        .peer_timeout(peer_timeout)
        .linger(LINGER)
}

/// Rank 0 real, rank 1 a raw connection (the real handshake, then bytes of our choosing).
fn real_and_raw(peer_timeout: Duration) -> (TcpBackend, TcpStream) {
    let port = free_port();
    let raw =
        thread::spawn(move || dist_tcp::testing::form_raw(&cfg(1, 2, port, peer_timeout)).unwrap());
    let b = TcpBackend::with_config(cfg(0, 2, port, peer_timeout)).unwrap();
    let mut s = raw.join().unwrap();
    (b, s[0].take().unwrap())
}

fn frame(kind: FrameKind, tag: u64, len: u64, meta: [u8; 16]) -> [u8; 40] {
    FrameHeader {
        kind,
        tag,
        len,
        meta,
    }
    .encode()
}

fn closing_heartbeat() -> [u8; 40] {
    let mut meta = [0u8; 16];
    meta[8] = HEARTBEAT_CLOSING;
    frame(FrameKind::Heartbeat, 0, 0, meta)
}

fn faults(b: &TcpBackend) -> Arc<Mutex<Vec<PeerFault>>> {
    let seen: Arc<Mutex<Vec<PeerFault>>> = Arc::default();
    let s = seen.clone();
    b.on_peer_fault(move |f| s.lock().unwrap().push(f.clone()));
    seen
}

/// Waits (at most 2 s) until `seen` holds a fault `matches` accepts.
fn await_fault(seen: &Mutex<Vec<PeerFault>>, matches: impl Fn(&PeerFault) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if seen.lock().unwrap().iter().any(&matches) {
            return true;
        }
        thread::sleep(Duration::from_millis(10));
    }
    false
}

/// A peer that says "closing" in one heartbeat and then stays connected and silent (a process
/// stopped during its linger, or a hostile one) is excused for the linger only, then declared
/// unresponsive, and the hooks hear `Silent`. Fails without the bound on the excuse: the
/// receive runs to the op deadline and no fault is reported.
#[test]
fn a_peer_that_said_closing_then_went_silent_is_declared_unresponsive() {
    let (b, mut raw) = real_and_raw(PEER_TIMEOUT);
    let seen = faults(&b);
    raw.write_all(&closing_heartbeat()).unwrap();
    let t = Instant::now();
    let e = b.recv(&mut [0u8; 4], 1).unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(e, DistError::PeerUnresponsive { peer: 1, .. }),
        "expected PeerUnresponsive after about the linger ({LINGER:?}), got after {waited:.2?}: {e}"
    );
    // The flag still excuses the silence for the linger: not judged before it ran out (the flag
    // was heard after `write_all` returned, at the earliest).
    assert!(
        waited >= LINGER - Duration::from_millis(50),
        "declared after {waited:.2?}, within the linger {LINGER:?}"
    );
    assert!(
        waited < LINGER + PEER_TIMEOUT * 3,
        "declared only after {waited:.2?}"
    );
    assert!(
        await_fault(&seen, |f| f.peer == 1
            && matches!(f.cause, FaultCause::Silent(_))),
        "the hooks heard no Silent fault: {:?}",
        seen.lock().unwrap()
    );
    drop(raw);
}

/// A peer that says "closing" and then closes its connection is no fault: the excuse's bound
/// leaves the close after the flag as it was.
#[test]
fn a_close_after_closing_is_no_fault() {
    let (b, mut raw) = real_and_raw(PEER_TIMEOUT);
    let seen = faults(&b);
    raw.write_all(&closing_heartbeat()).unwrap();
    raw.shutdown(Shutdown::Write).unwrap();
    let e = b.recv(&mut [0u8; 4], 1).unwrap_err();
    assert!(
        matches!(e, DistError::PeerGone { peer: 1, .. }),
        "expected PeerGone, got {e}"
    );
    // Past the peer timeout and the linger: neither a close nor a silence is reported.
    thread::sleep(LINGER + PEER_TIMEOUT * 2);
    assert!(
        seen.lock().unwrap().is_empty(),
        "faults reported: {:?}",
        seen.lock().unwrap()
    );
    drop(raw);
}

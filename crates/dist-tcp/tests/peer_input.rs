//! What a peer's bytes can make a rank believe about it: a peer that said "closing" and then
//! went silent, or that went silent behind a held frame header, is still declared unresponsive;
//! a close long after "closing" is a fault; every one of many abort notices ends its wait.

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use dist_core::subgroup::GROUP_ID_BITS;
use dist_core::transport::Link;
use dist_core::{Backend, DistError, Tag, Transport};
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
    real_and_raw_with(peer_timeout, |c| c)
}

/// [`real_and_raw`], with rank 0's configuration changed by `tune`.
fn real_and_raw_with(
    peer_timeout: Duration,
    tune: impl FnOnce(TcpConfig) -> TcpConfig,
) -> (TcpBackend, TcpStream) {
    let port = free_port();
    let raw =
        thread::spawn(move || dist_tcp::testing::form_raw(&cfg(1, 2, port, peer_timeout)).unwrap());
    let b = TcpBackend::with_config(tune(cfg(0, 2, port, peer_timeout))).unwrap();
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

/// A peer that says "closing", keeps sending heartbeats past the excuse of its linger, and
/// then closes its connection (killed long after its linger began, or hostile) is reported
/// `Closed` to the hooks, which dist-hybrid's watch aborts NCCL on. Fails without the bound on
/// the excuse: a close after "closing" was never a fault, however late.
#[test]
fn a_close_long_after_closing_is_a_fault() {
    let (b, mut raw) = real_and_raw(PEER_TIMEOUT);
    let seen = faults(&b);
    raw.write_all(&closing_heartbeat()).unwrap();
    // The excuse lasts the longer of the linger and the peer timeout.
    let until = Instant::now() + LINGER.max(PEER_TIMEOUT) + Duration::from_millis(300);
    while Instant::now() < until {
        raw.write_all(&frame(FrameKind::Heartbeat, 0, 0, [0; 16]))
            .unwrap();
        thread::sleep(PEER_TIMEOUT / 4);
    }
    assert!(
        seen.lock().unwrap().is_empty(),
        "faults reported while the peer was heard: {:?}",
        seen.lock().unwrap()
    );
    raw.shutdown(Shutdown::Both).unwrap();
    assert!(
        await_fault(&seen, |f| f.peer == 1
            && matches!(f.cause, FaultCause::Closed(_))),
        "the hooks heard no Closed fault: {:?}",
        seen.lock().unwrap()
    );
}

/// A system tag of sub-group `id`.
fn sub_tag(id: u64) -> Tag {
    Tag::from_wire(Tag::system(2).to_wire() | (id << GROUP_ID_BITS.trailing_zeros()))
}

/// Rank 0 receives from rank 1 on `tag` in call `call` of its group (at most 5 s) while
/// `raise` (on another thread, once the receive waits) makes an abort notice for that call
/// arrive; the receive must end with it at once.
fn ended_by(b: &TcpBackend, tag: Tag, call: u64, reason: &str, raise: impl FnOnce() + Send) {
    b.group().link().enter_call(tag, call);
    let t = Instant::now();
    let e = thread::scope(|s| {
        s.spawn(|| {
            // Lets the receive start waiting: the notice must wake it.
            thread::sleep(Duration::from_millis(20));
            raise();
        });
        b.recv_tagged_timeout(&mut [0u8; 4], 1, tag, Duration::from_secs(5))
            .unwrap_err()
    });
    let waited = t.elapsed();
    match &e {
        DistError::Aborted { reason: r, .. } if r == reason => {}
        other => {
            panic!("call {call}: expected the abort \"{reason}\", got after {waited:.2?}: {other}")
        }
    }
    assert!(
        waited < Duration::from_secs(2),
        "call {call}: ended by its notice only after {waited:.2?}"
    );
}

/// A long job whose sub-groups fail call after call (here one group's calls, each notice
/// naming a call that no earlier notice ends): each of 100 abort notices from one peer, and
/// then each of 100 of this rank's own, ends the receive of its call at once, far past the
/// 16 notices a rank keeps from one sender. Fails without the fix: the 17th notice from a
/// sender was dropped, and its receive ran to its deadline.
#[test]
fn every_one_of_many_aborts_from_one_sender_ends_its_wait_at_once() {
    // A peer timeout that does not run out here (the raw peer sends no heartbeats): no
    // silence is declared, whose notice would end every wait.
    let (b, raw) = real_and_raw(Duration::from_secs(60));
    let tag = sub_tag(3);
    let raw = Mutex::new(raw);
    for k in 0..100u64 {
        let call = 1000 - k;
        let reason = format!("peer abort {k}");
        let mut meta = [0u8; 16];
        meta[8..].copy_from_slice(&call.to_le_bytes());
        ended_by(&b, tag, call, &reason, || {
            let mut raw = raw.lock().unwrap();
            raw.write_all(&frame(
                FrameKind::Abort,
                tag.to_wire(),
                reason.len() as u64,
                meta,
            ))
            .unwrap();
            raw.write_all(reason.as_bytes()).unwrap();
        });
    }
    for k in 0..100u64 {
        let call = 500 - k;
        let reason = format!("own abort {k}");
        ended_by(&b, tag, call, &reason, || {
            b.group().link().abort(tag, Some(call), &reason, None)
        });
    }
    assert_eq!(b.abort_notices().len(), 2 * 16);
    drop(raw);
}

/// A peer timeout longer than the recheck of a held frame (500 ms), as the default one is.
const HOLD_PEER_TIMEOUT: Duration = Duration::from_millis(1200);

/// A peer that sends one data header longer than the unexpected budget (on a tag nobody
/// receives) and then nothing: the frame is held for flow control, and the peer, none of whose
/// bytes arrive behind it, is declared unresponsive; a receive from it on another tag fails so.
/// Fails without the fix: every recheck of the hold counted as hearing from the peer, and the
/// receive ran to the op deadline.
#[test]
fn a_peer_silent_behind_a_held_header_is_declared_unresponsive() {
    let (b, mut raw) = real_and_raw(HOLD_PEER_TIMEOUT);
    let len = 2 * dist_tcp::DEFAULT_UNEXPECTED_LIMIT as u64;
    raw.write_all(&frame(
        FrameKind::Data,
        Tag::user(7).to_wire(),
        len,
        [0; 16],
    ))
    .unwrap();
    let t = Instant::now();
    let e = b.recv_tagged(&mut [0u8; 4], 1, Tag::user(1)).unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(e, DistError::PeerUnresponsive { peer: 1, .. }),
        "expected PeerUnresponsive within ~{:?}, got after {waited:.2?}: {e}",
        HOLD_PEER_TIMEOUT * 3
    );
    drop(raw);
}

/// A live peer blocked by this rank's flow control (a message larger than the unexpected budget,
/// held while nobody receives it, its sender stuck with the socket full) is not declared
/// unresponsive, however long the hold lasts; once received, the message arrives whole.
#[test]
fn a_peer_blocked_behind_a_held_frame_is_not_declared_unresponsive() {
    const LEN: usize = 16 << 20;
    let (b, raw) = real_and_raw_with(HOLD_PEER_TIMEOUT, |c| c.unexpected_limit(1 << 20));
    let seen = faults(&b);
    let payload: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let expected = payload.clone();
    let sender = thread::spawn(move || {
        let mut raw = raw;
        raw.write_all(&frame(
            FrameKind::Data,
            Tag::user(7).to_wire(),
            LEN as u64,
            [0; 16],
        ))
        .unwrap();
        // Blocks once the socket is full, until rank 0 receives on tag 7.
        raw.write_all(&payload).unwrap();
        raw
    });
    // Held for over twice the peer timeout while nothing of the peer can arrive.
    let wait = HOLD_PEER_TIMEOUT * 3;
    let e = b
        .recv_tagged_timeout(&mut [0u8; 4], 1, Tag::user(1), wait)
        .unwrap_err();
    assert!(
        matches!(e, DistError::Timeout { .. }),
        "expected a timeout, got {e}"
    );
    let mut got = vec![0u8; LEN];
    b.recv_tagged(&mut got, 1, Tag::user(7)).unwrap();
    assert!(got == expected, "the held message arrived changed");
    let raw = sender.join().unwrap();
    assert!(
        seen.lock().unwrap().is_empty(),
        "faults reported: {:?}",
        seen.lock().unwrap()
    );
    drop(raw);
}

//! Receivers that wait in `poll` on their peer's socket themselves (`poll_wait.rs`), as they do
//! on a host with more ranks than cores.

use super::tests::{Pair, held_by_spinner_lost_wake, limits, many_distinct_tags};
use super::*;

/// Waits (at most 5 s) until `holds` is true of the peer's state.
fn until(p: &Peer, what: &str, holds: impl Fn(&State) -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !holds(&p.lock()) {
        assert!(Instant::now() < end, "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// With the socket wait the I/O thread stays asleep: the receiver, woken by the bytes, reads
/// them itself (the I/O thread's turns are counted). Fails without it: the receiver never
/// registers (it sleeps on the condition variable, and the I/O thread reads its message).
#[test]
fn a_receiver_that_does_not_spin_reads_its_message_itself() {
    let mut pair = Pair::waiting(limits(1 << 30, 1 << 20), true);
    // The I/O thread has gone quiet: it waits for the socket alone, with no timer.
    until(&pair.peer, "the I/O thread waits for the socket", |st| {
        st.io_read && st.io_armed
    });
    let peer = pair.peer.clone();
    let receiver = std::thread::spawn(move || {
        let mut buf = [0u8; 5];
        let d = Instant::now() + Duration::from_secs(10);
        peer.recv(&mut buf, 7, d, &|| "recv tag 7".into())
            .map(|_| buf)
    });
    until(&pair.peer, "the receiver waits on the socket", |st| {
        st.pollers.len() == 1 && !st.io_armed
    });
    let turns = pair.peer.reader_turns.load(Ordering::Relaxed);
    pair.frame(1, 7, 5, b"hello");
    assert_eq!(&receiver.join().unwrap().unwrap(), b"hello");
    assert_eq!(
        pair.peer.reader_turns.load(Ordering::Relaxed),
        turns,
        "the I/O thread took a turn for a message its receiver waited for on the socket"
    );
    // The socket is the I/O thread's again.
    let st = pair.peer.lock();
    assert!(st.pollers.is_empty() && st.io_armed);
}

/// Fails without the wake descriptor: an abort notice (here raised by the test, as the abort
/// hook does) wakes the peers' sleepers, and a receiver in `poll` on a quiet socket would sit
/// out its 20 s deadline.
#[test]
fn a_receiver_waiting_on_the_socket_is_woken_by_an_abort() {
    let pair = Pair::waiting(limits(1 << 30, 1 << 20), true);
    let tag = Tag::system(5);
    let peer = pair.peer.clone();
    let receiver = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        let d = Instant::now() + Duration::from_secs(20);
        let started = Instant::now();
        let r = peer.recv(&mut buf, tag.to_wire(), d, &|| "barrier".into());
        (r, started.elapsed())
    });
    until(&pair.peer, "the receiver waits on the socket", |st| {
        st.pollers.len() == 1
    });
    pair.peer.aborts.raise(AbortNotice {
        from: 2,
        culprit: None,
        first: None,
        tag,
        call: None,
        reason: "rank 2 failed".into(),
    });
    pair.peer.wake();
    let (r, took) = receiver.join().unwrap();
    let e = r.unwrap_err();
    assert!(e.to_string().contains("rank 2 failed"), "{e}");
    assert!(took < Duration::from_secs(10), "woken only after {took:?}");
}

/// A frame held back for flow control by another reader: the receivers waiting on the socket
/// leave it to the I/O thread and sleep (the socket would stay readable under them, or the
/// held bytes sit in the buffer where `poll` does not see them). Failed (a timeout) before
/// readers that leave bytes in the buffer or hold a frame woke those receivers.
#[test]
fn a_frame_held_by_a_spinner_reaches_receivers_waiting_on_the_socket() {
    held_by_spinner_lost_wake(true);
}

/// Many small frames on distinct tags, read a bounded number per read: the bytes a read leaves
/// in the buffer are moved along by the receiver before it polls. Fails without that look at
/// the buffer (a receive times out with its message in the buffer); `after_read`'s wake of the
/// waiters, for bytes another reader left, does not make it fail when taken out alone.
#[test]
fn frames_left_in_the_buffer_reach_a_receiver_waiting_on_the_socket() {
    many_distinct_tags(true);
}

/// Review of d75cce1, finding 1. Fails before the fix (about 150,000 turns of the I/O thread in
/// 1.5 s, and a core's worth of CPU): every read that met a frame still held rang the waiters
/// and kicked the I/O thread, whose own turn then met the held frame again and kicked itself.
/// A hold is told of once, when it starts.
#[test]
fn a_frame_held_while_a_receiver_waits_on_the_socket_costs_no_turns() {
    let mut pair = Pair::waiting(limits(1 << 30, 100 + QUEUED_OVERHEAD + 50), true);
    pair.frame(1, 1, 100, &[1; 100]);
    until(&pair.peer, "the first message is queued", |st| {
        st.queued_bytes == 100 + QUEUED_OVERHEAD
    });
    // The second does not fit the budget: the I/O thread holds it, its payload in the buffer.
    pair.frame(1, 2, 100, &[2; 100]);
    until(&pair.peer, "the second is held", |st| st.reader_holding);
    let peer = pair.peer.clone();
    let waiter = std::thread::spawn(move || {
        let mut b = [0u8; 10];
        let d = Instant::now() + Duration::from_millis(1500);
        peer.recv(&mut b, 5, d, &|| "recv tag 5".into())
    });
    until(&pair.peer, "the receiver waits on the socket", |st| {
        st.pollers.len() == 1
    });
    // A window in which nothing happens on the connection: the I/O thread should sleep.
    let turns = pair.peer.reader_turns.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    let turns = pair.peer.reader_turns.load(Ordering::Relaxed) - turns;
    let mut b = [0u8; 100];
    pair.recv(&mut b, 1).unwrap();
    pair.recv(&mut b, 2).unwrap();
    assert_eq!(b, [2; 100]);
    assert!(
        matches!(waiter.join().unwrap(), Err(DistError::Timeout { .. })),
        "tag 5 was never sent"
    );
    assert!(
        turns < 20,
        "{turns} turns of the I/O thread in 300 ms of a held frame"
    );
}

/// Review of d75cce1, finding 2. Fails before the fix (the message landed after about 500 ms,
/// the hold recheck): a read that stopped at its bound of frames ended the I/O thread's turn,
/// and its next turn, from the top, waited for the socket with the rest of the frames, this
/// receiver's among them, in the buffer.
#[test]
fn a_sleeping_receiver_behind_a_bounded_read_is_not_kept_waiting() {
    let mut pair = Pair::waiting(limits(1 << 30, 1 << 20), false);
    // Receivers sleep on the condition variable (a spin of 1 µs: no socket wait).
    pair.peer.set_spin(Duration::from_micros(1));
    let peer = pair.peer.clone();
    let receiver = std::thread::spawn(move || {
        let mut b = [0u8; 5];
        let d = Instant::now() + Duration::from_secs(5);
        peer.recv(&mut b, 7, d, &|| "recv tag 7".into())
            .map(|_| (b, Instant::now()))
    });
    until(&pair.peer, "the receiver sleeps", |st| st.sleepers == 1);
    // 300 one-byte frames nobody waits for, then the receiver's: more than one read's bound.
    let mut bytes = Vec::new();
    for i in 0..300u64 {
        let h = FrameHeader {
            kind: FrameKind::Data,
            tag: 1000 + i,
            len: 1,
            meta: [0; 16],
        };
        bytes.extend_from_slice(&h.encode());
        bytes.push(1);
    }
    let h = FrameHeader {
        kind: FrameKind::Data,
        tag: 7,
        len: 5,
        meta: [0; 16],
    };
    bytes.extend_from_slice(&h.encode());
    bytes.extend_from_slice(b"hello");
    let sent = Instant::now();
    std::io::Write::write_all(&mut pair.raw, &bytes).unwrap();
    let (b, landed) = receiver.join().unwrap().unwrap();
    assert_eq!(&b, b"hello");
    let took = landed - sent;
    // The bug cost the hold recheck (500 ms); a healthy turn takes microseconds.
    assert!(took < HOLD_RECHECK / 2, "landed after {took:?}");
}

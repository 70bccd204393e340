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

/// Fails without the socket wait: the receiver slept on the condition variable and the I/O
/// thread, woken by the bytes, read the message and woke it (turns of the I/O thread counted).
/// With it, the I/O thread stays asleep: the receiver, woken by the bytes, reads them itself.
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
/// in the buffer are moved along by the receiver before it polls (and a read that leaves some
/// wakes the receivers in `poll`). Failed (a receive timed out with its message in the buffer)
/// with neither.
#[test]
fn frames_left_in_the_buffer_reach_a_receiver_waiting_on_the_socket() {
    many_distinct_tags(true);
}

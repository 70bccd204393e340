//! Tests of a receive whose buffer the read side fills in place: a peer that stops in the
//! middle of the payload leaves the receive to end at its deadline, and only once nothing can
//! write the buffer any more.

use std::io::Write;
use std::sync::mpsc;

use super::tests::{Pair, limits};
use super::*;

/// A peer sends a header and half of a 1 MiB payload into a receive posted for it, then
/// stalls: the receive ends (a timeout) after its deadline and the fill's grace, the half
/// that came is in the buffer (it was filled in place), and the rest, sent once the receive has
/// returned, never reaches the buffer (the connection was cut before the receive let go of
/// it). This is what the read side's writes through a posted buffer's pointer rely on
/// (`rx.rs`, `slots.rs`).
#[test]
fn a_receive_whose_peer_stalls_mid_message_lets_go_of_its_buffer_only_when_cut() {
    const LEN: usize = 1 << 20;
    let pair = Pair::new(limits(1 << 30, 1 << 20));
    let mut raw = pair.raw.try_clone().unwrap();
    let payload: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 | 1).collect();
    let (go, rest) = mpsc::channel::<()>();
    let (first, rest_of) = payload.split_at(LEN / 2);
    let (first, rest_of) = (first.to_vec(), rest_of.to_vec());
    let writer = std::thread::spawn(move || {
        // Lets the receive be posted first, so that the payload lands in its buffer.
        std::thread::sleep(Duration::from_millis(50));
        let h = FrameHeader {
            kind: FrameKind::Data,
            tag: 7,
            len: LEN as u64,
            meta: [7; 16],
        };
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(&first).unwrap();
        rest.recv().unwrap();
        // The connection is cut by now: this may fail.
        let _ = raw.write_all(&rest_of);
    });
    let mut buf = vec![0u8; LEN];
    let deadline = Instant::now() + Duration::from_secs(1);
    let r = pair
        .peer
        .recv(&mut buf, 7, deadline, &|| "recv tag 7".into());
    let e = r.unwrap_err();
    assert!(matches!(e, DistError::Timeout { .. }), "{e}");
    go.send(()).unwrap();
    writer.join().unwrap();
    // Gives a read side that still held the buffer time to write the rest into it.
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        buf[..LEN / 2] == payload[..LEN / 2],
        "the first half was not filled in place"
    );
    assert!(
        buf[LEN / 2..].iter().all(|&b| b == 0),
        "bytes landed in the buffer after its receive returned"
    );
}

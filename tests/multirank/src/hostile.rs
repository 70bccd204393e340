//! A hostile peer (issue 10, point 16): the last rank completes the real handshake, then floods
//! every other rank with abort notices and unexpected messages, sends each a malformed frame (a
//! length of 2^47 or 2^63, an unknown kind, a truncated header) and disappears. The honest ranks'
//! errors must name it; none panics, aborts or grows past the unexpected-message budget; they
//! still talk to each other afterwards.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use dist_core::{Backend, DistError, Tag};
use dist_tcp::DEFAULT_UNEXPECTED_LIMIT;
use dist_tcp::wire::{FrameHeader, FrameKind};

use dist_multirank::{self as common, fill, first_difference, join, seed};

use crate::flow::peak_rss;

const FLOOD_TAG: Tag = Tag::user(2);
const ATTACK_TAG: Tag = Tag::user(1);
const FLOOD_MSG: usize = 32 << 10;
/// Twice the budget, so that the reader must stop reading to stay within it.
const FLOOD_COUNT: u64 = (2 * DEFAULT_UNEXPECTED_LIMIT / FLOOD_MSG) as u64;
const ABORT_FLOOD: usize = 1000;
const SLACK: u64 = 32 << 20;

/// What the hostile rank sends rank `r` last, and what `r`'s error must say of it.
fn attack(r: usize) -> (Vec<u8>, String) {
    let header = |kind: u32, len: u64| {
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            tag: ATTACK_TAG.to_wire(),
            len,
            meta: [0; 16],
        }
        .encode();
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h.to_vec()
    };
    match r % 4 {
        0 => (
            header(1, 1 << 47),
            format!("Data frame of {} bytes", 1u64 << 47),
        ),
        1 => (
            header(1, 1 << 63),
            format!("Data frame of {} bytes", 1u64 << 63),
        ),
        2 => (header(9, 16), "unknown frame kind 9".into()),
        _ => (
            header(1, 16)[..17].to_vec(),
            "frame header (17 of 40 bytes)".into(),
        ),
    }
}

fn write_frame(
    s: &mut TcpStream,
    kind: FrameKind,
    tag: Tag,
    payload: &[u8],
) -> std::io::Result<()> {
    let h = FrameHeader {
        kind,
        tag: tag.to_wire(),
        len: payload.len() as u64,
        meta: [0; 16],
    };
    s.write_all(&h.encode())?;
    s.write_all(payload)
}

fn hostile(me: usize) {
    let streams = dist_tcp::testing::form_raw(&common::config()).unwrap_or_else(|e| panic!("{e}"));
    std::thread::scope(|s| {
        for (r, stream) in streams.into_iter().enumerate() {
            let Some(mut stream) = stream else { continue };
            s.spawn(move || {
                stream
                    .set_write_timeout(Some(Duration::from_secs(60)))
                    .unwrap();
                // Read (and drop) what the honest rank sends, its heartbeats: a socket closed
                // with unread bytes resets the connection, and a reset would discard the flood
                // still waiting in the honest rank's buffers.
                let mut drain = stream.try_clone().unwrap();
                drain
                    .set_read_timeout(Some(Duration::from_secs(60)))
                    .unwrap();
                let drainer = std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while matches!(drain.read(&mut buf), Ok(n) if n > 0) {}
                });
                for _ in 0..ABORT_FLOOD {
                    write_frame(
                        &mut stream,
                        FrameKind::Abort,
                        Tag::system(9),
                        b"hostile abort",
                    )
                    .unwrap();
                }
                let mut msg = vec![0u8; FLOOD_MSG];
                for k in 0..FLOOD_COUNT {
                    fill(&mut msg, seed(me, r, k));
                    write_frame(&mut stream, FrameKind::Data, FLOOD_TAG, &msg)
                        .unwrap_or_else(|e| panic!("flood message {k} to {r}: {e}"));
                }
                stream.write_all(&attack(r).0).unwrap();
                // Disappear: the honest rank closes the connection on the malformed frame,
                // which ends the drain.
                let _ = stream.shutdown(Shutdown::Write);
                let _ = drainer.join();
            });
        }
    });
}

/// The case: see the module's doc. Fails before the fixes of points 9 and 10: the honest rank
/// that gets 2^47 aborts allocating it, and the flooded ranks queue 2 x the budget.
pub fn peer() -> Result<(), String> {
    let cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    let h = n - 1;
    if me == h {
        hostile(me);
        return Ok(());
    }
    let b = join();
    let start = peak_rss();
    // The scenario: flooded while receiving nothing (for longer than the hostile rank takes to
    // send its flood, so that what arrives must be bounded by the budget, not by our reading).
    std::thread::sleep(Duration::from_secs(2));
    let mut msg = vec![0u8; FLOOD_MSG];
    for k in 0..FLOOD_COUNT {
        b.recv_tagged(&mut msg, h, FLOOD_TAG)
            .unwrap_or_else(|e| panic!("flood message {k}: {e}"));
        if let Some(at) = first_difference(&msg, seed(h, me, k)) {
            panic!("flood message {k}: wrong byte at offset {at}");
        }
    }
    let grown = peak_rss().saturating_sub(start);
    println!(
        "flooded with {} MiB: peak RSS grew by {} MiB",
        (FLOOD_COUNT * FLOOD_MSG as u64) >> 20,
        grown >> 20
    );
    assert!(
        grown <= DEFAULT_UNEXPECTED_LIMIT as u64 + SLACK,
        "peak RSS grew by {grown} bytes"
    );
    let notices = b.abort_notices();
    assert!(
        !notices.is_empty() && notices.len() <= 64,
        "{} abort notices kept",
        notices.len()
    );
    let err = b
        .recv_tagged_timeout(&mut [0u8; 4], h, ATTACK_TAG, Duration::from_secs(60))
        .expect_err("a receive from the hostile rank after its malformed frame");
    let want = attack(me).1;
    match &err {
        DistError::PeerGone {
            rank, peer, cause, ..
        } => {
            assert_eq!((*rank, *peer), (me, h), "{err}");
            assert!(cause.contains(&want), "{err}: expected {want:?}");
            if me % 4 < 3 {
                assert!(
                    cause.contains(&format!("protocol error from peer {h}")),
                    "{err}"
                );
            }
        }
        _ => panic!("expected the hostile peer gone, got {err}"),
    }
    println!("hostile peer named: {err}");
    // The honest ranks still talk to each other.
    if h >= 2 {
        let (to, from) = ((me + 1) % h, (me + h - 1) % h);
        let mut out = vec![0u8; 1 << 20];
        fill(&mut out, seed(me, to, 0));
        let mut inb = vec![0u8; 1 << 20];
        std::thread::scope(|s| {
            let sender = s.spawn(|| b.send(&out, to));
            b.recv(&mut inb, from).unwrap_or_else(|e| panic!("{e}"));
            sender.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        });
        assert_eq!(first_difference(&inb, seed(from, me, 0)), None);
    }
    Ok(())
}

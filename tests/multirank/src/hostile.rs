//! A hostile peer: the last rank completes the real handshake, then floods
//! every other rank with abort notices and unexpected messages, sends each a malformed frame (a
//! length of 2^47 or 2^63, an unknown kind, a truncated header) and disappears. The honest ranks'
//! errors must name it; none panics, aborts or grows past the unexpected-message budget; they
//! still talk to each other afterwards. Two more cases flood without ending in a protocol
//! error: heartbeats that each ask for an answer ([`asks`]), and doorbell bytes under a
//! shared-memory ring ([`doorbells`]).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp, Tag};
use dist_tcp::wire::{FrameHeader, FrameKind};
use dist_tcp::{DEFAULT_UNEXPECTED_LIMIT, FaultCause, PeerFault};

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

/// The most the hostile rank floods in the cases below: each honest rank ends its flood
/// when done with its checks.
const FLOOD_AT_MOST: Duration = Duration::from_secs(120);
const DONE_TAG: Tag = Tag::user(4);
const DURING_TAG: Tag = Tag::user(5);
/// The exchanges between honest ranks while it floods: one a [`ROUND_GAP`], over 3 s at least.
const ROUNDS: usize = 30;
const ROUND_GAP: Duration = Duration::from_millis(100);
/// What a flooded rank's peak RSS may grow by while the flood lasts: its read buffer and the
/// socket's, the liveness inbox (at most one answer and five faults per peer, each fault at
/// most an abort notice's 64 KiB), the exchanges' 1 MiB buffers, and the allocator's slack.
const FLOOD_RSS_BUDGET: u64 = 32 << 20;
/// How long a receive from the flooding rank waits, and how late it may end.
const SHORT_WAIT: Duration = Duration::from_millis(500);
const LATE: Duration = Duration::from_secs(2);
/// How many abort notices of one peer the fault hooks hear of (dist-tcp's
/// `ABORT_FAULTS_PER_PEER`).
const ABORT_FAULTS_PER_PEER: usize = 4;
const HONEST_TAG: Tag = Tag::user(3);

/// The honest ranks' side of a flood from rank `h`: every honest rank exchanges a message with
/// its neighbours among them each round (each is served), and a receive from `h` ends by its
/// deadline; the peak RSS grows by at most [`FLOOD_RSS_BUDGET`], and no honest rank is
/// reported faulty by another. Returns the faults heard of `h`.
fn flooded(b: &dist_tcp::TcpBackend, h: usize, what: &str) -> Vec<PeerFault> {
    let me = b.rank();
    let faults = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = faults.clone();
    b.on_peer_fault(move |f| seen.lock().unwrap().push(f.clone()));
    let start = peak_rss();
    let t = Instant::now();
    let mut out = vec![0u8; 1 << 20];
    let mut inb = vec![0u8; 1 << 20];
    let mut waits = Vec::new();
    for round in 0..ROUNDS {
        if h >= 2 {
            let (to, from) = ((me + 1) % h, (me + h - 1) % h);
            fill(&mut out, seed(me, to, round as u64));
            std::thread::scope(|s| {
                let sender = s.spawn(|| b.send_tagged(&out, to, HONEST_TAG));
                b.recv_tagged_timeout(&mut inb, from, HONEST_TAG, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("{what}: round {round} from rank {from}: {e}"));
                sender
                    .join()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{what}: round {round} to rank {to}: {e}"));
            });
            assert_eq!(
                first_difference(&inb, seed(from, me, round as u64)),
                None,
                "{what}: round {round} from rank {from}"
            );
        }
        if round % 10 == 5 {
            let w = Instant::now();
            let r = b.recv_tagged_timeout(&mut [0u8; 4], h, ATTACK_TAG, SHORT_WAIT);
            let took = w.elapsed();
            assert!(
                matches!(r, Err(DistError::Timeout { .. })),
                "{what}: a receive from the flooding rank {h}: {r:?}"
            );
            assert!(
                took <= SHORT_WAIT + LATE,
                "{what}: a receive from the flooding rank {h} with a {SHORT_WAIT:?} timeout \
                 ended after {took:?}"
            );
            waits.push(took);
        }
        std::thread::sleep(ROUND_GAP);
    }
    let grown = peak_rss().saturating_sub(start);
    println!(
        "{what}: {ROUNDS} rounds in {:?} while flooded; receives from the flooding rank ended \
         after {waits:?}; peak RSS grew by {} KiB",
        t.elapsed(),
        grown >> 10
    );
    assert!(
        grown <= FLOOD_RSS_BUDGET,
        "{what}: peak RSS grew by {grown} bytes while flooded (budget {FLOOD_RSS_BUDGET})"
    );
    let faults = faults.lock().unwrap().clone();
    for f in &faults {
        // An honest rank that was still forming its group when the hostile rank's first abort
        // notice arrived passes that notice on (the group's formation ends on any abort it
        // hears of), so another honest rank may hear of the hostile's text through it: that
        // names the honest rank as the sender, and is not a fault of its own.
        let relayed = matches!(&f.cause, FaultCause::Aborted(t) if t.contains("hostile abort"));
        assert!(
            f.peer == h || relayed,
            "{what}: honest rank {} reported faulty: {f}",
            f.peer
        );
    }
    faults
}

/// The frames of the ask flood: 40-byte heartbeats that each ask for one back, with an abort
/// notice naming call `k` after every 1,600.
fn ask_batch(k: u64) -> Vec<u8> {
    let mut meta = [0u8; 16];
    meta[8] = dist_tcp::wire::HEARTBEAT_ASK;
    let beat = FrameHeader {
        kind: FrameKind::Heartbeat,
        tag: 0,
        len: 0,
        meta,
    }
    .encode();
    let mut batch = Vec::with_capacity(1601 * beat.len() + 64);
    for _ in 0..1600 {
        batch.extend_from_slice(&beat);
    }
    let text = format!("hostile abort {k}");
    let mut meta = [0u8; 16];
    meta[8..].copy_from_slice(&(k + 1).to_le_bytes());
    let abort = FrameHeader {
        kind: FrameKind::Abort,
        tag: Tag::system(9).to_wire(),
        len: text.len() as u64,
        meta,
    }
    .encode();
    batch.extend_from_slice(&abort);
    batch.extend_from_slice(text.as_bytes());
    batch
}

/// A hostile rank (the last) streams heartbeats that each ask for an answer, and abort notices,
/// never reading what the honest ranks write back, until each honest rank, done with its
/// checks, closes the connection: each honest rank's peak RSS grows by at most
/// [`FLOOD_RSS_BUDGET`] meanwhile (the liveness thread's inbox holds one answer per peer, not
/// one per frame), the honest ranks still exchange messages, a receive from the hostile rank
/// ends by its deadline, and the fault hooks hear of at most [`ABORT_FAULTS_PER_PEER`] of its
/// notices.
pub fn asks() -> Result<(), String> {
    let cfg = common::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    let h = n - 1;
    if me == h {
        let streams = dist_tcp::testing::form_raw(&cfg).unwrap_or_else(|e| panic!("{e}"));
        std::thread::scope(|s| {
            for stream in streams.into_iter().flatten() {
                s.spawn(move || {
                    let mut stream = stream;
                    stream
                        .set_write_timeout(Some(Duration::from_secs(1)))
                        .unwrap();
                    let t = Instant::now();
                    let mut k = 0;
                    while t.elapsed() < FLOOD_AT_MOST {
                        match stream.write_all(&ask_batch(k)) {
                            Ok(()) => {}
                            // The honest rank reads no faster: go on.
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            // It closed the connection: done.
                            Err(_) => break,
                        }
                        k += 1;
                    }
                });
            }
        });
        return Ok(());
    }
    let b = join();
    let faults = flooded(&b, h, "ask flood");
    let aborted = faults
        .iter()
        .filter(|f| f.peer == h && matches!(f.cause, FaultCause::Aborted(_)))
        .count();
    println!("ask flood: the hooks heard of {aborted} abort notices of rank {h}");
    assert!(
        aborted <= ABORT_FAULTS_PER_PEER,
        "the hooks heard of {aborted} abort notices of rank {h}"
    );
    // Ends the flood.
    let sock = dist_tcp::testing::peer_socket(&b, h).expect("a connection to the hostile rank");
    let _ = sock.shutdown(Shutdown::Both);
    Ok(())
}

/// A hostile rank (the last), a real backend whose connections run over shared memory, floods
/// each honest rank's socket under its ring with doorbell bytes until every honest rank, done
/// with its checks, says so: the honest ranks' I/O threads still serve every other connection
/// (they exchange messages), a receive from the hostile rank ends by its deadline, peak RSS
/// stays within [`FLOOD_RSS_BUDGET`], a message the hostile rank sends through the ring while
/// it floods arrives (an I/O thread stuck draining the flood never read it), and so does one
/// after the flood.
pub fn doorbells() -> Result<(), String> {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let h = n - 1;
    let over_shm = (0..n).all(|p| p == me || b.shared_memory_with(p) == (true, true));
    // Every rank learns whether all of them talk over shared memory, and skips together if not.
    let mut all = [u8::from(over_shm)];
    b.all_reduce(&mut all, ReduceOp::Min)
        .unwrap_or_else(|e| panic!("{e}"));
    if all[0] == 0 {
        return Err("skipped: the ranks do not talk over shared memory here".into());
    }
    if me == h {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for r in 0..h {
                let mut sock = dist_tcp::testing::peer_socket(&b, r).expect("a connection");
                let stop = &stop;
                s.spawn(move || {
                    sock.set_write_timeout(Some(Duration::from_secs(1)))
                        .unwrap();
                    let chunk = [0u8; 64 << 10];
                    let t = Instant::now();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && t.elapsed() < FLOOD_AT_MOST
                    {
                        let _ = sock.write_all(&chunk);
                    }
                });
            }
            // A message through the ring while the flood lasts: the flooded rank's I/O
            // thread must read it.
            for r in 0..h {
                b.send_tagged(b"during the flood", r, DURING_TAG)
                    .unwrap_or_else(|e| panic!("to {r}: {e}"));
            }
            for r in 0..h {
                b.recv_tagged_timeout(&mut [0u8; 4], r, DONE_TAG, FLOOD_AT_MOST)
                    .unwrap_or_else(|e| panic!("rank {r} done: {e}"));
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        for r in 0..h {
            b.send_tagged(b"after the flood", r, ATTACK_TAG)
                .unwrap_or_else(|e| panic!("to {r}: {e}"));
        }
    } else {
        flooded(&b, h, "doorbell flood");
        // Still flooded (the flood ends when this rank says it is done).
        let mut during = [0u8; 16];
        let t = Instant::now();
        b.recv_tagged_timeout(&mut during, h, DURING_TAG, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("the message during the flood: {e}"));
        assert_eq!(&during, b"during the flood");
        println!(
            "doorbell flood: the message during the flood taken {:?} after its receive began",
            t.elapsed()
        );
        b.send_tagged(b"done", h, DONE_TAG)
            .unwrap_or_else(|e| panic!("done: {e}"));
        let mut after = [0u8; 15];
        b.recv_tagged_timeout(&mut after, h, ATTACK_TAG, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("the message after the flood: {e}"));
        assert_eq!(&after, b"after the flood");
    }
    b.barrier().unwrap_or_else(|e| panic!("{e}"));
    Ok(())
}

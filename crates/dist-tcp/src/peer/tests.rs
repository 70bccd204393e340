//! Tests of one peer's read side against a loopback socket whose other end the test writes.

use std::cell::Cell;
use std::io::Write;
use std::net::TcpListener;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::*;

thread_local! {
    /// Set by a test: the next receive's wait on this thread panics as it starts.
    pub(super) static PANIC_IN_WAIT: Cell<bool> = const { Cell::new(false) };
}

const RANK: usize = 1;

/// A peer (rank 1 as seen from rank 0) over loopback TCP driven by an I/O thread of its own,
/// and the raw other end, on which a test writes whatever bytes it likes.
pub(super) struct Pair {
    pub(super) peer: Arc<Peer>,
    pub(super) raw: TcpStream,
    io: IoThread,
}

impl Pair {
    /// As [`Pair::new`], with receivers that do not spin: they wait on the socket themselves
    /// (`poll_wait.rs`) when `on_socket`, as on an oversubscribed host.
    pub(super) fn waiting(limits: Limits, on_socket: bool) -> Pair {
        let p = Pair::new(limits);
        if on_socket {
            p.peer.set_spin(Duration::ZERO);
        }
        p
    }

    pub(super) fn new(limits: Limits) -> Pair {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let peer = Arc::new(
            Peer::connected(
                0,
                RANK,
                s,
                Duration::from_secs(10),
                Arc::new(Aborts::default()),
                limits,
            )
            .unwrap(),
        );
        let io = IoThread::spawn("test-io".into()).unwrap();
        io.adopt(&peer);
        Pair { peer, raw, io }
    }

    pub(super) fn frame(&mut self, kind: u32, tag: u64, len: u64, payload: &[u8]) {
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len,
            meta: [tag as u8; 16],
        }
        .encode();
        h[..4].copy_from_slice(&kind.to_le_bytes());
        self.raw.write_all(&h).unwrap();
        self.raw.write_all(payload).unwrap();
    }

    pub(super) fn recv(&self, buf: &mut [u8], tag: u64) -> Result<Meta> {
        let deadline = Instant::now() + Duration::from_secs(10);
        self.peer
            .recv(buf, tag, deadline, &|| format!("recv tag {tag}"))
    }

    fn queued_bytes(&self) -> usize {
        self.peer.lock().queued_bytes
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = self.raw.shutdown(Shutdown::Both);
        self.peer.shutdown(Shutdown::Both);
        self.io.stop();
    }
}

pub(super) fn limits(max_message: u64, unexpected: usize) -> Limits {
    Limits {
        max_message,
        unexpected,
        sealed: false,
    }
}

/// A posted receive is withdrawn on every exit path, unwinding included. Fails before the fix: the
/// guard was disarmed before the wait, so the receive stayed posted after the panic and the reader
/// wrote the message into `buf`, whose borrow had ended (here a live `Vec`, so the write is
/// visible, not a crash).
#[test]
fn a_receive_whose_wait_unwinds_is_withdrawn() {
    let mut pair = Pair::new(limits(1 << 30, 1 << 20));
    let mut buf = vec![0u8; 8];
    let r = catch_unwind(AssertUnwindSafe(|| {
        PANIC_IN_WAIT.with(|p| p.set(true));
        pair.recv(&mut buf, 7)
    }));
    assert!(r.is_err(), "the injected panic unwound out of recv");
    pair.frame(1, 7, 8, &[9; 8]);
    // The message must now be queued, not written into `buf`.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pair.peer.peek(7).is_none() && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(buf, [0; 8], "the reader wrote into a withdrawn buffer");
    assert_eq!(pair.peer.peek(7), Some((8, [7; 16])));
    let mut again = [0u8; 8];
    assert_eq!(pair.recv(&mut again, 7).unwrap(), [7; 16]);
    assert_eq!(again, [9; 8]);
}

/// A posted receive whose holder panics (in the send beside it) is withdrawn by the handle's
/// drop as the panic unwinds.
#[test]
fn a_receive_whose_send_unwinds_is_withdrawn() {
    let mut pair = Pair::new(limits(1 << 30, 1 << 20));
    let mut buf = vec![0u8; 8];
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the handle is dropped by the unwinding below; it is never leaked.
        let posted = unsafe { pair.peer.post(&mut buf, 7, deadline, None) };
        assert!(
            posted.id().is_some(),
            "nothing was queued: the receive is posted"
        );
        panic!("injected: a panic in the send beside a receive")
    }));
    assert!(r.is_err());
    pair.frame(1, 7, 8, &[9; 8]);
    while pair.peer.peek(7).is_none() && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(buf, [0; 8]);
    assert_eq!(pair.peer.peek(7), Some((8, [7; 16])));
}

/// What a receive from a peer that sent `bytes` fails with.
fn after(bytes: &[u8], max_message: u64) -> DistError {
    let mut pair = Pair::new(limits(max_message, 1 << 20));
    pair.raw.write_all(bytes).unwrap();
    pair.raw.shutdown(Shutdown::Write).unwrap();
    let mut buf = [0u8; 4];
    pair.recv(&mut buf, 3).unwrap_err()
}

fn header(kind: u32, len: u64) -> Vec<u8> {
    let mut h = FrameHeader {
        kind: FrameKind::Data,
        tag: 3,
        len,
        meta: [0; 16],
    }
    .encode();
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h.to_vec()
}

fn gone_cause(e: DistError) -> String {
    match e {
        DistError::PeerGone {
            rank, peer, cause, ..
        } => {
            assert_eq!((rank, peer), (0, RANK));
            cause
        }
        e => panic!("expected PeerGone, got {e}"),
    }
}

/// Frame lengths from the wire are capped. Fails before the fix: a 2^47-byte frame was queued with
/// `vec![0; 2^47]`, which aborts the process (allocation failure), and 2^63 the same.
#[test]
fn frames_over_the_cap_are_protocol_errors_naming_the_peer() {
    for len in [1u64 << 47, 1 << 63, u64::MAX, (1 << 20) + 1] {
        let cause = gone_cause(after(&header(1, len), 1 << 20));
        assert!(cause.contains("protocol error from peer 1"), "{cause}");
        assert!(cause.contains(&format!("{len} bytes")), "{cause}");
        assert!(cause.contains("limit of 1048576 bytes"), "{cause}");
    }
    // An abort notice longer than 64 KiB is refused as well.
    let cause = gone_cause(after(&header(2, 1 << 20), 1 << 30));
    assert!(cause.contains("Abort frame of 1048576 bytes"), "{cause}");
}

#[test]
fn unknown_kinds_and_truncated_frames_close_the_connection() {
    let cause = gone_cause(after(&header(9, 4), 1 << 20));
    assert!(
        cause.contains("protocol error from peer 1: unknown frame kind 9"),
        "{cause}"
    );
    let cause = gone_cause(after(&header(1, 4)[..17], 1 << 20));
    assert!(cause.contains("frame header (17 of 40 bytes)"), "{cause}");
    let mut cut = header(1, 4);
    cut.extend_from_slice(&[1, 2]);
    let cause = gone_cause(after(&cut, 1 << 20));
    assert!(cause.contains("closed mid-message"), "{cause}");
}

/// Flow control, in one process. Fails before the fix: every unexpected message was
/// queued (`queued_bytes` had no bound; here it reached 16 MiB), and a message larger than
/// the bound was queued whole.
#[test]
fn unexpected_messages_are_bounded_and_larger_ones_still_arrive() {
    const LIMIT: usize = 1 << 20;
    const PIECE: usize = 64 << 10;
    const COUNT: usize = 256;
    let mut pair = Pair::new(limits(1 << 30, LIMIT));
    let mut raw = pair.raw.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        // One message larger than the whole budget, then many small ones.
        let big: Vec<u8> = (0..4 * LIMIT).map(|i| (i % 251) as u8).collect();
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            tag: 5,
            len: big.len() as u64,
            meta: [5; 16],
        };
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(&big).unwrap();
        h.tag = 6;
        h.len = PIECE as u64;
        for k in 0..COUNT {
            raw.write_all(&h.encode()).unwrap();
            raw.write_all(&vec![k as u8; PIECE]).unwrap();
        }
    });
    // Let the reader run into the bound while nothing is posted: the writer blocks.
    std::thread::sleep(Duration::from_millis(300));
    assert!(pair.queued_bytes() <= LIMIT, "{}", pair.queued_bytes());
    let mut big = vec![0u8; 4 * LIMIT];
    pair.recv(&mut big, 5).unwrap();
    assert!(big.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    let mut buf = vec![0u8; PIECE];
    let mut peak = 0;
    for k in 0..COUNT {
        peak = peak.max(pair.queued_bytes());
        pair.recv(&mut buf, 6).unwrap();
        assert!(buf.iter().all(|b| *b == k as u8), "message {k}");
    }
    assert!(peak <= LIMIT, "{peak}");
    writer.join().unwrap();
    pair.frame(1, 6, 0, &[]);
}

/// Review finding 1. Fails before the fix (t1 times out after 3 s): a frame held for flow
/// control by a spinner (not the reader thread, now the I/O thread) was never re-routed when the
/// budget freed, while the reader sat in `peek` on a socket whose bytes were already in `rx.buf`.
#[test]
fn review_held_by_spinner_lost_wake() {
    held_by_spinner_lost_wake(false);
}

/// [`review_held_by_spinner_lost_wake`], with receivers waiting on the socket themselves when
/// `on_socket` (`poll_wait_tests.rs`).
pub(super) fn held_by_spinner_lost_wake(on_socket: bool) {
    // Room for one 100-byte message, not two.
    let mut pair = Pair::waiting(limits(1 << 30, 100 + QUEUED_OVERHEAD + 50), on_socket);
    pair.frame(1, 1, 100, &[1; 100]);
    let t = Instant::now();
    while pair.queued_bytes() != 100 + QUEUED_OVERHEAD && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pair.queued_bytes(), 100 + QUEUED_OVERHEAD);
    // T0 sleeps on tag 5 forever: the I/O thread watches the socket.
    let p0 = pair.peer.clone();
    let t0 = std::thread::spawn(move || {
        let mut b = [0u8; 10];
        let d = Instant::now() + Duration::from_secs(8);
        let _ = p0.recv(&mut b, 5, d, &|| "t0".into());
    });
    std::thread::sleep(Duration::from_millis(200));
    // Act as a spinner: M1 (tag 2, does not fit) then M2 (tag 3), in one write.
    let mut bytes = Vec::new();
    for (tag, len) in [(2u64, 100usize), (3, 10)] {
        bytes.extend_from_slice(
            &FrameHeader {
                kind: FrameKind::Data,
                tag,
                len: len as u64,
                meta: [0; 16],
            }
            .encode(),
        );
        bytes.extend(std::iter::repeat_n(tag as u8, len));
    }
    pair.peer.spinners.fetch_add(1, Ordering::AcqRel);
    pair.raw.write_all(&bytes).unwrap();
    let rx = pair.peer.rx().unwrap();
    let t = Instant::now();
    let mut held = false;
    while t.elapsed() < Duration::from_secs(2) {
        if let Ok(mut r) = rx.try_lock()
            && let Step::Held(..) = pair.peer.progress(&mut r)
        {
            held = true;
            break;
        }
    }
    pair.peer.spinners.fetch_sub(1, Ordering::AcqRel);
    assert!(held);
    let reader_knows = pair.peer.lock().reader_holding;
    eprintln!("reader holding after spinner got Held: {reader_knows}");
    // T1 receives tag 3 (behind M1); then the queue drains, which should let M1 queue and M2 land.
    let p1 = pair.peer.clone();
    let t1 = std::thread::spawn(move || {
        let mut b = [0u8; 10];
        let d = Instant::now() + Duration::from_secs(3);
        let s = Instant::now();
        let r = p1.recv(&mut b, 3, d, &|| "t1".into());
        (r.map(|_| b), s.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    let mut b = [0u8; 100];
    pair.recv(&mut b, 1).unwrap();
    let (r, took) = t1.join().unwrap();
    eprintln!("t1: {r:?} after {took:?}");
    assert!(
        r.is_ok(),
        "lost wake: tag 3 never delivered after the budget freed ({took:?})"
    );
    drop(pair);
    let _ = t0.join();
}

/// Review finding 2. Fails before the fix (a Timeout after 3 s, then `Pair::drop` hangs on the
/// reader): while a frame was held for flow control nothing read the socket, so a peer that
/// hung up mid-message was never noticed.
#[test]
fn a_connection_that_dies_while_a_frame_is_held_is_gone() {
    let mut pair = Pair::new(limits(1 << 30, 100 + QUEUED_OVERHEAD + 50));
    pair.frame(1, 1, 100, &[1; 100]);
    let t = Instant::now();
    while pair.queued_bytes() != 100 + QUEUED_OVERHEAD && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // A second message does not fit: it is held. The peer dies after half its payload.
    let mut h = header(1, 100);
    h.extend_from_slice(&[2; 50]);
    pair.raw.write_all(&h).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    pair.raw.shutdown(Shutdown::Write).unwrap();
    let mut buf = [0u8; 4];
    let d = Instant::now() + Duration::from_secs(3);
    let e = pair
        .peer
        .recv(&mut buf, 9, d, &|| "recv tag 9".into())
        .unwrap_err();
    let cause = gone_cause(e);
    assert!(cause.contains("closed mid-message"), "{cause}");
}

/// Review finding 6. Fails before the fix: the queue kept an empty deque for every tag ever
/// received (the map never shrank), and 1-byte messages on fresh tags were charged 64 bytes
/// each, far less than the memory their entries take.
#[test]
fn messages_on_many_distinct_tags_stay_within_the_budget_and_leave_no_entries() {
    many_distinct_tags(false);
}

/// [`messages_on_many_distinct_tags_stay_within_the_budget_and_leave_no_entries`], with
/// receivers waiting on the socket themselves when `on_socket` (`poll_wait_tests.rs`).
pub(super) fn many_distinct_tags(on_socket: bool) {
    const LIMIT: usize = 64 << 10;
    let pair = Pair::waiting(limits(1 << 30, LIMIT), on_socket);
    let mut raw = pair.raw.try_clone().unwrap();
    const N: u64 = 2000;
    let writer = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        for tag in 100..100 + N {
            let h = FrameHeader {
                kind: FrameKind::Data,
                tag,
                len: 1,
                meta: [0; 16],
            };
            bytes.extend_from_slice(&h.encode());
            bytes.push(tag as u8);
        }
        raw.write_all(&bytes).unwrap();
    });
    std::thread::sleep(Duration::from_millis(300));
    // Each queued message is charged at least 256 bytes: at most LIMIT/257 of them are queued.
    let entries = pair.peer.lock().queued.len();
    assert!(entries <= LIMIT / 257, "{entries} messages queued");
    assert!(pair.queued_bytes() <= LIMIT, "{}", pair.queued_bytes());
    let mut b = [0u8; 1];
    for tag in 100..100 + N {
        pair.recv(&mut b, tag).unwrap();
        assert_eq!(b[0], tag as u8);
    }
    writer.join().unwrap();
    assert_eq!(
        pair.peer.lock().queued.len(),
        0,
        "emptied tags left entries"
    );
    assert_eq!(pair.queued_bytes(), 0);
}

/// Review finding 3. Fails before the fix: the send waited on `SO_SNDTIMEO` (here 10 s per
/// write) whatever its deadline, and a second send waited for the writer lock behind it.
#[test]
fn a_send_to_a_peer_that_does_not_read_ends_by_its_deadline() {
    let pair = Pair::new(limits(1 << 30, 1 << 20));
    let p = pair.peer.clone();
    let big = std::thread::spawn(move || {
        let data = vec![0u8; 64 << 20];
        let s = Instant::now();
        let d = s + Duration::from_millis(800);
        let r = p.send(FrameKind::Data, 1, &data, [0; 16], &|| "big send".into(), d);
        (r, s.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    let s = Instant::now();
    let d = s + Duration::from_millis(200);
    let r = pair.peer.send(
        FrameKind::Data,
        2,
        &[1; 8],
        [0; 16],
        &|| "small send".into(),
        d,
    );
    let took = s.elapsed();
    match r {
        Err(DistError::Timeout { op, peer, .. }) => {
            assert_eq!(peer, RANK);
            assert!(
                op.contains("small send") && op.contains("behind another send"),
                "{op}"
            );
        }
        r => panic!("expected a Timeout, got {r:?}"),
    }
    assert!(took < Duration::from_secs(2), "{took:?}");
    let (r, took) = big.join().unwrap();
    match r {
        Err(DistError::Timeout { op, .. }) => {
            assert!(
                op.contains("big send") && op.contains(" of 67108904 bytes sent"),
                "{op}"
            )
        }
        r => panic!("expected a Timeout, got {r:?}"),
    }
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// Review finding 4. Fails before the fix: a peer flooding frames (abort notices here) made
/// every pass of `send_while_receiving`'s spin loop count as progress, so it spun past its
/// deadline for as long as the flood lasted (then blocked on `SO_SNDTIMEO`, 10 s).
#[test]
fn a_send_while_receiving_under_a_flood_ends_by_its_deadline() {
    let pair = Pair::new(limits(1 << 30, 1 << 20));
    let mut raw = pair.raw.try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let flood = std::thread::spawn(move || {
        let mut f = header(2, 4096);
        f.extend_from_slice(&[b'x'; 4096]);
        let t = Instant::now();
        while !flag.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(8) {
            if raw.write_all(&f).is_err() {
                break;
            }
        }
    });
    let data = vec![0u8; 64 << 20];
    let mut buf = [0u8; 8];
    let s = Instant::now();
    let d = s + Duration::from_secs(1);
    let peer = pair.peer.clone();
    // SAFETY: the handle is waited on or dropped below; it is never leaked.
    let posted = unsafe { pair.peer.post(&mut buf, 5, d, None) };
    let r = peer
        .send_while_receiving(
            5,
            &data,
            [0; 16],
            &|| "send".into(),
            &peer,
            posted.id().unwrap(),
            d,
        )
        .and_then(|()| posted.wait());
    let took = s.elapsed();
    stop.store(true, Ordering::Relaxed);
    assert!(matches!(r, Err(DistError::Timeout { .. })), "{r:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let _ = pair.raw.shutdown(Shutdown::Both);
    flood.join().unwrap();
}

/// Many ranks on one host: a quiet connection's read side waits for the socket
/// instead of waking every IDLE_DRAIN. Fails before the change: over 2 s of quiet the reader
/// thread looked at its state about 100 times (every 20 ms); with the reader thread's IDLE_POLL
/// about 13; on the I/O thread about 6 (every IDLE_DRAIN until IDLE_QUIET, then none: a quiet
/// socket has no timer). A frame arriving meanwhile is still drained and received.
#[test]
fn a_quiet_reader_waits_for_the_socket() {
    let mut p = Pair::new(limits(1 << 20, 1 << 20));
    let quiet = Duration::from_secs(2);
    std::thread::sleep(quiet);
    let turns = p.peer.reader_turns.load(Ordering::Relaxed);
    let every_drain = (quiet.as_millis() / IDLE_DRAIN.as_millis()) as u64;
    let until_quiet = (IDLE_QUIET.as_millis() / IDLE_DRAIN.as_millis()) as u64;
    assert!(
        turns <= until_quiet + 4,
        "the read side looked {turns} times in {quiet:?} of quiet (every IDLE_DRAIN would be \
         {every_drain}; until IDLE_QUIET only, {until_quiet})"
    );
    p.frame(1, 7, 3, b"abc");
    let mut buf = [0u8; 3];
    p.recv(&mut buf, 7).unwrap();
    assert_eq!(&buf, b"abc");
}

/// The read buffer starts small, stays small while what arrives fits, doubles (up to RX_BUF)
/// when a read fills it, and keeps every byte in order through each growth.
#[test]
fn the_read_buffer_grows_only_for_a_busy_connection() {
    let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut rx = Rx {
        sock: Source::Script(Script {
            bytes: bytes.clone(),
            ..Script::default()
        }),
        buf: vec![0u8; RX_BUF_MIN].into_boxed_slice(),
        lo: 0,
        hi: 0,
        frame: Frame::Header,
        dead: false,
        stopped_early: false,
        held_unread: 0,
    };
    // A trickle (100 bytes at a time, consumed at once) never grows it.
    let mut got = Vec::new();
    for _ in 0..10 {
        if let Source::Script(s) = &mut rx.sock {
            s.available += 100;
        }
        assert_eq!(rx.read_more().unwrap(), 100);
        got.extend_from_slice(&rx.buf[rx.lo..rx.hi]);
        rx.lo = rx.hi;
    }
    assert_eq!(rx.buf.len(), RX_BUF_MIN);
    // A flood: every read fills the buffer, which doubles up to RX_BUF and no further; bytes
    // left unread across a growth are kept.
    if let Source::Script(s) = &mut rx.sock {
        s.available = bytes.len();
    }
    let mut sizes = Vec::new();
    while got.len() < bytes.len() {
        let n = rx.read_more().unwrap();
        assert!(n > 0);
        // Take all but the last 3 bytes, which stay for the next read.
        let take = (rx.hi - rx.lo).saturating_sub(3).max(1);
        got.extend_from_slice(&rx.buf[rx.lo..rx.lo + take]);
        rx.lo += take;
        sizes.push(rx.buf.len());
        if rx.hi - rx.lo > 0 && got.len() + (rx.hi - rx.lo) == bytes.len() {
            got.extend_from_slice(&rx.buf[rx.lo..rx.hi]);
            rx.lo = rx.hi;
        }
    }
    assert_eq!(got, bytes);
    assert_eq!(*sizes.iter().max().unwrap(), RX_BUF);
    assert!(
        sizes.windows(2).all(|w| w[1] == w[0] || w[1] == 2 * w[0]),
        "{sizes:?}"
    );
}

/// A peer's abort text is kept within [`ABORT_MAX`] bytes however it is made: invalid UTF-8
/// (each bad byte becomes a three-byte U+FFFD) is cut back at a character boundary, and valid
/// text is kept as it came. Fails with the text kept as `from_utf8_lossy` made it (three times
/// the bound for a frame of `0xFF` bytes).
#[test]
fn an_abort_text_is_kept_within_its_bound() {
    let bad = super::rx::bounded_text(&vec![0xFF; ABORT_MAX]);
    assert!(
        bad.len() <= ABORT_MAX && bad.len() > ABORT_MAX - 3,
        "{}",
        bad.len()
    );
    assert!(bad.chars().all(|c| c == char::REPLACEMENT_CHARACTER));
    let good = "peer 3 gone: é".repeat(100);
    assert_eq!(super::rx::bounded_text(good.as_bytes()), good);
}

//! Property tests of the frame decoder and of the receive state machine,
//! driven from bytes with no socket: frames cut at random points, posts, arrivals and takes
//! interleaved at random.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

const UNEXPECTED: usize = 128 << 10;

fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7 + j / 251) as u8).collect()
}

fn stream(msgs: &[(u64, usize)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, &(tag, len)) in msgs.iter().enumerate() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len: len as u64,
            meta: [i as u8; 16],
        };
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(&payload(i, len));
    }
    out
}

/// A peer (rank 1 seen from rank 0) whose read side reads `bytes` as a test makes them
/// available.
fn scripted(bytes: Vec<u8>, limits: Limits) -> Peer {
    let p = Peer::bare(
        0,
        1,
        Duration::from_secs(1),
        Arc::new(Aborts::default()),
        limits,
        None,
    );
    // Writer and stream are never used here: unconnected sockets stand in for them.
    let sock = || socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let conn = Conn {
        writer: WriterLock::new(Writer::new(sock(), None)),
        shm: (false, false),
        pollable: false,
        rx: Mutex::new(Rx {
            sock: Source::Script(Script {
                bytes,
                ..Script::default()
            }),
            buf: vec![0u8; RX_BUF_MIN].into_boxed_slice(),
            lo: 0,
            hi: 0,
            frame: Frame::Header,
            dead: false,
            stopped_early: false,
            held_unread: 0,
        }),
        stream: TcpStream::from(sock()),
    };
    assert!(p.conn.set(Box::new(conn)).is_ok());
    p
}

fn rx(p: &Peer) -> MutexGuard<'_, Rx> {
    p.rx().unwrap().lock().unwrap()
}

fn feed(p: &Peer, n: usize, eof: bool) {
    if let Source::Script(s) = &mut rx(p).sock {
        s.available = (s.available + n).min(s.bytes.len());
        s.eof = eof;
    }
}

fn step(p: &Peer) -> Step {
    let mut r = rx(p);
    let s = p.progress(&mut r);
    if let Step::Closed(cause) = &s {
        p.shut(&mut r, cause.clone());
    }
    s
}

/// The budget holds, and its count matches what is queued (and what is being read to queue).
fn check_budget(p: &Peer) -> std::result::Result<(), TestCaseError> {
    let reading = match &rx(p).frame {
        Frame::Queue { data, .. } => data.len() + QUEUED_OVERHEAD,
        _ => 0,
    };
    let st = p.lock();
    let counted: usize = st
        .queued
        .values()
        .flatten()
        .filter(|q| q.counted)
        .map(|q| q.data.len() + QUEUED_OVERHEAD)
        .sum::<usize>()
        + reading;
    prop_assert_eq!(counted, st.queued_bytes);
    prop_assert!(st.queued_bytes <= UNEXPECTED, "{} queued", st.queued_bytes);
    Ok(())
}

#[derive(Clone, Debug)]
enum Op {
    /// Make this many more bytes of the stream available.
    Feed(usize),
    /// Post the next receive on this tag.
    Post(u64),
    /// Run the read side.
    Progress,
    /// Take the oldest receive on this tag if it is done.
    Take(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..80_000).prop_map(Op::Feed),
        (0u64..3).prop_map(Op::Post),
        Just(Op::Progress),
        Just(Op::Progress),
        (0u64..3).prop_map(Op::Take),
    ]
}

fn msg_len() -> impl Strategy<Value = usize> {
    // Small; around the 64 KiB grace and read-buffer size; larger than the whole budget.
    prop_oneof![0usize..100, 60_000usize..70_000, 100_000usize..300_000]
}

/// The receive side of one tag in the model: messages in order, receives posted and taken.
#[derive(Default)]
struct TagState {
    msgs: Vec<usize>,
    posted: usize,
    outstanding: VecDeque<(u64, usize, Vec<u8>)>,
    received: usize,
}

struct Model<'a> {
    peer: &'a Peer,
    msgs: &'a [(u64, usize)],
    tags: Vec<TagState>,
}

impl Model<'_> {
    fn verify(&self, i: usize, meta: Meta, buf: &[u8]) -> std::result::Result<(), TestCaseError> {
        prop_assert_eq!(meta, [i as u8; 16], "message {} came out of order", i);
        prop_assert!(
            buf == payload(i, self.msgs[i].1).as_slice(),
            "message {} corrupted",
            i
        );
        Ok(())
    }

    fn post(&mut self, tag: u64) -> std::result::Result<(), TestCaseError> {
        let t = &mut self.tags[tag as usize];
        let Some(&i) = t.msgs.get(t.posted) else {
            return Ok(());
        };
        t.posted += 1;
        let mut buf = vec![0xEE; self.msgs[i].1];
        let mut st = self.peer.lock();
        match st.take_queued(tag, &mut buf) {
            Some(Ok(meta)) => {
                drop(st);
                self.tags[tag as usize].received += 1;
                self.verify(i, meta, &buf)?;
            }
            Some(Err(len)) => prop_assert!(false, "size mismatch: {} queued", len),
            None => {
                // SAFETY: the buffer's heap block stays put while the `Vec` moves into the
                // model, which keeps it, untouched, until the receive is taken; if the case
                // fails first, the read side is never run again.
                let id = unsafe { st.post(tag, buf.as_mut_ptr(), buf.len()) };
                drop(st);
                self.tags[tag as usize].outstanding.push_back((id, i, buf));
            }
        }
        Ok(())
    }

    /// Takes the done receives at the front of `tag`'s posted ones.
    fn take(&mut self, tag: u64) -> std::result::Result<(), TestCaseError> {
        while let Some((id, _, _)) = self.tags[tag as usize].outstanding.front() {
            let done = self.peer.lock().take_done(*id);
            match done {
                None => return Ok(()),
                Some(Outcome::Delivered(meta)) => {
                    let (_, i, buf) = self.tags[tag as usize].outstanding.pop_front().unwrap();
                    self.tags[tag as usize].received += 1;
                    self.verify(i, meta, &buf)?;
                }
                Some(Outcome::Mismatch(n)) => {
                    return Err(TestCaseError::fail(format!("mismatch {n}")));
                }
                Some(Outcome::Gone(c)) => return Err(TestCaseError::fail(c)),
            }
        }
        Ok(())
    }

    fn all_received(&self) -> bool {
        self.tags.iter().all(|t| t.received == t.msgs.len())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any 40 bytes decode to a header or an error, never a panic; a decoded header encodes
    /// back to the same bytes.
    #[test]
    fn frame_headers_decode_or_fail_cleanly(raw in prop::array::uniform32(any::<u8>()), tail in any::<[u8; 8]>()) {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[..32].copy_from_slice(&raw);
        b[32..].copy_from_slice(&tail);
        if let Ok(h) = FrameHeader::decode(&b) {
            prop_assert_eq!(h.encode(), b);
        }
        // A known kind and no flags always decode.
        b[..8].copy_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        prop_assert!(FrameHeader::decode(&b).is_ok());
    }

    /// Messages on three tags, cut at random points, with posts, progress and takes in random
    /// order: every message reaches the receive posted for it, in order per tag, intact; the
    /// queue never holds more than the budget; nothing panics.
    #[test]
    fn receives_match_messages_in_order_within_the_budget(
        msgs in prop::collection::vec((0u64..3, msg_len()), 0..12),
        ops in prop::collection::vec(op(), 0..80),
    ) {
        let bytes = stream(&msgs);
        let total = bytes.len();
        let peer = scripted(bytes, Limits { max_message: 1 << 30, unexpected: UNEXPECTED, sealed: false });
        let mut m = Model { peer: &peer, msgs: &msgs, tags: (0..3).map(|_| TagState::default()).collect() };
        for (i, &(tag, _)) in msgs.iter().enumerate() {
            m.tags[tag as usize].msgs.push(i);
        }
        for op in ops {
            match op {
                Op::Feed(n) => feed(&peer, n, false),
                Op::Post(t) => m.post(t)?,
                Op::Progress => {
                    if let Step::Closed(c) = step(&peer) {
                        prop_assert!(false, "closed: {}", c);
                    }
                }
                Op::Take(t) => m.take(t)?,
            }
            check_budget(&peer)?;
        }
        // Then everything arrives, every receive is posted, and all must complete.
        feed(&peer, total, true);
        for _ in 0..10_000 {
            if m.all_received() {
                break;
            }
            for t in 0..3 {
                while m.tags[t as usize].posted < m.tags[t as usize].msgs.len() {
                    m.post(t)?;
                }
            }
            let s = step(&peer);
            for t in 0..3 {
                m.take(t)?;
            }
            check_budget(&peer)?;
            if let Step::Closed(c) = s {
                prop_assert!(m.all_received(), "closed early: {}", c);
            }
        }
        prop_assert!(m.all_received());
    }

    /// Valid frames followed by garbage, cut anywhere: the read side ends with a protocol error
    /// naming the peer or the stream's end, never a panic, never past the budget.
    #[test]
    fn garbage_after_frames_is_a_clean_error(
        msgs in prop::collection::vec((0u64..3, 0usize..5000), 0..6),
        garbage in prop::collection::vec(any::<u8>(), 1..200),
        cuts in prop::collection::vec(1usize..3000, 1..20),
    ) {
        let mut bytes = stream(&msgs);
        bytes.extend_from_slice(&garbage);
        let peer = scripted(bytes, Limits { max_message: 1 << 20, unexpected: UNEXPECTED, sealed: false });
        for n in cuts {
            feed(&peer, n, false);
            step(&peer);
            check_budget(&peer)?;
        }
        feed(&peer, usize::MAX / 2, true);
        let mut end = None;
        for _ in 0..1000 {
            if let Step::Closed(c) = step(&peer) {
                end = Some(c);
                break;
            }
        }
        check_budget(&peer)?;
        if let Some(c) = end {
            prop_assert!(c.contains("peer 1") || c.contains("closed"), "{}", c);
        }
    }
}

/// A connection that carries only frames larger than its read buffer keeps the buffer at its
/// first size (each read that fills it holds one frame's header and the start of its payload,
/// the rest of which goes straight to the posted buffer), and a connection of small frames
/// back to back still grows it. Before, every read that filled the buffer doubled it, up to
/// RX_BUF: 64 KiB on every connection that carried a large message.
#[test]
fn the_read_buffer_does_not_grow_for_large_frames() {
    let msgs: Vec<(u64, usize)> = (0..6).map(|_| (0, 100_000)).collect();
    let p = scripted(
        stream(&msgs),
        Limits {
            max_message: 1 << 30,
            unexpected: 1 << 20,
            sealed: false,
        },
    );
    let mut bufs: Vec<Vec<u8>> = msgs.iter().map(|&(_, len)| vec![0u8; len]).collect();
    let mut ids = Vec::new();
    for b in &mut bufs {
        // SAFETY: each buffer stays in `bufs`, untouched, until its receive is taken below or
        // the test ends; the read side runs only inside this function.
        ids.push(unsafe { p.lock().post(0, b.as_mut_ptr(), b.len()) });
    }
    feed(&p, usize::MAX / 2, false);
    while !matches!(step(&p), Step::Idle) {}
    for (i, id) in ids.into_iter().enumerate() {
        let done = p.lock().take_done(id);
        assert!(
            matches!(done, Some(Outcome::Delivered(_))),
            "message {i} not delivered"
        );
        assert_eq!(bufs[i], payload(i, msgs[i].1), "message {i}");
    }
    assert_eq!(rx(&p).buf.len(), RX_BUF_MIN, "grown by large frames");

    let small: Vec<(u64, usize)> = (0..2_000).map(|_| (0, 40)).collect();
    let p = scripted(
        stream(&small),
        Limits {
            max_message: 1 << 30,
            unexpected: 1 << 20,
            sealed: false,
        },
    );
    feed(&p, usize::MAX / 2, false);
    while !matches!(step(&p), Step::Idle) {}
    assert_eq!(
        rx(&p).buf.len(),
        RX_BUF,
        "not grown by a flood of small frames"
    );
}

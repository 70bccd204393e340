//! Tests of how a peer writes its socket: TCP_NODELAY on every connection, and each frame (with
//! what is left of a heartbeat before it) handed to the kernel in one write.

use std::net::TcpListener;
use std::os::unix::net::UnixDatagram;

use dist_core::Backend;
use socket2::{Domain, Socket, Type};

use super::tests::{Pair, limits};
use super::*;
use crate::{Formation, TcpBackend, TcpConfig};

/// The socket of `p`'s connection.
fn stream(p: &Peer) -> &TcpStream {
    &p.conn.get().expect("connected").stream
}

/// Every connection of an eager job and of a lazy one (where most are dialed on first use,
/// through [`Peer::attach`]) has TCP_NODELAY set, read back from the kernel: a small frame (a
/// barrier's, a heartbeat) goes out at once, not held back by Nagle's algorithm until the
/// previous segment's acknowledgement. Fails with the `set_nodelay` in `set_conn` removed.
#[test]
fn every_connection_has_tcp_nodelay() {
    const N: usize = 5;
    for formation in [Formation::Eager, Formation::Lazy] {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ranks: Vec<_> = (0..N)
            .map(|r| {
                std::thread::spawn(move || {
                    let cfg = TcpConfig::new(r, N, format!("127.0.0.1:{port}"))
                        .formation(formation)
                        .init_timeout(Duration::from_secs(30));
                    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("{e}"));
                    let at_init = crate::testing::connected_peers(&b);
                    // A message to and from every other rank: every connection is made.
                    let tag = Tag::user(5);
                    for p in (0..N).filter(|p| *p != r) {
                        b.send_tagged(&[r as u8], p, tag).unwrap();
                    }
                    for p in (0..N).filter(|p| *p != r) {
                        let mut got = [0u8];
                        b.recv_tagged(&mut got, p, tag).unwrap();
                        assert_eq!(got[0] as usize, p);
                    }
                    for p in b.shared.peers.iter().filter(|p| !p.is_loopback()) {
                        assert!(
                            stream(p).nodelay().unwrap(),
                            "{formation:?}: rank {r}'s connection to rank {} has no TCP_NODELAY",
                            p.rank
                        );
                    }
                    b.barrier().unwrap();
                    at_init
                })
            })
            .collect();
        let at_init: Vec<usize> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        if formation == Formation::Lazy {
            assert!(
                at_init.iter().any(|c| *c < N - 1),
                "every connection was made at init ({at_init:?}): none was dialed on first use"
            );
        }
    }
}

/// A peer whose writer's socket is one end of a datagram pair: each write the peer makes
/// arrives at the other end as one datagram, whose bounds show what went in which write.
fn writes_seen(pair: &Pair) -> UnixDatagram {
    let (ours, theirs) = Socket::pair(Domain::UNIX, Type::DGRAM, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let conn = pair.peer.conn.get().expect("connected");
    let mut w = conn.writer.lock_by(deadline).expect("the writer is free");
    w.sock = ours;
    let theirs = UnixDatagram::from(std::os::fd::OwnedFd::from(theirs));
    theirs
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    theirs
}

/// One write's bytes (one datagram); `None` if no write is pending.
fn next_write(seen: &UnixDatagram) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 1 << 17];
    seen.set_nonblocking(true).unwrap();
    let got = match seen.recv(&mut buf) {
        Ok(k) => Some(buf[..k].to_vec()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
        Err(e) => panic!("{e}"),
    };
    seen.set_nonblocking(false).unwrap();
    got
}

/// A small frame goes to the kernel in one write, header and payload together (and with them
/// what was left of a heartbeat written in part), never a write of the header and another of
/// the payload: with TCP_NODELAY each write may leave as a segment of its own, so two writes
/// would double the packets of every small message. Fails if `Peer::send` writes the header
/// and the payload apart.
#[test]
fn a_small_frame_is_one_write() {
    let pair = Pair::new(limits(1 << 20, 1 << 20));
    let seen = writes_seen(&pair);
    let deadline = Instant::now() + Duration::from_secs(10);
    let op = || "send".to_string();
    for (k, len) in [0usize, 1, 8, 100, 4096, 60_000].into_iter().enumerate() {
        let tag = 40 + k as u64;
        let meta = [k as u8; 16];
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + k) as u8).collect();
        if k % 2 == 1 {
            // A heartbeat of which the last 15 bytes are still to go.
            let conn = pair.peer.conn.get().unwrap();
            let mut w = conn.writer.lock_by(deadline).unwrap();
            w.hb = [0xEE; FRAME_HEADER_LEN];
            w.hb_left = 15;
        }
        pair.peer
            .send(FrameKind::Data, tag, &data, meta, &op, deadline)
            .unwrap_or_else(|e| panic!("{e}"));
        let write = next_write(&seen).expect("a write");
        let hb = if k % 2 == 1 { 15 } else { 0 };
        assert_eq!(
            write.len(),
            hb + FRAME_HEADER_LEN + len,
            "a frame of {len} bytes (and {hb} bytes of heartbeat) in one write"
        );
        assert!(
            write[..hb].iter().all(|b| *b == 0xEE),
            "the heartbeat first"
        );
        let header: [u8; FRAME_HEADER_LEN] = write[hb..hb + FRAME_HEADER_LEN].try_into().unwrap();
        let h = FrameHeader::decode(&header).unwrap();
        assert_eq!(
            (h.kind, h.tag, h.len, h.meta),
            (FrameKind::Data, tag, len as u64, meta)
        );
        assert_eq!(&write[hb + FRAME_HEADER_LEN..], &data[..]);
        assert_eq!(next_write(&seen), None, "a second write for one frame");
        let conn = pair.peer.conn.get().unwrap();
        assert_eq!(conn.writer.lock_by(deadline).unwrap().hb_left, 0);
    }
}

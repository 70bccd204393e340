//! Tests of sealed connections at the peer and the backend: frames go out sealed and come in
//! opened; a forged record on a sealed connection fails the receive waiting on it with an error
//! naming the peer and the record, and nothing of it reaches the receive's buffer.

use std::io::{IoSlice, Read, Write};
use std::net::TcpListener;

use dist_core::{Backend, Collectives};

use super::tests::limits;
use super::*;
use crate::seal::{Keys, Sealer};
use crate::{TcpBackend, TcpConfig};

const TX: [u8; 32] = [1; 32];
const RX: [u8; 32] = [2; 32];

/// A sealed peer (rank 1 seen from rank 0) on its own I/O thread, and the raw other end with
/// the sealer of the records the peer must accept.
struct SealedPair {
    peer: Arc<Peer>,
    raw: TcpStream,
    to_peer: Sealer,
    io: IoThread,
}

impl SealedPair {
    fn new() -> SealedPair {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        crate::seal::remember(&s, Keys { tx: TX, rx: RX }).unwrap();
        let mut lim = limits(1 << 20, 1 << 20);
        lim.sealed = true;
        let peer = Arc::new(
            Peer::connected(0, 1, s, Duration::from_secs(10), Default::default(), lim).unwrap(),
        );
        let io = IoThread::spawn("test-io".into()).unwrap();
        io.adopt(&peer);
        SealedPair {
            peer,
            raw,
            to_peer: Sealer::new(&RX),
            io,
        }
    }

    /// The records of a data frame on `tag` carrying `payload`.
    fn frame(&mut self, tag: u64, payload: &[u8]) -> Vec<u8> {
        let h = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len: payload.len() as u64,
            meta: [0; 16],
        }
        .encode();
        let mut bufs = [IoSlice::new(&h), IoSlice::new(payload)];
        let mut bufs = &mut bufs[..];
        let mut out = Vec::new();
        while !bufs.is_empty() {
            let n = self.to_peer.seal(bufs).unwrap();
            IoSlice::advance_slices(&mut bufs, n);
            out.extend_from_slice(self.to_peer.pending());
            let k = self.to_peer.pending().len();
            self.to_peer.advance(k);
        }
        out
    }

    fn recv(&self, buf: &mut [u8], tag: u64) -> Result<Meta> {
        let deadline = Instant::now() + Duration::from_secs(10);
        self.peer
            .recv(buf, tag, deadline, &|| format!("recv tag {tag}"))
    }
}

impl Drop for SealedPair {
    fn drop(&mut self) {
        let _ = self.raw.shutdown(Shutdown::Both);
        self.peer.shutdown(Shutdown::Both);
        self.io.stop();
    }
}

/// A sealed frame arrives; the next, changed in one byte of its payload on the wire, fails the
/// receive posted for it with an error naming the peer and the record, and its buffer keeps
/// what it held: nothing forged is delivered. The peer's own sends go out sealed.
#[test]
fn a_forged_record_fails_the_receive_and_delivers_nothing() {
    let mut p = SealedPair::new();
    let good = p.frame(5, b"genuine gradient");
    p.raw.write_all(&good).unwrap();
    let mut buf = [0u8; 16];
    p.recv(&mut buf, 5).unwrap();
    assert_eq!(&buf, b"genuine gradient");

    let mut forged = p.frame(6, b"changed gradient");
    let last = forged.len() - TAG_AT_END - 3;
    forged[last] ^= 1;
    p.raw.write_all(&forged).unwrap();
    let mut buf = [0xAAu8; 16];
    let e = p.recv(&mut buf, 6).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            DistError::PeerGone {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{text}"
    );
    assert!(
        text.contains("sealed record 1 from rank 1") && text.contains("forged"),
        "{text}"
    );
    assert_eq!(buf, [0xAA; 16], "a forged payload reached the buffer");

    // What the peer sends is sealed: the raw end sees no plain frame header.
    let mut q = SealedPair::new();
    q.peer
        .send(
            FrameKind::Data,
            9,
            b"plain text that must not show",
            [0; 16],
            &|| "send".into(),
            Instant::now() + Duration::from_secs(5),
        )
        .unwrap();
    let mut wire = vec![0u8; 4 + FRAME_HEADER_LEN + 29 + 16];
    q.raw.read_exact(&mut wire).unwrap();
    assert!(!wire.windows(10).any(|w| w == b"plain text"));
    let mut o = crate::seal::Opener::new(&TX, 0);
    let mut at = 0;
    let mut text = [0u8; FRAME_HEADER_LEN + 29];
    let mut read = |d: &mut [u8]| {
        let n = d.len().min(wire.len() - at);
        d[..n].copy_from_slice(&wire[at..at + n]);
        at += n;
        Ok(n)
    };
    let mut got = 0;
    while got < text.len() {
        got += o.read(&mut read, &mut text[got..]).unwrap();
    }
    assert_eq!(&text[FRAME_HEADER_LEN..], b"plain text that must not show");
}

/// Bytes at the end of a record that are its tag.
const TAG_AT_END: usize = crate::seal::TAG_LEN;

/// A sealed job (eager and lazy, shared memory off) exchanges messages and reduces correctly,
/// every connection sealed; a rank that does not seal is refused by one that does.
#[test]
fn a_sealed_job_runs_and_a_rank_that_does_not_seal_is_refused() {
    const N: usize = 3;
    for formation in [crate::Formation::Eager, crate::Formation::Lazy] {
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
                        .secret("a secret of sixteen bytes or more")
                        .seal(true)
                        .shared_memory(false)
                        .init_timeout(Duration::from_secs(30));
                    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("{e}"));
                    let mut v = vec![(r + 1) as f32; 100_000];
                    b.all_reduce(&mut v, dist_core::ReduceOp::Sum).unwrap();
                    assert!(v.iter().all(|x| *x == 6.0));
                    let sealed = b.shared.peers.iter().filter_map(|p| p.conn.get()).all(|c| {
                        matches!(c.rx.lock().unwrap().sock, Source::Sealed { .. })
                            && c.writer
                                .lock_by(Instant::now() + Duration::from_secs(5))
                                .is_some_and(|w| w.seal.is_some())
                    });
                    assert!(sealed, "rank {r}: a connection is not sealed");
                    b.barrier().unwrap();
                })
            })
            .collect();
        for t in ranks {
            t.join().unwrap();
        }
    }
    // Rank 1 does not seal: rank 0 refuses it, naming both.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let cfg = TcpConfig::new(r, 2, format!("127.0.0.1:{port}"))
                    .secret("a secret of sixteen bytes or more")
                    .seal(r == 0)
                    .init_timeout(Duration::from_secs(10));
                TcpBackend::with_config(cfg)
                    .map(drop)
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    let errs: Vec<String> = ranks
        .into_iter()
        .filter_map(|t| t.join().unwrap().err())
        .collect();
    assert!(
        errs.iter()
            .any(|e| e.contains("rank 0 seals its connections") && e.contains("rank 1 does not")),
        "{errs:?}"
    );
}

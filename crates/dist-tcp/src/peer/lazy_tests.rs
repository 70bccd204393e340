//! Tests of a peer created without a connection: a receive posted before the connection is
//! attached, the connect hook on first use, racing first uses, and a failing hook.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;

use super::*;

const ME: usize = 0;
const RANK: usize = 3;

fn limits() -> Limits {
    Limits {
        max_message: 1 << 20,
        unexpected: 1 << 20,
        sealed: false,
    }
}

fn unconnected(hook: Option<ConnectHook>) -> Arc<Peer> {
    Arc::new(Peer::unconnected(
        ME,
        RANK,
        Duration::from_secs(10),
        Arc::new(Aborts::default()),
        limits(),
        hook,
    ))
}

/// A connected pair of sockets: (the peer's end, the test's end).
fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (s, raw)
}

fn data_frame(tag: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = FrameHeader {
        kind: FrameKind::Data,
        tag,
        len: payload.len() as u64,
        meta: [tag as u8; 16],
    }
    .encode()
    .to_vec();
    f.extend_from_slice(payload);
    f
}

/// Reads one frame from the test's end; returns its header and payload.
fn read_frame(raw: &mut TcpStream) -> (FrameHeader, Vec<u8>) {
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = [0u8; FRAME_HEADER_LEN];
    raw.read_exact(&mut h).unwrap();
    let h = FrameHeader::decode(&h).unwrap();
    let mut p = vec![0u8; h.len as usize];
    raw.read_exact(&mut p).unwrap();
    (h, p)
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// With no connect hook, a receive posted before the connection exists waits in the table;
/// once the connection is attached, the I/O thread registers it and serves the receive.
#[test]
fn a_receive_posted_before_the_attach_is_served_after_it() {
    let peer = unconnected(None);
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&peer);
    assert!(!peer.is_connected());
    let p = peer.clone();
    let (posted_tx, posted_rx) = mpsc::channel();
    let receiver = std::thread::spawn(move || {
        let mut buf = [0u8; 5];
        // SAFETY: the handle is waited on below, never leaked.
        let posted = unsafe { p.post(&mut buf, 9, deadline(), None) };
        posted_tx.send(()).unwrap();
        posted.wait().map(|m| (m, buf))
    });
    // The receive is in the table before anything is attached.
    posted_rx.recv().unwrap();
    assert_eq!(peer.lock().posted.len(), 1);
    let (s, mut raw) = socket_pair();
    assert!(peer.attach(s).unwrap());
    // A second attach is refused without harm.
    let (s2, _raw2) = socket_pair();
    assert!(!peer.attach(s2).unwrap());
    raw.write_all(&data_frame(9, b"hello")).unwrap();
    let (meta, buf) = receiver.join().unwrap().unwrap();
    assert_eq!((meta, &buf), ([9; 16], b"hello"));
    drop(raw);
    drop(io);
}

/// A hook that connects to `addr` and counts its calls; the test accepts on the listener.
fn dialing_hook(addr: std::net::SocketAddr, calls: Arc<AtomicUsize>) -> ConnectHook {
    Arc::new(move |peer, _deadline| {
        assert_eq!(peer, RANK);
        calls.fetch_add(1, Ordering::SeqCst);
        TcpStream::connect(addr)
            .map(Some)
            .map_err(|source| DistError::Io {
                rank: ME,
                context: "connect".into(),
                source,
            })
    })
}

/// The first send to an unconnected peer calls the hook, attaches what it returns, and goes
/// out on it; the next send reuses the connection; and a reply is read by the I/O thread.
#[test]
fn a_first_send_calls_the_connect_hook_once() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let peer = unconnected(Some(dialing_hook(l.local_addr().unwrap(), calls.clone())));
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&peer);
    let op = || "send to 3".to_string();
    peer.send(FrameKind::Data, 4, b"abc", [1; 16], &op, deadline())
        .unwrap();
    peer.send(FrameKind::Data, 4, b"def", [2; 16], &op, deadline())
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let (mut raw, _) = l.accept().unwrap();
    let (h, p) = read_frame(&mut raw);
    assert_eq!((h.tag, h.meta, p.as_slice()), (4, [1; 16], &b"abc"[..]));
    let (h, p) = read_frame(&mut raw);
    assert_eq!((h.tag, p.as_slice()), (4, &b"def"[..]));
    raw.write_all(&data_frame(6, b"back")).unwrap();
    let mut buf = [0u8; 4];
    peer.recv(&mut buf, 6, deadline(), &|| "recv".into())
        .unwrap();
    assert_eq!(&buf, b"back");
    drop(io);
}

/// Two threads using the peer first at once: one runs the hook, the other waits for it and
/// then uses the same connection. Fails without the guard: the hook runs twice (and the
/// second connection is dropped unused).
#[test]
fn two_first_uses_at_once_dial_once() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let entered_tx = Mutex::new(entered_tx);
    let hook: ConnectHook = {
        let calls = calls.clone();
        Arc::new(move |_, _| {
            calls.fetch_add(1, Ordering::SeqCst);
            let _ = entered_tx.lock().unwrap().send(());
            // Held until the other caller is seen waiting (or the test has failed).
            let _ = release_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
            TcpStream::connect(addr)
                .map(Some)
                .map_err(|source| DistError::Io {
                    rank: ME,
                    context: "connect".into(),
                    source,
                })
        })
    };
    let peer = unconnected(Some(hook));
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&peer);
    let send = |tag: u64| {
        let p = peer.clone();
        std::thread::spawn(move || {
            p.send(
                FrameKind::Data,
                tag,
                &[tag as u8; 8],
                [0; 16],
                &|| format!("send {tag}"),
                deadline(),
            )
        })
    };
    let a = send(1);
    entered_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let b = send(2);
    // Wait until the second caller waits for the first one's dial.
    let t = Instant::now();
    while peer.dial.lock().unwrap().waiting == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the second caller never waited"
        );
        std::thread::yield_now();
    }
    release_tx.send(()).unwrap();
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let (mut raw, _) = l.accept().unwrap();
    let mut tags = [read_frame(&mut raw).0.tag, read_frame(&mut raw).0.tag];
    tags.sort();
    assert_eq!(tags, [1, 2]);
    drop(io);
}

/// A hook that fails: the send and a posted receive fail with an error naming this rank, the
/// peer, the operation and the cause; nothing is attached, and a later use dials again.
#[test]
fn a_failing_hook_is_a_clear_error() {
    let calls = Arc::new(AtomicUsize::new(0));
    let hook: ConnectHook = {
        let calls = calls.clone();
        Arc::new(move |peer, _| {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(DistError::Io {
                rank: ME,
                context: format!("connect to rank {peer} at 10.0.0.9:4000"),
                source: std::io::ErrorKind::ConnectionRefused.into(),
            })
        })
    };
    let peer = unconnected(Some(hook));
    let op = || "send to 3 (tag 4, 3 bytes)".to_string();
    let e = peer
        .send(FrameKind::Data, 4, b"abc", [0; 16], &op, deadline())
        .unwrap_err();
    match &e {
        DistError::PeerGone {
            rank,
            peer,
            op,
            cause,
        } => {
            assert_eq!((*rank, *peer), (ME, RANK));
            assert_eq!(op, "send to 3 (tag 4, 3 bytes)");
            assert!(
                cause.contains("could not connect") && cause.contains("10.0.0.9:4000"),
                "{cause}"
            );
        }
        other => panic!("{other:?}"),
    }
    let mut buf = [0u8; 2];
    let e = peer
        .recv(&mut buf, 1, deadline(), &|| "recv from 3".into())
        .unwrap_err();
    assert!(
        matches!(&e, DistError::PeerGone { op, .. } if op == "recv from 3"),
        "{e:?}"
    );
    assert!(!peer.is_connected());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(peer.lock().posted.is_empty());
}

/// A wake of the I/O thread for a peer it does not watch yet (here: the backend waking every
/// peer on an abort, before this one is attached) must not leave the peer's pending-wake flag
/// set, or every later wake of it would be dropped (its held frames then waited for the
/// 500 ms recheck). Fails before the fix: the flag stayed set after the attach.
#[test]
fn a_wake_before_the_attach_does_not_silence_later_ones() {
    let peer = unconnected(None);
    let io = IoThread::spawn("test-io".into()).unwrap();
    io.adopt(&peer);
    peer.kick();
    let t = Instant::now();
    while peer.io_woken.load(Ordering::Acquire) && t.elapsed() < Duration::from_millis(100) {
        std::thread::yield_now();
    }
    let (s, _raw) = socket_pair();
    assert!(peer.attach(s).unwrap());
    let t = Instant::now();
    while peer.reader_turns.load(Ordering::Relaxed) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the attached peer got no turn"
        );
        std::thread::yield_now();
    }
    assert!(
        !peer.io_woken.load(Ordering::Acquire),
        "a wake from before the attach is still pending: later wakes would be dropped"
    );
    drop(io);
}

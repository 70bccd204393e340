//! Tests of the shared-memory negotiation: offers, which configurations offer shared memory,
//! rings between two ranks of one host, refusals, and deadlines against a full listener.

use super::*;

/// An offer decodes to what was encoded; a stray first byte or unknown flag is refused.
#[test]
fn offers_round_trip_and_garbage_is_refused() {
    let o = Offer {
        wants: true,
        cap: RING_CAP,
        host: [3; 32],
        nonce: [4; 16],
        token: [5; 16],
        rank: 7,
    };
    let b = o.encode();
    let d = Offer::decode(&b).unwrap();
    assert!(d.wants && d.cap == RING_CAP && d.host == [3; 32] && d.rank == 7);
    assert_eq!((d.nonce, d.token), ([4; 16], [5; 16]));
    let mut bad = b;
    bad[0] ^= 1;
    assert!(
        Offer::decode(&bad)
            .unwrap_err()
            .contains("not a shared-memory offer")
    );
    let mut bad = b;
    bad[9] = 1;
    assert!(Offer::decode(&bad).unwrap_err().contains("unknown flags"));
}

/// The identity is that of this host: the same twice, and `DIST_HOST_ID` changes it.
#[test]
fn host_identity_follows_the_simulated_host() {
    let a = host_identity(None).expect("boot id and namespace readable");
    assert_eq!(Some(a), host_identity(None));
    assert_ne!(Some(a), host_identity(Some("other")));
}

/// A configuration wants shared memory by default, not with `shared_memory(false)`, and
/// not when the job forms lazily.
#[test]
fn which_configurations_offer_shared_memory() {
    let c = crate::TcpConfig::new(0, 2, "127.0.0.1:1");
    assert_eq!(c.shm_host(), host_identity(None));
    assert!(c.clone().shared_memory(false).shm_host().is_none());
    assert!(
        c.clone()
            .formation(crate::Formation::Lazy)
            .shm_host()
            .is_none()
    );
    assert_ne!(c.host_id("h1").shm_host(), host_identity(None));
}

fn pair() -> (TcpStream, TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn both(ha: Option<[u8; 32]>, hb: Option<[u8; 32]>) -> (Shm, Shm) {
    let (a, b) = pair();
    let deadline = Instant::now() + Duration::from_secs(10);
    std::thread::scope(|s| {
        let t = s.spawn(|| negotiate(&b, 3, 1, hb, None, deadline).unwrap());
        let x = negotiate(&a, 1, 3, ha, None, deadline).unwrap();
        (x, t.join().unwrap())
    })
}

/// Two ranks of one host each get both rings, and bytes written by one arrive at the other.
#[test]
fn same_host_ranks_share_rings() {
    let h = host_identity(None);
    let (mut a, mut b) = both(h, h);
    let (tx, rx) = (a.tx.as_mut().unwrap(), b.rx.as_mut().unwrap());
    assert_eq!(tx.write_some(&[IoSlice::new(b"over shm")]).unwrap().0, 8);
    let mut out = [0u8; 8];
    assert_eq!(rx.read(&mut out).unwrap(), 8);
    assert_eq!(&out, b"over shm");
    assert!(a.rx.is_some() && b.tx.is_some());
}

/// Other hosts, or a rank that declines, get no ring in either direction, and both sides
/// agree.
#[test]
fn other_hosts_or_a_refusal_stay_on_tcp() {
    for (ha, hb) in [
        (host_identity(Some("a")), host_identity(Some("b"))),
        (host_identity(None), None),
        (None, host_identity(None)),
    ] {
        let (a, b) = both(ha, hb);
        assert!(a.tx.is_none() && a.rx.is_none() && b.tx.is_none() && b.rx.is_none());
    }
}

/// A peer that sends something other than an offer is a protocol error, not a hang.
#[test]
fn garbage_instead_of_an_offer_is_an_error() {
    let (a, mut b) = pair();
    b.write_all(&[0x55; OFFER_LEN]).unwrap();
    let e = negotiate(
        &a,
        1,
        3,
        host_identity(None),
        None,
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(e.contains("not a shared-memory offer"), "{e}");
}

/// A listener on the abstract name of `nonce` with backlog 0 and one connection pending,
/// never accepted: its queue is full, so a blocking connect to it waits. The filler
/// connection is returned to keep it so.
#[cfg(target_os = "linux")]
fn full_listener(nonce: &[u8; 16]) -> (OwnedFd, UnixStream) {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let addr = SocketAddrUnix::new_abstract_name(format!("dist-shm-{hex}").as_bytes()).unwrap();
    let l = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&l, &addr).unwrap();
    rustix::net::listen(&l, 0).unwrap();
    let filler = UnixStream::connect_addr(&abstract_addr(nonce).unwrap()).unwrap();
    (l, filler)
}

/// A connect to a peer whose listener's queue is full fails by its deadline, with an
/// error naming the rank, the peer and the time waited.
#[test]
#[cfg(target_os = "linux")]
fn a_connect_to_a_full_listener_ends_at_its_deadline() {
    let nonce = [0x4b; 16];
    let (_l, _filler) = full_listener(&nonce);
    let start = Instant::now();
    let e = connect_peer(3, 1, &nonce, start + Duration::from_millis(300)).unwrap_err();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}: {e}");
    assert!(took < Duration::from_secs(5), "{took:?}: {e}");
    assert!(
        e.contains("rank 3") && e.contains("peer 1") && e.contains("did not complete in"),
        "{e}"
    );
}

/// A lower-rank peer that offers shared memory but whose listener's queue is full: the
/// higher rank's negotiate still returns by its deadline.
#[test]
#[cfg(target_os = "linux")]
fn a_full_listener_cannot_hold_negotiate() {
    let (a, mut b) = pair();
    let nonce = [0x5a; 16];
    let (_l, _filler) = full_listener(&nonce);
    let offer = Offer {
        wants: true,
        cap: RING_CAP,
        host: host_identity(None).unwrap(),
        nonce,
        token: [1; 16],
        rank: 1,
    };
    b.write_all(&offer.encode()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(1);
        let r = negotiate(&a, 3, 1, host_identity(None), None, deadline);
        let _ = tx.send(r.map(|_| ()));
    });
    let got = rx.recv_timeout(Duration::from_secs(6));
    assert!(
        got.is_ok(),
        "negotiate still blocked 5 s after its deadline (connect to a full listener)"
    );
}

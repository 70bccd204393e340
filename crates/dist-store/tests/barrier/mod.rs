//! `BARRIER` (PyTorch 2.15 and later) on the three servers, libuv, legacy and dist's, with raw
//! requests: every scenario must give the same bytes on all three. Then dist's client's
//! `server_barrier`, timed out and cancelled, against each.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use dist_store::proto::{self, Request};
use dist_store::{Store, StoreError, StoreServer};

use crate::TorchServer;
use crate::common::{T, Torch, connect};

/// A nonce whose first byte is not STOP_WAITING (0) or WAIT_CANCELED (1): a PING answered
/// with it proves that nothing else was sent to that connection before it.
const NONCE: u32 = 0x0A0B_0C0D;

/// A validated connection speaking raw requests.
struct Raw {
    s: TcpStream,
    server: &'static str,
}

impl Raw {
    fn open(addr: SocketAddr, server: &'static str) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        // PyTorch's libuv server resolves each new client's name on its loop thread, which can
        // stall it for seconds: a generous deadline.
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut r = Raw { s, server };
        r.send(&Request::Validate(proto::VALIDATION_MAGIC));
        r.expect_quiet();
        r
    }

    fn send(&mut self, req: &Request<'_>) {
        let mut buf = Vec::new();
        proto::encode_request(&mut buf, req);
        self.s.write_all(&buf).unwrap();
    }

    /// `n` answer bytes, or `None` if the server closed the connection first.
    fn read(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut got = vec![0u8; n];
        let mut at = 0;
        while at < n {
            match self.s.read(&mut got[at..]) {
                Ok(0) => return None,
                Ok(k) => at += k,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("{}: reading {n} bytes: {e}", self.server),
            }
        }
        Some(got)
    }

    /// Sends PING and checks that its nonce is the next thing on the connection: the server
    /// has run every earlier request of this connection and sent it nothing else meanwhile.
    fn expect_quiet(&mut self) {
        self.send(&Request::Ping(NONCE));
        assert_eq!(
            self.read(4).as_deref(),
            Some(&NONCE.to_le_bytes()[..]),
            "{}: something came before the ping's answer",
            self.server
        );
    }

    fn expect(&mut self, want: &[u8], what: &str) {
        assert_eq!(
            self.read(want.len()).as_deref(),
            Some(want),
            "{}: {what}",
            self.server
        );
    }

    fn get(&mut self, key: &[u8]) -> Vec<u8> {
        self.send(&Request::Get(key));
        let len = u64::from_le_bytes(self.read(8).unwrap().try_into().unwrap());
        self.read(len as usize).unwrap()
    }
}

const STOP: &[u8] = &[proto::STOP_WAITING];
const CANCELED: &[u8] = &[proto::WAIT_CANCELED];

/// The scenarios, run against one server. Each asserts what PyTorch 2.15's servers do.
fn scenarios(addr: SocketAddr, server: &'static str) {
    let open = || Raw::open(addr, server);

    // The world-size-th arrival releases everyone; the key holds the count as ASCII decimal; a
    // later arrival under the same key passes at once (the count only grows).
    let (mut a, mut b, mut c) = (open(), open(), open());
    a.send(&Request::Barrier(b"/r", 2));
    a.expect_quiet();
    b.send(&Request::Barrier(b"/r", 2));
    b.expect(STOP, "the second of two arrivals passes");
    a.expect(STOP, "the first is released by the second");
    assert_eq!(c.get(b"/r"), b"2", "{server}: the count");
    c.send(&Request::Barrier(b"/r", 2));
    c.expect(STOP, "a third arrival passes at once");
    assert_eq!(c.get(b"/r"), b"3", "{server}: the count");

    // A cancelled arrival stays counted; the cancelled client is not woken later.
    let (mut a, mut b) = (open(), open());
    a.send(&Request::Barrier(b"/c", 2));
    a.expect_quiet();
    a.send(&Request::CancelWait);
    a.expect(CANCELED, "cancel answers WAIT_CANCELED");
    b.send(&Request::Barrier(b"/c", 2));
    b.expect(STOP, "the cancelled arrival counts");
    a.expect_quiet();

    // A world size of 1 or less passes at once.
    let mut a = open();
    a.send(&Request::Barrier(b"/one", 1));
    a.expect(STOP, "world size 1");
    a.send(&Request::Barrier(b"/zero", 0));
    a.expect(STOP, "world size 0");
    a.send(&Request::Barrier(b"/neg", -3));
    a.expect(STOP, "a negative world size");

    // A SET of the key releases a waiting arrival; the count then goes on from the value set.
    let (mut a, mut b) = (open(), open());
    a.send(&Request::Barrier(b"/s", 3));
    a.expect_quiet();
    b.send(&Request::Set(b"/s", b"7"));
    a.expect(STOP, "a set of the key releases the barrier");
    b.send(&Request::Barrier(b"/s", 3));
    b.expect(STOP, "the count goes on from the value set (8 >= 3)");
    assert_eq!(b.get(b"/s"), b"8", "{server}: the count after a set");

    // An arrival stores the count without waking a WAIT on the key; the last one wakes it.
    let (mut w, mut a, mut b) = (open(), open(), open());
    w.send(&Request::Wait(vec![b"/w"]));
    w.expect_quiet();
    a.send(&Request::Barrier(b"/w", 2));
    a.expect_quiet();
    w.expect_quiet();
    b.send(&Request::Barrier(b"/w", 2));
    b.expect(STOP, "the last arrival");
    a.expect(STOP, "the first arrival");
    w.expect(STOP, "the wait, woken with the barrier");

    // A key holding no decimal integer: the arriving client is closed, the others served.
    let (mut a, mut b) = (open(), open());
    a.send(&Request::Set(b"/x", b"abc"));
    a.send(&Request::Barrier(b"/x", 2));
    a.send(&Request::Ping(NONCE));
    assert_eq!(
        a.read(1),
        None,
        "{server}: a barrier on a value that is no number"
    );
    b.expect_quiet();
}

/// `BARRIER` on PyTorch 2.15's libuv and legacy servers and on dist's: the same answers in
/// every scenario (docs/store.md, quirk 12); dist's client's `server_barrier` against each,
/// timed out (cancelled; the connection stays usable; the arrival stays counted).
pub(crate) fn barrier_behaves_as_pytorchs_servers(t: &Torch) {
    let libuv = TorchServer::start(&t.python, "libuv");
    let legacy = TorchServer::start(&t.python, "legacy");
    let dist = StoreServer::bind("127.0.0.1:0").unwrap();
    let servers = [
        ("libuv", libuv.addr),
        ("legacy", legacy.addr),
        ("dist", dist.local_addr()),
    ];
    for (name, addr) in servers {
        scenarios(addr, name);

        let c = connect(addr);
        let e = c
            .server_barrier("tb", 2, Duration::from_millis(200))
            .unwrap_err();
        assert!(
            matches!(
                &e,
                StoreError::Timeout { op: "server_barrier", key, .. } if key == "tb"
            ),
            "{name}: {e:?}"
        );
        c.set("after", b"1").unwrap();
        assert_eq!(c.get("after", T).unwrap(), b"1", "{name}: usable after");
        connect(addr)
            .server_barrier("tb", 2, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{name}: the timed-out arrival counts: {e}"));
    }
}

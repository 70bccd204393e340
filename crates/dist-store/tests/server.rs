//! dist's client against dist's server: every operation, and a server under hostile clients
//! (malformed, oversized, unvalidated, not reading, thousands idle) that closes each alone.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{Caps, T, connect, exercise};
use dist_store::proto::{self, Request, VALIDATION_MAGIC, query};
use dist_store::{ServerOptions, Store, StoreError, StoreServer, TcpStore};

fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s
}

fn send(s: &mut TcpStream, reqs: &[Request<'_>]) {
    let mut buf = Vec::new();
    for r in reqs {
        proto::encode_request(&mut buf, r);
    }
    s.write_all(&buf).unwrap();
}

/// The server closed `s`: a read ends (EOF or reset) within the test's deadline.
fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("expected the server to close the connection, got {e}"),
        }
    }
}

#[test]
fn every_operation_against_dists_server() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    exercise(
        server.local_addr(),
        "dist",
        Caps {
            queues: true,
            server_barrier: true,
        },
    );
}

#[test]
fn a_client_that_breaks_the_protocol_is_closed_alone() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let good = connect(addr);
    good.set("k", b"v").unwrap();

    // Unknown query type.
    let mut bad = raw(addr);
    send(&mut bad, &[Request::Validate(VALIDATION_MAGIC)]);
    bad.write_all(&[99]).unwrap();
    assert_closed(&mut bad);

    // A key longer than the limit: closed on its length alone, before its bytes come.
    let mut bad = raw(addr);
    send(&mut bad, &[Request::Validate(VALIDATION_MAGIC)]);
    let mut req = vec![query::SET];
    req.extend_from_slice(&(1u64 << 40).to_le_bytes());
    bad.write_all(&req).unwrap();
    assert_closed(&mut bad);

    // A WAIT for more keys than the limit.
    let mut bad = raw(addr);
    send(&mut bad, &[Request::Validate(VALIDATION_MAGIC)]);
    let mut req = vec![query::WAIT];
    req.extend_from_slice(&u64::MAX.to_le_bytes());
    bad.write_all(&req).unwrap();
    assert_closed(&mut bad);

    // No VALIDATE first, and a wrong magic.
    let mut bad = raw(addr);
    send(&mut bad, &[Request::Ping(7)]);
    assert_closed(&mut bad);
    let mut bad = raw(addr);
    send(&mut bad, &[Request::Validate(0x1234_5678)]);
    assert_closed(&mut bad);

    // ADD on a value that is no number.
    good.set("text", b"abc").unwrap();
    let mut bad = raw(addr);
    send(
        &mut bad,
        &[
            Request::Validate(VALIDATION_MAGIC),
            Request::Add(b"/text", 1),
        ],
    );
    assert_closed(&mut bad);

    assert_eq!(good.get("k", T).unwrap(), b"v", "the others are served");
    assert!(
        server
            .stats()
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 6
    );
}

#[test]
fn a_client_that_stops_reading_cannot_grow_the_server() {
    let opts = ServerOptions {
        client_out_pause: 256 * 1024,
        ..ServerOptions::default()
    };
    let server = StoreServer::bind_with("127.0.0.1:0", opts).unwrap();
    let addr = server.local_addr();
    let good = connect(addr);
    let value = vec![7u8; 1 << 20];
    good.set("v", &value).unwrap();

    // 1,000 GETs of 1 MiB, never read: 1 GiB of answers if the server kept them all.
    let mut hog = raw(addr);
    hog.set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut req = Vec::new();
    proto::encode_request(&mut req, &Request::Validate(VALIDATION_MAGIC));
    let mut one = Vec::new();
    proto::encode_request(&mut one, &Request::Get(b"/v"));
    let mut sent = 0usize;
    hog.write_all(&req).unwrap();
    for _ in 0..1000 {
        match hog.write_all(&one) {
            Ok(()) => sent += 1,
            Err(_) => break,
        }
    }
    assert_eq!(sent, 1000, "small requests fit the socket buffers");
    // Served meanwhile: the server paused the hog, it did not stall on it.
    let t0 = Instant::now();
    for i in 0..20 {
        good.set(&format!("x{i}"), b"1").unwrap();
        assert_eq!(good.get(&format!("x{i}"), T).unwrap(), b"1");
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    // The hog's answers held by the server stay under the pause plus one answer, however many
    // it asked for (the socket buffers hold a few MiB more).
    let unsent = server
        .stats()
        .unsent
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(unsent > 0, "the hog's answers wait");
    assert!(
        unsent <= opts.client_out_pause + 8 + (1 << 20),
        "the server holds {unsent} bytes for a client that does not read"
    );
    hog.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut got = 0usize;
    let mut b = vec![0u8; 1 << 16];
    let t0 = Instant::now();
    while let Ok(n) = hog.read(&mut b) {
        if n == 0 {
            break;
        }
        got += n;
        if t0.elapsed() > Duration::from_secs(20) {
            break;
        }
    }
    // Once the hog reads, the server resumes and answers every request it sent.
    assert_eq!(
        got,
        1000 * (8 + (1 << 20)),
        "every answer arrives once read"
    );
}

#[test]
fn thousands_of_idle_connections_cost_no_thread() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let threads = || std::fs::read_dir("/proc/self/task").map(|d| d.count()).ok();
    let before = threads();
    let mut idle = Vec::new();
    for _ in 0..2000 {
        let mut s = raw(addr);
        send(
            &mut s,
            &[Request::Validate(VALIDATION_MAGIC), Request::Ping(1)],
        );
        idle.push(s);
    }
    for s in &mut idle {
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 1);
    }
    // Other tests run beside this one and start threads of their own: a thread per connection
    // would add 2,000, the others add a few dozen at most.
    let (before, after) = (before.unwrap(), threads().unwrap());
    assert!(
        after < before + 200,
        "threads went from {before} to {after} for 2,000 connections"
    );
    let c = connect(addr);
    assert_eq!(c.add("after", 1).unwrap(), 1);
    assert_eq!(
        server
            .stats()
            .clients
            .load(std::sync::atomic::Ordering::Relaxed),
        2001
    );
}

#[test]
fn server_stops_and_clients_see_it() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let c = connect(server.local_addr());
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c.get("never", Duration::from_secs(30));
        (r, t0.elapsed())
    });
    // Give the wait time to reach the server, then take the server away.
    std::thread::sleep(Duration::from_millis(200));
    server.stop();
    let (r, took) = waiter.join().unwrap();
    let e = r.unwrap_err();
    assert!(matches!(e, StoreError::Io { op: "get", .. }), "{e:?}");
    assert!(
        took < Duration::from_secs(5),
        "ended by the close, not the deadline: {took:?}"
    );
}

#[test]
fn a_stop_waiting_that_crosses_the_cancel_is_tolerated() {
    // A server that answers a WAIT only after the client cancelled: STOP_WAITING, then
    // WAIT_CANCELED, as PyTorch's server does when the key came just before the cancel.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 10];
        s.read_exact(&mut b).unwrap(); // VALIDATE + PING
        s.write_all(&b[6..10]).unwrap();
        let mut seen = Vec::new();
        let mut one = [0u8; 1];
        while s.read(&mut one).unwrap() == 1 {
            seen.push(one[0]);
            if one[0] == query::CANCEL_WAIT && seen.len() > 1 {
                s.write_all(&[proto::STOP_WAITING, proto::WAIT_CANCELED])
                    .unwrap();
                break;
            }
        }
        // Then one GETNUMKEYS, answered, to show the stream stayed in step.
        s.read_exact(&mut one).unwrap();
        assert_eq!(one[0], query::GETNUMKEYS);
        s.write_all(&42i64.to_le_bytes()).unwrap();
        seen
    });
    let c = connect(addr);
    let e = c.wait(&["k"], Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    assert_eq!(c.num_keys().unwrap(), 42);
    let seen = fake.join().unwrap();
    assert_eq!(seen[0], query::WAIT);
}

#[test]
fn a_trickling_answer_is_cut_at_the_deadline() {
    // A server that answers GETNUMKEYS one byte every 150 ms (the last at 1.05 s): each read
    // gets something, so only the operation's deadline (600 ms) can end the call, not the
    // socket's per-read timeout.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 10];
        s.read_exact(&mut b).unwrap(); // VALIDATE + PING
        s.write_all(&b[6..10]).unwrap();
        let mut one = [0u8; 1];
        s.read_exact(&mut one).unwrap();
        assert_eq!(one[0], query::GETNUMKEYS);
        for byte in 42i64.to_le_bytes() {
            std::thread::sleep(Duration::from_millis(150));
            if s.write_all(&[byte]).is_err() {
                break;
            }
        }
    });
    let c = TcpStore::connect(addr, Duration::from_millis(600)).unwrap();
    let t0 = std::time::Instant::now();
    let e = c.num_keys().unwrap_err();
    assert!(
        matches!(e, StoreError::Timeout { op: "num_keys", .. }),
        "{e:?} after {:?}",
        t0.elapsed()
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(550),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn limits_in_total_close_the_client_that_passes_them() {
    let opts = ServerOptions {
        store: dist_store::StoreLimits {
            max_keys: 10,
            ..Default::default()
        },
        ..ServerOptions::default()
    };
    let server = StoreServer::bind_with("127.0.0.1:0", opts).unwrap();
    let c = connect(server.local_addr());
    for i in 0..10 {
        c.set(&format!("k{i}"), b"x").unwrap();
    }
    c.set("k10", b"x").unwrap(); // SET has no answer: the close shows on the next call.
    let e = c.num_keys().unwrap_err();
    assert!(matches!(e, StoreError::Io { .. }), "{e:?}");
    let e = c.num_keys().unwrap_err();
    assert!(matches!(e, StoreError::Broken { .. }), "{e:?}");
    assert_eq!(connect(server.local_addr()).num_keys().unwrap(), 10);
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any bytes from one client, validated or not: the server answers or closes that
        /// client, and goes on serving another; it never stops or panics.
        #[test]
        fn any_bytes_from_a_client_leave_the_server_serving(
            validated in any::<bool>(),
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            let server = StoreServer::bind("127.0.0.1:0").unwrap();
            let addr = server.local_addr();
            let mut bad = raw(addr);
            if validated {
                send(&mut bad, &[Request::Validate(VALIDATION_MAGIC)]);
            }
            let _ = bad.write_all(&bytes);
            let _ = bad.shutdown(std::net::Shutdown::Write);
            // Whatever came back, the connection ends (the server closes it on EOF).
            bad.set_read_timeout(Some(T)).unwrap();
            let mut sink = Vec::new();
            let _ = bad.read_to_end(&mut sink);
            let good = connect(addr);
            good.set("k", b"v").unwrap();
            prop_assert_eq!(good.get("k", T).unwrap(), b"v".to_vec());
        }
    }
}

/// A client says which local address reaches the server (where dist-tcp's ranks listen), and
/// keeps its connection when its timeout changes (as a backend's store does after formation).
#[test]
fn a_client_knows_its_local_address_and_takes_a_new_timeout() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let c = TcpStore::connect(server.local_addr(), Duration::from_secs(5)).unwrap();
    let local = c.local_addr().unwrap();
    assert_eq!(local.ip(), server.local_addr().ip());
    assert_ne!(local.port(), server.local_addr().port());
    c.set("k", b"v").unwrap();
    let c = c.with_timeout(Duration::from_millis(1500));
    assert_eq!(c.timeout(), Duration::from_millis(1500));
    assert_eq!(c.local_addr().unwrap(), local);
    assert_eq!(c.get("k", Duration::from_secs(5)).unwrap(), b"v");
}

//! A hostile client of the job's store: while the job runs, the last rank (a member of the job
//! like the others) also attacks the store rank 0 serves on `MASTER_PORT`, with raw
//! connections: thousands of idle ones, malformed and oversized requests, a client that sends
//! requests without ever reading their answers. The bounds (docs/store.md, "dist's server:
//! bounds"): each malformed client is closed, alone; the honest ranks' store calls are served
//! meanwhile; a client that never reads stops being read (its requests back up in its own
//! socket); rank 0's peak RSS grows by at most [`STORE_RSS_BUDGET`] over the attack; the
//! attacker's well-behaved connections are still answered after it.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, ReduceOp};
use dist_tcp::dist_store::Store;
use dist_tcp::dist_store::proto::{self, Request};

use dist_multirank::join;

use crate::flow::peak_rss;

/// Idle validated connections the attacker holds open (each costs the server a socket and a
/// few hundred bytes, no thread).
const IDLE: usize = 2_000;
/// GETs of a 1 MiB value the never-reading client tries to send: 42 MB of requests, more than
/// the kernel's socket buffers hold, so that it must block once the server stops reading it.
const UNREAD_GETS: usize = 2_000_000;
/// What rank 0's peak RSS may grow by over the attack: the 1 MiB value, what the server holds
/// for the client that does not read (its 256 KiB pause and one answer, which shares the stored
/// value), the idle connections' entries, the honest calls' buffers, the allocator's slack.
const STORE_RSS_BUDGET: u64 = 32 << 20;
/// Store round trips each honest rank makes while the attack is in place.
const HONEST_CALLS: usize = 50;
const T: Duration = Duration::from_secs(60);

fn master() -> SocketAddr {
    let addr = format!(
        "{}:{}",
        std::env::var("MASTER_ADDR").expect("MASTER_ADDR"),
        std::env::var("MASTER_PORT").expect("MASTER_PORT")
    );
    addr.to_socket_addrs()
        .expect("MASTER_ADDR:MASTER_PORT")
        .next()
        .expect("an address")
}

fn encode(reqs: &[Request<'_>]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in reqs {
        proto::encode_request(&mut b, r);
    }
    b
}

/// A connection that sent VALIDATE and a PING, and got the nonce back.
fn validated(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&encode(&[
        Request::Validate(proto::VALIDATION_MAGIC),
        Request::Ping(7),
    ]))
    .unwrap();
    let mut nonce = [0u8; 4];
    s.read_exact(&mut nonce)
        .unwrap_or_else(|e| panic!("the store's answer to a PING: {e}"));
    assert_eq!(u32::from_le_bytes(nonce), 7);
    s
}

/// Whether the server answers a PING on `s` (after whatever `s` sent before).
fn answers(s: &mut TcpStream, nonce: u32) -> bool {
    if s.write_all(&encode(&[Request::Ping(nonce)])).is_err() {
        return false;
    }
    let mut b = [0u8; 4];
    s.read_exact(&mut b).is_ok() && u32::from_le_bytes(b) == nonce
}

/// Sends `bytes` on a fresh connection and checks that the server closes it (without an
/// answer) within [`T`].
fn closed_for(addr: SocketAddr, what: &str, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(T)).unwrap();
    // The server may close before taking every byte: a failed write is that close.
    let _ = s.write_all(bytes);
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {}
        Ok(n) => panic!(
            "{what}: the store answered {:?} instead of closing",
            &b[..n]
        ),
        Err(e) => panic!("{what}: the store neither answered nor closed: {e}"),
    }
    println!("store attack: {what}: closed");
}

/// The attacker's side: returns once the honest ranks are done.
fn attack(addr: SocketAddr, store: &impl Store, honest: usize) {
    let mut probe = validated(addr);
    let t0 = Instant::now();
    let mut idle: Vec<TcpStream> = (0..IDLE).map(|_| validated(addr)).collect();
    println!(
        "store attack: {IDLE} idle connections opened in {:?}",
        t0.elapsed()
    );

    let valid = |rest: &[Request<'_>]| {
        let mut b = encode(&[Request::Validate(proto::VALIDATION_MAGIC)]);
        b.extend_from_slice(&encode(rest));
        b
    };
    closed_for(addr, "a PING before VALIDATE", &encode(&[Request::Ping(1)]));
    closed_for(
        addr,
        "a wrong magic",
        &encode(&[Request::Validate(0xdead_beef)]),
    );
    let mut garbage = valid(&[]);
    garbage.extend_from_slice(&[0xEE, 1, 2, 3, 4, 5, 6, 7, 8]);
    closed_for(addr, "query type 0xEE", &garbage);
    closed_for(
        addr,
        "a second VALIDATE",
        &valid(&[Request::Validate(proto::VALIDATION_MAGIC)]),
    );
    let long_key = vec![b'k'; 8 * 1024 + 1];
    closed_for(
        addr,
        "a key of 8 KiB + 1",
        &valid(&[Request::Set(&long_key, b"v")]),
    );
    // A SET whose value claims 2^40 bytes: refused on the length field, nothing allocated.
    let mut huge = valid(&[]);
    huge.push(proto::query::SET);
    huge.extend_from_slice(&2u64.to_le_bytes());
    huge.extend_from_slice(b"/h");
    huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
    huge.extend_from_slice(&[0u8; 4096]);
    closed_for(addr, "a value of 2^40 bytes", &huge);
    // A WAIT listing 2^40 keys: refused on the count.
    let mut many = valid(&[]);
    many.push(proto::query::WAIT);
    many.extend_from_slice(&(1u64 << 40).to_le_bytes());
    closed_for(addr, "a WAIT of 2^40 keys", &many);

    // A client that stores a 1 MiB value, then sends GETs of it and never reads the answers.
    let mut unread = validated(addr);
    unread
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let big = vec![7u8; 1 << 20];
    unread
        .write_all(&encode(&[Request::Set(b"/hostile_big", &big)]))
        .unwrap();
    let get = encode(&[Request::Get(b"/hostile_big")]);
    let batch: Vec<u8> = get.iter().copied().cycle().take(get.len() * 1000).collect();
    let mut sent = 0;
    while sent < UNREAD_GETS {
        match unread.write_all(&batch) {
            Ok(()) => sent += 1000,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(e) => panic!("the never-reading client: {e}"),
        }
    }
    println!("store attack: the never-reading client got {sent} GETs out before blocking");
    assert!(
        sent < UNREAD_GETS,
        "the server read all {UNREAD_GETS} GETs of a client that never reads its answers"
    );

    // The attack is in place: the honest ranks make their calls, then say so.
    store.set("hostile/ready", b"1").unwrap();
    let done: Vec<String> = (0..honest).map(|r| format!("hostile/done/{r}")).collect();
    let refs: Vec<&str> = done.iter().map(String::as_str).collect();
    store
        .wait(&refs, Duration::from_secs(300))
        .unwrap_or_else(|e| panic!("the honest ranks' calls: {e}"));

    // The attacker's well-behaved connections are still served.
    assert!(answers(&mut probe, 11), "the probe connection lost");
    for (i, s) in idle.iter_mut().enumerate().step_by(IDLE / 10) {
        assert!(answers(s, 100 + i as u32), "idle connection {i} lost");
    }
    println!("store attack: the probe and the idle connections still answered");
}

/// The case: see the module's doc.
pub fn store() -> Result<(), String> {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let h = n - 1;
    let store = b.store();
    let start = peak_rss();
    // Everyone has joined (and rank 0 has its starting RSS) before the attack.
    let mut one = [1u8];
    b.all_reduce(&mut one, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    if me == h {
        attack(master(), &store, h);
    } else {
        store
            .get("hostile/ready", Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("the attacker never said ready: {e}"));
        // Store round trips with the other honest ranks while the attack is in place.
        let t0 = Instant::now();
        for k in 0..HONEST_CALLS {
            store
                .set(&format!("honest/{me}/{k}"), format!("{me}:{k}").as_bytes())
                .unwrap_or_else(|e| panic!("{e}"));
            let peer = (me + 1) % h;
            let got = store
                .get(&format!("honest/{peer}/{k}"), T)
                .unwrap_or_else(|e| panic!("during the attack: {e}"));
            assert_eq!(got, format!("{peer}:{k}").into_bytes());
        }
        println!(
            "rank {me}: {HONEST_CALLS} store round trips during the attack in {:?}",
            t0.elapsed()
        );
        store.set(&format!("hostile/done/{me}"), b"1").unwrap();
    }
    if me == 0 {
        let grown = peak_rss().saturating_sub(start);
        println!(
            "rank 0 (the store's server): peak RSS grew by {} KiB",
            grown >> 10
        );
        assert!(
            grown <= STORE_RSS_BUDGET,
            "rank 0's peak RSS grew by {grown} bytes over the attack"
        );
    }
    // The job still works.
    let mut sum = [me as u64];
    b.all_reduce(&mut sum, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sum[0], (n * (n - 1) / 2) as u64);
    Ok(())
}

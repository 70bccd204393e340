//! A lazily formed job through `TcpBackend` (ranks as threads on loopback): peers connect on
//! first use, both sides of a pair may dial at once, and a rank connects only to the peers its
//! program talks to.

mod common;
use common::free_port;

use std::thread;
use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_tcp::testing::connected_peers;
use dist_tcp::{Formation, TcpBackend, TcpConfig};

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .formation(Formation::Lazy)
        .init_timeout(Duration::from_secs(60))
        .timeout(Duration::from_secs(60))
        .linger(Duration::from_secs(5))
}

/// Runs `f` on every rank of a fresh job with [`cfg`], each in its own thread.
fn job<T: Send + 'static>(
    world: usize,
    f: impl Fn(TcpBackend) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    common::job_with(world, cfg, f)
}

/// A world that is not a power of two runs point-to-point, barriers, small and large
/// all_reduces and a broadcast, every result checked; afterwards every rank, rank 0 included
/// (formation through the store connects no pair), is connected to at most 3⌈log₂ n⌉ + 3
/// peers, which is fewer than all of them.
#[test]
fn a_lazy_job_connects_only_the_peers_it_uses() {
    let n = 33;
    let out = job(n, |b| {
        let (me, n) = (b.rank(), b.world_size());
        // Both neighbours at once: each pair of the ring dials from both sides.
        b.send(&[me as u8; 3], (me + 1) % n).unwrap();
        b.send(&[me as u8; 2], (me + n - 1) % n).unwrap();
        let (mut left, mut right) = ([0u8; 3], [0u8; 2]);
        b.recv(&mut left, (me + n - 1) % n).unwrap();
        b.recv(&mut right, (me + 1) % n).unwrap();
        assert_eq!(left, [((me + n - 1) % n) as u8; 3]);
        assert_eq!(right, [((me + 1) % n) as u8; 2]);
        for _ in 0..3 {
            b.barrier().unwrap();
        }
        let mut small = [me as u64 + 1];
        b.all_reduce(&mut small, ReduceOp::Sum).unwrap();
        assert_eq!(small[0], (n * (n + 1) / 2) as u64);
        let mut large: Vec<u32> = (0..(1 << 18)).map(|i| (i as u32) ^ me as u32).collect();
        b.all_reduce(&mut large, ReduceOp::Sum).unwrap();
        for (i, v) in large.iter().enumerate().step_by(997) {
            let want: u32 = (0..n as u32).map(|r| (i as u32) ^ r).sum();
            assert_eq!(*v, want, "element {i}");
        }
        let mut root = vec![0u8; 100];
        if me == 5 {
            root.iter_mut().for_each(|x| *x = 7);
        }
        b.broadcast(&mut root, 5).unwrap();
        assert!(root.iter().all(|&x| x == 7));
        b.barrier().unwrap();
        connected_peers(&b)
    });
    let log = usize::BITS as usize - (n - 1).leading_zeros() as usize;
    for (r, &c) in out.iter().enumerate() {
        assert!(
            c <= 3 * log + 3 && c < n - 1,
            "rank {r} connected to {c} of {} peers",
            n - 1
        );
    }
}

/// Every rank sends to every other at once, many rounds: each pair dials from both sides in
/// the first round, ends with one connection, and every message arrives intact.
#[test]
fn every_pair_dialing_at_once_ends_with_one_connection_each() {
    let n = 8;
    let out = job(n, |b| {
        let (me, n) = (b.rank(), b.world_size());
        for round in 0..20u8 {
            // Small messages: each send completes without its receive (the peer queues it).
            for p in (0..n).filter(|&p| p != me) {
                b.send(&[me as u8, p as u8, round, 0xAB], p).unwrap();
            }
            for p in (0..n).filter(|&p| p != me) {
                let mut buf = [0u8; 4];
                b.recv(&mut buf, p).unwrap();
                assert_eq!(buf, [p as u8, me as u8, round, 0xAB]);
            }
        }
        let input: Vec<u32> = (0..n as u32).map(|p| 100 * me as u32 + p).collect();
        let mut output = vec![0u32; n];
        b.all_to_all(&input, &mut output).unwrap();
        let want: Vec<u32> = (0..n as u32).map(|p| 100 * p + me as u32).collect();
        assert_eq!(output, want);
        b.barrier().unwrap();
        connected_peers(&b)
    });
    assert!(out.iter().all(|&c| c == n - 1), "connections: {out:?}");
}

/// A rank that has left: the first send to it fails at the connect, naming the peer, long
/// before the operation's deadline (its listener is gone, so the dial is refused).
#[test]
fn a_first_send_to_a_rank_that_left_fails_at_once_naming_it() {
    let port = free_port();
    let (left_tx, left_rx) = std::sync::mpsc::channel::<()>();
    let leaver = thread::spawn(move || {
        let b = TcpBackend::with_config(cfg(2, 3, port)).unwrap();
        drop(b);
        left_tx.send(()).unwrap();
    });
    let root = thread::spawn(move || TcpBackend::with_config(cfg(0, 3, port)).unwrap());
    let b = TcpBackend::with_config(cfg(1, 3, port)).unwrap();
    // Rank 2's backend, and with it its listener, is gone.
    left_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    leaver.join().unwrap();
    let started = Instant::now();
    let e = b.send(b"hello", 2).unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(
            e,
            DistError::PeerGone {
                rank: 1,
                peer: 2,
                ..
            }
        ),
        "unexpected error: {e}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    drop(b);
    drop(root.join().unwrap());
}

//! In-process tests of the TCP backend: ranks as threads of one test, on loopback.

mod common;
use common::free_port;

use std::thread;
use std::time::{Duration, Instant};

use dist_core::{Backend, DistError, Tag};
use dist_tcp::{TcpBackend, TcpConfig};

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .init_timeout(Duration::from_secs(20))
        .timeout(Duration::from_secs(20))
        .linger(Duration::from_secs(5))
}

/// Runs `f` on every rank of a fresh job with [`cfg`], each in its own thread.
fn job<T: Send + 'static>(
    world: usize,
    f: impl Fn(TcpBackend) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    common::job_with(world, cfg, f)
}

#[test]
fn ring_messages_self_sends_and_barrier() {
    let out = job(3, |b| {
        let (me, n) = (b.rank(), b.world_size());
        b.send(&[me as u8; 5], (me + 1) % n).unwrap();
        b.send_tagged(b"self", me, Tag::user(9)).unwrap();
        let mut buf = [0u8; 5];
        b.recv(&mut buf, (me + n - 1) % n).unwrap();
        let mut own = [0u8; 4];
        b.recv_tagged(&mut own, me, Tag::user(9)).unwrap();
        assert_eq!(&own, b"self");
        for _ in 0..50 {
            b.barrier().unwrap();
        }
        buf[0]
    });
    assert_eq!(out, vec![2, 0, 1]);
}

#[test]
fn size_mismatch_keeps_the_message_and_the_connection() {
    job(2, |b| {
        if b.rank() == 0 {
            b.send(&[7u8; 16], 1).unwrap();
            b.send(&[8u8; 4], 1).unwrap();
        } else {
            let mut small = [0u8; 8];
            let e = b.recv(&mut small, 0).unwrap_err();
            assert!(
                matches!(
                    e,
                    DistError::SizeMismatch {
                        rank: 1,
                        peer: 0,
                        expected: 8,
                        got: 16,
                        ..
                    }
                ),
                "{e}"
            );
            assert_eq!(small, [0u8; 8], "the buffer was written");
            let mut right = [0u8; 16];
            b.recv(&mut right, 0).unwrap();
            assert_eq!(right, [7u8; 16]);
            let mut next = [0u8; 4];
            b.recv(&mut next, 0).unwrap();
            assert_eq!(next, [8u8; 4]);
        }
        b.barrier().unwrap();
    });
}

#[test]
fn invalid_ranks_are_errors() {
    job(2, |b| {
        let e = b.send(&[1], 2).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 2 is out of range for world size 2"),
            "{e}"
        );
        let e = b.recv(&mut [0], 5).unwrap_err();
        assert!(matches!(e, DistError::InvalidRank { given: 5, .. }), "{e}");
    });
    let e = TcpBackend::new(3, 3, "127.0.0.1:1").unwrap_err();
    assert!(matches!(e, DistError::InvalidRank { given: 3, .. }), "{e}");
}

#[test]
fn rendezvous_timeout_names_the_missing_ranks() {
    let port = free_port();
    let t = thread::spawn(move || {
        TcpBackend::with_config(cfg(1, 4, port).init_timeout(Duration::from_secs(2)))
    });
    let e =
        TcpBackend::with_config(cfg(0, 4, port).init_timeout(Duration::from_secs(1))).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, DistError::RendezvousFailed { joined: 2, missing, .. } if missing == &vec![2, 3]),
        "{msg}"
    );
    assert!(
        msg.contains("2 of 4 ranks joined, missing ranks [2, 3]"),
        "{msg}"
    );
    assert!(t.join().unwrap().is_err());
}

/// Two processes that claim rank 1 of 3: the second is refused naming the key that holds
/// the first's listener, without failing the job: it forms once rank 2 comes.
#[test]
fn a_duplicate_rank_is_refused_and_told_why() {
    use dist_store::Store;
    let port = free_port();
    let root = thread::spawn(move || TcpBackend::with_config(cfg(0, 3, port)));
    let first = thread::spawn(move || TcpBackend::with_config(cfg(1, 3, port)));
    // The first claim is in the store before the second is made.
    let store =
        dist_store::TcpStore::connect(("127.0.0.1", port), Duration::from_secs(10)).unwrap();
    store
        .wait(&["dist/0/init/addr/1"], Duration::from_secs(10))
        .unwrap();
    let e = TcpBackend::with_config(cfg(1, 3, port)).unwrap_err();
    assert!(
        matches!(&e, DistError::HandshakeRefused { rank: 1, .. })
            && e.to_string()
                .contains("duplicate rank 1: key dist/0/init/addr/1 already holds"),
        "{e}"
    );
    // The job is whole once rank 2 comes.
    let two = TcpBackend::with_config(cfg(2, 3, port)).unwrap();
    let (root, first) = (
        root.join().unwrap().unwrap(),
        first.join().unwrap().unwrap(),
    );
    let hs: Vec<_> = [root, first, two]
        .into_iter()
        .map(|b| thread::spawn(move || b.barrier()))
        .collect();
    for h in hs {
        h.join().unwrap().unwrap();
    }
}

/// A rank whose world size is not rank 0's fails the job at once: rank 0 names it, and so does
/// every other rank.
#[test]
fn a_rank_of_another_world_size_is_named() {
    let port = free_port();
    let others: Vec<_> = [(0, 3), (1, 3)]
        .into_iter()
        .map(|(r, n)| thread::spawn(move || TcpBackend::with_config(cfg(r, n, port))))
        .collect();
    let t = Instant::now();
    let e = TcpBackend::with_config(cfg(2, 5, port)).unwrap_err();
    assert!(
        matches!(
            &e,
            DistError::Aborted {
                rank: 2,
                origin: 2,
                ..
            }
        ) && e
            .to_string()
            .contains("rank 2 has a world size of 5, rank 0 of 3 (key dist/0/init/addr/2)"),
        "{e}"
    );
    for (r, h) in others.into_iter().enumerate() {
        let e = h.join().unwrap().unwrap_err();
        assert!(
            matches!(&e, DistError::Aborted { origin: 2, .. })
                && e.to_string().contains("rank 2 has a world size of 5"),
            "rank {r}: {e}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// A rank with the wrong secret is refused by the rank it connects to, and both fail at once
/// (the refused rank publishes its failure, which the other sees while it waits), not at the
/// deadline; a secret on one side only is refused too; the right secret forms the job.
#[test]
fn wrong_secret_is_refused_on_both_sides_and_right_one_joins() {
    let pair = |a: Option<&'static str>, b: Option<&'static str>| {
        let port = free_port();
        let with = move |r: usize, s: Option<&str>| {
            let c = cfg(r, 2, port);
            TcpBackend::with_config(match s {
                Some(s) => c.secret(s),
                None => c,
            })
        };
        let t = Instant::now();
        let root = thread::spawn(move || with(0, a));
        let one = with(1, b);
        (root.join().unwrap(), one, t.elapsed())
    };
    let (root, one, took) = pair(Some("right secret 16+ b"), Some("wrong secret 16+ b"));
    let e = one.unwrap_err();
    assert!(
        matches!(&e, DistError::HandshakeRefused { .. })
            && e.to_string().contains("wrong shared secret from rank 1"),
        "{e}"
    );
    let e = root.unwrap_err();
    assert!(
        matches!(&e, DistError::Aborted { origin: 1, .. })
            && e.to_string().contains("wrong shared secret from rank 1"),
        "{e}"
    );
    assert!(took < Duration::from_secs(10), "failed after {took:?}");
    let (root, one, _) = pair(Some("right secret 16+ b"), None);
    let e = one.unwrap_err();
    assert!(e.to_string().contains("requires a shared secret"), "{e}");
    assert!(root.is_err());
    let (root, one, _) = pair(Some("right secret 16+ b"), Some("right secret 16+ b"));
    assert_eq!((root.unwrap().rank(), one.unwrap().rank()), (0, 1));
}

#[test]
fn timeout_names_the_silent_peer() {
    job(2, |b| {
        let t = Instant::now();
        let e = b
            .recv_timeout(&mut [0u8; 4], 1 - b.rank(), Duration::from_millis(300))
            .unwrap_err();
        let waited = t.elapsed();
        assert!(
            matches!(e, DistError::Timeout { peer, .. } if peer == 1 - b.rank()),
            "{e}"
        );
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_millis(800),
            "{waited:?}"
        );
        b.barrier().unwrap();
    });
}

#[test]
fn rank_zeros_tuning_is_the_jobs() {
    use dist_core::{Collectives, ReduceOp, Transport};
    // Rank 0 asks for two lanes and 64 KiB pieces, the others for one lane and 512 KiB: had
    // each rank used its own, their messages would not match. A 2 MiB all_reduce takes the
    // two-ring path.
    let port = free_port();
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            thread::spawn(move || {
                let c = if r == 0 {
                    cfg(r, world, port).lanes(2).ring_piece_kb(64)
                } else {
                    cfg(r, world, port).lanes(1).ring_piece_kb(512)
                };
                let b = TcpBackend::with_config(c).unwrap();
                let count = (2 << 20) / 4 + 3;
                let mut x: Vec<f32> = (0..count).map(|i| (i % 1000 + r) as f32).collect();
                b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                for (i, v) in x.iter().enumerate() {
                    assert_eq!(*v, (3 * (i % 1000) + 3) as f32, "element {i}");
                }
                (b.lanes(), b.ring_piece())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), (2, 64 << 10));
    }
}

#[test]
fn two_lanes_inside_a_rayon_pool_take_no_other_job() {
    use dist_core::{Collectives, ReduceOp};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Each rank calls a two-ring all_reduce from the only thread of a rayon pool, with another
    // job of that pool queued: the job must not run on that thread while the collective waits
    // for its second lane.
    let port = free_port();
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            thread::spawn(move || {
                let b = TcpBackend::with_config(cfg(r, world, port).lanes(2)).unwrap();
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                let ran = Arc::new(AtomicBool::new(false));
                pool.install(|| {
                    let flag = ran.clone();
                    rayon::spawn(move || flag.store(true, Ordering::SeqCst));
                    let mut x = vec![1.0f32; (4 << 20) / 4];
                    for _ in 0..5 {
                        b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                        assert!(
                            !ran.load(Ordering::SeqCst),
                            "another job of the caller's pool ran during the collective"
                        );
                    }
                    assert!(x.iter().all(|v| *v == 243.0), "{}", x[0]);
                });
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Rank 0 gathers where every rank's calls beside its backend are (what a `HybridBackend`
/// reports for its NCCL calls) right after the ranks moved: the answer must be each rank's new
/// position, asked for by heartbeat, not the one its last periodic heartbeat carried (those go
/// out once a second here, and said "none"). The positions are past 2^24, so the 24 bits a
/// heartbeat carries are completed from rank 0's own. Fails without the ask: rank 0 then sees
/// `None` for ranks 1 and 2.
#[test]
fn positions_beside_are_asked_for_fresh() {
    use dist_core::flight::{OpState, Position};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let at = |seq: u64| Position {
        seq,
        op: "all_reduce",
        state: OpState::Done,
    };
    let port = free_port();
    let handles: Vec<_> = (0..3)
        .map(|r| {
            thread::spawn(move || {
                let cfg = cfg(r, 3, port).peer_timeout(Duration::from_secs(60));
                let b = TcpBackend::with_config(cfg).unwrap();
                let seq = Arc::new(AtomicU64::new(0));
                let source = seq.clone();
                b.report_beside(move || {
                    let s = source.load(Ordering::SeqCst);
                    (s > 0).then(|| at(s))
                });
                b.barrier().unwrap();
                seq.store((1 << 24) + 5 + r as u64, Ordering::SeqCst);
                b.barrier().unwrap();
                let got = (r == 0).then(|| b.positions_beside(Duration::from_secs(10)));
                b.barrier().unwrap();
                got
            })
        })
        .collect();
    let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let want: Vec<_> = (0..3)
        .map(|r| (r, Some(at((1 << 24) + 5 + r as u64))))
        .collect();
    assert_eq!(got[0].as_ref().unwrap(), &want);
}

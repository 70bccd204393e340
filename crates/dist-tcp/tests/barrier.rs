//! The barrier is a collective: it carries the call's descriptor, so a barrier against another
//! collective is a mismatch on every rank at once, not a wait until the deadline.

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp};
use dist_tcp::TcpBackend;

#[test]
fn a_barrier_against_an_all_reduce_is_a_mismatch_on_every_rank_at_once() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let world = 3;
    // Every rank leaves the first barrier before any starts the mismatched call: a rank that
    // finishes it early would otherwise abort a slower rank still inside it (seen in CI).
    let all_out = std::sync::Arc::new(std::sync::Barrier::new(world));
    let ranks: Vec<_> = (0..world)
        .map(|r| {
            let all_out = all_out.clone();
            thread::spawn(move || {
                let b = TcpBackend::builder(r, world, format!("127.0.0.1:{port}"))
                    .timeout(Duration::from_secs(20))
                    .linger(Duration::from_secs(2))
                    .with_config_now();
                b.barrier().unwrap();
                all_out.wait();
                let t = Instant::now();
                let e = if r == 1 {
                    b.barrier().unwrap_err()
                } else {
                    b.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap_err()
                };
                (r, e, t.elapsed())
            })
        })
        .collect();
    for h in ranks {
        let (r, e, took) = h.join().unwrap();
        eprintln!("rank {r} after {took:.2?}: {e}");
        let text = e.to_string();
        assert!(
            matches!(
                e,
                DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
            ),
            "rank {r}: {e}"
        );
        assert!(
            text.contains("barrier") && text.contains("all_reduce"),
            "rank {r}: {text}"
        );
        assert!(took < Duration::from_secs(2), "rank {r} took {took:?}");
    }
}

trait Join {
    fn with_config_now(self) -> TcpBackend;
}

impl Join for dist_tcp::TcpConfig {
    fn with_config_now(self) -> TcpBackend {
        TcpBackend::with_config(self).unwrap()
    }
}

#[test]
fn a_collective_takes_a_timeout_of_its_own() {
    use dist_core::Within;
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            thread::spawn(move || {
                let b = TcpBackend::builder(r, 2, format!("127.0.0.1:{port}"))
                    .timeout(Duration::from_secs(30))
                    .linger(Duration::from_secs(2))
                    .with_config_now();
                if r == 1 {
                    let t = Instant::now();
                    let e = b
                        .within(Duration::from_millis(300))
                        .all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
                        .unwrap_err();
                    let took = t.elapsed();
                    b.send_tagged(b"done", 0, dist_core::Tag::user(1)).unwrap();
                    return Some((e, took));
                }
                // Rank 0 calls nothing collective; it waits for rank 1 to be done.
                b.recv_tagged_timeout(
                    &mut [0u8; 4],
                    1,
                    dist_core::Tag::user(1),
                    Duration::from_secs(10),
                )
                .unwrap();
                None
            })
        })
        .collect();
    let (e, took) = ranks
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .next()
        .unwrap();
    eprintln!("{e} (after {took:.2?})");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}: {e}"
    );
}

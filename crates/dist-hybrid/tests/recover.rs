//! `HybridBackend::recover` without NCCL (ranks as threads, loopback TCP; runs with or without
//! GPUs): three ranks, rank 2 leaves (its backend dropped), the other two recover into a
//! backend of two whose collectives work, numbered in the old order.

use std::net::TcpListener;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use dist_core::{Backend, ReduceOp};
use dist_hybrid::{GpuChoice, HybridBackend};
use dist_nccl::CommConfig;
use dist_tcp::TcpBackend;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Rank `rank` of three on `port`, TCP only, with a short peer timeout (the recovery waits at
/// most that long for a rank it does not know failed).
fn hybrid(rank: usize, port: u16) -> HybridBackend {
    let tcp = TcpBackend::with_config(
        TcpBackend::builder(rank, 3, format!("127.0.0.1:{port}"))
            .init_timeout(Duration::from_secs(20))
            .timeout(Duration::from_secs(20))
            .peer_timeout(Duration::from_secs(2)),
    )
    .unwrap();
    HybridBackend::with_nccl(tcp, rank, GpuChoice::None, None, CommConfig::default()).unwrap()
}

#[test]
fn the_survivors_recover_into_a_working_backend_of_two() {
    let port = free_port();
    let (gone_tx, gone_rx) = mpsc::channel::<()>();
    let leaver = thread::spawn(move || {
        let h = hybrid(2, port);
        let mut x = [1.0f32; 4];
        h.all_reduce(&mut x[..], ReduceOp::Sum).unwrap();
        drop(h);
        gone_tx.send(()).unwrap();
    });
    let gone_rx = std::sync::Arc::new(std::sync::Mutex::new(gone_rx));
    let survivors: Vec<_> = (0..2)
        .map(|r| {
            let gone = gone_rx.clone();
            thread::spawn(move || {
                let h = hybrid(r, port);
                let mut x = [1.0f32; 4];
                h.all_reduce(&mut x[..], ReduceOp::Sum).unwrap();
                assert_eq!(x, [3.0; 4], "rank {r} before");
                // Rank 0 recovers once rank 2 has left; rank 1 at once, and waits in the
                // agreement (at most the peer timeout) for rank 2, which never checks in.
                if r == 0 {
                    gone.lock()
                        .unwrap()
                        .recv_timeout(Duration::from_secs(30))
                        .unwrap();
                }
                let h = h
                    .recover(Duration::from_secs(30))
                    .unwrap_or_else(|e| panic!("rank {r}: recover: {e}"));
                assert!(h.nccl().is_none(), "rank {r}: NCCL appeared");
                assert_eq!(h.tcp().epoch(), 1, "rank {r}");
                assert_eq!(h.tcp().members(), &[0, 1], "rank {r}");
                assert_eq!((h.rank(), h.world_size()), (r, 2), "rank {r}");
                let mut y = [(r + 1) as f32; 4];
                h.all_reduce(&mut y[..], ReduceOp::Sum).unwrap();
                assert_eq!(y, [3.0; 4], "rank {r} after");
                h.barrier().unwrap();
            })
        })
        .collect();
    leaver.join().unwrap();
    for s in survivors {
        s.join().unwrap();
    }
}

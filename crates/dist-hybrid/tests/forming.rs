//! Forming a hybrid job in one process (ranks as threads, loopback TCP): which GPU each rank
//! takes, and what happens when NCCL is asked for but some rank cannot have a GPU. Runs with
//! or without GPUs: every case arranges for at least one rank to have none.

use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use dist_core::Backend;
use dist_hybrid::{GpuChoice, HostId, HybridBackend, HybridError, LocalRanks, local_ranks};
use dist_nccl::{CommConfig, UniqueId};
use dist_tcp::TcpBackend;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tcp(rank: usize, world: usize, port: u16) -> TcpBackend {
    TcpBackend::with_config(
        TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
            .init_timeout(Duration::from_secs(20))
            .timeout(Duration::from_secs(20)),
    )
    .unwrap()
}

/// Runs `f(rank, port)` for every rank of a fresh job, each in its own thread.
fn job<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, u16) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port();
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || f(r, port))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// More ranks than this machine has GPUs, so that some rank has none of its own.
fn world() -> usize {
    (dist_nccl::cuda_device_count() + 1).max(2)
}

#[test]
fn local_ranks_follow_the_host_not_the_global_rank() {
    // Hosts simulated by identity: ranks 0, 2 on host "a", ranks 1, 3 on host "b", as a
    // round-robin launcher would place them. Before, rank 2 took GPU 2 (its global rank).
    let got = job(4, |r, port| {
        let t = tcp(r, 4, port);
        let host = HostId::of(&[if r % 2 == 0 { "a" } else { "b" }]);
        local_ranks(&t, host).unwrap()
    });
    let want = |local_rank| LocalRanks {
        local_rank,
        local_size: 2,
    };
    assert_eq!(got, [want(0), want(0), want(1), want(1)]);
}

#[test]
fn an_explicit_device_that_some_rank_lacks_is_an_error_on_every_rank() {
    let n = world();
    let got = job(n, move |r, port| {
        // Only the last rank asks for a device that exists nowhere; the others say Auto.
        let gpu = if r == n - 1 {
            GpuChoice::Device(10_000)
        } else {
            GpuChoice::Auto
        };
        HybridBackend::with_nccl(tcp(r, n, port), r, gpu, None, CommConfig::default())
    });
    for (r, res) in got.into_iter().enumerate() {
        match res {
            Err(e @ HybridError::GpuMissing { .. }) => {
                let text = e.to_string();
                let HybridError::GpuMissing {
                    rank,
                    asked,
                    without,
                } = e
                else {
                    unreachable!()
                };
                assert_eq!(rank, r);
                assert_eq!(asked, [n - 1]);
                assert!(without.contains(&(n - 1)), "rank {r}: {without:?}");
                assert!(
                    text.starts_with(&format!("rank {r}: NCCL was asked for")),
                    "{text}"
                );
            }
            other => panic!("rank {r}: expected GpuMissing, got {other:?}"),
        }
    }
}

#[test]
fn a_unique_id_means_nccl_is_required() {
    // `new` with an id used to fall back to TCP silently when a rank had no GPU.
    let n = world();
    let got = job(n, move |r, port| {
        let id = UniqueId::from_bytes(&[7u8; 128]).unwrap();
        HybridBackend::new(r, n, &format!("127.0.0.1:{port}"), &id)
    });
    for (r, res) in got.into_iter().enumerate() {
        match res {
            Err(HybridError::GpuMissing { asked, without, .. }) => {
                assert_eq!(asked, (0..n).collect::<Vec<_>>());
                assert!(!without.is_empty(), "rank {r}");
            }
            other => panic!("rank {r}: expected GpuMissing, got {other:?}"),
        }
    }
}

#[test]
fn auto_falls_back_to_tcp_on_every_rank_and_says_why() {
    let n = world();
    let got = job(n, move |r, port| {
        let t = tcp(r, n, port);
        let timeout = t.default_timeout();
        let h =
            HybridBackend::with_nccl(t, r, GpuChoice::Auto, None, CommConfig::default()).unwrap();
        // The NCCL side of a job formed from a TCP one gets the TCP job's timeout.
        assert_eq!(dist_hybrid::nccl_config_for(h.tcp()).timeout, timeout);
        (h.nccl().is_none(), h.why_no_nccl().map(str::to_owned))
    });
    for (r, (tcp_only, why)) in got.into_iter().enumerate() {
        assert!(tcp_only, "rank {r} formed NCCL");
        let why = why.unwrap();
        assert!(
            why.contains("no CUDA device") || why.contains("no GPU of its own"),
            "rank {r}: {why}"
        );
    }
}

/// A hybrid backend gives its job's store, the TCP mesh's (under the job's `user` prefix): a
/// key one rank sets, every rank reads, and a counter every rank adds to.
#[test]
fn the_hybrid_backend_gives_the_jobs_store() {
    use dist_tcp::dist_store::Store;
    let wait = Duration::from_secs(10);
    let got = job(3, move |r, port| {
        let h = HybridBackend::with_nccl(
            tcp(r, 3, port),
            r,
            GpuChoice::None,
            None,
            CommConfig::default(),
        )
        .unwrap();
        let store = h.store();
        assert_eq!(store.prefix(), h.tcp().store().prefix());
        if r == 2 {
            store.set("checkpoint", b"step 1200").unwrap();
        }
        let v = store.get("checkpoint", wait).unwrap();
        store.add("seen", 1).unwrap();
        store.barrier("seen-all", 3, wait).unwrap();
        (v, store.add("seen", 0).unwrap())
    });
    for (r, (v, seen)) in got.into_iter().enumerate() {
        assert_eq!((v.as_slice(), seen), (&b"step 1200"[..], 3), "rank {r}");
    }
}

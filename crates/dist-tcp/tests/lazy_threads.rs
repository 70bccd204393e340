//! The threads a lazily formed job costs, counted in a test binary of its own: a count of the
//! process's threads is only this job's when no other test runs beside it (in the library's
//! unit tests it once counted 346 for 256 ranks, the other tests' threads among them).

use std::net::TcpListener;
use std::time::Duration;

use dist_tcp::TcpConfig;
use dist_tcp::testing::form_lazy;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn threads_now() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("/proc/self/status has a thread count")
}

/// 256 ranks form lazily as threads, through the store rank 0 serves: no rank connects to
/// another, and formation costs one thread per rank (its accept thread) and the store's
/// one, where the eager mesh needs a thread per peer.
#[test]
fn a_few_hundred_ranks_form_lazily() {
    const N: usize = 256;
    let before = threads_now();
    let port = free_port();
    let ranks: Vec<_> = (0..N)
        .map(|r| {
            std::thread::Builder::new()
                .name(format!("lazy-rank-{r}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    let cfg = TcpConfig::new(r, N, format!("127.0.0.1:{port}"))
                        .init_timeout(Duration::from_secs(60));
                    form_lazy(&cfg, Box::new(|_, _| false)).unwrap_or_else(|e| panic!("{e}"))
                })
                .unwrap()
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let during = threads_now().saturating_sub(before);
    // Each rank's accept thread (the rank threads have ended) and rank 0's store server, whose
    // one event loop serves every rank's connection; no handshake ran, so no worker.
    assert!(
        during <= N + 1,
        "{during} threads for {N} ranks (bound {})",
        N + 1
    );
    for (r, formed) in ranks.iter().enumerate() {
        let connected = formed.streams.iter().filter(|s| s.is_some()).count();
        assert_eq!(connected, 0, "rank {r}");
    }
}

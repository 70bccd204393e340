//! The threads a lazily formed job costs, counted in a test binary of its own: a count of the
//! process's threads is only this job's when no other test runs beside it (in the library's
//! unit tests it once counted 346 for 256 ranks, the other tests' threads among them).

use std::net::TcpListener;
use std::time::Duration;

use dist_tcp::TcpConfig;
use dist_tcp::testing::form_lazy;

/// The most threads a rank's acceptor runs handshakes on (`init/acceptor.rs`).
const HANDSHAKE_WORKERS: usize = 4;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How many children rank `r` has in the tree the table of listeners goes down
/// (`init/tree.rs`): the ranks `r + 2^k < world` with `2^k > r`.
fn tree_children(r: usize, world: usize) -> usize {
    let first = (r + 1).next_power_of_two();
    std::iter::successors(Some(first), |s| s.checked_mul(2))
        .take_while(|s| r + s < world)
        .count()
}

fn threads_now() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("/proc/self/status has a thread count")
}

/// 256 ranks form lazily as threads: each rank connects to rank 0 (and its neighbours in the
/// table's tree, whose connections this test drops), and formation costs
/// a bounded number of threads per rank (its accept thread; rank 0 a few handshake workers
/// until they are idle), where the eager mesh needs a thread per peer.
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
    // Each rank's accept thread (the rank threads have ended; rank 0 keeps no listener after
    // formation), rank 0's handshake workers, and the workers each rank's acceptor ran its
    // children's handshakes on, in the table's tree (at most one per child, at most
    // HANDSHAKE_WORKERS; they end once idle); nothing else runs in this process.
    let tree_workers: usize = (1..N)
        .map(|r| tree_children(r, N).min(HANDSHAKE_WORKERS))
        .sum();
    assert!(
        during <= N + HANDSHAKE_WORKERS + tree_workers,
        "{during} threads for {N} ranks (bound {})",
        N + HANDSHAKE_WORKERS + tree_workers
    );
    for (r, formed) in ranks.iter().enumerate() {
        let connected = formed.streams.iter().filter(|s| s.is_some()).count();
        assert_eq!(connected, if r == 0 { N - 1 } else { 1 }, "rank {r}");
    }
}

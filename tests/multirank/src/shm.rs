//! Shared memory between ranks of one host: every collective and point-to-point
//! size over the rings (and over TCP with `DIST_SHM=0`), a job of several hosts in which only
//! the ranks of one host share memory (hosts simulated by `DIST_HOST_ID`, or network
//! namespaces), and a rank killed with SIGKILL in the middle of a loop of collectives.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, Tag};
use dist_multirank::{Case, Variant, config, fill, first_difference, seed};
use dist_tcp::TcpBackend;

use crate::{coll, failures};

/// The cases, registered in `main.rs`.
pub const CASES: &[Case] = &[
    Case::new("shm_coll", coll_all)
        .sizes(&[2, 3, 4, 5, 6, 7, 8])
        .variants(&[NO_SHM]),
    Case::new("shm_coll_large", coll_large).sizes(&[3, 6]),
    Case::new("shm_p2p", p2p)
        .sizes(&[2, 3, 5])
        .variants(&[NO_SHM]),
    Case::new("shm_mixed", mixed).sizes(&[4, 5, 6]),
    Case::new("hosts2_shm_mixed", mixed).hosts(2).sizes(&[4]),
    Case::new("shm_sigkill", sigkill).only_at(&[4]),
];

/// The same case over TCP only.
const NO_SHM: Variant = Variant {
    name: "shm0",
    sizes: &[3],
    env: &[("DIST_SHM", "0")],
};

fn shm_on() -> bool {
    std::env::var("DIST_SHM").map_or(true, |v| v != "0")
}

/// Checks that frames to and from each peer take shared memory exactly when `same_host(peer)`
/// (and shared memory is on).
fn expect_shared(b: &TcpBackend, same_host: &dyn Fn(usize) -> bool) {
    let me = b.rank();
    for p in (0..b.world_size()).filter(|&p| p != me) {
        let want = shm_on() && same_host(p);
        assert_eq!(
            b.shared_memory_with(p),
            (want, want),
            "rank {me}: shared memory with rank {p} (to, from)"
        );
    }
}

fn join() -> TcpBackend {
    TcpBackend::with_config(config()).unwrap_or_else(|e| panic!("init failed: {e}"))
}

/// Every collective, every type, op, count and root, with every pair of ranks on the rings.
fn coll_all() -> Result<(), String> {
    let b = join();
    expect_shared(&b, &|_| true);
    expect_memfd_rings(&b);
    let t = Instant::now();
    coll::all_on(&b, false);
    println!(
        "rank {}: collectives verified over {} in {:.1?}",
        b.rank(),
        if shm_on() { "shared memory" } else { "TCP" },
        t.elapsed()
    );
    Ok(())
}

/// The large collectives (pieces of a MiB and more, each many times the ring) over the rings.
fn coll_large() -> Result<(), String> {
    let b = join();
    expect_shared(&b, &|_| true);
    coll::all_on(&b, true);
    Ok(())
}

/// Every ordered pair exchanges messages around the ring's sizes (a frame header is 40 bytes,
/// the ring 1 MiB) and far beyond, both ways at once; every byte is checked.
fn p2p() -> Result<(), String> {
    let b = join();
    expect_shared(&b, &|_| true);
    let (me, n) = (b.rank(), b.world_size());
    let sizes = [
        0usize,
        1,
        40,
        4096,
        (1 << 20) - 40,
        1 << 20,
        (1 << 20) + 1,
        24 << 20,
    ];
    for (k, &size) in sizes.iter().enumerate() {
        let mut out = vec![0u8; size];
        let mut inb = vec![0u8; size];
        let tag = Tag::user(k as u32);
        for shift in 1..n {
            let (dst, src) = ((me + shift) % n, (me + n - shift) % n);
            fill(&mut out, seed(me, dst, size as u64));
            inb.fill(0xAA);
            std::thread::scope(|s| {
                let sender = s.spawn(|| b.send_tagged(&out, dst, tag));
                b.recv_tagged(&mut inb, src, tag)
                    .unwrap_or_else(|e| panic!("{e}"));
                sender.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
            });
            if let Some(at) = first_difference(&inb, seed(src, me, size as u64)) {
                panic!("{size} bytes from rank {src}: wrong byte at offset {at}");
            }
        }
    }
    // Many small messages queued before their receives: they wait in the ring and the queue.
    let to = (me + 1) % n;
    let from = (me + n - 1) % n;
    for i in 0..2000u32 {
        b.send_tagged(&i.to_le_bytes(), to, Tag::user(100)).unwrap();
    }
    for i in 0..2000u32 {
        let mut x = [0u8; 4];
        b.recv_tagged(&mut x, from, Tag::user(100)).unwrap();
        assert_eq!(u32::from_le_bytes(x), i, "message {i} from rank {from}");
    }
    b.barrier().unwrap();
    Ok(())
}

/// A job over several hosts: ranks of one host share memory, the others talk TCP, and every
/// collective is right. On the namespace hosts the launcher makes (`DIST_TEST_HOST`), hosts
/// are real network namespaces; otherwise ranks 2k and 2k+1 claim one host by `DIST_HOST_ID`.
fn mixed() -> Result<(), String> {
    let me: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let host = match std::env::var("DIST_TEST_HOST") {
        Ok(h) => h.parse::<u64>().unwrap(),
        Err(_) => (me / 2) as u64,
    };
    let cfg = if std::env::var_os("DIST_TEST_HOST").is_some() {
        config()
    } else {
        config().host_id(format!("simulated-{host}"))
    };
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    let n = b.world_size();
    let mut hosts = vec![0u64; n];
    b.all_gather(&[host], &mut hosts).unwrap();
    expect_shared(&b, &|p| hosts[p] == host);
    let sharing = (0..n).filter(|&p| p != me && hosts[p] == host).count();
    println!(
        "rank {me} on host {host}: shared memory with {sharing} of {} peers",
        n - 1
    );
    coll::all_on(&b, false);
    Ok(())
}

fn dev_shm() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Rank 3 killed with SIGKILL in the middle of a loop of all_reduces over the rings: every
/// survivor errors within 1 s of its last good all_reduce, naming rank 3, and `/dev/shm` holds
/// nothing new afterwards (the rings are memfd mappings: see [`expect_memfd_rings`]).
fn sigkill() -> Result<(), String> {
    let before = dev_shm();
    failures::victim_loop("KILL", Duration::from_secs(1))?;
    let new: Vec<_> = dev_shm().difference(&before).cloned().collect();
    assert!(new.is_empty(), "new in /dev/shm after the kill: {new:?}");
    Ok(())
}

/// While the job is up, this rank maps one ring per direction per peer, each an anonymous
/// memfd (never a file in `/dev/shm`).
fn expect_memfd_rings(b: &TcpBackend) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let rings = maps
        .lines()
        .filter(|l| l.contains("memfd:dist-shm-ring"))
        .count();
    let want = if shm_on() {
        2 * (b.world_size() - 1)
    } else {
        0
    };
    assert_eq!(rings, want, "ring mappings of rank {}:\n{maps}", b.rank());
    assert!(
        !maps.contains("/dev/shm/"),
        "a mapping in /dev/shm:\n{maps}"
    );
}

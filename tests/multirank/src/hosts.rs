//! Cases on simulated hosts (network namespaces joined by a bridge, see `dist_launch::hosts`;
//! the launcher makes them, these cases need root): collectives with ranks spread over 2 and 3
//! hosts, a host cut off in the middle of a loop of all_reduces, and a host whose ranks start
//! 5 s late. Ranks go to hosts in blocks (4 ranks on 2 hosts: 0 and 1 on host 0, 2 and 3 on
//! host 1); `DIST_TEST_HOST` tells a rank its host.

use std::process::Command;
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, ReduceOp};
use dist_multirank::{Case, TWO_LANES, config};
use dist_tcp::TcpBackend;

use crate::{coll, p2p};

/// The cases, each at the world sizes and on the number of hosts it declares.
pub const CASES: &[Case] = &[
    Case::new("hosts2_p2p_pairs", || {
        p2p::pairs();
        Ok(())
    })
    .hosts(2)
    .sizes(&[4]),
    Case::new("hosts2_coll_reductions", || {
        coll::reductions_all();
        Ok(())
    })
    .hosts(2)
    .sizes(&[4])
    .variants(&[HOSTS_LANES2]),
    Case::new("hosts3_coll_reductions", || {
        coll::reductions_all();
        Ok(())
    })
    .hosts(3)
    .sizes(&[5]),
    Case::new("hosts3_coll_movement", || {
        coll::movement_all();
        Ok(())
    })
    .hosts(3)
    .sizes(&[4]),
    Case::new("hosts3_coll_peer_death", || {
        coll::peer_death();
        Ok(())
    })
    .hosts(3)
    .sizes(&[3]),
    Case::new("hosts3_cut", cut).hosts(3).only_at(&[6]),
    Case::new("hosts2_late", late).hosts(2).sizes(&[4]),
    Case::new("hosts3_hier", hierarchical)
        .hosts(3)
        .sizes(&[4, 5]),
    Case::new("hosts2_hier", hierarchical).hosts(2).sizes(&[5]),
    // Also run by the harness's `hosts_sealed_path_*` trials, on a hostile path.
    Case::new("hosts2_sealed_path", crate::hosts_sealed::sealed_path)
        .hosts(2)
        .only_at(&[2]),
];

/// Two lanes, as [`TWO_LANES`], at 4 ranks only.
const HOSTS_LANES2: dist_multirank::Variant = dist_multirank::Variant {
    sizes: &[4],
    ..TWO_LANES
};

/// The peer timeout of [`cut`].
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// The all_reduces every rank completes before the last host is cut off.
const BEFORE: u64 = 50;

/// This rank's host, as the launcher says.
fn env(key: &str) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} is not set: run on simulated hosts"))
}

/// Takes this rank's host off the network: `eth0` down in its own namespace (checked to be the
/// one the launcher made, never the root namespace).
fn cut_off_this_host() {
    let ns = std::env::var("DIST_TEST_NETNS").expect("DIST_TEST_NETNS");
    let here = Command::new("ip")
        .args(["netns", "identify", &std::process::id().to_string()])
        .output()
        .expect("run ip netns identify");
    assert_eq!(
        String::from_utf8_lossy(&here.stdout).trim(),
        ns,
        "not in this host's namespace: refusing to take a link down"
    );
    let st = Command::new("ip")
        .args(["link", "set", IFACE, "down"])
        .status()
        .expect("run ip link set");
    assert!(st.success(), "ip link set eth0 down: {st}");
}

/// The interface that joins a simulated host to the others (`dist_launch::hosts::IFACE`).
const IFACE: &str = "eth0";

/// 6 ranks on 3 hosts run all_reduces; before its 51st, host 2 (ranks 4 and 5) takes its link
/// down. Every survivor errors within the peer timeout + 2 s of its last good all_reduce, its
/// error naming rank 4 or 5 as unresponsive; the ranks of host 2 error too (not checked further).
pub fn cut() -> Result<(), String> {
    let b = TcpBackend::with_config(
        config()
            .timeout(Duration::from_secs(30))
            .peer_timeout(PEER_TIMEOUT)
            .linger(Duration::from_secs(1)),
    )
    .unwrap_or_else(|e| panic!("init failed: {e}"));
    let (me, n) = (b.rank(), b.world_size());
    let (host, hosts) = (env("DIST_TEST_HOST"), env("DIST_TEST_HOSTS"));
    let mut all = vec![0u32; n];
    b.all_gather(&[host as u32], &mut all).unwrap();
    let cut_host = (hosts - 1) as u32;
    let victims: Vec<usize> = (0..n).filter(|r| all[*r] == cut_host).collect();
    assert!(!victims.is_empty() && !victims.contains(&0), "{victims:?}");
    let cutter = victims[0];
    b.barrier().unwrap();
    let mut x = vec![1.0f32; 1024];
    let mut k = 0u64;
    let mut last_ok = Instant::now();
    let start = Instant::now();
    let e = loop {
        if me == cutter && k == BEFORE {
            cut_off_this_host();
            println!("rank {me}: host {host} cut off after {k} all_reduces");
        }
        match b.all_reduce(&mut x, ReduceOp::Max) {
            Ok(()) => {
                last_ok = Instant::now();
                k += 1;
            }
            Err(e) => break e,
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no error after {k} all_reduces"
        );
    };
    let took = last_ok.elapsed();
    println!("rank {me} (host {host}): after {k} all_reduces, error {took:.2?} later: {e}");
    if victims.contains(&me) {
        return Ok(());
    }
    assert_eq!(k, BEFORE, "failed before host {cut_host} was cut off: {e}");
    assert!(
        e.peer().is_some_and(|p| victims.contains(&p)),
        "the error names no rank of host {cut_host} ({victims:?}): {e}"
    );
    let text = e.to_string();
    assert!(text.contains("unresponsive"), "{text}");
    let bound = PEER_TIMEOUT + Duration::from_secs(2);
    assert!(took < bound, "error after {took:?}, bound {bound:?}: {e}");
    Ok(())
}

/// How late the ranks of the last host start.
const LATE: Duration = Duration::from_secs(5);

/// 4 ranks on 2 hosts; those of host 1 start 5 s after the others. The job forms within its init
/// timeout (20 s), rank 0 having waited at least the 5 s, and runs: a checked all_reduce.
pub fn late() -> Result<(), String> {
    let init_timeout = Duration::from_secs(20);
    let host = env("DIST_TEST_HOST");
    let late = host == env("DIST_TEST_HOSTS") - 1;
    if late {
        // The scenario itself, not a wait for something: this host boots late.
        std::thread::sleep(LATE);
    }
    let t = Instant::now();
    let b = TcpBackend::with_config(config().init_timeout(init_timeout))
        .unwrap_or_else(|e| panic!("init failed: {e}"));
    let formed = t.elapsed();
    let (me, n) = (b.rank(), b.world_size());
    println!("rank {me} (host {host}, late: {late}): formed in {formed:.2?}");
    if me == 0 {
        assert!(
            formed >= LATE && formed < init_timeout,
            "rank 0 formed in {formed:?}"
        );
    }
    let mut x: Vec<u64> = (0..4099).map(|i| (me * 1000 + i) as u64).collect();
    b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let base = (n * (n - 1) / 2 * 1000) as u64;
    for (i, v) in x.iter().enumerate() {
        assert_eq!(*v, base + (n * i) as u64, "element {i}");
    }
    b.barrier().unwrap();
    Ok(())
}

/// Rank `r`'s element `i` in [`hierarchical`].
fn own(r: usize, i: usize) -> u64 {
    (r * 1_000_003 + i * 7) as u64
}

/// Ranks spread unevenly over the hosts (4 on 3 hosts: 2, 1 and 1; 5 on 3: 2, 2 and 1; 5 on 2:
/// 3 and 2): the collectives take the hosts' path (`collectives/hier/`) from the first, which
/// holds the group's arena vote, and broadcast, reduce, gather and scatter from every root,
/// all_gather, reduce_scatter and the barrier give what a sequential reference says, at 0, 1,
/// 1,000 and 70,001 elements (past the chain's and the ring's limits), and 70,001 bytes.
pub fn hierarchical() -> Result<(), String> {
    use dist_core::collectives::{Kind, Transport, collective_path};
    let b = dist_multirank::join();
    let (me, n) = (b.rank(), b.world_size());
    let host = env("DIST_TEST_HOST");
    let mut x = [0u64; 3];
    b.broadcast(&mut x, n - 1).unwrap();
    for kind in [
        Kind::Broadcast,
        Kind::Reduce,
        Kind::Gather,
        Kind::Scatter,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::Barrier,
    ] {
        let path = collective_path(b.group(), kind, 1000, 8000);
        assert_eq!(path, "hosts", "rank {me} (host {host}): {kind:?}");
    }
    for count in [0usize, 1, 1000, 70_001] {
        let mine: Vec<u64> = (0..count).map(|i| own(me, i)).collect();
        let sum = |i: usize| (0..n).map(|r| own(r, i)).sum::<u64>();
        for root in 0..n {
            let mut x = mine.clone();
            b.broadcast(&mut x, root).unwrap();
            assert!(
                x.iter().enumerate().all(|(i, v)| *v == own(root, i)),
                "broadcast {count} from {root}"
            );
            let mut x = mine.clone();
            b.reduce(&mut x, ReduceOp::Sum, root).unwrap();
            if me == root {
                assert!(
                    x.iter().enumerate().all(|(i, v)| *v == sum(i)),
                    "reduce {count} to {root}"
                );
            }
            let mut all = vec![0u64; count * n];
            b.gather(&mine, (me == root).then_some(&mut all[..]), root)
                .unwrap();
            if me == root {
                let want = |j: usize| own(j / count.max(1), j % count.max(1));
                assert!(
                    all.iter().enumerate().all(|(j, v)| *v == want(j)),
                    "gather {count} to {root}"
                );
            }
            let src: Vec<u64> = (0..count * n).map(|j| own(root, j)).collect();
            let mut got = vec![0u64; count];
            b.scatter((me == root).then_some(&src[..]), &mut got, root)
                .unwrap();
            assert_eq!(
                got[..],
                src[me * count..(me + 1) * count],
                "scatter {count} from {root}"
            );
        }
        let mut all = vec![0u64; count * n];
        b.all_gather(&mine, &mut all).unwrap();
        for r in 0..n {
            let block = &all[r * count..(r + 1) * count];
            assert!(
                block.iter().enumerate().all(|(i, v)| *v == own(r, i)),
                "all_gather {count}: block {r}"
            );
        }
        let input: Vec<u64> = (0..count * n).map(|j| own(me, j)).collect();
        let mut out = vec![0u64; count];
        b.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
        let want: Vec<u64> = (0..count).map(|i| sum(me * count + i)).collect();
        assert_eq!(out, want, "reduce_scatter {count}");
        let bytes: Vec<u8> = (0..count).map(|i| (me * 31 + i) as u8).collect();
        let mut all = vec![0u8; count * n];
        b.all_gather(&bytes, &mut all).unwrap();
        assert!(
            all.iter()
                .enumerate()
                .all(|(j, v)| { *v == ((j / count.max(1)) * 31 + j % count.max(1)) as u8 }),
            "all_gather of {count} bytes"
        );
        b.barrier().unwrap();
    }
    println!("rank {me} (host {host}): the hosts' collectives verified");
    Ok(())
}

//! The hierarchical collectives (`collectives/hier/`) over the in-memory link with hosts:
//! broadcast, reduce, gather, scatter, all_gather, reduce_scatter and barrier at uneven layouts
//! (hosts of 1, 2 and 3 ranks, ranks of a host not consecutive), the root on every host, sizes
//! 0, small, not divisible by the ranks or hosts, and past the chain's and the ring's limits,
//! each result compared with the flat path's on a link without hosts; the bytes that cross
//! between hosts, counted per collective, against what each host needs once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::super::desc::{Desc, Kind};
use super::super::scratch::bytes;
use super::super::{COLLECTIVE_TAG, collective_path};
use super::matrix::{TIMEOUT, inputs};
use crate::testing::{Delivery, MemLink, run_links};
use crate::{Backend, Collectives, Element, Group, ReduceOp, Result, Tuning};

const SLOT: usize = 4 << 10;

/// Layouts of hosts of 1, 2 and 3 ranks, some with a host's ranks apart.
const LAYOUTS: &[&[usize]] = &[
    &[0, 1, 1, 2, 2, 2],
    &[2, 1, 1, 2, 0, 2, 1],
    &[0, 0, 1],
    &[3, 5, 3, 5, 5],
    &[4, 4, 4, 9],
];

/// Rank `r`'s element `i`, distinct per rank and position.
fn own(r: usize, i: usize) -> u32 {
    (r * 100_003 + i * 7) as u32
}

/// Every collective of `count` elements from each root of `roots`; what each rank received
/// (the root's only, for gather and reduce), as bytes, in call order.
fn script(g: &Group<MemLink>, count: usize, roots: &[usize]) -> Result<Vec<Vec<u8>>> {
    let (me, n) = (g.rank(), g.world_size());
    let mut got = Vec::new();
    for &root in roots {
        let mut x: Vec<u32> = (0..count).map(|i| own(me, i)).collect();
        g.broadcast(&mut x, root)?;
        got.push(bytes(&x).to_vec());
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PreMulSum(2.0)] {
            let mut x = inputs::<f32>(op, me, count);
            g.reduce(&mut x, op, root)?;
            if me == root {
                got.push(bytes(&x).to_vec());
            }
        }
        for op in [ReduceOp::Max, ReduceOp::BitXor] {
            let input = inputs::<i64>(op, me, count);
            let mut out = vec![0i64; count];
            g.reduce_into(&input, &mut out, op, root)?;
            if me == root {
                got.push(bytes(&out).to_vec());
            }
        }
        let input: Vec<u32> = (0..count).map(|i| own(me, i)).collect();
        let mut all = vec![0u32; count * n];
        g.gather(&input, (me == root).then_some(&mut all[..]), root)?;
        if me == root {
            got.push(bytes(&all).to_vec());
        }
        let all: Vec<u32> = (0..count * n).map(|i| own(root, i)).collect();
        let mut mine = vec![0u32; count];
        g.scatter((me == root).then_some(&all[..]), &mut mine, root)?;
        got.push(bytes(&mine).to_vec());
    }
    let input: Vec<u32> = (0..count).map(|i| own(me, i)).collect();
    let mut all = vec![0u32; count * n];
    g.all_gather(&input, &mut all)?;
    got.push(bytes(&all).to_vec());
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min] {
        let input = inputs::<f32>(op, me, count * n);
        let mut out = vec![0f32; count];
        g.reduce_scatter(&input, &mut out, op)?;
        got.push(bytes(&out).to_vec());
    }
    let input = inputs::<u8>(ReduceOp::BitOr, me, count * n);
    let mut out = vec![0u8; count];
    g.reduce_scatter(&input, &mut out, ReduceOp::BitOr)?;
    got.push(bytes(&out).to_vec());
    g.barrier()?;
    Ok(got)
}

/// What every rank received from `f` on the link `links`, rank by rank.
fn outcomes(
    links: Vec<MemLink>,
    f: impl Fn(&Group<MemLink>) -> Result<Vec<Vec<u8>>> + Sync,
) -> Vec<Vec<Vec<u8>>> {
    let results = run_links(links, |l| f(&Group::form(l, Tuning::default(), TIMEOUT)?));
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// Runs `script` for each of `counts` on `hosts` hierarchically and flat; the results must be
/// alike, and the hierarchical run must have taken the hosts' path.
fn alike(hosts: &[usize], counts: &[usize], every_root: bool) {
    let n = hosts.len();
    let roots: Vec<usize> = if every_root {
        (0..n).collect()
    } else {
        vec![0, n - 1]
    };
    let run = |g: &Group<MemLink>| -> Result<Vec<Vec<u8>>> {
        let mut got = Vec::new();
        for &count in counts {
            got.extend(script(g, count, &roots)?);
        }
        Ok(got)
    };
    let hier = outcomes(MemLink::mesh_on_hosts(hosts, SLOT), |g| {
        let got = run(g)?;
        // No all_reduce came before: the first call held the arena vote.
        assert_eq!(g.arena_in_use(), Some(true), "hosts {hosts:?}");
        for kind in [
            Kind::Broadcast,
            Kind::AllGather,
            Kind::Barrier,
            Kind::Gather,
        ] {
            assert_eq!(collective_path(g, kind, 1, 4), "hosts", "{kind:?}");
        }
        Ok(got)
    });
    let flat = outcomes(MemLink::mesh(n), |g| {
        assert_eq!(collective_path(g, Kind::Broadcast, 1, 4), "tree");
        run(g)
    });
    for r in 0..n {
        assert_eq!(hier[r].len(), flat[r].len(), "hosts {hosts:?}, rank {r}");
        for (i, (h, f)) in hier[r].iter().zip(&flat[r]).enumerate() {
            assert!(h == f, "hosts {hosts:?}, rank {r}: result {i} differs");
        }
    }
}

#[test]
fn small_collectives_across_hosts_match_the_flat_path() {
    for hosts in LAYOUTS {
        alike(hosts, &[0, 1, 5, 13], true);
    }
}

/// Past the chain's limit (a broadcast of 1.2 MB: two chunks), the leaders' chain inside the
/// hosts too, and past the ring's limit for reduce (280 KB, not a multiple of the hosts).
#[test]
fn large_collectives_across_hosts_match_the_flat_path() {
    for hosts in [LAYOUTS[0], LAYOUTS[1]] {
        alike(hosts, &[70_001], false);
    }
    let n = 5;
    let hosts = [0, 1, 1, 0, 1];
    let big = |g: &Group<MemLink>| -> Result<Vec<Vec<u8>>> {
        let mut got = Vec::new();
        for root in 0..n {
            let mut x: Vec<u32> = (0..300_007).map(|i| own(g.rank(), i)).collect();
            g.broadcast(&mut x, root)?;
            got.push(bytes(&x).to_vec());
        }
        Ok(got)
    };
    let hier = outcomes(MemLink::mesh_on_hosts(&hosts, SLOT), big);
    let flat = outcomes(MemLink::mesh(n), big);
    assert!(hier == flat, "1.2 MB broadcasts differ");
}

/// Bytes (and messages) that cross between hosts, by collective.
#[derive(Default)]
struct Crossing {
    bytes: [AtomicU64; 16],
    msgs: [AtomicU64; 16],
}

/// Counts on `links` the collectives' bytes whose sender and receiver sit on different hosts.
fn count_crossing(links: &[MemLink], hosts: &[usize]) -> Arc<Crossing> {
    let seen = Arc::new(Crossing::default());
    let (s, hosts) = (seen.clone(), hosts.to_vec());
    links[0].set_faults(move |e| {
        if e.tag == COLLECTIVE_TAG && hosts[e.src] != hosts[e.dst] {
            let kind = usize::from(Desc::decode(&e.meta).kind) % 16;
            s.bytes[kind].fetch_add(e.len as u64, Ordering::Relaxed);
            s.msgs[kind].fetch_add(1, Ordering::Relaxed);
        }
        Delivery::Now
    });
    seen
}

/// One of each collective, `k` u32 a rank's block, root 1: the bytes that cross between hosts.
fn crossing(hosts: &[usize], tuning: Tuning, k: usize) -> Arc<Crossing> {
    let n = hosts.len();
    let links = MemLink::mesh_on_hosts(hosts, SLOT);
    let seen = count_crossing(&links, hosts);
    let results = run_links(links, |l| {
        let g = Group::form(l, tuning, TIMEOUT)?;
        let me = g.rank();
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        let mut x = vec![me as u32; k];
        g.broadcast(&mut x, 1)?;
        g.reduce(&mut x, ReduceOp::Sum, 1)?;
        let mut all = vec![0u32; k * n];
        g.gather(&x, (me == 1).then_some(&mut all[..]), 1)?;
        g.scatter((me == 1).then_some(&all[..]), &mut x, 1)?;
        g.all_gather(&x, &mut all)?;
        g.reduce_scatter(&all, &mut x, ReduceOp::Sum)?;
        g.barrier()
    });
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    seen
}

/// The claim: each byte crosses the hosts' links once per host that needs it. Hosts of 1, 2
/// and 3 ranks (root 1 on the middle one), 1,000 u32 a block: a broadcast and a reduce cross
/// once per other host, a gather or scatter once per block off the root's host, an all_gather
/// and a reduce_scatter once per block and host that lacks it; the barrier sends the leaders'
/// ⌈log₂ 3⌉ rounds only. The flat path sends more bytes of each, or for gather and scatter
/// (which send each block across once already) as many in more messages.
#[test]
fn each_byte_crosses_between_hosts_once_per_host() {
    let hosts = [0, 1, 1, 2, 2, 2];
    let (n, k) = (hosts.len(), 1000usize);
    let b = (k * 4) as u64;
    let hier = crossing(&hosts, Tuning::default(), k);
    let flat = crossing(
        &hosts,
        Tuning {
            arena_max_kb: 0,
            ..Tuning::default()
        },
        k,
    );
    let sizes = [1u64, 2, 3];
    let others: u64 = sizes.iter().map(|m| (n as u64 - m) * b).sum();
    let expect = [
        (Kind::Broadcast, 2 * b),
        (Kind::Reduce, 2 * b),
        (Kind::Gather, 4 * b),
        (Kind::Scatter, 4 * b),
        (Kind::AllGather, others),
        (Kind::ReduceScatter, others),
        (Kind::Barrier, 0),
    ];
    for (kind, want) in expect {
        let k = kind as usize;
        let (h, f) = (
            hier.bytes[k].load(Ordering::Relaxed),
            flat.bytes[k].load(Ordering::Relaxed),
        );
        let (hm, fm) = (
            hier.msgs[k].load(Ordering::Relaxed),
            flat.msgs[k].load(Ordering::Relaxed),
        );
        assert_eq!(h, want, "{kind:?}: {h} bytes crossed, flat {f}");
        // Fewer bytes, or (gather and scatter, whose flat path sends each block across once
        // already; the barrier, which sends none) as many in fewer messages.
        assert!(
            h < f || (h == f && hm < fm),
            "{kind:?}: {h} bytes in {hm} messages against flat {f} in {fm}"
        );
    }
    let k = Kind::Barrier as usize;
    let h = hier.msgs[k].load(Ordering::Relaxed);
    assert_eq!(h, 3 * 2, "barrier: {h} messages crossed");
}

/// A tuning that keeps the group off the arena keeps these collectives flat, and a link whose
/// hosts each hold one rank, or one host all of them, never takes the hosts' path.
#[test]
fn no_shared_host_or_no_arena_stays_flat() {
    for (hosts, arena_max_kb) in [
        (vec![0, 1, 1, 2], 0),
        (vec![0, 1, 2, 3], Tuning::default().arena_max_kb),
        (vec![0, 0, 0], Tuning::default().arena_max_kb),
    ] {
        let results = run_links(MemLink::mesh_on_hosts(&hosts, SLOT), |l| {
            let tuning = Tuning {
                arena_max_kb,
                ..Tuning::default()
            };
            let g = Group::form(l, tuning, TIMEOUT)?;
            let mut x = vec![g.rank() as u32; 3];
            g.broadcast(&mut x, 2)?;
            g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
            Ok((x, collective_path(&g, Kind::Gather, 3, 12)))
        });
        for res in results {
            let (x, path) = res.unwrap();
            assert_eq!(x, vec![2u32; 3]);
            assert_ne!(path, "hosts", "hosts {hosts:?}");
        }
    }
}

/// Every element type through the hosts' reduce and reduce_scatter, against the flat path.
#[test]
fn every_element_type_reduces_alike() {
    fn both<E: Element>(g: &Group<MemLink>, got: &mut Vec<Vec<u8>>) -> Result<()> {
        let (me, n) = (g.rank(), g.world_size());
        for op in super::matrix::ops_for::<E>() {
            let mut x = inputs::<E>(op, me, 11);
            g.reduce(&mut x, op, n - 1)?;
            if me == n - 1 {
                got.push(bytes(&x).to_vec());
            }
            let input = inputs::<E>(op, me, 3 * n);
            let mut out = vec![E::from_f64(0.0); 3];
            g.reduce_scatter(&input, &mut out, op)?;
            got.push(bytes(&out).to_vec());
        }
        Ok(())
    }
    let f = |g: &Group<MemLink>| -> Result<Vec<Vec<u8>>> {
        let mut got = Vec::new();
        both::<f32>(g, &mut got)?;
        both::<f64>(g, &mut got)?;
        both::<half::f16>(g, &mut got)?;
        both::<half::bf16>(g, &mut got)?;
        both::<i8>(g, &mut got)?;
        both::<u8>(g, &mut got)?;
        both::<i32>(g, &mut got)?;
        both::<u64>(g, &mut got)?;
        Ok(got)
    };
    let hosts = [1, 0, 1, 2, 2];
    let hier = outcomes(MemLink::mesh_on_hosts(&hosts, SLOT), f);
    let flat = outcomes(MemLink::mesh(hosts.len()), f);
    assert!(hier == flat, "results differ");
}

/// A rank whose count differs (a non-leader, then a leader) in an all_gather and a
/// reduce_scatter across hosts: every rank returns an error naming a mismatch or the abort that
/// followed it, well before the deadline, none hangs.
#[test]
fn a_mismatched_count_across_hosts_is_an_error_on_every_rank() {
    use std::time::{Duration, Instant};
    let hosts = [0, 1, 1, 2, 2, 2];
    for odd in [4, 3] {
        let t = Instant::now();
        let results = run_links(MemLink::mesh_on_hosts(&hosts, SLOT), |l| {
            let g = Group::form(l, Tuning::default(), Duration::from_secs(20))?;
            g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
            let k = if g.rank() == odd { 4 } else { 3 };
            let first = g.all_gather(&vec![1u32; k], &mut vec![0u32; k * hosts.len()]);
            let second = g.reduce_scatter(
                &vec![1u32; k * hosts.len()],
                &mut vec![0u32; k],
                ReduceOp::Sum,
            );
            Ok((first, second))
        });
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        for (r, res) in results.into_iter().enumerate() {
            let (first, second) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            for e in [first.unwrap_err(), second.unwrap_err()] {
                assert!(
                    matches!(
                        e,
                        crate::DistError::CollectiveMismatch { .. }
                            | crate::DistError::Aborted { .. }
                    ),
                    "odd rank {odd}, rank {r}: {e}"
                );
            }
        }
    }
}

/// All_reduces of `count` u32 on `hosts` with the arena's limit at `arena_max_kb`: each rank's
/// path name and result, and the bytes of all_reduce that crossed between hosts.
fn all_reduce_across(
    hosts: &[usize],
    arena_max_kb: u32,
    count: usize,
) -> (Vec<(String, Vec<u32>)>, u64) {
    let links = MemLink::mesh_on_hosts(hosts, SLOT);
    let seen = count_crossing(&links, hosts);
    let results = run_links(links, |l| {
        let tuning = Tuning {
            arena_max_kb,
            ..Tuning::default()
        };
        let g = Group::form(l, tuning, TIMEOUT)?;
        let me = g.rank();
        // The vote, which crosses too: counted apart below.
        g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
        g.barrier()?;
        let path = super::super::all_reduce_path(&g, count, count * 4);
        let mut x: Vec<u32> = (0..count).map(|i| own(me, i)).collect();
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok((path, x))
    });
    let out: Vec<_> = results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    (
        out,
        seen.bytes[Kind::AllReduce as usize].load(Ordering::Relaxed),
    )
}

/// Above the arena's limit, an all_reduce whose ranks share hosts takes the hosts' path: the
/// true sums, and the hosts' links carry the leaders' ring (2(H − 1)/H of the buffer from each
/// host), fewer than the flat path's; a group all on one host keeps its own
/// choice there (not the hosts' path), and one rank a host stays flat.
#[test]
fn a_large_all_reduce_across_shared_hosts_takes_the_hosts_path() {
    // 64 KiB of u32 against a limit of 16 KiB.
    let (count, kb) = (16 << 10, 16);
    let sum = |n: usize, i: usize| (0..n).map(|r| own(r, i)).fold(0u32, u32::wrapping_add);
    for hosts in [&[0usize, 0, 1, 1][..], &[0, 1, 1, 2, 2, 2], &[4, 4, 4, 9]] {
        let n = hosts.len();
        let h = {
            let mut u = hosts.to_vec();
            u.sort_unstable();
            u.dedup();
            u.len() as u64
        };
        // What the group's first all_reduce (its arena vote) sends, to take off.
        let (_, vote) = all_reduce_across(hosts, kb, 0);
        let (out, crossed) = all_reduce_across(hosts, kb, count);
        let crossed = crossed - vote;
        for (r, (path, x)) in out.iter().enumerate() {
            assert!(path.starts_with("hosts-"), "rank {r} on {hosts:?}: {path}");
            assert!(
                x.iter().enumerate().all(|(i, v)| *v == sum(n, i)),
                "rank {r} on {hosts:?}: a wrong sum"
            );
        }
        // The leaders' ring: each of H leaders sends 2(H − 1)/H of the buffer, (H − 1)/H in
        // each half (the buffer divides evenly here), all of it between hosts.
        let buf = (count * 4) as u64;
        let want = 2 * (h - 1) * buf;
        assert_eq!(
            crossed, want,
            "{hosts:?}: bytes of all_reduce that crossed, against the leaders' ring"
        );
        // The flat path (the arena off) sends more across.
        let (_, flat_vote) = all_reduce_across(hosts, 0, 0);
        let (_, flat) = all_reduce_across(hosts, 0, count);
        let flat = flat - flat_vote;
        assert!(
            crossed < flat,
            "{hosts:?}: {crossed} bytes crossed against flat {flat}"
        );
    }
    // All on one host, and one rank a host: never the hosts' path above the limit.
    for hosts in [&[0usize, 0, 0][..], &[0, 1, 2, 3]] {
        let (out, _) = all_reduce_across(hosts, kb, count);
        for (r, (path, x)) in out.iter().enumerate() {
            assert!(!path.starts_with("hosts-"), "rank {r} on {hosts:?}: {path}");
            assert!(x.iter().enumerate().all(|(i, v)| *v == sum(hosts.len(), i)));
        }
    }
}

/// Above the arena's limit on hosts of equal size (ranks of a host apart, or together; 2 and 3
/// a host): the all_reduce runs by columns (`hier/columns.rs`), and every op and element type
/// gives what the flat path gives, at a count that divides by neither the hosts nor the ranks.
#[test]
fn all_reduce_by_columns_matches_the_flat_path() {
    fn each<E: Element>(g: &Group<MemLink>, got: &mut Vec<Vec<u8>>) -> Result<()> {
        for op in super::matrix::ops_for::<E>() {
            let mut x = inputs::<E>(op, g.rank(), 5_003);
            g.all_reduce(&mut x, op)?;
            got.push(bytes(&x).to_vec());
        }
        Ok(())
    }
    let run = |hosts: Option<&[usize]>, n: usize| {
        let links = match hosts {
            Some(h) => MemLink::mesh_on_hosts(h, SLOT),
            None => MemLink::mesh(n),
        };
        let results = run_links(links, |l| {
            let tuning = Tuning {
                arena_max_kb: 4,
                ..Tuning::default()
            };
            let g = Group::form(l, tuning, TIMEOUT)?;
            g.all_reduce(&mut [0u8], ReduceOp::Sum)?;
            let path = super::super::all_reduce_path(&g, 5_003, 5_003 * 4);
            let mut got = Vec::new();
            each::<f32>(&g, &mut got)?;
            each::<half::bf16>(&g, &mut got)?;
            each::<i64>(&g, &mut got)?;
            each::<u8>(&g, &mut got)?;
            Ok((path, got))
        });
        results
            .into_iter()
            .enumerate()
            .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect::<Vec<_>>()
    };
    for hosts in [
        &[0usize, 1, 0, 1][..],
        &[0, 0, 0, 1, 1, 1],
        &[3, 3, 1, 1, 2, 2],
    ] {
        let n = hosts.len();
        let hier = run(Some(hosts), n);
        let flat = run(None, n);
        for r in 0..n {
            assert_eq!(hier[r].0, "hosts-columns", "hosts {hosts:?}, rank {r}");
            assert_ne!(flat[r].0, "hosts-columns");
            assert!(
                hier[r].1 == flat[r].1,
                "hosts {hosts:?}, rank {r}: results differ"
            );
        }
    }
}

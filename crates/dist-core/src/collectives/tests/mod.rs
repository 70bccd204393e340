//! Unit tests of `collectives`: the pure parts here, every algorithm over an in-memory link in
//! `matrix`, mismatches and failures in `faults`.

use super::desc::{Desc, Kind};
use super::scratch::{segment, split_pair};
use super::tree::binomial;
use super::*;
use crate::testing::MemLink;
use crate::{DType, DistError, Tuning, Within};

mod arena_threads;
mod direct;
mod faults;
mod forming;
mod halving;
mod hier;
mod host;
mod matrix;
mod small;
mod small_ops;
mod uneven;

/// Whether `e` names `rank` as its cause: the peer found gone, or the origin of an abort.
fn names(e: &DistError, rank: usize) -> bool {
    match e {
        DistError::PeerGone { peer, .. } => *peer == rank,
        DistError::Aborted { origin, .. } => *origin == rank,
        _ => false,
    }
}

#[test]
fn descriptor_round_trips_and_explains_differences() {
    let a = Desc {
        kind: Kind::AllReduce as u8,
        dtype: DType::F32 as u8,
        op: ReduceOp::Sum.code(),
        root: 0,
        seq: 7,
        count: 1 << 40,
    };
    assert_eq!(Desc::decode(&a.encode()), a);
    assert_eq!(a.describe(), "all_reduce(f32 x 1099511627776, sum)");
    let b = Desc {
        count: 5,
        dtype: DType::I32 as u8,
        ..a
    };
    assert_eq!(
        a.differences(&b),
        "element type i32 vs f32 here, count 5 vs 1099511627776 here (all_reduce(i32 x 5, sum))"
    );
    let c = Desc {
        kind: Kind::Broadcast as u8,
        root: 2,
        ..a
    };
    assert!(
        a.differences(&c)
            .starts_with("it called broadcast where this rank called all_reduce")
    );
    let d = Desc { seq: 8, ..a };
    assert!(a.differences(&d).contains("skipped or added a collective"));
}

#[test]
fn segments_cover_everything_once() {
    for count in [0usize, 1, 5, 7, 100, 1001] {
        for n in 1..10 {
            let mut next = 0;
            for i in 0..n {
                let s = segment(count, n, i);
                assert_eq!(s.start, next);
                next = s.end;
            }
            assert_eq!(next, count);
        }
    }
}

#[test]
fn binomial_tree_reaches_every_rank_once() {
    for n in 1..20 {
        let mut seen = vec![0; n];
        seen[0] = 1;
        for v in 0..n {
            let (parent, children) = binomial(v, n);
            assert_eq!(parent.is_none(), v == 0);
            for ch in children {
                assert_eq!(binomial(ch, n).0, Some(v));
                seen[ch] += 1;
            }
        }
        assert!(seen.iter().all(|s| *s == 1), "n={n}: {seen:?}");
    }
}

#[test]
fn split_pair_gives_disjoint_ranges_either_way() {
    let mut x = [0, 1, 2, 3, 4, 5];
    let (a, b) = split_pair(&mut x, 0..2, 3..6);
    assert_eq!(a, &[0, 1]);
    b[0] = 9;
    let (a, b) = split_pair(&mut x, 4..6, 1..3);
    assert_eq!(a, &[4, 5]);
    assert_eq!(b, &[1, 2]);
    assert_eq!(x[3], 9);
    // An empty range beside a full one at the same place (the halving's empty blocks: this
    // panicked with "range end index 1 out of range for slice of length 0").
    let (a, b) = split_pair(&mut x, 2..2, 2..4);
    assert_eq!((a, &*b), (&[][..], &[2, 9][..]));
    let (a, b) = split_pair(&mut x, 4..6, 4..4);
    assert_eq!((a, &*b), (&[4, 5][..], &[][..]));
    let (a, b) = split_pair(&mut x, 3..3, 3..3);
    assert!(a.is_empty() && b.is_empty());
}

/// Rank 0 of a group of `n` in memory whose other ranks never call: enough for the checks
/// that must fail before any message moves.
pub(super) fn lone(n: usize) -> Group<MemLink> {
    let link = MemLink::mesh(n).swap_remove(0);
    Group::form(link, Tuning::default(), std::time::Duration::from_secs(1)).unwrap()
}

/// Counts whose sum overflows a usize are an error naming them, not a panic (on main the
/// `iter().sum()` panicked with "attempt to add with overflow").
#[test]
fn all_to_all_v_counts_that_overflow_are_errors() {
    let b = lone(2);
    let e = b
        .all_to_all_v(&[0u8; 2], &[usize::MAX, 2], &mut [0u8; 2], &[1, 1])
        .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, DistError::InvalidArgument { .. }), "{text}");
    assert!(
        text.contains("all_to_all_v")
            && text.contains(&format!("send_counts [{}, 2]", usize::MAX))
            && text.contains("more than a usize holds"),
        "{text}"
    );
    // A failed call aborts the group: a second one needs a group of its own.
    let e = lone(2)
        .all_to_all_v(&[0u8; 2], &[1, 1], &mut [0u8; 2], &[2, usize::MAX - 1])
        .unwrap_err();
    assert!(e.to_string().contains("recv_counts"), "{e}");
}

/// A default timeout too long for the clock is an error naming the call and the timeout,
/// not a panic in `Instant + Duration` (on main: "overflow when adding duration to instant").
#[test]
fn huge_default_timeouts_are_errors() {
    for timeout in [std::time::Duration::MAX, crate::MAX_TIMEOUT * 2] {
        let b = lone(2);
        let e = b
            .within(timeout)
            .all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
            .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, DistError::InvalidArgument { .. }), "{text}");
        assert!(
            text.contains("all_reduce(f32 x 4, sum)") && text.contains(&format!("{timeout:?}")),
            "{text}"
        );
    }
}

/// The host paths by size and rank count follow the cost model: the small areas and whole
/// pieces while the model has them no slower than the shares (whole at most 32 KiB), the shares
/// after; the chosen path's predicted time never falls as the size rises, at any rank count.
#[test]
fn the_host_paths_follow_the_cost_model() {
    use super::HostAllReducePath::{Direct, Small, Split, Whole};
    let areas = (HOST_SMALL_MAX, 4 << 20);
    let path = |n, bytes| host_all_reduce_path(n, bytes, areas, false);
    let time = |p, n, bytes| host_time_ns(p, n, bytes).expect("modelled");
    // The figures the model is fitted to (16-core host), within 15 %.
    for (p, n, bytes, us) in [
        (Small, 4, 8, 1.7),
        (Small, 16, 8, 4.4),
        (Small, 16, 2048, 11.9),
        (Whole, 4, 32 << 10, 22.9),
        (Split, 8, 32 << 10, 18.3),
        (Split, 8, 128 << 10, 57.6),
        (Split, 16, 8 << 10, 15.2),
        (Split, 16, 32 << 10, 26.2),
    ] {
        let t = time(p, n, bytes) as f64 / 1000.0;
        assert!(
            (t / us - 1.0).abs() < 0.15,
            "{p:?} {n} ranks {bytes} B: {t} us, measured {us}"
        );
    }
    // 2 ranks: whole up to 32 KiB (the model never has the shares faster); 3: about 10 KiB.
    assert_eq!(host_split_min(2), HOST_SPLIT_MIN);
    assert_eq!(host_small_max(2), HOST_SMALL_MAX);
    assert_eq!(path(2, HOST_SPLIT_MIN), Whole);
    assert_eq!(path(2, HOST_SPLIT_MIN + 1), Split);
    assert!((9 << 10..11 << 10).contains(&host_split_min(3)));
    // From 4 ranks, the shares from about 5 KiB (at 16 ranks a 32 KiB call took 106.6 us
    // reduced whole, 128 KiB 89.8 us in shares), and from 5 ranks right after the small areas,
    // which end before 4 KiB.
    assert_eq!(host_small_max(4), HOST_SMALL_MAX);
    assert!((HOST_SMALL_MAX..6 << 10).contains(&host_split_min(4)));
    assert_eq!(path(4, host_split_min(4) + 1), Split);
    for n in [5, 8, 16, 64, 1024] {
        let max = host_small_max(n);
        assert!((2 << 10..HOST_SMALL_MAX).contains(&max), "{n} ranks: {max}");
        assert_eq!(path(n, max), Small, "{n} ranks");
        assert_eq!(path(n, max + 1), Split, "{n} ranks");
    }
    for n in 2..=70 {
        let mut last = 0;
        let mut sizes: Vec<usize> = (1..=64 << 10).step_by(61).collect();
        sizes.extend([
            HOST_SMALL_MAX,
            HOST_SMALL_MAX + 1,
            HOST_SPLIT_MIN,
            HOST_SPLIT_MIN + 1,
        ]);
        sizes.sort_unstable();
        for bytes in sizes {
            let p = path(n, bytes);
            let t = time(p, n, bytes);
            // The model's choice: no modelled path is faster (whole capped at 32 KiB).
            for other in [Whole, Split] {
                if other != Whole || bytes <= HOST_SPLIT_MIN {
                    assert!(t <= time(other, n, bytes), "{n} ranks {bytes} B: {p:?}");
                }
            }
            assert!(
                t >= last,
                "{n} ranks {bytes} B: {p:?} faster than a smaller size"
            );
            last = t;
        }
    }
    // No small areas; a slot smaller than the split size; direct reads.
    assert_eq!(host_all_reduce_path(2, 8, (0, 4 << 20), false), Whole);
    assert_eq!(host_all_reduce_path(2, 2048, (0, 1024), false), Split);
    assert_eq!(host_all_reduce_path(4, 1 << 20, areas, true), Direct);
    assert_eq!(host_all_reduce_path(4, 8, areas, true), Small);
    assert_eq!(host_time_ns(Direct, 4, 8), None);
}

//! Groups of a `HybridBackend` without a GPU (sub-groups, host side): 4 ranks split into
//! 2 × 2 (rows by `split`, columns by `new_group`), collectives on host buffers on both axes
//! and async host work through the group's scope, every result checked; the groups are
//! TCP-only, for the backend's reason, and split again.

use dist_core::{Backend, ReduceOp};
use dist_hybrid::{GpuChoice, HybridBackend, HybridGroup};
use dist_nccl::CommConfig;

/// A value only world rank `r` gives at index `i`, exact in f64 sums.
fn val(r: usize, i: usize) -> f64 {
    (r * 1000 + i) as f64
}

/// All_reduce, all_gather and a broadcast from each rank on `g`, whose rank `j` is world rank
/// `mates[j]`, each result checked.
fn exercise(g: &HybridGroup, mates: &[usize], count: usize) {
    let (me, n) = (g.rank(), g.world_size());
    assert_eq!(n, mates.len(), "group size");
    let world_me = mates[me];
    let mine: Vec<f64> = (0..count).map(|i| val(world_me, i)).collect();
    let mut sum = mine.clone();
    g.all_reduce(&mut sum[..], ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    for (i, v) in sum.iter().enumerate() {
        let want: f64 = mates.iter().map(|&m| val(m, i)).sum();
        assert_eq!(*v, want, "all_reduce element {i} of {count} on {mates:?}");
    }
    let mut all = vec![0.0; count * n];
    g.all_gather(&mine[..], &mut all[..])
        .unwrap_or_else(|e| panic!("{e}"));
    for (j, block) in all.chunks_exact(count).enumerate() {
        let want: Vec<f64> = (0..count).map(|i| val(mates[j], i)).collect();
        assert_eq!(block, &want[..], "all_gather block {j} on {mates:?}");
    }
    for (root, &world_root) in mates.iter().enumerate() {
        let mut b = if me == root {
            mine.clone()
        } else {
            vec![-1.0; count]
        };
        g.broadcast(&mut b[..], root)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            b.iter().enumerate().all(|(i, v)| *v == val(world_root, i)),
            "broadcast from group rank {root} on {mates:?}"
        );
    }
}

/// Four all_reduces queued at once in the group's scope (buckets), waited on in reverse order.
fn buckets(g: &HybridGroup, mates: &[usize]) {
    let world_me = mates[g.rank()];
    let mut bs: Vec<Vec<f64>> = (0..4)
        .map(|b| (0..1000).map(|i| val(world_me, i) + b as f64).collect())
        .collect();
    g.scope(|s| {
        let works = bs
            .iter_mut()
            .map(|b| s.all_reduce(&mut b[..], ReduceOp::Sum))
            .collect::<Vec<_>>();
        for w in works.into_iter().rev() {
            w.wait()?;
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (b, x) in bs.iter().enumerate() {
        for (i, v) in x.iter().enumerate() {
            let want: f64 = mates.iter().map(|&m| val(m, i) + b as f64).sum();
            assert_eq!(*v, want, "bucket {b} element {i} on {mates:?}");
        }
    }
}

/// 4 ranks as 2 × 2: rows {0, 1}, {2, 3} by split; columns {0, 2}, {1, 3} by new_group.
pub fn grid() -> Result<(), String> {
    let cfg = dist_multirank::config();
    let tcp = dist_tcp::TcpBackend::with_config(cfg).map_err(|e| e.to_string())?;
    let h = HybridBackend::with_nccl(tcp, 0, GpuChoice::None, None, CommConfig::default())
        .map_err(|e| e.to_string())?;
    let me = h.rank();
    assert_eq!(h.world_size(), 4);
    let (row, col) = (me / 2, me % 2);
    // Keys reverse the rows' order: row rank 0 is the higher world rank.
    let rows = h
        .split_named(Some(row as u32), -(me as i64), "row")
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank has a row");
    // The name reaches the host group, whose errors use it.
    assert_eq!(rows.tcp().link().name(), Some("row"));
    let row_mates = [row * 2 + 1, row * 2];
    let mut cols = None;
    for c in 0..2 {
        let g = h
            .new_group_named(&[c, c + 2], "col")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(g.is_some(), c == col, "new_group({c}) on rank {me}");
        cols = cols.or(g);
    }
    let cols = cols.expect("every rank is in its column");
    assert_eq!(cols.tcp().link().label(), "\"col\"");
    let col_mates = [col, col + 2];
    assert!(rows.nccl().is_none() && rows.why_no_nccl().is_some());
    for (g, mates) in [(&rows, &row_mates[..]), (&cols, &col_mates[..])] {
        assert_eq!(mates[g.rank()], me, "group rank {} on {mates:?}", g.rank());
        exercise(g, mates, 1);
        exercise(g, mates, 100_003);
        buckets(g, mates);
    }
    // A group of a group: the row's rank 0 alone.
    let solo = rows
        .split((rows.rank() == 0).then_some(0), 0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(solo.is_some(), rows.rank() == 0);
    if let Some(s) = solo {
        assert_eq!((s.rank(), s.world_size()), (0, 1));
    }
    // TCP-only, like the backend: the same reason, and synchronize is a no-op.
    assert_eq!(rows.why_no_nccl(), h.why_no_nccl());
    rows.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    // Both axes again, after the nested split, with the whole job's barrier between.
    h.barrier().map_err(|e| e.to_string())?;
    exercise(&rows, &row_mates, 7);
    exercise(&cols, &col_mates, 7);
    h.barrier().map_err(|e| e.to_string())?;
    println!("rank {me}: row {row} and column {col} collectives and buckets checked");
    Ok(())
}

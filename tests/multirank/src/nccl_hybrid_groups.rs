//! Groups of a `HybridBackend` on GPUs: 2 ranks split as 1 × 2 (one group
//! of both) and 2 × 1 (a group each), and a `new_group` that leaves rank 0 out (its NCCL side
//! takes part in the split with no color); device collectives, blocking and async, on each
//! group, every result checked against host arithmetic.

use std::time::Duration;

use cudarc::driver::CudaSlice;
use dist_core::{Backend, ReduceOp};
use dist_hybrid::{HybridBackend, HybridGroup};
use dist_tcp::TcpBackend;

use super::nccl_failures::hybrid_with;

const NCCL_TIMEOUT: Duration = Duration::from_secs(30);

fn up<H: dist_core::Transport>(g: &HybridBackend<H>, x: &[f32]) -> CudaSlice<f32> {
    let c = g.nccl().expect("a group of a backend with NCCL has NCCL");
    c.stream().clone_htod(x).unwrap_or_else(|e| panic!("{e}"))
}

fn down(g: &HybridGroup, x: &CudaSlice<f32>) -> Vec<f32> {
    g.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let c = g.nccl().expect("NCCL");
    c.stream().clone_dtoh(x).unwrap_or_else(|e| panic!("{e}"))
}

/// A value only world rank `r` gives at index `i`.
fn val(r: usize, i: usize) -> f32 {
    (r * 100 + i % 50) as f32
}

/// Device all_reduce (blocking and async), all_gather and broadcast on `g`, whose rank `j` is
/// world rank `mates[j]`, checked.
fn exercise(g: &HybridGroup, mates: &[usize]) {
    const K: usize = 4096;
    let (me, n) = (g.rank(), g.world_size());
    assert_eq!(n, mates.len());
    let world_me = mates[me];
    let mine: Vec<f32> = (0..K).map(|i| val(world_me, i)).collect();
    let sum: Vec<f32> = (0..K)
        .map(|i| mates.iter().map(|&m| val(m, i)).sum())
        .collect();
    let mut x = up(g, &mine);
    g.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(g, &x), sum, "all_reduce on {mates:?}");
    // Four buckets in flight at once, waited on in reverse order.
    let mut bs: Vec<CudaSlice<f32>> = (0..4).map(|_| up(g, &mine)).collect();
    let works: Vec<_> = bs
        .iter_mut()
        .map(|b| {
            g.all_reduce_async(b, ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    for w in works.into_iter().rev() {
        w.wait().unwrap_or_else(|e| panic!("{e}"));
    }
    for (k, b) in bs.iter().enumerate() {
        assert_eq!(down(g, b), sum, "async bucket {k} on {mates:?}");
    }
    let mut all = up(g, &vec![-1.0; K * n]);
    g.all_gather(&up(g, &mine), &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = mates
        .iter()
        .flat_map(|&m| (0..K).map(move |i| val(m, i)))
        .collect();
    assert_eq!(down(g, &all), want, "all_gather on {mates:?}");
    for (root, &world_root) in mates.iter().enumerate() {
        let mut b = up(
            g,
            &if me == root {
                mine.clone()
            } else {
                vec![-1.0; K]
            },
        );
        g.broadcast(&mut b, root).unwrap_or_else(|e| panic!("{e}"));
        let want: Vec<f32> = (0..K).map(|i| val(world_root, i)).collect();
        assert_eq!(down(g, &b), want, "broadcast from {root} on {mates:?}");
    }
}

/// 2 ranks: 1 × 2 and 2 × 1 by split, then a new_group of rank 1 alone.
pub fn groups() -> Result<(), String> {
    let h = hybrid_with(None, NCCL_TIMEOUT)?;
    let (me, n) = (h.rank(), h.world_size());
    let one_by_two = h
        .split(Some(0), 0)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank has color 0");
    let two_by_one = h
        .split(Some(me as u32), 0)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("every rank has its own color");
    let world: Vec<usize> = (0..n).collect();
    exercise(&one_by_two, &world);
    exercise(&two_by_one, &[me]);
    let last = h.new_group(&[n - 1]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(last.is_some(), me == n - 1, "new_group([{}])", n - 1);
    if let Some(g) = &last {
        exercise(g, &[me]);
    }
    // A group of a group: 1 × 2 split again into its ranks' own groups.
    let again = one_by_two
        .split(Some(one_by_two.rank() as u32), 0)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("own color");
    exercise(&again, &[me]);
    // The job's communicator still works beside its groups.
    let mut x = up(&h, &[1.0f32; 64]);
    h.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let got = h.nccl().unwrap().stream().clone_dtoh(&x).unwrap();
    assert_eq!(got, vec![n as f32; 64]);
    let tcp: &TcpBackend = h.tcp();
    tcp.barrier().map_err(|e| e.to_string())?;
    println!("rank {me}: 1 x 2, 2 x 1, new_group and nested groups checked on device buffers");
    Ok(())
}

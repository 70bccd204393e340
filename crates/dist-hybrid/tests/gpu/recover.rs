//! `HybridBackend::recover` on one GPU, one rank: nobody is left out, so the TCP side forms
//! epoch 1 of the same rank and the NCCL side is revoked and shrunk to the same member (a
//! split of the handle the communicator keeps); the recovered backend's device all_reduce
//! works, and it recovers again.

use std::time::Duration;

use dist_core::{Backend, ReduceOp};
use dist_hybrid::HybridBackend;

use crate::{K, d, expect, h, one_rank};

/// A device all_reduce of ones through `b`, checked (one rank: the sum is the input).
fn device_sum(b: &HybridBackend, what: &str) -> Result<(), String> {
    let nccl = b
        .nccl()
        .ok_or_else(|| format!("{what}: no NCCL side ({:?})", b.why_no_nccl()))?;
    let s = nccl.stream().clone();
    let mut x = s.clone_htod(&[1.0f32; K]).map_err(d("copy in"))?;
    b.all_reduce(&mut x, ReduceOp::Sum).map_err(h(what))?;
    b.synchronize_nccl().map_err(h(what))?;
    let got = s.clone_dtoh(&x).map_err(d("copy out"))?;
    expect(got.iter().all(|&v| v == 1.0), || {
        format!("{what}: want ones, got {got:?}")
    })
}

pub fn one_rank_recovers_twice() -> Result<(), String> {
    let b = one_rank(Duration::from_secs(30))?;
    device_sum(&b, "before")?;
    let b = b.recover(Duration::from_secs(30)).map_err(h("recover"))?;
    expect(b.tcp().epoch() == 1, || {
        format!("epoch {} after one recovery", b.tcp().epoch())
    })?;
    expect((b.rank(), b.world_size()) == (0, 1), || {
        format!("rank {} of {}", b.rank(), b.world_size())
    })?;
    device_sum(&b, "after the recovery")?;
    let b = b
        .recover(Duration::from_secs(30))
        .map_err(h("recover again"))?;
    expect(b.tcp().epoch() == 2, || {
        format!("epoch {} after two recoveries", b.tcp().epoch())
    })?;
    device_sum(&b, "after the second recovery")
}

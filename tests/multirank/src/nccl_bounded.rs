//! The NCCL cases about bounds: a communicator dropped with work a dead peer never completes,
//! and a split a peer never joins.

use std::time::{Duration, Instant};

use dist_core::{Backend, ReduceOp};
use dist_nccl::CommConfig;

use super::{Rig, rig, up};

/// Dropping a communicator whose work on another stream (`on(&side)`) can never complete (the
/// peer is gone) returns within its timeout. Before, drop waited only for its own stream, the
/// watchdog watched only that stream, and finalize then waited for the side stream forever.
pub(crate) fn drop_bounded() -> Result<(), String> {
    let deadline = Duration::from_secs(6);
    let r = rig(deadline)?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let side = r.comm.context().new_stream().unwrap();
    let mut x = up(&side, &vec![1.0f32; 1 << 20]);
    r.comm
        .on(&side)
        .all_reduce_in_place(&mut x, ReduceOp::Sum)
        .unwrap();
    r.comm.synchronize_stream(&side).unwrap();
    r.tcp.barrier().unwrap();
    if me == n - 1 {
        println!("exiting abruptly before the next all_reduce");
        std::process::exit(0);
    }
    let Rig { tcp, comm } = r;
    // Enqueued; it never completes (or NCCL notices the dead peer first: either way drop must
    // return within the deadline).
    let _ = comm.on(&side).all_reduce_in_place(&mut x, ReduceOp::Sum);
    let t = Instant::now();
    drop(comm);
    let took = t.elapsed();
    println!("dropped with work pending on another stream in {took:.1?}");
    assert!(
        took < deadline + Duration::from_secs(5),
        "drop took {took:?} with a timeout of {deadline:?}"
    );
    drop(tcp);
    Ok(())
}

/// A split the last rank never joins: the others' `split` returns `Timeout` naming the split by
/// its init deadline (plus polling slack), with no thread left inside NCCL. On main the split
/// made a blocking communicator and NCCL blocked inside `ncclCommSplit` until every rank joined:
/// this case hung there (the watchdog could only log it).
pub(crate) fn split_absent() -> Result<(), String> {
    let r = rig(Duration::from_secs(30))?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let deadline = Duration::from_secs(3);
    if me + 1 < n {
        let t = Instant::now();
        let got = r.comm.split(
            0,
            me as i32,
            CommConfig {
                init_timeout: deadline,
                ..CommConfig::default()
            },
        );
        let took = t.elapsed();
        let e = match got {
            Ok(_) => panic!("rank {me}: split succeeded without rank {}", n - 1),
            Err(e) => e,
        };
        println!(
            "rank {me}: split without rank {} failed after {took:.1?}: {e}",
            n - 1
        );
        let text = e.to_string();
        assert!(
            matches!(e, dist_nccl::NcclError::Timeout { .. }) && text.contains("split"),
            "rank {me}: want a split timeout, got: {text}"
        );
        assert!(
            took < deadline + Duration::from_secs(3),
            "rank {me}: split took {took:?} with an init deadline of {deadline:?}"
        );
    } else {
        println!("rank {me}: never joining the split");
    }
    r.tcp.barrier().unwrap();
    // The parent's bootstrap may hold the half-done split's messages: end it by abort.
    r.comm.abort();
    r.tcp.barrier().unwrap();
    Ok(())
}

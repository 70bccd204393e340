//! The NCCL cases about bounds: a communicator dropped with work a dead peer never completes,
//! and a split a peer never joins.

use std::time::{Duration, Instant};

use dist_core::{Backend, ReduceOp};
use dist_nccl::{CommConfig, Communicator};

use super::{Rig, connect_peers, rig, up};

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

/// The first point-to-point call between two ranks, and the first collective of a
/// communicator, while the last rank never calls NCCL again. With `connect_peers` (the
/// default) every pair of ranks connected while the communicator formed, so rank 0's receive
/// from the idle rank only enqueues, and the synchronize after it fails at the 3 s timeout (the
/// watchdog aborts: no thread is inside NCCL). (A small send would complete: NCCL buffers it in
/// the connection, receive posted or not.) The first all_reduce on a split communicator is
/// bounded the same way when NCCL connects rings and trees at init (`NCCL_RUNTIME_CONNECT=0`,
/// which the launcher sets). Before `connect_peers`, NCCL connected the pair inside the send's
/// `ncclGroupEnd`, which waited for the idle rank for ever: rank 0 stayed inside NCCL (2 x H200: still there
/// after 40 s, `docs/results/2026-11-30-2xH200-efd5e41/fe7a790-connect-absent-without.txt`).
pub(crate) fn connect_absent() -> Result<(), String> {
    use std::sync::mpsc;
    let timeout = Duration::from_secs(3);
    let Some((r, sub)) = split_with_idle_rank(timeout)? else {
        return Ok(());
    };
    let (me, n) = (r.comm.rank(), r.comm.size());
    let idle = n - 1;
    let mut x = up(r.comm.stream(), &[1.0f32; 256]);
    let mut y = up(sub.stream(), &[1.0f32; 256]);
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            // The collective first, on `sub`: its abort leaves `r.comm` alone (no shared
            // resources between them), while `r.comm`'s would take down its splits' parent.
            let mut lines = Vec::new();
            println!("rank {me}: first all_reduce on the split, the idle rank absent");
            let t = Instant::now();
            let reduced = sub.all_reduce_in_place(&mut y, ReduceOp::Sum);
            let enq = t.elapsed();
            let synced = sub.synchronize();
            lines.push((
                "all_reduce",
                enq,
                t.elapsed(),
                reduced.err().map(|e| e.to_string()),
                synced.err(),
            ));
            if me == 0 {
                println!("rank {me}: first recv from the idle rank {idle}");
                let t = Instant::now();
                let got = r.comm.recv(&mut x, idle);
                let enq = t.elapsed();
                let synced = r.comm.synchronize();
                lines.push((
                    "recv",
                    enq,
                    t.elapsed(),
                    got.err().map(|e| e.to_string()),
                    synced.err(),
                ));
            }
            let _ = tx.send(lines);
        });
        let Ok(lines) = rx.recv_timeout(Duration::from_secs(40)) else {
            println!("rank {me}: still inside NCCL 40 s after the first call to an idle rank");
            std::process::exit(1);
        };
        for (what, enq, took, call_err, sync_err) in lines {
            println!(
                "rank {me}: first {what} to/with idle rank {idle}: call returned after {enq:.1?} \
                 ({call_err:?}); synchronize failed after {took:.1?}: {sync_err:?}"
            );
            assert!(call_err.is_none(), "rank {me}: the {what} itself failed");
            let e = sync_err.unwrap_or_else(|| panic!("rank {me}: the {what} completed"));
            assert!(
                matches!(e, dist_nccl::NcclError::Timeout { .. }),
                "rank {me}: want a timeout for the {what}, got: {e}"
            );
            assert!(
                enq < Duration::from_secs(1) && took < timeout + Duration::from_secs(5),
                "rank {me}: the {what} took {enq:?} to enqueue and {took:?} to fail"
            );
        }
    });
    // The aborts ended the kernels they left on the device: each stream drains.
    for (what, stream) in [("communicator", r.comm.stream()), ("split", sub.stream())] {
        let t = Instant::now();
        let mark = stream
            .context()
            .new_event(None)
            .map_err(|e| e.to_string())?;
        mark.record(stream).map_err(|e| e.to_string())?;
        while !mark.is_complete() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "rank {me}: the {what}'s stream still busy 5 s after its abort"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        println!(
            "rank {me}: the {what}'s stream drained {:.1?} after the errors",
            t.elapsed()
        );
    }
    // The teardown after the aborts, bounded. It used to hang (runs eef0a71 … efd5e41 in
    // docs/results/2026-11-30-2xH200-efd5e41/; 6 of 7 tries in run 0aa176d-diag-b,
    // docs/results/2026-11-30-2xH200-8c8398a/): the split's `ncclCommAbort` waits
    // in `cuMemFreeHost` for the device to go idle, which needs the main communicator's pending
    // receive to end, which needs its abort; that abort was deferred behind the main
    // communicator's lock, which its watchdog held while blocked in `cuEventRecord` behind the
    // split's abort. The watchdog now makes no CUDA call under the lock (`watchdog.rs`).
    // `DIST_TEST_FREE_FIRST=1` frees the buffers before the communicators.
    let buffers_first = std::env::var_os("DIST_TEST_FREE_FIRST").is_some();
    release_and_tear_down(r, sub, (x, y), buffers_first);
    Ok(())
}

/// Two communicators of one device stalled at once by one idle peer (a split's all_reduce and
/// the main communicator's, both enqueued before either times out, and no `synchronize`, which
/// has a deadline of its own): both are aborted at their timeout and the teardown ends. The
/// first `ncclCommAbort` waits in `cuMemFreeHost` for the device to go idle, which needs the
/// other's kernel to end, which needs the other's abort. Before the deadline thread
/// (`dist-nccl/src/deadline.rs`), that abort was decided by the other's watchdog after an event
/// query, which blocks behind the first abort: both waited for ever (the deadlock of run
/// 0aa176d-diag-b, in a second shape, found in review).
pub(crate) fn two_stalled() -> Result<(), String> {
    let timeout = Duration::from_secs(3);
    let Some((r, sub)) = split_with_idle_rank(timeout)? else {
        return Ok(());
    };
    let me = r.comm.rank();
    let mut x = up(r.comm.stream(), &[1.0f32; 256]);
    let mut y = up(sub.stream(), &[1.0f32; 256]);
    let t = Instant::now();
    sub.all_reduce_in_place(&mut y, ReduceOp::Sum)
        .map_err(|e| format!("rank {me}: the split's all_reduce: {e}"))?;
    r.comm
        .all_reduce_in_place(&mut x, ReduceOp::Sum)
        .map_err(|e| format!("rank {me}: the main all_reduce: {e}"))?;
    let (main, split) = (r.comm.abort_handle(), sub.abort_handle());
    loop {
        let (a, b) = (main.aborted(), split.aborted());
        if let (Some(a), Some(b)) = (&a, &b) {
            println!(
                "rank {me}: both aborted {:.1?} after the calls: main: {a}; split: {b}",
                t.elapsed()
            );
            break;
        }
        assert!(
            t.elapsed() < timeout + Duration::from_secs(10),
            "rank {me}: {:.1?} after the calls: main aborted: {a:?}, split aborted: {b:?}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    release_and_tear_down(r, sub, (x, y), false);
    Ok(())
}

/// The main communicator and a split of it (with `timeout`), the last rank idle: `None` on
/// that rank, which makes no NCCL call after the split and waits (at most 90 s) for rank 0's
/// word from [`release_and_tear_down`].
fn split_with_idle_rank(timeout: Duration) -> Result<Option<(Rig, Communicator)>, String> {
    let r = rig(timeout)?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let cfg = CommConfig {
        timeout,
        connect_peers: connect_peers(),
        ..CommConfig::default()
    };
    let sub = r
        .comm
        .split(0, me as i32, cfg)
        .unwrap_or_else(|e| panic!("{e}"));
    r.tcp.barrier().unwrap();
    if me == n - 1 {
        println!("rank {me}: calling NCCL no more");
        let mut done = [0u8; 1];
        r.tcp
            .recv_timeout(&mut done, 0, Duration::from_secs(90))
            .unwrap_or_else(|e| panic!("{e}"));
        return Ok(None);
    }
    Ok(Some((r, sub)))
}

/// Lets the idle rank of [`split_with_idle_rank`] go (from rank 0), then drops the split, the
/// main communicator and `buffers` (first, if `buffers_first`) and the TCP job, and checks
/// that all of it ended within 10 s.
fn release_and_tear_down(r: Rig, sub: Communicator, buffers: impl Sized, buffers_first: bool) {
    let (me, n) = (r.comm.rank(), r.comm.size());
    if me == 0 {
        r.tcp.send(&[1], n - 1).unwrap_or_else(|e| panic!("{e}"));
    }
    let mut buffers = Some(buffers);
    let t = Instant::now();
    if buffers_first {
        drop(buffers.take());
        println!("rank {me}: buffers freed first, after {:.1?}", t.elapsed());
    }
    drop(sub);
    let Rig { tcp, comm } = r;
    drop(comm);
    drop(buffers);
    drop(tcp);
    println!(
        "rank {me}: communicators and buffers dropped after {:.1?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "rank {me}: the teardown took {:.1?}",
        t.elapsed()
    );
}

//! On GPUs, through `HybridBackend`: every collective on device buffers
//! (the uneven ones and point-to-point included) against host references, with the call check
//! on; ranks whose uneven counts differ get an error on every rank; and the asynchronous
//! device collectives' handles (`GpuWork`): a bucketed gradient all-reduce overlapped with host
//! compute, a forgotten handle whose buffer is still ordered after its work, and a wait that
//! times out on a rank left alone, ending in a named error.

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use dist_core::{Backend, ReduceOp};
use dist_hybrid::HybridBackend;
use dist_multirank::TestElem;
use dist_nccl::NcclType;
use half::bf16;

use super::nccl_failures::{dev, hybrid_with};

/// The NCCL timeout of these cases, far above what any of them waits for.
const NCCL_TIMEOUT: Duration = Duration::from_secs(30);

fn down<T: NcclType + Default>(h: &HybridBackend, x: &CudaSlice<T>) -> Vec<T> {
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.nccl()
        .unwrap()
        .stream()
        .clone_dtoh(x)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A value no input takes, so that an output left unwritten is seen.
fn poison<T: TestElem + NcclType>(h: &HybridBackend, n: usize) -> CudaSlice<T> {
    let mut v = vec![T::val(0, 0, false); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).fill(0x5A);
    dev(h, &v)
}

fn bits<T: TestElem>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

/// Rank r's elements `from..from + k`.
fn vals<T: TestElem>(r: usize, from: usize, k: usize) -> Vec<T> {
    (from..from + k).map(|i| T::val(r, i, false)).collect()
}

/// Every collective of one element type on device buffers, `k` elements a block.
fn one_type<T: TestElem + NcclType + Default>(h: &HybridBackend, k: usize) {
    let (me, n) = (h.rank(), h.world_size());
    let name = <T as NcclType>::NAME;
    let check = |what: &str, op: ReduceOp, base: usize, got: &[T]| {
        for (j, g) in got.iter().enumerate() {
            assert!(
                T::matches(op, n, base + j, false, *g),
                "{what} {name} {op}: element {j} is {g:?}"
            );
        }
    };
    let mine = vals::<T>(me, 0, k);
    let full = vals::<T>(me, 0, k * n);
    let send = dev(h, &mine);
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut x = dev(h, &mine);
        h.all_reduce(&mut x, op).unwrap_or_else(|e| panic!("{e}"));
        check("all_reduce", op, 0, &down(h, &x));
        for root in 0..n {
            let mut out = poison::<T>(h, k);
            h.reduce(&send, (me == root).then_some(&mut out), op, root)
                .unwrap_or_else(|e| panic!("{e}"));
            if me == root {
                check("reduce", op, 0, &down(h, &out));
            }
        }
        let big = dev(h, &full);
        let mut part = poison::<T>(h, k);
        h.reduce_scatter(&big, &mut part, op)
            .unwrap_or_else(|e| panic!("{e}"));
        check("reduce_scatter", op, me * k, &down(h, &part));
    }
    let every: Vec<T> = (0..n).flat_map(|r| vals::<T>(r, 0, k)).collect();
    for root in 0..n {
        let mut b = if me == root {
            dev(h, &mine)
        } else {
            poison::<T>(h, k)
        };
        h.broadcast(&mut b, root).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            bits(&down(h, &b)),
            bits(&vals::<T>(root, 0, k)),
            "broadcast {name} from {root}"
        );
        let mut all = poison::<T>(h, k * n);
        h.gather(&send, (me == root).then_some(&mut all), root)
            .unwrap_or_else(|e| panic!("{e}"));
        if me == root {
            assert_eq!(
                bits(&down(h, &all)),
                bits(&every),
                "gather {name} to {root}"
            );
        }
        let src = dev(h, &every);
        let mut got = poison::<T>(h, k);
        h.scatter((me == root).then_some(&src), &mut got, root)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            bits(&down(h, &got)),
            bits(&mine),
            "scatter {name} from {root}"
        );
    }
    let mut all = poison::<T>(h, k * n);
    h.all_gather(&send, &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(bits(&down(h, &all)), bits(&every), "all_gather {name}");
    let big = dev(h, &full);
    let mut out = poison::<T>(h, k * n);
    h.all_to_all(&big, &mut out)
        .unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<T> = (0..n).flat_map(|q| vals::<T>(q, me * k, k)).collect();
    assert_eq!(bits(&down(h, &out)), bits(&want), "all_to_all {name}");
    uneven::<T>(h, k);
    p2p::<T>(h, k);
}

/// all_to_all_v and the uneven three: rank r's block has `r * k + 1` elements, and in
/// all_to_all_v rank i sends `(i + 2 j) % 3 * k` elements (some none) to rank j.
fn uneven<T: TestElem + NcclType + Default>(h: &HybridBackend, k: usize) {
    let (me, n) = (h.rank(), h.world_size());
    let name = <T as NcclType>::NAME;
    let counts: Vec<usize> = (0..n).map(|r| r * k + 1).collect();
    let total: usize = counts.iter().sum();
    let every: Vec<T> = (0..n).flat_map(|r| vals::<T>(r, 0, counts[r])).collect();
    let mine = vals::<T>(me, 0, counts[me]);
    let send = dev(h, &mine);
    let mut out = poison::<T>(h, total);
    h.all_gather_v(&send, &mut out, &counts)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        bits(&down(h, &out)),
        bits(&every),
        "all_gather_v {name} {counts:?}"
    );
    let src = dev(h, &every);
    for root in 0..n {
        let mut out = poison::<T>(h, total);
        h.gather_v(&send, (me == root).then_some(&mut out), &counts, root)
            .unwrap_or_else(|e| panic!("{e}"));
        if me == root {
            assert_eq!(
                bits(&down(h, &out)),
                bits(&every),
                "gather_v {name} to {root}"
            );
        }
        let mut got = poison::<T>(h, counts[me]);
        h.scatter_v((me == root).then_some(&src), &counts, &mut got, root)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            bits(&down(h, &got)),
            bits(&mine),
            "scatter_v {name} from {root}"
        );
    }
    let c = |i: usize, j: usize| (i + 2 * j) % 3 * k;
    let sc: Vec<usize> = (0..n).map(|j| c(me, j)).collect();
    let rc: Vec<usize> = (0..n).map(|j| c(j, me)).collect();
    // Block j of rank i's input: rank i's values from 1000 j.
    let input: Vec<T> = (0..n)
        .flat_map(|j| vals::<T>(me, 1000 * j, sc[j]))
        .collect();
    let want: Vec<T> = (0..n)
        .flat_map(|j| vals::<T>(j, 1000 * me, rc[j]))
        .collect();
    let input = dev(h, &input);
    let mut out = poison::<T>(h, want.len());
    h.all_to_all_v(&input, &sc, &mut out, &rc)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        bits(&down(h, &out)),
        bits(&want),
        "all_to_all_v {name} {sc:?} {rc:?}"
    );
}

/// Device buffers over NCCL point-to-point: rank 0 to rank 1 and back by send_to/recv_from,
/// then around the ring by send_recv.
fn p2p<T: TestElem + NcclType + Default>(h: &HybridBackend, k: usize) {
    let (me, n) = (h.rank(), h.world_size());
    let name = <T as NcclType>::NAME;
    let mine = vals::<T>(me, 7, k);
    let send = dev(h, &mine);
    for (from, to) in [(0, 1), (1, 0)] {
        if me == from {
            h.send_to(&send, to).unwrap_or_else(|e| panic!("{e}"));
            h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
        } else if me == to {
            let mut got = poison::<T>(h, k);
            h.recv_from(&mut got, from)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                bits(&down(h, &got)),
                bits(&vals::<T>(from, 7, k)),
                "recv {name} from {from}"
            );
        }
    }
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let mut got = poison::<T>(h, k);
    h.send_recv(&send, right, &mut got, left)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        bits(&down(h, &got)),
        bits(&vals::<T>(left, 7, k)),
        "send_recv {name} from {left}"
    );
}

/// Every collective on device buffers through the hybrid, three element types, a small and a
/// large block, with the call check on: all verified, nothing left unchecked, no failure.
pub fn collectives() -> Result<(), String> {
    let h = hybrid_with(None, NCCL_TIMEOUT)?;
    let t = Instant::now();
    for k in [1usize, 1009, 1 << 18] {
        one_type::<f32>(&h, k);
        one_type::<bf16>(&h, k);
        one_type::<i64>(&h, k);
    }
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(h.nccl_failure(), None);
    assert_eq!(h.unchecked_calls(), 0, "calls the check did not compare");
    h.barrier().unwrap();
    println!(
        "rank {}: every device collective through HybridBackend verified in {:.1?}",
        h.rank(),
        t.elapsed()
    );
    Ok(())
}

/// The last rank cuts the same total of an all_gather_v differently (each receive at least as
/// long as the send it meets, so no rank's buffer can be overrun): the check finds the
/// counts' fingerprints differ and every rank gets an error naming the call, within 1 s.
pub fn uneven_mismatch() -> Result<(), String> {
    let h = hybrid_with(None, NCCL_TIMEOUT)?;
    let (me, n) = (h.rank(), h.world_size());
    let mut x = dev(&h, &[1.0f32; 64]);
    h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.barrier().unwrap();
    // Everyone: 4 each. The last rank: 5 for rank 0, 3 for itself (2 ranks: rank 0 sends 4
    // where the last expects 5, the last sends 3 where rank 0 expects 4).
    let mut counts = vec![4usize; n];
    if me == n - 1 {
        counts[0] = 5;
        counts[n - 1] = 3;
    }
    let send = dev(&h, &vec![1.0f32; counts[me]]);
    let mut out = dev(&h, &vec![0.0f32; counts.iter().sum()]);
    let t = Instant::now();
    let first = h.all_gather_v(&send, &mut out, &counts);
    let e = match first {
        Err(e) => e,
        Ok(()) => loop {
            match h.synchronize_nccl() {
                Err(e) => break e,
                Ok(()) if t.elapsed() > Duration::from_secs(10) => {
                    panic!("rank {me}: no error 10 s after counts that differ: silent")
                }
                Ok(()) => std::thread::yield_now(),
            }
        },
    };
    let waited = t.elapsed();
    let text = e.to_string();
    println!("rank {me}: error after {waited:.2?}: {text}");
    for want in [
        "mismatch",
        "all_gather_v",
        "rank 0",
        &format!("rank {}", n - 1),
    ] {
        assert!(text.contains(want), "rank {me}: {want:?} not in: {text}");
    }
    assert!(
        waited < Duration::from_secs(1),
        "rank {me}: {waited:?} to the error"
    );
    h.barrier().unwrap();
    Ok(())
}

/// A rank's gradient bucket `b` at element `i` (exact sums in f32 for these sizes).
fn grad(rank: usize, b: usize, i: usize) -> f32 {
    ((rank * 7 + b * 3 + i) % 16) as f32
}

/// What the host computes while a bucket travels: the reference sum of the bucket (so the
/// compute is real work whose result the check below uses).
fn host_reference(n: usize, b: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (0..n).map(|r| grad(r, b, i)).sum())
        .collect()
}

/// GpuWork: a bucketed gradient all-reduce (4 buckets of 4 MiB of f32), each bucket's
/// all_reduce_async issued and the host's compute done while it travels, then every handle
/// waited on and every bucket checked; is_completed seen true after a wait; a dropped
/// unfinished handle waits (the call before it has ended when the drop returns); a forgotten
/// handle's buffer read afterwards holds the reduced values (cudarc orders the read after the
/// work: the handle's drop never ran), and dropping that buffer is safe; then the other async
/// calls, several in flight at once.
pub fn work() -> Result<(), String> {
    let h = hybrid_with(None, NCCL_TIMEOUT)?;
    let (me, n) = (h.rank(), h.world_size());
    const LEN: usize = 1 << 20;
    let mut buckets: Vec<CudaSlice<f32>> = (0..4)
        .map(|b| dev(&h, &(0..LEN).map(|i| grad(me, b, i)).collect::<Vec<_>>()))
        .collect();
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let t = Instant::now();
    let mut refs = Vec::new();
    let mut pending_during_compute = 0;
    let mut works = Vec::new();
    for (b, bucket) in buckets.iter_mut().enumerate() {
        let w = h
            .all_reduce_async(bucket, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
        refs.push(host_reference(n, b, LEN));
        pending_during_compute += usize::from(!w.is_completed());
        works.push(w);
    }
    let issued = t.elapsed();
    for w in works {
        assert_eq!(w.op(), "all_reduce");
        w.wait().unwrap_or_else(|e| panic!("{e}"));
    }
    println!(
        "rank {me}: 4 buckets issued and the host's compute done in {issued:.1?}, all waited by \
         {:.1?}; {pending_during_compute} of 4 still in flight after their compute",
        t.elapsed()
    );
    for (b, bucket) in buckets.iter().enumerate() {
        let got = down(&h, bucket);
        assert!(
            got == refs[b],
            "bucket {b}: first element {} vs {}",
            got[0],
            refs[b][0]
        );
    }
    // A finished handle says so.
    let mut x = dev(&h, &[me as f32 + 1.0; 4096]);
    let w = h.all_reduce_async(&mut x, ReduceOp::Sum).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !w.is_completed() {
        assert!(
            Instant::now() < deadline,
            "rank {me}: not completed in 10 s"
        );
        std::thread::yield_now();
    }
    w.wait_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e}"));
    let want: f32 = (1..=n).map(|r| r as f32).sum();
    assert!(down(&h, &x).iter().all(|v| *v == want));
    // Dropping an unfinished handle waits for it: the call enqueued before it (64 MiB) has
    // ended once the drop returns.
    let mut a = dev(&h, &vec![me as f32 + 1.0; 16 * LEN]);
    let mut b = dev(&h, &vec![me as f32 + 1.0; LEN]);
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    let first = h.all_reduce_async(&mut a, ReduceOp::Sum).unwrap();
    drop(h.all_reduce_async(&mut b, ReduceOp::Sum).unwrap());
    assert!(
        first.is_completed(),
        "rank {me}: dropping an unfinished handle did not wait for it"
    );
    first.wait().unwrap_or_else(|e| panic!("{e}"));
    assert!(down(&h, &a).iter().all(|v| *v == want));
    assert!(down(&h, &b).iter().all(|v| *v == want));
    // A forgotten handle: the buffer's next use still comes after the work. Read on another
    // stream of the context, which cudarc makes wait for the buffer's write event.
    let mut y = dev(&h, &vec![me as f32 + 1.0; LEN]);
    std::mem::forget(h.all_reduce_async(&mut y, ReduceOp::Sum).unwrap());
    let other = h.nccl().unwrap().context().new_stream().unwrap();
    let read = other.clone_dtoh(&y).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        read.iter().all(|v| *v == want),
        "rank {me}: read before the work ended: {}",
        read[0]
    );
    drop(y);
    more_async(&h);
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(h.nccl_failure(), None);
    h.barrier().unwrap();
    Ok(())
}

/// The other `_async` calls, several in flight at once, waited on in reverse order: an
/// all_gather_v, a gather_v to the last rank, then point-to-point between ranks 0 and 1 (rank
/// 0 sends first, rank 1 receives first, so the two single calls meet in order).
fn more_async(h: &HybridBackend) {
    let (me, n) = (h.rank(), h.world_size());
    let counts: Vec<usize> = (0..n).map(|r| 2 * r + 5).collect();
    let total: usize = counts.iter().sum();
    let block = |r: usize| -> Vec<i32> { (0..counts[r]).map(|i| (r * 100 + i) as i32).collect() };
    let every: Vec<i32> = (0..n).flat_map(block).collect();
    let mine = dev(h, &block(me));
    let mut all = dev(h, &vec![-1i32; total]);
    let mut gathered = dev(h, &vec![-1i32; total]);
    let mut inb = dev(h, &vec![-1i32; 64]);
    let out = dev(h, &vec![me as i32; 64]);
    let mut works = vec![
        h.all_gather_v_async(&mine, &mut all, &counts)
            .unwrap_or_else(|e| panic!("{e}")),
        h.gather_v_async(
            &mine,
            (me == n - 1).then_some(&mut gathered),
            &counts,
            n - 1,
        )
        .unwrap_or_else(|e| panic!("{e}")),
    ];
    if me == 0 {
        works.push(h.send_async(&out, 1).unwrap_or_else(|e| panic!("{e}")));
        works.push(h.recv_async(&mut inb, 1).unwrap_or_else(|e| panic!("{e}")));
    } else if me == 1 {
        works.push(h.recv_async(&mut inb, 0).unwrap_or_else(|e| panic!("{e}")));
        works.push(h.send_async(&out, 0).unwrap_or_else(|e| panic!("{e}")));
    }
    for w in works.into_iter().rev() {
        w.wait().unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(down(h, &all), every, "all_gather_v_async");
    if me == n - 1 {
        assert_eq!(down(h, &gathered), every, "gather_v_async");
    }
    if me < 2 {
        let peer = 1 - me;
        assert_eq!(
            down(h, &inb),
            vec![peer as i32; 64],
            "recv_async from {peer}"
        );
    }
}

/// The last rank makes no NCCL call: rank 0's GpuWork::wait_timeout of its all_reduce ends
/// within its deadline (plus the abort) in a named timeout saying where every rank is.
pub fn work_timeout() -> Result<(), String> {
    const WAIT: Duration = Duration::from_secs(2);
    let h = hybrid_with(None, NCCL_TIMEOUT)?;
    let (me, n) = (h.rank(), h.world_size());
    let idle = n - 1;
    let mut x = dev(&h, &[1.0f32; 1024]);
    h.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    h.synchronize_nccl().unwrap_or_else(|e| panic!("{e}"));
    h.barrier().unwrap();
    if me == idle {
        let mut done = [0u8; 1];
        h.tcp()
            .recv_timeout(&mut done, 0, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        println!("rank {me}: made no second NCCL call");
        return Ok(());
    }
    let t = Instant::now();
    let w = h.all_reduce_async(&mut x, ReduceOp::Sum).unwrap();
    assert!(
        !w.is_completed(),
        "an all_reduce without rank {idle} completed"
    );
    let e = w
        .wait_timeout(WAIT)
        .expect_err("the all_reduce cannot complete without the idle rank");
    let took = t.elapsed();
    let text = e.to_string();
    println!("rank {me}: error after {took:.2?}: {text}");
    assert!(
        matches!(e, dist_hybrid::HybridError::NcclTimeout { .. }),
        "rank {me}: not a timeout: {text}"
    );
    for want in ["all_reduce", &format!("rank {idle} finished #1 all_reduce")] {
        assert!(text.contains(want), "rank {me}: {want:?} not in: {text}");
    }
    assert!(
        took < WAIT + Duration::from_secs(3),
        "rank {me}: took {took:.2?}"
    );
    // The communicator is aborted: later calls fail at once.
    assert!(h.all_reduce(&mut x, ReduceOp::Sum).is_err());
    if me == 0 {
        h.tcp().send(&[1], idle).unwrap_or_else(|e| panic!("{e}"));
    }
    Ok(())
}

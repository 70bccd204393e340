//! The NCCL collective cases: every collective of every element type with every valid op and
//! root against host references, over NCCL's default transports and over its socket
//! transport, and a communicator split into groups that run different collectives at once.

use std::time::{Duration, Instant};

use dist_core::{Backend, DType, ReduceOp};
use dist_multirank::TestElem;
use dist_nccl::{CommConfig, NcclType};
use half::{bf16, f16};

use super::{Rig, bits, down, poison, rig, up};

/// Every collective of one element type, every valid op, every root, against host references.
fn one_type<T: TestElem + NcclType + Default>(r: &Rig, counts: &[usize]) {
    let (me, n) = (r.comm.rank(), r.comm.size());
    let s = r.comm.stream();
    let ops: Vec<ReduceOp> = T::ops()
        .into_iter()
        .filter(|o| !matches!(o, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor))
        .collect();
    for &count in counts {
        let mine: Vec<T> = (0..count).map(|i| T::val(me, i, false)).collect();
        let full: Vec<T> = (0..count * n).map(|i| T::val(me, i, false)).collect();
        let check = |what: &str, op: ReduceOp, base: usize, got: &[T]| {
            for (j, g) in got.iter().enumerate() {
                assert!(
                    T::matches(op, n, base + j, false, *g),
                    "{what} {} {op} count {count}: element {j} is {g:?}",
                    <T as NcclType>::NAME
                );
            }
        };
        for &op in &ops {
            let send = up(s, &mine);
            let mut out = up(s, &poison::<T>(count));
            r.comm
                .all_reduce(&send, &mut out, op)
                .unwrap_or_else(|e| panic!("{e}"));
            check("all_reduce", op, 0, &down(&r.comm, &out));
            let mut inplace = up(s, &mine);
            r.comm
                .all_reduce_in_place(&mut inplace, op)
                .unwrap_or_else(|e| panic!("{e}"));
            check("all_reduce in place", op, 0, &down(&r.comm, &inplace));
            for root in 0..n {
                let mut out = up(s, &poison::<T>(count));
                r.comm
                    .reduce(&send, (me == root).then_some(&mut out), op, root)
                    .unwrap_or_else(|e| panic!("{e}"));
                if me == root {
                    check("reduce", op, 0, &down(&r.comm, &out));
                }
            }
            let big = up(s, &full);
            let mut part = up(s, &poison::<T>(count));
            r.comm
                .reduce_scatter(&big, &mut part, op)
                .unwrap_or_else(|e| panic!("{e}"));
            check("reduce_scatter", op, me * count, &down(&r.comm, &part));
        }
        for root in 0..n {
            let mut b = if me == root {
                up(s, &mine)
            } else {
                up(s, &poison::<T>(count))
            };
            r.comm
                .broadcast(&mut b, root)
                .unwrap_or_else(|e| panic!("{e}"));
            let want: Vec<T> = (0..count).map(|i| T::val(root, i, false)).collect();
            assert_eq!(
                bits(&down(&r.comm, &b)),
                bits(&want),
                "broadcast from {root}"
            );

            let send = up(s, &mine);
            let mut all = up(s, &poison::<T>(count * n));
            r.comm
                .gather(&send, (me == root).then_some(&mut all), root)
                .unwrap_or_else(|e| panic!("{e}"));
            if me == root {
                let got = down(&r.comm, &all);
                for q in 0..n {
                    let want: Vec<T> = (0..count).map(|i| T::val(q, i, false)).collect();
                    assert_eq!(
                        bits(&got[q * count..(q + 1) * count]),
                        bits(&want),
                        "gather block {q}"
                    );
                }
            }
            let src: Vec<T> = (0..count * n).map(|i| T::val(root, i, false)).collect();
            let src_d = up(s, &src);
            let mut part = up(s, &poison::<T>(count));
            r.comm
                .scatter((me == root).then_some(&src_d), &mut part, root)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                bits(&down(&r.comm, &part)),
                bits(&src[me * count..(me + 1) * count]),
                "scatter from {root}"
            );
        }
        let send = up(s, &mine);
        let mut all = up(s, &poison::<T>(count * n));
        r.comm
            .all_gather(&send, &mut all)
            .unwrap_or_else(|e| panic!("{e}"));
        let got = down(&r.comm, &all);
        for q in 0..n {
            let want: Vec<T> = (0..count).map(|i| T::val(q, i, false)).collect();
            assert_eq!(
                bits(&got[q * count..(q + 1) * count]),
                bits(&want),
                "all_gather block {q}"
            );
        }
        let big = up(s, &full);
        let mut out = up(s, &poison::<T>(count * n));
        r.comm
            .all_to_all(&big, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        let got = down(&r.comm, &out);
        for q in 0..n {
            let want: Vec<T> = (0..count)
                .map(|i| T::val(q, me * count + i, false))
                .collect();
            assert_eq!(
                bits(&got[q * count..(q + 1) * count]),
                bits(&want),
                "all_to_all block {q}"
            );
        }
        // send/recv around the ring, fused in a group.
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let mut inb = up(s, &poison::<T>(count));
        r.comm
            .group(|g| {
                g.send(&send, right)?;
                g.recv(&mut inb, left)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let want: Vec<T> = (0..count).map(|i| T::val(left, i, false)).collect();
        assert_eq!(bits(&down(&r.comm, &inb)), bits(&want), "recv from {left}");
    }
}

fn each_type(r: &Rig, counts: &[usize]) {
    for d in DType::ALL {
        match d {
            DType::F32 => one_type::<f32>(r, counts),
            DType::F64 => one_type::<f64>(r, counts),
            DType::F16 => one_type::<f16>(r, counts),
            DType::BF16 => one_type::<bf16>(r, counts),
            DType::I8 => one_type::<i8>(r, counts),
            DType::U8 => one_type::<u8>(r, counts),
            DType::I32 => one_type::<i32>(r, counts),
            DType::U32 => one_type::<u32>(r, counts),
            DType::I64 => one_type::<i64>(r, counts),
            DType::U64 => one_type::<u64>(r, counts),
            other => panic!("untested type {other}"),
        }
    }
}

/// Counts: one, a prime, and one large enough for NCCL's large-message paths.
const COUNTS: [usize; 3] = [1, 1009, 1 << 20 | 3];

pub(crate) fn collectives() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let t = Instant::now();
    each_type(&r, &COUNTS);
    println!(
        "every collective x type x op verified in {:.1?}",
        t.elapsed()
    );
    r.tcp.barrier().unwrap();
    Ok(())
}

/// The same over NCCL's socket transport, the stand-in for two hosts.
pub(crate) fn collectives_socket() -> Result<(), String> {
    // SAFETY: set before any other thread of this process exists (the first thing the case
    // does), so no one reads the environment concurrently.
    unsafe {
        std::env::set_var("NCCL_P2P_DISABLE", "1");
        std::env::set_var("NCCL_SHM_DISABLE", "1");
    }
    let r = rig(Duration::from_secs(60))?;
    each_type(&r, &[1, 1009, 65_537]);
    println!("every collective verified over NCCL's socket transport");
    r.tcp.barrier().unwrap();
    Ok(())
}

/// Split into two groups (by rank parity) that run different collectives at once.
pub(crate) fn split() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let color = (me % 2) as u32;
    let sub = r
        .comm
        .split(color, me as i32, CommConfig::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let members: Vec<usize> = (0..n).filter(|q| q % 2 == me % 2).collect();
    assert_eq!(sub.size(), members.len());
    assert_eq!(sub.rank(), members.iter().position(|q| *q == me).unwrap());
    let s = sub.stream().clone();
    if color == 0 {
        let mut x = up(&s, &vec![me as f32 + 1.0; 4096]);
        sub.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        let want: f32 = members.iter().map(|q| *q as f32 + 1.0).sum();
        assert!(down(&sub, &x).iter().all(|v| *v == want));
    } else {
        let mut x = up(&s, &vec![me as u64; 4096]);
        sub.broadcast(&mut x, 0).unwrap();
        assert!(down(&sub, &x).iter().all(|v| *v == members[0] as u64));
    }
    // The parent still works.
    let mut y = up(r.comm.stream(), &[1i32; 7]);
    r.comm.all_reduce_in_place(&mut y, ReduceOp::Sum).unwrap();
    assert_eq!(down(&r.comm, &y), vec![n as i32; 7]);
    drop(sub);
    r.tcp.barrier().unwrap();
    println!(
        "split into {} groups ran different collectives at once",
        n.min(2)
    );
    Ok(())
}

/// The uneven collectives on the communicator itself, alone and recorded inside a group beside
/// an all_reduce (their own NCCL group nests in the outer one and launches at its end), and a
/// `Work` handle on the stream: every result checked.
pub(crate) fn uneven_grouped() -> Result<(), String> {
    let r = rig(Duration::from_secs(60))?;
    let (me, n) = (r.comm.rank(), r.comm.size());
    let s = r.comm.stream();
    // Rank q's block: q * 1000 + 3 elements of q's values.
    let counts: Vec<usize> = (0..n).map(|q| q * 1000 + 3).collect();
    let total: usize = counts.iter().sum();
    let block =
        |q: usize| -> Vec<u32> { (0..counts[q]).map(|i| (q * 1_000_000 + i) as u32).collect() };
    let every: Vec<u32> = (0..n).flat_map(block).collect();
    let mine = up(s, &block(me));
    let mut out = up(s, &vec![u32::MAX; total]);
    r.comm
        .all_gather_v(&mine, &mut out, &counts)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&r.comm, &out), every, "all_gather_v");
    let mut out = up(s, &vec![u32::MAX; total]);
    let mut sum = up(s, &vec![me as u32 + 1; 4099]);
    r.comm
        .group(|g| {
            g.all_gather_v(&mine, &mut out, &counts)?;
            g.all_reduce_in_place(&mut sum, ReduceOp::Sum)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(down(&r.comm, &out), every, "all_gather_v in a group");
    let want = (n * (n + 1) / 2) as u32;
    assert!(
        down(&r.comm, &sum).iter().all(|v| *v == want),
        "all_reduce in the group"
    );
    let src = up(s, &every);
    for root in 0..n {
        let mut got = up(s, &vec![u32::MAX; counts[me]]);
        let mut all = up(s, &vec![u32::MAX; total]);
        r.comm
            .group(|g| {
                g.scatter_v((me == root).then_some(&src), &mut got, &counts, root)?;
                g.gather_v(&mine, (me == root).then_some(&mut all), &counts, root)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(down(&r.comm, &got), block(me), "scatter_v from {root}");
        if me == root {
            assert_eq!(down(&r.comm, &all), every, "gather_v to {root}");
        }
    }
    // A Work handle on what was enqueued: waited on, then the result is there.
    let mut x = up(s, &vec![me as u32 + 1; 1 << 20]);
    r.comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    let w = r
        .comm
        .record_work("all_reduce")
        .unwrap_or_else(|e| panic!("{e}"));
    w.wait_timeout(Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e}"));
    let got = s.clone_dtoh(&x).unwrap_or_else(|e| panic!("{e}"));
    assert!(got.iter().all(|v| *v == want), "after Work::wait");
    // Refused before NCCL sees it: counts of another world size, a block of the wrong length.
    let e = r
        .comm
        .all_gather_v(&mine, &mut out, &counts[..n - 1])
        .unwrap_err();
    assert!(e.to_string().contains("counts has"), "{e}");
    let e = r.comm.all_gather_v(&src, &mut out, &counts).unwrap_err();
    assert!(
        e.to_string().contains(&format!("but counts[{me}] is")),
        "{e}"
    );
    println!("rank {me}: uneven collectives alone and grouped, and a Work handle, verified");
    r.tcp.barrier().unwrap();
    Ok(())
}

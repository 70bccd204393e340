//! Collective cases: every collective x element type x valid reduce op against references
//! computed here from every rank's deterministic inputs; every root; mismatches; a dead rank.

use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DType, DistError, Element, ReduceOp};
use dist_multirank::{TestElem, join};
use dist_tcp::TcpBackend;
use half::{bf16, f16};

/// Counts: empty, one, a prime, one not divisible by any world size tested, and one large
/// enough (for every type) to take the ring and chain paths.
fn counts() -> [usize; 5] {
    [0, 1, 13, 1009, 70_001]
}

fn bits<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

/// A value no input takes, to poison outputs before each call.
fn poison<T: Element>(x: &mut [T]) {
    bytemuck::cast_slice_mut::<T, u8>(x).fill(0x5A);
}

fn check_reduced<T: TestElem>(
    what: &str,
    op: ReduceOp,
    n: usize,
    base: usize,
    nan: bool,
    got: &[T],
) {
    for (j, g) in got.iter().enumerate() {
        assert!(
            T::matches(op, n, base + j, nan, *g),
            "{what} {} {op}: element {j} is {g:?}, wrong",
            T::DTYPE
        );
    }
}

fn reductions<T: TestElem>(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    for op in T::ops() {
        let nan = matches!(op, ReduceOp::Min | ReduceOp::Max);
        for count in counts() {
            let input: Vec<T> = (0..count).map(|i| T::val(me, i, nan)).collect();
            // all_reduce, in place and out of place.
            let mut data = input.clone();
            b.all_reduce(&mut data, op)
                .unwrap_or_else(|e| panic!("{e}"));
            check_reduced("all_reduce", op, n, 0, nan, &data);
            let mut out = vec![T::val(0, 0, false); count];
            poison(&mut out);
            b.all_reduce_into(&input, &mut out, op)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                bits(&out),
                bits(&data),
                "all_reduce_into differs from all_reduce"
            );
            // reduce, to every root.
            for root in 0..n {
                let mut out = input.clone();
                if me == root {
                    poison(&mut out);
                }
                b.reduce_into(&input, &mut out, op, root)
                    .unwrap_or_else(|e| panic!("{e}"));
                if me == root {
                    check_reduced("reduce", op, n, 0, nan, &out);
                }
            }
            // reduce_scatter: block `me` of the reduction of n * count elements.
            let full: Vec<T> = (0..n * count).map(|i| T::val(me, i, nan)).collect();
            let mut block = vec![T::val(0, 0, false); count];
            poison(&mut block);
            b.reduce_scatter(&full, &mut block, op)
                .unwrap_or_else(|e| panic!("{e}"));
            check_reduced("reduce_scatter", op, n, me * count, nan, &block);
        }
    }
}

fn movement<T: TestElem>(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    let v = |r, i| T::val(r, i, false);
    for count in counts() {
        let mine: Vec<T> = (0..count).map(|i| v(me, i)).collect();
        for root in 0..n {
            let mut data = mine.clone();
            if me != root {
                poison(&mut data);
            }
            b.broadcast(&mut data, root)
                .unwrap_or_else(|e| panic!("{e}"));
            let want: Vec<T> = (0..count).map(|i| v(root, i)).collect();
            assert_eq!(
                bits(&data),
                bits(&want),
                "broadcast from {root}, {count} x {}",
                T::DTYPE
            );

            let mut all = vec![v(0, 0); count * n];
            poison(&mut all);
            b.gather(&mine, (me == root).then_some(&mut all[..]), root)
                .unwrap_or_else(|e| panic!("{e}"));
            if me == root {
                for r in 0..n {
                    let want: Vec<T> = (0..count).map(|i| v(r, i)).collect();
                    assert_eq!(
                        bits(&all[r * count..(r + 1) * count]),
                        bits(&want),
                        "gather block {r}"
                    );
                }
            }

            let source: Vec<T> = (0..count * n).map(|i| v(root, i)).collect();
            let mut part = vec![v(0, 0); count];
            poison(&mut part);
            b.scatter((me == root).then_some(&source[..]), &mut part, root)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                bits(&part),
                bits(&source[me * count..(me + 1) * count]),
                "scatter from {root}"
            );
        }
        let mut all = vec![v(0, 0); count * n];
        poison(&mut all);
        b.all_gather(&mine, &mut all)
            .unwrap_or_else(|e| panic!("{e}"));
        for r in 0..n {
            let want: Vec<T> = (0..count).map(|i| v(r, i)).collect();
            assert_eq!(
                bits(&all[r * count..(r + 1) * count]),
                bits(&want),
                "all_gather block {r}"
            );
        }
        // all_to_all: block j of rank r's input is v(r, j * count + i).
        let input: Vec<T> = (0..count * n).map(|i| v(me, i)).collect();
        let mut out = vec![v(0, 0); count * n];
        poison(&mut out);
        b.all_to_all(&input, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        for r in 0..n {
            let want: Vec<T> = (0..count).map(|i| v(r, me * count + i)).collect();
            assert_eq!(
                bits(&out[r * count..(r + 1) * count]),
                bits(&want),
                "all_to_all block {r}"
            );
        }
        // all_to_all_v: rank i sends c(i, j) elements to rank j.
        let c = |i: usize, j: usize| (i * 2 + j) % 4 + count % 3;
        let send: Vec<usize> = (0..n).map(|j| c(me, j)).collect();
        let recv: Vec<usize> = (0..n).map(|i| c(i, me)).collect();
        let input: Vec<T> = (0..send.iter().sum()).map(|i| v(me, i)).collect();
        let mut out = vec![v(0, 0); recv.iter().sum()];
        poison(&mut out);
        b.all_to_all_v(&input, &send, &mut out, &recv)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut at = 0;
        for i in 0..n {
            let from: usize = (0..me).map(|j| c(i, j)).sum();
            let want: Vec<T> = (from..from + c(i, me)).map(|x| v(i, x)).collect();
            assert_eq!(
                bits(&out[at..at + c(i, me)]),
                bits(&want),
                "all_to_all_v from {i}"
            );
            at += c(i, me);
        }
    }
}

fn each_type(b: &TcpBackend, f: &dyn Fn(&TcpBackend, DType)) {
    for d in DType::ALL {
        f(b, d);
    }
}

macro_rules! dispatch {
    ($d:expr, $f:ident, $b:expr) => {
        match $d {
            DType::F32 => $f::<f32>($b),
            DType::F64 => $f::<f64>($b),
            DType::F16 => $f::<f16>($b),
            DType::BF16 => $f::<bf16>($b),
            DType::I8 => $f::<i8>($b),
            DType::U8 => $f::<u8>($b),
            DType::I32 => $f::<i32>($b),
            DType::U32 => $f::<u32>($b),
            DType::I64 => $f::<i64>($b),
            DType::U64 => $f::<u64>($b),
            other => panic!("untested type {other}"),
        }
    };
}

/// The reductions and the data movement of [`reductions_all`] and [`movement_all`] on `b`,
/// and, with `large`, the cases of [`large_rings_all`]: every type.
pub fn all_on(b: &TcpBackend, large: bool) {
    each_type(b, &|b, d| dispatch!(d, reductions, b));
    each_type(b, &|b, d| dispatch!(d, movement, b));
    if large {
        each_type(b, &|b, d| dispatch!(d, large_rings, b));
    }
}

/// all_reduce, reduce (every root) and reduce_scatter: every type, every valid op, every count.
pub fn reductions_all() {
    let b = join();
    let t = Instant::now();
    each_type(&b, &|b, d| dispatch!(d, reductions, b));
    println!("reductions verified in {:.1?}", t.elapsed());
}

fn large_rings<T: TestElem>(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    let size = std::mem::size_of::<T>();
    // Just past the size from which the rings may run two at once, and odd, so that neither the
    // halves nor the segments come out even.
    let count = dist_core::collectives::TWO_RINGS_MIN / size + 7;
    // Blocks of reduce_scatter and all_gather: n of them just past the same size.
    let k = (dist_core::collectives::TWO_RINGS_MIN / (size * n)) | 1;
    let k = k + 2;
    for op in T::ops() {
        let nan = matches!(op, ReduceOp::Min | ReduceOp::Max);
        let mut data: Vec<T> = (0..count).map(|i| T::val(me, i, nan)).collect();
        b.all_reduce(&mut data, op)
            .unwrap_or_else(|e| panic!("{e}"));
        check_reduced("large all_reduce", op, n, 0, nan, &data);
        let full: Vec<T> = (0..n * k).map(|i| T::val(me, i, nan)).collect();
        let mut block = vec![T::val(0, 0, false); k];
        poison(&mut block);
        b.reduce_scatter(&full, &mut block, op)
            .unwrap_or_else(|e| panic!("{e}"));
        check_reduced("large reduce_scatter", op, n, me * k, nan, &block);
    }
    // broadcast past its own threshold, from the first, a middle and the last rank (each
    // chain's direction from the root differs; every root is covered at smaller sizes).
    let count = dist_core::collectives::BROADCAST_TWO_CHAINS_MIN / size + 7;
    let mut roots = vec![0, n / 2, n - 1];
    roots.dedup();
    for root in roots {
        let mut data: Vec<T> = (0..count).map(|i| T::val(me, i, false)).collect();
        if me != root {
            poison(&mut data);
        }
        b.broadcast(&mut data, root)
            .unwrap_or_else(|e| panic!("{e}"));
        let want: Vec<T> = (0..count).map(|i| T::val(root, i, false)).collect();
        assert_eq!(bits(&data), bits(&want), "large broadcast from {root}");
    }
    // all_gather's threshold is its own.
    let k = (dist_core::collectives::ALL_GATHER_TWO_RINGS_MIN / (size * n)) | 1;
    let k = k + 2;
    let mine: Vec<T> = (0..k).map(|i| T::val(me, i, false)).collect();
    let mut all = vec![T::val(0, 0, false); n * k];
    poison(&mut all);
    b.all_gather(&mine, &mut all)
        .unwrap_or_else(|e| panic!("{e}"));
    for r in 0..n {
        let want: Vec<T> = (0..k).map(|i| T::val(r, i, false)).collect();
        assert_eq!(
            bits(&all[r * k..(r + 1) * k]),
            bits(&want),
            "large all_gather, block {r}"
        );
    }
}

/// all_reduce, reduce_scatter, broadcast and all_gather past the two-ring
/// thresholds: every type and valid op (one ring or two, as the job's tuning says:
/// `DIST_TCP_LANES`).
pub fn large_rings_all() {
    let b = join();
    let t = Instant::now();
    each_type(&b, &|b, d| dispatch!(d, large_rings, b));
    println!(
        "large rings ({} lane(s)) verified in {:.1?}",
        dist_core::Transport::lanes(&b),
        t.elapsed()
    );
}

/// broadcast, gather, scatter (every root), all_gather, all_to_all(v): every type and count.
pub fn movement_all() {
    let b = join();
    let t = Instant::now();
    each_type(&b, &|b, d| dispatch!(d, movement, b));
    println!("data movement verified in {:.1?}", t.elapsed());
}

/// Bitwise ops on floats are refused with a clear error, on every rank, before any message.
pub fn invalid_op() {
    let b = join();
    let e = b
        .all_reduce(&mut [1.0f32; 4], ReduceOp::BitXor)
        .unwrap_err();
    assert!(e.to_string().contains("bxor is not defined for f32"), "{e}");
}

/// Runs a mismatched call. A rank that only sends in it (a broadcast root, say) cannot see the
/// mismatch then; it learns from the ranks that did at its next collective. So every rank must
/// get an error within the bad call and two more all_reduces, and it must say `expect`.
fn expect_mismatch(expect: &[&str], bad: impl FnOnce(&TcpBackend) -> Result<(), DistError>) {
    let b = join();
    let t = Instant::now();
    let e = match bad(&b) {
        Err(e) => e,
        Ok(()) => (0..2)
            .find_map(|_| b.all_reduce(&mut [1u8; 3], ReduceOp::Sum).err())
            .expect("a mismatch went unnoticed"),
    };
    let text = e.to_string();
    assert!(
        matches!(
            e,
            DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
        ),
        "{text}"
    );
    assert!(
        expect.iter().any(|x| text.contains(x)),
        "expected one of {expect:?} in: {text}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    println!("{text}");
}

/// The last rank passes another count.
pub fn mismatch_count() {
    expect_mismatch(&["count 100 vs 101", "count 101 vs 100"], |b| {
        let n = if b.rank() == b.world_size() - 1 {
            101
        } else {
            100
        };
        b.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
    });
}

/// The last rank passes another count, past the two-ring threshold: with two lanes both rings
/// stop, on every rank.
pub fn mismatch_count_large() {
    let k = (4 << 20) / 4;
    expect_mismatch(
        &[
            &format!("count {k} vs {}", k + 1),
            &format!("count {} vs {k}", k + 1),
        ],
        |b| {
            let n = if b.rank() == b.world_size() - 1 {
                k + 1
            } else {
                k
            };
            b.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
        },
    );
}

/// The last rank passes another element type of the same size.
pub fn mismatch_dtype() {
    expect_mismatch(
        &["element type i32 vs f32", "element type f32 vs i32"],
        |b| {
            if b.rank() == b.world_size() - 1 {
                b.all_reduce(&mut [1i32; 64], ReduceOp::Sum)
            } else {
                b.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum)
            }
        },
    );
}

/// The last rank passes another reduce op.
pub fn mismatch_op() {
    expect_mismatch(&["reduce op max vs sum", "reduce op sum vs max"], |b| {
        let op = if b.rank() == b.world_size() - 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        b.all_reduce(&mut [1u32; 1000], op)
    });
}

/// The last rank broadcasts from another root. A root only sends, so the ranks may only notice
/// at their next collective (in practice, at every world size tested, they all do); every
/// rank's error must be one of the exact forms below, naming this rank, the disagreeing rank,
/// this rank's call and the other's, with the other root, and both roots when the mismatch is
/// seen inside the broadcast. On main this test accepted any text containing "root" or "it
/// called".
pub fn mismatch_root() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let mine = if me == n - 1 { n - 1 } else { 0 };
    let other = if mine == 0 { n - 1 } else { 0 };
    let t = Instant::now();
    let e = match b.broadcast(&mut [7u64; 32], mine) {
        Err(e) => e,
        Ok(()) => (0..2)
            .find_map(|_| b.all_reduce(&mut [1u8; 3], ReduceOp::Sum).err())
            .expect("a mismatch went unnoticed"),
    };
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let text = e.to_string();
    println!("{text}");
    assert!(text.starts_with(&format!("rank {me}: ")), "{text}");
    let bcast = |root: usize| format!("broadcast(u64 x 32, root {root})");
    let next = "all_reduce(u8 x 3, sum)".to_string();
    match &e {
        DistError::CollectiveMismatch {
            rank,
            op,
            peer,
            detail,
        } => {
            assert!(*rank == me && *peer != me, "{text}");
            let forms = [
                // Seen inside the broadcast: both roots.
                (
                    bcast(mine),
                    format!("root {other} vs {mine} here ({})", bcast(other)),
                ),
                // Seen at the next collective: the other root's broadcast.
                (
                    next.clone(),
                    format!(
                        "it called broadcast where this rank called all_reduce ({})",
                        bcast(other)
                    ),
                ),
                // Still in the broadcast when a peer that had finished its own moved on.
                (
                    bcast(mine),
                    format!("it called all_reduce where this rank called broadcast ({next})"),
                ),
            ];
            assert!(
                forms.iter().any(|(o, d)| o == op && d == detail),
                "rank {me} (root {mine}) got an error of no expected form: {text}"
            );
        }
        DistError::Aborted {
            rank,
            op,
            origin,
            reason,
            ..
        } => {
            assert!(*rank == me && *origin != me, "{text}");
            assert!(*op == bcast(mine) || *op == next, "{text}");
            // The first failure, at the end of the chain of aborts, is of one of the forms above
            // (as seen from its own rank, whose root may be either).
            let first = reason.rsplit(" failed: ").next().unwrap_or(reason);
            let endings = [
                format!("root {} vs 0 here ({})", n - 1, bcast(n - 1)),
                format!("root 0 vs {} here ({})", n - 1, bcast(0)),
                format!(
                    "it called broadcast where this rank called all_reduce ({})",
                    bcast(0)
                ),
                format!(
                    "it called broadcast where this rank called all_reduce ({})",
                    bcast(n - 1)
                ),
                format!("it called all_reduce where this rank called broadcast ({next})"),
            ];
            assert!(
                reason.starts_with(&format!("rank {origin}: "))
                    && first.starts_with("rank ")
                    && first.contains(" disagrees: ")
                    && endings.iter().any(|e| first.ends_with(e.as_str())),
                "rank {me} (root {mine}): an abort of no expected form: {text}"
            );
        }
        _ => panic!("expected a collective mismatch, got: {text}"),
    }
}

/// The last rank calls another collective.
pub fn mismatch_kind() {
    expect_mismatch(&["it called"], |b| {
        let n = b.world_size();
        if b.rank() == n - 1 {
            let mut out = vec![0f32; 16 * n];
            b.all_gather(&[1.0f32; 16], &mut out)
        } else {
            b.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
        }
    });
}

/// The last rank is killed in the middle of an all_reduce: every other rank fails promptly
/// with an error naming it.
pub fn peer_death() {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let victim = n - 1;
    let mut data = vec![1.0f32; 4 << 20];
    if me == victim {
        let (tx, rx) = std::sync::mpsc::channel();
        let b = &b;
        std::thread::scope(|s| {
            s.spawn(move || {
                for i in 0.. {
                    if b.all_reduce(&mut data, ReduceOp::Sum).is_err() {
                        break;
                    }
                    let _ = tx.send(i);
                }
            });
            // After the second all_reduce: the third is under way on every rank.
            rx.recv().unwrap();
            rx.recv().unwrap();
            println!("exiting abruptly mid all_reduce");
            std::process::exit(0);
        });
    }
    let (e, call) = loop {
        let t = Instant::now();
        if let Err(e) = b.all_reduce(&mut data, ReduceOp::Sum) {
            break (e, t.elapsed());
        }
    };
    // A healthy 16 MiB all_reduce takes well under a second here; the timeout is 60 s.
    assert!(
        call < Duration::from_secs(5),
        "the failing all_reduce took {call:?}: {e}"
    );
    let t = Instant::now();
    let text = e.to_string();
    let names = match &e {
        DistError::PeerGone { peer, .. } => *peer == victim,
        DistError::Aborted { reason, .. } => reason.contains(&format!("peer {victim} gone")),
        _ => false,
    };
    assert!(names, "expected an error naming rank {victim}: {text}");
    // And the next collective refuses at once.
    let again = b.all_reduce(&mut [1u8], ReduceOp::Sum).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1), "{again}");
    println!("{text}");
}

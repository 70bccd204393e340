//! The uneven collectives over TCP (all_gather_v, gather_v, scatter_v): counts with empty
//! blocks and blocks past the ring's piece, every root, several element types, every result
//! against the senders' deterministic inputs; and ranks whose counts disagree get an error on
//! every rank, not a hang.

use dist_core::{Backend, Collectives, DistError, Element};
use dist_multirank::{TestElem, join};
use dist_tcp::TcpBackend;
use half::bf16;

/// Block sizes for `n` ranks under `seed`: empty, one, small, and large (past 256 KiB for
/// every type tested).
fn counts_for(n: usize, seed: usize) -> Vec<usize> {
    (0..n)
        .map(|r| match (r + seed) % 4 {
            0 => 0,
            1 => 1,
            2 => 13 + r,
            _ => 70_001 + 3 * r,
        })
        .collect()
}

fn bits<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn one_type<T: TestElem>(b: &TcpBackend, seed: usize) {
    let (me, n) = (b.rank(), b.world_size());
    let counts = counts_for(n, seed);
    let total: usize = counts.iter().sum();
    let poison = || {
        let mut v = vec![T::val(0, 0, false); total];
        bytemuck::cast_slice_mut::<T, u8>(&mut v).fill(0x5A);
        v
    };
    // Block r: rank r's values 0..counts[r].
    let want: Vec<T> = (0..n)
        .flat_map(|r| (0..counts[r]).map(move |i| T::val(r, i, false)))
        .collect();
    let mine: Vec<T> = (0..counts[me]).map(|i| T::val(me, i, false)).collect();
    let mut out = poison();
    b.all_gather_v(&mine, &mut out, &counts)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        bits(&out),
        bits(&want),
        "all_gather_v {} counts {counts:?}",
        T::DTYPE
    );
    for root in 0..n {
        let mut out = poison();
        b.gather_v(&mine, (me == root).then_some(&mut out[..]), &counts, root)
            .unwrap_or_else(|e| panic!("{e}"));
        if me == root {
            assert_eq!(
                bits(&out),
                bits(&want),
                "gather_v to {root}, counts {counts:?}"
            );
        }
        let mut got = poison();
        got.truncate(counts[me]);
        b.scatter_v((me == root).then_some(&want[..]), &counts, &mut got, root)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            bits(&got),
            bits(&mine),
            "scatter_v from {root}, counts {counts:?}"
        );
    }
}

/// Every uneven collective, for four seeds of counts and four element types.
pub fn uneven() -> Result<(), String> {
    let b = join();
    for seed in 0..4 {
        match seed {
            0 => one_type::<f32>(&b, seed),
            1 => one_type::<f64>(&b, seed),
            2 => one_type::<bf16>(&b, seed),
            _ => one_type::<u8>(&b, seed),
        }
        one_type::<i64>(&b, seed + 1);
    }
    println!(
        "all_gather_v, gather_v, scatter_v at {} ranks, every root, verified",
        b.world_size()
    );
    b.barrier().unwrap_or_else(|e| panic!("{e}"));
    Ok(())
}

/// The last rank cuts the same total differently: every rank's all_gather_v fails with a
/// mismatch or an abort (the ring's first message of the wrong size), within the timeout.
pub fn uneven_mismatch() -> Result<(), String> {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    let mut counts = vec![4usize; n];
    if me == n - 1 {
        counts[0] = 5;
        counts[n - 1] = 3;
    }
    let mine = vec![1u32; counts[me]];
    let mut out = vec![0u32; 4 * n];
    let t = std::time::Instant::now();
    let e = b
        .all_gather_v(&mine, &mut out, &counts)
        .expect_err("counts that disagree were accepted");
    println!("after {:.1?}: {e}", t.elapsed());
    assert!(
        matches!(
            e,
            DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("all_gather_v"), "{e}");
    assert!(t.elapsed() < b.default_timeout(), "took {:?}", t.elapsed());
    Ok(())
}

//! all_gather_v, gather_v and scatter_v over the in-memory link: every world size 1–9, counts
//! with empty blocks, every root, several element types, each result against a reference; bad
//! counts refused naming the rank, the call and the sizes; ranks whose counts disagree get a
//! mismatch or an abort, never a hang.

use half::bf16;

use super::faults::expect_mismatch;
use super::lone;
use super::matrix::TIMEOUT;
use crate::testing::MemLink;
use crate::testing::run_group;
use crate::{Backend, Collectives, DistError, Element, Group, Result, Tuning};

/// Rank `r`'s element `i`, distinct across ranks and places (exact in every type tested).
fn val<E: Element>(r: usize, i: usize) -> E {
    E::from_f64(((r * 31 + i * 7) % 101) as f64)
}

/// Block sizes for `n` ranks: some empty, some one, one larger than the rest.
fn counts_for(n: usize, seed: usize) -> Vec<usize> {
    (0..n)
        .map(|r| match (r + seed) % 4 {
            0 => 0,
            1 => 1,
            2 => 5 + r,
            _ => 300 + 17 * r,
        })
        .collect()
}

fn uneven<E: Element>(g: &Group<MemLink>, seed: usize) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let counts = counts_for(n, seed);
    let total: usize = counts.iter().sum();
    let zero = E::from_f64(0.0);
    // Block r holds rank r's values 0..counts[r].
    let want: Vec<E> = (0..n)
        .flat_map(|r| (0..counts[r]).map(move |i| val::<E>(r, i)))
        .collect();
    let mine: Vec<E> = (0..counts[me]).map(|i| val(me, i)).collect();
    let mut out = vec![zero; total];
    g.all_gather_v(&mine, &mut out, &counts)?;
    assert_eq!(
        out, want,
        "all_gather_v on rank {me} of {n}, counts {counts:?}"
    );
    for root in 0..n {
        let mut out = vec![zero; total];
        g.gather_v(&mine, (me == root).then_some(&mut out[..]), &counts, root)?;
        if me == root {
            assert_eq!(out, want, "gather_v to {root} of {n}, counts {counts:?}");
        }
        let mut got = vec![zero; counts[me]];
        g.scatter_v((me == root).then_some(&want[..]), &counts, &mut got, root)?;
        assert_eq!(
            got, mine,
            "scatter_v from {root} to {me} of {n}, counts {counts:?}"
        );
    }
    Ok(())
}

#[test]
fn uneven_collectives_at_every_world_size_and_root() {
    for n in 1..=9 {
        for seed in 0..4 {
            let res = run_group(
                n,
                |_| Tuning::default(),
                TIMEOUT,
                |g| {
                    uneven::<f32>(&g, seed)?;
                    uneven::<u8>(&g, seed + 1)?;
                    uneven::<bf16>(&g, seed + 2)?;
                    uneven::<i64>(&g, seed + 3)
                },
            );
            for (r, x) in res.into_iter().enumerate() {
                x.unwrap_or_else(|e| panic!("{n} ranks, seed {seed}, rank {r}: {e}"));
            }
        }
    }
}

/// Large blocks, past the ring's piece, and all empty ones.
#[test]
fn uneven_collectives_with_large_and_empty_blocks() {
    let res = run_group(
        5,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            let (me, n) = (g.rank(), g.world_size());
            let counts: Vec<usize> = (0..n).map(|r| (r % 3) * 200_003).collect();
            let total: usize = counts.iter().sum();
            let mine: Vec<u32> = (0..counts[me])
                .map(|i| (me * 1_000_000 + i) as u32)
                .collect();
            let mut out = vec![0u32; total];
            g.all_gather_v(&mine, &mut out, &counts)?;
            let mut at = 0;
            for (r, &k) in counts.iter().enumerate() {
                for i in 0..k {
                    assert_eq!(
                        out[at + i],
                        (r * 1_000_000 + i) as u32,
                        "block {r} element {i}"
                    );
                }
                at += k;
            }
            let zeros = vec![0usize; n];
            g.all_gather_v::<f64>(&[], &mut [], &zeros)?;
            g.gather_v::<f64>(&[], Some(&mut []), &zeros, 0)?;
            g.scatter_v::<f64>(Some(&[]), &zeros, &mut [], 0)
        },
    );
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// Bad counts on the calling rank: an error naming the rank, the call and the sizes, before
/// any message moves.
#[test]
fn bad_counts_are_named() {
    type Call = Box<dyn Fn(&Group<MemLink>) -> Result<()>>;
    let cases: Vec<(Call, &str)> = vec![
        (
            Box::new(|g| g.all_gather_v(&[1.0f32; 2], &mut [0.0; 3], &[2, 1, 0])),
            "counts has 3 entries, expected one per rank (2)",
        ),
        (
            Box::new(|g| g.all_gather_v(&[1.0f32; 2], &mut [0.0; 4], &[3, 1])),
            "input has 2 elements but counts[0] is 3",
        ),
        (
            Box::new(|g| g.all_gather_v(&[1.0f32; 2], &mut [0.0; 4], &[2, 1])),
            "output has 4 elements, expected 3",
        ),
        (
            Box::new(|g| g.gather_v(&[1u8; 2], Some(&mut [0; 4]), &[2, usize::MAX], 0)),
            "add up to more than a usize holds",
        ),
        (
            Box::new(|g| g.gather_v(&[1u8; 2], None, &[2, 2], 0)),
            "the root must pass an output buffer",
        ),
        (
            Box::new(|g| g.scatter_v(Some(&[1u8; 3]), &[2, 2], &mut [0; 2], 0)),
            "input has 3 elements, expected 4",
        ),
        (
            Box::new(|g| g.scatter_v::<u8>(None, &[2, 2], &mut [0; 1], 1)),
            "output has 1 elements but counts[0] is 2",
        ),
        (
            Box::new(|g| g.scatter_v::<u8>(None, &[2, 2], &mut [0; 2], 2)),
            "root 2",
        ),
    ];
    for (call, want) in cases {
        let e = call(&lone(2)).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                DistError::InvalidArgument { .. } | DistError::InvalidRank { .. }
            ),
            "{text}"
        );
        assert!(text.starts_with("rank 0: "), "{text}");
        assert!(text.contains(want), "expected {want:?} in: {text}");
        assert!(text.contains("_v("), "the call is named: {text}");
    }
}

/// Ranks whose counts disagree: a mismatch or an abort on every rank, naming the difference.
#[test]
fn counts_that_disagree_are_a_mismatch_everywhere() {
    // Another total: seen in the descriptor.
    expect_mismatch(2..=5, &["count"], |g| {
        let n = g.world_size();
        let mut counts = vec![2; n];
        if g.rank() == n - 1 {
            counts[0] = 3;
        }
        let mine = vec![1u32; counts[g.rank()]];
        let mut out = vec![0u32; counts.iter().sum()];
        g.all_gather_v(&mine, &mut out, &counts)
    });
    // The same total cut differently: seen in a message's size.
    expect_mismatch(2..=5, &["counts disagree", "sends"], |g| {
        let (me, n) = (g.rank(), g.world_size());
        let mut counts = vec![2; n];
        if me == n - 1 {
            counts[0] = 3;
            counts[n - 1] = 1;
        }
        let mine = vec![1u32; counts[me]];
        let mut out = vec![0u32; 2 * n];
        g.gather_v(&mine, (me == 0).then_some(&mut out[..]), &counts, 0)
    });
    // gather_v against gather: another collective.
    expect_mismatch(2..=4, &["gather_v", "gather"], |g| {
        let n = g.world_size();
        let mut out = vec![0u8; 2 * n];
        let out = (g.rank() == 0).then_some(&mut out[..]);
        if g.rank() == n - 1 {
            g.gather(&[1u8; 2], out, 0)
        } else {
            g.gather_v(&[1u8; 2], out, &vec![2; n], 0)
        }
    });
}

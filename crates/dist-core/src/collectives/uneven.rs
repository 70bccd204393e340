//! The uneven collectives: all_gather_v, gather_v and scatter_v, where rank `r`'s block has
//! `counts[r]` elements. Every rank passes the same `counts` (one entry per rank); the
//! descriptor every message carries holds their sum, so ranks whose totals differ are a
//! mismatch at the first message, and ranks whose blocks differ are one at the first message
//! whose size disagrees (every block moves as a message, an empty one too).
//!
//! all_gather_v runs the ring of all_gather over blocks of the given sizes; gather_v and
//! scatter_v go straight to and from the root.

use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::link::Link;
use crate::types::Element;

use super::call::{Call, What, run};
use super::desc::Kind;
use super::ring::{Ring, ring_all_gather};
use super::scratch::{bytes, bytes_mut};

/// The sum of `counts` for the descriptor; `u64::MAX` where it overflows (the call then fails
/// its own check of the counts, naming them).
fn total_for_desc(counts: &[usize]) -> usize {
    counts
        .iter()
        .try_fold(0usize, |a, x| a.checked_add(*x))
        .unwrap_or(usize::MAX)
}

/// The checks every uneven collective makes of `counts`: one per rank, a sum that fits, and
/// this rank's own block (`mine`, named `what`) of `counts[me]` elements. Returns the sum.
fn check_counts<L: Link>(
    c: &Call<'_, L>,
    counts: &[usize],
    what: &str,
    mine: usize,
) -> Result<usize> {
    if counts.len() != c.n {
        return Err(c.invalid(format!(
            "counts has {} entries, expected one per rank ({})",
            counts.len(),
            c.n
        )));
    }
    let total = c.total("counts", counts)?;
    if mine != counts[c.me] {
        return Err(c.invalid(format!(
            "{what} has {mine} elements but counts[{}] is {}",
            c.me, counts[c.me]
        )));
    }
    Ok(total)
}

/// `buf` cut into consecutive blocks of `counts` elements (their sum is `buf.len()`).
fn blocks<'b, T>(buf: &'b mut [T], counts: &[usize]) -> Vec<&'b mut [T]> {
    let mut out = Vec::with_capacity(counts.len());
    let mut rest = buf;
    for &k in counts {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(k);
        out.push(head);
        rest = tail;
    }
    out
}

/// Where block `r` starts: the sum of the counts before it.
fn offset(counts: &[usize], r: usize) -> usize {
    counts[..r].iter().sum()
}

fn what(kind: Kind, counts: &[usize], root: usize) -> What {
    What {
        kind,
        count: total_for_desc(counts),
        op: None,
        root,
    }
}

pub(crate) fn all_gather_v<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: &mut [T],
    counts: &[usize],
) -> Result<()> {
    run::<_, T, _>(g, t, what(Kind::AllGatherV, counts, 0), |c| {
        let total = check_counts(c, counts, "input", input.len())?;
        c.check_len("output", output.len(), total)?;
        let mut parts = blocks(output, counts);
        parts[c.me].copy_from_slice(input);
        if c.n == 1 {
            return Ok(());
        }
        ring_all_gather(c, Ring::forward(c.me, c.n), &mut parts, 0)
    })
}

pub(crate) fn gather_v<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: &[T],
    output: Option<&mut [T]>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    run::<_, T, _>(g, t, what(Kind::GatherV, counts, root), |c| {
        c.check_root(root)?;
        let total = check_counts(c, counts, "input", input.len())?;
        if c.me != root {
            return c.send(bytes(input), root);
        }
        let Some(out) = output else {
            return Err(c.invalid("the root must pass an output buffer".into()));
        };
        c.check_len("output", out.len(), total)?;
        let mut parts = blocks(out, counts);
        parts[root].copy_from_slice(input);
        for (r, part) in parts.into_iter().enumerate().filter(|(r, _)| *r != root) {
            c.recv(bytes_mut(part), r)?;
        }
        Ok(())
    })
}

pub(crate) fn scatter_v<T: Element, L: Link>(
    g: &Group<L>,
    t: Duration,
    input: Option<&[T]>,
    counts: &[usize],
    output: &mut [T],
    root: usize,
) -> Result<()> {
    run::<_, T, _>(g, t, what(Kind::ScatterV, counts, root), |c| {
        c.check_root(root)?;
        let total = check_counts(c, counts, "output", output.len())?;
        if c.me != root {
            return c.recv(bytes_mut(output), root);
        }
        let Some(inp) = input else {
            return Err(c.invalid("the root must pass an input buffer".into()));
        };
        c.check_len("input", inp.len(), total)?;
        for r in (0..c.n).filter(|r| *r != root) {
            let at = offset(counts, r);
            c.send(bytes(&inp[at..at + counts[r]]), r)?;
        }
        let at = offset(counts, root);
        output.copy_from_slice(&inp[at..at + counts[root]]);
        Ok(())
    })
}

//! The collectives where every rank talks to every other directly: the pairwise exchange of
//! all_to_all(_v), and gather and scatter through the root.

use crate::error::Result;
use crate::link::Link;
use crate::types::Element;

use super::call::Call;
use super::scratch::{bytes, bytes_mut};

/// Pairwise exchange: in step `s` send to `me + s` while receiving from `me - s`.
pub(super) fn exchange<T: Element, L: Link>(
    c: &Call<'_, L>,
    input: &[T],
    send_counts: &[usize],
    output: &mut [T],
    recv_counts: &[usize],
) -> Result<()> {
    let (me, n) = (c.me, c.n);
    let offsets = |counts: &[usize]| {
        let mut o = Vec::with_capacity(n + 1);
        o.push(0);
        for x in counts {
            o.push(o.last().copied().unwrap_or(0) + x);
        }
        o
    };
    let (so, ro) = (offsets(send_counts), offsets(recv_counts));
    if send_counts[me] != recv_counts[me] {
        return Err(c.invalid(format!(
            "sends {} elements to itself but expects {}",
            send_counts[me], recv_counts[me]
        )));
    }
    output[ro[me]..ro[me + 1]].copy_from_slice(&input[so[me]..so[me + 1]]);
    for s in 1..n {
        let (dst, src) = ((me + s) % n, (me + n - s) % n);
        c.send_recv(
            bytes(&input[so[dst]..so[dst + 1]]),
            dst,
            bytes_mut(&mut output[ro[src]..ro[src + 1]]),
            src,
        )?;
    }
    Ok(())
}

/// gather: every rank's `input` (`k` elements) into block `r` of `output` on `root`.
pub(super) fn gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    c.check_root(root)?;
    let k = input.len();
    if c.me != root {
        return c.send(bytes(input), root);
    }
    let Some(out) = output else {
        return Err(c.invalid("the root must pass an output buffer".into()));
    };
    c.check_len("output", out.len(), c.blocks("output", k)?)?;
    out[root * k..(root + 1) * k].copy_from_slice(input);
    for r in (0..c.n).filter(|r| *r != root) {
        c.recv(bytes_mut(&mut out[r * k..(r + 1) * k]), r)?;
    }
    Ok(())
}

/// scatter: block `r` of `input` on `root` into rank `r`'s `output` (`k` elements).
pub(super) fn scatter<T: Element, L: Link>(
    c: &Call<'_, L>,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    c.check_root(root)?;
    let k = output.len();
    if c.me != root {
        return c.recv(bytes_mut(output), root);
    }
    let Some(inp) = input else {
        return Err(c.invalid("the root must pass an input buffer".into()));
    };
    c.check_len("input", inp.len(), c.blocks("input", k)?)?;
    for r in (0..c.n).filter(|r| *r != root) {
        c.send(bytes(&inp[r * k..(r + 1) * k]), r)?;
    }
    output.copy_from_slice(&inp[root * k..(root + 1) * k]);
    Ok(())
}

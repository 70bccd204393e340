//! The rooted collectives across hosts: broadcast, reduce, gather and scatter. The root stands
//! for its host, each other host's leader for its own; between them the bytes cross the hosts'
//! links once per host, and inside each host its representative serves the host's ranks.
//!
//! | collective | inside each host | between the hosts' representatives |
//! | --- | --- | --- |
//! | broadcast | after: from the representative (tree, or chain above 256 KiB) | from the root (tree, or chain) |
//! | reduce | before: to the representative (binomial tree) | to the root: tree up to 256 KiB or fewer elements than hosts, else ring reduce-scatter and each segment to the root |
//! | gather | before: each rank's block to the representative | each host's packed blocks to the root |
//! | scatter | after: each rank's block from the representative | each host's packed blocks from the root |

use crate::error::Result;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::super::call::{Call, finish};
use super::super::consts::REDUCE_RING_MIN;
use super::super::scratch::{bytes, bytes_mut, segments, with_scratch};
use super::Layout;
use super::sub;

/// broadcast of `data` from `root`: to one rank per host, then inside each host.
pub(in super::super) fn broadcast<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let reps = l.reps(Some(root));
    let rep = reps[l.mine()];
    if c.me == rep {
        sub::broadcast(c, &reps, l.host[root], data)?;
    }
    sub::broadcast(c, l.local(), l.pos_in_host(rep), data)
}

/// reduce of every rank's `data` (premultiplied for `PreMulSum`) into `root`'s: inside each
/// host to its representative, then between them to the root, which scales for `Avg`.
pub(in super::super) fn reduce<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let reps = l.reps(Some(root));
    let rep = reps[l.mine()];
    let hosts = l.hosts();
    let hr = l.host[root];
    with_scratch::<T, _>(data.len(), |tmp| {
        sub::reduce(c, l.local(), l.pos_in_host(rep), data, op, tmp)?;
        if c.me != rep {
            return Ok(());
        }
        if std::mem::size_of_val(data) <= REDUCE_RING_MIN || data.len() < hosts {
            return sub::reduce(c, &reps, hr, data, op, tmp);
        }
        let p = sub::position(c, &reps)?;
        let mut segs = segments(data, hosts);
        sub::ring_reduce_scatter(c, &reps, &mut segs, op, tmp)?;
        if c.me != root {
            return c.send(bytes(segs[p]), root);
        }
        for (h, &q) in reps.iter().enumerate().filter(|&(h, _)| h != hr) {
            c.recv(bytes_mut(segs[h]), q)?;
        }
        Ok(())
    })?;
    if c.me == root {
        finish(data, op, c.n);
    }
    Ok(())
}

/// gather of every rank's `input` into `output` on `root`: each host's blocks to its
/// representative (the root's straight into `output`), packed, then to the root.
pub(in super::super) fn gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    let k = input.len();
    let reps = l.reps(Some(root));
    let rep = reps[l.mine()];
    if c.me != rep {
        return c.send(bytes(input), rep);
    }
    if c.me != root {
        let local = l.local();
        return with_scratch::<T, _>(local.len() * k, |packed| {
            for (i, &q) in local.iter().enumerate() {
                let block = &mut packed[i * k..(i + 1) * k];
                if q == c.me {
                    block.copy_from_slice(input);
                } else {
                    c.recv(bytes_mut(block), q)?;
                }
            }
            c.send(bytes(packed), root)
        });
    }
    let Some(out) = output else {
        return Err(c.invalid("the root must pass an output buffer".into()));
    };
    c.check_len("output", out.len(), c.blocks("output", k)?)?;
    out[root * k..(root + 1) * k].copy_from_slice(input);
    for &q in l.local().iter().filter(|&&q| q != root) {
        c.recv(bytes_mut(&mut out[q * k..(q + 1) * k]), q)?;
    }
    let most = l.ranks.iter().map(Vec::len).max().unwrap_or(0);
    with_scratch::<T, _>(most * k, |packed| {
        for (h, ranks) in l.ranks.iter().enumerate().filter(|&(h, _)| h != l.mine()) {
            let packed = &mut packed[..ranks.len() * k];
            c.recv(bytes_mut(packed), reps[h])?;
            for (i, &q) in ranks.iter().enumerate() {
                out[q * k..(q + 1) * k].copy_from_slice(&packed[i * k..(i + 1) * k]);
            }
        }
        Ok(())
    })
}

/// scatter of block `r` of `root`'s `input` into rank `r`'s `output`: each other host's blocks,
/// packed, to its representative, which hands them out (the root hands out its own host's).
pub(in super::super) fn scatter<T: Element, L: Link>(
    c: &Call<'_, L>,
    l: &Layout,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    let k = output.len();
    let reps = l.reps(Some(root));
    let rep = reps[l.mine()];
    if c.me != rep {
        return c.recv(bytes_mut(output), rep);
    }
    let local = l.local();
    if c.me != root {
        return with_scratch::<T, _>(local.len() * k, |packed| {
            c.recv(bytes_mut(packed), root)?;
            for (i, &q) in local.iter().enumerate() {
                let block = &packed[i * k..(i + 1) * k];
                if q == c.me {
                    output.copy_from_slice(block);
                } else {
                    c.send(bytes(block), q)?;
                }
            }
            Ok(())
        });
    }
    let Some(inp) = input else {
        return Err(c.invalid("the root must pass an input buffer".into()));
    };
    c.check_len("input", inp.len(), c.blocks("input", k)?)?;
    let most = l.ranks.iter().map(Vec::len).max().unwrap_or(0);
    with_scratch::<T, _>(most * k, |packed| {
        for (h, ranks) in l.ranks.iter().enumerate().filter(|&(h, _)| h != l.mine()) {
            let packed = &mut packed[..ranks.len() * k];
            for (i, &q) in ranks.iter().enumerate() {
                packed[i * k..(i + 1) * k].copy_from_slice(&inp[q * k..(q + 1) * k]);
            }
            c.send(bytes(packed), reps[h])?;
        }
        Ok(())
    })?;
    for &q in local.iter().filter(|&&q| q != root) {
        c.send(bytes(&inp[q * k..(q + 1) * k]), q)?;
    }
    output.copy_from_slice(&inp[root * k..(root + 1) * k]);
    Ok(())
}

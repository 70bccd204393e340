//! The pipelined chain of a large broadcast: from the root along a ring, in chunks, each rank
//! receiving chunk k + 1 while it passes chunk k on.

use crate::error::Result;
use crate::link::Link;
use crate::types::Element;

use super::call::Call;
use super::consts::CHAIN_CHUNK;
use super::ring::Ring;
use super::scratch::{bytes, bytes_mut, split_pair};

/// broadcast of `data` from `root` along `ring`.
pub(super) fn broadcast_chain<T: Element, L: Link>(
    c: &Call<'_, L>,
    ring: Ring,
    data: &mut [T],
    root: usize,
) -> Result<()> {
    let n = c.n;
    // Along the ring from the root: the root is 0, the last rank to receive n - 1.
    let v = (ring.pos + n - ring.position_of(root, n)) % n;
    let (prev, next, tag) = (ring.left, ring.right, ring.tag);
    let per = (CHAIN_CHUNK / std::mem::size_of::<T>()).max(1);
    let chunks = data.len().div_ceil(per);
    let len = data.len();
    let chunk = |i: usize| i * per..((i + 1) * per).min(len);
    if v == 0 {
        for i in 0..chunks {
            c.send_on(tag, bytes(&data[chunk(i)]), next)?;
        }
        return Ok(());
    }
    c.recv_on(tag, bytes_mut(&mut data[chunk(0)]), prev)?;
    for i in 0..chunks {
        let last_rank = v == n - 1;
        match (last_rank, i + 1 < chunks) {
            (false, true) => {
                let (out, inb) = split_pair(data, chunk(i), chunk(i + 1));
                c.send_recv_on(tag, bytes(out), next, bytes_mut(inb), prev)?;
            }
            (false, false) => c.send_on(tag, bytes(&data[chunk(i)]), next)?,
            (true, true) => c.recv_on(tag, bytes_mut(&mut data[chunk(i + 1)]), prev)?,
            (true, false) => {}
        }
    }
    Ok(())
}

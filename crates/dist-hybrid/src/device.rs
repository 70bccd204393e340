//! The collectives on device buffers: each NCCL call through the hybrid's record and check
//! ([`HybridBackend::nccl_call`]), with what the check compares.
//!
//! What the check compares beside the collective, element type and root: the count every rank
//! passes the same (the buffer's, or for the uneven collectives the counts' sum) and the reduce
//! op; for all_gather_v, gather_v and scatter_v also a fingerprint of the counts (`v` and 8 hex
//! digits, in the op's place), so that ranks whose counts differ, even with one sum, are a
//! mismatch on every rank. all_to_all_v's counts differ from rank to rank by design: the check
//! compares only its collective and type (count 0).
//!
//! all_to_all, gather and scatter use NCCL's own calls from NCCL 2.28; with an older library,
//! the uneven collectives' fused sends and receives with equal counts (the check sees the same
//! call either way).

use cudarc::driver::CudaSlice;
use dist_core::collectives::Kind;
use dist_core::{ReduceOp, Transport};
use dist_nccl::{Communicator, NcclType};

use crate::buffer::Buffer;
use crate::{HybridBackend, Result};

/// The first NCCL with ncclAlltoAll, ncclGather and ncclScatter (2.28.0).
const NATIVE_ALL_TO_ALL: i32 = 22800;

/// The counts' fingerprint the check compares (FNV-1a over their little-endian bytes).
pub(crate) fn fingerprint(counts: &[usize]) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for c in counts {
        for b in (*c as u64).to_le_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    format!("v{h:08x}")
}

/// The counts' sum for the check's descriptor (saturated: an overflow is refused by the call).
pub(crate) fn total(counts: &[usize]) -> usize {
    counts.iter().fold(0usize, |a, c| a.saturating_add(*c))
}

pub(crate) fn native(c: &Communicator) -> bool {
    c.nccl().version() >= NATIVE_ALL_TO_ALL
}

/// `k` for each of `n` ranks, for the fallback of the even calls.
pub(crate) fn even(k: usize, n: usize) -> Vec<usize> {
    vec![k; n]
}

impl<T: NcclType> Buffer for CudaSlice<T> {
    fn all_reduce<H: Transport>(&mut self, h: &HybridBackend<H>, op: ReduceOp) -> Result<()> {
        h.nccl_call::<T>(Kind::AllReduce, self.len(), Some(op.name()), None, |c| {
            c.all_reduce_in_place(self, op)
        })
    }

    fn broadcast<H: Transport>(&mut self, h: &HybridBackend<H>, root: usize) -> Result<()> {
        h.nccl_call::<T>(Kind::Broadcast, self.len(), None, Some(root), |c| {
            c.broadcast(self, root)
        })
    }

    fn reduce<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let n = input.len();
        h.nccl_call::<T>(Kind::Reduce, n, Some(op.name()), Some(root), |c| {
            c.reduce(input, output, op, root)
        })
    }

    fn all_gather<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()> {
        h.nccl_call::<T>(Kind::AllGather, input.len(), None, None, |c| {
            c.all_gather(input, output)
        })
    }

    fn reduce_scatter<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = output.len();
        h.nccl_call::<T>(Kind::ReduceScatter, n, Some(op.name()), None, |c| {
            c.reduce_scatter(input, output, op)
        })
    }

    fn all_to_all<H: Transport>(
        input: &Self,
        output: &mut Self,
        h: &HybridBackend<H>,
    ) -> Result<()> {
        h.nccl_call::<T>(Kind::AllToAll, input.len(), None, None, |c| {
            if native(c) || !input.len().is_multiple_of(c.size()) {
                // NCCL's own call, or its refusal of a length that does not split evenly.
                return c.all_to_all(input, output);
            }
            let counts = even(input.len() / c.size(), c.size());
            c.all_to_all_v(input, &counts, output, &counts)
        })
    }

    fn all_to_all_v<H: Transport>(
        input: &Self,
        send_counts: &[usize],
        output: &mut Self,
        recv_counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()> {
        h.nccl_call::<T>(Kind::AllToAllV, 0, None, None, |c| {
            c.all_to_all_v(input, send_counts, output, recv_counts)
        })
    }

    fn gather<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        h.nccl_call::<T>(Kind::Gather, input.len(), None, Some(root), |c| {
            if native(c) {
                return c.gather(input, output, root);
            }
            c.gather_v(input, output, &even(input.len(), c.size()), root)
        })
    }

    fn scatter<H: Transport>(
        input: Option<&Self>,
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        h.nccl_call::<T>(Kind::Scatter, output.len(), None, Some(root), |c| {
            if native(c) {
                return c.scatter(input, output, root);
            }
            let counts = even(output.len(), c.size());
            c.scatter_v(input, output, &counts, root)
        })
    }

    fn all_gather_v<H: Transport>(
        input: &Self,
        output: &mut Self,
        counts: &[usize],
        h: &HybridBackend<H>,
    ) -> Result<()> {
        let fp = fingerprint(counts);
        h.nccl_call::<T>(Kind::AllGatherV, total(counts), Some(&fp), None, |c| {
            c.all_gather_v(input, output, counts)
        })
    }

    fn gather_v<H: Transport>(
        input: &Self,
        output: Option<&mut Self>,
        counts: &[usize],
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        let fp = fingerprint(counts);
        h.nccl_call::<T>(Kind::GatherV, total(counts), Some(&fp), Some(root), |c| {
            c.gather_v(input, output, counts, root)
        })
    }

    fn scatter_v<H: Transport>(
        input: Option<&Self>,
        counts: &[usize],
        output: &mut Self,
        h: &HybridBackend<H>,
        root: usize,
    ) -> Result<()> {
        let fp = fingerprint(counts);
        h.nccl_call::<T>(Kind::ScatterV, total(counts), Some(&fp), Some(root), |c| {
            c.scatter_v(input, output, counts, root)
        })
    }

    fn send_to<H: Transport>(&self, h: &HybridBackend<H>, dst: usize) -> Result<()> {
        h.nccl_p2p::<T>("send", self.len(), dst, |c| c.send(self, dst))
    }

    fn recv_from<H: Transport>(&mut self, h: &HybridBackend<H>, src: usize) -> Result<()> {
        h.nccl_p2p::<T>("recv", self.len(), src, |c| c.recv(self, src))
    }
}

impl<H: Transport> HybridBackend<H> {
    /// Sends `send` to `dst` while receiving `recv` from `src`, device buffers over NCCL, fused
    /// in one NCCL group (so that two ranks exchanging with each other do not wait on each
    /// other's send). Enqueued on the communicator's stream.
    pub fn send_recv<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        dst: usize,
        recv: &mut CudaSlice<T>,
        src: usize,
    ) -> Result<()> {
        let c = self.need_nccl("send_recv")?;
        if let Some(w) = &self.watch {
            w.begin_p2p("send", T::NAME, send.len(), dst);
            w.begin_p2p("recv", T::NAME, recv.len(), src);
        }
        c.group(|g| {
            g.send(send, dst)?;
            g.recv(recv, src)
        })
        .map_err(|e| {
            if let Some(w) = &self.watch {
                w.failed_call(&e);
                w.failed_call(&e);
            }
            self.explain_nccl(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_fingerprints_differ_where_the_counts_do() {
        let a = fingerprint(&[3, 1, 4]);
        assert_eq!(a.len(), 9, "{a}: within the check's 15 bytes");
        assert!(a.starts_with('v'));
        assert_eq!(a, fingerprint(&[3, 1, 4]));
        // The same sum cut differently, and the same counts for another world size.
        assert_ne!(a, fingerprint(&[4, 1, 3]));
        assert_ne!(a, fingerprint(&[3, 1, 4, 0]));
        assert_eq!(total(&[usize::MAX, 1]), usize::MAX);
    }

    /// Two ranks' all_gather_v with one sum cut differently: the check's descriptors travel
    /// with the fingerprint intact and the matcher reports the pair, naming both.
    #[test]
    fn the_check_compares_uneven_counts() {
        use crate::check::{Desc, Frame, Matcher, Name, mismatch_text};
        let d = |counts: &[usize]| Desc {
            seq: 3,
            coll: Name::new(Kind::AllGatherV.name()),
            dtype: Name::new("f32"),
            count: total(counts) as u64,
            op: Name::new(&fingerprint(counts)),
            root: None,
        };
        let (mine, theirs) = (d(&[4, 4]), d(&[5, 3]));
        let f = Frame::Descs(vec![theirs]);
        assert_eq!(Frame::decode(&f.encode()), Ok(f));
        let mut m = Matcher::default();
        assert_eq!(m.mine(mine), None);
        let found = m.theirs(theirs).expect("counts that differ are a mismatch");
        let text = mismatch_text(1, 0, &found);
        assert!(
            text.contains("rank 0 called #3 all_gather_v f32 x 8 v"),
            "{text}"
        );
        assert!(
            text.contains("rank 1 called #3 all_gather_v f32 x 8 v"),
            "{text}"
        );
        let mut m = Matcher::default();
        assert_eq!(m.mine(d(&[4, 4])), None);
        assert_eq!(m.theirs(d(&[4, 4])), None, "equal counts match");
    }
}

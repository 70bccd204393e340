//! The collectives NCCL has no call for, as point-to-point calls fused in one NCCL group
//! (`ncclGroupStart`, an `ncclSend`/`ncclRecv` per block, `ncclGroupEnd`): all_gather_v,
//! gather_v, scatter_v and all_to_all_v, each block of the size its counts say. A block of no
//! elements moves nothing on either side (both sides skip it, from the same counts).
//!
//! The whole fused call goes through [`Ops::launch`] as one call: its `// SAFETY:` rests on
//! what `collectives.rs` says of `launch`, and on every block lying inside its buffer (the
//! counts' sum equals the buffer's length, checked before). Inside a [`crate::Group`] the
//! nested NCCL group only records the calls; they launch at the outer group's end, and the
//! outer group keeps the buffers until then, as for every call.
//!
//! Ranks must agree on the counts (rank `r` sends what its peer expects): NCCL does not check
//! it. `dist-hybrid`'s call check compares the counts every rank passed.

use cudarc::driver::CudaSlice;
use dist_core::collectives::Kind;
use dist_nccl_sys::{nccl_fn, ncclResult_t};

use super::{Dst, Guards, Ops};
use crate::error::Result;
use crate::types::NcclType;

/// One block of a fused call: to (`send`) or from `peer`, `count` elements at element `at` of
/// the send (or receive) buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Move {
    pub(crate) send: bool,
    pub(crate) peer: usize,
    pub(crate) at: usize,
    pub(crate) count: usize,
}

/// Where each block starts: the running sums of `counts` (callers checked that the sum fits).
fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut at = 0;
    counts
        .iter()
        .map(|c| {
            let here = at;
            at += c;
            here
        })
        .collect()
}

/// The blocks of all_gather_v for rank `me`: its own block to every rank, every rank's block
/// from it.
pub(crate) fn all_gather_v_moves(me: usize, counts: &[usize]) -> Vec<Move> {
    let at = offsets(counts);
    (0..counts.len())
        .flat_map(|p| {
            [
                Move {
                    send: true,
                    peer: p,
                    at: 0,
                    count: counts[me],
                },
                Move {
                    send: false,
                    peer: p,
                    at: at[p],
                    count: counts[p],
                },
            ]
        })
        .collect()
}

/// The blocks of gather_v for rank `me`: its block to the root; on the root, every block.
pub(crate) fn gather_v_moves(me: usize, counts: &[usize], root: usize) -> Vec<Move> {
    let mut v = vec![Move {
        send: true,
        peer: root,
        at: 0,
        count: counts[me],
    }];
    if me == root {
        let at = offsets(counts);
        v.extend((0..counts.len()).map(|p| Move {
            send: false,
            peer: p,
            at: at[p],
            count: counts[p],
        }));
    }
    v
}

/// The blocks of scatter_v for rank `me`: its block from the root; on the root, every block.
pub(crate) fn scatter_v_moves(me: usize, counts: &[usize], root: usize) -> Vec<Move> {
    let mut v = vec![Move {
        send: false,
        peer: root,
        at: 0,
        count: counts[me],
    }];
    if me == root {
        let at = offsets(counts);
        v.extend((0..counts.len()).map(|p| Move {
            send: true,
            peer: p,
            at: at[p],
            count: counts[p],
        }));
    }
    v
}

/// The blocks of all_to_all_v: `send_counts[p]` to every rank `p`, `recv_counts[p]` from it.
pub(crate) fn all_to_all_v_moves(send_counts: &[usize], recv_counts: &[usize]) -> Vec<Move> {
    let (so, ro) = (offsets(send_counts), offsets(recv_counts));
    (0..send_counts.len())
        .flat_map(|p| {
            [
                Move {
                    send: true,
                    peer: p,
                    at: so[p],
                    count: send_counts[p],
                },
                Move {
                    send: false,
                    peer: p,
                    at: ro[p],
                    count: recv_counts[p],
                },
            ]
        })
        .collect()
}

/// `counts` for a call of `size` ranks: one per rank, with a sum that fits; the sum, or why not.
pub(crate) fn counts_ok(
    what: &str,
    counts: &[usize],
    size: usize,
) -> std::result::Result<usize, String> {
    if counts.len() != size {
        return Err(format!(
            "{what} has {} entries, expected one per rank ({size})",
            counts.len()
        ));
    }
    counts
        .iter()
        .try_fold(0usize, |a, c| a.checked_add(*c))
        .ok_or_else(|| format!("{what} {counts:?} add up to more than a usize holds"))
}

impl<'a> Ops<'a> {
    fn check_counts(&self, op: &str, what: &str, counts: &[usize]) -> Result<usize> {
        counts_ok(what, counts, self.comm.size).map_err(|r| self.invalid(op, r))
    }

    /// This rank's own block (`what`, `got` elements) must be `counts[rank]`.
    fn check_mine(&self, op: &str, what: &str, got: usize, counts: &[usize]) -> Result<()> {
        let want = counts[self.comm.rank];
        if got != want {
            return Err(self.invalid(
                op,
                format!(
                    "{what} has {got} elements but counts[{}] is {want}",
                    self.comm.rank
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn all_gather_v_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: impl Dst<'b, T>,
        counts: &[usize],
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllGatherV.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        let total = self.check_counts(OP, "counts", counts)?;
        self.check_mine(OP, "send", send.len(), counts)?;
        self.check_len(OP, "recv", recv.slice().len(), total)?;
        let moves = all_gather_v_moves(self.comm.rank, counts);
        self.fused(OP, Some(send), Some(recv), &moves)
    }

    pub(crate) fn gather_v_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        recv: Option<impl Dst<'b, T>>,
        counts: &[usize],
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::GatherV.name();
        self.check_context(
            OP,
            [
                ("send", Some(send)),
                ("recv", recv.as_ref().map(|r| r.slice())),
            ],
        )?;
        self.check_rank(OP, "root", root)?;
        let total = self.check_counts(OP, "counts", counts)?;
        self.check_mine(OP, "send", send.len(), counts)?;
        self.check_root_has(OP, "receive", recv.is_some(), root)?;
        // Only the root receives: elsewhere a receive buffer given is not used.
        let recv = recv.filter(|_| self.comm.rank == root);
        if let Some(recv) = &recv {
            self.check_len(OP, "recv", recv.slice().len(), total)?;
        }
        let moves = gather_v_moves(self.comm.rank, counts, root);
        self.fused(OP, Some(send), recv, &moves)
    }

    pub(crate) fn scatter_v_g<'b, T: NcclType>(
        &self,
        send: Option<&'b CudaSlice<T>>,
        recv: impl Dst<'b, T>,
        counts: &[usize],
        root: usize,
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::ScatterV.name();
        self.check_context(OP, [("send", send), ("recv", Some(recv.slice()))])?;
        self.check_rank(OP, "root", root)?;
        let total = self.check_counts(OP, "counts", counts)?;
        self.check_mine(OP, "recv", recv.slice().len(), counts)?;
        self.check_root_has(OP, "send", send.is_some(), root)?;
        let send = send.filter(|_| self.comm.rank == root);
        if let Some(send) = send {
            self.check_len(OP, "send", send.len(), total)?;
        }
        let moves = scatter_v_moves(self.comm.rank, counts, root);
        self.fused(OP, send, Some(recv), &moves)
    }

    pub(crate) fn all_to_all_v_g<'b, T: NcclType>(
        &self,
        send: &'b CudaSlice<T>,
        send_counts: &[usize],
        recv: impl Dst<'b, T>,
        recv_counts: &[usize],
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        const OP: &str = Kind::AllToAllV.name();
        self.check_context(OP, [("send", Some(send)), ("recv", Some(recv.slice()))])?;
        let sent = self.check_counts(OP, "send_counts", send_counts)?;
        let received = self.check_counts(OP, "recv_counts", recv_counts)?;
        self.check_len(OP, "send", send.len(), sent)?;
        self.check_len(OP, "recv", recv.slice().len(), received)?;
        let me = self.comm.rank;
        if send_counts[me] != recv_counts[me] {
            return Err(self.invalid(
                OP,
                format!(
                    "sends {} elements to itself but expects {} (send_counts[{me}] and \
                     recv_counts[{me}])",
                    send_counts[me], recv_counts[me]
                ),
            ));
        }
        let moves = all_to_all_v_moves(send_counts, recv_counts);
        self.fused(OP, Some(send), Some(recv), &moves)
    }

    /// The blocks `moves` as one NCCL group of sends and receives, through [`Ops::launch`].
    /// Every block must lie inside its buffer (callers checked the lengths against the counts).
    fn fused<'b, T: NcclType>(
        &self,
        op: &'static str,
        send: Option<&'b CudaSlice<T>>,
        recv: Option<impl Dst<'b, T>>,
        moves: &[Move],
    ) -> Result<Guards<'b>>
    where
        'a: 'b,
    {
        let nccl = &self.comm.shared.nccl;
        let start = nccl_fn!(nccl, ncclGroupStart)?;
        let end = nccl_fn!(nccl, ncclGroupEnd)?;
        let send_fn = nccl_fn!(nccl, ncclSend)?;
        let recv_fn = nccl_fn!(nccl, ncclRecv)?;
        let mut peers = Vec::with_capacity(moves.len());
        for m in moves {
            peers.push(self.check_rank(op, "peer", m.peer)?);
        }
        let size = std::mem::size_of::<T>();
        let (has_send, has_recv) = (send.is_some(), recv.is_some());
        for m in moves.iter().filter(|m| m.count > 0) {
            if (m.send && !has_send) || (!m.send && !has_recv) {
                let (dir, way, buf) = if m.send {
                    ("send", "to", "input")
                } else {
                    ("receive", "from", "output")
                };
                return Err(self.invalid(
                    op,
                    format!(
                        "a {dir} of {} elements {way} peer {}, but no {buf} buffer was given",
                        m.count, m.peer
                    ),
                ));
            }
        }
        self.launch(op, send, recv, |s, r, c, st| {
            let ok = |x: ncclResult_t| {
                x == ncclResult_t::ncclSuccess || x == ncclResult_t::ncclInProgress
            };
            // SAFETY: `launch` gives the buffers' device pointers (s, r) on this stream, under
            // the communicator's lock, with the communicator live. Each block is `count`
            // elements at element `at` of its buffer, inside it: the callers checked the
            // buffers' lengths against the counts' sums, and the moves come from those counts
            // (`*_moves`); a block of a buffer not given has no elements (checked above), and
            // no element is moved for it. The pointer arithmetic is on device addresses, never
            // dereferenced here. Every ncclGroupStart is matched by the ncclGroupEnd below,
            // whatever a call in between returns, on this thread. The multirank trials
            // `nccl_uneven_grouped` (alone and inside a group) and `hybrid_device_collectives`
            // (every uneven collective) run it.
            unsafe {
                let started = start();
                if !ok(started) {
                    return started;
                }
                let mut first = ncclResult_t::ncclSuccess;
                for (m, peer) in moves.iter().zip(&peers).filter(|(m, _)| m.count > 0) {
                    let at = m.at * size;
                    let x = if m.send {
                        send_fn(
                            s.cast::<u8>().wrapping_add(at).cast(),
                            m.count,
                            T::NCCL,
                            *peer,
                            c,
                            st,
                        )
                    } else {
                        recv_fn(
                            r.cast::<u8>().wrapping_add(at).cast(),
                            m.count,
                            T::NCCL,
                            *peer,
                            c,
                            st,
                        )
                    };
                    if !ok(x) {
                        first = x;
                        break;
                    }
                }
                let ended = end();
                if first == ncclResult_t::ncclSuccess {
                    ended
                } else {
                    first
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block one rank sends is one its peer receives, of the same size, for every
    /// pattern: the moves of all ranks pair up exactly.
    #[test]
    fn every_send_meets_a_receive_of_its_size() {
        fn pairs(n: usize, moves: impl Fn(usize) -> Vec<Move>) {
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            for me in 0..n {
                for m in moves(me).into_iter().filter(|m| m.count > 0) {
                    if m.send {
                        sends.push((me, m.peer, m.count));
                    } else {
                        recvs.push((m.peer, me, m.count));
                    }
                }
            }
            sends.sort_unstable();
            recvs.sort_unstable();
            assert_eq!(sends, recvs, "{n} ranks");
        }
        for n in 1..=6 {
            let counts: Vec<usize> = (0..n).map(|r| (r * 3) % 4).collect();
            pairs(n, |me| all_gather_v_moves(me, &counts));
            for root in 0..n {
                pairs(n, |me| gather_v_moves(me, &counts, root));
                pairs(n, |me| scatter_v_moves(me, &counts, root));
            }
            let c = |from: usize, to: usize| (from * 5 + to * 3) % 4;
            pairs(n, |me| {
                let s: Vec<usize> = (0..n).map(|j| c(me, j)).collect();
                let r: Vec<usize> = (0..n).map(|j| c(j, me)).collect();
                all_to_all_v_moves(&s, &r)
            });
        }
    }

    /// Each block lies inside its buffer and blocks do not overlap on the receiving side.
    #[test]
    fn blocks_tile_the_receive_buffer() {
        let counts = [3usize, 0, 5, 1];
        let total: usize = counts.iter().sum();
        let mut covered = vec![0u8; total];
        for m in all_gather_v_moves(2, &counts)
            .into_iter()
            .filter(|m| !m.send)
        {
            for x in &mut covered[m.at..m.at + m.count] {
                *x += 1;
            }
        }
        assert!(covered.iter().all(|x| *x == 1), "{covered:?}");
        for m in scatter_v_moves(1, &counts, 1)
            .into_iter()
            .filter(|m| m.send)
        {
            assert!(m.at + m.count <= total);
        }
    }

    #[test]
    fn counts_are_checked_without_a_gpu() {
        assert_eq!(counts_ok("counts", &[1, 2], 2), Ok(3));
        assert_eq!(
            counts_ok("counts", &[1, 2, 3], 2).unwrap_err(),
            "counts has 3 entries, expected one per rank (2)"
        );
        assert!(
            counts_ok("recv_counts", &[usize::MAX, 1], 2)
                .unwrap_err()
                .contains("add up to more than a usize holds")
        );
    }
}

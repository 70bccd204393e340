//! Hierarchical collectives, for a group whose ranks sit on several hosts, some of which hold
//! more than one of them: each collective runs in phases inside every host (between the host's
//! ranks) and across hosts (between one rank per host), so that a byte crosses the links
//! between hosts once per host that needs it rather than once per rank.
//!
//! The files: `sub` (broadcast, reduce, and ring gather and reduce-scatter over a list of
//! ranks: the phases), `rooted` (broadcast, reduce, gather, scatter), `spread` (all_gather,
//! reduce_scatter, barrier), `columns` (all_reduce above the arena's limit on hosts of equal
//! size).
//!
//! Each host's leader is its lowest rank, as for the hierarchical all_reduce
//! (`collectives/host.rs`); a rooted collective's root stands for its own host instead. Every
//! phase moves messages over the group's link: between ranks of one host dist-tcp carries them
//! through its shared-memory rings, between hosts over TCP. A host's block (the blocks of its
//! ranks, which need not be consecutive ranks) travels packed, in rank order.
//!
//! all_reduce takes the hosts' path at every size where the group spans hosts as below
//! ([`all_reduce_spans`]); within the arena's limit also where each host holds one rank.
//!
//! The choice, made alike on every rank ([`layout`]): the link offers a host arena whose host
//! layout covers the group, that layout has more than one host and fewer hosts than ranks, the
//! group's tuning allows the arena ([`Tuning::arena_max`](crate::Tuning::arena_max) above 0),
//! and the group agrees on its arena (the vote of the group's first all_reduce, held by the
//! first of these calls if no all_reduce came before). Otherwise the collective runs flat.
//! all_to_all(v) stays flat: its pairwise exchange already sends each byte across the hosts
//! once, from its sender to its receiver.

use crate::error::Result;
use crate::group::Group;
use crate::link::Link;

use super::call::Call;
use super::desc::Kind;

mod columns;
mod rooted;
mod spread;
mod sub;

pub(super) use columns::all_reduce as all_reduce_columns;
pub(super) use rooted::{broadcast, gather, reduce, scatter};
pub(super) use spread::{all_gather, barrier, reduce_scatter};

/// The hosts of a group's ranks, as the collectives here use them.
pub(super) struct Layout {
    /// Each rank's host, numbered from 0 in the order of the hosts' lowest ranks.
    host: Vec<usize>,
    /// Each host's ranks, in rank order (the first is its leader).
    ranks: Vec<Vec<usize>>,
    /// This rank.
    me: usize,
}

impl Layout {
    /// The layout of `raw` (any host index per rank, as [`HostArena::hosts`] gives it), seen
    /// from rank `me`.
    ///
    /// [`HostArena::hosts`]: crate::arena::HostArena::hosts
    pub(super) fn new(raw: &[usize], me: usize) -> Layout {
        let mut seen: Vec<usize> = Vec::new();
        let mut host = Vec::with_capacity(raw.len());
        let mut ranks: Vec<Vec<usize>> = Vec::new();
        for (r, h) in raw.iter().enumerate() {
            let i = match seen.iter().position(|s| s == h) {
                Some(i) => i,
                None => {
                    seen.push(*h);
                    ranks.push(Vec::new());
                    seen.len() - 1
                }
            };
            host.push(i);
            ranks[i].push(r);
        }
        Layout { host, ranks, me }
    }

    /// Whether the layout has more than one host and some host with more than one rank.
    pub(super) fn spans(&self) -> bool {
        self.ranks.len() > 1 && self.ranks.len() < self.host.len()
    }

    /// The number of hosts.
    pub(super) fn hosts(&self) -> usize {
        self.ranks.len()
    }

    /// This rank's host.
    pub(super) fn mine(&self) -> usize {
        self.host[self.me]
    }

    /// The ranks of this rank's host.
    pub(super) fn local(&self) -> &[usize] {
        &self.ranks[self.mine()]
    }

    /// One rank per host, by host: its leader, or `root` on the root's host.
    pub(super) fn reps(&self, root: Option<usize>) -> Vec<usize> {
        let mut reps: Vec<usize> = self.ranks.iter().map(|r| r[0]).collect();
        if let Some(root) = root {
            reps[self.host[root]] = root;
        }
        reps
    }

    /// Where rank `r` stands among the ranks of its host.
    pub(super) fn pos_in_host(&self, r: usize) -> usize {
        let rs = &self.ranks[self.host[r]];
        rs.iter().position(|&q| q == r).unwrap_or(0)
    }

    /// The first block of host `h` in the packed order (every host's blocks, host by host).
    pub(super) fn packed_start(&self, h: usize) -> usize {
        self.ranks[..h].iter().map(Vec::len).sum()
    }
}

/// The host layout a call of this group runs hierarchically on, or `None` for the flat
/// algorithms (see the [module docs](self)). Holds the group's arena vote if it is not known
/// yet: every rank gets here alike, as the conditions before it are the same everywhere.
pub(super) fn layout<L: Link>(c: &Call<'_, L>) -> Result<Option<Layout>> {
    let Some(l) = spanning(c.g) else {
        return Ok(None);
    };
    let Some(a) = c.g.link().arena() else {
        return Ok(None);
    };
    Ok(super::host::agreed(c, a)?.then_some(l))
}

/// The layout of group `g`'s link where it spans hosts and the tuning allows the arena, before
/// the vote (see [`layout`]).
fn spanning<L: Link>(g: &Group<L>) -> Option<Layout> {
    let n = g.link().world_size();
    if n < 3 || g.tuning().arena_max() == 0 || g.arena_in_use() == Some(false) {
        return None;
    }
    let hosts = g.link().arena()?.hosts();
    if hosts.len() != n {
        return None;
    }
    let l = Layout::new(hosts, g.link().rank());
    l.spans().then_some(l)
}

/// Whether an all_reduce on group `g` larger than its arena's limit runs on the hosts' path
/// (`host::all_reduce_hosts`: inside each host on the arena, the hosts' leaders in a ring)
/// rather than a flat algorithm over every rank: where the group spans hosts and some host
/// holds more than one of its ranks (and the tuning allows the arena). Each host's link then
/// carries 2(H − 1)/H of the buffer instead of the flat ring's 2(N − 1)/N, with H hosts and N
/// ranks, and a link between hosts is taken to be slower than a host's memory. The arena's
/// limit still governs a group all on one host (`host_arena_limit`), whose choices this leaves
/// alone.
pub(super) fn all_reduce_spans<L: Link>(g: &Group<L>) -> bool {
    spanning(g).is_some()
}

/// The layout on which an all_reduce above the arena's limit runs by columns
/// (`columns.rs`): the group spans hosts as for [`all_reduce_spans`] and every host holds the
/// same number of its ranks. Uneven layouts take `host::all_reduce_hosts`.
pub(super) fn all_reduce_columns_layout<L: Link>(g: &Group<L>) -> Option<Layout> {
    spanning(g).filter(|l| columns::even(l).is_some())
}

/// Whether a call of `kind` on group `g` runs hierarchically, as the group stands (after its
/// arena vote): for [`collective_path`](super::collective_path).
pub(super) fn kind_spans_hosts<L: Link>(g: &Group<L>, kind: Kind) -> bool {
    let kinds = [
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
        Kind::Gather,
        Kind::Scatter,
        Kind::ReduceScatter,
        Kind::Barrier,
    ];
    kinds.contains(&kind) && g.arena_in_use() == Some(true) && spanning(g).is_some()
}

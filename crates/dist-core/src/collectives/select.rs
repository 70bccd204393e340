//! The choice of algorithm by message size and world size, where it depends on more than one
//! threshold: all_reduce (recursive doubling, the ring, or recursive halving and doubling; on a
//! host arena, small areas, every rank reducing the whole, shares or direct reads), and the
//! large broadcast and reduce on many ranks.

use super::consts::{
    ALL_REDUCE_RING_MIN, CHAIN_CHUNK, HALVING_MIN_RANKS, HOST_READ_PS, HOST_SMALL_MAX,
    HOST_SPLIT_BASE_NS, HOST_SPLIT_MIN, HOST_SPLIT_PER_RANK_NS, HOST_SPLIT_PS, HOST_WAIT_NS,
    HOST_WAIT_PER_RANK_NS, RING_SHARE_MIN, TWO_RINGS_MAX_RANKS, TWO_RINGS_MIN,
};
use super::desc::Kind;
use crate::group::Group;
use crate::link::Link;

/// An all_reduce algorithm (see the table in the [module docs](super)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllReduceAlgorithm {
    /// Recursive doubling: ⌈log₂ n⌉ steps, each moving the whole buffer.
    Doubling,
    /// Ring reduce-scatter, then ring all-gather: 2 (n − 1) steps of 1/n of the buffer, in
    /// pieces, on one ring or two at once.
    Ring,
    /// Recursive halving, then recursive doubling (Rabenseifner): 2 ⌈log₂ n⌉ steps moving
    /// halves, quarters, … of the buffer; ⌊log₂ n⌋ + 1 partners per rank.
    Halving,
}

impl AllReduceAlgorithm {
    pub(crate) fn code(self) -> u8 {
        match self {
            AllReduceAlgorithm::Doubling => 1,
            AllReduceAlgorithm::Ring => 2,
            AllReduceAlgorithm::Halving => 3,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<AllReduceAlgorithm> {
        match c {
            1 => Some(AllReduceAlgorithm::Doubling),
            2 => Some(AllReduceAlgorithm::Ring),
            3 => Some(AllReduceAlgorithm::Halving),
            _ => None,
        }
    }
}

/// The all_reduce algorithm for `count` elements of `bytes` bytes in all on `n` ranks of a
/// group with `lanes` lanes:
/// - up to [`ALL_REDUCE_RING_MIN`] bytes, or fewer elements than ranks: recursive doubling
///   (latency-bound: ⌈log₂ n⌉ steps);
/// - larger, below [`HALVING_MIN_RANKS`] ranks: the ring (it pipelines its pieces and can run
///   two rings at once; its 2 (n − 1) steps cost little with few ranks);
/// - larger, from [`HALVING_MIN_RANKS`] ranks: recursive halving and doubling (2 ⌈log₂ n⌉
///   steps instead of 2 (n − 1), for the same bytes moved), except below
///   [`TWO_RINGS_MAX_RANKS`] where the group runs two rings at once (two lanes, from
///   [`TWO_RINGS_MIN`] bytes): there two threads move and reduce, where the halving has one.
pub fn all_reduce_algorithm(
    n: usize,
    count: usize,
    bytes: usize,
    lanes: u32,
) -> AllReduceAlgorithm {
    let two_rings = lanes >= 2 && n >= 3 && bytes >= TWO_RINGS_MIN;
    if bytes <= ALL_REDUCE_RING_MIN || count < n {
        AllReduceAlgorithm::Doubling
    } else if n < HALVING_MIN_RANKS
        || (two_rings && n < TWO_RINGS_MAX_RANKS)
        || bytes / n >= RING_SHARE_MIN
    {
        AllReduceAlgorithm::Ring
    } else {
        AllReduceAlgorithm::Halving
    }
}

/// Whether a large broadcast of `bytes` (past the tree's limit) on `n` ranks runs as an
/// all_reduce by recursive halving and doubling (bitwise or, the other ranks contributing
/// zeros) instead of the pipelined chain: from [`HALVING_MIN_RANKS`] ranks, while the chain's
/// fill, n − 1 chunks of [`CHAIN_CHUNK`] before the last rank has its first, is more than the
/// halving's extra (it moves about twice the buffer per rank where the chain moves it once).
pub fn broadcast_by_halving(n: usize, bytes: usize) -> bool {
    n >= HALVING_MIN_RANKS && bytes < (n - 1).saturating_mul(CHAIN_CHUNK)
}

/// Whether a large reduce (past the tree's limit) on `n` ranks runs as an all_reduce by
/// recursive halving and doubling (the root keeps the result) instead of the ring
/// reduce-scatter and the gather of its n − 1 segments at the root: from
/// [`HALVING_MIN_RANKS`] ranks, where the ring's 2 (n − 1) sequential steps cost more than the
/// halving's second half.
pub fn reduce_by_halving(n: usize) -> bool {
    n >= HALVING_MIN_RANKS
}

/// How an all_reduce on a host arena goes (`collectives/host.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostAllReducePath {
    /// Through the small areas, every rank reducing every input (`collectives/small.rs`).
    Small,
    /// Through the slots, every rank reducing every input of each piece.
    Whole,
    /// Through the slots, each piece in one share per rank, which that rank reduces.
    Split,
    /// Reading the peers' buffers in place (`collectives/direct.rs`).
    Direct,
}

impl HostAllReducePath {
    /// A name for tables (`dist-perf`'s algorithm column).
    pub fn name(self) -> &'static str {
        match self {
            HostAllReducePath::Small => "arena-small",
            HostAllReducePath::Whole => "arena-whole",
            HostAllReducePath::Split => "arena-split",
            HostAllReducePath::Direct => "arena-direct",
        }
    }
}

/// The predicted time, in nanoseconds, of an all_reduce of `bytes` on a host arena of `local`
/// ranks, each with a core, by `path`: the cost model the host paths are chosen by (`None` for
/// [`HostAllReducePath::Direct`], which the group's agreement chooses, not the model). Fitted to
/// the 16-core Xeon host's all_reduce times at 4, 8 and 16 ranks
/// (`docs/results/2026-12-07-1xH200-a9b6a28`, the copy methods of the code since):
/// - small areas and whole pieces: one wait on every peer, [`HOST_WAIT_NS`] +
///   [`HOST_WAIT_PER_RANK_NS`] × n (8 B: 1.7, 2.8, 4.4 µs at 4, 8, 16 ranks), then every rank
///   reads and reduces every peer's input, [`HOST_READ_PS`] a byte of each
///   ((n − 1) × size bytes: 2 KiB at 16 ranks 11.4–12.5 µs, 32 KiB whole at 4 ranks 22.9);
/// - shares: two waits, and at least [`HOST_SPLIT_PER_RANK_NS`] × n −
///   [`HOST_SPLIT_BASE_NS`] (setting up n shares: 4.9 µs at 8 ranks, 11.5 at 16), then
///   [`HOST_SPLIT_PS`] × (n − 1)/n a byte of the buffer (each rank writes, reduces and copies out
///   its part of each share: 8 and 32 KiB at 16 ranks 15.2 and 26.2 µs, 32 and 128 KiB at 8 ranks
///   18.3 and 57.6).
///
/// A host whose ranks share cores waits longer (each wait a switch of threads), which favours
/// the paths with one wait; the model does not see it (the choice must be the same on every
/// rank, and the ranks need not agree on their cores).
pub fn host_time_ns(path: HostAllReducePath, local: usize, bytes: usize) -> Option<u64> {
    let n = local.max(1) as u64;
    let b = bytes as u64;
    let wait = HOST_WAIT_NS + HOST_WAIT_PER_RANK_NS * n;
    match path {
        HostAllReducePath::Small | HostAllReducePath::Whole => {
            Some(wait + HOST_READ_PS * (n - 1) * b / 1000)
        }
        HostAllReducePath::Split => {
            let fixed =
                (2 * wait).max((HOST_SPLIT_PER_RANK_NS * n).saturating_sub(HOST_SPLIT_BASE_NS));
            Some(fixed + HOST_SPLIT_PS * (n - 1) * b / (1000 * n))
        }
        HostAllReducePath::Direct => None,
    }
}

/// The size (bytes) from which the cost model ([`host_time_ns`]) has the shares faster than
/// every rank reducing the whole buffer, on a host of `local` ranks (`usize::MAX`: never).
/// Searched once per rank count up to [`CROSSOVERS_KEPT`] and kept (every small all_reduce asks).
fn host_crossover(local: usize) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Each entry is 0 until searched, then the crossover plus one, or `usize::MAX` for never
    // (a crossover is at most 1 GiB). Relaxed: threads racing on an entry store the same value.
    static KEPT: [AtomicUsize; CROSSOVERS_KEPT] = [const { AtomicUsize::new(0) }; CROSSOVERS_KEPT];
    let Some(entry) = KEPT.get(local) else {
        return search_crossover(local);
    };
    match entry.load(Ordering::Relaxed) {
        0 => {
            let found = search_crossover(local);
            entry.store(found.saturating_add(1), Ordering::Relaxed);
            found
        }
        usize::MAX => usize::MAX,
        kept => kept - 1,
    }
}

/// The rank counts whose crossover [`host_crossover`] keeps once searched.
const CROSSOVERS_KEPT: usize = 1024;

/// [`host_crossover`]'s search.
fn search_crossover(local: usize) -> usize {
    let n = local.max(1) as u64;
    if n < 2 {
        return usize::MAX;
    }
    let whole = |b: u64| host_time_ns(HostAllReducePath::Whole, local, b as usize).unwrap_or(0);
    let split = |b: u64| host_time_ns(HostAllReducePath::Split, local, b as usize).unwrap_or(0);
    // Whole's time grows faster with the size from 3 ranks (and as fast at 2): search the
    // first size where the shares are faster, up to 1 GiB.
    let (mut lo, mut hi) = (0u64, 1u64 << 30);
    if whole(hi) <= split(hi) {
        return usize::MAX;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if whole(mid) <= split(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    usize::try_from(hi).unwrap_or(usize::MAX)
}

/// The largest all_reduce on a host arena of `local` ranks that goes through the small areas:
/// [`HOST_SMALL_MAX`], or less where the cost model ([`host_time_ns`]) has the shares faster
/// from a smaller size (about 3.6 KiB at 5 ranks, 2.3 KiB at 8, 2.5 KiB at 16).
pub fn host_small_max(local: usize) -> usize {
    HOST_SMALL_MAX.min(host_crossover(local).saturating_sub(1))
}

/// The largest all_reduce on a host arena of `local` ranks that every rank reduces whole (one
/// wait per call): below the size where the cost model ([`host_time_ns`]) has the shares
/// faster, and never more than [`HOST_SPLIT_MIN`] (the split's threads, from 512 KiB, want it
/// there): 32 KiB at 2 ranks, about 10 KiB at 3, 5 KiB at 4; from 5 ranks it is below the
/// small areas' limit ([`host_small_max`]), so no size is reduced whole on the slots. Measured
/// on 16 ranks of the 16-core host with 32 KiB whole at every
/// rank count (before the rule): 32 KiB whole 106.6 µs, 128 KiB split 89.8 µs
/// (`docs/benchmarks.md`).
pub fn host_split_min(local: usize) -> usize {
    HOST_SPLIT_MIN.min(host_crossover(local).saturating_sub(1))
}

/// How an all_reduce of `bytes` on a host arena of `local` ranks goes, given the arena's small
/// areas and slots (bytes) and whether the call reads its peers' buffers directly (`direct`,
/// as the group agreed: [`Group::arena_direct_min`]): the small areas up to
/// [`host_small_max`], then direct reads where agreed, else whole pieces up to
/// [`host_split_min`] (and within a slot), else shares.
pub fn host_all_reduce_path(
    local: usize,
    bytes: usize,
    (small_len, slot_len): (usize, usize),
    direct: bool,
) -> HostAllReducePath {
    if bytes <= host_small_max(local).min(small_len) {
        HostAllReducePath::Small
    } else if direct {
        HostAllReducePath::Direct
    } else if bytes > host_split_min(local).min(slot_len) {
        HostAllReducePath::Split
    } else {
        HostAllReducePath::Whole
    }
}

/// The algorithm an all_reduce of `count` elements, `bytes` in all, runs on group `g`, by name,
/// as the group chooses it once it has agreed on its arena (after its first all_reduce): a host
/// arena path ([`HostAllReducePath::name`]; "hosts-" before it where the group spans several
/// hosts, whose leaders then run a ring between them), or a message algorithm
/// ([`all_reduce_algorithm`], or the one the group forces).
pub fn all_reduce_path<L: Link>(g: &Group<L>, count: usize, bytes: usize) -> String {
    let n = g.link().world_size();
    let forced = g.forced_all_reduce();
    let arena_max = g.tuning().arena_max();
    if n > 1
        && forced.is_none()
        && arena_max > 0
        && g.arena_in_use() == Some(true)
        && let Some(a) = g.link().arena()
    {
        let local = a.local().len();
        let direct = super::host::direct_for_group(g, a, bytes);
        let path = host_all_reduce_path(local, bytes, (a.small_len(), a.slot_len()), direct);
        if local == n && (bytes <= arena_max || direct) {
            return path.name().into();
        }
        if bytes > arena_max && super::hier::all_reduce_columns_layout(g).is_some() {
            return "hosts-columns".into();
        }
        if bytes <= arena_max || super::hier::all_reduce_spans(g) {
            let path = host_all_reduce_path(local, bytes, (a.small_len(), a.slot_len()), false);
            return format!("hosts-{}", path.name());
        }
    }
    let algorithm =
        forced.unwrap_or_else(|| all_reduce_algorithm(n, count, bytes, g.tuning().lanes));
    match algorithm {
        AllReduceAlgorithm::Doubling => "doubling",
        AllReduceAlgorithm::Ring => "ring",
        AllReduceAlgorithm::Halving => "halving",
    }
    .into()
}

/// The algorithm a call of `kind` runs on group `g`, by name, as the group chooses it once it
/// has agreed on its arena: `count` elements and `bytes` in the call's own terms (the buffer of
/// all_reduce, broadcast and reduce; all_gather's input, a rank's block; 0 for barrier).
/// all_reduce as [`all_reduce_path`]; the others "arena-small" where they take the host
/// arena's small areas (`collectives/small_ops.rs`), else their message algorithm ("tree",
/// "chain", "two-chains", "halving", "ring", "two-rings", "doubling", "dissemination"); "-" for
/// a collective not named here.
pub fn collective_path<L: Link>(g: &Group<L>, kind: Kind, count: usize, bytes: usize) -> String {
    use super::consts::{
        ALL_GATHER_TWO_RINGS_MIN, BARRIER_DOUBLING_MIN, BROADCAST_CHAIN_MIN,
        BROADCAST_TWO_CHAINS_MIN, REDUCE_RING_MIN,
    };
    if kind == Kind::AllReduce {
        return all_reduce_path(g, count, bytes);
    }
    if super::small_ops::kind_takes_small(g, kind, bytes) {
        return HostAllReducePath::Small.name().into();
    }
    if super::hier::kind_spans_hosts(g, kind) {
        return "hosts".into();
    }
    let n = g.link().world_size();
    let two = |size: usize, min: usize| g.tuning().lanes >= 2 && n >= 3 && size >= min;
    match kind {
        Kind::Broadcast if bytes <= BROADCAST_CHAIN_MIN => "tree",
        Kind::Broadcast if broadcast_by_halving(n, bytes) => "halving",
        Kind::Broadcast if two(bytes, BROADCAST_TWO_CHAINS_MIN) => "two-chains",
        Kind::Broadcast => "chain",
        Kind::Reduce if bytes <= REDUCE_RING_MIN || count < n => "tree",
        Kind::Reduce if reduce_by_halving(n) => "halving",
        Kind::Reduce => "ring",
        Kind::AllGather if two(bytes.saturating_mul(n), ALL_GATHER_TWO_RINGS_MIN) => "two-rings",
        Kind::AllGather => "ring",
        Kind::Barrier if n.is_power_of_two() || n >= BARRIER_DOUBLING_MIN => "doubling",
        Kind::Barrier => "dissemination",
        _ => "-",
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::{CROSSOVERS_KEPT, host_crossover, search_crossover};

    /// The crossover kept is the one searched, asked once or again, "never" included (one
    /// rank), and past the counts kept.
    #[test]
    fn kept_crossovers_are_the_searched_ones() {
        for n in (0..40).chain([CROSSOVERS_KEPT - 1, CROSSOVERS_KEPT, CROSSOVERS_KEPT + 7]) {
            let searched = search_crossover(n);
            assert_eq!(host_crossover(n), searched, "{n} ranks, first ask");
            assert_eq!(host_crossover(n), searched, "{n} ranks, kept");
        }
        assert_eq!(host_crossover(1), usize::MAX);
    }
}

//! The choice of algorithm by message size and world size, where it depends on more than one
//! threshold: all_reduce (recursive doubling, the ring, or recursive halving and doubling), and
//! the large broadcast and reduce on many ranks.

use super::consts::{
    ALL_REDUCE_RING_MIN, CHAIN_CHUNK, HALVING_MIN_RANKS, RING_SHARE_MIN, TWO_RINGS_MAX_RANKS,
    TWO_RINGS_MIN,
};

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

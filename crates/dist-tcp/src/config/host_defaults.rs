//! The defaults that depend on the host: how many of the job's ranks share its cores decides
//! the receivers' spin, the ring piece, the lanes, the host arena's limit, and whether (and on
//! how many threads) ranks read each other's buffers directly.

use std::time::Duration;

use dist_core::Tuning;
use dist_core::collectives::{HOST_ARENA_MAX_OVERSUBSCRIBED, HOST_DIRECT_MIN, host_arena_limit};

use super::TcpConfig;

/// Ranks of one job per core of their host up to which receivers spin by default (see
/// [`default_spin`]); measured on a 2-core host (`docs/benchmarks.md`, "Spinning and
/// oversubscription").
pub(crate) const SPIN_RANKS_PER_CORE: usize = 16;

/// How long a receiver spins before it sleeps when `DIST_SPIN_US` is not set: [`crate::peer::SPIN`]
/// (50 µs) while the job's ranks on this host (`local`) are at most [`SPIN_RANKS_PER_CORE`]
/// per core (`cores`), else none. Spinning saves a thread switch when the message comes within
/// microseconds, which pays while the sender has a core to run on; on a host with many more
/// ranks than cores, the spinning rank takes the core the sender needs.
pub(crate) fn default_spin(local: usize, cores: usize) -> Duration {
    if crowded(local, cores) {
        Duration::ZERO
    } else {
        crate::peer::SPIN
    }
}

/// How long a collective on the host arena's small areas spins on its peers' words
/// (`DIST_SMALL_SPIN_US` unset; never more than the arena's spin, [`default_spin`]): 10 µs where
/// this host has at least two cores for each of the job's ranks on it, else
/// [`SMALL_SPIN`](dist_core::collectives::SMALL_SPIN) (2 µs). With cores to spare a peer late by
/// a few µs is worth the spin; where the ranks have a core each or less, a rank that spins takes
/// the core a late peer, or other work, needs. Measured (`docs/benchmarks.md`, "Defaults and
/// why"): 8 ranks on the 16-core host, 8 B-2 KiB, 10 µs 1.95-5.56 µs a call against 2.00-10.53
/// at 2 µs; 2 ranks on the 2-core machine under other load, 10 µs 14-43 µs against 8-18.
pub(crate) fn default_small_spin(local: usize, cores: usize) -> Duration {
    if cores >= local.saturating_mul(2) {
        SPARE_CORES_SMALL_SPIN
    } else {
        dist_core::collectives::SMALL_SPIN
    }
}

/// The small areas' spin where the host has cores to spare ([`default_small_spin`]).
pub(crate) const SPARE_CORES_SMALL_SPIN: Duration = Duration::from_micros(10);

/// Whether the job's ranks on this host (`local`) are more than [`SPIN_RANKS_PER_CORE`] per core
/// (`cores`): a crowded host, where ranks take turns on the cores and every page a rank touches
/// is cleared once per rank.
pub(crate) fn crowded(local: usize, cores: usize) -> bool {
    local > SPIN_RANKS_PER_CORE.saturating_mul(cores.max(1))
}

/// The ring piece on a crowded host ([`crowded`]), in KiB: the pieces of recursive halving and
/// the ring, and their scratch (two pieces), are a quarter of the default's. There the cores
/// are never free to overlap one piece's transfer with the next one's reduction, and each
/// rank's scratch pages cost their clearing: at 1,024 ranks on 2 cores, 512 KiB of scratch a
/// rank was about a tenth of the pages the job touched (`docs/results/README.md`, "2026-12-01
/// (d39cb9d)").
pub(crate) const CROWDED_PIECE_KB: u32 = 64;

/// From which size this rank proposes direct reads of its host's peers' buffers (`None`: it
/// does not): as `cfg` says, else where `fast` says `process_vm_readv` copies at least half
/// as fast as a copy within the process ([`dist_core::transport::read_process_is_fast`], asked
/// only where it matters) and the host's `local` ranks do not crowd the `cores` this rank may
/// run on (`available_parallelism`: its affinity mask and cgroup, not the host's count;
/// [`crowded`]: there the probe's few milliseconds a rank add up, and nothing was measured):
/// where the ranks outnumber those cores, above the arena's limit there (`DIST_ARENA_MAX_KB`
/// where set, else [`SHARED_CORES_DIRECT_MIN`]), else (a core a rank or more) from
/// [`CORE_A_RANK_DIRECT_MIN`] (with two or more it splits its part over them:
/// [`arena_threads_for`]). With `DIST_DIRECT=1` and no size, from
/// [`HOST_DIRECT_MIN`]. A size set in `cfg` wins. All_reduce µs, medians of three
/// alternating rounds (`docs/results/README.md`): 4 ranks on 2 cores where the read copied at 0.7
/// of the copy's rate ("2026-12-01, evening (0436ad0)"), direct against the rings 1 MiB 427 against
/// 552, 16 MiB 7,260 against 9,758; where at 0.25 to 0.4 ("2026-12-02, early (75cc19f)"), 1 MiB 494
/// against 408, 16 MiB 14,854 against 9,826. For a core a rank or more see
/// [`CORE_A_RANK_DIRECT_MIN`].
pub(crate) fn direct_for(
    cfg: &TcpConfig,
    local: usize,
    cores: usize,
    fast: impl FnOnce() -> bool,
) -> Option<usize> {
    let min = |default: usize| cfg.direct_min_kb.map_or(default, |kb| (kb as usize) << 10);
    match cfg.direct {
        Some(on) => on.then(|| min(HOST_DIRECT_MIN)),
        None if crowded(local, cores) => None,
        None if local > cores => fast().then(|| {
            // Just above the arena's limit there: the one set, if one is (0 sets none).
            let set = cfg.arena_max_kb.filter(|&kb| kb > 0);
            let limit = set.map(|kb| ((kb as usize) << 10) + 1);
            min(limit.unwrap_or(SHARED_CORES_DIRECT_MIN))
        }),
        None => fast().then(|| min(CORE_A_RANK_DIRECT_MIN)),
    }
}

/// The smallest all_reduce that reads peers' buffers directly by default where the host's
/// ranks outnumber its cores and no arena limit is set (`DIST_ARENA_MAX_KB`: then just above
/// that one): just above the arena's default limit there
/// ([`HOST_ARENA_MAX_OVERSUBSCRIBED`], 1 MiB), since below it the arena's copies are faster and
/// above it direct reads beat the rings. 4 ranks on 2 cores where the read copies at 0.7 of a
/// copy's rate (`docs/results/README.md`, "2026-12-02, morning (00e12fa)"), direct against the
/// arena's copies 512 KiB 217 against 180 µs, 1 MiB 514 against 429; against the rings 2 MiB 985
/// against 1,177, 32 MiB 17,976 against 26,844.
pub(crate) const SHARED_CORES_DIRECT_MIN: usize = HOST_ARENA_MAX_OVERSUBSCRIBED + 1;

/// The smallest all_reduce that reads peers' buffers directly by default where each of the
/// host's ranks has a core or more: 16 MiB. 16 cores, all_reduce µs, direct reads split
/// over each rank's cores against the arena's slots (4 MiB) split likewise
/// (`docs/results/README.md`, "2026-12-02, morning (00e12fa)"): 4 ranks 4 MiB 978 against 606, 8
/// MiB 1,452 against 1,243, 16 MiB 1,683 against 2,534; 8 ranks 4 MiB 1,405 against 1,191, 8 MiB
/// 2,509 against 2,374, 16 MiB 4,760 against 4,680; 64 MiB (1 MiB slots) 4 ranks 7,487 against
/// 12,193, 8 ranks 18,755 against 26,901. With a core a rank, 16 ranks, once the results went
/// through the slots ("2026-12-02, afternoon (4249335)"): direct reads against the arena's slots 4
/// MiB 1,731 against 2,311, 16 MiB 8,362 against 12,706, 64 MiB 39,979 against 48,571, but 1 MiB
/// 634 against 559 (and "2026-12-02, early (75cc19f)", before, 4 MiB 2,092 against 1,793).
pub(crate) const CORE_A_RANK_DIRECT_MIN: usize = 16 << 20;

/// The most threads a rank may be told to split its part of an all_reduce on the arena over.
pub(crate) const ARENA_THREADS_LIMIT: u32 = 64;

/// The most threads a rank splits its part of an all_reduce on the arena over by default.
pub(crate) const ARENA_THREADS_MAX: usize = 8;

/// How many threads a rank splits its part of an all_reduce on the arena over: as `cfg` says,
/// else the `cores` it may run on over the host's `local` ranks, from 1 to
/// [`ARENA_THREADS_MAX`] (a rank bound to cores of its own counts only those: give it
/// `DIST_ARENA_THREADS`).
pub(crate) fn arena_threads_for(cfg: &TcpConfig, local: usize, cores: usize) -> usize {
    cfg.arena_threads.map_or_else(
        || (cores / local.max(1)).clamp(1, ARENA_THREADS_MAX),
        |t| t as usize,
    )
}

/// Whether this rank runs a large send and its receive on two threads: as `cfg` says, else
/// where the machine has at least 8 cores.
pub(crate) fn parallel_for(cfg: &TcpConfig) -> bool {
    cfg.parallel
        .unwrap_or_else(|| std::thread::available_parallelism().is_ok_and(|n| n.get() >= 8))
}

/// This rank's choice of the group's [`Tuning`] (rank 0's is the group's): what `cfg` says, else
/// - the ring piece: 256 KiB (cache-sized) when one thread moves both directions, 1 MiB when
///   a send and its receive run on separate cores, and [`CROWDED_PIECE_KB`] on a crowded host
///   ([`crowded`]);
/// - the lanes (rings a large all_reduce runs at once, in opposite directions, each on its own
///   thread): 2 when there are cores to spare, else 1;
/// - the largest all_reduce on the host arena: [`host_arena_limit`] of this host's ranks of the
///   job (`local`), the job's and this host's cores (`cores`).
pub(crate) fn local_tuning(cfg: &TcpConfig, parallel: bool, local: usize, cores: usize) -> Tuning {
    let arena_default = host_arena_limit(local, cfg.world_size, cores);
    let piece_default = if crowded(local, cores) {
        CROWDED_PIECE_KB
    } else if parallel {
        1 << 10
    } else {
        Tuning::default().ring_piece_kb
    };
    Tuning {
        ring_piece_kb: cfg
            .ring_piece_kb
            .unwrap_or(piece_default)
            .clamp(1, Tuning::MAX_PIECE_KB),
        lanes: cfg
            .lanes
            .unwrap_or(if parallel { 2 } else { 1 })
            .clamp(1, Tuning::MAX_LANES),
        arena_max_kb: cfg
            .arena_max_kb
            .unwrap_or((arena_default >> 10) as u32)
            .min(Tuning::MAX_ARENA_KB),
    }
}

/// The ranks of this job on this host: `LOCAL_WORLD_SIZE` (as torchrun sets it) if it is a
/// positive number, else `counted` (this rank and the peers connected from this host's address).
pub(crate) fn local_ranks(get: impl Fn(&str) -> Option<String>, counted: usize) -> usize {
    get("LOCAL_WORLD_SIZE")
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(counted)
}

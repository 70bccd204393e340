//! The collectives' tags, and the sizes where they change algorithm.

use std::time::Duration;

use crate::backend::Tag;

/// The tag every collective message travels on. Collectives are called in the same order on
/// every rank, and messages between two ranks on one tag keep their order, so one tag suffices.
pub const COLLECTIVE_TAG: Tag = Tag::system(2);
/// The tag of the second ring of a two-lane collective (see [`Tuning::lanes`](crate::Tuning::lanes)), so that its
/// messages can never be taken for the first ring's, even where both rings join the same ranks.
pub const SECOND_RING_TAG: Tag = Tag::system(3);

/// all_reduce messages up to this size use recursive doubling; larger ones the ring (or, on
/// [`HALVING_MIN_RANKS`] ranks or more, recursive halving and doubling).
pub const ALL_REDUCE_RING_MIN: usize = 64 << 10;
/// From this many ranks, a large all_reduce runs recursive halving and doubling instead of the
/// ring, and a large reduce (and a large broadcast, while the chain's fill dominates) runs on
/// it too (see [`all_reduce_algorithm`](super::all_reduce_algorithm)). On 8 and 16 ranks of a
/// 2-core machine it was faster than the ring up to 512 KiB (1.1–1.9×) and even with it from
/// 2 MiB within the noise (docs/benchmarks.md); below 8 ranks the ring is kept.
pub const HALVING_MIN_RANKS: usize = 8;
/// From [`HALVING_MIN_RANKS`] ranks, an all_reduce whose share per rank (its bytes ÷ the ranks)
/// is at least this runs the ring after all: its 2(n − 1) steps then move pieces large enough
/// to pay for their latency, and it keeps every rank's link busy at once. Measured on the
/// 32-core GPU host, 16 ranks: the ring 2.2–2.3 GB/s busbw at 16 and 64 MiB against the
/// halving's 1.5–1.6 (docs/benchmarks.md); at 1,024 ranks the ring starts at 512 MiB.
pub const RING_SHARE_MIN: usize = 512 << 10;
/// A group with two lanes keeps the two rings at once for a large all_reduce below this many
/// ranks (their two threads against the halving's one); from here it runs the halving.
pub const TWO_RINGS_MAX_RANKS: usize = 16;
/// From this many ranks the barrier runs recursive doubling even where the world is not a power
/// of two (it always does where it is): ⌊log₂ n⌋ + 2 rounds there, one more than the
/// dissemination barrier's ⌈log₂ n⌉, but over the partners the small all_reduce and the halving use, so that in a lazily
/// connected job (dist-tcp connects lazily from 65 ranks) the barrier dials no peer of its
/// own. At 1,024 ranks on 2 cores (`cargo xtask scale`, `docs/results/README.md`, "2026-12-01
/// (99ff264)"), the barrier phase took 3.2–5.3 s over connections of its own and 1.0–2.0 s over
/// these.
pub const BARRIER_DOUBLING_MIN: usize = 64;
/// broadcast messages up to this size use the binomial tree; larger ones the pipelined chain.
pub const BROADCAST_CHAIN_MIN: usize = 256 << 10;
/// reduce messages up to this size use the binomial tree; larger ones the ring.
pub const REDUCE_RING_MIN: usize = 256 << 10;
/// all_reduce, reduce_scatter and all_gather moving this many bytes in all (the buffer, the
/// input, the output) run as two rings at once where the transport has two lanes; below it,
/// handing half the work to the other thread costs more than it saves (all_reduce on 32
/// cores: 1 MiB 0.51 ms with one ring, 0.57 ms with two; 2 MiB 1.04 and 0.88).
pub const TWO_RINGS_MIN: usize = 2 << 20;
/// all_gather, which reduces nothing, gains from a second ring only later (on 32 cores, 4 MiB:
/// 4.2 GB/s busbw with one ring, 3.9 with two; 16 MiB: 3.5 and 4.1).
pub const ALL_GATHER_TWO_RINGS_MIN: usize = 16 << 20;
/// broadcast runs two chains only from here (on 32 cores, 8 MiB: 4.7 GB/s with one chain, 4.1
/// with two; 16 MiB: even; 32 and 64 MiB: 3.9 and 3.6 with one, 4.4 and 4.3 with two).
pub const BROADCAST_TWO_CHAINS_MIN: usize = 32 << 20;
/// An all_reduce on a host arena up to this many bytes (and within the arena's small areas)
/// goes through the small areas: each rank's input, the call's descriptor and a sequence word
/// in the fewest cache lines (`collectives/small.rs`); so do a broadcast or reduce of up to this
/// many bytes, an all_gather whose ranks each give up to this many, and every barrier, where
/// every rank of the group shares the host (`collectives/small_ops.rs`).
pub const HOST_SMALL_MAX: usize = 4 << 10;
/// The largest all_reduce on a host arena whose every rank reduces the whole buffer (one wait
/// per call), at any rank count; larger ones split each piece into one share per rank
/// (`collectives/host.rs`). The cost model lowers it with the host's ranks:
/// [`host_split_min`](super::host_split_min).
pub const HOST_SPLIT_MIN: usize = 32 << 10;
/// The host arena's cost model ([`host_time_ns`](super::host_time_ns)): a wait on every peer
/// costs this, plus [`HOST_WAIT_PER_RANK_NS`] a rank (16-core host, 8 B small all_reduces:
/// 1.7, 2.8 and 4.4 µs at 4, 8 and 16 ranks).
pub const HOST_WAIT_NS: u64 = 750;
/// See [`HOST_WAIT_NS`].
pub const HOST_WAIT_PER_RANK_NS: u64 = 230;
/// The host arena's cost model: reading and reducing one byte of one peer's input, in
/// picoseconds, where every rank reduces every input (the small areas, whole pieces).
pub const HOST_READ_PS: u64 = 220;
/// The host arena's cost model: the least a piece split into shares costs beyond its bytes is
/// this a rank less [`HOST_SPLIT_BASE_NS`] (or two waits, if more).
pub const HOST_SPLIT_PER_RANK_NS: u64 = 825;
/// See [`HOST_SPLIT_PER_RANK_NS`].
pub const HOST_SPLIT_BASE_NS: u64 = 1_700;
/// The host arena's cost model: a byte of the buffer split into shares, in picoseconds, times
/// (n − 1)/n (each rank writes its input for the others' shares, reduces its own and copies the
/// others' out).
pub const HOST_SPLIT_PS: u64 = 450;
/// The default [`Tuning::arena_max`](crate::Tuning::arena_max), and the arena's limit where
/// a host's ranks have a core each, but not two, and are fewer than
/// [`HOST_ARENA_ALL_MIN_RANKS`]: larger all_reduces run the message algorithms (over the
/// shared-memory rings between ranks of one host). 4 ranks on 32 cores, the arena on one
/// thread a rank (`docs/results/README.md`, "2026-11-30, night (8a5a853, 4cca66a)"): 1 MiB 275 us
/// on the arena against 443 on the rings; 4 MiB 1,129 against 1,097; 16 MiB 4,312 against 3,446.
pub const HOST_ARENA_MAX: usize = 1 << 20;
/// From this many ranks on one host, each with a core, every all_reduce runs on the arena: 8
/// and 16 ranks on 32 cores ("2026-11-30, night (8a5a853, 4cca66a)"), arena against the message
/// algorithms: 8 ranks 4 MiB 1,433 against 2,029 us, 16 MiB 6,092 against 5,636, 64 MiB 27,260
/// against 30,484; 16 ranks 4 MiB 2,253 against 3,094, 16 MiB 9,991 against 10,185, 64 MiB 43,071
/// against 48,847.
pub const HOST_ARENA_ALL_MIN_RANKS: usize = 8;
/// The arena's limit where a host has more ranks than cores (a link's own choice, such as
/// dist-tcp's): there a piece split into shares waits twice for every rank, each wait a
/// thread switch. On 2 cores, medians of three alternating rounds, the arena against the
/// shared-memory rings (`docs/results/README.md`, "2026-12-02, early (75cc19f)", two kept runs): 4
/// ranks 512 KiB 110–141 us against 173–181, 1 MiB 211–318 against 313–337, 2 MiB 522–686 against
/// 558–704; 8 ranks 1 MiB 801 against 1,306, 2 MiB 1,927 against 2,982 (a quick pass not kept had
/// the arena behind at 1 and 2 MiB: 412 against 382, 941 against 769). The code of 2026-11-30,
/// night (8a5a853, 4cca66a) measured 256 KiB 323 against 236 and 1 MiB 1,478 against 498, and the
/// limit was 128 KiB.
pub const HOST_ARENA_MAX_OVERSUBSCRIBED: usize = 1 << 20;
/// The smallest all_reduce whose ranks of one host read each other's buffers directly
/// (`collectives/direct.rs`) where they can, unless a link proposes another size
/// ([`HostArena::direct_min`](crate::transport::HostArena::direct_min)).
pub const HOST_DIRECT_MIN: usize = 256 << 10;
/// The chunk of the pipelined broadcast.
pub const CHAIN_CHUNK: usize = 1 << 20;

/// The arena limit a link proposes for a host with `local` of the job's `world` ranks and
/// `cores` cores ([`Tuning::arena_max`](crate::Tuning::arena_max) is rank 0's): every size
/// (up to [`Tuning::MAX_ARENA_KB`](crate::Tuning::MAX_ARENA_KB)) for a job all on this host
/// with [`HOST_ARENA_ALL_MIN_RANKS`] ranks or more, each with a core, or with two cores or more
/// each, which split their part of a piece over them
/// ([`HostArena::threads`](crate::transport::HostArena::threads); 16 cores, 4 ranks, `docs/results/README.md`,
/// "2026-12-02, morning (00e12fa)": split over 4 threads, 4 MiB 770 us against the rings' 1,223 in
/// "2026-12-02, early (75cc19f)") (only such jobs were measured: across hosts the arena's part
/// comes before and after the leaders' ring, not beside it); [`HOST_ARENA_MAX`] otherwise;
/// [`HOST_ARENA_MAX_OVERSUBSCRIBED`] where the ranks outnumber the cores.
pub fn host_arena_limit(local: usize, world: usize, cores: usize) -> usize {
    if local > cores {
        HOST_ARENA_MAX_OVERSUBSCRIBED
    } else if local >= world
        && (local >= HOST_ARENA_ALL_MIN_RANKS || cores >= local.saturating_mul(2))
    {
        (crate::Tuning::MAX_ARENA_KB as usize) << 10
    } else {
        HOST_ARENA_MAX
    }
}

/// By default, the longest a call on the host arena's small areas spins on its peers' area
/// words (in all, over every peer), where the arena's spin time is not zero and the host's ranks
/// do not outnumber the cores, before its waits give the core away (dist-tcp:
/// `DIST_SMALL_SPIN_US` sets it): a peer on a core of its own publishes within a few cache-line
/// transfers, and a yield costs more than that. (On 4 ranks of the 2-core machine, with the
/// spin, every small all_reduce up to 2 KiB took about 22 µs where the slots' path took 15,
/// medians of five rounds under heavy load; without it, level within the noise.)
pub const SMALL_SPIN: Duration = Duration::from_micros(2);

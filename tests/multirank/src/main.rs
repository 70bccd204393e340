//! The multi-rank test program: `dist-multirank CASE` runs one test case as the rank that
//! RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe; `dist-multirank --list` lists the
//! cases with the world sizes, variants and needs each declares. The `multirank` test target
//! (`cargo test`) and `cargo xtask test-multirank` launch it once per rank for each. Each case
//! asserts, so a failure is a non-zero exit with the reason on stderr.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod admission;
mod coll;
mod elastic;
mod failures;
mod flow;
mod groups;
mod grow;
mod hostile;
mod hostile_inject;
mod hostile_store;
mod hosts;
mod hosts_sealed;
mod hybrid_groups;
mod lazy_death;
mod p2p;
mod shm;
mod shm_arena;
mod uneven;
mod work;

use std::process::ExitCode;

use dist_multirank::{Case, DIRECT, SEALED, TWO_LANES, Variant};

/// The grid case with two lanes (the second ring's tag, inside sub-groups), at its one size.
/// [`SEALED`] at 2 and 3 ranks only: the large rings sealed at 5 ranks took 267 s of the 300 s
/// a case may take on the loaded 2-core machine.
const SEALED_FEW: Variant = Variant {
    sizes: &[2, 3],
    ..SEALED
};

/// [`SEALED`] at the two ranks of a case between one pair.
const SEALED_PAIR: Variant = Variant {
    sizes: &[2],
    ..SEALED
};

const GRID_TWO_LANES: Variant = Variant {
    sizes: &[8],
    ..TWO_LANES
};

/// Lazy connections at a world size that would form eagerly by default.
const LAZY: Variant = Variant {
    name: "lazy",
    sizes: &[8],
    env: &[("DIST_FORMATION", "lazy")],
};

/// A budget for queued messages (64 KiB) smaller than the conveniences' large message, which
/// then waits in the socket until its receive is posted.
const SMALL_QUEUE: Variant = Variant {
    name: "small_queue",
    sizes: &[3],
    env: &[("DIST_UNEXPECTED_LIMIT", "65536")],
};

/// Each case asserts: a failure panics. Beside each, what it declares: the world sizes it runs
/// at (by default 2, 3, 4, 5 and 8), its variants, its needs.
const CASES: &[Case] = &[
    Case::new("p2p_pairs", || {
        p2p::pairs();
        Ok(())
    }),
    Case::new("p2p_threads", || {
        p2p::threads();
        Ok(())
    })
    .variants(&[SEALED]),
    // Every size to 8: the dissemination barrier (3, 5, 6, 7) and recursive doubling (2, 4, 8).
    Case::new("p2p_barriers", || {
        p2p::barriers();
        Ok(())
    })
    .sizes(&[2, 3, 4, 5, 6, 7, 8]),
    Case::new("p2p_timeout", || {
        p2p::timeout();
        Ok(())
    }),
    Case::new("p2p_peer_death", || {
        p2p::peer_death();
        Ok(())
    }),
    Case::new("p2p_strangers", || {
        p2p::strangers();
        Ok(())
    }),
    Case::new("p2p_rank0_last", || {
        p2p::rank0_last();
        Ok(())
    }),
    Case::new("p2p_reverse_start", || {
        p2p::reverse_start();
        Ok(())
    }),
    Case::new("p2p_secret", || {
        p2p::secret();
        Ok(())
    }),
    Case::new("coll_reductions", || {
        coll::reductions_all();
        Ok(())
    })
    .variants(&[TWO_LANES, SEALED]),
    Case::new("coll_large_rings", || {
        coll::large_rings_all();
        Ok(())
    })
    .variants(&[TWO_LANES, SEALED_FEW]),
    Case::new("coll_movement", || {
        coll::movement_all();
        Ok(())
    })
    .variants(&[TWO_LANES, SEALED]),
    Case::new("coll_invalid_op", || {
        coll::invalid_op();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_count", || {
        coll::mismatch_count();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_count_large", || {
        coll::mismatch_count_large();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_dtype", || {
        coll::mismatch_dtype();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_op", || {
        coll::mismatch_op();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_root", || {
        coll::mismatch_root();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_mismatch_kind", || {
        coll::mismatch_kind();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("coll_peer_death", || {
        coll::peer_death();
        Ok(())
    })
    .variants(&[TWO_LANES, DIRECT]),
    Case::new("coll_uneven", uneven::uneven).sizes(&[2, 3, 4, 5, 6, 7, 8]),
    Case::new("coll_uneven_mismatch", uneven::uneven_mismatch).sizes(&[2, 3, 5]),
    Case::new("fail_sigkill", failures::sigkill).only_at(&[4]),
    // At 65 ranks the job is lazy by default.
    Case::new("lazy_last_rank_dies", || {
        lazy_death::last_rank_dies();
        Ok(())
    })
    .sizes(&[65])
    .variants(&[LAZY]),
    Case::new("lazy_rank0_dies", || {
        lazy_death::rank0_dies();
        Ok(())
    })
    .sizes(&[65])
    .variants(&[LAZY]),
    Case::new("fail_sigstop", failures::sigstop).only_at(&[4]),
    Case::new("fail_barrier_vs_all_reduce", || {
        failures::barrier_vs_all_reduce();
        Ok(())
    }),
    Case::new("fail_skipped_collective", || {
        failures::skipped_collective();
        Ok(())
    }),
    Case::new("groups_grids", || {
        groups::grids();
        Ok(())
    })
    .only_at(&[8])
    .variants(&[GRID_TWO_LANES]),
    Case::new("groups_splits", || {
        groups::splits();
        Ok(())
    })
    .sizes(&[2, 3, 5, 6, 8]),
    Case::new("groups_conveniences", || {
        groups::conveniences();
        Ok(())
    })
    .sizes(&[2, 3, 5, 6, 8])
    .variants(&[SMALL_QUEUE]),
    Case::new("groups_abort_spreads", || {
        groups::abort_spreads();
        Ok(())
    })
    .only_at(&[3, 4, 6]),
    Case::new("work_collectives", || {
        work::collectives();
        Ok(())
    })
    .variants(&[TWO_LANES]),
    Case::new("work_bucketed_all_reduce", || {
        work::bucketed();
        Ok(())
    }),
    Case::new("work_p2p", || {
        work::p2p();
        Ok(())
    }),
    Case::new("work_threads", || {
        work::threads();
        Ok(())
    }),
    Case::new("hybrid_groups_host", hybrid_groups::grid).only_at(&[4]),
    Case::new("admission_flood", admission::flood),
    Case::new("flow_unexpected", flow::unexpected),
    Case::new("hostile_peer", hostile::peer),
    // A frame injected into a connection: delivered on a plain one, refused on a sealed one.
    Case::new("hostile_inject", hostile_inject::inject)
        .only_at(&[2])
        .variants(&[SEALED_PAIR]),
    Case::new("hostile_asks", hostile::asks).only_at(&[2, 3]),
    Case::new("hostile_doorbells", hostile::doorbells).only_at(&[2, 3]),
    Case::new("hostile_store", hostile_store::store).only_at(&[2, 3]),
];

fn main() -> ExitCode {
    let cases: Vec<Case> = CASES
        .iter()
        .chain(elastic::CASES)
        .chain(grow::CASES)
        .chain(hosts::CASES)
        .chain(shm::CASES)
        .chain(shm_arena::CASES)
        .copied()
        .collect();
    dist_multirank::run_cases("dist-multirank", &cases)
}

//! The multi-rank test program: `dist-multirank CASE` runs one test case as the rank that
//! RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe; `dist-multirank --list` lists the
//! cases. `cargo xtask test-multirank` launches it once per rank for several world sizes. Each
//! case asserts, so a failure is a non-zero exit with the reason on stderr.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod admission;
mod coll;
mod failures;
mod flow;
mod hostile;
mod p2p;

use std::process::ExitCode;

use dist_multirank::Case;

/// Each case asserts: a failure panics.
const CASES: &[Case] = &[
    ("p2p_pairs", || {
        p2p::pairs();
        Ok(())
    }),
    ("p2p_threads", || {
        p2p::threads();
        Ok(())
    }),
    ("p2p_barriers", || {
        p2p::barriers();
        Ok(())
    }),
    ("p2p_timeout", || {
        p2p::timeout();
        Ok(())
    }),
    ("p2p_peer_death", || {
        p2p::peer_death();
        Ok(())
    }),
    ("p2p_strangers", || {
        p2p::strangers();
        Ok(())
    }),
    ("p2p_secret", || {
        p2p::secret();
        Ok(())
    }),
    ("coll_reductions", || {
        coll::reductions_all();
        Ok(())
    }),
    ("coll_large_rings", || {
        coll::large_rings_all();
        Ok(())
    }),
    ("coll_movement", || {
        coll::movement_all();
        Ok(())
    }),
    ("coll_invalid_op", || {
        coll::invalid_op();
        Ok(())
    }),
    ("coll_mismatch_count", || {
        coll::mismatch_count();
        Ok(())
    }),
    ("coll_mismatch_count_large", || {
        coll::mismatch_count_large();
        Ok(())
    }),
    ("coll_mismatch_dtype", || {
        coll::mismatch_dtype();
        Ok(())
    }),
    ("coll_mismatch_op", || {
        coll::mismatch_op();
        Ok(())
    }),
    ("coll_mismatch_root", || {
        coll::mismatch_root();
        Ok(())
    }),
    ("coll_mismatch_kind", || {
        coll::mismatch_kind();
        Ok(())
    }),
    ("coll_peer_death", || {
        coll::peer_death();
        Ok(())
    }),
    ("fail_sigkill", failures::sigkill),
    ("fail_sigstop", failures::sigstop),
    ("fail_barrier_vs_all_reduce", || {
        failures::barrier_vs_all_reduce();
        Ok(())
    }),
    ("fail_skipped_collective", || {
        failures::skipped_collective();
        Ok(())
    }),
    ("admission_flood", admission::flood),
    ("flow_unexpected", flow::unexpected),
    ("hostile_peer", hostile::peer),
];

fn main() -> ExitCode {
    dist_multirank::run_cases("dist-multirank", CASES)
}

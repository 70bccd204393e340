//! The multi-rank test program: `dist-multirank CASE` runs one test case as the rank that
//! RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe; `dist-multirank --list` lists the
//! cases. `cargo xtask test-multirank` launches it once per rank for several world sizes. Each
//! case asserts, so a failure is a non-zero exit with the reason on stderr.

// A binary crate: `pub` in its modules means "used by main", nothing is exported.
#![allow(unreachable_pub)]

mod coll;
mod p2p;

use std::process::ExitCode;

type Case = (&'static str, fn());

const CASES: &[Case] = &[
    ("p2p_pairs", p2p::pairs),
    ("p2p_threads", p2p::threads),
    ("p2p_barriers", p2p::barriers),
    ("p2p_timeout", p2p::timeout),
    ("p2p_peer_death", p2p::peer_death),
    ("p2p_strangers", p2p::strangers),
    ("p2p_secret", p2p::secret),
    ("coll_reductions", coll::reductions_all),
    ("coll_movement", coll::movement_all),
    ("coll_invalid_op", coll::invalid_op),
    ("coll_mismatch_count", coll::mismatch_count),
    ("coll_mismatch_dtype", coll::mismatch_dtype),
    ("coll_mismatch_op", coll::mismatch_op),
    ("coll_mismatch_root", coll::mismatch_root),
    ("coll_mismatch_kind", coll::mismatch_kind),
    ("coll_peer_death", coll::peer_death),
];

fn main() -> ExitCode {
    dist_multirank::init_logging();
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "--list" {
        for (name, _) in CASES {
            println!("{name}");
        }
        return ExitCode::SUCCESS;
    }
    match CASES.iter().find(|(name, _)| *name == arg) {
        Some((name, run)) => {
            run();
            println!("{name}: ok");
            ExitCode::SUCCESS
        }
        None => {
            eprintln!("usage: dist-multirank --list | CASE (unknown case {arg:?})");
            ExitCode::from(2)
        }
    }
}

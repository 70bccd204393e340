//! A rank dies in a lazily connected job (`DIST_FORMATION=lazy`, or 65 ranks and more): every
//! survivor waiting on a collective learns of it within the peer timeout, with the dead rank
//! named, whether or not it was ever connected to that rank. The death reaches the ranks that
//! never talked to it as abort notices, from the ranks that waited on it directly (their
//! connection closed, or their dial was refused) and from there on along the connections the
//! collective uses; a rank 0 that dies is seen so too (formation through the store connects
//! no pair, so rank 0 is a rank like any other here).

use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_multirank::join;

/// Rank `victim` of a lazy job exits abruptly after its first 8 B all_reduce; every other rank
/// runs 8 B all_reduces until one fails, which must happen within the peer timeout and name the
/// victim. (The first may fail already: the victim's exit resets connections whose last
/// bytes its partners have not read yet, and TCP drops those.) At 8 ranks, ranks 1, 2 and 4 are
/// never connected to rank 7 (the all_reduce's partners of 7 are 6, 5 and 3): they hear of its
/// death only from others.
fn death_of(victim: usize) {
    let b = join();
    let (me, n) = (b.rank(), b.world_size());
    assert!(victim < n);
    if me == victim {
        let mut x = [1u64];
        b.all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("rank {me}: the first all_reduce: {e}"));
        assert_eq!(x[0], n as u64);
        println!("rank {me}: exiting abruptly after the first all_reduce");
        std::process::exit(0);
    }
    let (e, took, calls) = {
        let mut calls = 0;
        loop {
            let mut x = [1u64];
            let t = Instant::now();
            calls += 1;
            match b.all_reduce(&mut x, ReduceOp::Sum) {
                Err(e) => break (e, t.elapsed(), calls),
                Ok(()) => assert_eq!(x[0], n as u64, "rank {me}: call {calls}"),
            }
        }
    };
    let connected = dist_tcp::testing::connected_peers(&b);
    // The peer timeout (10 s by default) bounds how long a rank may go without hearing of it.
    assert!(
        took < Duration::from_secs(10),
        "rank {me}: the failing all_reduce took {took:?}: {e}"
    );
    let text = e.to_string();
    let names = match &e {
        DistError::PeerGone { peer, .. } => *peer == victim,
        DistError::Aborted { origin, reason, .. } => {
            *origin == victim || reason.contains(&format!("peer {victim} gone"))
        }
        _ => false,
    };
    assert!(
        names,
        "rank {me}: expected an error naming rank {victim}: {text}"
    );
    println!(
        "rank {me} (connected to {connected} peers): call {calls} failed after {took:.2?}: {text}"
    );
}

/// The last rank dies.
pub fn last_rank_dies() {
    let n = join_world();
    death_of(n - 1);
}

/// Rank 0, which every rank of a lazy job is connected to, dies.
pub fn rank0_dies() {
    death_of(0);
}

/// The world size the launcher describes.
fn join_world() -> usize {
    std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("WORLD_SIZE is not set"))
}

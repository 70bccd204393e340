//! Abort notices that name their call, over real connections: a rank still in an earlier call
//! finishes it and fails at the call the notice names.

mod common;

use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError};
use dist_tcp::{TcpBackend, TcpConfig};

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .init_timeout(Duration::from_secs(20))
        .timeout(Duration::from_secs(20))
}

/// Rank 1 is the root of a broadcast (its part is its sends), then fails the next call on its
/// own (a root out of range) and leaves. Every other rank starts the broadcast only once that
/// abort notice is here: the broadcast still finishes with rank 1's data, and the next call
/// fails naming rank 1. The notice names its call on the wire. (Before, a notice ended every
/// later wait: the broadcast failed with an abort for a call it had not reached, as
/// dist-hybrid's init once did in CI.)
#[test]
fn an_abort_for_a_later_call_lets_an_earlier_one_finish() {
    for world in [2, 3] {
        let results = common::job_with(world, cfg, move |b| {
            let mut data = [b.rank() as u64 + 100; 40];
            if b.rank() == 1 {
                b.broadcast(&mut data, 1)?;
                let bad = b.broadcast(&mut [0u8; 4], world + 2);
                return bad.map(|()| data);
            }
            let until = Instant::now() + Duration::from_secs(20);
            while b.abort_notices().is_empty() {
                assert!(
                    Instant::now() < until,
                    "{world} ranks: no abort notice came"
                );
                std::thread::yield_now();
            }
            // Rank 1's own notice, or another rank's passing it on (naming rank 1 as the
            // culprit): either names rank 1's call.
            let n = &b.abort_notices()[0];
            assert_eq!(n.origin(), 1, "{n:?}");
            assert!(n.call.is_some(), "the notice names no call: {n:?}");
            if let Err(e) = b.broadcast(&mut data, 1) {
                panic!(
                    "{world} ranks, rank {}: the earlier call failed: {e}",
                    b.rank()
                );
            }
            assert_eq!(data, [101; 40]);
            b.broadcast(&mut [0u8; 4], 1).map(|()| data)
        });
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Err(DistError::InvalidRank { given, .. }) if r == 1 => {
                    assert_eq!(given, world + 2)
                }
                Err(DistError::Aborted {
                    origin: 1, reason, ..
                }) if r != 1 => assert!(reason.contains("out of range"), "{reason}"),
                other => panic!("{world} ranks, rank {r}: {other:?}"),
            }
        }
    }
}

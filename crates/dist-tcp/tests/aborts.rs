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

/// Rank 1 fails a call on its own (a root out of range); ranks 0 and 2, once its notice is
/// here, fail that call with rank 1 as the origin and pass the abort on to each other. The passed-on notices name rank 1
/// as the origin of the failure but not at fault: rank 1 failed its own call and lives (a
/// rank named at fault is judged failed by a recovery). Before, the pass-on named its origin
/// at fault.
#[test]
fn an_abort_passed_on_names_its_origin_but_no_rank_at_fault() {
    let results = common::job_with(3, cfg, move |b| {
        let me = b.rank();
        let store = b.store();
        if me == 1 {
            let e = b.broadcast(&mut [0u8; 4], 5).unwrap_err();
            use dist_tcp::dist_store::Store;
            store
                .wait(&["test/seen/0", "test/seen/2"], Duration::from_secs(20))
                .unwrap();
            store.set("test/seen/1", b"1").unwrap();
            return (e.to_string(), Vec::new());
        }
        let until = Instant::now() + Duration::from_secs(20);
        while b.abort_notices().is_empty() {
            assert!(Instant::now() < until, "rank {me}: no abort notice came");
            std::thread::sleep(Duration::from_millis(1));
        }
        let e = b.broadcast(&mut [0u8; 4], 0).unwrap_err();
        assert!(
            matches!(
                e,
                DistError::Aborted {
                    origin: 1,
                    culprit: None,
                    ..
                }
            ),
            "rank {me}: {e:?}"
        );
        // The other survivor's notice, passed on.
        let other = 2 - me;
        let until = Instant::now() + Duration::from_secs(20);
        let passed = loop {
            if let Some(n) = b.abort_notices().into_iter().find(|n| n.from == other) {
                break n;
            }
            assert!(
                Instant::now() < until,
                "rank {me}: rank {other} passed nothing on"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        use dist_tcp::dist_store::Store;
        store.set(&format!("test/seen/{me}"), b"1").unwrap();
        if me == 0 {
            // Rank 0 serves the store: it stays until the others are done with it.
            store
                .wait(&["test/seen/1", "test/seen/2"], Duration::from_secs(20))
                .unwrap();
        }
        (e.to_string(), vec![passed])
    });
    for (r, (e, passed)) in results.into_iter().enumerate() {
        for n in passed {
            assert_eq!(
                (n.origin(), n.culprit, n.first),
                (1, None, Some(1)),
                "rank {r} ({e}): {n:?}"
            );
        }
    }
}

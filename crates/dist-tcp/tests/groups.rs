//! Sub-groups of a TcpBackend in one process: they share the backend's connections, run beside
//! the backend's own collectives, and fail (never hang, never touch freed memory) once the
//! backend is gone.

mod common;

use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp, Subgroups, Tag, TypedMessages};
use dist_tcp::{TcpConfig, TcpGroup};

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpConfig::new(rank, world, format!("127.0.0.1:{port}"))
        .timeout(Duration::from_secs(3))
        .linger(Duration::from_millis(500))
}

#[test]
fn a_group_that_outlives_its_backend_fails_by_its_deadline() {
    let out = common::job_with(3, cfg, |b| {
        let me = b.rank();
        let g: TcpGroup = b.split(Some(0), -(me as i64)).unwrap().unwrap();
        assert_eq!(g.rank(), 2 - me);
        let mut x = [me as u32 + 1];
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [6]);
        // Every rank is done with the group's collectives before any drops its backend.
        b.barrier().unwrap();
        drop(b);
        let t = Instant::now();
        let r = g.all_reduce(&mut x, ReduceOp::Sum);
        let sent = g.send_slice(&[1u8], (g.rank() + 1) % 3, Tag::user(1));
        let mut buf = [0u8];
        let got = g.recv_tagged(&mut buf, (g.rank() + 2) % 3, Tag::user(1));
        (r, sent, got, t.elapsed())
    });
    for (r, (coll, sent, got, took)) in out.into_iter().enumerate() {
        eprintln!("rank {r} after {took:.2?}: {coll:?} / {sent:?} / {got:?}");
        // Within the collective's and the receive's deadlines (3 s each), with slack.
        assert!(took < Duration::from_secs(8), "rank {r} took {took:?}");
        let e = coll.expect_err("an all_reduce after the backend is gone");
        assert!(
            matches!(
                e,
                DistError::PeerGone { .. } | DistError::Timeout { .. } | DistError::Aborted { .. }
            ),
            "rank {r}: {e}"
        );
        let e = got.expect_err("a receive after the backend is gone");
        assert!(
            matches!(
                e,
                DistError::PeerGone { .. } | DistError::Timeout { .. } | DistError::Aborted { .. }
            ),
            "rank {r}: {e}"
        );
        // A send may still be taken by the kernel; if not, it says why.
        if let Err(e) = sent {
            assert!(matches!(e, DistError::PeerGone { .. }), "rank {r}: {e}");
        }
    }
}

/// The backend's own group holds its link for the backend's life: a group a caller forms over
/// a clone of that link is refused at once (it would share the backend's tags), and the
/// backend's collectives go on.
#[test]
fn a_group_over_the_backends_own_link_is_refused() {
    let out = common::job_with(2, cfg, |b| {
        let link = dist_core::Transport::group(&b).link().clone();
        let t = Instant::now();
        let refused =
            dist_core::Group::form(link, dist_core::Tuning::default(), Duration::from_secs(3));
        let took = t.elapsed();
        let mut x = [1u32; 3];
        b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        (refused.map(|_| ()), took, x)
    });
    for (r, (refused, took, x)) in out.into_iter().enumerate() {
        match refused {
            Err(DistError::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains("a group already runs over this link"),
                    "{reason}"
                )
            }
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(took < Duration::from_secs(1), "rank {r}: {took:?}");
        assert_eq!(x, [2; 3]);
    }
}

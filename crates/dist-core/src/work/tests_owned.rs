//! Owned async work and typed point-to-point work over the in-memory link: owned all_reduces
//! kept past their issue and waited for elsewhere, in issue order beside blocking calls and
//! scopes, dropped unwaited (with the group dropped too), refused from a second thread; typed
//! `isend_slice`/`irecv_slice` and their size errors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::tests::{form, late_from_1, sum, val};
use crate::testing::{run_group, run_links};
use crate::{
    Backend, Collectives, DistError, ReduceOp, Subgroups, Tag, Tuning, TypedMessages, Work,
};

/// A meeting point of test threads (the ranks' and others) whose wait ends by a deadline, so
/// that a thread that fails before it comes leaves the others with an error, not a hang.
struct Meet {
    arrived: AtomicUsize,
    parties: usize,
}

impl Meet {
    fn new(parties: usize) -> Meet {
        Meet {
            arrived: AtomicUsize::new(0),
            parties,
        }
    }

    /// Arrives, and waits (at most a minute) until every party has.
    fn wait(&self) {
        self.arrived.fetch_add(1, Ordering::AcqRel);
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while self.arrived.load(Ordering::Acquire) < self.parties {
            assert!(
                std::time::Instant::now() < until,
                "a party never came to the meeting point"
            );
            std::thread::yield_now();
        }
    }
}

/// What a training step keeps between its backward hooks and its optimizer step: the handles,
/// with no lifetime.
struct Step {
    pending: Vec<Work<'static, Vec<i64>>>,
}

/// Owned all_reduces issued one after another (the hooks), a blocking all_reduce and a scope
/// between them, waited for afterwards, one of them on another thread: every buffer comes
/// back reduced, and the blocking call and the scope ran after the owned work issued before
/// them (issue order, the same on every rank).
#[test]
fn owned_all_reduces_outlive_their_issue_and_keep_issue_order() {
    // Rank 1's collective messages arrive late, so the owned work is still running when the
    // blocking call comes.
    let results = run_links(late_from_1(3, Duration::from_millis(50)), |link| {
        let g = form(link)?;
        let (me, n) = (g.rank(), g.world_size());
        let mut step = Step {
            pending: Vec::new(),
        };
        for k in 0..3 {
            step.pending
                .push(g.all_reduce_owned(vec![val(me, k); 1000 + k], ReduceOp::Sum));
        }
        // Same shape as bucket 0, other values: run out of order, the two would be mixed.
        let mut between = vec![val(me, 7); 1000];
        g.all_reduce(&mut between, ReduceOp::Sum)?;
        assert!(step.pending[0].is_completed(), "the blocking call overtook");
        assert!(between.iter().all(|v| *v == sum(n, 7)));
        step.pending
            .push(g.all_reduce_owned(vec![val(me, 3); 10], ReduceOp::Max));
        let mut in_scope = vec![val(me, 8); 1000];
        let issued_in_scope = g.scope(|s| {
            s.all_reduce(&mut in_scope, ReduceOp::Sum).wait()?;
            // Issued last (rank 1's part comes late): only the scope's end waits for it.
            Ok(g.all_reduce_owned(vec![val(me, 9); 1000], ReduceOp::Sum))
        })?;
        assert!(in_scope.iter().all(|v| *v == sum(n, 8)));
        // The scope's end waited for the owned work issued in it; the handle outlives it.
        assert!(issued_in_scope.is_completed());
        assert!(issued_in_scope.wait()?.iter().all(|v| *v == sum(n, 9)));
        let last = step.pending.pop().expect("four handles");
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|t| {
            t.spawn(move || tx.send(last.wait()));
        });
        let got = rx.recv().expect("the other thread waited")?;
        assert_eq!(got, vec![val(n - 1, 3); 10]);
        for (k, w) in step.pending.into_iter().enumerate() {
            let got = w.wait()?;
            assert_eq!(got.len(), 1000 + k);
            assert!(got.iter().all(|v| *v == sum(n, k)), "bucket {k}");
        }
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// A handle dropped unwaited lets its work run to its end: the next blocking call comes after
/// it, and a group dropped with owned work still running keeps its state (and the buffer) for
/// that work, which the late ranks then complete against.
#[test]
fn dropped_owned_handles_neither_wait_nor_lose_the_work() {
    let dropped_early = Meet::new(3);
    let results = run_group(
        3,
        |_| Tuning::default(),
        Duration::from_secs(20),
        |g| {
            let (me, n) = (g.rank(), g.world_size());
            drop(g.all_reduce_owned(vec![val(me, 0); 100], ReduceOp::Sum));
            let mut x = vec![val(me, 1); 100];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            assert!(x.iter().all(|v| *v == sum(n, 1)));
            // Rank 0 issues, drops its handle and its group, then waits for the others to
            // issue theirs: its part must still run, with its buffer.
            if me == 0 {
                drop(g.all_reduce_owned(vec![val(me, 2); 100_000], ReduceOp::Sum));
                drop(g);
                dropped_early.wait();
                return Ok(None);
            }
            dropped_early.wait();
            let got = g
                .all_reduce_owned(vec![val(me, 2); 100_000], ReduceOp::Sum)
                .wait()?;
            Ok(Some(got))
        },
    );
    for (r, got) in results.into_iter().enumerate() {
        match got.unwrap() {
            None => assert_eq!(r, 0),
            Some(v) => assert!(v.iter().all(|x| *x == sum(3, 2)), "rank {r}"),
        }
    }
}

/// While a thread's owned work runs, a collective of another thread is refused at once (and
/// the group aborted), as two threads' blocking calls are; the owned work fails too, here and
/// on the other ranks, instead of hanging.
#[test]
fn another_threads_call_while_owned_work_runs_is_refused() {
    let refused = Meet::new(2);
    let results = run_group(
        2,
        |_| Tuning::default(),
        Duration::from_secs(20),
        |g| {
            let me = g.rank();
            if me == 1 {
                // Issues its part only once rank 0's second thread has been refused.
                refused.wait();
                return Ok(vec![
                    g.all_reduce_owned(vec![1u32; 8], ReduceOp::Sum).wait(),
                ]);
            }
            let w = g.all_reduce_owned(vec![1u32; 8], ReduceOp::Sum);
            let other = std::thread::scope(|t| t.spawn(|| g.barrier()).join().unwrap());
            refused.wait();
            Ok(vec![other.map(|()| Vec::new()), w.wait()])
        },
    );
    let r0 = results[0].as_ref().unwrap();
    match &r0[0] {
        Err(DistError::ConcurrentUse { detail, .. }) => {
            assert!(detail.contains("owned async work"), "{detail}")
        }
        other => panic!("rank 0's second thread: {other:?}"),
    }
    assert!(
        matches!(
            &r0[1],
            Err(DistError::ConcurrentUse { .. } | DistError::Aborted { .. })
        ),
        "{:?}",
        r0[1]
    );
    let r1 = &results[1].as_ref().unwrap()[0];
    assert!(matches!(r1, Err(DistError::Aborted { .. })), "{r1:?}");
}

/// Owned work on a sub-group: its own order, beside the parent's blocking calls.
#[test]
fn owned_work_runs_on_a_sub_group() {
    let results = run_group(
        4,
        |_| Tuning::default(),
        Duration::from_secs(20),
        |g| {
            let me = g.rank();
            let pair = g.split_named(Some(me as u32 / 2), 0, "pair")?.unwrap();
            let w = pair.all_reduce_owned(vec![me as u64; 64], ReduceOp::Sum);
            let mut all = [me as u64];
            g.all_reduce(&mut all, ReduceOp::Sum)?;
            assert_eq!(all, [6]);
            w.wait()
        },
    );
    for (r, got) in results.into_iter().enumerate() {
        let base = (r / 2 * 2) as u64;
        assert_eq!(got.unwrap(), vec![2 * base + 1; 64], "rank {r}");
    }
}

/// Typed sends and receives in a scope: a ring of f64 slices, values checked; a receive of the
/// wrong length is a size error naming the peer, the call, the element type and both sizes,
/// and the message stays queued for a receive of the right length.
#[test]
fn typed_isend_and_irecv_move_elements_and_name_size_errors() {
    let results = run_group(
        3,
        |_| Tuning::default(),
        Duration::from_secs(20),
        |g| {
            let (me, n) = (g.rank(), g.world_size());
            let (right, left) = ((me + 1) % n, (me + n - 1) % n);
            let mine: Vec<f64> = (0..100).map(|i| (me * 1000 + i) as f64 + 0.5).collect();
            let mut got = vec![0f64; 100];
            g.scope(|s| {
                let r = s.irecv_slice(&mut got, left, Tag::user(4));
                s.isend_slice(&mine, right, Tag::user(4)).wait()?;
                r.wait().map(|_| ())
            })?;
            let want: Vec<f64> = (0..100).map(|i| (left * 1000 + i) as f64 + 0.5).collect();
            assert_eq!(got, want);
            // Rank 0 sends 3 u32s to rank 1, which posts 2.
            let mut error = None;
            if me == 0 {
                g.scope(|s| s.isend_slice(&[7u32, 8, 9], 1, Tag::user(5)).wait())?;
            } else if me == 1 {
                let mut two = [0u32; 2];
                let e = g
                    .scope(|s| s.irecv_slice(&mut two, 0, Tag::user(5)).wait().map(|_| ()))
                    .unwrap_err();
                error = Some(e.to_string());
                let mut three = [0u32; 3];
                g.recv_slice(&mut three, 0, Tag::user(5))?;
                assert_eq!(three, [7, 8, 9]);
            }
            Ok(error)
        },
    );
    let e = results[1].as_ref().unwrap().clone().unwrap();
    assert_eq!(
        e,
        "rank 1: irecv_slice from 0 (tag 5, u32 x 2 = 8 bytes) from peer 0: expected 8 bytes, \
         got a message of 12"
    );
    for r in results {
        r.unwrap();
    }
}

/// A blocking call of the thread whose owned work holds the group claims the group afresh once
/// that work has ended: a call of another thread during the blocking call is refused, as it
/// would be without owned work before it. (Holding the group through the owned work's claim
/// instead would leave it unclaimed once that work ended, and the other thread's call would
/// run beside the blocking one.)
#[test]
fn a_blocking_call_after_owned_work_claims_the_group_itself() {
    let other_tried = Meet::new(2);
    let results = run_group(
        2,
        |_| Tuning::default(),
        Duration::from_secs(20),
        |g| {
            if g.rank() == 1 {
                g.all_reduce_owned(vec![1u8; 4], ReduceOp::Sum).wait()?;
                // Joins rank 0's blocking call only once rank 0's other thread has tried.
                other_tried.wait();
                let mut x = [1u8; 4];
                return Ok(vec![g.all_reduce(&mut x, ReduceOp::Sum)]);
            }
            let w = g.all_reduce_owned(vec![1u8; 4], ReduceOp::Sum);
            std::thread::scope(|t| {
                let other = t.spawn(|| {
                    // Until the owned work has ended and the blocking call holds the group.
                    let until = std::time::Instant::now() + Duration::from_secs(60);
                    while g.occupancy().pending() > 0 || !g.occupancy().occupied() {
                        assert!(
                            std::time::Instant::now() < until,
                            "the blocking call never claimed the group"
                        );
                        std::thread::yield_now();
                    }
                    let r = g.barrier();
                    other_tried.wait();
                    r
                });
                let mut x = [1u8; 4];
                let blocking = g.all_reduce(&mut x, ReduceOp::Sum);
                let other = other.join().unwrap();
                Ok(vec![w.wait().map(|_| ()), blocking, other])
            })
        },
    );
    let r0 = results[0].as_ref().unwrap();
    assert!(r0[0].is_ok(), "{:?}", r0[0]);
    match &r0[2] {
        Err(DistError::ConcurrentUse { detail, .. }) => {
            assert!(detail.contains("all_reduce"), "{detail}")
        }
        other => panic!("the other thread's barrier: {other:?}"),
    }
    assert!(
        r0[1].is_err(),
        "the blocking call ended well beside a refused call"
    );
    let r1 = &results[1].as_ref().unwrap()[0];
    assert!(matches!(r1, Err(DistError::Aborted { .. })), "{r1:?}");
}

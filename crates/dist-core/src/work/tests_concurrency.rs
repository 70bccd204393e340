//! Async work beside other calls, over the in-memory link: a blocking call inside a scope,
//! several groups at once, two threads on one group, nested scopes, receives queued before a
//! blocking collective, and which threads run the work.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::tests::{TIMEOUT, form, late_from_1, lone, sum, val};
use crate::testing::{Delivery, MemLink, run_group, run_links};
use crate::{Backend, Collectives, DistError, ReduceOp, Tag, Tuning};

/// A blocking collective called inside a scope, on the scope's group, runs after the async
/// work queued before it (not refused, not reordered).
#[test]
fn a_blocking_call_in_a_scope_runs_after_its_queued_work() {
    let results = run_links(late_from_1(3, Duration::from_millis(100)), |link| {
        let g = form(link)?;
        let me = g.rank();
        let (mut x, mut y) = (vec![val(me, 0); 5], vec![val(me, 1); 9]);
        g.scope(|s| {
            let w = s.all_reduce(&mut x, ReduceOp::Sum);
            g.all_reduce(&mut y, ReduceOp::Sum)?;
            assert!(
                w.is_completed(),
                "the blocking call ran before the queued one"
            );
            let x = w.wait()?;
            assert!(x.iter().all(|v| *v == sum(3, 0)), "{x:?}");
            Ok(())
        })?;
        assert!(y.iter().all(|v| *v == sum(3, 1)), "{y:?}");
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// Two groups' work runs at once: the second group's all_reduce ends while the first's,
/// issued before it, still waits for a late message.
#[test]
fn work_on_two_groups_runs_at_once() {
    let (slow, fast) = (late_from_1(2, Duration::from_secs(2)), MemLink::mesh(2));
    let pairs: Vec<_> = slow.into_iter().zip(fast).collect();
    std::thread::scope(|t| {
        let hs: Vec<_> = pairs
            .into_iter()
            .map(|(a, b)| {
                t.spawn(move || {
                    let (ga, gb) = (form(a)?, form(b)?);
                    let me = ga.rank();
                    let (mut x, mut y) = (vec![val(me, 0); 4], vec![val(me, 1); 4]);
                    ga.scope(|sa| {
                        gb.scope(|sb| {
                            let wa = sa.all_reduce(&mut x, ReduceOp::Sum);
                            let y = sb.all_reduce(&mut y, ReduceOp::Sum).wait()?;
                            assert!(y.iter().all(|v| *v == sum(2, 1)));
                            if me == 0 {
                                assert!(!wa.is_completed(), "the groups' work ran in turn");
                            }
                            let x = wa.wait()?;
                            assert!(x.iter().all(|v| *v == sum(2, 0)));
                            Ok(())
                        })
                    })
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
}

/// A second thread calling a collective while the first is inside one on the same group is
/// refused at once, naming the rank, its call and the other thread's; the group is aborted,
/// so the first call and the other rank's fail too, and nothing hangs.
#[test]
fn two_threads_on_one_group_one_is_refused_at_once() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let results = run_group(
        2,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            if g.rank() == 1 {
                // Joins only once rank 0's second thread has been refused.
                go_rx.lock().unwrap().recv().unwrap();
                let e = g.all_reduce(&mut [1u32; 4], ReduceOp::Sum).unwrap_err();
                assert!(matches!(e, DistError::Aborted { .. }), "{e}");
                return Ok(());
            }
            std::thread::scope(|t| {
                let first = t.spawn(|| g.all_reduce(&mut [1u32; 4], ReduceOp::Sum));
                let since = Instant::now();
                while !g.occupancy().occupied() {
                    assert!(since.elapsed() < TIMEOUT, "the first call never entered");
                    std::thread::yield_now();
                }
                let t0 = Instant::now();
                let e = g.barrier().unwrap_err();
                assert!(t0.elapsed() < Duration::from_secs(5), "the refusal waited");
                let text = e.to_string();
                assert!(
                    matches!(e, DistError::ConcurrentUse { rank: 0, .. }),
                    "{text}"
                );
                assert!(
                    text.contains("barrier")
                        && text.contains("another thread is inside all_reduce"),
                    "{text}"
                );
                go_tx.send(()).unwrap();
                let e = first.join().unwrap().unwrap_err();
                assert!(
                    matches!(
                        e,
                        DistError::ConcurrentUse { .. } | DistError::Aborted { .. }
                    ),
                    "{e}"
                );
            });
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}

/// A scope open on one thread: another thread's collective, and its scope, are refused.
#[test]
fn a_scope_holds_its_group_against_other_threads() {
    let g = lone(2);
    let e = g
        .scope(|_| {
            std::thread::scope(|t| {
                let e = t
                    .spawn(|| g.all_reduce(&mut [0u8; 1], ReduceOp::Sum))
                    .join()
                    .unwrap()
                    .unwrap_err();
                assert!(
                    e.to_string()
                        .contains("another thread is inside an async scope"),
                    "{e}"
                );
                let e = t.spawn(|| g.scope(|_| Ok(()))).join().unwrap().unwrap_err();
                assert!(matches!(e, DistError::ConcurrentUse { .. }), "{e}");
            });
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(e, DistError::ConcurrentUse { rank: 0, .. }), "{e}");
}

/// The same thread may open a scope inside its scope, and its work still runs in issue order.
#[test]
fn nested_scopes_on_one_thread_keep_issue_order() {
    let results = run_group(
        3,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            let me = g.rank();
            let (mut x, mut y) = (vec![val(me, 0); 3], vec![val(me, 1); 300]);
            g.scope(|s| {
                let w = s.all_reduce(&mut x, ReduceOp::Sum);
                g.scope(|inner| inner.all_reduce(&mut y, ReduceOp::Sum).wait().map(|_| ()))?;
                assert!(w.wait()?.iter().all(|v| *v == sum(3, 0)));
                Ok(())
            })?;
            assert!(y.iter().all(|v| *v == sum(3, 1)));
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}

/// A receive queued before a blocking collective does not hold the collective up: the peer
/// sends the message only after that collective.
#[test]
fn a_blocking_collective_does_not_wait_for_queued_receives() {
    let results = run_group(
        2,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            let me = g.rank();
            let mut x = [val(me, 0)];
            if me == 1 {
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                g.send_tagged(&[9u8; 4], 0, Tag::user(2))?;
            } else {
                let mut inb = [0u8; 4];
                g.scope(|s| {
                    let r = s.irecv(&mut inb, 1, Tag::user(2));
                    g.all_reduce(&mut x, ReduceOp::Sum)?;
                    assert_eq!(r.wait()?, &[9u8; 4]);
                    Ok(())
                })?;
            }
            assert_eq!(x[0], sum(2, 0));
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}

/// Async work runs on work threads ([`crate::work::on_work_thread`], which transports read to
/// sleep instead of spinning there), the caller's own calls do not.
#[test]
fn async_work_runs_on_work_threads_and_blocking_calls_do_not() {
    let links = MemLink::mesh(2);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    links[0].set_faults(move |e| {
        if e.tag == Tag::user(5) {
            record.lock().unwrap().push(crate::work::on_work_thread());
        }
        Delivery::Now
    });
    let results = run_links(links, |link| {
        let g = form(link)?;
        let mut b = [0u8; 1];
        if g.rank() == 0 {
            g.send_tagged(&[1], 1, Tag::user(5))?;
            g.scope(|s| s.isend(&[2], 1, Tag::user(5)).wait())?;
        } else {
            g.recv_tagged(&mut b, 0, Tag::user(5))?;
            g.recv_tagged(&mut b, 0, Tag::user(5))?;
        }
        Ok(crate::work::on_work_thread())
    });
    for r in results {
        assert!(!r.unwrap(), "a caller's thread counted as a work thread");
    }
    assert_eq!(*seen.lock().unwrap(), [false, true]);
}

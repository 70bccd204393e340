//! Async work over the in-memory link: every async collective's result, issue order, errors
//! through `wait`, `wait_timeout`, `is_completed`, dropped and leaked handles (async work beside
//! blocking calls, other groups and other threads: `tests_concurrency.rs`), and the helpers both
//! test modules share.

use std::time::{Duration, Instant};

use crate::collectives::COLLECTIVE_TAG;
use crate::testing::{Delivery, MemLink, run_group, run_links};
use crate::{Backend, Collectives, DistError, Group, ReduceOp, Result, Tag, Tuning};

pub(super) const TIMEOUT: Duration = Duration::from_secs(20);

pub(super) fn form(link: MemLink) -> Result<Group<MemLink>> {
    Group::form(link, Tuning::default(), TIMEOUT)
}

/// Rank `r`'s element `i`.
pub(super) fn val(r: usize, i: usize) -> i64 {
    (r * 1000 + i) as i64
}

/// The sum over `n` ranks of element `i`.
pub(super) fn sum(n: usize, i: usize) -> i64 {
    (0..n).map(|r| val(r, i)).sum()
}

/// Rank 0 of a group of `n` whose other ranks never call.
pub(super) fn lone(n: usize) -> Group<MemLink> {
    form(MemLink::mesh(n).swap_remove(0)).unwrap()
}

/// A mesh of `n` whose messages from rank 1 on the collectives' tag arrive `delay` late.
pub(super) fn late_from_1(n: usize, delay: Duration) -> Vec<MemLink> {
    let links = MemLink::mesh(n);
    links[0].set_faults(move |e| {
        if e.src == 1 && e.tag == COLLECTIVE_TAG {
            Delivery::After(delay)
        } else {
            Delivery::Now
        }
    });
    links
}

/// Every async collective on `g`, each result checked against the reference.
fn every_collective(g: &Group<MemLink>) -> Result<()> {
    let (me, n) = (g.rank(), g.world_size());
    let k = 37;
    let mine: Vec<i64> = (0..k).map(|i| val(me, i)).collect();
    let blocks: Vec<i64> = (0..n * k).map(|i| val(me, i)).collect();
    let (mut ar, mut ar_out, mut bc, mut red, mut red_out) = (
        mine.clone(),
        vec![0; k],
        mine.clone(),
        mine.clone(),
        vec![0; k],
    );
    let (mut ag, mut ga, mut sc, mut rs, mut a2a) = (
        vec![0; n * k],
        vec![0; n * k],
        vec![0; k],
        vec![0; k],
        vec![0; n * k],
    );
    // all_to_all_v: rank r sends j + 1 elements to rank j.
    let send_counts: Vec<usize> = (0..n).map(|j| j + 1).collect();
    let recv_counts = vec![me + 1; n];
    let v_in: Vec<i64> = (0..send_counts.iter().sum()).map(|i| val(me, i)).collect();
    let mut v_out = vec![0; n * (me + 1)];
    let root = n - 1;
    g.scope(|s| {
        let w_ar = s.all_reduce(&mut ar, ReduceOp::Sum);
        let w_ar_out = s.all_reduce_into(&mine, &mut ar_out, ReduceOp::Sum);
        let w_bc = s.broadcast(&mut bc, root);
        let w_red = s.reduce(&mut red, ReduceOp::Sum, 0);
        let w_red_out = s.reduce_into(&mine, &mut red_out, ReduceOp::Max, root);
        let w_ag = s.all_gather(&mine, &mut ag);
        let w_ga = s.gather(&mine, (me == root).then_some(&mut ga[..]), root);
        let w_sc = s.scatter((me == 0).then_some(&blocks[..]), &mut sc, 0);
        let w_rs = s.reduce_scatter(&blocks, &mut rs, ReduceOp::Sum);
        let w_a2a = s.all_to_all(&blocks, &mut a2a);
        let w_v = s.all_to_all_v(&v_in, &send_counts, &mut v_out, &recv_counts);
        let w_bar = s.barrier();
        let want_sum: Vec<i64> = (0..k).map(|i| sum(n, i)).collect();
        assert_eq!(w_ar.wait()?, &want_sum[..], "all_reduce");
        assert_eq!(w_ar_out.wait()?, &want_sum[..], "all_reduce_into");
        let root_vals: Vec<i64> = (0..k).map(|i| val(root, i)).collect();
        assert_eq!(w_bc.wait()?, &root_vals[..], "broadcast");
        let red = w_red.wait()?;
        if me == 0 {
            assert_eq!(red, &want_sum[..], "reduce");
        }
        let red_out = w_red_out.wait()?;
        if me == root {
            assert_eq!(red_out, &root_vals[..], "reduce_into max");
        }
        let gathered: Vec<i64> = (0..n * k).map(|i| val(i / k, i % k)).collect();
        assert_eq!(w_ag.wait()?, &gathered[..], "all_gather");
        match w_ga.wait()? {
            Some(out) => assert_eq!(out, &gathered[..], "gather"),
            None => assert_ne!(me, root),
        }
        let block: Vec<i64> = (0..k).map(|i| val(0, me * k + i)).collect();
        assert_eq!(w_sc.wait()?, &block[..], "scatter");
        let rs_want: Vec<i64> = (0..k).map(|i| sum(n, me * k + i)).collect();
        assert_eq!(w_rs.wait()?, &rs_want[..], "reduce_scatter");
        let a2a_want: Vec<i64> = (0..n * k).map(|i| val(i / k, me * k + i % k)).collect();
        assert_eq!(w_a2a.wait()?, &a2a_want[..], "all_to_all");
        // From rank j: its elements at offset sum(1..=me) (what it sends to ranks before me).
        let off: usize = (1..=me).sum();
        let v_want: Vec<i64> = (0..n * (me + 1))
            .map(|i| val(i / (me + 1), off + i % (me + 1)))
            .collect();
        assert_eq!(w_v.wait()?, &v_want[..], "all_to_all_v");
        w_bar.wait()
    })?;
    // The buffers are the caller's again once the scope has ended.
    assert_eq!(ar, ar_out);
    Ok(())
}

#[test]
fn every_async_collective_gives_the_blocking_result() {
    for n in 1..=5 {
        for r in run_group(n, |_| Tuning::default(), TIMEOUT, |g| every_collective(&g)) {
            r.unwrap_or_else(|e| panic!("n={n}: {e}"));
        }
    }
}

/// Twenty collectives of five kinds and many sizes in flight at once: run out of order on any
/// rank, they would be a mismatch (their descriptors differ).
#[test]
fn collectives_on_one_group_run_in_issue_order() {
    for n in [2, 3, 4] {
        let results = run_group(
            n,
            |_| Tuning::default(),
            TIMEOUT,
            |g| {
                let me = g.rank();
                let mut bufs: Vec<Vec<i64>> =
                    (0..20).map(|j| vec![val(me, j); j * 97 + 1]).collect();
                let mut gathered: Vec<Vec<i64>> = (0..20).map(|j| vec![0; n * (j + 1)]).collect();
                let inputs: Vec<Vec<i64>> = (0..20).map(|j| vec![val(me, j); j + 1]).collect();
                g.scope(|s| {
                    let mut work = Vec::new();
                    for (j, (b, (out, inp))) in (bufs.iter_mut())
                        .zip(gathered.iter_mut().zip(&inputs))
                        .enumerate()
                    {
                        let w = match j % 4 {
                            0 => s.all_reduce(b, ReduceOp::Sum),
                            1 => s.broadcast(b, j % n),
                            2 => s.all_gather(inp, out),
                            _ => s.reduce(b, ReduceOp::Max, j % n),
                        };
                        work.push((j, w));
                    }
                    for (j, w) in work {
                        let got = w.wait()?;
                        let want = match j % 4 {
                            0 => sum(n, j),
                            1 => val(j % n, j),
                            2 => {
                                check_gathered(got, n, j);
                                continue;
                            }
                            _ if me == j % n => val(n - 1, j),
                            _ => continue,
                        };
                        assert!(got.iter().all(|x| *x == want), "collective {j}: {got:?}");
                    }
                    Ok(())
                })
            },
        );
        for r in results {
            r.unwrap_or_else(|e| panic!("n={n}: {e}"));
        }
    }
}

fn check_gathered(got: &[i64], n: usize, j: usize) {
    let want: Vec<i64> = (0..n * (j + 1)).map(|i| val(i / (j + 1), j)).collect();
    assert_eq!(got, &want[..], "all_gather {j}");
}

/// Every rank receives from its left while sending to its right, both async: the receive
/// issued first does not hold up the send.
#[test]
fn irecv_then_isend_around_a_ring() {
    for n in [2, 3, 5] {
        let results = run_group(
            n,
            |_| Tuning::default(),
            TIMEOUT,
            |g| {
                let me = g.rank();
                let (left, right) = ((me + n - 1) % n, (me + 1) % n);
                let out = (me as u64 * 7).to_le_bytes();
                let mut inb = [0u8; 8];
                g.scope(|s| {
                    let r = s.irecv(&mut inb, left, Tag::user(3));
                    let w = s.isend(&out, right, Tag::user(3));
                    let got = r.wait()?;
                    w.wait()?;
                    assert_eq!(u64::from_le_bytes(got.try_into().unwrap()), left as u64 * 7);
                    Ok(())
                })
            },
        );
        for r in results {
            r.unwrap_or_else(|e| panic!("n={n}: {e}"));
        }
    }
}

/// A mismatch, and a bad root, come out of `wait` as the blocking call's error would.
#[test]
fn errors_come_through_wait() {
    let results = run_group(
        3,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            let mut x = vec![1i64; 4 + g.rank() / 2];
            let e = g
                .scope(|s| s.all_reduce(&mut x, ReduceOp::Sum).wait().map(|_| ()))
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
                ),
                "{e}"
            );
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
    let g = lone(2);
    let mut x = [0u8; 4];
    let e = g
        .scope(|s| s.broadcast(&mut x, 7).wait().map(|_| ()))
        .unwrap_err();
    assert!(matches!(e, DistError::InvalidRank { given: 7, .. }), "{e}");
}

/// `wait_timeout` on work that cannot have ended hands the handle back; the work goes on and
/// its result comes later. `is_completed` turns true once it has ended.
#[test]
fn wait_timeout_keeps_the_work_and_is_completed_follows_it() {
    let results = run_links(late_from_1(2, Duration::from_millis(300)), |link| {
        let g = form(link)?;
        let me = g.rank();
        let mut x = vec![val(me, 0); 16];
        g.scope(|s| {
            let w = s.all_reduce(&mut x, ReduceOp::Sum);
            let w = if me == 0 {
                // Rank 1's message cannot arrive for 300 ms.
                assert!(!w.is_completed());
                let w = w.wait_timeout(Duration::from_millis(1)).unwrap_err();
                assert!(!w.is_completed());
                let t = Instant::now();
                while !w.is_completed() {
                    assert!(t.elapsed() < TIMEOUT, "the work never ended");
                    std::thread::yield_now();
                }
                w
            } else {
                w
            };
            let got = w.wait()?;
            assert!(got.iter().all(|v| *v == sum(2, 0)), "{got:?}");
            Ok(())
        })
    });
    for r in results {
        r.unwrap();
    }
}

/// Dropping a handle whose work has not ended waits for it; a leaked handle's work still runs
/// and the scope waits for it, its buffer then holding the result.
#[test]
fn dropped_handles_wait_and_leaked_ones_still_run() {
    let results = run_links(late_from_1(2, Duration::from_millis(200)), |link| {
        let g = form(link)?;
        let me = g.rank();
        let (mut x, mut y) = (vec![val(me, 0); 8], vec![val(me, 1); 8]);
        g.scope(|s| {
            let w = s.all_reduce(&mut x, ReduceOp::Sum);
            if me == 0 {
                assert!(!w.is_completed());
            }
            drop(w);
            assert_eq!(s.pending(), 0, "the drop returned before its work ended");
            std::mem::forget(s.all_reduce(&mut y, ReduceOp::Sum));
            Ok(())
        })?;
        assert_eq!(g.occupancy().pending(), 0);
        assert!(x.iter().all(|v| *v == sum(2, 0)), "{x:?}");
        assert!(y.iter().all(|v| *v == sum(2, 1)), "{y:?}");
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

/// A failed work whose handle was dropped: the scope returns its error.
#[test]
fn the_error_of_a_dropped_handle_is_the_scopes() {
    let results = run_group(
        2,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            let mut x = vec![0u32; 3 + g.rank()];
            let e = g
                .scope(|s| {
                    drop(s.all_reduce(&mut x, ReduceOp::Sum));
                    Ok(())
                })
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
                ),
                "{e}"
            );
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}

/// The uneven collectives, async: rank `r` contributes `r + 1` elements; each result is the
/// blocking call's, computed here from the definition.
#[test]
fn async_uneven_collectives_give_the_blocking_result() {
    for n in 1..=5 {
        let results = run_group(
            n,
            |_| Tuning::default(),
            TIMEOUT,
            |g| {
                let (me, n) = (g.rank(), g.world_size());
                let counts: Vec<usize> = (0..n).map(|r| r + 1).collect();
                let total: usize = counts.iter().sum();
                let mine: Vec<i64> = (0..=me).map(|i| val(me, i)).collect();
                // Block r of the gathered vector: rank r's r + 1 elements.
                let gathered: Vec<i64> = (0..n)
                    .flat_map(|r| (0..=r).map(move |i| val(r, i)))
                    .collect();
                let root = n - 1;
                let (mut ag, mut ga, mut sc) = (vec![0; total], vec![0; total], vec![0; me + 1]);
                g.scope(|s| {
                    let w_ag = s.all_gather_v(&mine, &mut ag, &counts);
                    let w_ga =
                        s.gather_v(&mine, (me == root).then_some(&mut ga[..]), &counts, root);
                    let w_sc = s.scatter_v((me == 0).then_some(&gathered[..]), &counts, &mut sc, 0);
                    assert_eq!(w_ag.wait()?, &gathered[..], "all_gather_v");
                    match w_ga.wait()? {
                        Some(out) => assert_eq!(out, &gathered[..], "gather_v"),
                        None => assert_ne!(me, root),
                    }
                    assert_eq!(w_sc.wait()?, &mine[..], "scatter_v");
                    Ok(())
                })
            },
        );
        for r in results {
            r.unwrap_or_else(|e| panic!("n={n}: {e}"));
        }
    }
}

/// A long scope that drops its handles after their work succeeded keeps a bounded list of
/// them (before the fix every dropped success stayed tracked: 1,000 sends, 1,000 slots).
#[test]
fn dropped_successes_are_not_tracked_forever() {
    let results = run_group(
        2,
        |_| Tuning::default(),
        TIMEOUT,
        |g| {
            if g.rank() == 0 {
                g.scope(|s| {
                    for _ in 0..1000 {
                        drop(s.isend(&[1], 1, Tag::user(9)));
                    }
                    assert!(s.tracked() < 200, "{} slots tracked", s.tracked());
                    Ok(())
                })
            } else {
                let mut b = [0u8; 1];
                for _ in 0..1000 {
                    g.recv_tagged(&mut b, 0, Tag::user(9))?;
                }
                Ok(())
            }
        },
    );
    for r in results {
        r.unwrap();
    }
}

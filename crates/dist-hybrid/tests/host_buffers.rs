//! Every collective of `HybridBackend` on host slices (TCP only, ranks as threads over
//! loopback): the dispatch by buffer type reaches the TCP collectives with the arguments in
//! their places, each result checked. Needs no GPU.

use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use dist_core::{Backend, ReduceOp};
use dist_hybrid::{GpuChoice, HybridBackend};
use dist_nccl::CommConfig;
use dist_tcp::TcpBackend;

fn job<T: Send + 'static>(
    world: usize,
    f: impl Fn(HybridBackend) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || {
                let tcp = TcpBackend::with_config(
                    TcpBackend::builder(r, world, format!("127.0.0.1:{port}"))
                        .init_timeout(Duration::from_secs(20))
                        .timeout(Duration::from_secs(20)),
                )
                .unwrap();
                let h =
                    HybridBackend::with_nccl(tcp, r, GpuChoice::None, None, CommConfig::default())
                        .unwrap();
                f(h)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn every_collective(h: &HybridBackend) {
    let (me, n) = (h.rank(), h.world_size());
    let v = |r: usize, i: usize| (r * 100 + i) as i64;
    let k = 3;
    let mine: Vec<i64> = (0..k).map(|i| v(me, i)).collect();

    let mut x = mine.clone();
    h.all_reduce(&mut x[..], ReduceOp::Sum).unwrap();
    assert_eq!(
        x,
        (0..k)
            .map(|i| (0..n).map(|r| v(r, i)).sum())
            .collect::<Vec<i64>>()
    );

    let mut b = if me == 1 { mine.clone() } else { vec![0; k] };
    h.broadcast(&mut b[..], 1).unwrap();
    assert_eq!(b, (0..k).map(|i| v(1, i)).collect::<Vec<_>>());

    let mut out = vec![0i64; k];
    h.reduce(
        &mine[..],
        (me == 0).then_some(&mut out[..]),
        ReduceOp::Max,
        0,
    )
    .unwrap();
    if me == 0 {
        assert_eq!(out, (0..k).map(|i| v(n - 1, i)).collect::<Vec<_>>());
    }

    let all: Vec<i64> = (0..n).flat_map(|r| (0..k).map(move |i| v(r, i))).collect();
    let mut out = vec![0i64; k * n];
    h.all_gather(&mine[..], &mut out[..]).unwrap();
    assert_eq!(out, all);

    let big: Vec<i64> = (0..k * n).map(|i| v(me, i)).collect();
    let mut part = vec![0i64; k];
    h.reduce_scatter(&big[..], &mut part[..], ReduceOp::Sum)
        .unwrap();
    let want: Vec<i64> = (0..k)
        .map(|i| (0..n).map(|r| v(r, me * k + i)).sum())
        .collect();
    assert_eq!(part, want);

    let mut out = vec![0i64; k * n];
    h.all_to_all(&big[..], &mut out[..]).unwrap();
    let want: Vec<i64> = (0..n)
        .flat_map(|r| (0..k).map(move |i| v(r, me * k + i)))
        .collect();
    assert_eq!(out, want);

    // all_to_all_v: rank i sends i + j + 1 elements to rank j.
    let send: Vec<usize> = (0..n).map(|j| me + j + 1).collect();
    let recv: Vec<usize> = (0..n).map(|j| j + me + 1).collect();
    let input: Vec<i64> = (0..n)
        .flat_map(|j| (0..send[j]).map(move |i| (j * 10 + i) as i64))
        .collect();
    let mut out = vec![0i64; recv.iter().sum()];
    h.all_to_all_v(&input[..], &send, &mut out[..], &recv)
        .unwrap();
    let want: Vec<i64> = (0..n)
        .flat_map(|j| (0..recv[j]).map(move |i| (me * 10 + i) as i64))
        .collect();
    assert_eq!(out, want);

    let mut out = vec![0i64; k * n];
    h.gather(&mine[..], (me == n - 1).then_some(&mut out[..]), n - 1)
        .unwrap();
    if me == n - 1 {
        assert_eq!(out, all);
    }
    let mut got = vec![0i64; k];
    h.scatter((me == 0).then_some(&all[..]), &mut got[..], 0)
        .unwrap();
    assert_eq!(got, mine);

    // The uneven three: rank r's block has r elements (rank 0's is empty).
    let counts: Vec<usize> = (0..n).collect();
    let uneven_all: Vec<i64> = (0..n).flat_map(|r| (0..r).map(move |i| v(r, i))).collect();
    let mine_v: Vec<i64> = (0..me).map(|i| v(me, i)).collect();
    let mut out = vec![0i64; uneven_all.len()];
    h.all_gather_v(&mine_v[..], &mut out[..], &counts).unwrap();
    assert_eq!(out, uneven_all);
    let mut out = vec![0i64; uneven_all.len()];
    h.gather_v(&mine_v[..], (me == 1).then_some(&mut out[..]), &counts, 1)
        .unwrap();
    if me == 1 {
        assert_eq!(out, uneven_all);
    }
    let mut got = vec![0i64; me];
    h.scatter_v(
        (me == 1).then_some(&uneven_all[..]),
        &counts,
        &mut got[..],
        1,
    )
    .unwrap();
    assert_eq!(got, mine_v);

    // Typed messages around the ring.
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    h.send_to(&[me as f64 + 0.5; 4][..], right).unwrap();
    let mut inb = [0.0f64; 4];
    h.recv_from(&mut inb[..], left).unwrap();
    assert_eq!(inb, [left as f64 + 0.5; 4]);
}

/// A root that passes no output to reduce: an error naming it there, and an abort that ends
/// the other ranks' call, or their next (a rank that only sends in a reduce may finish it
/// first, as in every collective), at once rather than at their deadline. Before, the root
/// reduced into a copy and dropped the result without a word.
#[test]
fn a_reduce_root_without_output_fails_every_rank() {
    let errs = job(3, |h| {
        let t = std::time::Instant::now();
        let mut out = [0i32; 4];
        let out = (h.rank() != 1).then_some(&mut out[..]);
        let e = h
            .reduce(&[1i32; 4][..], out, ReduceOp::Sum, 1)
            .and_then(|()| h.all_reduce(&mut [1i32; 4][..], ReduceOp::Sum))
            .unwrap_err();
        (e.to_string(), t.elapsed())
    });
    assert!(
        errs[1].0.contains("rank 1: reduce(i32 x 4, sum, root 1)"),
        "{}",
        errs[1].0
    );
    assert!(
        errs[1].0.contains("the root must pass an output buffer"),
        "{}",
        errs[1].0
    );
    for (r, (e, took)) in errs.iter().enumerate() {
        assert!(
            e.contains("root must pass an output buffer"),
            "rank {r}: {e}"
        );
        assert!(*took < Duration::from_secs(10), "rank {r}: {took:?}");
    }
}

#[test]
fn every_collective_on_host_slices_goes_over_tcp() {
    for world in [2, 3] {
        job(world, |h| {
            assert!(h.nccl().is_none());
            every_collective(&h);
            h.barrier().unwrap();
        });
    }
}

/// A CUDA graph capture where the backend has no NCCL communicator: the error says so, and
/// the closure never runs.
#[test]
fn a_capture_without_nccl_is_refused() {
    job(1, |h| {
        let mut ran = false;
        let e = h
            .capture(|_| {
                ran = true;
                Ok(())
            })
            .unwrap_err();
        assert!(!ran, "the closure ran");
        assert!(
            matches!(e, dist_hybrid::HybridError::NoNccl { ref op, .. } if op == "capture"),
            "{e}"
        );
        assert!(e.to_string().contains("no NCCL communicator"), "{e}");
    });
}

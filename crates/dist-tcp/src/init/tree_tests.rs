//! The table's tree: its shape, the checks on a forwarded table, and a lazy formation whose
//! ranks get their table from their parents (over real sockets, ranks as threads).

use std::io::Write;
use std::net::TcpListener;
use std::time::Duration;

use super::*;
use crate::wire::{TABLE_HEAD_LEN, TableHead};

/// Every rank but 0 has one parent below it, is among its parent's children exactly once, and
/// is at most ⌈log₂ n⌉ hops from rank 0; rank 0's children are the powers of two.
#[test]
fn the_tree_spans_every_world_once() {
    for world in 1..=300usize {
        let mut seen = vec![0usize; world];
        for r in 0..world {
            for c in tree::children(r, world) {
                assert_eq!(tree::parent(c), r, "world {world}: child {c} of {r}");
                seen[c] += 1;
            }
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1..].iter().all(|n| *n == 1), "world {world}: {seen:?}");
        let depth_max = (world as f64).log2().ceil() as usize;
        for r in 1..world {
            let (mut at, mut hops) = (r, 0);
            while at != 0 {
                assert!(tree::parent(at) < at);
                at = tree::parent(at);
                hops += 1;
            }
            assert!(hops <= depth_max, "world {world}: rank {r} {hops} hops");
        }
        let roots: Vec<usize> = tree::children(0, world).collect();
        let powers: Vec<usize> = (0..usize::BITS)
            .map(|k| 1usize << k)
            .take_while(|p| *p < world)
            .collect();
        assert_eq!(roots, powers, "world {world}");
    }
}

/// A forwarded table must be whole, of rank 0's job, and list the parent where rank 0 said:
/// each failure says what it got and what it expected.
#[test]
fn a_forwarded_table_is_checked_against_rank_0() {
    let a: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:4001".parse().unwrap();
    let whole = |job_id| TableHead {
        job_id,
        world: 2,
        first: 0,
        count: 2,
    };
    assert_eq!(tree::check_forwarded(&whole(7), &[a, b], 1, b, 7), Ok(()));
    let e = tree::check_forwarded(&whole(8), &[a, b], 1, b, 7).unwrap_err();
    assert!(e.contains("job 0x8, not rank 0's job 0x7"), "{e}");
    let e = tree::check_forwarded(&whole(7), &[a, a], 1, b, 7).unwrap_err();
    assert!(
        e.contains(
            "lists rank 1 at Some(127.0.0.1:4000), where rank 0 says it listens at 127.0.0.1:4001"
        ),
        "{e}"
    );
    let part = TableHead {
        job_id: 7,
        world: 2,
        first: 1,
        count: 1,
    };
    let e = tree::check_forwarded(&part, &[b], 1, b, 7).unwrap_err();
    assert!(
        e.contains("ranks 1..2 of the table of 2, not the whole"),
        "{e}"
    );
}

/// A table whose head claims more ranks than the job has, or is cut short, is an error naming
/// the sizes, and nothing is allocated by the claim.
#[test]
fn reading_a_table_checks_what_the_head_claims() {
    let pair = || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let far = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (far, l.accept().unwrap().0)
    };
    let io = |e: std::io::Error| DistError::Io {
        rank: 3,
        context: "read the table".into(),
        source: e,
    };
    let bad = |reason: String| DistError::HandshakeRefused {
        rank: 3,
        peer: "rank 1".into(),
        reason,
    };
    let by = || Instant::now() + Duration::from_secs(10);
    let a: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let (mut far, mut near) = pair();
    far.write_all(&wire::encode_table_part(7, 1 << 30, 0, &[a]))
        .unwrap();
    let e = tree::read_table(&mut near, 4, by(), &io, &bad).unwrap_err();
    assert!(
        e.to_string()
            .contains("table has 1073741824 ranks, expected 4"),
        "{e}"
    );
    let (mut far, mut near) = pair();
    let mut cut = wire::encode_table(7, &[a, a]);
    cut.truncate(TABLE_HEAD_LEN + 20);
    far.write_all(&cut).unwrap();
    drop(far);
    let e = tree::read_table(&mut near, 2, by(), &io, &bad).unwrap_err();
    assert!(
        e.to_string()
            .contains("connection closed after 20 of 38 bytes"),
        "{e}"
    );
}

/// 70 ranks (as threads) form lazily: rank 0 sends the whole table to its children only and
/// the others get it down the tree; every rank ends up connected to rank 0 and its tree
/// neighbours, and a rank whose table came from its parent dials a rank it was never told
/// about by rank 0 (its address came down the tree) and gets through.
#[test]
fn the_table_comes_down_the_tree() {
    const N: usize = 70;
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let threads: Vec<_> = (0..N)
        .map(|r| {
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    let cfg = TcpConfig::new(r, N, format!("127.0.0.1:{port}"))
                        .init_timeout(Duration::from_secs(60))
                        .secret(b"a shared secret of 16+ bytes".to_vec());
                    let (tx, rx) = crossbeam_channel::unbounded();
                    let f = form_lazy(&cfg, Box::new(move |p, s| tx.send((p, s)).is_ok()))
                        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    (f, rx)
                })
                .unwrap()
        })
        .collect();
    let ranks: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (r, (f, rx)) in ranks.iter().enumerate() {
        let mut neighbours: Vec<usize> = tree::children(r, N).collect();
        if r != 0 && tree::parent(r) != 0 {
            neighbours.push(tree::parent(r));
        }
        if r == 0 {
            neighbours.clear(); // Rank 0's children are its rendezvous connections.
        }
        let mut got: Vec<usize> = (0..neighbours.len())
            .map(|_| rx.recv_timeout(Duration::from_secs(20)).unwrap().0)
            .collect();
        got.sort_unstable();
        neighbours.sort_unstable();
        assert_eq!(got, neighbours, "rank {r}");
        assert!(rx.try_recv().is_err(), "rank {r}: a spare connection");
        assert_eq!(f.mesh.same_host_ranks(), N, "rank {r}: the whole table");
    }
    // Rank 69's parent is 5 (69 = 64 + 5), and rank 0 told it only rank 5's listener; it
    // reaches rank 42, which is neither.
    let (f, _) = &ranks[69];
    let deadline = Instant::now() + Duration::from_secs(20);
    match f.mesh.dial(42, deadline).unwrap() {
        Dialed::Stream(_) => {}
        Dialed::Elsewhere => panic!("rank 42 did not dial"),
    }
    let (_, rx42) = &ranks[42];
    let (p, _) = rx42.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(p, 69);
}

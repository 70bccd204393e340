//! The job's store, as a backend gives it ([`TcpBackend::store`]) and as formation uses it:
//! user keys beside the collectives, under the job's prefix; formation through a store served
//! by others (`cargo xtask store`, torchrun's agent), twice in one process; any start order.

mod common;
use common::free_port;

use std::thread;
use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_store::{Store, StoreServer, TcpStore};
use dist_tcp::{Formation, TcpBackend, TcpConfig};

fn cfg(rank: usize, world: usize, port: u16) -> TcpConfig {
    TcpBackend::builder(rank, world, format!("127.0.0.1:{port}"))
        .init_timeout(Duration::from_secs(20))
        .timeout(Duration::from_secs(20))
        .linger(Duration::from_secs(5))
}

const WAIT: Duration = Duration::from_secs(10);

/// User code coordinates through `store()` beside the collectives: a counter every rank adds
/// to, a key one rank sets and the others wait for, a named barrier; the keys lie under the
/// job's prefix (`dist/0/user/`), as the connection without a prefix (`inner`) sees them.
#[test]
fn user_keys_beside_the_collectives() {
    let out = common::job_with(3, cfg, |b| {
        let (me, n) = (b.rank(), b.world_size());
        let store = b.store();
        assert_eq!(store.prefix(), "dist/0/user");
        let arrived = store.add("arrived", 1).unwrap();
        if me == 1 {
            store.set("leader", b"rank 1").unwrap();
        }
        assert_eq!(store.get("leader", WAIT).unwrap(), b"rank 1");
        store.barrier("after-leader", n, WAIT).unwrap();
        assert_eq!(store.add("arrived", 0).unwrap(), n as i64);
        let mut x = [me as u64 + 1];
        b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[0], 6);
        // The same key without the prefix, on the connection beneath.
        assert_eq!(
            store.inner().get("dist/0/user/leader", WAIT).unwrap(),
            b"rank 1"
        );
        b.barrier().unwrap();
        arrived
    });
    let mut arrivals = out;
    arrivals.sort();
    assert_eq!(arrivals, [1, 2, 3]);
}

/// A job of one rank has a store too (on a free loopback port, not the master address).
#[test]
fn a_world_of_one_has_a_store() {
    let b = TcpBackend::new(0, 1, "127.0.0.1:1").unwrap();
    b.store().set("k", b"v").unwrap();
    assert_eq!(b.store().get("k", WAIT).unwrap(), b"v");
}

/// With a store served by others (as `cargo xtask store` or torchrun's agent serve it), no
/// rank serves one, and the job forms through it; a second job of the same ranks in the same
/// process, through the same store under the same prefix, reads none of the first one's keys
/// (each formation's keys lie under a count of its own), eager and lazy alike.
#[test]
fn jobs_form_through_a_store_served_by_others() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    for (round, formation) in [Formation::Eager, Formation::Lazy, Formation::Eager]
        .into_iter()
        .enumerate()
    {
        let hs: Vec<_> = (0..4)
            .map(|r| {
                thread::spawn(move || {
                    let b = TcpBackend::with_config(
                        cfg(r, 4, port)
                            .serve_store(false)
                            .store_prefix("by-hand")
                            .formation(formation),
                    )
                    .unwrap_or_else(|e| panic!("round {round}, rank {r}: {e}"));
                    assert_eq!(b.store().prefix(), format!("by-hand/{round}/user"));
                    let mut x = [r as u32];
                    b.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    x[0]
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), 6);
        }
    }
    let c = TcpStore::connect(server.local_addr(), WAIT).unwrap();
    let keys = c.list_keys().unwrap();
    for round in 0..3 {
        let go = format!("by-hand/{round}/init/go");
        assert!(keys.contains(&go), "{go} not among {keys:?}");
    }
}

/// Without a store, a rank that serves none waits for it until its init deadline and says
/// whose store it was waiting for.
#[test]
fn no_store_served_fails_at_the_deadline_naming_it() {
    let port = free_port();
    let t = Instant::now();
    let e = TcpBackend::with_config(
        cfg(1, 2, port)
            .serve_store(false)
            .init_timeout(Duration::from_millis(500)),
    )
    .unwrap_err();
    assert!(
        matches!(&e, DistError::RendezvousFailed { rank: 1, .. })
            && e.to_string()
                .contains(&format!("no store at 127.0.0.1:{port}")),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A rank waiting for the table names every rank whose listener key is absent, rank 0
/// included, not only rank 0: the store tells.
#[test]
fn a_rank_that_times_out_names_the_absent_ranks() {
    let port = free_port();
    let root = thread::spawn(move || {
        TcpBackend::with_config(cfg(0, 4, port).init_timeout(Duration::from_secs(3)))
    });
    let e =
        TcpBackend::with_config(cfg(2, 4, port).init_timeout(Duration::from_secs(2))).unwrap_err();
    assert!(
        matches!(&e, DistError::RendezvousFailed { rank: 2, joined: 2, missing, .. } if missing == &vec![1, 3]),
        "{e}"
    );
    let e = root.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("missing ranks [1, 3]"), "{e}");
}

//! Revoke and recover (`TcpBackend::revoke`, `TcpBackend::recover`, `TcpConfig::elastic`): a
//! rank killed with SIGKILL in the middle of an all_reduce revokes the group on every survivor
//! (pending operations, a user-tag receive included, end with the epoch-named error); the
//! survivors agree on the next epoch through the store and complete a checked all_reduce on
//! it; a rank the others judge failed is left out and told so; two ranks that blame each
//! other still end in one group; a rank that dies during the recovery is left out of the
//! epoch after.
//!
//! A rank killed by a signal cannot be a process the launcher started (that is a failed
//! case): the victim's process starts a copy of this program that joins in its place, kills
//! itself (SIGKILL) mid-all_reduce, and passes once the copy has died of it.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp, Subgroups, Tag};
use dist_multirank::{Case, Variant, config};
use dist_tcp::TcpBackend;
use dist_tcp::dist_store::Store;

/// The cases, registered in `main.rs`.
pub const CASES: &[Case] = &[
    Case::new("elastic_revoke", revoke).only_at(&[4]),
    Case::new("elastic_shrink", shrink)
        .only_at(&[4, 8])
        .variants(&[LAZY]),
    Case::new("elastic_excluded", excluded).only_at(&[4]),
    Case::new("elastic_partition", partition).only_at(&[4]),
    Case::new("elastic_failure_in_recovery", failure_in_recovery).only_at(&[4]),
    Case::new("elastic_revoke_naming_none", revoke_naming_none).only_at(&[4]),
    Case::new("elastic_timeout", timeout).only_at(&[4]),
    Case::new("elastic_store_busy", store_busy).only_at(&[4]),
    Case::new("elastic_two_failures", two_failures).only_at(&[4]),
    Case::new("elastic_subgroup", subgroup).only_at(&[4]),
];

/// The job and every later epoch connected lazily (each pair on first use).
const LAZY: Variant = Variant {
    name: "lazy",
    sizes: &[8],
    env: &[("DIST_FORMATION", "lazy")],
};

/// The peer timeout these cases run with (also how long a recovery waits for check-ins).
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a recovery may take.
const RECOVER: Duration = Duration::from_secs(30);
/// Set in the environment of the copy that plays the victim.
const VICTIM: &str = "DIST_TEST_ELASTIC_VICTIM";
/// The all_reduces the victim completes before it kills itself.
const BEFORE: u64 = 20;
/// Floats per all_reduce: large enough that the kill lands inside one.
const COUNT: usize = 1 << 18;

fn join() -> TcpBackend {
    join_with(Duration::from_secs(30))
}

/// [`join`] with operations bounded by `timeout`.
fn join_with(timeout: Duration) -> TcpBackend {
    TcpBackend::with_config(
        config()
            .timeout(timeout)
            .peer_timeout(PEER_TIMEOUT)
            .elastic(true),
    )
    .unwrap_or_else(|e| panic!("init failed: {e}"))
}

/// A barrier, and then every rank says through the store that it has left it, and waits until
/// every rank has: a rank that revokes after this cannot fail another's barrier.
fn past_barrier(b: &TcpBackend) {
    let me = b.rank();
    b.barrier().unwrap();
    let store = b.store();
    store.set(&format!("test/past/{me}"), b"1").unwrap();
    let keys: Vec<String> = (0..b.world_size())
        .map(|r| format!("test/past/{r}"))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store
        .wait(&refs, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("rank {me}: the others past the barrier: {e}"));
}

/// Waits (at most 20 s) until the job ranks `ids` have checked in to the recovery into
/// `epoch` (their `here` keys, as `recover` writes them under `<job prefix>/elastic/<epoch>`).
fn wait_for_check_ins(b: &TcpBackend, epoch: u64, ids: &[usize]) {
    let keys: Vec<String> = ids.iter().map(|id| format!("here/{id}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    b.store_under(&format!("elastic/{epoch}"))
        .wait(&refs, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("rank {}: the others' check-ins: {e}", b.rank()));
}

/// Waits (at most 20 s) until an abort notice has come from each of `ranks`.
fn wait_for_notices(b: &TcpBackend, ranks: &[usize]) {
    let until = Instant::now() + Duration::from_secs(20);
    while !ranks
        .iter()
        .all(|&r| b.abort_notices().iter().any(|n| n.from == r))
    {
        assert!(
            Instant::now() < until,
            "rank {}: no notice from each of {ranks:?}: {:?}",
            b.rank(),
            b.abort_notices()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Recovers, and asserts that every rank of the job is a member of epoch 1, through a checked
/// all_reduce.
fn recover_all_four(b: TcpBackend) {
    let me = b.rank();
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    println!("rank {me}: epoch {}, members {:?}", b.epoch(), b.members());
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2, 3][..]));
    checked_all_reduce(&b);
    b.barrier().unwrap();
}

fn env_usize(k: &str) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{k} is not set"))
}

/// On the launcher's process of rank `victim`: runs a copy of this program in its place,
/// which must die of SIGKILL, and returns true (the case is then done here).
fn stand_aside(victim: usize) -> bool {
    if env_usize("RANK") != victim || std::env::var_os(VICTIM).is_some() {
        return false;
    }
    let status = Command::new(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env(VICTIM, "1")
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(9), "the victim ended with {status}");
    println!("victim (rank {victim}) ended by SIGKILL, as planned");
    true
}

/// Runs all_reduces of [`COUNT`] floats until one fails, and returns its error. The victim
/// (`me == victim`) kills itself with SIGKILL from another thread once it has completed
/// [`BEFORE`] of them: inside the next.
fn loop_until_failure(b: &TcpBackend, victim: usize) -> DistError {
    let me = b.rank();
    let done = Arc::new(AtomicU64::new(0));
    if me == victim {
        let done = done.clone();
        std::thread::spawn(move || {
            while done.load(Ordering::Acquire) < BEFORE {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_millis(1));
            let pid = std::process::id().to_string();
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        });
    }
    let mut x = vec![1.0f32; COUNT];
    let start = Instant::now();
    loop {
        x.fill(1.0);
        match b.all_reduce(&mut x, ReduceOp::Sum) {
            Ok(()) => {
                assert_eq!(x[0], b.world_size() as f32, "rank {me}: a wrong sum");
                done.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) => {
                assert!(me != victim, "the victim failed before its end: {e}");
                let k = done.load(Ordering::Acquire);
                assert!(k >= BEFORE, "rank {me}: failed after {k} all_reduces: {e}");
                return e;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "rank {me}: no failure after a minute"
        );
    }
}

/// Asserts that `e` is the revocation of epoch `epoch` naming rank `culprit`.
fn assert_revoked(me: usize, e: &DistError, epoch: u64, culprit: usize) {
    match e {
        DistError::Revoked {
            epoch: got,
            culprit: Some(c),
            ..
        } if *got == epoch && *c == culprit => {}
        other => panic!(
            "rank {me}: expected 'group epoch {epoch} revoked' naming rank {culprit}, got: {other}"
        ),
    }
    let text = e.to_string();
    let want = format!("group epoch {epoch} revoked: rank {culprit} failed");
    assert!(text.contains(&want), "rank {me}: no '{want}' in: {text}");
}

/// One all_reduce on `b` whose every rank adds its job rank + 1: the sum must be that of the
/// members.
fn checked_all_reduce(b: &TcpBackend) {
    let mine = (b.members()[b.rank()] + 1) as f64;
    let want: f64 = b.members().iter().map(|&m| (m + 1) as f64).sum();
    let mut x = vec![mine; 4096];
    b.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("rank {}: the new group's all_reduce: {e}", b.rank()));
    assert!(
        x.iter().all(|&v| v == want),
        "rank {}: sum {} where the members {:?} give {want}",
        b.rank(),
        x[0],
        b.members()
    );
}

/// SIGKILL of rank 3 mid-all_reduce: every survivor's all_reduce ends with "group epoch 0
/// revoked: rank 3 failed"; so does a receive on a user tag that rank 1 waits on (from rank
/// 2, which never sends, and keeps its connections open until then) on another thread, long
/// before its 30 s timeout; later operations fail at once with it; the revoked backend drops
/// without waiting.
pub fn revoke() -> Result<(), String> {
    let victim = 3;
    if stand_aside(victim) {
        return Ok(());
    }
    let b = join();
    let me = b.rank();
    b.barrier().unwrap();
    std::thread::scope(|s| {
        let pending = (me == 1).then(|| {
            s.spawn(|| {
                let mut buf = [0u8; 8];
                let t = Instant::now();
                let r = b.recv_tagged_timeout(&mut buf, 2, Tag::user(7), Duration::from_secs(30));
                (r, t.elapsed())
            })
        });
        let e = loop_until_failure(&b, victim);
        let at = Instant::now();
        println!("rank {me}: {e}");
        assert_revoked(me, &e, 0, victim);
        if let Some(h) = pending {
            let (r, took) = h.join().unwrap();
            let e = r.expect_err("the pending receive returned a message no one sent");
            println!("rank {me}: the pending receive, after {took:.2?}: {e}");
            assert_revoked(me, &e, 0, victim);
            let after = at.elapsed();
            assert!(
                after < Duration::from_secs(5),
                "the pending receive ended {after:?} after the all_reduce's error"
            );
        }
    });
    // Later operations fail at once, a send to a live peer and a barrier included.
    let t = Instant::now();
    let e = b
        .send_tagged(&[1], (me + 1) % victim, Tag::user(8))
        .unwrap_err();
    assert_revoked(me, &e, 0, victim);
    let e = b.barrier().unwrap_err();
    assert_revoked(me, &e, 0, victim);
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "later operations took {took:?}"
    );
    // Rank 2 stays (its connections open) until rank 1's pending receive has ended: a close
    // must not be what ends it.
    let store = b.store();
    if me == 1 {
        store.set("test/pending_ended", b"1").unwrap();
    } else {
        store
            .wait(&["test/pending_ended"], Duration::from_secs(40))
            .unwrap_or_else(|e| panic!("rank {me}: rank 1's pending receive: {e}"));
    }
    let t = Instant::now();
    drop(b);
    let took = t.elapsed();
    println!("rank {me}: the revoked backend dropped in {took:.2?}");
    assert!(took < Duration::from_secs(5), "the drop took {took:?}");
    Ok(())
}

/// SIGKILL of rank 1 mid-all_reduce: the survivors recover into epoch 1, the members being
/// every rank but 1 renumbered in order, and complete a checked all_reduce there (and a
/// barrier, and a second all_reduce).
pub fn shrink() -> Result<(), String> {
    let n = env_usize("WORLD_SIZE");
    let victim = 1;
    if stand_aside(victim) {
        return Ok(());
    }
    let b = join();
    let me = b.rank();
    b.barrier().unwrap();
    let e = loop_until_failure(&b, victim);
    assert_revoked(me, &e, 0, victim);
    let t = Instant::now();
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    let took = t.elapsed();
    let want: Vec<usize> = (0..n).filter(|&r| r != victim).collect();
    println!(
        "rank {me}: recovered in {took:.2?}: epoch {}, rank {} of {}, members {:?}",
        b.epoch(),
        b.rank(),
        b.world_size(),
        b.members()
    );
    assert_eq!(b.epoch(), 1);
    assert_eq!(b.members(), want.as_slice());
    assert_eq!(b.world_size(), n - 1);
    assert_eq!(b.members()[b.rank()], me, "renumbered out of order");
    checked_all_reduce(&b);
    b.barrier().unwrap();
    checked_all_reduce(&b);
    Ok(())
}

/// Rank 0 revokes the group blaming rank 2, which is alive; every other rank hears of it and
/// judges rank 2 failed. Rank 2 comes to the recovery only after the others have agreed
/// (it waits for their decision in the store), without it, and it is told it was left out
/// (`DistError::Excluded`, with the members); the others form epoch 1 of three ranks. Rank 0
/// (which serves the store) collects every rank's view and compares them.
pub fn excluded() -> Result<(), String> {
    let b = join();
    let me = b.rank();
    let store = b.store();
    past_barrier(&b);
    if me == 0 {
        b.revoke(Some(2), "rank 2 is too slow (the test says so)")
            .unwrap();
    } else {
        // The notice ends this wait (no one sends on this tag).
        let e = b
            .recv_tagged_timeout(&mut [0u8; 1], 0, Tag::user(9), Duration::from_secs(20))
            .unwrap_err();
        assert_revoked(me, &e, 0, 2);
    }
    if me == 2 {
        // Come to the recovery only once the others have agreed on epoch 1 (its members key,
        // under `<job prefix>/elastic/1`, as `recover` writes it): late by construction, not
        // by a guess at how long their agreement takes.
        use dist_tcp::dist_store::Store;
        b.store_under("elastic/1")
            .wait(&["members"], Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("rank 2: the others' agreement on epoch 1: {e}"));
    }
    match b.recover(RECOVER) {
        Err(DistError::Excluded {
            epoch: 1, members, ..
        }) if me == 2 => {
            assert_eq!(members, [0, 1, 3]);
            println!("rank 2: left out of epoch 1, as the others agreed: {members:?}");
            report(&store, me, &members);
        }
        Ok(b) if me != 2 => {
            assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 3][..]));
            checked_all_reduce(&b);
            report(&store, me, b.members());
            if me == 0 {
                compare_views(&store);
            }
            b.barrier().unwrap();
        }
        Ok(b) => panic!(
            "rank 2 was taken into epoch {} {:?}",
            b.epoch(),
            b.members()
        ),
        Err(e) => panic!("rank {me}: {e}"),
    }
    Ok(())
}

/// Ranks 1 and 2 blame each other at once (a partition between them, as each sees it); ranks
/// 0 and 3 hear of either or both. Whoever decides, exactly one group forms: every rank ends
/// with the same members (in the group, or told it was left out), at least one of ranks 1
/// and 2 is out, and the group's all_reduce is right. Rank 0 collects every rank's view
/// through the store and compares them.
pub fn partition() -> Result<(), String> {
    let b = join();
    let me = b.rank();
    let store = b.store();
    // A rank still in the barrier when another revokes fails it with the revocation.
    let left = b.barrier();
    match me {
        1 => b.revoke(Some(2), "rank 1 cannot reach rank 2").unwrap(),
        2 => b.revoke(Some(1), "rank 2 cannot reach rank 1").unwrap(),
        _ => {
            let e = match left {
                Err(e) => e,
                // The notice ends this wait (no one sends on this tag).
                Ok(()) => b
                    .recv_tagged_timeout(&mut [0u8; 1], 0, Tag::user(9), Duration::from_secs(20))
                    .unwrap_err(),
            };
            assert!(matches!(e, DistError::Revoked { epoch: 0, .. }), "{e}");
        }
    }
    let members = match b.recover(RECOVER) {
        Ok(b) => {
            assert_eq!(b.epoch(), 1);
            checked_all_reduce(&b);
            let m = b.members().to_vec();
            assert!(m.contains(&me));
            println!("rank {me}: in epoch 1 with {m:?}");
            report(&store, me, &m);
            if me == 0 {
                compare_views(&store);
            }
            b.barrier().unwrap();
            m
        }
        Err(DistError::Excluded {
            epoch: 1, members, ..
        }) => {
            assert!(!members.contains(&me));
            println!("rank {me}: left out of epoch 1, whose members are {members:?}");
            report(&store, me, &members);
            members
        }
        Err(e) => panic!("rank {me}: {e}"),
    };
    assert!(members.contains(&0), "rank 0 serves the store: {members:?}");
    assert!(
        !(members.contains(&1) && members.contains(&2)),
        "ranks 1 and 2 blamed each other, yet both are members: {members:?}"
    );
    Ok(())
}

/// Puts this rank's view of epoch 1's members in the store, for rank 0.
fn report(store: &impl Store, me: usize, members: &[usize]) {
    store
        .set(
            &format!("test/view/{me}"),
            format!("{members:?}").as_bytes(),
        )
        .unwrap_or_else(|e| panic!("rank {me}: {e}"));
}

/// On rank 0 (which serves the store, and so waits here until every rank has used it): every
/// rank's view must be the same.
fn compare_views(store: &impl Store) {
    let n = env_usize("WORLD_SIZE");
    let views: Vec<String> = (0..n)
        .map(|r| {
            let v = store
                .get(&format!("test/view/{r}"), Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("rank {r}'s view: {e}"));
            String::from_utf8_lossy(&v).into_owned()
        })
        .collect();
    println!("views of epoch 1's members, by rank: {views:?}");
    assert!(
        views.iter().all(|v| *v == views[0]),
        "two groups formed: {views:?}"
    );
}

/// SIGKILL of rank 3 mid-all_reduce; rank 2 then dies during the recovery itself, right
/// after its check-in (so that the agreement takes it into epoch 1, whose formation cannot
/// complete). Ranks 0 and 1 agree again and form epoch 2 of the two of them.
pub fn failure_in_recovery() -> Result<(), String> {
    let victim = 3;
    if stand_aside(victim) {
        return Ok(());
    }
    // A longer peer timeout than the others: epoch 2 waits that long for the check-ins of
    // ranks 0 and 1, which come after the failed formation of epoch 1 and a dismantle.
    let b = TcpBackend::with_config(
        config()
            .timeout(Duration::from_secs(30))
            .peer_timeout(Duration::from_secs(6))
            .elastic(true),
    )
    .unwrap_or_else(|e| panic!("init failed: {e}"));
    let me = b.rank();
    b.barrier().unwrap();
    let e = loop_until_failure(&b, victim);
    assert_revoked(me, &e, 0, victim);
    if me == 2 {
        dist_tcp::testing::die_in_recovery();
    }
    let t = Instant::now();
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    println!(
        "rank {me}: recovered in {:.2?}: epoch {}, members {:?}",
        t.elapsed(),
        b.epoch(),
        b.members()
    );
    assert_eq!((b.epoch(), b.members()), (2, &[0, 1][..]));
    checked_all_reduce(&b);
    Ok(())
}

/// Rank 1 revokes the group naming nobody at fault, while the others wait in a barrier; their
/// barriers fail with the revocation, which they pass on to each other. Rank 1 names no rank,
/// and nobody names rank 1: it comes to the recovery last (once the others have checked in),
/// and every rank is a member of epoch 1.
pub fn revoke_naming_none() -> Result<(), String> {
    let b = join();
    let me = b.rank();
    past_barrier(&b);
    if me == 1 {
        b.revoke(None, "the test revokes it naming nobody").unwrap();
        wait_for_check_ins(&b, 1, &[0, 2, 3]);
    } else {
        let e = b.barrier().unwrap_err();
        println!("rank {me}: {e}");
        match &e {
            DistError::Revoked {
                epoch: 0,
                culprit: None,
                ..
            } => {}
            other => panic!("rank {me}: expected the revocation naming nobody, got: {other}"),
        }
    }
    recover_all_four(b);
    Ok(())
}

/// Rank 1 stays out of a barrier; rank 2's operations are bounded by 2 s, the others' by 30 s:
/// rank 2's barrier times out, and ranks 0 and 3 fail theirs with rank 2's notice and pass it
/// on to each other. Rank 2 failed its own call and lives: nobody names it at fault. Once each
/// rank has the others' notices (rank 1: once the others checked in), all recover, and every
/// rank is a member of epoch 1.
pub fn timeout() -> Result<(), String> {
    let me = env_usize("RANK");
    let b = join_with(Duration::from_secs(if me == 2 { 2 } else { 30 }));
    past_barrier(&b);
    match me {
        1 => {
            wait_for_notices(&b, &[2]);
            wait_for_check_ins(&b, 1, &[0, 2, 3]);
        }
        2 => {
            let e = b.barrier().unwrap_err();
            println!("rank 2: {e}");
            assert!(matches!(e, DistError::Timeout { .. }), "rank 2: {e}");
            wait_for_notices(&b, &[0, 3]);
        }
        _ => {
            let e = b.barrier().unwrap_err();
            println!("rank {me}: {e}");
            assert!(
                matches!(
                    e,
                    DistError::Revoked {
                        epoch: 0,
                        culprit: None,
                        ..
                    }
                ),
                "rank {me}: {e}"
            );
            wait_for_notices(&b, &[2, 3 - me]);
        }
    }
    recover_all_four(b);
    Ok(())
}

/// A thread of rank 0 waits on the job's store, for a key set only after the recovery, while
/// rank 0 recovers (rank 1 revoked the group): the recovery agrees over a connection of its
/// own, not behind that wait (which holds the backend's connection), and every rank is a
/// member of epoch 1. The waiter then ends with the key.
pub fn store_busy() -> Result<(), String> {
    let b = join();
    let me = b.rank();
    past_barrier(&b);
    let waiter = (me == 0).then(|| {
        let store = b.store();
        std::thread::spawn(move || store.wait(&["test/recovered"], Duration::from_secs(60)))
    });
    if me == 0 {
        // Long enough for the waiter to be in its wait (the case checks the recovery, and
        // passes either way only if rank 0 is in epoch 1 before the key is set).
        std::thread::sleep(Duration::from_millis(300));
    }
    if me == 1 {
        b.revoke(None, "the test revokes it").unwrap();
    } else {
        let e = b
            .recv_tagged_timeout(&mut [0u8; 1], 1, Tag::user(9), Duration::from_secs(20))
            .unwrap_err();
        assert!(matches!(e, DistError::Revoked { epoch: 0, .. }), "{e}");
    }
    let t = Instant::now();
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    println!(
        "rank {me}: recovered in {:.2?}: members {:?}",
        t.elapsed(),
        b.members()
    );
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2, 3][..]));
    checked_all_reduce(&b);
    if me == 1 {
        b.store().set("test/recovered", b"1").unwrap();
    }
    if let Some(w) = waiter {
        w.join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank 0's waiter: {e}"));
    }
    b.barrier().unwrap();
    Ok(())
}

/// Two failures, one after the other: SIGKILL of rank 3 mid-all_reduce, recovery into epoch 1
/// (ranks 0, 1, 2), then SIGKILL of rank 2 mid-all_reduce there, recovery into epoch 2 (ranks
/// 0 and 1). After each, a checked all_reduce; after the second, the store answers a set and
/// a get made after a wait longer than the second formation took, with operations bounded by
/// the job's timeout (30 s), not by what was left of a formation.
pub fn two_failures() -> Result<(), String> {
    let me = env_usize("RANK");
    if stand_aside(3) || stand_aside(2) {
        return Ok(());
    }
    let b = join();
    past_barrier(&b);
    let e = loop_until_failure(&b, 3);
    assert_revoked(me, &e, 0, 3);
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: the first recovery: {e}"));
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2][..]));
    checked_all_reduce(&b);
    b.barrier().unwrap();
    let e = loop_until_failure(&b, 2);
    assert_revoked(me, &e, 1, 2);
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: the second recovery: {e}"));
    println!("rank {me}: epoch {}, members {:?}", b.epoch(), b.members());
    assert_eq!((b.epoch(), b.members()), (2, &[0, 1][..]));
    checked_all_reduce(&b);
    let store = b.store();
    assert_eq!(store.inner().timeout(), Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(500));
    store.set(&format!("test/after/{me}"), b"1").unwrap();
    let other = 1 - me;
    store
        .get(&format!("test/after/{other}"), Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("rank {me}: the store after two recoveries: {e}"));
    b.barrier().unwrap();
    Ok(())
}

/// SIGKILL of rank 3 in the middle of an all_reduce of a sub-group of every rank in reverse
/// order (group rank `3 - r` is backend rank `r`): the sub-group's error is the revocation of
/// epoch 0 naming backend rank 3 (a failure first seen in a sub-group revokes the backend),
/// and so is every later call, on the sub-group and on the backend; the survivors recover.
pub fn subgroup() -> Result<(), String> {
    let victim = 3;
    if stand_aside(victim) {
        return Ok(());
    }
    let b = join();
    let me = b.rank();
    let g = b
        .split(Some(0), -(me as i64))
        .unwrap_or_else(|e| panic!("rank {me}: split: {e}"))
        .expect("every rank is in the group");
    assert_eq!(g.rank(), 3 - me);
    past_barrier(&b);
    let done = Arc::new(AtomicU64::new(0));
    if me == victim {
        let done = done.clone();
        std::thread::spawn(move || {
            while done.load(Ordering::Acquire) < BEFORE {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_millis(1));
            let pid = std::process::id().to_string();
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        });
    }
    let mut x = vec![1.0f32; COUNT];
    let e = loop {
        x.fill(1.0);
        match g.all_reduce(&mut x, ReduceOp::Sum) {
            Ok(()) => {
                done.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) => break e,
        }
    };
    assert!(me != victim, "the victim failed before its end: {e}");
    println!("rank {me}: the sub-group's all_reduce: {e}");
    assert_revoked(me, &e, 0, victim);
    let e = g.barrier().unwrap_err();
    assert_revoked(me, &e, 0, victim);
    drop(g);
    let b = b
        .recover(RECOVER)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2][..]));
    checked_all_reduce(&b);
    Ok(())
}

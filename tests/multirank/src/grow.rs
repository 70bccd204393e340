//! Growing an elastic job (`TcpBackend::join`, `TcpBackend::admit`, `TcpConfig::admission`):
//! a joiner is taken in at the members' next `admit` and ends last in the next epoch, having
//! received the members' state by a broadcast; two joiners wait for a policy's minimum and
//! come in together; a joiner waits for a recovery where the policy says so; a joiner of
//! another job, or with another secret, is refused with an error that says so; a joiner no
//! member takes in withdraws at its deadline, and the members do not take it in after.
//!
//! `grow_admit` runs again with every pair connected lazily. A joiner is a process the
//! launcher did not start: rank 0 starts copies of this program
//! with `DIST_TEST_JOINER` set, which join the running job (the launcher's environment gives
//! them the master address), and checks that they exit 0.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dist_core::collectives::Collectives;
use dist_core::{Backend, DistError, ReduceOp, Tag};
use dist_multirank::{Case, Variant, config};
use dist_tcp::dist_store::Store;
use dist_tcp::{Admission, TcpBackend, TcpConfig};

/// The cases, registered in `main.rs`.
pub const CASES: &[Case] = &[
    Case::new("grow_admit", admit)
        .only_at(&[3])
        .variants(&[LAZY]),
    Case::new("grow_two_joiners", two_joiners).only_at(&[3]),
    Case::new("grow_at_recovery", at_recovery).only_at(&[3]),
    Case::new("grow_refused", refused).only_at(&[3]),
    Case::new("grow_timeout", timeout).only_at(&[3]),
    Case::new("grow_beside_a_wait", beside_a_wait).only_at(&[3]),
    Case::new("grow_counter_raised", counter_raised).only_at(&[3]),
    Case::new("grow_recover_members", recover_members).only_at(&[3]),
];

/// The job, the joiner and every later epoch connected lazily (each pair on first use).
const LAZY: Variant = Variant {
    name: "lazy",
    sizes: &[3],
    env: &[("DIST_FORMATION", "lazy")],
};

/// Set (to the joiner's role) in the environment of the copies that join.
const JOINER: &str = "DIST_TEST_JOINER";
/// The peer timeout of every process of these cases.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a join, an admit or a recovery may take.
const LONG: Duration = Duration::from_secs(30);
/// The secret of the job of `grow_refused`.
const SECRET: &[u8] = b"the job's own secret, 32 bytes..";
/// The state the members hand the joiners.
const STATE: [f64; 4] = [1.5, -2.0, 3.25, 42.0];

/// This process's role as a joiner, if it is one.
fn role() -> Option<String> {
    std::env::var(JOINER).ok()
}

fn member_config(policy: Admission) -> TcpConfig {
    config()
        .timeout(LONG)
        .peer_timeout(PEER_TIMEOUT)
        .elastic(true)
        .admission(policy)
}

fn member(policy: Admission) -> TcpBackend {
    TcpBackend::with_config(member_config(policy)).unwrap_or_else(|e| panic!("init failed: {e}"))
}

/// Starts a joiner: a copy of this program in role `role`.
fn start_joiner(role: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(std::env::args().skip(1))
        .env(JOINER, role)
        .spawn()
        .unwrap_or_else(|e| panic!("starting joiner {role}: {e}"))
}

/// Waits for a joiner started by [`start_joiner`]; it must exit 0.
fn reap(mut c: Child, role: &str) {
    let status = c.wait().unwrap();
    assert!(status.success(), "joiner {role} ended with {status}");
    println!("joiner {role} passed");
}

/// Waits (at most 20 s) for the store key `key` under `<job prefix>/elastic`.
fn wait_elastic_key(b: &TcpBackend, key: &str) -> Vec<u8> {
    b.store_under("elastic")
        .get(key, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("rank {}: waiting for {key}: {e}", b.rank()))
}

/// One all_reduce whose every rank adds its job rank + 1: the sum must be that of the members.
fn checked_all_reduce(b: &TcpBackend) {
    let mine = (b.members()[b.rank()] + 1) as f64;
    let want: f64 = b.members().iter().map(|&m| (m + 1) as f64).sum();
    let mut x = vec![mine; 4096];
    b.all_reduce(&mut x, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("rank {}: all_reduce: {e}", b.rank()));
    assert!(
        x.iter().all(|&v| v == want),
        "rank {}: sum {} where the members {:?} give {want}",
        b.rank(),
        x[0],
        b.members()
    );
}

/// The state handed on: rank 0 has it, every other rank (joiners included) receives it.
fn hand_state(b: &TcpBackend) {
    let mut s = if b.rank() == 0 { STATE } else { [0.0; 4] };
    b.broadcast(&mut s, 0)
        .unwrap_or_else(|e| panic!("rank {}: the state's broadcast: {e}", b.rank()));
    assert_eq!(s, STATE, "rank {}: the state received", b.rank());
}

/// Members: `admit` between steps (a checked all_reduce each) until the epoch changes, at
/// most 30 s.
fn steps_until_grown(mut b: TcpBackend) -> TcpBackend {
    let start = Instant::now();
    let epoch = b.epoch();
    while b.epoch() == epoch {
        checked_all_reduce(&b);
        b = b.admit(LONG).unwrap_or_else(|e| panic!("admit: {e}"));
        assert!(start.elapsed() < LONG, "no joiner taken in after {LONG:?}");
    }
    b
}

/// A joiner: joins, and checks that it landed in epoch `epoch` with `members`.
fn joiner(policy: Admission, epoch: u64, members: &[usize]) -> TcpBackend {
    let t = Instant::now();
    let b = TcpBackend::join(member_config(policy), LONG)
        .unwrap_or_else(|e| panic!("joiner: join: {e}"));
    println!(
        "joiner: taken in after {:.2?}: epoch {}, rank {} of {}, members {:?}",
        t.elapsed(),
        b.epoch(),
        b.rank(),
        b.world_size(),
        b.members()
    );
    assert_eq!((b.epoch(), b.members()), (epoch, members));
    b
}

/// One joiner, taken in at the members' next `admit` (the default policy): epoch 1, job rank
/// 3, last; it receives the state by broadcast before its first all_reduce, and the group of
/// four runs a checked all_reduce and a barrier.
pub fn admit() -> Result<(), String> {
    if role().is_some() {
        let b = joiner(Admission::AtAdmit, 1, &[0, 1, 2, 3]);
        assert_eq!(b.rank(), 3);
        hand_state(&b);
        checked_all_reduce(&b);
        b.barrier().unwrap();
        return Ok(());
    }
    let b = member(Admission::AtAdmit);
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("one"));
    let b = steps_until_grown(b);
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2, 3][..]));
    assert_eq!(b.rank(), me, "a member renumbered");
    hand_state(&b);
    checked_all_reduce(&b);
    b.barrier().unwrap();
    if let Some(c) = child {
        reap(c, "one");
    }
    Ok(())
}

/// Policy "at least two": the first joiner registers and the members' `admit` calls leave it
/// waiting (epoch 0 after several, once its ticket is in the store); a second joiner comes,
/// and the next `admit` takes both in: epoch 1, job ranks 3 and 4 last, in order.
pub fn two_joiners() -> Result<(), String> {
    let policy = Admission::AtLeast(2);
    if let Some(r) = role() {
        let b = joiner(policy, 1, &[0, 1, 2, 3, 4]);
        let want = if r == "first" { 3 } else { 4 };
        assert_eq!(b.members()[b.rank()], want, "joiner {r}");
        hand_state(&b);
        checked_all_reduce(&b);
        b.barrier().unwrap();
        return Ok(());
    }
    let mut b = member(policy);
    let me = b.rank();
    let first = (me == 0).then(|| start_joiner("first"));
    // Every member waits for the first joiner's ticket, then admits five times: one waiting
    // is short of the policy's two.
    wait_elastic_key(&b, "join/3");
    for _ in 0..5 {
        checked_all_reduce(&b);
        b = b
            .admit(LONG)
            .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
        assert_eq!(b.epoch(), 0, "rank {me}: taken in with one joiner waiting");
    }
    b.barrier().unwrap();
    let second = (me == 0).then(|| start_joiner("second"));
    let b = steps_until_grown(b);
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2, 3, 4][..]));
    hand_state(&b);
    checked_all_reduce(&b);
    b.barrier().unwrap();
    if let (Some(f), Some(s)) = (first, second) {
        reap(f, "first");
        reap(s, "second");
    }
    Ok(())
}

/// Policy "at recovery": a joiner waits through the members' `admit` calls (epoch 0), then
/// rank 1 revokes the group naming nobody, every member recovers, and the recovery takes the
/// joiner in: epoch 1, members 0, 1, 2 and 3.
pub fn at_recovery() -> Result<(), String> {
    let policy = Admission::AtRecovery;
    if role().is_some() {
        let b = joiner(policy, 1, &[0, 1, 2, 3]);
        hand_state(&b);
        checked_all_reduce(&b);
        return Ok(());
    }
    let mut b = member(policy);
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("one"));
    wait_elastic_key(&b, "join/3");
    for _ in 0..3 {
        checked_all_reduce(&b);
        b = b
            .admit(LONG)
            .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
        assert_eq!(
            b.epoch(),
            0,
            "rank {me}: taken in at admit under 'at recovery'"
        );
    }
    // Every rank past the last all_reduce before rank 1 revokes (as elastic.rs's cases).
    b.barrier().unwrap();
    let store = b.store();
    store.set(&format!("test/past/{me}"), b"1").unwrap();
    store
        .wait(&["test/past/0", "test/past/1", "test/past/2"], LONG)
        .unwrap();
    if me == 1 {
        b.revoke(None, "the test revokes it").unwrap();
    } else {
        let e = b
            .recv_tagged_timeout(&mut [0u8; 1], 1, Tag::user(9), Duration::from_secs(20))
            .unwrap_err();
        assert!(matches!(e, DistError::Revoked { epoch: 0, .. }), "{e}");
    }
    let b = b
        .recover(LONG)
        .unwrap_or_else(|e| panic!("rank {me}: recover: {e}"));
    assert_eq!((b.epoch(), b.members()), (1, &[0, 1, 2, 3][..]));
    hand_state(&b);
    checked_all_reduce(&b);
    if let Some(c) = child {
        reap(c, "one");
    }
    Ok(())
}

/// A joiner under another store prefix (no such job) fails at once saying so; one with
/// another secret is refused by rank 0's look at `admit`, and its error says the secret is
/// wrong; the members stay at epoch 0, three of them, and its verdict in the store says why.
pub fn refused() -> Result<(), String> {
    if role().is_some() {
        let t = Instant::now();
        let e = TcpBackend::join(
            member_config(Admission::AtAdmit).store_prefix("no-such-job"),
            LONG,
        )
        .expect_err("joined a job that is not there");
        println!("joiner of another job: {e}");
        let text = e.to_string();
        assert!(
            text.contains("no elastic job under prefix no-such-job/0"),
            "{text}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "took {:?}",
            t.elapsed()
        );
        let cfg =
            member_config(Admission::AtAdmit).secret(b"another secret, also 32 bytes...".to_vec());
        let e = TcpBackend::join(cfg, LONG).expect_err("a wrong secret joined");
        println!("joiner with another secret: {e}");
        assert!(
            matches!(&e, DistError::HandshakeRefused { rank: 3, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("wrong shared secret"), "{e}");
        return Ok(());
    }
    let mut b = TcpBackend::with_config(member_config(Admission::AtAdmit).secret(SECRET.to_vec()))
        .unwrap_or_else(|e| panic!("init failed: {e}"));
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("refused"));
    wait_elastic_key(&b, "join/3");
    // Admit until the verdict is in (rank 0's first look after the ticket refuses it).
    let verdict = loop {
        checked_all_reduce(&b);
        b = b
            .admit(LONG)
            .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
        assert_eq!((b.epoch(), b.world_size()), (0, 3), "rank {me}: grew");
        let s = b.store_under("elastic");
        if s.check(&["join/3/verdict"]).unwrap() {
            break s.get("join/3/verdict", LONG).unwrap();
        }
    };
    let verdict = String::from_utf8_lossy(&verdict).into_owned();
    assert!(
        verdict.starts_with("refused: wrong shared secret"),
        "{verdict}"
    );
    b.barrier().unwrap();
    if let Some(c) = child {
        reap(c, "refused");
    }
    Ok(())
}

/// Rank 0's look for joiners at `admit` does not wait behind a user's wait on the store: a
/// thread of rank 0 waits 20 s in `store().get` for a key nobody sets while every member calls
/// `admit` with 2 s, a joiner waiting; the joiner is taken in (epoch 1) within 8 s.
pub fn beside_a_wait() -> Result<(), String> {
    if role().is_some() {
        let b = joiner(Admission::AtAdmit, 1, &[0, 1, 2, 3]);
        hand_state(&b);
        checked_all_reduce(&b);
        return Ok(());
    }
    let b = member(Admission::AtAdmit);
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("one"));
    wait_elastic_key(&b, "join/3");
    if me == 0 {
        let user = b.store();
        std::thread::spawn(move || {
            let _ = user.get("absent", Duration::from_secs(20));
        });
        // The user's get is under way (holding the connection) before the admit.
        std::thread::sleep(Duration::from_millis(300));
    }
    b.barrier().unwrap();
    let t = Instant::now();
    let b = b
        .admit(Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
    let took = t.elapsed();
    println!("rank {me}: admit took {took:.2?}, epoch {}", b.epoch());
    assert_eq!(
        (b.epoch(), b.members()),
        (1, &[0, 1, 2, 3][..]),
        "rank {me}: the joiner was not taken in"
    );
    assert!(
        took < Duration::from_secs(8),
        "rank {me}: admit took {took:?}"
    );
    hand_state(&b);
    checked_all_reduce(&b);
    if let Some(c) = child {
        reap(c, "one");
    }
    Ok(())
}

/// A count of joiners raised to 2^40 by hand (the store takes anyone's `add`): the look for
/// joiners reads a bounded number of ids, so `admit(1s)` returns within 6 s, taking no one in.
pub fn counter_raised() -> Result<(), String> {
    let b = member(Admission::AtAdmit);
    let me = b.rank();
    if me == 0 {
        b.store_under("elastic")
            .add("joiners", 1 << 40)
            .map_err(|e| format!("raise the count: {e}"))?;
    }
    b.barrier().unwrap();
    let t = Instant::now();
    let b = b
        .admit(Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
    let took = t.elapsed();
    println!("rank {me}: admit took {took:.2?}");
    assert!(
        took < Duration::from_secs(6),
        "rank {me}: admit took {took:?}"
    );
    assert_eq!((b.epoch(), b.world_size()), (0, 3), "rank {me}");
    checked_all_reduce(&b);
    Ok(())
}

/// `recover_members` takes no joiner in under the default policy: a joiner waits while the
/// members recover (epoch 1, the same three), its verdict still unset after, and it withdraws
/// at its own deadline (5 s) with a timeout.
pub fn recover_members() -> Result<(), String> {
    if role().is_some() {
        let e = TcpBackend::join(member_config(Admission::AtAdmit), Duration::from_secs(5))
            .expect_err("taken in by recover_members");
        println!("joiner: {e}");
        assert!(matches!(&e, DistError::Timeout { rank: 3, .. }), "{e}");
        return Ok(());
    }
    let b = member(Admission::AtAdmit);
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("left"));
    wait_elastic_key(&b, "join/3");
    let b = b
        .recover_members(LONG)
        .unwrap_or_else(|e| panic!("rank {me}: recover_members: {e}"));
    assert_eq!(
        (b.epoch(), b.members()),
        (1, &[0, 1, 2][..]),
        "rank {me}: recover_members took in a joiner"
    );
    let there = b
        .store_under("elastic")
        .check(&["join/3/verdict"])
        .map_err(|e| format!("check the verdict: {e}"))?;
    assert!(
        !there,
        "rank {me}: the joiner has a verdict after recover_members"
    );
    checked_all_reduce(&b);
    b.barrier().unwrap();
    let verdict = wait_elastic_key(&b, "join/3/verdict");
    assert_eq!(verdict, b"withdrawn");
    if let Some(c) = child {
        reap(c, "left");
    }
    Ok(())
}

/// A joiner that no member takes in (they do not call `admit` until it is gone) fails at its
/// deadline (3 s) with a timeout that names the last epoch formed and says nobody took it in;
/// it withdrew, so the members' `admit` after does not take it in.
pub fn timeout() -> Result<(), String> {
    if role().is_some() {
        let t = Instant::now();
        let e = TcpBackend::join(member_config(Admission::AtAdmit), Duration::from_secs(3))
            .expect_err("joined with no member admitting");
        let took = t.elapsed();
        println!("joiner, after {took:.2?}: {e}");
        assert!(matches!(&e, DistError::Timeout { rank: 3, .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("no member took it in"), "{text}");
        assert!(
            text.contains("the last epoch formed is 0, members 0,1,2"),
            "{text}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
        return Ok(());
    }
    let b = member(Admission::AtAdmit);
    let me = b.rank();
    let child = (me == 0).then(|| start_joiner("late"));
    let verdict = wait_elastic_key(&b, "join/3/verdict");
    assert_eq!(verdict, b"withdrawn");
    let b = b
        .admit(LONG)
        .unwrap_or_else(|e| panic!("rank {me}: admit: {e}"));
    assert_eq!(
        (b.epoch(), b.world_size()),
        (0, 3),
        "rank {me}: took in a joiner that withdrew"
    );
    checked_all_reduce(&b);
    if let Some(c) = child {
        reap(c, "late");
    }
    Ok(())
}

//! all_reduce on the host arena: results checked at every world size from
//! 2 to 8 at counts around the small areas' limit, the split threshold and the slot's pieces,
//! and in calls whose sizes alternate across them, with the group on the
//! arena exactly when shared memory is on; a job of several hosts (simulated by
//! `DIST_HOST_ID`) on the hierarchical all_reduce; barrier, broadcast, reduce and all_gather
//! interleaved with all_reduces (on the small areas where every rank shares the host); and
//! after a mismatch, an error on every rank rather than a hang.

use dist_core::collectives::{
    Collectives, HOST_DIRECT_MIN, HOST_SMALL_MAX, Kind, Transport, collective_path, host_split_min,
};
use dist_core::transport::Link;
use dist_core::{Backend, DistError, ReduceOp};
use dist_multirank::{Case, DIRECT, Variant, config};
use dist_tcp::TcpBackend;

/// The cases, registered in `main.rs`.
pub const CASES: &[Case] = &[
    Case::new("shm_arena", arena)
        .sizes(&[2, 3, 4, 5, 6, 7, 8])
        .variants(&[NO_SHM, EVERY_SIZE, DIRECT, THREADS]),
    Case::new("shm_arena_hosts", several_hosts)
        .sizes(&[4, 5])
        .variants(&[EVERY_SIZE]),
    Case::new("shm_arena_mismatch", mismatch).sizes(&[3]),
    Case::new("shm_arena_sigkill", sigkill)
        .only_at(&[4])
        .variants(&[THREADS]),
];

/// Rank 3 killed with SIGKILL in the middle of a loop of 512 KiB all_reduces on the arena
/// (each split into shares, and in the `threads3` variant over each rank's threads; 512 KiB
/// is under the arena's limit on any host, so the loop stays on the arena): every survivor
/// errors within 1 s of its last good one, naming rank 3.
fn sigkill() -> Result<(), String> {
    crate::failures::victim_loop_of("KILL", std::time::Duration::from_secs(1), 128 << 10)
}

const NO_SHM: Variant = Variant {
    name: "shm0",
    sizes: &[3],
    env: &[("DIST_SHM", "0")],
};

/// The arena for every size (the default on hosts with 8 ranks or more and a core each, or
/// two cores or more each), so that buffers of several pieces run on it here too.
const EVERY_SIZE: Variant = Variant {
    name: "every_size",
    sizes: &[3, 5],
    env: &[("DIST_ARENA_MAX_KB", "1048576")],
};

/// The arena for every size, each rank's part of a piece split over three threads (the
/// default where each rank has three cores or more), whatever the machine's cores.
const THREADS: Variant = Variant {
    name: "threads3",
    sizes: &[4],
    env: &[
        ("DIST_ARENA_MAX_KB", "1048576"),
        ("DIST_ARENA_THREADS", "3"),
    ],
};

/// The arena's slot (one piece): the backend's, or 1 MiB without an arena.
fn slot(b: &TcpBackend) -> usize {
    b.group().link().arena().map_or(1 << 20, |a| a.slot_len())
}

fn shm_on() -> bool {
    std::env::var("DIST_SHM").map_or(true, |v| v != "0")
}

/// Rank `r`'s element `i`: small integers, exact in f32 in any order.
fn value(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32
}

/// all_reduce (sum, max; f32, and i64 out of place) at counts around the thresholds, every
/// element checked; reading directly (the `direct` variant), also shares of more than a slot,
/// which pass their results through the slots in several rounds.
fn check_sizes(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    let per = slot(b) / 4;
    let local = b.group().link().arena().map_or(n, |a| a.local().len());
    let split = host_split_min(local) / 4;
    let small = HOST_SMALL_MAX / 4;
    let mut counts = vec![
        1,
        2,
        7,
        small - 1,
        small,
        small + 1,
        split - 1,
        split,
        split + 1,
        per - 1,
        per,
        per + 1,
        2 * per + 5,
    ];
    if std::env::var("DIST_DIRECT").as_deref() == Ok("1") {
        counts.push(n * per + n);
    }
    for count in counts {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let mut x: Vec<f32> = (0..count).map(|i| value(me, i)).collect();
            b.all_reduce(&mut x, op).unwrap_or_else(|e| panic!("{e}"));
            for (i, got) in x.iter().enumerate() {
                let all = (0..n).map(|r| value(r, i));
                let want = match op {
                    ReduceOp::Sum => all.sum::<f32>(),
                    _ => all.fold(f32::MIN, f32::max),
                };
                assert_eq!(*got, want, "rank {me}: {op:?} of {count}: element {i}");
            }
        }
        let input: Vec<i64> = (0..count).map(|i| (me * count + i) as i64).collect();
        let mut out = vec![0i64; count];
        b.all_reduce_into(&input, &mut out, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
        for (i, got) in out.iter().enumerate() {
            let want: i64 = (0..n).map(|r| (r * count + i) as i64).sum();
            assert_eq!(*got, want, "rank {me}: i64 sum of {count}: element {i}");
        }
    }
}

/// The group's arena limit is the one `DIST_ARENA_MAX_KB` asks for, where it is set (the
/// `every_size` variant: else its sizes would not reach the arena past the default limit).
fn check_limit(b: &TcpBackend) {
    if let Ok(kb) = std::env::var("DIST_ARENA_MAX_KB") {
        let kb: u32 = kb.parse().expect("DIST_ARENA_MAX_KB is a number");
        assert_eq!(b.group().tuning().arena_max_kb, kb, "rank {}", b.rank());
    }
}

/// With `DIST_ARENA_THREADS` (the `threads3` variant), the arena splits each rank's part
/// over that many threads.
fn check_threads(b: &TcpBackend) {
    let Ok(t) = std::env::var("DIST_ARENA_THREADS") else {
        return;
    };
    let t: usize = t.parse().expect("DIST_ARENA_THREADS is a number");
    let arena = b.group().link().arena();
    assert_eq!(arena.map(|a| a.threads()), Some(t), "rank {}", b.rank());
}

/// With `DIST_DIRECT=1` (the `direct` variant), the group reads its peers' buffers directly
/// from the size `DIST_DIRECT_MIN_KB` asks for, where no Yama ptrace policy stands in the way.
/// With one, whether the reads are allowed depends on the process's capabilities, so the claim
/// is not checked: the reason for the case to say it was skipped (after its other checks).
fn check_direct(b: &TcpBackend) -> Option<String> {
    if std::env::var("DIST_DIRECT").as_deref() != Ok("1") || !shm_on() {
        return None;
    }
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
    if let Some(v) = yama.as_deref().ok().map(str::trim).filter(|v| *v != "0") {
        return Some(format!(
            "direct reads not checked: Yama ptrace_scope is {v}, not 0 (whether this process \
             may read its peers' memory then depends on its capabilities)"
        ));
    }
    let min = std::env::var("DIST_DIRECT_MIN_KB").map_or(HOST_DIRECT_MIN, |v| {
        v.parse::<usize>().expect("DIST_DIRECT_MIN_KB is a number") << 10
    });
    assert_eq!(
        b.group().arena_direct_min(),
        Some(min),
        "rank {}: direct reads",
        b.rank()
    );
    None
}

/// Back-to-back all_reduces whose sizes alternate across the small areas' limit and the split
/// (each rank's inputs new every call, so that bytes read from an area or slot its owner had
/// already written again would show), every element checked.
fn check_alternating(b: &TcpBackend) {
    let (me, n) = (b.rank(), b.world_size());
    let small = HOST_SMALL_MAX / 4;
    let counts = [2, small + 1, 9, small, host_split_min(n) / 4 + 3, 1, 0, 5];
    for round in 0..200usize {
        let count = counts[round % counts.len()];
        let value = |r: usize, i: usize| ((r + 1) * 1000 + round * 7 + i) as u32;
        let mut x: Vec<u32> = (0..count).map(|i| value(me, i)).collect();
        b.all_reduce(&mut x, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{e}"));
        for (i, got) in x.iter().enumerate() {
            let want: u32 = (0..n).map(|r| value(r, i)).sum();
            assert_eq!(
                *got, want,
                "rank {me}: round {round}, {count} u32: element {i}"
            );
        }
    }
}

/// barrier, broadcast, reduce and all_gather, around the small areas' limit, interleaved with
/// all_reduces, roots changing, inputs new every round, every element checked; where every rank
/// shares the host and shared memory is on, the small ones take the small areas (as
/// `collective_path` says), else messages.
fn check_small_ops(b: &TcpBackend, one_host: bool) {
    let (me, n) = (b.rank(), b.world_size());
    let small = HOST_SMALL_MAX / 4;
    let fail = |e: DistError| -> ! { panic!("{e}") };
    for round in 0..150usize {
        let v = |r: usize, i: usize| ((r + 1) * 1000 + round * 7 + i) as u32;
        let root = (round / 5) % n;
        let len = [2, 0, small, 5, small + 1, 1][round % 6];
        let mine: Vec<u32> = (0..len).map(|i| v(me, i)).collect();
        let what = format!("rank {me}: round {round}, {len} u32");
        match round % 5 {
            0 => b.barrier().unwrap_or_else(|e| fail(e)),
            1 => {
                let mut x = mine;
                b.broadcast(&mut x, root).unwrap_or_else(|e| fail(e));
                let want: Vec<u32> = (0..len).map(|i| v(root, i)).collect();
                assert_eq!(x, want, "{what}: broadcast from {root}");
            }
            2 => {
                let mut x = mine;
                b.reduce(&mut x, ReduceOp::Max, root)
                    .unwrap_or_else(|e| fail(e));
                if me == root {
                    let want: Vec<u32> = (0..len).map(|i| v(n - 1, i)).collect();
                    assert_eq!(x, want, "{what}: reduce to {root}");
                }
            }
            3 => {
                let mut out = vec![0u32; n * len];
                b.all_gather(&mine, &mut out).unwrap_or_else(|e| fail(e));
                let want: Vec<u32> = (0..n)
                    .flat_map(|r| (0..len).map(move |i| v(r, i)))
                    .collect();
                assert_eq!(out, want, "{what}: all_gather");
            }
            _ => {
                let mut x = mine;
                b.all_reduce(&mut x, ReduceOp::Sum)
                    .unwrap_or_else(|e| fail(e));
                let want: Vec<u32> = (0..len).map(|i| (0..n).map(|r| v(r, i)).sum()).collect();
                assert_eq!(x, want, "{what}: all_reduce");
            }
        }
    }
    let small_path = one_host && shm_on();
    for (kind, bytes) in [
        (Kind::Barrier, 0),
        (Kind::Broadcast, 8),
        (Kind::AllGather, 8),
    ] {
        let path = collective_path(b.group(), kind, bytes, bytes);
        assert_eq!(
            path == "arena-small",
            small_path,
            "rank {me}: {kind:?} of {bytes} bytes on {path}"
        );
    }
}

/// Every rank on one host: the group runs on the arena (over messages with `DIST_SHM=0`).
fn arena() -> Result<(), String> {
    let b = TcpBackend::with_config(config()).unwrap_or_else(|e| panic!("init failed: {e}"));
    check_limit(&b);
    check_sizes(&b);
    check_alternating(&b);
    check_small_ops(&b, true);
    let unchecked = check_direct(&b);
    check_threads(&b);
    assert_eq!(
        b.group().arena_in_use(),
        Some(shm_on()),
        "rank {}: arena in use",
        b.rank()
    );
    b.barrier().unwrap();
    match unchecked {
        Some(why) => Err(format!("skipped: {why}")),
        None => Ok(()),
    }
}

/// Ranks 2k and 2k + 1 on one simulated host (at 5 ranks the last one alone): the group runs
/// the hierarchical all_reduce, with the right results.
fn several_hosts() -> Result<(), String> {
    let me: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let cfg = config().host_id(format!("simulated-{}", me / 2));
    let b = TcpBackend::with_config(cfg).unwrap_or_else(|e| panic!("init failed: {e}"));
    check_limit(&b);
    check_sizes(&b);
    check_small_ops(&b, false);
    assert_eq!(b.group().arena_in_use(), Some(true), "rank {me}");
    b.barrier().unwrap();
    Ok(())
}

/// A count that differs on one rank: every rank errors (a mismatch, or the abort it causes),
/// none hangs.
fn mismatch() -> Result<(), String> {
    let b = TcpBackend::with_config(config()).unwrap_or_else(|e| panic!("init failed: {e}"));
    let me = b.rank();
    b.all_reduce(&mut [1.0f32], ReduceOp::Sum).unwrap();
    let count = if me == 1 { 100 } else { 99 };
    let e = b
        .all_reduce(&mut vec![1.0f32; count], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        matches!(
            e,
            DistError::CollectiveMismatch { .. } | DistError::Aborted { .. }
        ),
        "rank {me}: {e}"
    );
    println!("rank {me}: {e}");
    Ok(())
}

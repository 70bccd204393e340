//! Tests of `config.rs`: the launcher's and dist's variables read, bad values refused naming
//! the variable and value, the secret kept out of `Debug`, the receive spin by ranks per core.

use super::*;
use std::collections::HashMap;

/// An environment of `pairs` only, as a lookup (shared with `launch.rs`'s tests).
pub(crate) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

const OK: [(&str, &str); 4] = [
    ("RANK", "2"),
    ("WORLD_SIZE", "4"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29500"),
];

#[test]
fn reads_torchrun_variables() {
    let mut v = OK.to_vec();
    v.push(("LOCAL_RANK", "1"));
    v.push(("DIST_TIMEOUT", "2.5"));
    let c = TcpConfig::from_lookup(env(&v)).unwrap();
    assert_eq!((c.rank, c.world_size, c.local_rank), (2, 4, Some(1)));
    assert_eq!(c.master, "127.0.0.1:29500");
    assert_eq!(c.timeout, Duration::from_millis(2500));
    assert_eq!((c.parallel, c.ring_piece_kb, c.lanes), (None, None, None));
    assert_eq!(c.arena_max_kb, None);
    v.extend([
        ("DIST_TCP_PARALLEL", "0"),
        ("DIST_RING_PIECE_KB", "512"),
        ("DIST_TCP_LANES", "2"),
        ("DIST_ARENA_MAX_KB", "0"),
    ]);
    let c = TcpConfig::from_lookup(env(&v)).unwrap();
    assert_eq!(
        (c.parallel, c.ring_piece_kb, c.lanes, c.arena_max_kb),
        (Some(false), Some(512), Some(2), Some(0))
    );
    assert_eq!(c.formation, Formation::Auto);
    assert_eq!(c.formation_mode(), Formation::Eager);
    let big = |mut c: TcpConfig, n: usize| {
        c.world_size = n;
        c.formation_mode()
    };
    assert_eq!(big(c.clone(), LAZY_FROM - 1), Formation::Eager);
    assert_eq!(big(c.clone(), LAZY_FROM), Formation::Lazy);
    v.push(("DIST_FORMATION", "lazy"));
    assert_eq!(
        TcpConfig::from_lookup(env(&v)).unwrap().formation,
        Formation::Lazy
    );
    v.pop();
    v.push(("DIST_FORMATION", "eager"));
    let c = TcpConfig::from_lookup(env(&v)).unwrap();
    assert_eq!(big(c, 1000), Formation::Eager);
    v.pop();
    v.push(("DIST_FORMATION", "lazily"));
    let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
    assert!(e.contains("DIST_FORMATION") && e.contains("lazily"), "{e}");
    let v6 = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "::1"),
        ("MASTER_PORT", "1"),
    ];
    assert_eq!(TcpConfig::from_lookup(env(&v6)).unwrap().master, "[::1]:1");
}

/// Direct reads: by default where the host's ranks outnumber its cores without crowding it
/// (above the arena's limit there: 1 MiB, or as set) or have a core each (from 16 MiB), and
/// the reads are fast; `DIST_DIRECT` decides otherwise, and `DIST_DIRECT_MIN_KB` sets the size.
#[test]
fn direct_reads_by_default_and_by_variable() {
    use crate::config::{CORE_A_RANK_DIRECT_MIN, SHARED_CORES_DIRECT_MIN, direct_for};
    let c = TcpConfig::from_lookup(env(&OK)).unwrap();
    assert_eq!((c.direct, c.direct_min_kb), (None, None));
    let (fast, slow) = (|| true, || false);
    assert_eq!(direct_for(&c, 4, 2, fast), Some((1 << 20) + 1));
    assert_eq!(SHARED_CORES_DIRECT_MIN, (1 << 20) + 1);
    assert_eq!(direct_for(&c, 4, 2, slow), None);
    assert_eq!(
        direct_for(&c, 4, 4, fast),
        Some(CORE_A_RANK_DIRECT_MIN),
        "a core a rank"
    );
    assert_eq!(direct_for(&c, 4, 7, fast), Some(CORE_A_RANK_DIRECT_MIN));
    assert_eq!(direct_for(&c, 4, 4, slow), None);
    assert_eq!(direct_for(&c, 4, 8, fast), Some(CORE_A_RANK_DIRECT_MIN));
    assert_eq!(direct_for(&c, 4, 16, slow), None);
    assert_eq!(direct_for(&c, 40, 2, fast), None, "crowded");
    for (val, on) in [("0", false), ("1", true)] {
        let mut v = OK.to_vec();
        v.extend([("DIST_DIRECT", val), ("DIST_DIRECT_MIN_KB", "64")]);
        let c = TcpConfig::from_lookup(env(&v)).unwrap();
        assert_eq!((c.direct, c.direct_min_kb), (Some(on), Some(64)));
        let want = on.then_some(64 << 10);
        assert_eq!(direct_for(&c, 4, 2, slow), want);
        assert_eq!(direct_for(&c, 4, 16, fast), want);
    }
    let mut v = OK.to_vec();
    v.push(("DIST_DIRECT_MIN_KB", "512"));
    let c = TcpConfig::from_lookup(env(&v)).unwrap();
    assert_eq!(direct_for(&c, 4, 16, fast), Some(512 << 10));
    // Where ranks outnumber cores, from just above the arena's limit as set (the arena keeps
    // every size it was given), unless a size for direct reads is set too.
    for kb in ["256", "4096"] {
        let mut v = OK.to_vec();
        v.push(("DIST_ARENA_MAX_KB", kb));
        let c = TcpConfig::from_lookup(env(&v)).unwrap();
        let want = (kb.parse::<usize>().unwrap() << 10) + 1;
        assert_eq!(direct_for(&c, 4, 2, fast), Some(want), "arena to {kb} KiB");
        v.push(("DIST_DIRECT_MIN_KB", "2048"));
        let c = TcpConfig::from_lookup(env(&v)).unwrap();
        assert_eq!(direct_for(&c, 4, 2, fast), Some(2 << 20));
    }
}

/// An arena all_reduce's threads a rank: by default the cores each of the host's ranks has
/// (1 to 8); `DIST_ARENA_THREADS` decides otherwise (1 to 64; 0 is refused).
#[test]
fn arena_threads_by_default_and_by_variable() {
    use crate::config::arena_threads_for;
    let c = TcpConfig::from_lookup(env(&OK)).unwrap();
    let by_default = [
        (4, 2, 1),
        (4, 4, 1),
        (4, 16, 4),
        (16, 32, 2),
        (2, 128, 8),
        (0, 3, 3),
    ];
    for (local, cores, want) in by_default {
        assert_eq!(
            arena_threads_for(&c, local, cores),
            want,
            "{local} on {cores}"
        );
    }
    let mut v = OK.to_vec();
    v.push(("DIST_ARENA_THREADS", "3"));
    let c = TcpConfig::from_lookup(env(&v)).unwrap();
    assert_eq!(arena_threads_for(&c, 4, 2), 3);
    for bad in ["0", "65", "x"] {
        let mut v = OK.to_vec();
        v.push(("DIST_ARENA_THREADS", bad));
        let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
        assert!(e.contains("DIST_ARENA_THREADS"), "{bad}: {e}");
    }
}

#[test]
fn names_missing_and_malformed_variables() {
    for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        let v: Vec<_> = OK.iter().copied().filter(|(k, _)| *k != missing).collect();
        let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
        assert!(e.contains(missing) && e.contains("not set"), "{e}");
    }
    for (k, bad) in [
        ("RANK", "two"),
        ("WORLD_SIZE", "-1"),
        ("MASTER_PORT", "70000"),
        ("DIST_TIMEOUT", "0"),
        ("LOCAL_RANK", "x"),
        ("DIST_TCP_PARALLEL", "2"),
        ("DIST_TCP_LANES", "3"),
        ("DIST_RING_PIECE_KB", "0"),
        ("DIST_FORMATION", "later"),
        ("DIST_SPIN_US", "1e12"),
        ("DIST_ARENA_MAX_KB", "1048577"),
        ("DIST_SPIN_US", "10001"),
        ("DIST_SMALL_SPIN_US", "10001"),
        ("DIST_SMALL_SPIN_US", "two"),
        ("DIST_DIRECT", "yes"),
        ("DIST_DIRECT_MIN_KB", "-1"),
    ] {
        let mut v: Vec<_> = OK.iter().copied().filter(|(n, _)| *n != k).collect();
        v.push((k, bad));
        let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
        assert!(e.contains(k) && e.contains(bad), "{e}");
    }
    let mut v = OK.to_vec();
    v[0] = ("RANK", "4");
    let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
    assert!(e.contains("rank 4 is not below the world size 4"), "{e}");
}

/// `DIST_TIMEOUT=1e20` and the like are errors naming the variable and the value; on main,
/// 1e20 panicked in `Duration::from_secs_f64` and 1e18 later in `Instant + Duration`.
#[test]
fn huge_or_odd_durations_are_errors_naming_the_input() {
    for k in ["DIST_TIMEOUT", "DIST_INIT_TIMEOUT"] {
        for bad in ["1e20", "1e18", "3.2e9", "inf", "NaN", "-5", "0"] {
            let mut v = OK.to_vec();
            v.push((k, bad));
            let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(bad), "{e}");
        }
        let mut v = OK.to_vec();
        v.push((k, "3.1e9"));
        assert!(TcpConfig::from_lookup(env(&v)).is_ok());
    }
    let c = || TcpConfig::new(0, 2, "127.0.0.1:1");
    for (what, cfg) in [
        ("timeout", c().timeout(Duration::MAX)),
        (
            "init timeout",
            c().init_timeout(Duration::from_secs(u64::MAX)),
        ),
        ("handshake timeout", c().handshake_timeout(Duration::MAX)),
        ("linger", c().linger(Duration::MAX)),
    ] {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains(what) && e.contains("longer than the longest"),
            "{e}"
        );
    }
}

/// Review finding 5. Fails before the fix: `timeout(Duration::ZERO)` passed `validate`, and
/// `DIST_TIMEOUT=1e-7` was accepted; socket2 turns a send timeout under 1 µs into 0, which
/// the OS reads as "block forever".
#[test]
fn timeouts_under_a_millisecond_are_refused() {
    let c = || TcpConfig::new(0, 2, "127.0.0.1:1");
    for (what, cfg) in [
        ("timeout", c().timeout(Duration::ZERO)),
        ("timeout", c().timeout(Duration::from_nanos(100))),
        ("init timeout", c().init_timeout(Duration::from_micros(999))),
        ("handshake timeout", c().handshake_timeout(Duration::ZERO)),
    ] {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains(what) && e.contains("shortest allowed, 1 ms"),
            "{e}"
        );
    }
    assert!(c().timeout(Duration::from_millis(1)).validate().is_ok());
    for k in ["DIST_TIMEOUT", "DIST_INIT_TIMEOUT"] {
        for bad in ["1e-7", "0.0009"] {
            let mut v = OK.to_vec();
            v.push((k, bad));
            let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
            assert!(
                e.contains(k) && e.contains(bad) && e.contains("0.001"),
                "{e}"
            );
        }
    }
}

/// Secrets shorter than 16 bytes are refused with an error that says how long one must be.
#[test]
fn short_secrets_are_refused() {
    let c = || TcpConfig::new(0, 2, "127.0.0.1:1");
    for short in ["", "hunter2", "fifteen bytes!!"] {
        let e = c().secret(short).validate().unwrap_err().to_string();
        assert!(
            e.contains("shared secret")
                && e.contains(&format!("is {} bytes", short.len()))
                && e.contains("at least 16 bytes"),
            "{e}"
        );
    }
    assert!(c().secret("sixteen bytes!!!").validate().is_ok());
    let mut v = OK.to_vec();
    v.push(("DIST_SECRET", "short"));
    let e = TcpConfig::from_lookup(env(&v)).unwrap_err().to_string();
    assert!(
        e.contains("DIST_SECRET") && e.contains("at least 16 bytes"),
        "{e}"
    );
}

#[test]
fn debug_hides_the_secret() {
    let c = TcpConfig::new(0, 1, "x:1").secret("hunter2");
    assert!(!format!("{c:?}").contains("hunter2"));
}

/// The small areas' spin: 10 µs with two cores or more a rank, else 2 µs.
#[test]
fn the_small_spin_is_longer_with_cores_to_spare() {
    let spare = Duration::from_micros(10);
    let tight = dist_core::collectives::SMALL_SPIN;
    assert_eq!(default_small_spin(8, 16), spare);
    assert_eq!(default_small_spin(1, 2), spare);
    assert_eq!(default_small_spin(16, 16), tight);
    assert_eq!(default_small_spin(2, 2), tight);
    assert_eq!(default_small_spin(9, 16), tight);
    assert_eq!(default_small_spin(3, 0), tight);
}

/// The spin's default: 50 µs up to 16 ranks of the job per core of the host, none beyond
/// (measured: `docs/benchmarks.md`, "Spinning and oversubscription"); `LOCAL_WORLD_SIZE`
/// counts the ranks when set to a positive number.
#[test]
fn the_spin_stops_on_an_oversubscribed_host() {
    assert_eq!(default_spin(4, 2), crate::peer::SPIN);
    assert_eq!(default_spin(32, 2), crate::peer::SPIN);
    assert_eq!(default_spin(33, 2), Duration::ZERO);
    assert_eq!(default_spin(64, 2), Duration::ZERO);
    assert_eq!(default_spin(64, 32), crate::peer::SPIN);
    assert_eq!(default_spin(17, 0), Duration::ZERO);
    let env = |v: &'static str| move |k: &str| (k == "LOCAL_WORLD_SIZE").then(|| v.to_string());
    assert_eq!(local_ranks(env("8"), 64), 8);
    assert_eq!(local_ranks(env("0"), 64), 64);
    assert_eq!(local_ranks(env("many"), 64), 64);
    assert_eq!(local_ranks(|_: &str| None, 3), 3);
}

/// The ring piece's default: 256 KiB with one thread a rank, 1 MiB with a send beside its
/// receive, a quarter of 256 KiB on a crowded host (more than 16 ranks a core) whatever the
/// rest; a piece the configuration names wins everywhere.
#[test]
fn the_ring_piece_shrinks_on_a_crowded_host() {
    let cfg = TcpConfig::new(0, 1024, "127.0.0.1:29500");
    let piece = |cfg: &TcpConfig, parallel, local, cores| {
        local_tuning(cfg, parallel, local, cores).ring_piece_kb
    };
    assert_eq!(piece(&cfg, false, 4, 2), 256);
    assert_eq!(piece(&cfg, true, 16, 32), 1024);
    assert_eq!(piece(&cfg, false, 32, 2), 256);
    assert_eq!(piece(&cfg, false, 33, 2), CROWDED_PIECE_KB);
    assert_eq!(piece(&cfg, true, 1024, 16), CROWDED_PIECE_KB);
    let named = cfg.ring_piece_kb(512);
    assert_eq!(piece(&named, false, 1024, 2), 512);
}

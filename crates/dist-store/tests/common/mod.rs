//! What the integration tests share: one run of every operation of dist's client against a
//! server (dist's or PyTorch's), and finding a python with torch.

// Each test binary uses a part of this module; its items are public to the including crate.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use dist_store::{Store, StoreError, TcpStore};

/// What the server under test offers beyond the operations every TCPStore server has.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// QUEUE_PUSH / QUEUE_POP / QUEUE_LEN.
    pub queues: bool,
    /// BARRIER.
    pub server_barrier: bool,
}

pub const T: Duration = Duration::from_secs(20);

pub fn connect(addr: SocketAddr) -> TcpStore {
    TcpStore::connect(addr, T).expect("connect")
}

/// Every operation of the [`Store`] trait through dist's client against the server at `addr`,
/// with a fresh key space under `ns`.
pub fn exercise(addr: SocketAddr, ns: &str, caps: Caps) {
    let s = connect(addr);
    let other = connect(addr);
    let k = |name: &str| format!("{ns}/{name}");

    s.set(&k("a"), b"1").unwrap();
    assert_eq!(s.get(&k("a"), T).unwrap(), b"1");
    assert_eq!(s.add(&k("n"), 5).unwrap(), 5);
    assert_eq!(other.add(&k("n"), -2).unwrap(), 3);
    assert_eq!(s.get(&k("n"), T).unwrap(), b"3", "add keeps ascii decimal");

    // compare_set, PyTorch's rules.
    assert_eq!(s.compare_set(&k("cs"), b"x", b"y").unwrap(), b"x");
    assert!(!s.check(&[&k("cs")]).unwrap(), "nothing stored");
    assert_eq!(s.compare_set(&k("cs"), b"", b"y").unwrap(), b"y");
    assert_eq!(s.compare_set(&k("cs"), b"z", b"w").unwrap(), b"y");
    assert_eq!(s.compare_set(&k("cs"), b"y", b"w").unwrap(), b"w");

    assert!(s.check(&[&k("a"), &k("n")]).unwrap());
    assert!(!s.check(&[&k("a"), &k("nope")]).unwrap());

    // A wait that times out is cancelled on the server; the connection stays usable.
    let t0 = Instant::now();
    let e = s
        .wait(&[&k("never")], Duration::from_millis(200))
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    match &e {
        StoreError::Timeout {
            op, key, server, ..
        } => {
            assert_eq!(*op, "wait");
            assert_eq!(key, &k("never"));
            assert_eq!(server, &addr.to_string());
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(e.to_string().contains(&k("never")), "{e}");
    let e = s.get(&k("never"), Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, StoreError::Timeout { op: "get", .. }), "{e:?}");
    assert_eq!(
        s.get(&k("a"), T).unwrap(),
        b"1",
        "usable after cancelled waits"
    );

    // Waits woken by another client.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            other.set(&k("late"), b"v").unwrap();
            std::thread::sleep(Duration::from_millis(100));
            other.set(&k("late2"), b"w").unwrap();
        });
        s.wait(&[&k("late")], T).unwrap();
        assert_eq!(s.get(&k("late2"), T).unwrap(), b"w");
    });
    // Multi-key wait: the last of three keys releases it.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for x in ["w1", "w2", "w3"] {
                std::thread::sleep(Duration::from_millis(30));
                other.set(&k(x), x.as_bytes()).unwrap();
            }
        });
        s.wait(&[&k("w1"), &k("w2"), &k("w3")], T).unwrap();
    });

    assert!(s.delete_key(&k("a")).unwrap());
    assert!(!s.delete_key(&k("a")).unwrap());
    assert!(s.num_keys().unwrap() >= 6);

    s.append(&k("ap"), b"ab").unwrap();
    // APPEND has no answer, so two connections' appends may arrive in either order: one here.
    s.append(&k("ap"), b"cd").unwrap();
    assert_eq!(s.get(&k("ap"), T).unwrap(), b"abcd");

    s.multi_set(&[&k("m1"), &k("m2")], &[b"v1", b""]).unwrap();
    assert_eq!(
        other.multi_get(&[&k("m1"), &k("m2")], T).unwrap(),
        vec![b"v1".to_vec(), vec![]]
    );
    let e = s.multi_set(&[&k("m1")], &[]).unwrap_err();
    assert!(matches!(e, StoreError::InvalidArgument { .. }), "{e:?}");

    let keys = s.list_keys().unwrap();
    assert!(
        keys.contains(&k("m1")) && keys.contains(&k("ap")),
        "{keys:?}"
    );

    // Values up to 4 MiB (PyTorch's libuv server takes 8 MiB at most).
    let big: Vec<u8> = (0..4 << 20).map(|i| (i * 7 % 251) as u8).collect();
    s.set(&k("big"), &big).unwrap();
    assert_eq!(other.get(&k("big"), T).unwrap(), big);

    if caps.queues {
        s.queue_push(&k("q"), b"i1").unwrap();
        s.queue_push(&k("q"), b"i2").unwrap();
        // QUEUE_PUSH has no answer: an answered call on the same connection shows both were
        // run before the other connection looks.
        assert_eq!(s.queue_len(&k("q")).unwrap(), 2);
        assert_eq!(other.queue_len(&k("q")).unwrap(), 2);
        assert_eq!(other.queue_pop(&k("q"), T).unwrap(), b"i1");
        assert_eq!(other.try_queue_pop(&k("q")).unwrap().unwrap(), b"i2");
        assert_eq!(other.try_queue_pop(&k("q")).unwrap(), None);
        let e = s
            .queue_pop(&k("q"), Duration::from_millis(100))
            .unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Timeout {
                    op: "queue_pop",
                    ..
                }
            ),
            "{e:?}"
        );
        std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                other.queue_push(&k("q2"), b"x").unwrap();
            });
            assert_eq!(s.queue_pop(&k("q2"), T).unwrap(), b"x");
        });
    }

    // The named barrier (add + wait, which every server offers), twice under one name.
    for _round in 0..2 {
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    let c = connect(addr);
                    c.barrier(&k("bar"), 3, T).unwrap();
                });
            }
        });
    }
    if caps.server_barrier {
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| connect(addr).server_barrier(&k("sbar"), 3, T).unwrap());
            }
        });
    }

    // Many clients at once: 32 connections, 50 adds each, an exact count.
    std::thread::scope(|sc| {
        for _ in 0..32 {
            sc.spawn(|| {
                let c = connect(addr);
                for _ in 0..50 {
                    c.add(&k("ctr"), 1).unwrap();
                }
            });
        }
    });
    assert_eq!(s.add(&k("ctr"), 0).unwrap(), 1600);
}

/// A python that imports torch, and the torch it imports.
#[derive(Debug, Clone)]
pub struct Torch {
    pub python: String,
    /// `torch.__version__`, e.g. "2.15.0+cu132".
    pub version: String,
    /// Its release as (major, minor).
    pub release: (u32, u32),
}

impl Torch {
    /// Whether its servers and client know `BARRIER` (PyTorch 2.15 and later).
    pub fn has_barrier(&self) -> bool {
        self.release >= (2, 15)
    }

    /// "2.15.0" for "2.15.0+cu132": a name for the trials that run with it.
    pub fn label(&self) -> &str {
        self.version.split('+').next().unwrap_or(&self.version)
    }
}

/// The torch `py` imports, or why it imports none.
fn probe(py: &str) -> Result<Torch, String> {
    let out = Command::new(py)
        .args([
            "-c",
            "import torch, torch.distributed as d; d.TCPStore; print(torch.__version__)",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let version = String::from_utf8_lossy(&o.stdout)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
                .to_string();
            let mut parts = version.split(['.', '+']).map(|p| p.parse::<u32>().ok());
            match (parts.next().flatten(), parts.next().flatten()) {
                (Some(major), Some(minor)) => Ok(Torch {
                    python: py.to_string(),
                    version,
                    release: (major, minor),
                }),
                _ => Err(format!("{py} imports torch of version {version:?}")),
            }
        }
        Ok(o) => Err(format!(
            "{py} cannot import torch.distributed ({})",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => Err(format!("{py} does not run: {e}")),
    }
}

/// A python that imports torch: `DIST_TORCH_PYTHON`, else `python3`; `Err(reason)` if none.
pub fn torch_python() -> Result<String, String> {
    let (py, from_env) = match std::env::var("DIST_TORCH_PYTHON") {
        Ok(p) if !p.is_empty() => (p, true),
        _ => ("python3".to_string(), false),
    };
    probe(&py).map(|t| t.python).map_err(|why| {
        if from_env {
            why
        } else {
            format!("{why}; set DIST_TORCH_PYTHON (`cargo xtask torch-venv` prints one)")
        }
    })
}

/// Every torch to test against: the python of [`torch_python`], then each python listed in
/// `DIST_TORCH_PYTHONS` (separated by `:`, as `PATH`), one per torch version; and why a listed
/// python was left out (it was asked for: the caller reports that as a failure). `Err(reason)`
/// when none imports torch.
pub fn torch_pythons() -> (Result<Vec<Torch>, String>, Vec<String>) {
    let mut found: Vec<Torch> = Vec::new();
    let mut why = String::new();
    match torch_python() {
        Ok(py) => found.extend(probe(&py)),
        Err(e) => why = e,
    }
    let mut bad = Vec::new();
    let listed = std::env::var("DIST_TORCH_PYTHONS").unwrap_or_default();
    for py in listed.split(':').filter(|p| !p.is_empty()) {
        match probe(py) {
            Ok(t) if found.iter().any(|f| f.label() == t.label()) => {}
            Ok(t) => found.push(t),
            Err(e) => bad.push(format!("DIST_TORCH_PYTHONS: {e}")),
        }
    }
    if found.is_empty() {
        (Err(why), bad)
    } else {
        (Ok(found), bad)
    }
}

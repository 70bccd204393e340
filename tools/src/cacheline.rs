//! `dist-cacheline`: the host's bound on a small message between two cores: a cache-line
//! ping-pong through shared memory. Two threads, pinned to two CPUs (the first two this process
//! may run on, or `--cpus A,B`), each own one cache line (128 bytes apart, so that no prefetch
//! of a neighbour line joins them): the first stores round i into its line and waits until the
//! second's line says i; the second waits for i in the first's line and answers with i in its
//! own. A round trip is two cache-line transfers, one each way: what dist's small collectives
//! (each rank writes a word in its own line of the host arena, every other rank reads it) cannot
//! beat. Prints the median and the best of `--rounds` rounds of `--iters` round trips, per round
//! trip and one way (half of it), in ns.
//!
//! Threads of one process move cache lines between cores as processes sharing a mapping do
//! (the line, not the address space, is what travels). Run it on an idle host, or say how busy
//! it was: a waiting thread that loses its core adds a scheduler's time slice to a round trip.

// A binary crate: nothing is exported.
#![allow(unreachable_pub)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest a side waits for the other's answer before it gives up (the other lost its core
/// for that long, or died): the tool then says so and exits.
const PATIENCE: Duration = Duration::from_secs(10);

/// Two cache lines, each the one side's alone, 128 bytes apart.
#[repr(C, align(128))]
struct Line(AtomicU64);

struct Shared {
    ping: Line,
    pong: Line,
}

struct Opts {
    iters: u64,
    rounds: usize,
    cpus: Option<(usize, usize)>,
}

fn usage() -> ! {
    eprintln!(
        "usage: dist-cacheline [--iters N (100000)] [--rounds R (7)] [--cpus A,B]\n\
         a cache-line ping-pong between two threads on two CPUs: the round trip and one-way time"
    );
    std::process::exit(2)
}

fn parse() -> Opts {
    let mut o = Opts {
        iters: 100_000,
        rounds: 7,
        cpus: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--iters" => o.iters = value().parse().unwrap_or_else(|_| usage()),
            "--rounds" => o.rounds = value().parse().unwrap_or_else(|_| usage()),
            "--cpus" => {
                let v = value();
                let (a, b) = v.split_once(',').unwrap_or_else(|| usage());
                o.cpus = Some((
                    a.parse().unwrap_or_else(|_| usage()),
                    b.parse().unwrap_or_else(|_| usage()),
                ));
            }
            _ => usage(),
        }
    }
    if o.iters == 0 || o.rounds == 0 {
        usage();
    }
    o
}

/// The CPUs to pin the two sides to: the given ones, or the first two this process may run on.
#[cfg(target_os = "linux")]
fn cpus(given: Option<(usize, usize)>) -> Result<(usize, usize), String> {
    use rustix::thread::{CpuSet, sched_getaffinity};
    if let Some(c) = given {
        return Ok(c);
    }
    let allowed = sched_getaffinity(None).map_err(|e| format!("sched_getaffinity: {e}"))?;
    let mut it = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c));
    match (it.next(), it.next()) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err("this process may run on one CPU only: no two cores to measure".into()),
    }
}

/// Pins the calling thread to `cpu`.
#[cfg(target_os = "linux")]
fn pin(cpu: usize) -> Result<(), String> {
    use rustix::thread::{CpuSet, sched_setaffinity};
    let mut one = CpuSet::new();
    one.set(cpu);
    sched_setaffinity(None, &one).map_err(|e| format!("sched_setaffinity({cpu}): {e}"))
}

#[cfg(not(target_os = "linux"))]
fn cpus(_: Option<(usize, usize)>) -> Result<(usize, usize), String> {
    Err("pinning needs Linux".into())
}

#[cfg(not(target_os = "linux"))]
fn pin(_: usize) -> Result<(), String> {
    Err("pinning needs Linux".into())
}

/// Spins until `line` holds `want`; an error past [`PATIENCE`].
fn wait_for(line: &AtomicU64, want: u64) -> Result<(), String> {
    let mut looks = 0u32;
    let mut since: Option<Instant> = None;
    while line.load(Ordering::Acquire) != want {
        std::hint::spin_loop();
        looks = looks.wrapping_add(1);
        // The clock only now and then: a look costs a few ns, the clock tens.
        if looks.is_multiple_of(1 << 16) {
            let t = *since.get_or_insert_with(Instant::now);
            if t.elapsed() > PATIENCE {
                return Err(format!(
                    "waited over {PATIENCE:?} for round {want}: the other side lost its core"
                ));
            }
        }
    }
    Ok(())
}

/// One round of `iters` round trips from counter `base`; returns the seconds per round trip.
fn round(s: &Shared, base: u64, iters: u64) -> Result<f64, String> {
    let t = Instant::now();
    for i in base + 1..=base + iters {
        s.ping.0.store(i, Ordering::Release);
        wait_for(&s.pong.0, i)?;
    }
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let o = parse();
    let (a, b) = cpus(o.cpus).unwrap_or_else(|e| {
        eprintln!("dist-cacheline: {e}");
        std::process::exit(1)
    });
    let s = Shared {
        ping: Line(AtomicU64::new(0)),
        pong: Line(AtomicU64::new(0)),
    };
    // One round of warm-up (both threads running, the lines in place), then the rounds.
    let total = o.iters * (o.rounds as u64 + 1);
    let times = std::thread::scope(|scope| {
        let answer = scope.spawn(|| -> Result<(), String> {
            pin(b)?;
            for i in 1..=total {
                wait_for(&s.ping.0, i)?;
                s.pong.0.store(i, Ordering::Release);
            }
            Ok(())
        });
        let asked = (|| -> Result<Vec<f64>, String> {
            pin(a)?;
            round(&s, 0, o.iters)?;
            (1..=o.rounds as u64)
                .map(|r| round(&s, r * o.iters, o.iters))
                .collect()
        })();
        if asked.is_err() {
            // Let the answering side's wait end: it sees a value it never waits for, and its
            // patience runs out.
            s.ping.0.store(u64::MAX, Ordering::Release);
        }
        let answered = answer
            .join()
            .unwrap_or_else(|_| Err("the answering thread panicked".into()));
        asked.and_then(|t| answered.map(|()| t))
    });
    let times = times.unwrap_or_else(|e| {
        eprintln!("dist-cacheline: {e}");
        std::process::exit(1)
    });
    let ns = |s: f64| s * 1e9;
    let (med, best) = (
        median(times.clone()),
        times.iter().copied().fold(f64::MAX, f64::min),
    );
    println!(
        "# cache-line ping-pong between CPUs {a} and {b}: {} rounds of {} round trips",
        o.rounds, o.iters
    );
    println!("round_trip_ns median {:.1} best {:.1}", ns(med), ns(best));
    println!(
        "one_way_ns median {:.1} best {:.1}",
        ns(med) / 2.0,
        ns(best) / 2.0
    );
}

//! Point-to-point benchmark between ranks 0 and 1, beside a plain socket pair measured in the
//! same run: median one-way latency of small messages (ping-pong), and streaming throughput of
//! large messages (one direction, acknowledged at the end). Run by `cargo xtask bench-p2p`;
//! `--latency-only` skips the throughput part; `--pin` pins rank r, before any of its threads
//! starts, to the r-th CPU it may run on (Linux; elsewhere it says it cannot).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use dist_core::{Backend, Tag};

const LAT_ITERS: usize = 10_000;
const STREAM_BYTES: usize = 64 << 20;
const STREAM_MSGS: usize = 48;
const ROUNDS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The CPU this process's main thread last ran on (field 39 of `/proc/self/stat`), where
/// there is one: where the scheduler placed the two ranks decides much of a small message's
/// latency (on one CPU every round trip takes two context switches).
fn last_cpu() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(36)?.parse().ok()
}

/// Ping-pong `iters` times; returns each round trip's time.
fn pingpong(iters: usize, mut one: impl FnMut()) -> Vec<f64> {
    for _ in 0..1000 {
        one();
    }
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            one();
            t.elapsed().as_secs_f64()
        })
        .collect()
}

/// Pins this thread (and so every thread it starts later) to the `rank`-th CPU of those it may
/// run on; returns that CPU.
#[cfg(target_os = "linux")]
fn pin(rank: usize) -> Result<usize, String> {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
    let allowed = sched_getaffinity(None).map_err(|e| format!("sched_getaffinity: {e}"))?;
    let cpu = (0..CpuSet::MAX_CPU)
        .filter(|&c| allowed.is_set(c))
        .nth(rank)
        .ok_or_else(|| format!("rank {rank}: only {} CPUs allowed", allowed.count()))?;
    let mut one = CpuSet::new();
    one.set(cpu);
    sched_setaffinity(None, &one).map_err(|e| format!("sched_setaffinity({cpu}): {e}"))?;
    Ok(cpu)
}

#[cfg(not(target_os = "linux"))]
fn pin(_rank: usize) -> Result<usize, String> {
    Err("pinning is implemented on Linux only".into())
}

fn main() {
    dist_multirank::init_logging();
    let cfg = dist_multirank::config();
    let (me, n) = (cfg.rank(), cfg.world_size());
    assert!(n == 2, "run with exactly 2 ranks");
    if std::env::args().any(|a| a == "--pin") {
        match pin(me) {
            Ok(cpu) => println!("rank {me}: pinned to CPU {cpu}"),
            Err(e) => {
                eprintln!("dist-p2p-bench: --pin: {e}");
                std::process::exit(2);
            }
        }
    }
    let port: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
    // The plain pair: rank 1 listens on MASTER_PORT + 1, rank 0 connects.
    let mut plain = if me == 1 {
        let l = TcpListener::bind(("127.0.0.1", port + 1)).expect("bind the plain pair's port");
        l.accept().unwrap().0
    } else {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match TcpStream::connect(("127.0.0.1", port + 1)) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "plain pair: {e}");
                    // Rank 1 may not be listening yet: retry.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    };
    plain.set_nodelay(true).unwrap();
    let latency_only = std::env::args().any(|a| a == "--latency-only");
    let b = dist_multirank::join();
    let peer = 1 - me;
    let tag = Tag::user(1);
    let mut small = [0u8; 8];
    let mut results = Vec::new();
    for round in 0..ROUNDS {
        // Latency, plain pair then dist.
        let p = pingpong(LAT_ITERS, || {
            if me == 0 {
                plain.write_all(&small).unwrap();
                plain.read_exact(&mut small).unwrap();
            } else {
                plain.read_exact(&mut small).unwrap();
                plain.write_all(&small).unwrap();
            }
        });
        let d = pingpong(LAT_ITERS, || {
            if me == 0 {
                b.send_tagged(&small, peer, tag).unwrap();
                b.recv_tagged(&mut small, peer, tag).unwrap();
            } else {
                b.recv_tagged(&mut small, peer, tag).unwrap();
                b.send_tagged(&small, peer, tag).unwrap();
            }
        });
        let (lat_plain, lat_dist) = (median(p) / 2.0, median(d) / 2.0);
        // Where the two ranks ran at the end of the dist ping-pong (u64::MAX: unknown).
        let mut cpus = last_cpu().unwrap_or(u64::MAX).to_le_bytes();
        if me == 1 {
            b.send_tagged(&cpus, 0, tag).unwrap();
        } else {
            let mine = cpus;
            b.recv_tagged(&mut cpus, 1, tag).unwrap();
            let show = |c: [u8; 8]| match u64::from_le_bytes(c) {
                u64::MAX => "?".to_string(),
                c => c.to_string(),
            };
            println!(
                "round {round}: ranks 0 and 1 last ran on CPUs {} and {}",
                show(mine),
                show(cpus)
            );
        }
        if latency_only {
            if me == 0 {
                println!(
                    "round {round}: latency plain {:.2} us, dist {:.2} us",
                    lat_plain * 1e6,
                    lat_dist * 1e6
                );
            }
            results.push((lat_plain, lat_dist, f64::NAN, f64::NAN));
            continue;
        }
        // Throughput, plain pair then dist.
        let mut big = vec![1u8; STREAM_BYTES];
        let mut ack = [0u8; 1];
        let t = Instant::now();
        for _ in 0..STREAM_MSGS {
            if me == 0 {
                plain.write_all(&big).unwrap();
            } else {
                plain.read_exact(&mut big).unwrap();
            }
        }
        if me == 0 {
            plain.read_exact(&mut ack).unwrap();
        } else {
            plain.write_all(&ack).unwrap();
        }
        let bw_plain = (STREAM_BYTES * STREAM_MSGS) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for _ in 0..STREAM_MSGS {
            if me == 0 {
                b.send_tagged(&big, peer, tag).unwrap();
            } else {
                b.recv_tagged(&mut big, peer, tag).unwrap();
            }
        }
        if me == 0 {
            b.recv_tagged(&mut ack, peer, tag).unwrap();
        } else {
            b.send_tagged(&ack, peer, tag).unwrap();
        }
        let bw_dist = (STREAM_BYTES * STREAM_MSGS) as f64 / t.elapsed().as_secs_f64() / 1e9;
        if me == 0 {
            println!(
                "round {round}: latency plain {:.2} us, dist {:.2} us; throughput plain {bw_plain:.2} GB/s, dist {bw_dist:.2} GB/s",
                lat_plain * 1e6,
                lat_dist * 1e6
            );
        }
        results.push((lat_plain, lat_dist, bw_plain, bw_dist));
    }
    if me == 0 {
        let m = |f: fn(&(f64, f64, f64, f64)) -> f64| median(results.iter().map(f).collect());
        let (lp, ld, bp, bd) = (m(|r| r.0), m(|r| r.1), m(|r| r.2), m(|r| r.3));
        println!();
        println!("| measure | plain socket pair | dist TcpBackend | ratio (dist / plain) |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| median one-way latency, 8 B | {:.2} us | {:.2} us | {:.2} |",
            lp * 1e6,
            ld * 1e6,
            ld / lp
        );
        if !latency_only {
            println!(
                "| streaming throughput, 64 MiB messages | {bp:.2} GB/s | {bd:.2} GB/s | {:.2} |",
                bd / bp
            );
        }
    }
    b.barrier().unwrap();
}

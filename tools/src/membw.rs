//! `dist-membw`: the host's bound on a large all_reduce through shared memory: how many bytes
//! a second `--threads` threads (default: every CPU this process may run on) move together
//! when each copies its own `--bytes` buffer into another (`copy`: a read and a write of every
//! byte) or adds one f32 buffer into another (`reduce`: two reads and a write), as the ranks
//! of an all_reduce on one host do. Prints, for each, the best and median of `--rounds`
//! rounds: seconds per pass and the bytes moved (read plus written) per second, all threads
//! together, in GB/s.
//!
//! An all_reduce of S bytes on n ranks of one host that copies every input in and the result
//! out (the arena's shares) moves about 3 S bytes a rank through memory (copy in: read S, write
//! S; reduce its share: read S, write S/n; copy the result out: read S, write S); one that reads
//! its peers' buffers in place moves about 2 S. Dividing those bytes, times n, by this tool's
//! GB/s at n threads gives the shortest such an all_reduce can take on the host.

// A binary crate: nothing is exported.
#![allow(unreachable_pub)]

use std::sync::Barrier;
use std::time::Instant;

struct Opts {
    threads: usize,
    bytes: usize,
    rounds: usize,
}

fn usage() -> ! {
    eprintln!(
        "usage: dist-membw [--threads T (this process's CPUs)] [--bytes B (32M; K, M suffixes)] \
         [--rounds R (7)]\n\
         T threads each copying (and adding) a buffer of B bytes of its own: bytes moved per \
         second, all together"
    );
    std::process::exit(2)
}

fn size(v: &str) -> Option<usize> {
    let (digits, unit) = match v.as_bytes().last()? {
        b'K' | b'k' => (&v[..v.len() - 1], 1 << 10),
        b'M' | b'm' => (&v[..v.len() - 1], 1 << 20),
        b'G' | b'g' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

fn parse() -> Opts {
    let mut o = Opts {
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        bytes: 32 << 20,
        rounds: 7,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--threads" => o.threads = value().parse().unwrap_or_else(|_| usage()),
            "--bytes" => o.bytes = size(&value()).unwrap_or_else(|| usage()),
            "--rounds" => o.rounds = value().parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    if o.threads == 0 || o.rounds == 0 || o.bytes < 4 {
        usage();
    }
    o
}

/// What each thread does to its buffers in a pass.
#[derive(Clone, Copy)]
enum Pass {
    /// `dst = src`: S read, S written.
    Copy,
    /// `dst += src` (f32): 2 S read, S written.
    Reduce,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Copy => "copy",
            Pass::Reduce => "reduce",
        }
    }

    /// Bytes through memory per pass of a buffer of `bytes`.
    fn moved(self, bytes: usize) -> f64 {
        match self {
            Pass::Copy => 2.0 * bytes as f64,
            Pass::Reduce => 3.0 * bytes as f64,
        }
    }

    fn run(self, src: &[f32], dst: &mut [f32]) {
        match self {
            Pass::Copy => dst.copy_from_slice(src),
            Pass::Reduce => dst.iter_mut().zip(src).for_each(|(d, s)| *d += *s),
        }
    }
}

/// `rounds` rounds of one pass on every thread at once (each starts at a barrier); the
/// seconds of each round, from the barrier to the last thread's end.
fn measure(o: &Opts, pass: Pass) -> Vec<f64> {
    let n = o.bytes / 4;
    let start = Barrier::new(o.threads + 1);
    let end = Barrier::new(o.threads + 1);
    std::thread::scope(|s| {
        for t in 0..o.threads {
            let (start, end) = (&start, &end);
            s.spawn(move || {
                // Each thread's own pages, touched by it first (its NUMA node, where several).
                let src = vec![t as f32 + 1.0; n];
                let mut dst = vec![0.0f32; n];
                for _ in 0..o.rounds {
                    start.wait();
                    pass.run(&src, &mut dst);
                    end.wait();
                }
                std::hint::black_box(&dst);
            });
        }
        (0..o.rounds)
            .map(|_| {
                start.wait();
                let t = Instant::now();
                end.wait();
                t.elapsed().as_secs_f64()
            })
            .collect()
    })
}

fn main() {
    let o = parse();
    println!(
        "# {} threads, {} bytes each, {} rounds: bytes moved (read + written) per second, all \
         threads together",
        o.threads, o.bytes, o.rounds
    );
    for pass in [Pass::Copy, Pass::Reduce] {
        let mut secs = measure(&o, pass);
        // The first round also faults the destination's pages in: not the steady state.
        if secs.len() > 1 {
            secs.remove(0);
        }
        secs.sort_by(f64::total_cmp);
        let moved = pass.moved(o.bytes) * o.threads as f64;
        let best = secs[0];
        let median = secs[secs.len() / 2];
        println!(
            "{:<6} best {:>9.1} us {:>7.1} GB/s  median {:>9.1} us {:>7.1} GB/s",
            pass.name(),
            best * 1e6,
            moved / best / 1e9,
            median * 1e6,
            moved / median / 1e9
        );
    }
}

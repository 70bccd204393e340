//! What starting and joining 1 or 3 scoped threads costs per step (2,000 steps each), for the
//! async split tried and reverted in session 16 (`docs/benchmarks.md`, "Session 16"). Not part
//! of any crate: `rustc -O thread-start.rs -o thread-start && ./thread-start`.

use std::time::Instant;
fn main() {
    for k in [1usize, 3] {
        let n = 2000;
        let t = Instant::now();
        for _ in 0..n {
            std::thread::scope(|s| {
                for _ in 0..k {
                    std::thread::Builder::new().spawn_scoped(s, || { std::hint::black_box(1); }).unwrap();
                }
            });
        }
        println!("{k} threads: {:.1} us per step", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
}

//! The demo `cargo xtask demo` runs: the ranks exchange messages around the mesh and verify
//! every byte, pass barriers, and rank 0 prints point-to-point latency and bandwidth to rank 1.

use std::time::Instant;

use dist_core::{Backend, Tag};

use dist_multirank::{fill, first_difference, seed};

fn main() {
    dist_multirank::init_logging();
    let b = dist_multirank::join();
    let (me, n) = (b.rank(), b.world_size());
    if me == 0 {
        println!("dist demo: {n} ranks over TCP on this host");
    }
    // Every rank sends a verified message to every other rank.
    let size = 1 << 20;
    let mut out = vec![0u8; size];
    let mut inb = vec![0u8; size];
    let mut verified = 0usize;
    for shift in 1..n {
        let (dst, src) = ((me + shift) % n, (me + n - shift) % n);
        fill(&mut out, seed(me, dst, 1));
        std::thread::scope(|s| {
            let h = s.spawn(|| b.send_tagged(&out, dst, Tag::user(1)));
            b.recv_tagged(&mut inb, src, Tag::user(1))
                .unwrap_or_else(|e| panic!("{e}"));
            h.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        });
        assert_eq!(
            first_difference(&inb, seed(src, me, 1)),
            None,
            "bad bytes from {src}"
        );
        verified += size;
    }
    for _ in 0..100 {
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    let mut totals = vec![0u8; 8];
    if me == 0 {
        let mut all = verified;
        for r in 1..n {
            b.recv_tagged(&mut totals, r, Tag::user(2)).unwrap();
            all += u64::from_le_bytes(totals[..8].try_into().unwrap()) as usize;
        }
        println!(
            "mesh exchange: {} messages of 1 MiB, {all} bytes verified; 100 barriers passed",
            n * (n - 1)
        );
    } else {
        b.send_tagged(&(verified as u64).to_le_bytes(), 0, Tag::user(2))
            .unwrap();
    }
    // Ping-pong between ranks 0 and 1.
    if n >= 2 && me < 2 {
        if me == 0 {
            println!("\npoint-to-point, rank 0 <-> rank 1 (ping-pong; one-way = round trip / 2)");
            println!(
                "{:>12} {:>8} {:>14} {:>12}",
                "bytes", "iters", "latency (us)", "GB/s"
            );
        }
        for &size in &[8usize, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
            let iters = (200_000_000 / (size + 20_000)).clamp(5, 2000);
            let mut buf = vec![0u8; size];
            fill(&mut buf, 5);
            let peer = 1 - me;
            let tag = Tag::user(3);
            let mut one = || {
                if me == 0 {
                    b.send_tagged(&buf, peer, tag).unwrap();
                    b.recv_tagged(&mut buf, peer, tag).unwrap();
                } else {
                    b.recv_tagged(&mut buf, peer, tag).unwrap();
                    b.send_tagged(&buf, peer, tag).unwrap();
                }
            };
            for _ in 0..iters.min(20) {
                one();
            }
            let t = Instant::now();
            for _ in 0..iters {
                one();
            }
            let one_way = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
            assert_eq!(
                first_difference(&buf, 5),
                None,
                "ping-pong corrupted the data"
            );
            if me == 0 {
                println!(
                    "{size:>12} {iters:>8} {:>14.2} {:>12.3}",
                    one_way * 1e6,
                    size as f64 / one_way / 1e9
                );
            }
        }
    }
    b.barrier().unwrap();
    if me == 0 {
        println!("\nall ranks verified every byte");
    }
}

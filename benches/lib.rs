//! Helpers for the criterion benchmarks: a job of N ranks as threads of one process, driven by
//! rank 0 (the benchmark's thread), over loopback TCP.

use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dist_core::collectives::Kind;
use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_tcp::TcpBackend;

/// The collectives benchmarked: [`Job::time`] takes these; any other kind fails the benchmark,
/// as any error does.
pub const KINDS: [Kind; 5] = [
    Kind::AllReduce,
    Kind::Broadcast,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AllToAll,
];

struct Work {
    op: Kind,
    bytes: usize,
    iters: u64,
}

/// Buffers for one op and size, and the call itself.
struct Bufs {
    a: Vec<f32>,
    out: Vec<f32>,
}

impl Bufs {
    fn new(op: Kind, bytes: usize, n: usize) -> Bufs {
        let mut count = (bytes / 4).max(1);
        if !matches!(op, Kind::AllReduce | Kind::Broadcast) {
            count = (count / n).max(1) * n;
        }
        Bufs {
            a: vec![1.0; count],
            out: vec![0.0; count],
        }
    }

    fn run(&mut self, b: &TcpBackend, op: Kind) {
        let n = b.world_size();
        let k = self.a.len() / n;
        let r = match op {
            Kind::AllReduce => b.all_reduce(&mut self.a, ReduceOp::Sum),
            Kind::Broadcast => b.broadcast(&mut self.a, 0),
            Kind::AllGather => b.all_gather(&self.a[..k], &mut self.out),
            Kind::ReduceScatter => b.reduce_scatter(&self.a, &mut self.out[..k], ReduceOp::Sum),
            Kind::AllToAll => b.all_to_all(&self.a, &mut self.out),
            other => Err(DistError::InvalidArgument {
                rank: b.rank(),
                op: other.name().into(),
                reason: "not one of the benchmarked KINDS".into(),
            }),
        };
        r.unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A job of `n` ranks: rank 0 here, the others in threads that follow its commands.
pub struct Job {
    root: TcpBackend,
    workers: Vec<(Sender<Option<Work>>, JoinHandle<()>)>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("ranks", &(self.workers.len() + 1))
            .finish()
    }
}

fn worker(b: TcpBackend, rx: Receiver<Option<Work>>) {
    while let Ok(Some(w)) = rx.recv() {
        let mut bufs = Bufs::new(w.op, w.bytes, b.world_size());
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..w.iters {
            bufs.run(&b, w.op);
        }
        b.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
}

impl Job {
    /// Forms a job of `n` ranks on a free loopback port.
    pub fn new(n: usize) -> Job {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let master = format!("127.0.0.1:{port}");
        let cfg = |r: usize| {
            TcpBackend::builder(r, n, master.clone())
                .timeout(Duration::from_secs(120))
                .linger(Duration::from_secs(5))
        };
        let workers: Vec<_> = (1..n)
            .map(|r| {
                let (tx, rx) = crossbeam_channel::unbounded();
                let c = cfg(r);
                let h = std::thread::spawn(move || {
                    worker(
                        TcpBackend::with_config(c).unwrap_or_else(|e| panic!("{e}")),
                        rx,
                    )
                });
                (tx, h)
            })
            .collect();
        let root = TcpBackend::with_config(cfg(0)).unwrap_or_else(|e| panic!("{e}"));
        Job { root, workers }
    }

    /// Runs `iters` calls of `op` on `bytes` on every rank; returns rank 0's time for them,
    /// from a barrier to the end of its last call.
    pub fn time(&self, op: Kind, bytes: usize, iters: u64) -> Duration {
        for (tx, _) in &self.workers {
            tx.send(Some(Work { op, bytes, iters }))
                .expect("worker alive");
        }
        let mut bufs = Bufs::new(op, bytes, self.root.world_size());
        self.root.barrier().unwrap_or_else(|e| panic!("{e}"));
        let t = Instant::now();
        for _ in 0..iters {
            bufs.run(&self.root, op);
        }
        let elapsed = t.elapsed();
        self.root.barrier().unwrap_or_else(|e| panic!("{e}"));
        elapsed
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (tx, _) in &self.workers {
            let _ = tx.send(None);
        }
        for (_, h) in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

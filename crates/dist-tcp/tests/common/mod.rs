//! What the in-process test files share: a free port on loopback, and a job of ranks as threads.

use std::net::TcpListener;
use std::thread;

use dist_tcp::{TcpBackend, TcpConfig};

/// A port on 127.0.0.1 that nothing listens on right now.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `f` on every rank of a fresh job, each in its own thread, with the configuration
/// `cfg(rank, world, port)` gives, and returns their results in rank order.
pub(crate) fn job_with<T: Send + 'static>(
    world: usize,
    cfg: fn(usize, usize, u16) -> TcpConfig,
    f: impl Fn(TcpBackend) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || f(TcpBackend::with_config(cfg(r, world, port)).unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

//! Helpers shared by the multi-rank programs (tests, demo, benchmarks): environment, patterns,
//! logging.

use std::time::Duration;

use dist_tcp::{TcpBackend, TcpConfig};

/// Logs to stderr when `RUST_LOG` asks for it; quiet otherwise.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// The configuration the launcher describes, with timeouts suited to tests.
pub fn config() -> TcpConfig {
    TcpConfig::from_env()
        .unwrap_or_else(|e| panic!("{e}"))
        .init_timeout(Duration::from_secs(60))
        .timeout(Duration::from_secs(60))
        .linger(Duration::from_secs(10))
}

/// Joins the job the launcher describes.
pub fn join() -> TcpBackend {
    TcpBackend::with_config(config()).unwrap_or_else(|e| panic!("init failed: {e}"))
}

fn word(i: u64, seed: u64) -> u64 {
    (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i >> 7)
}

/// Fills `buf` with a pattern determined by `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let (words, tail) = buf.split_at_mut(buf.len() / 8 * 8);
    for (i, w) in words.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(i as u64, seed).to_le_bytes());
    }
    let last = word(u64::MAX, seed).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The first byte offset where `buf` differs from [`fill`]'s pattern for `seed`.
pub fn first_difference(buf: &[u8], seed: u64) -> Option<usize> {
    let (words, tail) = buf.split_at(buf.len() / 8 * 8);
    let bad = words
        .chunks_exact(8)
        .enumerate()
        .position(|(i, w)| w != word(i as u64, seed).to_le_bytes());
    if let Some(i) = bad {
        return Some(i * 8);
    }
    let last = word(u64::MAX, seed).to_le_bytes();
    (tail != &last[..tail.len()]).then_some(words.len())
}

/// A seed naming a message by sender, receiver and a third number.
pub fn seed(src: usize, dst: usize, k: u64) -> u64 {
    ((src as u64) << 40) ^ ((dst as u64) << 20) ^ k
}

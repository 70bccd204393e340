//! A key-value store to coordinate a job, speaking PyTorch's TCPStore protocol byte for byte:
//! the [`Store`] trait (what `torch.distributed.Store` offers, every wait with a deadline),
//! [`TcpStore`] (a client of PyTorch's servers and of dist's), [`StoreServer`] (a server
//! PyTorch's own client can use: one event loop, bounded everywhere) and [`PrefixStore`] (keys
//! under a prefix, as PyTorch's). The wire format lives in [`proto`], pure and fuzzed.
//!
//! ```
//! use std::time::Duration;
//! use dist_store::{PrefixStore, Store, StoreServer, TcpStore};
//!
//! # fn main() -> Result<(), dist_store::StoreError> {
//! let server = StoreServer::bind("127.0.0.1:0")?;
//! let a = TcpStore::connect(server.local_addr(), Duration::from_secs(5))?;
//! let b = TcpStore::connect(server.local_addr(), Duration::from_secs(5))?;
//!
//! a.set("ckpt/step", b"1200")?;
//! assert_eq!(b.get("ckpt/step", Duration::from_secs(5))?, b"1200");
//! assert_eq!(a.add("joined", 1)? + b.add("joined", 1)?, 3);
//!
//! // Keys of one job under a prefix of its own: "job7/leader" on the wire.
//! let job = PrefixStore::new("job7", &b);
//! job.set("leader", b"host-3")?;
//! assert_eq!(a.get("job7/leader", Duration::from_secs(5))?, b"host-3");
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

mod client;
mod error;
mod io;
mod poll;
mod prefix;
pub mod proto;
mod server;
mod state;

use std::time::Duration;

pub use client::{ClientOptions, KEY_PREFIX, TcpStore};
pub use error::{Result, StoreError};
pub use prefix::PrefixStore;
pub use server::{ServerOptions, ServerStats, StoreServer};
pub use state::StoreLimits;

/// What `torch.distributed.Store` offers. Every operation that waits takes its deadline; the
/// others are bounded by the store's own timeout. Keys are strings; values are bytes.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Stores `value` under `key`, waking whoever waits for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting up to `timeout` for it to be set.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer at `key` (kept as ASCII decimal, absent counts as 0) and
    /// returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Sets `key` to `desired` if its value is `expected` (or if it is absent and `expected` is
    /// empty) and returns the value now stored. PyTorch's quirk: for an absent key and a
    /// non-empty `expected`, it returns `expected` and stores nothing.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Waits up to `timeout` until every key in `keys` is set.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key in `keys` is set now.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Deletes `key`; whether it was there.
    fn delete_key(&self, key: &str) -> Result<bool>;

    /// How many keys the server holds (all of them, whatever their prefix).
    fn num_keys(&self) -> Result<i64>;

    /// Appends `value` to the value at `key` (or sets it, if absent).
    fn append(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The values of `keys`, waiting up to `timeout` for all of them.
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>>;

    /// Sets each key to its value (`keys` and `values` of one length).
    fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()>;

    /// Appends `value` to the queue at `key`, waking one client waiting to pop.
    fn queue_push(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Takes the oldest item of the queue at `key`, waiting up to `timeout` for one.
    fn queue_pop(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Takes the oldest item of the queue at `key`, or `None` if it is empty now.
    fn try_queue_pop(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// The number of items in the queue at `key`.
    fn queue_len(&self, key: &str) -> Result<i64>;

    /// The keys this store can see (for a prefixed store, those under its prefix, without it).
    fn list_keys(&self) -> Result<Vec<String>>;

    /// Returns once `world_size` callers have entered the barrier named `key` (or fails after
    /// `timeout`). A name may be used again: each `world_size` arrivals form one round.
    fn barrier(&self, key: &str, world_size: usize, timeout: Duration) -> Result<()>;
}

/// A barrier out of `add` and `wait`, which every TCPStore server offers: the n-th arrival of
/// a round sets the round's key, everyone waits for it.
pub(crate) fn counting_barrier(
    store: &dyn Store,
    key: &str,
    world_size: usize,
    timeout: Duration,
) -> Result<()> {
    let n = world_size.max(1) as i64;
    let arrived = store.add(&format!("{key}/arrived"), 1)?;
    let round = (arrived - 1) / n;
    let done = format!("{key}/done/{round}");
    if arrived % n == 0 {
        store.set(&done, b"1")?;
    }
    store.wait(&[&done], timeout)
}

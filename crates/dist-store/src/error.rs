//! The one error type of the store: every variant names the operation, the key and the server.

use std::time::Duration;

/// What a store operation can fail with. Every variant names the operation (`op`, e.g. `"get"`),
/// the key it was about (`key`; the first of several, or `""` where the operation has none) and
/// the server (`server`, its address as the client dialled it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The deadline passed before the server answered (for `get`, `wait`, `queue_pop` and
    /// `barrier`: before the keys were there; the wait was cancelled on the server).
    #[error(
        "store {op} of key {key:?} at {server}: timed out after {timeout:?} waiting for {waited_for}"
    )]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The key (the first, where there were several).
        key: String,
        /// The server's address.
        server: String,
        /// The time the caller allowed.
        timeout: Duration,
        /// What was still awaited (keys, a reply, a connection).
        waited_for: String,
    },
    /// No connection to the server could be made and validated before the deadline.
    #[error(
        "store connect to {server}: no validated connection after {attempts} attempts in {elapsed:?}"
    )]
    Connect {
        /// The server's address.
        server: String,
        /// How many connections were tried.
        attempts: u32,
        /// How long was spent trying.
        elapsed: Duration,
        /// The last attempt's failure.
        #[source]
        source: std::io::Error,
    },
    /// The connection failed while the operation was under way (the server went away, reset the
    /// connection, or closed it because it refused the request).
    #[error("store {op} of key {key:?} at {server}: connection failed")]
    Io {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's address.
        server: String,
        /// What the socket reported.
        #[source]
        source: std::io::Error,
    },
    /// The server answered something the protocol does not allow at this point.
    #[error("store {op} of key {key:?} at {server}: protocol violation: {detail}")]
    Protocol {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's address.
        server: String,
        /// What was wrong.
        detail: String,
    },
    /// An argument is outside what the protocol or the server accepts (a key or value too long,
    /// too many keys, keys and values of different counts); nothing was sent.
    #[error("store {op} of key {key:?} at {server}: invalid argument: {detail}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's address.
        server: String,
        /// What was wrong.
        detail: String,
    },
    /// An earlier failure left the connection in an unknown state (a reply may still be in
    /// flight), so no further operation is sent on it.
    #[error("store {op} of key {key:?} at {server}: connection unusable after an earlier failure")]
    Broken {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
        /// The server's address.
        server: String,
    },
    /// The server could not be started (bind, listen, or its thread).
    #[error("store server at {addr}: could not start")]
    Serve {
        /// The address asked for.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The crate's result type.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

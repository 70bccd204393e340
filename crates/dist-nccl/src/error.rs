//! `NcclError`: every way a dist-nccl call can fail.

use std::time::Duration;

/// Shorthand for results whose error is [`NcclError`].
pub type Result<T, E = NcclError> = std::result::Result<T, E>;

/// An error of dist-nccl, naming the operation and the communicator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// The library could not be loaded, lacks a function, or is too old for it.
    #[error(transparent)]
    Load(#[from] dist_nccl_sys::LoadError),

    /// NCCL returned an error.
    #[error("{comm}: {op} failed: NCCL error {code} ({text}){}", if last.is_empty() { String::new() } else { format!(": {last}") })]
    Nccl {
        /// The communicator (its name, rank and size).
        comm: String,
        /// The call.
        op: String,
        /// The `ncclResult_t` value.
        code: u32,
        /// `ncclGetErrorString` of it.
        text: String,
        /// `ncclGetLastError`, when the library has it.
        last: String,
    },

    /// A CUDA driver call failed.
    #[error("{comm}: {op}: CUDA error: {source}")]
    Cuda {
        /// The communicator, or the device.
        comm: String,
        /// The call.
        op: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// An argument was refused before NCCL saw it: nothing was enqueued, no memory touched.
    #[error("{comm}: {op}: {reason}")]
    InvalidArgument {
        /// The communicator.
        comm: String,
        /// The call.
        op: String,
        /// What is wrong.
        reason: String,
    },

    /// Work did not complete by its deadline; the communicator was aborted.
    #[error("{comm}: {op} did not complete within {waited:.1?}; the communicator was aborted")]
    Timeout {
        /// The communicator.
        comm: String,
        /// The call that was waited for (the last enqueued before the deadline).
        op: String,
        /// How long.
        waited: Duration,
    },

    /// The communicator was aborted (by its watchdog, an asynchronous error or the user).
    #[error("{comm}: {op} refused: the communicator was aborted ({reason})")]
    Aborted {
        /// The communicator.
        comm: String,
        /// The call refused.
        op: String,
        /// Why it was aborted.
        reason: String,
    },

    /// The configuration or environment is unusable (no device, bad id bytes, ...).
    #[error("{what}: {reason}")]
    Config {
        /// What.
        what: String,
        /// Why.
        reason: String,
    },
}

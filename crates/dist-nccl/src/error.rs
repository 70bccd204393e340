//! `NcclError`: every way a dist-nccl call can fail, and `NcclCode`: NCCL's result codes, each
//! its own variant.

use std::time::Duration;

use dist_nccl_sys::ncclResult_t;

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
    #[error("{comm}: {op} failed: {code} (NCCL: {text}){}", if last.is_empty() { String::new() } else { format!(": {last}") })]
    Nccl {
        /// The communicator (its name, rank and size).
        comm: String,
        /// The call.
        op: String,
        /// What NCCL returned.
        code: NcclCode,
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

/// A result code of NCCL other than `ncclSuccess` (`ncclResult_t`), each its own variant, with
/// what NCCL's documentation (API, Types) says it means. Shown as its C name, its value and
/// that meaning: `ncclRemoteError (6): a remote process exited early or the network failed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NcclCode {
    /// A CUDA call inside NCCL failed.
    #[doc(alias = "ncclUnhandledCudaError")]
    UnhandledCudaError,
    /// A system call inside NCCL failed.
    #[doc(alias = "ncclSystemError")]
    SystemError,
    /// One of NCCL's internal checks failed: a bug in NCCL, or memory corruption.
    #[doc(alias = "ncclInternalError")]
    InternalError,
    /// An argument had a value NCCL refuses.
    #[doc(alias = "ncclInvalidArgument")]
    InvalidArgument,
    /// The call was wrong as made, usually a programming error.
    #[doc(alias = "ncclInvalidUsage")]
    InvalidUsage,
    /// The call failed, possibly because a remote process exited early or the network failed.
    #[doc(alias = "ncclRemoteError")]
    RemoteError,
    /// The operation is still being enqueued and progresses in the background (nonblocking
    /// communicators). An error only where a call was expected to have finished.
    #[doc(alias = "ncclInProgress")]
    InProgress,
    /// A value this crate does not know (from a newer NCCL, or `ncclNumResults`).
    Other(u32),
}

impl NcclCode {
    /// The code for `r`; `None` for `ncclSuccess`. The one place a raw result is converted.
    pub fn from_result(r: ncclResult_t) -> Option<NcclCode> {
        Some(match r {
            ncclResult_t::ncclSuccess => return None,
            ncclResult_t::ncclUnhandledCudaError => NcclCode::UnhandledCudaError,
            ncclResult_t::ncclSystemError => NcclCode::SystemError,
            ncclResult_t::ncclInternalError => NcclCode::InternalError,
            ncclResult_t::ncclInvalidArgument => NcclCode::InvalidArgument,
            ncclResult_t::ncclInvalidUsage => NcclCode::InvalidUsage,
            ncclResult_t::ncclRemoteError => NcclCode::RemoteError,
            ncclResult_t::ncclInProgress => NcclCode::InProgress,
            ncclResult_t(other) => NcclCode::Other(other),
        })
    }

    /// `Ok` for `ncclSuccess`, else the code.
    pub(crate) fn check(r: ncclResult_t) -> std::result::Result<(), NcclCode> {
        NcclCode::from_result(r).map_or(Ok(()), Err)
    }

    /// `Ok` for `ncclSuccess` and `ncclInProgress` (a nonblocking call going on in the
    /// background, to be polled), else the code.
    pub(crate) fn check_started(r: ncclResult_t) -> std::result::Result<(), NcclCode> {
        match NcclCode::check(r) {
            Err(NcclCode::InProgress) => Ok(()),
            other => other,
        }
    }

    /// The `ncclResult_t` value.
    pub fn result(self) -> ncclResult_t {
        match self {
            NcclCode::UnhandledCudaError => ncclResult_t::ncclUnhandledCudaError,
            NcclCode::SystemError => ncclResult_t::ncclSystemError,
            NcclCode::InternalError => ncclResult_t::ncclInternalError,
            NcclCode::InvalidArgument => ncclResult_t::ncclInvalidArgument,
            NcclCode::InvalidUsage => ncclResult_t::ncclInvalidUsage,
            NcclCode::RemoteError => ncclResult_t::ncclRemoteError,
            NcclCode::InProgress => ncclResult_t::ncclInProgress,
            NcclCode::Other(v) => ncclResult_t(v),
        }
    }

    /// The name `nccl.h` gives it (`ncclResult_t` for an unknown value).
    pub fn c_name(self) -> &'static str {
        match self {
            NcclCode::UnhandledCudaError => "ncclUnhandledCudaError",
            NcclCode::SystemError => "ncclSystemError",
            NcclCode::InternalError => "ncclInternalError",
            NcclCode::InvalidArgument => "ncclInvalidArgument",
            NcclCode::InvalidUsage => "ncclInvalidUsage",
            NcclCode::RemoteError => "ncclRemoteError",
            NcclCode::InProgress => "ncclInProgress",
            NcclCode::Other(_) => "ncclResult_t",
        }
    }

    /// What NCCL means by it, as in the variant's documentation.
    pub fn meaning(self) -> &'static str {
        match self {
            NcclCode::UnhandledCudaError => "a CUDA call inside NCCL failed",
            NcclCode::SystemError => "a system call inside NCCL failed",
            NcclCode::InternalError => {
                "an internal check failed: a bug in NCCL or memory corruption"
            }
            NcclCode::InvalidArgument => "an argument has a value NCCL refuses",
            NcclCode::InvalidUsage => "the call is wrong as made, usually a programming error",
            NcclCode::RemoteError => "a remote process exited early or the network failed",
            NcclCode::InProgress => "the operation is still progressing in the background",
            NcclCode::Other(_) => "a code this version of dist-nccl does not know",
        }
    }
}

impl std::fmt::Display for NcclCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.c_name(),
            self.result().0,
            self.meaning()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_result_code_has_its_variant_and_message() {
        assert_eq!(NcclCode::from_result(ncclResult_t::ncclSuccess), None);
        assert_eq!(NcclCode::check(ncclResult_t(0)), Ok(()));
        let table = [
            (
                1,
                NcclCode::UnhandledCudaError,
                "ncclUnhandledCudaError (1): a CUDA call inside NCCL failed",
            ),
            (
                2,
                NcclCode::SystemError,
                "ncclSystemError (2): a system call inside NCCL failed",
            ),
            (
                3,
                NcclCode::InternalError,
                "ncclInternalError (3): an internal check failed: a bug in NCCL or memory corruption",
            ),
            (
                4,
                NcclCode::InvalidArgument,
                "ncclInvalidArgument (4): an argument has a value NCCL refuses",
            ),
            (
                5,
                NcclCode::InvalidUsage,
                "ncclInvalidUsage (5): the call is wrong as made, usually a programming error",
            ),
            (
                6,
                NcclCode::RemoteError,
                "ncclRemoteError (6): a remote process exited early or the network failed",
            ),
            (
                7,
                NcclCode::InProgress,
                "ncclInProgress (7): the operation is still progressing in the background",
            ),
            (
                8,
                NcclCode::Other(8),
                "ncclResult_t (8): a code this version of dist-nccl does not know",
            ),
            (
                1234,
                NcclCode::Other(1234),
                "ncclResult_t (1234): a code this version of dist-nccl does not know",
            ),
        ];
        for (raw, code, text) in table {
            assert_eq!(NcclCode::from_result(ncclResult_t(raw)), Some(code));
            assert_eq!(code.result(), ncclResult_t(raw), "{code:?} round trips");
            assert_eq!(code.to_string(), text);
            assert_eq!(NcclCode::check(ncclResult_t(raw)), Err(code));
        }
        // The header's values, not only these numbers.
        assert_eq!(
            NcclCode::from_result(ncclResult_t::ncclRemoteError),
            Some(NcclCode::RemoteError)
        );
        assert_eq!(
            NcclCode::check_started(ncclResult_t::ncclInProgress),
            Ok(())
        );
        assert_eq!(NcclCode::check_started(ncclResult_t::ncclSuccess), Ok(()));
        assert_eq!(
            NcclCode::check_started(ncclResult_t::ncclSystemError),
            Err(NcclCode::SystemError)
        );
    }

    #[test]
    fn an_nccl_error_shows_the_code_its_meaning_and_nccls_text() {
        let e = NcclError::Nccl {
            comm: "nccl comm rank 0/2 on cuda:0".into(),
            op: "all_reduce".into(),
            code: NcclCode::RemoteError,
            text: "remote process exited or there was a network error".into(),
            last: "NET/IB : peer closed".into(),
        };
        assert_eq!(
            e.to_string(),
            "nccl comm rank 0/2 on cuda:0: all_reduce failed: ncclRemoteError (6): a remote \
             process exited early or the network failed (NCCL: remote process exited or there \
             was a network error): NET/IB : peer closed"
        );
        let e = NcclError::Nccl {
            comm: "c".into(),
            op: "split".into(),
            code: NcclCode::InvalidUsage,
            text: "invalid usage".into(),
            last: String::new(),
        };
        assert_eq!(
            e.to_string(),
            "c: split failed: ncclInvalidUsage (5): the call is wrong as made, usually a \
             programming error (NCCL: invalid usage)"
        );
    }
}

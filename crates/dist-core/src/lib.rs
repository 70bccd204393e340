//! Core types of `dist`: the [`Backend`] trait every transport implements, the [`DistError`]
//! they all return, message [`Tag`]s, and the element types and reduce operations that the
//! collectives are defined over. This crate does no network I/O (the [`flight`] recorder writes
//! its record to a file when asked).
//!
//! ```
//! use dist_core::{Backend, DistError, Tag};
//!
//! /// Sends `x` around a ring and returns what arrived from the left neighbour.
//! fn ring_pass(b: &dyn Backend, x: u64) -> Result<u64, DistError> {
//!     let n = b.world_size();
//!     let (left, right) = ((b.rank() + n - 1) % n, (b.rank() + 1) % n);
//!     b.send_tagged(&x.to_le_bytes(), right, Tag::user(7))?;
//!     let mut buf = [0u8; 8];
//!     b.recv_tagged(&mut buf, left, Tag::user(7))?;
//!     Ok(u64::from_le_bytes(buf))
//! }
//! ```
#![warn(missing_docs)]

mod backend;
pub mod collectives;
mod deadline;
mod error;
pub mod flight;
mod types;
mod within;

pub use backend::{Backend, Meta, Tag, Transport, run_beside_scoped};
pub use collectives::Collectives;
pub use deadline::{MAX_TIMEOUT, deadline_after, timeout_problem};
pub use error::{DistError, Result};
pub use types::{DType, Element, ReduceOp};
pub use within::{Timed, Within};

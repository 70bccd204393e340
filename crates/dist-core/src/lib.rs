//! Core types of `dist`: the [`Backend`] trait every transport implements, the [`DistError`]
//! they all return, message [`Tag`]s, the element types and reduce operations, and the
//! collectives, written once: a [`Group`] runs them over any [`Link`](transport::Link) (a
//! transport's byte mover), and [`Collectives`] offers them on every [`Transport`], blocking or
//! as async [`work`] in a [`Scope`] (one thread at a time per group). [`testing`] has a link in
//! memory, with faults to inject. What only a transport's author needs (the link, the memory
//! ranks share on a host, deadline helpers) is in [`transport`], apart from what a program
//! calls. This crate does no network I/O (the [`flight`] recorder
//! writes its record to a file when asked).
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
#![deny(missing_docs)]

mod arena;
mod backend;
pub mod collectives;
mod deadline;
mod error;
pub mod flight;
mod group;
mod link;
mod messages;
mod objects;
pub mod subgroup;
pub mod testing;
pub mod transport;
mod types;
mod within;
pub mod work;

pub use backend::{Backend, Meta, Tag};
pub use collectives::{Collectives, Transport};
pub use deadline::MAX_TIMEOUT;
pub use error::{DistError, Result};
pub use group::{Group, Tuning};
pub use messages::TypedMessages;
pub use objects::{MAX_OBJECT_BYTES, ObjectCollectives};
pub use subgroup::{SplitLink, SubGroup, SubLink, Subgroups};
pub use types::{DType, Element, ReduceOp};
pub use within::{Timed, Within};
pub use work::{Scope, Work};

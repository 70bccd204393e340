//! Sub-groups: [`Subgroups::split`] (MPI_Comm_split) and [`Subgroups::new_group`] (PyTorch's
//! `new_group`), collective over a parent group, each returning a [`Group`](crate::Group) over
//! a [`SubLink`]: some ranks of the root link renumbered from 0, sharing its connections, with
//! tags of their own.
//!
//! ```
//! use std::time::Duration;
//! use dist_core::testing::run_group;
//! use dist_core::{Backend, Collectives, ReduceOp, Subgroups, Tuning};
//!
//! // 4 ranks as 2 rows of 2: each row sums its ranks.
//! let sums = run_group(4, |_| Tuning::default(), Duration::from_secs(10), |g| {
//!     let row = g.split(Some((g.rank() / 2) as u32), 0)?.expect("every rank has a color");
//!     let mut x = [g.rank() as u64];
//!     row.all_reduce(&mut x, ReduceOp::Sum)?;
//!     Ok((row.rank(), x[0]))
//! });
//! let sums: Vec<_> = sums.into_iter().map(|r| r.unwrap()).collect();
//! assert_eq!(sums, [(0, 1), (1, 1), (0, 5), (1, 5)]);
//! ```

mod link;
mod split;

pub use link::{GROUP_ID_BITS, MAX_GROUP_ID, SplitLink, SubLink, SubRecv};
pub use split::{SubGroup, Subgroups};

#[cfg(test)]
mod tests;

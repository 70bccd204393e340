//! For transport authors: what a crate that moves a group's bytes (as `dist-tcp` does) builds
//! on, kept apart from the API a program calls.
//!
//! A transport implements [`Link`] (point-to-point bytes with tags, posted receives, abort
//! notices, and optionally the memory its ranks share on one host, a [`HostArena`]); a
//! [`Group`](crate::Group) runs every collective over it, and the transport's backend offers
//! them through [`Collectives`](crate::Collectives). Nothing here is needed to *use* a
//! backend: a program calls [`Backend`](crate::Backend), [`Collectives`](crate::Collectives)
//! and their errors, at the crate's root.
//!
//! These items follow the crate's version like the rest of its API (their list is kept in
//! `docs/api/dist-core.txt`), but they change when the collectives need something new of a
//! link; a program that uses only the root's items is not touched by that.

pub use crate::arena::{
    ArenaWord, HostArena, direct_reads_pay, host_ranks, read_process, read_process_is_fast,
};
pub use crate::deadline::{deadline_after, timeout_problem};
pub use crate::group::run_beside_scoped;
pub use crate::link::{Link, Notice, PostedRecv, call_in_group, notice_ends};

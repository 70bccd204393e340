//! The public calls, each written once (`ops/collectives.rs`, `ops/p2p.rs`) and exposed five
//! ways by one macro: on
//! [`Ops`] (launched at once), on [`GroupOps`] and [`Group`] (recorded, launched at the group's
//! end, their buffers borrowed until then), and on [`Communicator`] (its stream); and by a
//! second one on [`Capture`] (recorded into a CUDA graph, every buffer borrowed shared for the
//! graph's life, so that the caller's own captured work can read what a call wrote).

use cudarc::driver::CudaSlice;
use dist_core::ReduceOp;

use crate::capture::Capture;
use crate::communicator::Communicator;
use crate::error::Result;
use crate::group::{Group, GroupOps};
use crate::ops::Ops;
use crate::types::NcclType;

macro_rules! calls {
    ($($(#[$m:meta])* fn $name:ident / $core:ident ($($arg:ident: $ty:ty),*);)*) => {
        impl Ops<'_> {
            $(
                $(#[$m])*
                pub fn $name<'x, T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    self.$core($($arg),*).map(drop)
                }
            )*
        }

        impl<'buf> GroupOps<'_, 'buf> {
            $(
                $(#[$m])*
                ///
                /// Recorded in the group and launched at its end; the buffers stay borrowed
                /// until then.
                pub fn $name<'x: 'buf, T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    let guards = self.ops.$core($($arg),*)?;
                    self.group.keep(guards);
                    Ok(())
                }
            )*
        }

        impl<'buf> Group<'buf> {
            $(
                $(#[$m])*
                ///
                /// On the group's first communicator and its stream; recorded and launched
                /// at the group's end, the buffers borrowed until then.
                pub fn $name<'x: 'buf, T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    self.first().$name($($arg),*)
                }
            )*
        }

        impl Communicator {
            $(
                $(#[$m])*
                ///
                /// On the communicator's stream ([`Communicator::stream`]).
                pub fn $name<'x, T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    self.ops().$name($($arg),*)
                }
            )*
        }
    };
}

calls! {
    /// Reduces `send` over all ranks with `op` into `recv` (same length).
    #[doc(alias = "ncclAllReduce")]
    fn all_reduce / all_reduce_g(send: &'x CudaSlice<T>, recv: &'x mut CudaSlice<T>, op: ReduceOp);
    /// All-reduce in place.
    #[doc(alias = "ncclAllReduce")]
    fn all_reduce_in_place / all_reduce_in_place_g(buf: &'x mut CudaSlice<T>, op: ReduceOp);
    /// Copies `buf` on `root` into `buf` on every rank.
    #[doc(alias = "ncclBroadcast")]
    fn broadcast / broadcast_g(buf: &'x mut CudaSlice<T>, root: usize);
    /// Reduces `send` over all ranks into `recv` on `root` (`recv` is required there, of the
    /// same length, and ignored elsewhere).
    #[doc(alias = "ncclReduce")]
    fn reduce / reduce_g(send: &'x CudaSlice<T>, recv: Option<&'x mut CudaSlice<T>>, op: ReduceOp, root: usize);
    /// Every rank's `send` (length k) in rank order into `recv` (k × size).
    #[doc(alias = "ncclAllGather")]
    fn all_gather / all_gather_g(send: &'x CudaSlice<T>, recv: &'x mut CudaSlice<T>);
    /// Reduces `send` (k × size) over all ranks and leaves block `rank` in `recv` (k).
    #[doc(alias = "ncclReduceScatter")]
    fn reduce_scatter / reduce_scatter_g(send: &'x CudaSlice<T>, recv: &'x mut CudaSlice<T>, op: ReduceOp);
    /// Block j of `send` (k × size) to rank j, landing in block `rank` of its `recv`
    /// (NCCL 2.28 or newer).
    #[doc(alias = "ncclAlltoAll")]
    fn all_to_all / all_to_all_g(send: &'x CudaSlice<T>, recv: &'x mut CudaSlice<T>);
    /// Every rank's `send` (k) in rank order into `recv` (k × size) on `root` (NCCL 2.28+).
    #[doc(alias = "ncclGather")]
    fn gather / gather_g(send: &'x CudaSlice<T>, recv: Option<&'x mut CudaSlice<T>>, root: usize);
    /// Block r of `send` (k × size) on `root` into rank r's `recv` (k) (NCCL 2.28+).
    #[doc(alias = "ncclScatter")]
    fn scatter / scatter_g(send: Option<&'x CudaSlice<T>>, recv: &'x mut CudaSlice<T>, root: usize);
    /// Sends `buf` to `peer`, which must post a matching `recv`.
    #[doc(alias = "ncclSend")]
    fn send / send_g(buf: &'x CudaSlice<T>, peer: usize);
    /// Receives into `buf` from `peer`.
    #[doc(alias = "ncclRecv")]
    fn recv / recv_g(buf: &'x mut CudaSlice<T>, peer: usize);
    /// Every rank's `send` (rank r's of `counts[r]` elements) in rank order into `recv`
    /// (`counts`' sum), as sends and receives fused in one NCCL group. Every rank passes the
    /// same `counts`.
    fn all_gather_v / all_gather_v_g(send: &'x CudaSlice<T>, recv: &'x mut CudaSlice<T>, counts: &[usize]);
    /// Every rank's `send` (`counts[r]` elements) in rank order into `recv` on `root`
    /// (`counts`' sum; required there, not used elsewhere), as fused sends and receives.
    fn gather_v / gather_v_g(send: &'x CudaSlice<T>, recv: Option<&'x mut CudaSlice<T>>, counts: &[usize], root: usize);
    /// Block r of `send` on `root` (`counts`' sum; required there, not used elsewhere) into
    /// rank r's `recv` (`counts[r]` elements), as fused sends and receives.
    fn scatter_v / scatter_v_g(send: Option<&'x CudaSlice<T>>, recv: &'x mut CudaSlice<T>, counts: &[usize], root: usize);
    /// `send_counts[j]` elements of `send` (in rank order) to rank j, `recv_counts[j]` from
    /// rank j into `recv` (in rank order), as fused sends and receives. Rank i's
    /// `send_counts[j]` must be rank j's `recv_counts[i]`.
    fn all_to_all_v / all_to_all_v_g(send: &'x CudaSlice<T>, send_counts: &[usize], recv: &'x mut CudaSlice<T>, recv_counts: &[usize]);
}

/// The calls on [`Capture`]: the same, with every buffer borrowed shared for the graph's life
/// (`'buf`), the ones the calls write too (see [`Graph`](crate::Graph) for what that asks of
/// other streams).
macro_rules! capture_calls {
    ($(fn $name:ident / $core:ident ($($arg:ident: $ty:ty),*);)*) => {
        impl<'buf> Capture<'buf> {
            $(
                #[doc = concat!("[`Ops::", stringify!($name), "`], recorded into the graph on the capture's stream and replayed by each [`Graph::launch`](crate::Graph::launch).")]
                pub fn $name<T: NcclType>(&self, $($arg: $ty),*) -> Result<()> {
                    let guards = self.ops().$core($($arg),*)?;
                    self.keep(guards);
                    Ok(())
                }
            )*
        }
    };
}

capture_calls! {
    fn all_reduce / all_reduce_g(send: &'buf CudaSlice<T>, recv: &'buf CudaSlice<T>, op: ReduceOp);
    fn all_reduce_in_place / all_reduce_in_place_g(buf: &'buf CudaSlice<T>, op: ReduceOp);
    fn broadcast / broadcast_g(buf: &'buf CudaSlice<T>, root: usize);
    fn reduce / reduce_g(send: &'buf CudaSlice<T>, recv: Option<&'buf CudaSlice<T>>, op: ReduceOp, root: usize);
    fn all_gather / all_gather_g(send: &'buf CudaSlice<T>, recv: &'buf CudaSlice<T>);
    fn reduce_scatter / reduce_scatter_g(send: &'buf CudaSlice<T>, recv: &'buf CudaSlice<T>, op: ReduceOp);
    fn all_to_all / all_to_all_g(send: &'buf CudaSlice<T>, recv: &'buf CudaSlice<T>);
    fn gather / gather_g(send: &'buf CudaSlice<T>, recv: Option<&'buf CudaSlice<T>>, root: usize);
    fn scatter / scatter_g(send: Option<&'buf CudaSlice<T>>, recv: &'buf CudaSlice<T>, root: usize);
    fn send / send_g(buf: &'buf CudaSlice<T>, peer: usize);
    fn recv / recv_g(buf: &'buf CudaSlice<T>, peer: usize);
    fn all_gather_v / all_gather_v_g(send: &'buf CudaSlice<T>, recv: &'buf CudaSlice<T>, counts: &[usize]);
    fn gather_v / gather_v_g(send: &'buf CudaSlice<T>, recv: Option<&'buf CudaSlice<T>>, counts: &[usize], root: usize);
    fn scatter_v / scatter_v_g(send: Option<&'buf CudaSlice<T>>, recv: &'buf CudaSlice<T>, counts: &[usize], root: usize);
    fn all_to_all_v / all_to_all_v_g(send: &'buf CudaSlice<T>, send_counts: &[usize], recv: &'buf CudaSlice<T>, recv_counts: &[usize]);
}

//! Every collective and point-to-point call of dist-nccl, made on one rank, eagerly (through
//! `Communicator::on`) or recorded into a graph (through [`Capture`]), and what each leaves in its output
//! on one rank: a copy of its input (twice it, for `PreMulSum(2)`).

use cudarc::driver::CudaSlice;
use dist_core::ReduceOp;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use dist_nccl::{Capture, Communicator, Result};

/// Elements per buffer.
pub const K: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    AllReduce,
    AllReducePreMulSum,
    AllReduceInPlace,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
    AllGatherV,
    GatherV,
    ScatterV,
    AllToAllV,
    SendRecv,
}

pub const ALL: [Call; 15] = [
    Call::AllReduce,
    Call::AllReducePreMulSum,
    Call::AllReduceInPlace,
    Call::Broadcast,
    Call::Reduce,
    Call::AllGather,
    Call::ReduceScatter,
    Call::AllToAll,
    Call::Gather,
    Call::Scatter,
    Call::AllGatherV,
    Call::GatherV,
    Call::ScatterV,
    Call::AllToAllV,
    Call::SendRecv,
];

impl Call {
    /// In place: the input is written into `recv`, and `send` is not used.
    pub fn in_place(self) -> bool {
        matches!(self, Call::AllReduceInPlace | Call::Broadcast)
    }

    /// The output on one rank for input element `x`.
    pub fn want(self, x: f32) -> f32 {
        if self == Call::AllReducePreMulSum {
            2.0 * x
        } else {
            x
        }
    }

    /// The call on `stream` (enqueued now). Send and receive to itself go in one group.
    pub fn eager(
        self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        send: &CudaSlice<f32>,
        recv: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let ops = comm.on(stream);
        let c = [K];
        match self {
            Call::AllReduce => ops.all_reduce(send, recv, ReduceOp::Sum),
            Call::AllReducePreMulSum => ops.all_reduce(send, recv, ReduceOp::PreMulSum(2.0)),
            Call::AllReduceInPlace => ops.all_reduce_in_place(recv, ReduceOp::Sum),
            Call::Broadcast => ops.broadcast(recv, 0),
            Call::Reduce => ops.reduce(send, Some(recv), ReduceOp::Sum, 0),
            Call::AllGather => ops.all_gather(send, recv),
            Call::ReduceScatter => ops.reduce_scatter(send, recv, ReduceOp::Sum),
            Call::AllToAll => ops.all_to_all(send, recv),
            Call::Gather => ops.gather(send, Some(recv), 0),
            Call::Scatter => ops.scatter(Some(send), recv, 0),
            Call::AllGatherV => ops.all_gather_v(send, recv, &c),
            Call::GatherV => ops.gather_v(send, Some(recv), &c, 0),
            Call::ScatterV => ops.scatter_v(Some(send), recv, &c, 0),
            Call::AllToAllV => ops.all_to_all_v(send, &c, recv, &c),
            Call::SendRecv => comm.group(|g| {
                let o = g.with(comm)?.on(stream);
                o.send(send, 0)?;
                o.recv(recv, 0)
            }),
        }
    }

    /// The call recorded into `cap`'s graph. Send and receive to itself: the fused form
    /// (all_to_all_v is sends and receives in one NCCL group) and, in `graph.rs`, a group.
    pub fn captured<'buf>(
        self,
        cap: &Capture<'buf>,
        send: &'buf CudaSlice<f32>,
        recv: &'buf CudaSlice<f32>,
    ) -> Result<()> {
        let c: &[usize] = &[K];
        match self {
            Call::AllReduce => cap.all_reduce(send, recv, ReduceOp::Sum),
            Call::AllReducePreMulSum => cap.all_reduce(send, recv, ReduceOp::PreMulSum(2.0)),
            Call::AllReduceInPlace => cap.all_reduce_in_place(recv, ReduceOp::Sum),
            Call::Broadcast => cap.broadcast(recv, 0),
            Call::Reduce => cap.reduce(send, Some(recv), ReduceOp::Sum, 0),
            Call::AllGather => cap.all_gather(send, recv),
            Call::ReduceScatter => cap.reduce_scatter(send, recv, ReduceOp::Sum),
            Call::AllToAll => cap.all_to_all(send, recv),
            Call::Gather => cap.gather(send, Some(recv), 0),
            Call::Scatter => cap.scatter(Some(send), recv, 0),
            Call::AllGatherV => cap.all_gather_v(send, recv, c),
            Call::GatherV => cap.gather_v(send, Some(recv), c, 0),
            Call::ScatterV => cap.scatter_v(Some(send), recv, c, 0),
            Call::AllToAllV | Call::SendRecv => cap.all_to_all_v(send, c, recv, c),
        }
    }
}

//! NCCL's socket transport between the two GPUs, the stand-in for two GPU hosts: the NCCL cases
//! that depend on how ranks reach each other (formation, splits, groups, failures, bounded
//! teardown) run again with NCCL's peer-to-peer and shared-memory transports off, so that NCCL
//! moves every byte over TCP sockets as it would between hosts. `nccl_collectives_socket` covers
//! every collective so; the variant covers the rest. On a host without a CUDA device per rank it
//! is ignored, with the reason, like every GPU case.

use dist_multirank::Variant;

/// The cases' variant `socket`: `CASE::socket::n2`.
pub const SOCKET: Variant = Variant {
    name: "socket",
    sizes: &[2],
    env: &[("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")],
};

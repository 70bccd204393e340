//! The descriptor of a collective call, as every message of the call carries it in its meta,
//! and how two descriptors differ (for the mismatch errors); the collectives' kinds (the one
//! table of their names and codes, which dist-hybrid's NCCL calls, the perf tools and the
//! benches use too), and a rank's position as a heartbeat carries it.

use crate::backend::Meta;
use crate::flight::{OpState, Position};
use crate::types::{DType, ReduceOp};

/// Which collective a call is: its name ([`Kind::name`], [`Kind::parse`]) and its code in the
/// descriptor (`Kind::X as u8`, [`Kind::from_code`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Kind {
    /// [`Collectives::all_reduce`](super::Collectives::all_reduce)
    AllReduce = 1,
    /// [`Collectives::broadcast`](super::Collectives::broadcast)
    Broadcast = 2,
    /// [`Collectives::reduce`](super::Collectives::reduce)
    Reduce = 3,
    /// [`Collectives::all_gather`](super::Collectives::all_gather)
    AllGather = 4,
    /// [`Collectives::gather`](super::Collectives::gather)
    Gather = 5,
    /// [`Collectives::scatter`](super::Collectives::scatter)
    Scatter = 6,
    /// [`Collectives::reduce_scatter`](super::Collectives::reduce_scatter)
    ReduceScatter = 7,
    /// [`Collectives::all_to_all`](super::Collectives::all_to_all)
    AllToAll = 8,
    /// [`Collectives::all_to_all_v`](super::Collectives::all_to_all_v)
    AllToAllV = 9,
    /// [`barrier`](super::barrier): every rank waits for every other.
    Barrier = 10,
    /// [`Collectives::all_gather_v`](super::Collectives::all_gather_v)
    AllGatherV = 11,
    /// [`Collectives::gather_v`](super::Collectives::gather_v)
    GatherV = 12,
    /// [`Collectives::scatter_v`](super::Collectives::scatter_v)
    ScatterV = 13,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 13] = [
        Kind::AllReduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
        Kind::Gather,
        Kind::Scatter,
        Kind::ReduceScatter,
        Kind::AllToAll,
        Kind::AllToAllV,
        Kind::Barrier,
        Kind::AllGatherV,
        Kind::GatherV,
        Kind::ScatterV,
    ];

    /// The collective's name, as in `all_reduce`.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllToAll => "all_to_all",
            Kind::AllToAllV => "all_to_all_v",
            Kind::Barrier => "barrier",
            Kind::AllGatherV => "all_gather_v",
            Kind::GatherV => "gather_v",
            Kind::ScatterV => "scatter_v",
        }
    }

    /// The kind named `name` (the inverse of [`Kind::name`]).
    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The kind whose code is `c` (the inverse of `Kind::X as u8`).
    pub fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == c)
    }

    /// Whether the collective has a root rank (broadcast, reduce, gather, scatter).
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            Kind::Broadcast
                | Kind::Reduce
                | Kind::Gather
                | Kind::Scatter
                | Kind::GatherV
                | Kind::ScatterV
        )
    }

    /// Whether the collective takes a reduce op (all_reduce, reduce, reduce_scatter).
    pub const fn has_op(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }
}

/// The descriptor of one collective call, as it travels in every message's meta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub(crate) kind: u8,
    pub(crate) dtype: u8,
    pub(crate) op: u8,
    pub(crate) root: u32,
    pub(crate) seq: u16,
    pub(crate) count: u64,
}

impl Desc {
    pub(crate) fn encode(&self) -> Meta {
        let mut m = [0u8; 16];
        m[0] = self.kind;
        m[1] = self.dtype;
        m[2] = self.op;
        m[3..6].copy_from_slice(&self.root.to_le_bytes()[..3]);
        m[6..8].copy_from_slice(&self.seq.to_le_bytes());
        m[8..16].copy_from_slice(&self.count.to_le_bytes());
        m
    }

    pub(crate) fn decode(m: &Meta) -> Desc {
        Desc {
            kind: m[0],
            dtype: m[1],
            op: m[2],
            root: u32::from_le_bytes([m[3], m[4], m[5], 0]),
            seq: u16::from_le_bytes([m[6], m[7]]),
            count: u64::from_le_bytes(m[8..16].try_into().expect("8 bytes")),
        }
    }

    fn kind_name(&self) -> String {
        Kind::from_code(self.kind)
            .map_or_else(|| format!("unknown op {}", self.kind), |k| k.name().into())
    }

    fn dtype_name(&self) -> String {
        DType::from_code(self.dtype)
            .map_or_else(|| format!("type {}", self.dtype), |d| d.to_string())
    }

    /// The reduce op's name; `-` for none (code 0), `?` for a code no op has.
    fn op_name(&self) -> &'static str {
        match ReduceOp::from_code(self.op) {
            Some(op) => op.name(),
            None if self.op == 0 => "-",
            None => "?",
        }
    }

    /// `all_reduce(f32 x 100, sum)`, `barrier`.
    pub(crate) fn describe(&self) -> String {
        if self.kind == Kind::Barrier as u8 {
            return Kind::Barrier.name().into();
        }
        let mut s = format!(
            "{}({} x {}",
            self.kind_name(),
            self.dtype_name(),
            self.count
        );
        let kind = Kind::from_code(self.kind);
        if kind.is_some_and(Kind::has_op) {
            s += &format!(", {}", self.op_name());
        }
        if kind.is_some_and(Kind::has_root) {
            s += &format!(", root {}", self.root);
        }
        s + ")"
    }

    /// How `theirs` differs from this (ours), for the error message.
    pub(crate) fn differences(&self, theirs: &Desc) -> String {
        let mut d = Vec::new();
        if self.kind != theirs.kind {
            d.push(format!(
                "it called {} where this rank called {}",
                theirs.kind_name(),
                self.kind_name()
            ));
        } else {
            if self.dtype != theirs.dtype {
                d.push(format!(
                    "element type {} vs {} here",
                    theirs.dtype_name(),
                    self.dtype_name()
                ));
            }
            if self.count != theirs.count {
                d.push(format!("count {} vs {} here", theirs.count, self.count));
            }
            if self.op != theirs.op {
                d.push(format!(
                    "reduce op {} vs {} here",
                    theirs.op_name(),
                    self.op_name()
                ));
            }
            if self.root != theirs.root {
                d.push(format!("root {} vs {} here", theirs.root, self.root));
            }
        }
        if self.seq != theirs.seq && d.is_empty() {
            d.push(format!(
                "it is at collective #{} and this rank at #{} (a rank skipped or added a collective)",
                // Numbered from 1, as in the flight record (the descriptor keeps 16 bits).
                u32::from(theirs.seq) + 1,
                u32::from(self.seq) + 1
            ));
        }
        if d.is_empty() {
            d.push("message sizes differ".into());
        }
        format!("{} ({})", d.join(", "), theirs.describe())
    }
}

/// A rank's position as a heartbeat carries it: the collective's sequence number (0: none),
/// its state (1 queued, 2 started, 3 done, 4 failed) and its kind's code.
pub fn position_to_wire(p: Option<Position>) -> (u64, u8, u8) {
    let Some(p) = p else { return (0, 0, 0) };
    let state = match p.state {
        OpState::Queued => 1,
        OpState::Started => 2,
        OpState::Done => 3,
        OpState::Failed => 4,
    };
    let kind = Kind::parse(p.op).map_or(0, |k| k as u8);
    (p.seq, state, kind)
}

/// The inverse of [`position_to_wire`]; `None` for "none" and for what it cannot read.
pub fn position_from_wire(seq: u64, state: u8, kind: u8) -> Option<Position> {
    let state = match state {
        1 => OpState::Queued,
        2 => OpState::Started,
        3 => OpState::Done,
        4 => OpState::Failed,
        _ => return None,
    };
    let op = Kind::from_code(kind)?.name();
    (seq != 0).then_some(Position { seq, op, state })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_name_and_code() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.name()), Some(k), "{k:?}");
            assert_eq!(Kind::from_code(k as u8), Some(k), "{k:?}");
        }
        assert_eq!(Kind::parse("sendrecv"), None);
        assert_eq!(Kind::parse("All_Reduce"), None);
        assert_eq!(Kind::from_code(0), None);
        assert_eq!(Kind::from_code(14), None);
    }

    #[test]
    fn the_descriptor_names_reduce_ops_from_their_table() {
        let d = |kind: Kind, op: u8| Desc {
            kind: kind as u8,
            dtype: DType::F32 as u8,
            op,
            root: 2,
            seq: 0,
            count: 8,
        };
        for op in ReduceOp::ALL {
            assert_eq!(
                d(Kind::AllReduce, op.code()).describe(),
                format!("all_reduce(f32 x 8, {})", op.name())
            );
        }
        assert_eq!(d(Kind::Reduce, 0).describe(), "reduce(f32 x 8, -, root 2)");
        assert_eq!(
            d(Kind::Broadcast, 0).describe(),
            "broadcast(f32 x 8, root 2)"
        );
        assert!(
            d(Kind::AllReduce, 1)
                .differences(&d(Kind::AllReduce, 99))
                .starts_with("reduce op ? vs sum here")
        );
    }
}

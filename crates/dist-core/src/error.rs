//! `DistError`, the one error type of every dist backend.

use std::time::Duration;

/// Shorthand for results whose error is [`DistError`].
pub type Result<T, E = DistError> = std::result::Result<T, E>;

/// Everything that can go wrong in a dist operation. Each variant names the reporting rank and,
/// where there is one, the peer, the operation and the sizes involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A wait passed its deadline while the peer was (as far as we know) still connected.
    #[error("rank {rank}: {op} timed out after {waited:.3?} waiting for peer {peer}")]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// What was being waited for, such as `recv(tag 0, 4096 bytes)`.
        op: String,
        /// The rank that did not answer.
        peer: usize,
        /// How long was waited.
        waited: Duration,
    },

    /// The connection to a peer closed or broke: the process exited, was killed, or reset it.
    #[error("rank {rank}: peer {peer} gone during {op}: {cause}")]
    PeerGone {
        /// The rank that noticed.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
        /// The operation that noticed it.
        op: String,
        /// What the transport saw (end of stream, reset, …).
        cause: String,
    },

    /// Nothing has come from a peer for longer than the peer timeout, although its connection is
    /// open: the process is stopped, the network between the two is partitioned, or its host is
    /// down. (A live peer's transport sends heartbeats even while the peer computes.)
    #[error(
        "rank {rank}: peer {peer} unresponsive during {op}: nothing heard from it for {silent:.1?} \
         (stopped, partitioned, or its host down){}",
        if position.is_empty() { String::new() } else { format!("; {position}") }
    )]
    PeerUnresponsive {
        /// The rank that noticed.
        rank: usize,
        /// The silent rank.
        peer: usize,
        /// The operation that noticed it.
        op: String,
        /// How long nothing had been heard from it when it was declared unresponsive.
        silent: Duration,
        /// Where the peer last said it was (its last heartbeat), if known.
        position: String,
    },

    /// A message's length differs from the buffer posted for it. Nothing was written to the
    /// buffer and the message stays queued.
    #[error(
        "rank {rank}: {op} from peer {peer}: expected {expected} bytes, got a message of {got}"
    )]
    SizeMismatch {
        /// The receiving rank.
        rank: usize,
        /// The sender.
        peer: usize,
        /// The operation.
        op: String,
        /// The buffer's length in bytes.
        expected: usize,
        /// The message's length in bytes.
        got: usize,
    },

    /// A rank argument outside `0..world_size`.
    #[error("rank {rank}: {op}: rank {given} is out of range for world size {world_size}")]
    InvalidRank {
        /// The calling rank.
        rank: usize,
        /// The operation.
        op: String,
        /// The rank that was passed.
        given: usize,
        /// The job's size.
        world_size: usize,
    },

    /// An argument other than a rank is invalid (a buffer of the wrong length, a zero world size).
    #[error("rank {rank}: {op}: {reason}")]
    InvalidArgument {
        /// The calling rank.
        rank: usize,
        /// The operation.
        op: String,
        /// What is wrong.
        reason: String,
    },

    /// Not every rank joined the job before the init deadline.
    #[error(
        "rank {rank}: rendezvous failed after {waited:.1?}: {joined} of {world_size} ranks joined, \
         missing ranks {missing:?}{}",
        if detail.is_empty() { String::new() } else { format!(" ({detail})") }
    )]
    RendezvousFailed {
        /// The rank that gave up.
        rank: usize,
        /// How many ranks had joined.
        joined: usize,
        /// The expected number of ranks.
        world_size: usize,
        /// The ranks that had not joined (as far as this rank knows).
        missing: Vec<usize>,
        /// How long was waited.
        waited: Duration,
        /// The last problem seen, such as the last connection error.
        detail: String,
    },

    /// A handshake was refused, by us or by the other side.
    #[error("rank {rank}: handshake with {peer} refused: {reason}")]
    HandshakeRefused {
        /// The rank reporting the refusal.
        rank: usize,
        /// Who the other side was (an address, or a rank).
        peer: String,
        /// Why, as the refusing side put it.
        reason: String,
    },

    /// The ranks disagree about a collective: a different operation, element type, count, reduce
    /// op or root.
    #[error("rank {rank}: {op}: rank {peer} disagrees: {detail}")]
    CollectiveMismatch {
        /// The rank that noticed.
        rank: usize,
        /// This rank's call.
        op: String,
        /// The rank whose call differs.
        peer: usize,
        /// How the two calls differ.
        detail: String,
    },

    /// Another rank failed a collective and told this one to stop.
    ///
    /// In a sub-group's error, `rank` and `origin` are group ranks and `op` names the group
    /// with the backend ranks beside; where the rank at fault is no member of the group,
    /// `origin` is its backend rank, `reason` starts with [`DistError::OUTSIDE_GROUP`], and the
    /// text says "backend rank".
    #[error(
        "rank {rank}: {op} aborted because {} failed: {reason}",
        origin_words(*origin, reason)
    )]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// This rank's call.
        op: String,
        /// The rank that failed first.
        origin: usize,
        /// The rank known failed (it died, went silent, or was named at fault), where the
        /// abort names one: then `origin` too. `None` where `origin` reported a failure of its
        /// own call (a timeout, a mismatch, a revocation naming nobody), which says nothing of
        /// whether it lives.
        culprit: Option<usize>,
        /// Its error.
        reason: String,
    },

    /// Two threads called into one group at once: the later call is refused at once (and the
    /// group aborted, so that no rank waits for it), and the earlier one fails with this too.
    /// A group takes calls from one thread at a time; see
    /// [`Collectives`](crate::Collectives).
    #[error(
        "rank {rank}: {op}: {detail}; a group takes collectives from one thread at a time \
         (use a group per thread)"
    )]
    ConcurrentUse {
        /// The rank reporting.
        rank: usize,
        /// This thread's call.
        op: String,
        /// What the other thread was doing.
        detail: String,
    },

    /// The group was revoked after a failure (or by a rank that asked for it: dist-tcp's
    /// `TcpBackend::revoke`): every pending and later operation of its epoch ends with this at
    /// once. The survivors agree on the next epoch's members by recovering (dist-tcp's
    /// `TcpBackend::recover`); this epoch's group stays revoked.
    #[error(
        "rank {rank}: {op}: group epoch {epoch} revoked: {}",
        revoked_words(*culprit, reason)
    )]
    Revoked {
        /// The rank reporting.
        rank: usize,
        /// This rank's operation.
        op: String,
        /// The epoch revoked (0 for a group formed at init, one more for each recovery).
        epoch: u64,
        /// The rank whose failure revoked it, where known (a rank of that epoch).
        culprit: Option<usize>,
        /// The first failure seen, or why the group was revoked.
        reason: String,
    },

    /// The survivors of a failure agreed on the next epoch's members without this rank (they
    /// judged it failed, or it came to the agreement too late): it must stop.
    #[error(
        "rank {rank}: left out of group epoch {epoch}, whose members (by job rank) are \
         {members:?}: {reason}"
    )]
    Excluded {
        /// The rank reporting (its rank in the epoch before).
        rank: usize,
        /// The epoch it is left out of.
        epoch: u64,
        /// The members agreed, by job rank (a rank's number in the epoch the job began with).
        members: Vec<usize>,
        /// Why, as far as this rank can tell.
        reason: String,
    },

    /// A configuration value or environment variable is missing or malformed.
    #[error("configuration error: {what}: {reason}")]
    Config {
        /// The setting or variable.
        what: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An operating-system I/O error, with what was being done.
    #[error("rank {rank}: {context}: {source}")]
    Io {
        /// The rank it happened on.
        rank: usize,
        /// What was being done (`bind 0.0.0.0:29500`, `connect to rank 0 at …`).
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// How an abort's text names its origin: a rank of the reporting group, or (where the reason
/// says it is outside that group) a backend rank.
fn origin_words(origin: usize, reason: &str) -> String {
    if reason.starts_with(DistError::OUTSIDE_GROUP) {
        format!("backend rank {origin}")
    } else {
        format!("rank {origin}")
    }
}

/// How a revocation names its cause.
fn revoked_words(culprit: Option<usize>, reason: &str) -> String {
    match culprit {
        Some(c) => format!("rank {c} failed: {reason}"),
        None => reason.to_string(),
    }
}

impl DistError {
    /// How the reason of a sub-group's [`DistError::Aborted`] begins when the rank at fault is
    /// no member of the group: its `origin` is then a backend rank (and said so).
    pub const OUTSIDE_GROUP: &'static str = "(outside this group) ";

    /// The same error, its operation said as `context: op` (for an error that names one), so a
    /// low-level wait's error says what it was part of, e.g. "form the group: recv from 0".
    #[must_use]
    pub fn with_op(self, context: &str) -> DistError {
        self.map_op(|op| format!("{context}: {op}"))
    }

    /// The same error, its operation (for an error that names one) replaced by `f(op)`: the one
    /// path by which an error is relabelled ([`DistError::with_op`] is `context: op`).
    #[must_use]
    pub fn map_op(mut self, f: impl FnOnce(&str) -> String) -> DistError {
        if let Some(op) = self.op_mut() {
            *op = f(op);
        }
        self
    }

    /// The operation this error names, if it names one.
    pub fn op(&self) -> Option<&str> {
        match self {
            DistError::Timeout { op, .. }
            | DistError::PeerGone { op, .. }
            | DistError::PeerUnresponsive { op, .. }
            | DistError::SizeMismatch { op, .. }
            | DistError::InvalidRank { op, .. }
            | DistError::InvalidArgument { op, .. }
            | DistError::CollectiveMismatch { op, .. }
            | DistError::Aborted { op, .. }
            | DistError::Revoked { op, .. }
            | DistError::ConcurrentUse { op, .. } => Some(op),
            _ => None,
        }
    }

    /// The operation this error names, if it names one (every variant says whether it does).
    fn op_mut(&mut self) -> Option<&mut String> {
        match self {
            DistError::Timeout { op, .. }
            | DistError::PeerGone { op, .. }
            | DistError::PeerUnresponsive { op, .. }
            | DistError::SizeMismatch { op, .. }
            | DistError::InvalidRank { op, .. }
            | DistError::InvalidArgument { op, .. }
            | DistError::CollectiveMismatch { op, .. }
            | DistError::Aborted { op, .. }
            | DistError::Revoked { op, .. }
            | DistError::ConcurrentUse { op, .. } => Some(op),
            DistError::RendezvousFailed { .. }
            | DistError::Excluded { .. }
            | DistError::HandshakeRefused { .. }
            | DistError::Config { .. }
            | DistError::Io { .. } => None,
        }
    }

    /// The peer this error is about, if it names one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            DistError::Timeout { peer, .. }
            | DistError::PeerGone { peer, .. }
            | DistError::PeerUnresponsive { peer, .. }
            | DistError::SizeMismatch { peer, .. }
            | DistError::CollectiveMismatch { peer, .. } => Some(*peer),
            DistError::Aborted { origin, .. } => Some(*origin),
            DistError::Revoked { culprit, .. } => *culprit,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_rank_peer_and_sizes() {
        let e = DistError::SizeMismatch {
            rank: 1,
            peer: 3,
            op: "recv(tag 0)".into(),
            expected: 8,
            got: 16,
        };
        assert_eq!(
            e.to_string(),
            "rank 1: recv(tag 0) from peer 3: expected 8 bytes, got a message of 16"
        );
        assert_eq!(e.peer(), Some(3));
        let e = DistError::RendezvousFailed {
            rank: 0,
            joined: 2,
            world_size: 4,
            missing: vec![2, 3],
            waited: Duration::from_secs(5),
            detail: String::new(),
        };
        assert_eq!(
            e.to_string(),
            "rank 0: rendezvous failed after 5.0s: 2 of 4 ranks joined, missing ranks [2, 3]"
        );
    }

    #[test]
    fn with_op_and_map_op_relabel_only_errors_that_name_an_op() {
        let e = DistError::Timeout {
            rank: 0,
            op: "recv from 1".into(),
            peer: 1,
            waited: Duration::from_secs(1),
        };
        let e = e.with_op("form the group");
        assert_eq!(
            e.to_string(),
            "rank 0: form the group: recv from 1 timed out after 1.000s waiting for peer 1"
        );
        let e = e.map_op(|op| format!("{op} #3"));
        assert!(
            e.to_string()
                .contains(": form the group: recv from 1 #3 timed out")
        );
        let e = DistError::Config {
            what: "port".into(),
            reason: "bad".into(),
        }
        .with_op("form the group");
        assert_eq!(e.to_string(), "configuration error: port: bad");
    }
}

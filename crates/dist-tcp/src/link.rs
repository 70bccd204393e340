//! The TCP transport's [`Link`]: what a [`TcpBackend`](crate::TcpBackend)'s collective group
//! moves its bytes with. A send writes one frame (beside a posted receive, reading that
//! receive's socket whenever this one is full); a posted receive is filled straight from the
//! socket; an abort is a frame to every peer.

use std::sync::Arc;
use std::time::Instant;

use dist_core::flight::FlightRecorder;
use dist_core::transport::Link;
use dist_core::{DistError, Meta, Result, SplitLink, Tag};

use crate::peer::{self, AbortNotice, Peer, TcpRecv};
use crate::wire::FrameKind;
use crate::{PARALLEL_MIN, Shared};

/// The TCP transport's [`Link`]: frames over the mesh of connections, a posted receive filled
/// straight from the socket, abort notices as frames. A [`TcpBackend`](crate::TcpBackend)'s collective group runs
/// over it.
#[derive(Clone)]
pub struct TcpLink(pub(crate) Arc<Shared>);

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("rank", &self.0.rank)
            .field("world_size", &self.0.world)
            .finish()
    }
}

impl TcpLink {
    pub(crate) fn peer(&self, r: usize, op: &dyn Fn() -> String) -> Result<&Peer> {
        self.0
            .peers
            .get(r)
            .map(|p| &**p)
            .ok_or_else(|| DistError::InvalidRank {
                rank: self.0.rank,
                op: op(),
                given: r,
                world_size: self.0.world,
            })
    }
}

impl TcpLink {
    /// [`Link::abort`] naming `culprit` at fault, or `first` as the origin only.
    fn abort_naming(
        &self,
        tag: Tag,
        call: Option<u64>,
        reason: &str,
        culprit: Option<usize>,
        first: Option<usize>,
    ) {
        let shared = &self.0;
        // A rank that is no rank of the job names none ([`dist_core::Group::abort`] refuses
        // one; a caller of the link itself gets the abort without it), decided before anything
        // is recorded or sent.
        let in_job = |named: Option<usize>| match named {
            Some(c) if c >= shared.world => {
                tracing::warn!(
                    rank = shared.rank,
                    named = c,
                    world = shared.world,
                    "abort naming no rank of the job: sent naming none"
                );
                None
            }
            c => c,
        };
        let (culprit, first) = (in_job(culprit), in_job(first));
        // Kept here too (the list is bounded), so that this rank's other waits in this call
        // end with it whatever notices came before.
        shared.note_abort(AbortNotice {
            from: shared.rank,
            culprit,
            first,
            tag,
            call,
            reason: reason.to_string(),
        });
        // Receivers refuse a longer notice (a protocol error): send at most that much of it.
        let mut cut = reason.len().min(peer::ABORT_MAX);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        shared.send_abort_notices(tag, call, &reason[..cut], culprit, first);
        shared.write_trace();
    }
}

impl Link for TcpLink {
    type Recv<'a> = TcpRecv<'a>;

    fn rank(&self) -> usize {
        self.0.rank
    }

    fn world_size(&self) -> usize {
        self.0.world
    }

    /// Writes one frame to `dst`. Beside a posted receive, one thread keeps both directions
    /// going: the frame is written without blocking and, whenever the socket is full, the
    /// receive's socket is read. With cores to spare ([`TcpConfig::parallel`](crate::TcpConfig::parallel)) a large send
    /// instead blocks on this thread while the I/O thread takes the receive: the two
    /// copies run on two cores.
    fn send(
        &self,
        data: &[u8],
        dst: usize,
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        beside: Option<&TcpRecv<'_>>,
    ) -> Result<()> {
        let op = || format!("send to {dst} (tag {tag}, {} bytes)", data.len());
        let dst_peer = self.peer(dst, &op)?;
        let long = self.0.parallel && data.len() >= PARALLEL_MIN;
        match beside.and_then(|r| r.id().map(|id| (r.peer(), id))) {
            Some((src, id)) if !long => {
                dst_peer.send_while_receiving(tag.to_wire(), data, meta, &op, src, id, deadline)
            }
            Some((src, _)) => {
                src.wake_reader_now();
                dst_peer.send(FrameKind::Data, tag.to_wire(), data, meta, &op, deadline)
            }
            None => dst_peer.send(FrameKind::Data, tag.to_wire(), data, meta, &op, deadline),
        }
    }

    /// Posts the receive in `src`'s table: the payload lands in `buf` as it arrives, with no
    /// copy, whichever thread reads the socket.
    unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        src: usize,
        tag: Tag,
        deadline: Instant,
    ) -> Result<TcpRecv<'a>> {
        let len = buf.len();
        let peer = self.peer(src, &|| format!("recv from {src} (tag {tag}, {len} bytes)"))?;
        // SAFETY: the caller does not leak the handle (this function's own contract). (Tests:
        // `a_receive_whose_wait_unwinds_is_withdrawn`, every collective over TCP.)
        Ok(unsafe { peer.post(buf, tag.to_wire(), deadline, None) })
    }

    /// The length and meta of the next message queued from `src` on `tag`, if one has arrived
    /// that no receive has taken (after a [`DistError::SizeMismatch`], the message that did not
    /// fit).
    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        self.0.peers.get(src)?.peek(tag.to_wire())
    }

    /// Remembers the abort here (this rank's later collectives, and other threads' waits on
    /// system tags, fail at once with it, as they do on the ranks that hear of it), sends an
    /// abort frame naming `culprit` (meta bytes 0..8, rank + 1) and `call` (bytes 8..16, 0 for
    /// none) to every peer, and writes the flight record (`DIST_TRACE_DIR`). The notices go
    /// out from one thread, in one loop of non-blocking writes; this waits for it 500 ms at
    /// most, so a peer that does not read (stopped, or its buffers full) holds nobody up. The
    /// other ranks see it in [`TcpBackend::abort_notices`](crate::TcpBackend::abort_notices).
    fn abort(&self, tag: Tag, call: Option<u64>, reason: &str, culprit: Option<usize>) {
        self.abort_naming(tag, call, reason, culprit, None);
    }

    /// As [`TcpLink::abort`], the frame naming `origin` with `peer::ORIGIN_ONLY` set: the
    /// receivers' errors name it, and nobody notes it failed.
    fn pass_on_abort(&self, tag: Tag, call: Option<u64>, reason: &str, origin: usize) {
        self.abort_naming(tag, call, reason, None, Some(origin));
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        // Every collective asks: the common answer costs one atomic load.
        if !self.0.aborts.raised() {
            return None;
        }
        self.0.aborts.first().map(|n| (n.origin(), n.reason))
    }

    fn abort_notice_for(&self, tag: Tag, call: u64) -> Option<dist_core::transport::Notice> {
        let n = self.0.aborts.ending(tag, Some(call))?;
        Some(dist_core::transport::Notice {
            origin: n.origin(),
            culprit: n.culprit,
            call: dist_core::transport::call_in_group(n.tag, n.call, tag),
            reason: n.reason,
        })
    }

    /// Kept in the backend's abort list, which its waits consult when a notice has come.
    fn enter_call(&self, tag: Tag, call: u64) {
        if self.0.aborts.enter_call(tag, call) {
            for p in &self.0.peers {
                p.wake();
            }
        }
    }

    /// One group per backend: its own, formed at init, holds the link for the backend's whole
    /// life, so a group a caller forms over the link (a clone of it) is refused.
    fn claim_group(&self) -> bool {
        !self
            .0
            .group_claimed
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    fn release_group(&self) {
        self.0
            .group_claimed
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn flight(&self) -> Option<&FlightRecorder> {
        Some(&self.0.flight)
    }

    /// This rank's position from its own record, every live peer's from a heartbeat it sends
    /// when asked (within `record::ASK_WAIT`; else from its last one).
    fn positions(&self) -> Option<String> {
        Some(self.0.positions_text())
    }

    /// On a revoked backend, [`DistError::Revoked`] naming the epoch and the rank at fault
    /// (an elastic backend revokes itself on the failure an error names first; `elastic.rs`).
    fn label_error(&self, e: DistError) -> DistError {
        self.0.label(e)
    }

    /// The host arena of a job formed at init (also where shared memory is off: it then
    /// says it is incomplete, and the group runs its collectives over messages).
    fn arena(&self) -> Option<&dyn dist_core::transport::HostArena> {
        self.0
            .arena
            .as_ref()
            .map(|a| a as &dyn dist_core::transport::HostArena)
    }
}

/// The root of a [`TcpBackend`](crate::TcpBackend)'s sub-groups ([`dist_core::Subgroups`]):
/// each holds a clone of this link (a shared handle on the connections, not a borrow of the
/// backend).
impl SplitLink for TcpLink {
    type Root = TcpLink;

    fn root_link(&self) -> &TcpLink {
        self
    }

    fn root_rank(&self, r: usize) -> usize {
        r
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dist_core::collectives::COLLECTIVE_TAG;
    use dist_core::transport::Link;
    use dist_core::{DistError, Transport};

    use crate::TcpBackend;

    fn alone() -> TcpBackend {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = TcpBackend::builder(0, 1, format!("127.0.0.1:{port}"))
            .init_timeout(Duration::from_secs(20));
        TcpBackend::with_config(cfg).unwrap()
    }

    /// `Group::abort` naming a culprit past the group (`usize::MAX`, whose rank + 1 has no room
    /// in the notice) is refused with `InvalidRank`, nothing recorded; it used to record the
    /// abort, then panic on the overflow while writing the notice.
    #[test]
    fn an_abort_naming_no_rank_is_refused_before_anything_is_recorded() {
        let b = alone();
        let e = b
            .group()
            .abort(COLLECTIVE_TAG, "given up", Some(usize::MAX))
            .unwrap_err();
        match &e {
            DistError::InvalidRank {
                rank: 0,
                given: usize::MAX,
                world_size: 1,
                ..
            } => {}
            other => panic!("expected InvalidRank, got {other}"),
        }
        assert!(b.abort_notices().is_empty(), "{:?}", b.abort_notices());
        assert_eq!(b.group().link().abort_notice(), None);
        // A rank of the group is accepted, and recorded.
        b.group()
            .abort(COLLECTIVE_TAG, "given up", Some(0))
            .unwrap();
        assert_eq!(
            b.group().link().abort_notice(),
            Some((0, "given up".into()))
        );
    }

    /// The link itself, called with such a culprit, aborts naming none, without a panic.
    #[test]
    fn the_link_sends_an_abort_naming_no_rank_as_naming_none() {
        let b = alone();
        let link = b.group().link();
        link.abort(COLLECTIVE_TAG, Some(3), "given up", Some(usize::MAX));
        let n = b.abort_notices();
        assert_eq!(n.len(), 1, "{n:?}");
        assert_eq!((n[0].culprit, n[0].from), (None, 0));
    }
}

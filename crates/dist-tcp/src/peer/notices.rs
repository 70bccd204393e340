//! One frame to many peers from one thread (abort notices): non-blocking writes to every
//! connection in one loop, `poll` for room on those whose socket is full, so that a peer that
//! does not read holds up neither the others nor the thread past its deadline.

use super::*;

/// How often a peer whose writer another send holds is tried again (a freed writer wakes no one
/// outside its own waiters), and a full ring when other peers are waited for too.
const BUSY_RETRY: Duration = Duration::from_millis(1);

#[cfg(test)]
thread_local! {
    /// Passes of [`Peer::send_to_all`]'s loop on this thread (tests count its wake-ups).
    pub(super) static SEND_TO_ALL_PASSES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One peer's frame on its way.
struct Out<'a> {
    peer: &'a Peer,
    /// The writer, once taken: held until the frame is written or given up (a frame half
    /// written must not be followed by another sender's).
    w: Option<WriterGuard<'a>>,
    /// What is left of a heartbeat written in part, which goes out first.
    hb_rest: Vec<u8>,
    sent: usize,
    started: Instant,
}

impl Peer {
    /// Writes the frame (`kind`, `tag`, `data`, `meta`) to every peer in `peers` that has a
    /// connection, by `deadline`, from this thread alone. A peer whose frame is not written by
    /// then has its connection closed (a frame may be half written: see `send_failed`); one
    /// whose writer stays held by another send is skipped. `op` names the operation.
    pub(crate) fn send_to_all(
        peers: &[&Peer],
        kind: FrameKind,
        tag: u64,
        data: &[u8],
        meta: Meta,
        deadline: Instant,
        op: &dyn Fn(usize) -> String,
    ) {
        let header = FrameHeader {
            kind,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut left: Vec<Out<'_>> = peers
            .iter()
            .filter(|p| !p.loopback && p.writer().is_some())
            .map(|&peer| Out {
                peer,
                w: None,
                hb_rest: Vec::new(),
                sent: 0,
                started: Instant::now(),
            })
            .collect();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !left.is_empty() {
            #[cfg(test)]
            SEND_TO_ALL_PASSES.with(|p| p.set(p.get() + 1));
            // A writer held by another send, or a full ring: neither has a descriptor to poll.
            let mut busy = false;
            let mut rings = 0usize;
            fds.clear();
            left.retain_mut(|o| {
                let Some(writer) = o.peer.writer() else {
                    return false;
                };
                if o.w.is_none() {
                    let Some(w) = writer.lock_by(Instant::now()) else {
                        busy = true;
                        return true;
                    };
                    if w.broken.is_some() || o.peer.lock().closed.is_some() {
                        return false;
                    }
                    o.hb_rest = w.hb[FRAME_HEADER_LEN - w.hb_left..].to_vec();
                    o.started = Instant::now();
                    o.w = Some(w);
                }
                let total = o.hb_rest.len() + header.len() + data.len();
                match o.push(&header, data) {
                    Push::Done => false,
                    Push::Blocked(Some(fd)) => {
                        fds.push(libc::pollfd {
                            fd,
                            events: libc::POLLOUT,
                            revents: 0,
                        });
                        true
                    }
                    Push::Blocked(None) => {
                        busy = true;
                        rings += 1;
                        true
                    }
                    Push::Failed(e) => {
                        o.fail(e, &op, total);
                        false
                    }
                }
            });
            if left.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                for o in &mut left {
                    if o.w.is_some() {
                        let total = o.hb_rest.len() + header.len() + data.len();
                        o.fail(std::io::ErrorKind::TimedOut.into(), &op, total);
                    } else {
                        tracing::debug!(
                            rank = o.peer.me,
                            peer = o.peer.rank,
                            "{}: another send held the connection until the deadline",
                            op(o.peer.rank)
                        );
                    }
                }
                break;
            }
            let mut wait = deadline - now;
            if let [o] = &mut left[..]
                && rings == 1
                && fds.is_empty()
            {
                // The one frame left waits for room in a ring: sleep on the ring's own wake-up
                // (the consumer's read), which also sees the peer hang up.
                let total = o.hb_rest.len() + header.len() + data.len();
                let waited = o.w.as_ref().map_or(Ok(()), |w| w.wait_room(wait));
                if let Err(e) = waited {
                    o.fail(e, &op, total);
                    break;
                }
                continue;
            }
            if busy {
                wait = wait.min(BUSY_RETRY);
            }
            // An error ends this wait early; the loop looks at every socket again either way.
            let _ = crate::sys::poll_many(&mut fds, wait);
        }
    }
}

/// What one round of writes to a peer ended with.
enum Push {
    /// The frame is written (the writer is let go).
    Done,
    /// The socket (or ring) is full: wait for room on this fd (a ring has none: look again
    /// shortly).
    Blocked(Option<std::os::fd::RawFd>),
    Failed(std::io::Error),
}

impl Out<'_> {
    /// Writes what it can of the frame without blocking.
    fn push(&mut self, header: &[u8], data: &[u8]) -> Push {
        let Out {
            w, hb_rest, sent, ..
        } = self;
        let Some(g) = w.as_mut() else {
            return Push::Done;
        };
        let mut bufs = [
            IoSlice::new(hb_rest),
            IoSlice::new(header),
            IoSlice::new(data),
        ];
        let mut bufs = &mut bufs[..];
        IoSlice::advance_slices(&mut bufs, *sent);
        loop {
            if bufs.is_empty() {
                // On a sealed connection, the record the frame ends in goes out too.
                match g.flush_now() {
                    Ok(()) => {}
                    Err(e) if would_block(&e) => return Push::Blocked(g.room_fd()),
                    Err(e) => return Push::Failed(e),
                }
                g.hb_left = g.hb_left.saturating_sub(*sent);
                *w = None;
                return Push::Done;
            }
            match g.try_write(bufs) {
                Ok(0) => return Push::Failed(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    *sent += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if would_block(&e) => return Push::Blocked(g.room_fd()),
                Err(e) => return Push::Failed(e),
            }
        }
    }

    /// Gives up this peer's frame: its connection is closed (the frame may be half written).
    fn fail(&mut self, e: std::io::Error, op: &dyn Fn(usize) -> String, total: usize) {
        let (peer, started, sent) = (self.peer, self.started, self.sent);
        if let Some(mut w) = self.w.take() {
            w.hb_left = w.hb_left.saturating_sub(sent);
            // An abort notice that could not go out: nothing to wait for.
            let err = peer.send_failed(&mut w, e, started, &|| op(peer.rank), (sent, total), None);
            tracing::debug!(rank = peer.me, peer = peer.rank, error = %err, "frame not delivered");
        }
    }
}

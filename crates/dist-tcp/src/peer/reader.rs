//! The reader thread of a connection: it moves frames along while someone waits, drains the
//! socket now and then while nobody does, and tells the backend when the connection ends.

use std::os::fd::AsRawFd;

use super::*;

impl Peer {
    /// The reader thread's body, until the connection ends. While a receiver sleeps waiting on
    /// this peer, or a frame is half read, it blocks until bytes arrive and moves them along.
    /// While receives come and go on this peer it stays off the socket, so that a spinning
    /// receiver reads its message itself with no thread switch, and drains the socket every
    /// [`IDLE_DRAIN`] (unexpected messages must not fill the sender's buffers while nobody
    /// receives). Once nothing has been posted or taken on this peer for [`IDLE_QUIET`], it
    /// waits for the socket instead (up to [`IDLE_POLL`] at a time), so that the readers of the
    /// peers a rank is not talking to cost nothing while they wait and drain what arrives at
    /// once (with many ranks, waking every reader every [`IDLE_DRAIN`] took the whole machine:
    /// `docs/scale.md`).
    pub(crate) fn read_loop(&self, probe: TcpStream) {
        self.read_frames(probe);
        // The connection has ended: tell the backend (outside every lock of this peer).
        let cause = self.lock().closed.clone();
        if let (Some(sink), Some(cause)) = (self.on_close.get(), cause) {
            sink(self.rank, cause);
        }
    }

    fn read_frames(&self, probe: TcpStream) {
        let Some(rx) = &self.rx else { return };
        let mut held: Option<(Option<Instant>, u64)> = None;
        let mut mid_frame = false;
        // The events count last seen changing on this peer, and when.
        let mut last_event = (0u64, Instant::now());
        loop {
            #[cfg(test)]
            self.reader_turns.fetch_add(1, Ordering::Relaxed);
            let wait = {
                let mut st = self.lock();
                loop {
                    if st.closed.is_some() {
                        return;
                    }
                    if let Some((until, seen)) = held.take() {
                        // A message waits for its receive (or, for flow control, for room in
                        // the queue): a post or a take moves it on, as does the grace period
                        // ending. Events since it was routed are rechecked at once.
                        let limit = until.map_or(HOLD_RECHECK, |u| {
                            u.saturating_duration_since(Instant::now())
                        });
                        if !st.closing && st.events == seen && !limit.is_zero() {
                            st = self.reader_sleep(st, limit, true);
                        }
                        if st.closed.is_some() {
                            return;
                        }
                        break Wait::Drain;
                    }
                    let sleeping = st.posted.iter().any(|p| !matches!(p.slot, Slot::Done(_)));
                    let spinning = self.spinners.load(Ordering::Acquire) > 0;
                    if st.closing || ((sleeping || mid_frame) && !spinning) {
                        break Wait::Socket;
                    }
                    if st.events != last_event.0 {
                        last_event = (st.events, Instant::now());
                    } else if !sleeping && !spinning && last_event.1.elapsed() >= IDLE_QUIET {
                        break Wait::Quiet;
                    }
                    st = self.reader_sleep(st, IDLE_DRAIN, false);
                    if st.closed.is_none() {
                        break Wait::Drain;
                    }
                }
            };
            if let Wait::Quiet = wait {
                // Nothing posted here for a while: wait for bytes (a frame nobody waits for, a
                // heartbeat, an abort notice, the end of the stream), then drain them. A post
                // meanwhile needs no wake-up: its receiver spins on the socket itself, then
                // sleeps, and bytes arriving end this wait.
                if let Ok(0) = crate::sys::poll_read(probe.as_raw_fd(), IDLE_POLL) {
                    continue;
                }
            }
            if let Wait::Socket = wait {
                // A spinner may have read a frame and held it back: its bytes left the socket,
                // so wait as the holder does (on `reader_cond`), not on the socket.
                let r = rx.lock().unwrap_or_else(|p| p.into_inner());
                if let Frame::Held { until, seen, .. } = r.frame {
                    held = Some((until, seen));
                    continue;
                }
                drop(r);
                // Block until bytes (or the end of the stream) arrive, without taking them; at
                // most HOLD_RECHECK, in case a spinner holds a frame back meanwhile.
                let _ = crate::sys::poll_read(probe.as_raw_fd(), HOLD_RECHECK);
            }
            let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
            match self.progress(&mut r) {
                Step::Closed(cause) => {
                    self.shut(&mut r, cause);
                    return;
                }
                Step::Held(until, seen) => {
                    // Nothing is read while a frame is held: notice a dead connection here.
                    if let Some(cause) = held_hang_up(&probe, &r) {
                        self.shut(&mut r, cause);
                        return;
                    }
                    held = Some((until, seen));
                }
                Step::Progress | Step::Idle => {}
            }
            mid_frame = !matches!(r.frame, Frame::Header);
        }
    }
}

/// Why a connection whose read side holds a frame back is dead, if it is: reset or shut in both
/// directions, or shut by the peer before the held frame's payload fully arrived.
fn held_hang_up(probe: &TcpStream, r: &Rx) -> Option<String> {
    let fd = probe.as_raw_fd();
    let ev = match crate::sys::poll_read(fd, Duration::ZERO) {
        Ok(ev) => ev,
        Err(e) => return Some(format!("connection check failed: {e}")),
    };
    if ev & crate::sys::HUNG_UP != 0 {
        return Some("connection closed or reset while a message was held back".into());
    }
    if ev & crate::sys::PEER_SHUT != 0
        && let Frame::Held { header, .. } = &r.frame
    {
        let have = crate::sys::unread(fd).unwrap_or(0) + (r.hi - r.lo);
        if (have as u64) < header.len {
            return Some("connection closed mid-message".into());
        }
    }
    None
}

/// What the reader waits for before it next reads.
enum Wait {
    /// Nothing: read what the socket has now.
    Drain,
    /// A receiver sleeps on this peer or a frame is half read: block until bytes arrive.
    Socket,
    /// Nothing has happened on this peer for [`IDLE_QUIET`]: block until bytes arrive, at most
    /// [`IDLE_POLL`], and read only if they did.
    Quiet,
}

//! The read side of one connection as the backend's I/O thread drives it (`io.rs`): it moves
//! frames along while someone waits, drains the socket now and then while nobody does, and tells
//! the backend when the connection ends. Each call to [`Peer::turn`] does what the reader thread
//! per peer used to do between two waits, without blocking, and says what to wait for next.

use std::os::fd::AsRawFd;

use super::*;

/// What the I/O thread keeps for one peer between turns.
pub(super) struct Reading {
    /// A frame held back (for its receive, or for room in the queue): until when, and
    /// [`State::events`] when it was routed.
    held: Option<(Option<Instant>, u64)>,
    /// A frame was half read at the end of the last read.
    mid_frame: bool,
    /// The events count last seen changing on this peer, and when.
    last_event: (u64, Instant),
    /// Where the next turn goes on.
    resume: Resume,
}

impl Reading {
    pub(super) fn new() -> Reading {
        Reading {
            held: None,
            mid_frame: false,
            last_event: (0, Instant::now()),
            resume: Resume::Top,
        }
    }
}

/// Where a turn goes on from: the point of the old reader loop at which it waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// Look at the state afresh.
    Top,
    /// It waited while a frame was held (woken by a post, a take, or the hold's timer).
    Held,
    /// It waited [`IDLE_DRAIN`] (or for a wake) while receives come and go: drain now.
    Drain,
    /// It waited for the socket while the connection was quiet: read only if bytes came.
    Quiet,
    /// It waited for the socket (someone sleeps on this peer, or a frame is half read).
    Socket,
}

/// What the I/O thread does with a peer after a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// Call again as soon as the other peers have had their turn (bytes may be left).
    Again,
    /// Call again when the socket is readable (if `read`), at `timer` (if any), or on a wake.
    Wait { read: bool, timer: Option<Instant> },
    /// The connection has ended (the close hook has been called): forget this peer.
    Exit,
}

impl Peer {
    /// One turn of this peer's read side; never blocks (beyond brief locks). `readable`: the
    /// socket was reported readable since the last turn.
    ///
    /// While a receiver sleeps waiting on this peer, or a frame is half read, the turn waits
    /// for the socket and moves bytes along. While receives come and go on this peer it stays
    /// off the socket, so that a spinning receiver reads its message itself with no thread
    /// switch, and drains the socket every [`IDLE_DRAIN`] (unexpected messages must not fill the
    /// sender's buffers while nobody receives). Once nothing has been posted or taken on this
    /// peer for [`IDLE_QUIET`], it waits for the socket alone, with no timer, so that the peers
    /// a rank is not talking to cost nothing while they wait (`docs/scale.md`). While a
    /// receiver waits in `poll` on the socket itself (`poll_wait.rs`), the turn stands back
    /// with no timer: the socket is registered again once that receiver has left.
    pub(super) fn turn(&self, rd: &mut Reading, readable: bool) -> Plan {
        let plan = self.turn_inner(rd, readable);
        if plan == Plan::Exit {
            // The connection has ended: tell the backend (outside every lock of this peer).
            let cause = self.lock().closed.clone();
            if let (Some(sink), Some(cause)) = (self.on_close.get(), cause) {
                sink(self.rank, cause);
            }
        }
        plan
    }

    fn turn_inner(&self, rd: &mut Reading, readable: bool) -> Plan {
        let Some(rx) = self.rx() else {
            return Plan::Wait {
                read: false,
                timer: None,
            };
        };
        // A read that found nothing (or a frame held) goes on to decide what to wait for in
        // this same turn, as the reader thread's loop did; one that moved bytes ends the turn,
        // so that the other peers get theirs. Bounded: a few rounds, then the next turn.
        let mut readable = readable;
        for _ in 0..4 {
            match self.turn_once(rd, rx, readable) {
                Some(plan) => return plan,
                None => readable = false,
            }
        }
        Plan::Again
    }

    /// One pass of the reader thread's old loop: `None` to go on with another at once.
    fn turn_once(&self, rd: &mut Reading, rx: &Mutex<Rx>, readable: bool) -> Option<Plan> {
        match std::mem::replace(&mut rd.resume, Resume::Top) {
            Resume::Top => {}
            Resume::Held | Resume::Drain => {
                let mut st = self.lock();
                st.reader_sleeping = false;
                st.reader_holding = false;
                if st.closed.is_some() {
                    return Some(Plan::Exit);
                }
                drop(st);
                return self.read_now(rd, rx);
            }
            // Nothing came: look at the state again.
            Resume::Quiet if !readable => {}
            Resume::Quiet | Resume::Socket => return self.read_now(rd, rx),
        }
        #[cfg(test)]
        self.reader_turns.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        if st.closed.is_some() {
            return Some(Plan::Exit);
        }
        if let Some((until, seen)) = rd.held.take() {
            // A message waits for its receive (or, for flow control, for room in the queue): a
            // post or a take moves it on, as does the grace period ending. Events since it was
            // routed are rechecked at once.
            let now = Instant::now();
            let limit = until.map_or(HOLD_RECHECK, |u| u.saturating_duration_since(now));
            if !st.closing && st.events == seen && !limit.is_zero() {
                st.reader_sleeping = true;
                st.reader_holding = true;
                rd.resume = Resume::Held;
                return Some(Plan::Wait {
                    read: false,
                    timer: now.checked_add(limit),
                });
            }
            drop(st);
            return self.read_now(rd, rx);
        }
        if !st.pollers.is_empty() && !st.closing {
            // A receiver waits on the socket itself (`poll_wait.rs`): the bytes are its to read,
            // and the socket is watched again (with no timer) once it has left; any turn
            // meanwhile (a kick for bytes left in the buffer) reads. A frame held back is this
            // side's to hold.
            drop(st);
            if let Frame::Held { until, seen, .. } =
                rx.lock().unwrap_or_else(|p| p.into_inner()).frame
            {
                rd.held = Some((until, seen));
                return None;
            }
            rd.resume = Resume::Socket;
            return Some(Plan::Wait {
                read: true,
                timer: None,
            });
        }
        let sleeping = st.posted.iter().any(|p| !matches!(p.slot, Slot::Done(_)));
        let spinning = self.spinners.load(Ordering::Acquire) > 0;
        if st.closing || ((sleeping || rd.mid_frame) && !spinning) {
            drop(st);
            // A spinner may have read a frame and held it back: its bytes left the socket, so
            // wait as the holder does (for a post or a take), not for the socket.
            if let Frame::Held { until, seen, .. } =
                rx.lock().unwrap_or_else(|p| p.into_inner()).frame
            {
                rd.held = Some((until, seen));
                return None;
            }
            // Wait until bytes (or the end of the stream) arrive; at most HOLD_RECHECK, in case
            // a spinner holds a frame back meanwhile.
            return Some(self.wait_bytes(
                rd,
                rx,
                Resume::Socket,
                Instant::now().checked_add(HOLD_RECHECK),
            ));
        }
        let now = Instant::now();
        if st.events != rd.last_event.0 {
            rd.last_event = (st.events, now);
        } else if !sleeping && !spinning && now.duration_since(rd.last_event.1) >= IDLE_QUIET {
            // Nothing posted here for a while: wait for bytes (a frame nobody waits for, a
            // heartbeat, an abort notice, the end of the stream), then drain them. A post
            // meanwhile needs no wake-up: its receiver spins on the socket itself, then wakes
            // this side before it sleeps, and bytes arriving end this wait.
            drop(st);
            return Some(self.wait_bytes(rd, rx, Resume::Quiet, None));
        }
        st.reader_sleeping = true;
        rd.resume = Resume::Drain;
        Some(Plan::Wait {
            read: false,
            timer: now.checked_add(IDLE_DRAIN),
        })
    }

    /// Reads what the socket has now and moves frames along (bounded work: see `progress`).
    /// `None`: nothing was read, or a frame is held: go on to decide what to wait for.
    fn read_now(&self, rd: &mut Reading, rx: &Mutex<Rx>) -> Option<Plan> {
        let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
        // The I/O thread alone reads a ring's socket (its doorbells and its end).
        if let Source::Ring { io_turn, .. } = &mut r.sock {
            *io_turn = true;
        }
        let step = self.progress(&mut r);
        if let Source::Ring { io_turn, .. } = &mut r.sock {
            *io_turn = false;
        }
        let plan = match step {
            Step::Closed(cause) => {
                self.shut(&mut r, cause);
                return Some(Plan::Exit);
            }
            Step::Held(until, seen) => {
                // Nothing is read while a frame is held: notice a dead connection here.
                if let Some(cause) = self.held_hang_up(&r) {
                    self.shut(&mut r, cause);
                    return Some(Plan::Exit);
                }
                rd.held = Some((until, seen));
                None
            }
            Step::Progress => {
                // The read may have stopped at its bound with frames left in the buffer: the
                // next turn reads on, whatever wakes it.
                rd.resume = Resume::Socket;
                Some(Plan::Again)
            }
            Step::Idle => None,
        };
        rd.mid_frame = !matches!(r.frame, Frame::Header);
        plan
    }

    /// The plan to wait for bytes from the peer (and at most until `timer`), going on at
    /// `resume`. From a ring, the producer is first asked for a doorbell byte on the socket;
    /// if bytes are in the ring already, the turn comes back at once to read them instead.
    fn wait_bytes(
        &self,
        rd: &mut Reading,
        rx: &Mutex<Rx>,
        resume: Resume,
        timer: Option<Instant>,
    ) -> Plan {
        if let Source::Ring { ring, .. } = &rx.lock().unwrap_or_else(|p| p.into_inner()).sock {
            // A corrupt ring (an error) is reported by the read that follows.
            if ring.arm().unwrap_or(true) {
                rd.resume = Resume::Socket;
                return Plan::Again;
            }
        }
        rd.resume = resume;
        Plan::Wait { read: true, timer }
    }

    /// Why a connection whose read side holds a frame back is dead, if it is: reset or shut in
    /// both directions, or shut by the peer before the held frame's payload fully arrived.
    fn held_hang_up(&self, r: &Rx) -> Option<String> {
        let fd = self.stream()?.as_raw_fd();
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
            let pending = match &r.sock {
                Source::Ring { ring, .. } => ring
                    .available(&|| "checking a held frame".into())
                    .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX)),
                _ => crate::sys::unread(fd).unwrap_or(0),
            };
            let have = pending.saturating_add(r.hi - r.lo);
            if (have as u64) < header.len {
                return Some("connection closed mid-message".into());
            }
        }
        None
    }
}

//! The frame receive state machine: the read side's buffer in front of the socket, the frame
//! in progress, and each frame's payload moved to where it goes (a posted buffer, the queue, or
//! the abort hook), checked and bounded (where a data frame goes, and the header checks:
//! `route.rs`).

use super::*;

/// How many steps of the frame state machine one `progress` call takes at most.
const PROGRESS_TURNS: u32 = 256;

/// How many reads of doorbell bytes (64 at a time) one read from a ring makes at most: a
/// same-host peer that floods its socket with them must not keep the I/O thread in one drain
/// (holding this peer's read side) while the others wait. The drain goes on at the next turn.
pub(super) const DOORBELL_READS: u32 = 16;

/// Where the read side is in the byte stream.
pub(super) enum Frame {
    /// Between frames.
    Header,
    /// A payload landing in the posted buffer of receive `id`.
    Fill {
        id: u64,
        ptr: *mut u8,
        len: usize,
        done: usize,
        meta: Meta,
    },
    /// A payload nobody waits for (yet), read into fresh memory.
    Queue {
        tag: u64,
        data: Vec<u8>,
        done: usize,
        meta: Meta,
    },
    /// An abort notice's text (the first 64 KiB of it).
    Abort {
        tag: u64,
        text: Vec<u8>,
        left: usize,
        /// The rank at fault that the notice names (meta bytes 0..8: rank + 1, 0 for none).
        culprit: Option<usize>,
        /// The rank whose own call failed first, where the notice passes that on (meta bytes
        /// 0..8 as for the culprit, with [`ORIGIN_ONLY`] set).
        first: Option<usize>,
        /// The call it names (meta bytes 8..16: the call's number, from 1; 0 for none).
        call: Option<u64>,
    },
    /// A large payload nobody waits for yet, left in the socket until a receive is posted for it
    /// or `until` passes (then it is queued); with no `until`, until a receive is posted or the
    /// queue has room for it (flow control).
    Held {
        header: FrameHeader,
        until: Option<Instant>,
        /// [`State::events`] when it was routed.
        seen: u64,
    },
    /// A payload read and dropped: nobody will receive it (the backend is closing).
    Skip { left: u64 },
}

/// The read side of a connection: a 64 KiB buffer in front of the socket, and the frame in
/// progress. Every read is non-blocking, so the lock around it is only ever held briefly.
pub(super) struct Rx {
    pub(super) sock: Source,
    pub(super) buf: Box<[u8]>,
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) frame: Frame,
    pub(super) dead: bool,
    /// The last read stopped at its bound of frames (see [`Rx::buffered`]).
    pub(super) stopped_early: bool,
    /// While a frame is held: the peer's bytes waiting unread behind it at the last check
    /// (see [`Peer::held_fed`]).
    pub(super) held_unread: usize,
}

// SAFETY: `Frame::Fill::ptr` is the only non-`Send` field; see `State`'s impl. It is written
// through only while this struct's mutex is held and the receive is `Filling`. (Tests, with the
// I/O thread filling a buffer posted on another thread: `tests::
// unexpected_messages_are_bounded_and_larger_ones_still_arrive`, and `fill_tests::
// a_receive_whose_peer_stalls_mid_message_lets_go_of_its_buffer_only_when_cut` for a fill
// that its receive's deadline interrupts.)
unsafe impl Send for Rx {}

/// What a call to [`Peer::progress`] ended with.
pub(super) enum Step {
    /// Some bytes were consumed.
    Progress,
    /// Nothing to read now.
    Idle,
    /// A frame waits for its receive to be posted, at most until then (if given), or until
    /// [`State::events`] moves past the count given.
    Held(Option<Instant>, u64),
    /// The connection ended.
    Closed(String),
}

/// The read buffer a connection starts with: enough for the frames of a quiet connection
/// (heartbeats, small messages), so that rank 0, connected to every rank of a large job, holds
/// 4 KiB per connection rather than [`RX_BUF`].
pub(super) const RX_BUF_MIN: usize = 4 << 10;
/// The most the read buffer grows to, doubling each time a read fills it.
pub(super) const RX_BUF: usize = 64 << 10;

pub(super) fn would_block(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

/// What the read side reads: the socket or, in tests, a script of bytes.
pub(super) enum Source {
    Socket(socket2::Socket),
    /// The peer's ring in shared memory; the socket carries only doorbell bytes (any value,
    /// read and dropped) and the end of the stream. Only the I/O thread reads the socket
    /// (`io_turn` set around its reads): a spinning receiver that took a doorbell byte would
    /// leave the I/O thread asleep on the socket with no doorbell to come.
    Ring {
        sock: socket2::Socket,
        ring: crate::shm::RxRing,
        io_turn: bool,
        /// The last drain of doorbell bytes stopped at [`DOORBELL_READS`] with more maybe
        /// left: the read side has more to do although the read found nothing.
        bells_left: bool,
    },
    /// A sealed connection (`crate::seal`): the records read from `inner` are checked and
    /// opened, and only their text goes on.
    Sealed {
        inner: Box<Source>,
        open: Box<crate::seal::Opener>,
    },
    #[cfg(test)]
    Script(Script),
}

/// Bytes a test makes available a piece at a time: reads return what is available, then
/// `WouldBlock` (or the end of the stream once `eof` is set and everything was read).
#[cfg(test)]
#[derive(Default)]
pub(super) struct Script {
    pub(super) bytes: Vec<u8>,
    pub(super) read: usize,
    pub(super) available: usize,
    pub(super) eof: bool,
}

impl Source {
    pub(super) fn shutdown(&mut self) {
        match self {
            Source::Socket(s) | Source::Ring { sock: s, .. } => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Source::Sealed { inner, .. } => inner.shutdown(),
            #[cfg(test)]
            Source::Script(s) => s.eof = true,
        }
    }
}

/// Receives into `dst` without blocking.
pub(super) fn recv_now(sock: &mut Source, dst: &mut [u8]) -> std::io::Result<usize> {
    let sock = match sock {
        Source::Socket(s) => s,
        Source::Ring {
            sock,
            ring,
            io_turn,
            bells_left,
        } => return ring_recv(sock, ring, *io_turn, bells_left, dst),
        Source::Sealed { inner, open } => return open.read(&mut |b| recv_now(inner, b), dst),
        #[cfg(test)]
        Source::Script(s) => {
            let n = dst.len().min(s.available - s.read);
            if n == 0 && !(s.eof && s.available == s.bytes.len()) {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            dst[..n].copy_from_slice(&s.bytes[s.read..s.read + n]);
            s.read += n;
            return Ok(n);
        }
    };
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and `recv` only writes initialised bytes
    // into the slice, so viewing initialised memory as maybe-uninitialised is sound. (Every
    // received byte passes here; checked byte for byte by `tests::
    // unexpected_messages_are_bounded_and_larger_ones_still_arrive`, straight into a receive's
    // buffer and into the read buffer.)
    let dst = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
    loop {
        match sock.recv_with_flags(dst, MSG_DONTWAIT) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Receives into `dst` from the peer's ring without blocking: `WouldBlock` while it is empty
/// and the connection open, `Ok(0)` once it is empty and the peer has closed the connection
/// (the peer's last bytes were in the ring before it closed: they are read first). On the I/O
/// thread (`io_turn`), doorbell bytes on the socket are read and dropped on the way, at most
/// [`DOORBELL_READS`] reads of them per call (`bells_left` says the drain stopped there); other
/// threads leave the socket alone.
pub(super) fn ring_recv(
    sock: &socket2::Socket,
    ring: &mut crate::shm::RxRing,
    io_turn: bool,
    bells_left: &mut bool,
    dst: &mut [u8],
) -> std::io::Result<usize> {
    let n = ring.read(dst)?;
    if n > 0 || dst.is_empty() {
        return Ok(n);
    }
    if !io_turn {
        return Err(std::io::ErrorKind::WouldBlock.into());
    }
    let mut bells = [MaybeUninit::<u8>::uninit(); 64];
    let mut reads = 0u32;
    *bells_left = false;
    loop {
        if reads == DOORBELL_READS {
            *bells_left = true;
            break;
        }
        reads += 1;
        match sock.recv_with_flags(&mut bells, MSG_DONTWAIT) {
            // The end of the stream: whatever the peer wrote before closing is in the ring.
            Ok(0) => return ring.read(dst),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if would_block(&e) => break,
            Err(e) => return Err(e),
        }
    }
    match ring.read(dst)? {
        0 => Err(std::io::ErrorKind::WouldBlock.into()),
        n => Ok(n),
    }
}

impl Rx {
    /// The last read stopped at its bound of frames ([`PROGRESS_TURNS`]) with bytes maybe left
    /// in the buffer: the socket's readiness does not tell of them.
    pub(super) fn buffered(&self) -> bool {
        let opened = matches!(&self.sock, Source::Sealed { open, .. } if open.ready());
        self.stopped_early && (self.lo < self.hi || opened)
    }

    /// Reads more of the stream into the buffer; `Ok(0)` at its end.
    pub(super) fn read_more(&mut self) -> std::io::Result<usize> {
        if self.lo == self.hi {
            (self.lo, self.hi) = (0, 0);
        } else if self.hi == self.buf.len() {
            self.buf.copy_within(self.lo..self.hi, 0);
            (self.lo, self.hi) = (0, self.hi - self.lo);
        }
        if self.hi == self.buf.len() {
            // Full of one unfinished frame's bytes: room is needed to go on.
            self.grow();
        }
        let room = self.buf.len() - self.hi;
        let n = recv_now(&mut self.sock, &mut self.buf[self.hi..])?;
        self.hi += n;
        if n == room && !self.one_large_frame() {
            // The socket had at least as much as the buffer could take: a busy connection.
            self.grow();
        }
        Ok(n)
    }

    /// Whether the unread bytes start with the header of a frame at least as long as the
    /// buffer: a read that filled the buffer then took that frame's payload, the rest of which
    /// goes straight to its destination, and a larger buffer would only copy more of it twice.
    /// (On a host of 1,024 ranks, growing for such frames was about 5 % of the pages the job
    /// touched.)
    fn one_large_frame(&self) -> bool {
        self.buf[self.lo..self.hi]
            .first_chunk::<FRAME_HEADER_LEN>()
            .and_then(|raw| FrameHeader::decode(raw).ok())
            .is_some_and(|h| h.len >= self.buf.len() as u64)
    }

    /// Doubles the read buffer, up to [`RX_BUF`], keeping the unread bytes.
    fn grow(&mut self) {
        let len = self.buf.len();
        if len >= RX_BUF {
            return;
        }
        let mut bigger = vec![0u8; (len * 2).clamp(RX_BUF_MIN, RX_BUF)].into_boxed_slice();
        bigger[..self.hi - self.lo].copy_from_slice(&self.buf[self.lo..self.hi]);
        (self.hi, self.lo) = (self.hi - self.lo, 0);
        self.buf = bigger;
    }
}

impl Peer {
    /// Reads whatever has arrived, without blocking, and moves frames along: into posted
    /// buffers, into the queue, or to the abort hook.
    pub(super) fn progress(&self, rx: &mut Rx) -> Step {
        let was_held = matches!(rx.frame, Frame::Held { .. });
        let mut step = self.progress_frames(rx);
        if let Source::Ring { bells_left, .. } = &mut rx.sock
            && std::mem::take(bells_left)
            && matches!(step, Step::Idle)
        {
            // The drain of doorbell bytes stopped at its bound: more turns are due (after the
            // other ready peers'), not a wait for readiness the socket may not report again.
            step = Step::Progress;
        }
        // Only a hold that starts here is news: one that goes on was told of when it began.
        self.after_read(rx, !was_held && matches!(step, Step::Held(..)));
        // Any byte from the peer proves it alive. A frame held back (its socket is not read
        // meanwhile, so its heartbeats wait behind that frame) does only while the peer's
        // bytes keep arriving behind it, or fill what this side takes in unread: a peer that
        // sent a header and nothing more is judged silent as any other.
        let heard = match step {
            Step::Progress => true,
            Step::Held(..) => self.held_fed(rx, !was_held),
            _ => false,
        };
        if heard {
            self.heard.store(true, Ordering::Relaxed);
        }
        step
    }

    /// Whether a held frame proves the peer alive at this check: the hold starts here (its
    /// header's bytes just came), more of the peer's bytes wait unread behind it than at the
    /// last check, or they reach a quarter of what the socket (or the ring) takes in, so
    /// that the peer may be blocked by this side's flow control rather than silent (a full
    /// socket holds close to its receive buffer's size in unread bytes). A count that cannot
    /// be read proves it alive, as every hold did before.
    fn held_fed(&self, rx: &mut Rx, new: bool) -> bool {
        let Some((unread, full)) = unread_behind(&rx.sock) else {
            return true;
        };
        let grew = unread > rx.held_unread;
        rx.held_unread = unread;
        new || grew || unread >= full.max(1)
    }

    fn progress_frames(&self, rx: &mut Rx) -> Step {
        if rx.dead {
            return Step::Closed("connection closed".into());
        }
        rx.stopped_early = false;
        let mut moved = false;
        let io_end = |e: std::io::Error, moved: bool| {
            if would_block(&e) {
                if moved { Step::Progress } else { Step::Idle }
            } else {
                Step::Closed(describe(&e))
            }
        };
        let mut turns = 0u32;
        loop {
            // Bounded work per call: a peer that floods frames as fast as they are read would
            // otherwise keep one call here for as long as the flood lasts, and the caller (a
            // send that also receives, a spinning receiver) past its deadline. The state is
            // kept in `rx`, so the next call goes on where this one stopped.
            turns += 1;
            if moved && turns > PROGRESS_TURNS {
                rx.stopped_early = true;
                return Step::Progress;
            }
            match &mut rx.frame {
                Frame::Header => {
                    while rx.hi - rx.lo < FRAME_HEADER_LEN {
                        match rx.read_more() {
                            Ok(0) if rx.hi == rx.lo => {
                                return Step::Closed("connection closed by peer".into());
                            }
                            Ok(0) => {
                                return Step::Closed(format!(
                                    "connection closed in a frame header ({} of {FRAME_HEADER_LEN} bytes)",
                                    rx.hi - rx.lo
                                ));
                            }
                            Ok(_) => moved = true,
                            Err(e) => return io_end(e, moved),
                        }
                    }
                    let raw: [u8; FRAME_HEADER_LEN] = rx.buf[rx.lo..rx.lo + FRAME_HEADER_LEN]
                        .try_into()
                        .expect("a header's worth of bytes");
                    rx.lo += FRAME_HEADER_LEN;
                    moved = true;
                    let (h, len) = match self.check_header(&raw) {
                        Ok(x) => x,
                        Err(cause) => return Step::Closed(cause),
                    };
                    rx.frame = match h.kind {
                        FrameKind::Heartbeat => {
                            self.heard_position(&h.meta);
                            continue;
                        }
                        FrameKind::Abort => {
                            let named =
                                u64::from_le_bytes(h.meta[..8].try_into().expect("eight bytes"));
                            let rank = (named & !ORIGIN_ONLY)
                                .checked_sub(1)
                                .and_then(|c| usize::try_from(c).ok());
                            let first = named & ORIGIN_ONLY != 0;
                            Frame::Abort {
                                tag: h.tag,
                                text: Vec::with_capacity(len),
                                left: len,
                                culprit: rank.filter(|_| !first),
                                first: rank.filter(|_| first),
                                call: Some(u64::from_le_bytes(
                                    h.meta[8..].try_into().expect("eight bytes"),
                                ))
                                .filter(|&c| c != 0),
                            }
                        }
                        FrameKind::Data => self.route(h, len, None),
                    };
                    if let Frame::Held { until, seen, .. } = rx.frame {
                        return Step::Held(until, seen);
                    }
                }
                Frame::Held { header, until, .. } => {
                    let (h, until) = (*header, *until);
                    // Checked against `usize` when the header was read.
                    let len = h.len as usize;
                    rx.frame = self.route(h, len, Some(until));
                    if let Frame::Held { until, seen, .. } = rx.frame {
                        return Step::Held(until, seen);
                    }
                }
                Frame::Skip { left } => {
                    if *left > 0 {
                        let mut scratch = [0u8; 4096];
                        let k = (*left).min(scratch.len() as u64) as usize;
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut scratch[..k],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *left -= n as u64;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    rx.frame = Frame::Header;
                }
                Frame::Fill {
                    id,
                    ptr,
                    len,
                    done,
                    meta,
                } => {
                    if *done < *len {
                        // SAFETY: receive `id` is `Filling` and we hold the read-side lock: its
                        // owner cannot release the buffer before the fill ends (see `State`), and
                        // `len` is the buffer's length. (Tests: `fill_tests::
                        // a_receive_whose_peer_stalls_mid_message_lets_go_of_its_buffer_only_when_cut`,
                        // a deadline mid-fill; `tests::a_receive_whose_wait_unwinds_is_withdrawn`,
                        // a withdrawn receive not written.)
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(ptr.add(*done), *len - *done) };
                        match rx_pull(&mut rx.sock, &mut rx.buf, &mut rx.lo, &mut rx.hi, dst) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *done += n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let (id, meta) = (*id, *meta);
                    let mut st = self.lock();
                    if let Some(p) = st.posted.iter_mut().find(|p| p.id == id) {
                        p.slot = Slot::Done(Outcome::Delivered(meta));
                    }
                    self.notify(&st);
                    drop(st);
                    rx.frame = Frame::Header;
                }
                Frame::Queue {
                    tag,
                    data,
                    done,
                    meta,
                } => {
                    if *done < data.len() {
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut data[*done..],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                *done += n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let (tag, meta) = (*tag, *meta);
                    let data = std::mem::take(data);
                    rx.frame = Frame::Header;
                    self.offer(tag, Payload::Owned(data), meta, true);
                }
                Frame::Abort {
                    tag,
                    text,
                    left,
                    culprit,
                    first,
                    call,
                } => {
                    if *left > 0 {
                        let mut scratch = [0u8; 4096];
                        let k = (*left).min(scratch.len());
                        match rx_pull(
                            &mut rx.sock,
                            &mut rx.buf,
                            &mut rx.lo,
                            &mut rx.hi,
                            &mut scratch[..k],
                        ) {
                            Ok(0) => return Step::Closed("connection closed mid-message".into()),
                            Ok(n) => {
                                text.extend_from_slice(&scratch[..n]);
                                *left -= n;
                                moved = true;
                            }
                            Err(e) => return io_end(e, moved),
                        }
                        continue;
                    }
                    let notice = AbortNotice {
                        from: self.rank,
                        culprit: *culprit,
                        first: *first,
                        tag: Tag::from_wire(*tag),
                        call: *call,
                        reason: bounded_text(text),
                    };
                    rx.frame = Frame::Header;
                    match self.on_abort.get() {
                        Some(sink) => sink(notice),
                        None => {
                            self.aborts.raise(notice);
                        }
                    }
                }
            }
        }
    }
}

/// The peer's bytes waiting unread in `sock` (for a held frame, see [`Peer::held_fed`]), and
/// how many of them show that the peer may be blocked by this side's flow control; `None` when
/// the count cannot be read.
fn unread_behind(sock: &Source) -> Option<(usize, usize)> {
    use std::os::fd::AsRawFd;
    match sock {
        Source::Socket(s) => {
            let unread = crate::sys::unread(s.as_raw_fd()).ok()?;
            let room = s.recv_buffer_size().ok()?;
            Some((unread, room / 4))
        }
        // A ring's producer blocks once the ring is full, and it is larger than this.
        Source::Ring { ring, .. } => {
            let n = ring.available(&|| "checking a held frame".into()).ok()?;
            Some((usize::try_from(n).unwrap_or(usize::MAX), RX_BUF))
        }
        // What the sealing layer read ahead counts as unread too.
        Source::Sealed { inner, open } => {
            unread_behind(inner).map(|(n, full)| (n.saturating_add(open.held()), full))
        }
        #[cfg(test)]
        Source::Script(s) => Some((s.available - s.read, usize::MAX)),
    }
}

/// Reads into `dst` from the bytes buffered in a borrowed `Rx` (its fields passed apart, so
/// that the frame can be borrowed beside them), refilling the buffer from the socket when empty
/// (a read as large as half the buffer goes straight into `dst`).
pub(super) fn rx_pull(
    sock: &mut Source,
    buf: &mut [u8],
    lo: &mut usize,
    hi: &mut usize,
    dst: &mut [u8],
) -> std::io::Result<usize> {
    if *lo == *hi {
        (*lo, *hi) = (0, 0);
        if dst.len() >= buf.len() / 2 {
            return recv_now(sock, dst);
        }
        let n = recv_now(sock, buf)?;
        if n == 0 {
            return Ok(0);
        }
        *hi = n;
    }
    let n = dst.len().min(*hi - *lo);
    dst[..n].copy_from_slice(&buf[*lo..*lo + n]);
    *lo += n;
    Ok(n)
}

pub(super) fn describe(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "connection closed mid-message".into(),
        std::io::ErrorKind::ConnectionReset => "connection reset by peer".into(),
        _ => e.to_string(),
    }
}

/// A peer's abort text as a string of at most [`ABORT_MAX`] bytes: invalid UTF-8 is replaced
/// (each bad byte by U+FFFD, three bytes), so the replaced text is cut back, at a character
/// boundary, to the bound the frame's length had.
pub(super) fn bounded_text(text: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(text).into_owned();
    if s.len() > ABORT_MAX {
        let mut cut = ABORT_MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

//! The writing half of a connection: callers' threads write whole frames, one at a time.

use std::os::fd::AsRawFd;

use super::*;

pub(super) struct Writer {
    pub(super) sock: socket2::Socket,
    /// The ring to the peer in shared memory, when the connection has one (`crate::shm`):
    /// frames go there, and the socket only carries doorbell bytes and the end of the stream.
    pub(super) ring: Option<crate::shm::TxRing>,
    pub(super) broken: Option<String>,
    /// A heartbeat frame, of which the last `hb_left` bytes are still to be written: heartbeats
    /// are written without blocking, and a part that did not fit goes out before the next frame.
    pub(super) hb: [u8; FRAME_HEADER_LEN],
    pub(super) hb_left: usize,
    /// Bytes went out since the last heartbeat was written: the peer heard from this rank, and
    /// the next periodic heartbeat is skipped ([`Peer::heartbeat_if_quiet`]).
    pub(super) wrote: bool,
    /// On a sealed connection (`crate::seal`), what seals the bytes written to the socket, and
    /// the record being written: bytes of a frame count as written once sealed into a record,
    /// and the record goes out before anything after it ([`Writer::flush_now`]).
    pub(super) seal: Option<crate::seal::Sealer>,
}

/// The longest a sender sleeps on a full ring before it looks at the connection again (a peer
/// that died is seen by the socket hanging up, which wakes no futex).
const RING_WAIT_SLICE: Duration = Duration::from_millis(50);

/// How long a send that found its peer hung up waits for the read side to take what the peer
/// sent before closing (its abort notice): the frames are in this side's socket already, so
/// the I/O thread takes them within milliseconds unless data nobody has asked for is held
/// ahead of them.
const HUNG_UP_READ_WAIT: Duration = Duration::from_millis(200);

impl Writer {
    /// A writer over `sock`, with frames going to `ring` if given.
    pub(super) fn new(sock: socket2::Socket, ring: Option<crate::shm::TxRing>) -> Writer {
        Writer {
            sock,
            ring,
            broken: None,
            hb: [0; FRAME_HEADER_LEN],
            hb_left: 0,
            wrote: false,
            seal: None,
        }
    }

    /// A writer over `sock` whose bytes are sealed by `seal`, if given.
    pub(super) fn sealed(sock: socket2::Socket, seal: Option<crate::seal::Sealer>) -> Writer {
        Writer {
            seal,
            ..Writer::new(sock, None)
        }
    }

    /// Whether bytes taken as written are still to go out (a sealed record written in part).
    pub(super) fn unflushed(&self) -> bool {
        self.seal.as_ref().is_some_and(|s| !s.pending().is_empty())
    }

    /// Writes what is left of a sealed record without blocking: `WouldBlock` if some is left.
    pub(super) fn flush_now(&mut self) -> std::io::Result<()> {
        let Some(seal) = &mut self.seal else {
            return Ok(());
        };
        while !seal.pending().is_empty() {
            match self
                .sock
                .send_with_flags(seal.pending(), MSG_NOSIGNAL | MSG_DONTWAIT)
            {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    seal.advance(n);
                    self.wrote = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// [`Writer::try_write`] on a sealed connection: the record before goes out first; then
    /// the next bytes of `bufs` are sealed into a record (and taken as written), which goes
    /// out as far as the socket takes it now.
    fn try_write_sealed(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.flush_now()?;
        let Some(seal) = &mut self.seal else {
            return Ok(0);
        };
        let n = seal.seal(bufs)?;
        match self.flush_now() {
            Err(e) if !would_block(&e) => Err(e),
            _ => Ok(n),
        }
    }

    /// Writes what fits of `bufs` now, without blocking: to the ring (ringing the peer's
    /// doorbell if it asked for one) or the socket. `WouldBlock` when nothing fits.
    pub(super) fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        if self.seal.is_some() {
            return self.try_write_sealed(bufs);
        }
        let Some(ring) = &mut self.ring else {
            let n = self
                .sock
                .send_vectored_with_flags(bufs, MSG_NOSIGNAL | MSG_DONTWAIT)?;
            self.wrote |= n > 0;
            return Ok(n);
        };
        let (n, bell) = ring.write_some(bufs)?;
        if bell {
            // One byte wakes the peer's I/O thread; a full socket holds doorbells already.
            let _ = self.sock.send_with_flags(&[0], MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        self.wrote |= n > 0;
        Ok(n)
    }

    /// Waits at most `limit` for room to write (a wake-up is no promise of room). On a ring, an
    /// error once the connection has hung up (the read side shut it) or the peer has shut its
    /// side (it died: the kernel closed its socket; or it is closing its backend and will
    /// receive nothing more): either way nobody will make room.
    pub(super) fn wait_room(&self, limit: Duration) -> std::io::Result<()> {
        let fd = self.sock.as_raw_fd();
        let Some(ring) = &self.ring else {
            return crate::sys::poll_write(fd, limit).map(drop);
        };
        let ev = crate::sys::poll_read(fd, Duration::ZERO)?;
        if ev & crate::sys::HUNG_UP != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "connection closed while the shared-memory ring was full",
            ));
        }
        if ev & crate::sys::PEER_SHUT != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the peer shut its side of the connection (it died or is closing) while the \
                 shared-memory ring to it was full",
            ));
        }
        ring.wait_room(limit.min(RING_WAIT_SLICE))
    }

    /// What to `poll` for room, when there is one (a ring has none: look again shortly).
    pub(super) fn room_fd(&self) -> Option<std::os::fd::RawFd> {
        self.ring.is_none().then(|| self.sock.as_raw_fd())
    }

    /// Writes what is left of a heartbeat without blocking: `Ok` with some of it left when the
    /// socket is full (the next frame's write sends the rest first).
    pub(super) fn push_heartbeat(&mut self) -> std::io::Result<()> {
        // A sealed record written in part goes first (it may be the last heartbeat's).
        match self.flush_now() {
            Err(e) if would_block(&e) => return Ok(()),
            r => r?,
        }
        while self.hb_left > 0 {
            let from = FRAME_HEADER_LEN - self.hb_left;
            let hb = self.hb;
            match self.try_write(&[IoSlice::new(&hb[from..])]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => self.hb_left -= n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Writes all of `bufs` by `deadline` (and, on a sealed connection, the record they end in):
/// non-blocking writes, and a wait for room (at most until the deadline) whenever the socket or
/// ring is full. `SO_SNDTIMEO` would bound each write, not the whole.
pub(super) fn write_all_vectored(
    w: &mut Writer,
    mut bufs: &mut [IoSlice<'_>],
    deadline: Instant,
    sent: &mut usize,
) -> std::io::Result<()> {
    while !bufs.is_empty() || w.unflushed() {
        let wrote = if bufs.is_empty() {
            w.flush_now().map(|()| 0)
        } else {
            w.try_write(bufs)
        };
        match wrote {
            Ok(0) if bufs.is_empty() => {}
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                IoSlice::advance_slices(&mut bufs, n);
                *sent += n;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if would_block(&e) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                w.wait_room(left)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The writer behind a lock whose acquisition has a deadline (std's `Mutex` has none): a gate
/// (`busy`, and how many wait for it) that callers pass one at a time, waiting on a condvar at most
/// until their own deadline, then the writer's mutex, which only the gate's holder takes, so it
/// never blocks. Uncontended, passing costs two uncontended lock/unlock pairs and no wake-up.
pub(super) struct WriterLock {
    gate: Mutex<Gate>,
    freed: Condvar,
    writer: Mutex<Writer>,
}

#[derive(Default)]
struct Gate {
    busy: bool,
    waiting: u32,
}

/// The writer, held until dropped; dropping it lets the next waiting sender through.
pub(super) struct WriterGuard<'a> {
    lock: &'a WriterLock,
    writer: MutexGuard<'a, Writer>,
}

impl std::ops::Deref for WriterGuard<'_> {
    type Target = Writer;
    fn deref(&self) -> &Writer {
        &self.writer
    }
}

impl std::ops::DerefMut for WriterGuard<'_> {
    fn deref_mut(&mut self) -> &mut Writer {
        &mut self.writer
    }
}

impl Drop for WriterGuard<'_> {
    fn drop(&mut self) {
        let mut g = self.lock.gate();
        g.busy = false;
        if g.waiting > 0 {
            self.lock.freed.notify_one();
        }
    }
}

impl WriterLock {
    pub(super) fn new(w: Writer) -> WriterLock {
        WriterLock {
            gate: Mutex::new(Gate::default()),
            freed: Condvar::new(),
            writer: Mutex::new(w),
        }
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        // The gate's fields are two plain values, consistent after any panic.
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The writer, or `None` if another sender still holds it at `deadline`.
    pub(super) fn lock_by(&self, deadline: Instant) -> Option<WriterGuard<'_>> {
        let mut g = self.gate();
        while g.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g.waiting += 1;
            g = self
                .freed
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            g.waiting -= 1;
        }
        g.busy = true;
        drop(g);
        // Only the gate's holder takes this mutex, so it is free (a writer poisoned by a panic
        // mid-frame is still usable: `broken` says whether its stream is).
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        Some(WriterGuard { lock: self, writer })
    }
}

/// Takes the writer's lock by `deadline`: a send stuck behind another one to a slow peer fails
/// with a Timeout instead of waiting for it without end.
fn lock_writer<'a>(
    peer: &Peer,
    writer: &'a WriterLock,
    deadline: Instant,
    op: &dyn Fn() -> String,
) -> Result<WriterGuard<'a>> {
    let started = Instant::now();
    writer.lock_by(deadline).ok_or_else(|| {
        peer.timeout(
            format!("{} (waiting behind another send to this peer)", op()),
            started,
        )
    })
}

impl Peer {
    /// Sends one frame. `op` names the operation in errors.
    pub(crate) fn send(
        &self,
        kind: FrameKind,
        tag: u64,
        data: &[u8],
        meta: Meta,
        op: &dyn Fn() -> String,
        deadline: Instant,
    ) -> Result<()> {
        if self.loopback {
            return self.deliver_local(tag, data, meta);
        }
        let Some(conn) = self.connection_by(deadline, op)? else {
            return Err(self.gone(op(), "not connected".into()));
        };
        let mut w = lock_writer(self, &conn.writer, deadline, op)?;
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        // What is left of a heartbeat written in part goes out first, in the same bounded write.
        let hb = w.hb;
        let hb_rest = &hb[FRAME_HEADER_LEN - w.hb_left..];
        let header = FrameHeader {
            kind,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [
            IoSlice::new(hb_rest),
            IoSlice::new(&header),
            IoSlice::new(data),
        ];
        let started = Instant::now();
        let mut sent = 0;
        let total = hb_rest.len() + header.len() + data.len();
        let r = write_all_vectored(&mut w, &mut bufs, deadline, &mut sent);
        w.hb_left = w.hb_left.saturating_sub(sent);
        r.map_err(|e| self.send_failed(&mut w, e, started, op, (sent, total), Some(deadline)))
    }

    /// Sends a data frame while receive `id` on `src` is pending, from this one thread: the
    /// socket is written without blocking and, whenever it is full, `src`'s socket is read, so
    /// that neither direction waits on a thread switch. If neither moves for a spin period the
    /// thread stops spinning: the I/O thread takes the receive and the send blocks.
    // The frame (tag, data, meta), its op and deadline, and the receive it runs beside.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_while_receiving(
        &self,
        tag: u64,
        data: &[u8],
        meta: Meta,
        op: &dyn Fn() -> String,
        src: &Peer,
        id: u64,
        deadline: Instant,
    ) -> Result<()> {
        let (Some(writer), Some(rx)) = (self.writer(), src.rx()) else {
            return self.send(FrameKind::Data, tag, data, meta, op, deadline);
        };
        let mut w = lock_writer(self, writer, deadline, op)?;
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        // What is left of a heartbeat written in part goes out first, in the same writes.
        let hb = w.hb;
        let hb_rest = &hb[FRAME_HEADER_LEN - w.hb_left..];
        let header = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let total = hb_rest.len() + header.len() + data.len();
        let mut bufs = [
            IoSlice::new(hb_rest),
            IoSlice::new(&header),
            IoSlice::new(data),
        ];
        let mut bufs = &mut bufs[..];
        let mut sent = 0;
        let started = Instant::now();
        let spin = src.spin_time();
        let mut spinning = Some(Spinning::new(&src.spinners));
        let mut idle_since: Option<Instant> = None;
        let mut received = false;
        let r = loop {
            // On a sealed connection the frame is written once the record it ends in is: that
            // goes out in this loop too, reading `src` whenever the socket is full, as the
            // frame's bytes do.
            if bufs.is_empty() && !w.unflushed() {
                break Ok(());
            }
            let mut moved = false;
            let wrote = if bufs.is_empty() {
                w.flush_now().map(|()| 0)
            } else {
                w.try_write(bufs)
            };
            match wrote {
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    sent += n;
                    moved = true;
                }
                Err(e) if would_block(&e) || e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
            if !received && let Ok(mut r) = rx.try_lock() {
                match src.progress(&mut r) {
                    Step::Progress => moved = true,
                    Step::Closed(cause) => src.shut(&mut r, cause),
                    Step::Idle | Step::Held(..) => {}
                }
                drop(r);
                received = src
                    .lock()
                    .posted
                    .iter()
                    .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
            }
            // Checked on every pass, progress or not: a peer that keeps `src` busy (a flood of
            // frames) makes every pass count as progress, and must not keep us spinning past
            // the deadline (this check used to come after the `continue` below).
            let now = Instant::now();
            if now >= deadline {
                break Err(std::io::ErrorKind::TimedOut.into());
            }
            if moved {
                idle_since = None;
                continue;
            }
            if now.saturating_duration_since(*idle_since.get_or_insert(now)) > spin {
                // Stop spinning: the I/O thread takes the receive, and this thread blocks
                // on the send (within the socket's send timeout).
                spinning = None;
                src.wake_reader(&src.lock());
                break write_all_vectored(&mut w, bufs, deadline, &mut sent);
            }
            std::thread::yield_now();
        };
        drop(spinning);
        w.hb_left = w.hb_left.saturating_sub(sent);
        r.map_err(|e| self.send_failed(&mut w, e, started, op, (sent, total), Some(deadline)))
    }

    /// A send failed part-way: a frame may be half written, so the stream is no longer in step
    /// with the reader on the other side. Close it; both sides then see the peer as gone.
    /// `read_by`: where the peer hung up, wait until then at most for the read side to take
    /// what it sent first (its abort notice, which the caller then reports as the cause).
    pub(super) fn send_failed(
        &self,
        w: &mut Writer,
        e: std::io::Error,
        started: Instant,
        op: &dyn Fn() -> String,
        (sent, total): (usize, usize),
        read_by: Option<Instant>,
    ) -> DistError {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let mut cause = if timed_out {
            format!(
                "send blocked for {:.1?} with {sent} of {total} bytes sent: peer not reading",
                started.elapsed()
            )
        } else {
            format!("send failed with {sent} of {total} bytes sent: {e}")
        };
        if let Some(by) = read_by.filter(|_| !timed_out) {
            // The peer hung up. What it sent before closing (an abort notice saying why) may be
            // unread in this side's socket still: let the read side take it first, so that the
            // failure is reported as its cause rather than as the hang-up.
            let limit = Instant::now()
                .checked_add(HUNG_UP_READ_WAIT)
                .map_or(by, |t| t.min(by));
            self.wait_read_end(limit, false);
            // The read side may have ended the connection itself, on what it read (a sealed
            // record that failed its check shuts the socket both ways): that is why this send
            // failed, so the error says it.
            if let Some(read) = self.lock().closed.clone() {
                cause = format!("{cause}; the connection had ended on its read side: {read}");
            }
        }
        w.broken = Some(cause.clone());
        let _ = w.sock.shutdown(Shutdown::Both);
        if timed_out {
            DistError::Timeout {
                rank: self.me,
                op: format!("{} ({sent} of {total} bytes sent)", op()),
                peer: self.rank,
                waited: started.elapsed(),
            }
        } else {
            self.gone(op(), cause)
        }
    }
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    fn lock() -> WriterLock {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a socket");
        WriterLock::new(Writer::new(sock, None))
    }

    #[test]
    fn a_sender_behind_another_gives_up_at_its_own_deadline_and_the_next_gets_through() {
        let l = lock();
        let held = l.lock_by(Instant::now() + Duration::from_secs(1)).unwrap();
        // Behind the holder: gives up at its own deadline, not the holder's.
        let t = Instant::now();
        assert!(l.lock_by(t + Duration::from_millis(50)).is_none());
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(50) && waited < Duration::from_millis(500),
            "{waited:?}"
        );
        // A waiter with time to spare gets through as soon as the holder lets go.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let t = Instant::now();
                let g = l.lock_by(t + Duration::from_secs(10));
                (g.is_some(), t.elapsed())
            });
            // Let the waiter reach the gate (either order is correct: if it comes later it
            // finds the gate open).
            std::thread::sleep(Duration::from_millis(20));
            drop(held);
            let (got, waited) = waiter.join().unwrap();
            assert!(got);
            assert!(waited < Duration::from_secs(5), "{waited:?}");
        });
        // Free again.
        assert!(l.lock_by(Instant::now()).is_some());
    }
}

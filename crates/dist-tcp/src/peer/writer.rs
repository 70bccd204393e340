//! The writing half of a connection: callers' threads write whole frames, one at a time.

use super::*;

pub(super) struct Writer {
    pub(super) sock: socket2::Socket,
    pub(super) broken: Option<String>,
    /// A heartbeat frame, of which the last `hb_left` bytes are still to be written: heartbeats
    /// are written without blocking, and a part that did not fit goes out before the next frame.
    pub(super) hb: [u8; FRAME_HEADER_LEN],
    pub(super) hb_left: usize,
}

impl Writer {
    /// Writes what is left of a heartbeat; without blocking unless `block`. `Ok` with some of
    /// it left only when not blocking.
    pub(super) fn push_heartbeat(&mut self, block: bool) -> std::io::Result<()> {
        let flags = if block {
            MSG_NOSIGNAL
        } else {
            MSG_NOSIGNAL | MSG_DONTWAIT
        };
        while self.hb_left > 0 {
            let from = FRAME_HEADER_LEN - self.hb_left;
            match self.sock.send_with_flags(&self.hb[from..], flags) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => self.hb_left -= n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if !block && would_block(&e) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

pub(super) fn write_all_vectored(
    sock: &socket2::Socket,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !bufs.is_empty() {
        match sock.send_vectored_with_flags(bufs, MSG_NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
    ) -> Result<()> {
        let Some(writer) = &self.writer else {
            return self.deliver_local(tag, data, meta);
        };
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        let started = Instant::now();
        if w.hb_left > 0
            && let Err(e) = w.push_heartbeat(true)
        {
            return Err(self.send_failed(&mut w, e, started, op));
        }
        let header = FrameHeader {
            kind,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
        write_all_vectored(&w.sock, &mut bufs).map_err(|e| self.send_failed(&mut w, e, started, op))
    }

    /// Sends a data frame while receive `id` on `src` is pending, from this one thread: the
    /// socket is written without blocking and, whenever it is full, `src`'s socket is read, so
    /// that neither direction waits on a thread switch. If neither moves for a spin period the
    /// thread stops spinning: the reader thread takes the receive and the send blocks.
    pub(crate) fn send_while_receiving(
        &self,
        tag: u64,
        data: &[u8],
        meta: Meta,
        op: &dyn Fn() -> String,
        src: &Peer,
        id: u64,
    ) -> Result<()> {
        let (Some(writer), Some(rx)) = (&self.writer, &src.rx) else {
            return self.send(FrameKind::Data, tag, data, meta, op);
        };
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        let started = Instant::now();
        if w.hb_left > 0
            && let Err(e) = w.push_heartbeat(true)
        {
            return Err(self.send_failed(&mut w, e, started, op));
        }
        let header = FrameHeader {
            kind: FrameKind::Data,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
        let mut bufs = &mut bufs[..];
        let spin = spin_time();
        src.spinners.fetch_add(1, Ordering::AcqRel);
        let mut spinning = true;
        let mut idle_since: Option<Instant> = None;
        let mut received = false;
        let r = loop {
            if bufs.is_empty() {
                break Ok(());
            }
            let mut moved = false;
            match w
                .sock
                .send_vectored_with_flags(bufs, MSG_NOSIGNAL | MSG_DONTWAIT)
            {
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
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
            if moved {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now - *idle_since.get_or_insert(now) > spin {
                // Stop spinning: the reader thread takes the receive, and this thread blocks
                // on the send (within the socket's send timeout).
                src.spinners.fetch_sub(1, Ordering::AcqRel);
                spinning = false;
                src.wake_reader(&src.lock());
                break write_all_vectored(&w.sock, bufs);
            }
            std::thread::yield_now();
        };
        if spinning {
            src.spinners.fetch_sub(1, Ordering::AcqRel);
        }
        r.map_err(|e| self.send_failed(&mut w, e, started, op))
    }

    /// A send failed part-way: a frame may be half written, so the stream is no longer in step
    /// with the reader on the other side. Close it; both sides then see the peer as gone.
    pub(super) fn send_failed(
        &self,
        w: &mut Writer,
        e: std::io::Error,
        started: Instant,
        op: &dyn Fn() -> String,
    ) -> DistError {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let cause = if timed_out {
            format!(
                "send blocked for {:.1?}: peer not reading",
                started.elapsed()
            )
        } else {
            format!("send failed: {e}")
        };
        w.broken = Some(cause.clone());
        let _ = w.sock.shutdown(Shutdown::Both);
        if timed_out {
            DistError::Timeout {
                rank: self.me,
                op: op(),
                peer: self.rank,
                waited: started.elapsed(),
            }
        } else {
            self.gone(op(), cause)
        }
    }
}

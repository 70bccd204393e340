//! The writing half of a connection: callers' threads write whole frames, one at a time.

use std::os::fd::AsRawFd;

use super::*;

pub(super) struct Writer {
    pub(super) sock: socket2::Socket,
    pub(super) broken: Option<String>,
}

/// Writes all of `bufs` by `deadline`: non-blocking writes, and `poll` for room (at most until
/// the deadline) whenever the socket is full. `SO_SNDTIMEO` would bound each write, not the whole.
pub(super) fn write_all_vectored(
    sock: &socket2::Socket,
    mut bufs: &mut [IoSlice<'_>],
    deadline: Instant,
    sent: &mut usize,
) -> std::io::Result<()> {
    while !bufs.is_empty() {
        match sock.send_vectored_with_flags(bufs, MSG_NOSIGNAL | MSG_DONTWAIT) {
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
                crate::sys::poll_write(sock.as_raw_fd(), left)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Takes the writer's lock by `deadline`: a send stuck behind another one to a slow peer fails
/// with a Timeout instead of waiting for it without end.
fn lock_writer<'a>(
    peer: &Peer,
    writer: &'a Mutex<Writer>,
    deadline: Instant,
    op: &dyn Fn() -> String,
) -> Result<MutexGuard<'a, Writer>> {
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        match writer.try_lock() {
            Ok(w) => return Ok(w),
            Err(std::sync::TryLockError::Poisoned(p)) => return Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        if Instant::now() >= deadline {
            return Err(peer.timeout(
                format!("{} (waiting behind another send to this peer)", op()),
                started,
            ));
        }
        tries = tries.saturating_add(1);
        if tries < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
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
        let Some(writer) = &self.writer else {
            return self.deliver_local(tag, data, meta);
        };
        let mut w = lock_writer(self, writer, deadline, op)?;
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
        }
        let header = FrameHeader {
            kind,
            tag,
            len: data.len() as u64,
            meta,
        }
        .encode();
        let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
        let started = Instant::now();
        let mut sent = 0;
        write_all_vectored(&w.sock, &mut bufs, deadline, &mut sent).map_err(|e| {
            self.send_failed(&mut w, e, started, op, (sent, header.len() + data.len()))
        })
    }

    /// Sends a data frame while receive `id` on `src` is pending, from this one thread: the
    /// socket is written without blocking and, whenever it is full, `src`'s socket is read, so
    /// that neither direction waits on a thread switch. If neither moves for a spin period the
    /// thread stops spinning: the reader thread takes the receive and the send blocks.
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
        let (Some(writer), Some(rx)) = (&self.writer, &src.rx) else {
            return self.send(FrameKind::Data, tag, data, meta, op, deadline);
        };
        let mut w = lock_writer(self, writer, deadline, op)?;
        if let Some(cause) = &w.broken {
            return Err(self.gone(op(), cause.clone()));
        }
        if let Some(cause) = &self.lock().closed {
            return Err(self.gone(op(), cause.clone()));
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
        let mut sent = 0;
        let started = Instant::now();
        let spin = spin_time();
        let mut spinning = Some(Spinning::new(&src.spinners));
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
            if moved {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                // A peer that keeps `src` busy (a flood of frames) must not keep us spinning.
                break Err(std::io::ErrorKind::TimedOut.into());
            }
            if now.saturating_duration_since(*idle_since.get_or_insert(now)) > spin {
                // Stop spinning: the reader thread takes the receive, and this thread blocks
                // on the send (within the socket's send timeout).
                spinning = None;
                src.wake_reader(&src.lock());
                break write_all_vectored(&w.sock, bufs, deadline, &mut sent);
            }
            std::thread::yield_now();
        };
        drop(spinning);
        r.map_err(|e| self.send_failed(&mut w, e, started, op, (sent, header.len() + data.len())))
    }

    /// A send failed part-way: a frame may be half written, so the stream is no longer in step
    /// with the reader on the other side. Close it; both sides then see the peer as gone.
    pub(super) fn send_failed(
        &self,
        w: &mut Writer,
        e: std::io::Error,
        started: Instant,
        op: &dyn Fn() -> String,
        (sent, total): (usize, usize),
    ) -> DistError {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let cause = if timed_out {
            format!(
                "send blocked for {:.1?} with {sent} of {total} bytes sent: peer not reading",
                started.elapsed()
            )
        } else {
            format!("send failed with {sent} of {total} bytes sent: {e}")
        };
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

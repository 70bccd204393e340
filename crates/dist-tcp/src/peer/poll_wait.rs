//! A receiver that waits in `poll` on its peer's socket itself, on a host with more ranks than
//! cores (no spin: `config::default_spin`). Waiting on the condition variable costs a message
//! two thread switches (the peer's bytes wake the I/O thread, which reads them and wakes the
//! receiver) and often a third (the receiver, about to sleep, wakes the I/O thread so that it
//! watches the socket); waiting here costs one: the bytes wake the receiver, which reads them.
//!
//! While such a waiter is registered (in [`State::pollers`]), the I/O thread leaves the
//! socket to it: its interest in the socket is switched off ([`Peer::io_interest`]) and given
//! back when the last waiter leaves, so that the bytes wake one thread, not two. Whatever wakes
//! a sleeping receiver (a fill finished by another thread, a closed connection, an abort
//! notice from any peer: [`Peer::notify`], [`Peer::wake`]) also writes to each registered
//! waiter's wake descriptor, an `eventfd` of its thread that it polls beside the socket.
//!
//! Only for plain sockets: a shared-memory ring's socket carries doorbells that only the I/O
//! thread may take (`rx.rs`, [`Source::Ring`]). A waiter whose own read meets a frame held back
//! (for another receive, or for flow control) leaves it to the I/O thread and sleeps on the
//! condition variable instead: the socket would stay readable under it. A hold that another
//! reader starts, or a read that stops with frames left in the buffer (which `poll` does not
//! see), wakes the waiters ([`Peer::after_read`]); a hold that goes on does not, so that
//! nobody spins on it.

use std::os::fd::OwnedFd;

use rustix::event::{PollFd, PollFlags, Timespec};

use super::*;

/// The peer shut its sending side: wakes the waiter too (it reads the end of the stream).
#[cfg(any(target_os = "linux", target_os = "android"))]
const PEER_SHUT: PollFlags = PollFlags::RDHUP;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const PEER_SHUT: PollFlags = PollFlags::empty();

/// One thread's wake descriptor: a non-blocking `eventfd` that others write to wake it from
/// its `poll`, and the thread it belongs to.
pub(super) struct WakeFd {
    fd: OwnedFd,
    owner: std::thread::ThreadId,
}

impl WakeFd {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    fn new() -> std::io::Result<WakeFd> {
        use rustix::event::{EventfdFlags, eventfd};
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(WakeFd {
            fd,
            owner: std::thread::current().id(),
        })
    }

    /// No `eventfd` here: receivers sleep on the condition variable.
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    fn new() -> std::io::Result<WakeFd> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    /// Wakes the thread polling it (or makes its next poll return at once). Its own thread,
    /// which is not in `poll` if it rings (it is reading the socket itself), is left alone.
    pub(super) fn ring(&self) {
        if std::thread::current().id() == self.owner {
            return;
        }
        // Cannot fail but by overflowing the counter (2^64 − 2 rings unread); a ring lost then
        // still leaves the counter readable.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Resets the counter (the ring was seen).
    fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut b);
    }
}

thread_local! {
    /// This thread's wake descriptor, made on its first wait in `poll` (`None` if it could not
    /// be made, e.g. out of descriptors: the thread then sleeps on the condition variable).
    static WAKE_FD: Option<Arc<WakeFd>> = WakeFd::new().ok().map(Arc::new);
}

/// A receiver registered to wait on its peer's socket; its drop unregisters it (on every way
/// out of the wait, unwinding included) and gives the socket back to the I/O thread.
pub(super) struct SocketWait<'a> {
    peer: &'a Peer,
    wake: Arc<WakeFd>,
}

impl Peer {
    /// Registers this thread to wait on the socket itself, if it may: the receiver does not
    /// spin (`spin_us` 0: an oversubscribed host), the connection is a plain socket, and the
    /// thread has a wake descriptor. Called under the state lock (`st`).
    pub(super) fn socket_wait(&self, st: &mut State) -> Option<SocketWait<'_>> {
        if self.spin_us.load(Ordering::Relaxed) != 0 || !self.conn.get()?.pollable {
            return None;
        }
        // None while the thread's locals are being torn down.
        let wake = WAKE_FD.try_with(|w| w.clone()).ok().flatten()?;
        st.pollers.push(wake.clone());
        // The bytes are to wake this thread only.
        self.io_interest_locked(st, None);
        Some(SocketWait { peer: self, wake })
    }

    /// Sets what the I/O thread waits for on this peer's socket: `read` is what its last turn
    /// asked for (`None`: unchanged); the interest is registered only while no receiver waits
    /// on the socket itself. Returns false if the poller refused the change (the I/O thread
    /// then rechecks on a timer).
    pub(super) fn io_interest(&self, read: bool) -> bool {
        let mut st = self.lock();
        self.io_interest_locked(&mut st, Some(read))
    }

    fn io_interest_locked(&self, st: &mut State, read: Option<bool>) -> bool {
        if let Some(read) = read {
            st.io_read = read;
        }
        let want = st.io_read && st.pollers.is_empty();
        if want == st.io_armed {
            return true;
        }
        let (Some(io), Some(stream)) = (self.io.get(), self.stream()) else {
            return true;
        };
        let ok = io.set_interest(stream, self.rank, want);
        // On a failure the registration is unknown: counted as off, so the next change retries.
        st.io_armed = want && ok;
        ok
    }
}

impl SocketWait<'_> {
    /// Waits until the socket has bytes (then reads and routes what came), this thread's wake
    /// descriptor is written, or `limit` passes. False if the wait should go on on the condition
    /// variable instead: a frame is held back in the socket, or `poll` failed.
    pub(super) fn wait_once(&self, limit: Option<Duration>) -> bool {
        let peer = self.peer;
        let (Some(stream), Some(rx)) = (peer.stream(), peer.rx()) else {
            return false;
        };
        let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
        // Bytes already read into the buffer (a read stops after a bounded number of frames)
        // do not make the socket readable: they are moved along first.
        if !r.buffered() {
            drop(r);
            let ts = limit.map(|d| Timespec {
                tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(d.subsec_nanos()),
            });
            let mut fds = [
                PollFd::new(stream, PollFlags::IN | PEER_SHUT),
                PollFd::new(&self.wake.fd, PollFlags::IN),
            ];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => return true,
                Err(_) => return false,
            }
            if !fds[1].revents().is_empty() {
                self.wake.drain();
            }
            if fds[0].revents().is_empty() {
                return true;
            }
            r = rx.lock().unwrap_or_else(|p| p.into_inner());
        }
        match peer.progress(&mut r) {
            Step::Closed(cause) => {
                peer.shut(&mut r, cause);
                true
            }
            // The socket stays readable under a held frame: the I/O thread holds it (woken by
            // the socket once this waiter has left) and this receiver sleeps meanwhile.
            Step::Held(..) => false,
            Step::Progress | Step::Idle => true,
        }
    }
}

impl Drop for SocketWait<'_> {
    fn drop(&mut self) {
        // Bytes left in the buffer do not make the socket readable: the I/O thread is given a
        // turn for them (it reads on any turn while it stands back).
        let buffered = self
            .peer
            .rx()
            .is_some_and(|rx| rx.lock().unwrap_or_else(|p| p.into_inner()).buffered());
        let mut st = self.peer.lock();
        if let Some(i) = st.pollers.iter().position(|w| Arc::ptr_eq(w, &self.wake)) {
            st.pollers.swap_remove(i);
        }
        let registered = self.peer.io_interest_locked(&mut st, None);
        drop(st);
        // A registration the poller refused leaves the socket unwatched: a turn rechecks.
        if buffered || !registered {
            self.peer.kick();
        }
    }
}

impl Peer {
    /// After a read that left bytes in the buffer or began holding a frame back, neither of
    /// which makes the socket readable: the receivers waiting on the socket itself are woken
    /// (they move the bytes along, or leave a held frame to the I/O thread and sleep), and the
    /// I/O thread is given a turn for the held frame (unless it is the reader: its turn holds
    /// the frame already).
    pub(super) fn after_read(&self, r: &Rx, held: bool) {
        if !held && !r.buffered() {
            return;
        }
        let st = self.lock();
        if st.pollers.is_empty() {
            return;
        }
        for w in &st.pollers {
            w.ring();
        }
        drop(st);
        if held && !super::io::on_io_thread() {
            self.kick();
        }
    }
}

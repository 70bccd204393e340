//! The receiving half of a peer: a receive is posted (its buffer filled straight from the
//! socket, by the backend's I/O thread or by the receiver spinning on the socket itself),
//! then waited on; the handle withdraws it on every way out.

use super::*;

/// How long past its deadline a receive waits for a message that has started landing in its
/// buffer to finish, before it cuts the connection (it may not return while the buffer can
/// still be written).
const FILL_GRACE: Duration = Duration::from_millis(500);

/// Counts a spinner in [`Peer::spinners`] while it lives, so that a panic cannot leave it counted
/// (the I/O thread would then stand back for good).
pub(super) struct Spinning<'a>(&'a AtomicUsize);

impl<'a> Spinning<'a> {
    pub(super) fn new(n: &'a AtomicUsize) -> Spinning<'a> {
        n.fetch_add(1, Ordering::AcqRel);
        Spinning(n)
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a posted receive stands.
enum PostState {
    /// It ended at once (a queued message taken, or the connection already closed).
    Ready(Result<Meta>),
    /// Its entry is in the table, under this id.
    Posted(u64),
    /// It has been waited on: the entry is gone.
    Finished,
}

/// A receive posted on a [`TcpLink`](crate::TcpLink): wait on it ([`dist_core::transport::PostedRecv`]),
/// or drop it, which withdraws it.
pub struct TcpRecv<'a> {
    peer: &'a Peer,
    state: PostState,
    tag: u64,
    len: usize,
    started: Instant,
    deadline: Instant,
    /// Names the operation in errors (else "recv from P (tag T, N bytes)").
    op: Option<&'a dyn Fn() -> String>,
    _buf: std::marker::PhantomData<&'a mut [u8]>,
}

impl std::fmt::Debug for TcpRecv<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRecv")
            .field("peer", &self.peer.rank)
            .field("tag", &Tag::from_wire(self.tag))
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> TcpRecv<'a> {
    /// The peer it receives from.
    pub(crate) fn peer(&self) -> &'a Peer {
        self.peer
    }

    /// Its entry's id while it is in the table.
    pub(crate) fn id(&self) -> Option<u64> {
        match self.state {
            PostState::Posted(id) => Some(id),
            _ => None,
        }
    }

    fn op(&self) -> String {
        match self.op {
            Some(op) => op(),
            None => format!(
                "recv from {} (tag {}, {} bytes)",
                self.peer.rank,
                Tag::from_wire(self.tag),
                self.len
            ),
        }
    }

    /// Waits for the message until the deadline; returns its meta.
    pub(crate) fn wait(mut self) -> Result<Meta> {
        match std::mem::replace(&mut self.state, PostState::Finished) {
            PostState::Ready(r) => r,
            PostState::Finished => unreachable!("a handle is waited on once: `wait` takes it"),
            PostState::Posted(id) => {
                // Should `wait` unwind, the handle still holds the id and its drop withdraws it.
                self.state = PostState::Posted(id);
                let op = || self.op();
                let r = self
                    .peer
                    .wait(id, self.tag, self.len, self.started, self.deadline, &op);
                // `wait` removes the entry on every return: the reader can no longer reach
                // the buffer.
                self.state = PostState::Finished;
                r
            }
        }
    }
}

impl dist_core::transport::PostedRecv for TcpRecv<'_> {
    fn wait(self) -> Result<Meta> {
        TcpRecv::wait(self)
    }
}

impl Drop for TcpRecv<'_> {
    fn drop(&mut self) {
        if let PostState::Posted(id) = self.state {
            self.peer.withdraw(id, self.deadline);
        }
    }
}

impl Peer {
    /// Posts a receive of the next message on `tag` into `buf`, to wait on by `deadline`: from
    /// now on the payload may land in `buf`, straight from the socket. A message already queued
    /// is taken at once (a message of another length stays queued: the handle then holds the
    /// size mismatch).
    ///
    /// # Safety
    ///
    /// The handle must be waited on or dropped, never leaked: until then the reader may write
    /// into `buf`, and only the handle's end removes the entry that points at it.
    pub(crate) unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        tag: u64,
        deadline: Instant,
        op: Option<&'a dyn Fn() -> String>,
    ) -> TcpRecv<'a> {
        let started = Instant::now();
        let len = buf.len();
        let mut posted = TcpRecv {
            peer: self,
            state: PostState::Finished,
            tag,
            len,
            started,
            deadline,
            op,
            _buf: std::marker::PhantomData,
        };
        if !self.loopback && !self.is_connected() {
            // First use of a peer with no connection: made now through the connect hook (with
            // no hook, the receive waits in the table for a connection to be attached).
            let made = self.connection_by(deadline, &|| posted.op());
            if let Err(e) = made {
                posted.state = PostState::Ready(Err(e));
                return posted;
            }
        }
        let mut st = self.lock();
        if let Some(r) = st.take_queued(tag, buf) {
            // There may be room in the budget: a reader holding a frame back for it may go on.
            self.wake_reader_if_holding(&st);
            drop(st);
            posted.state = PostState::Ready(r.map_err(|got| self.mismatch(posted.op(), len, got)));
            return posted;
        }
        if let Some(cause) = &st.closed {
            let e = self.gone(posted.op(), cause.clone());
            posted.state = PostState::Ready(Err(e));
            return posted;
        }
        // SAFETY: `buf` is borrowed mutably for as long as the handle lives ('a). The entry
        // leaves `posted` before the handle ends: `wait` removes it on every return (waiting out
        // or cutting a fill), and the handle's drop withdraws it on every other way out (a
        // failing send beside it, a panic in `wait`; tests:
        // peer::tests::a_receive_whose_*_unwinds_is_withdrawn). The caller does not leak the
        // handle (this function's contract).
        let id = unsafe { st.post(tag, buf.as_mut_ptr(), len) };
        // The handle knows of the entry at once, so that its drop withdraws it whatever
        // happens from here on.
        posted.state = PostState::Posted(id);
        // The reader may be holding a large message back for a receive like this one.
        if st.reader_holding {
            self.wake_reader(&st);
        }
        drop(st);
        posted
    }

    /// Receives the next message on `tag` into `buf` by `deadline`; returns its meta.
    pub(crate) fn recv(
        &self,
        buf: &mut [u8],
        tag: u64,
        deadline: Instant,
        op: &dyn Fn() -> String,
    ) -> Result<Meta> {
        // SAFETY: the handle is waited on in this statement; it is never leaked.
        unsafe { self.post(buf, tag, deadline, Some(op)) }.wait()
    }

    /// Wakes the I/O thread's side of this peer, so that it takes a posted receive while this
    /// thread is busy (a large blocking send).
    pub(crate) fn wake_reader_now(&self) {
        let st = self.lock();
        self.wake_reader(&st);
    }

    fn wait(
        &self,
        id: u64,
        tag: u64,
        len: usize,
        started: Instant,
        deadline: Instant,
        op: &dyn Fn() -> String,
    ) -> Result<Meta> {
        #[cfg(test)]
        if tests::PANIC_IN_WAIT.with(|p| p.replace(false)) {
            panic!("injected: a panic inside a receive's wait");
        }
        // Declared before the state lock's guard, so that it drops after it: its drop takes the
        // lock.
        let mut on_socket: Option<SocketWait<'_>> = None;
        let mut st = self.lock();
        let mut timed_out = false;
        let mut spun = false;
        loop {
            let i = st
                .posted
                .iter()
                .position(|p| p.id == id)
                .expect("an entry stays until its owner removes it");
            if matches!(st.posted[i].slot, Slot::Done(_)) {
                let Some(Posted {
                    slot: Slot::Done(outcome),
                    ..
                }) = st.posted.remove(i)
                else {
                    unreachable!("checked above")
                };
                if timed_out {
                    return Err(self.timeout(op(), started));
                }
                return match outcome {
                    Outcome::Delivered(meta) => Ok(meta),
                    Outcome::Mismatch(got) => Err(self.mismatch(op(), len, got)),
                    Outcome::Gone(cause) => Err(self.gone(op(), cause)),
                };
            }
            let open = matches!(st.posted[i].slot, Slot::Open);
            let wire_tag = Tag::from_wire(tag);
            let ended = self.aborts.revoked()
                || (wire_tag.is_system() && self.aborts.ending_now(wire_tag).is_some());
            if open && ended {
                st.posted.remove(i);
                return Err(self.aborts.error(self.me, op(), wire_tag));
            }
            if !spun && self.rx().is_some() {
                spun = true;
                // With no spin on this host, wait on the socket itself (`poll_wait.rs`).
                if let Some(w) = self.socket_wait(&mut st) {
                    on_socket = Some(w);
                    continue;
                }
                // Spin briefly before sleeping, reading the socket ourselves: a message that
                // comes within microseconds then lands with no thread switch at all.
                drop(st);
                let until = Instant::now()
                    .checked_add(self.spin_time())
                    .map_or(deadline, |t| deadline.min(t));
                self.spin(id, until);
                st = self.lock();
                let done = st
                    .posted
                    .iter()
                    .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
                if !done {
                    // About to sleep: the I/O thread must now watch the socket for us.
                    self.wake_reader(&st);
                }
                continue;
            }
            let now = Instant::now();
            if !timed_out && now >= deadline {
                if open {
                    st.posted.remove(i);
                    return Err(self.timeout(op(), started));
                }
                // A message is landing in our buffer: a healthy peer finishes it within
                // microseconds (a receive polling with a short deadline meets such a message
                // now and then, e.g. when the sender was descheduled between a header and its
                // payload), so it gets FILL_GRACE before the connection is given up.
                let grace_end = deadline.checked_add(FILL_GRACE).unwrap_or(deadline);
                if now < grace_end {
                    let limit = Some(grace_end.saturating_duration_since(now));
                    st = self.block(st, limit, &mut on_socket);
                    continue;
                }
                timed_out = true;
                // The peer stalled in the middle of a payload that is landing in our buffer.
                // We may not return while it can still be written: cut the connection, which
                // ends the fill, under the read-side lock, before we go on.
                drop(st);
                self.cut("the peer stalled mid-message past a receiver's deadline");
                st = self.lock();
                continue;
            }
            let limit = (!timed_out).then(|| deadline.saturating_duration_since(now));
            st = self.block(st, limit, &mut on_socket);
        }
    }

    /// Waits for a change, at most `limit`: in `poll` on the socket while registered to
    /// (`socket`), else on the condition variable. A socket wait that must end (a frame held
    /// back in the socket) unregisters, and the next waits sleep.
    fn block<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        limit: Option<Duration>,
        socket: &mut Option<SocketWait<'_>>,
    ) -> MutexGuard<'a, State> {
        let Some(w) = socket else {
            return self.sleep(st, limit);
        };
        drop(st);
        if !w.wait_once(limit) {
            *socket = None;
            // Sleeping from now on: the I/O thread must watch the socket for this receiver.
            let st = self.lock();
            self.wake_reader(&st);
            return st;
        }
        self.lock()
    }

    /// Reads the socket from this thread until receive `id` is done or `until` passes, as long
    /// as nobody else is reading it at that moment.
    fn spin(&self, id: u64, until: Instant) {
        let Some(rx) = self.rx() else { return };
        let _spinning = Spinning::new(&self.spinners);
        loop {
            if let Ok(mut r) = rx.try_lock()
                && let Step::Closed(cause) = self.progress(&mut r)
            {
                self.shut(&mut r, cause);
            }
            let done = self
                .lock()
                .posted
                .iter()
                .any(|p| p.id == id && matches!(p.slot, Slot::Done(_)));
            if done || Instant::now() >= until {
                break;
            }
            std::thread::yield_now();
        }
    }

    /// Withdraws a posted receive; if its buffer is being filled, waits for the fill to end
    /// (cutting the connection if that takes past `deadline`).
    fn withdraw(&self, id: u64, deadline: Instant) {
        let mut st = self.lock();
        let mut cut = false;
        loop {
            let Some(i) = st.posted.iter().position(|p| p.id == id) else {
                return;
            };
            if !matches!(st.posted[i].slot, Slot::Filling) {
                st.posted.remove(i);
                return;
            }
            let now = Instant::now();
            if !cut && now >= deadline {
                cut = true;
                drop(st);
                self.cut("a receive was withdrawn while its message was arriving too slowly");
                st = self.lock();
                continue;
            }
            st = self.sleep(st, (!cut).then(|| deadline.saturating_duration_since(now)));
        }
    }
}

/// The spin `DIST_SPIN_US` asks for (at most [`SPIN_MAX_US`]), if it is set to a number.
pub(crate) fn spin_env() -> Option<Duration> {
    static S: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("DIST_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(|us: u64| Duration::from_micros(us.min(SPIN_MAX_US.into())))
    })
}

/// The small areas' spin `DIST_SMALL_SPIN_US` asks for (at most [`SPIN_MAX_US`]), if it is set
/// to a number ([`dist_core::arena::HostArena::small_spin`]).
pub(crate) fn small_spin_env() -> Option<Duration> {
    static S: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        std::env::var("DIST_SMALL_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(|us: u64| Duration::from_micros(us.min(SPIN_MAX_US.into())))
    })
}

//! The backend's one I/O thread: it drives the read side of every connection of a rank by
//! readiness polling (`poller.rs`: epoll on Linux), where each connection used to have a reader
//! thread of its own. Each peer gets turns ([`Peer::turn`], `reader.rs`) when its socket becomes
//! readable, when its timer passes, or when another thread wakes it (a post, a take, a receiver
//! about to sleep, the backend closing); between those it costs nothing. Reads are non-blocking,
//! and a peer with bytes left gets its next turn only after every other ready peer had one, so
//! that no connection holds up the others.

use std::collections::HashMap;
use std::thread::JoinHandle;

use super::poller::{Events, Poller};

use super::reader::{Plan, Reading};
use super::*;

/// What the threads of a backend share with its I/O thread.
pub(crate) struct Io {
    poller: Poller,
    inbox: Mutex<Inbox>,
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Inbox {
    /// Peers whose connection is to be watched from now on.
    added: Vec<Arc<Peer>>,
    /// Peers to give a turn (by rank).
    woken: Vec<usize>,
    stop: bool,
}

/// The I/O thread of a backend; dropping it stops the thread and waits for it.
#[derive(Debug)]
pub(crate) struct IoThread {
    io: Arc<Io>,
    handle: Option<JoinHandle<()>>,
}

impl IoThread {
    /// Starts the I/O thread, named `name`.
    pub(crate) fn spawn(name: String) -> std::io::Result<IoThread> {
        let io = Arc::new(Io {
            poller: Poller::new()?,
            inbox: Mutex::new(Inbox::default()),
        });
        let shared = io.clone();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(&shared))?;
        Ok(IoThread {
            io,
            handle: Some(handle),
        })
    }

    /// Hands `peer` to this thread: its connection is watched from now on, or from when it is
    /// attached ([`Peer::attach`]).
    pub(crate) fn adopt(&self, peer: &Arc<Peer>) {
        if peer.loopback {
            return;
        }
        let _ = peer.this.set(Arc::downgrade(peer));
        let _ = peer.io.set(self.io.clone());
        peer.io_register();
    }

    /// Stops the thread and waits for it: the connections still watched are shut, and their
    /// waits fail (the backend is closing; every peer has normally closed by then).
    pub(crate) fn stop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.io.lock().stop = true;
            let _ = self.io.poller.notify();
            let _ = h.join();
        }
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Io {
    fn lock(&self) -> MutexGuard<'_, Inbox> {
        // Plain lists, consistent after any panic.
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives `peer` a turn soon (a wake while one is pending costs nothing more).
    pub(super) fn wake(&self, peer: &Peer) {
        if !peer.io_woken.swap(true, Ordering::AcqRel) {
            self.lock().woken.push(peer.rank);
            let _ = self.poller.notify();
        }
    }

    /// Registers (`read`) or clears the one-shot readable interest in `stream`, watched under
    /// `key`; false if the poller refused.
    pub(super) fn set_interest(&self, stream: &TcpStream, key: usize, read: bool) -> bool {
        self.poller.modify(stream, key, read).is_ok()
    }

    pub(super) fn add(&self, peer: Arc<Peer>) {
        self.lock().added.push(peer);
        let _ = self.poller.notify();
    }
}

impl Peer {
    /// Registers this peer's connection with its I/O thread once both exist (from whichever of
    /// [`IoThread::adopt`] and [`Peer::attach`] comes second; exactly once).
    pub(super) fn io_register(&self) {
        // Under the state lock: whichever of the two calls takes it second sees both parts set.
        let _st = self.lock();
        if let (Some(io), Some(_), Some(me)) = (
            self.io.get(),
            self.conn.get(),
            self.this.get().and_then(std::sync::Weak::upgrade),
        ) && !self.io_added.swap(true, Ordering::AcqRel)
        {
            io.add(me);
        }
    }

    /// Gives this peer's read side a turn on the I/O thread now.
    pub(super) fn kick(&self) {
        if let Some(io) = self.io.get() {
            io.wake(self);
        }
    }
}

/// One watched peer.
struct Watched {
    peer: Arc<Peer>,
    reading: Reading,
    /// When its next turn is due without any event.
    timer: Option<Instant>,
    /// Due a turn now; with whether its socket was reported readable.
    ready: Option<bool>,
}

thread_local! {
    /// Set on an I/O thread: it takes care of a frame held back by its own reads.
    static ON_IO_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is an I/O thread.
pub(super) fn on_io_thread() -> bool {
    ON_IO_THREAD.with(|t| t.get())
}

/// The watched peers by key; their sockets are deleted from the poller when this drops, the
/// thread unwinding included (`Poller::add`'s contract: a peer let go of may close its socket).
struct WatchedSet<'a> {
    io: &'a Io,
    map: HashMap<usize, Watched>,
}

impl std::ops::Deref for WatchedSet<'_> {
    type Target = HashMap<usize, Watched>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for WatchedSet<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Drop for WatchedSet<'_> {
    fn drop(&mut self) {
        for w in self.map.values() {
            if let Some(stream) = w.peer.stream() {
                let _ = self.io.poller.delete(stream);
            }
        }
    }
}

fn run(io: &Io) {
    ON_IO_THREAD.with(|t| t.set(true));
    let mut watched = WatchedSet {
        io,
        map: HashMap::new(),
    };
    let mut events = Events::new();
    let mut readable: Vec<usize> = Vec::new();
    let mut ready: Vec<usize> = Vec::new();
    loop {
        let inbox = std::mem::take(&mut *io.lock());
        for peer in inbox.added {
            let key = peer.rank;
            let Some(stream) = peer.stream() else {
                continue;
            };
            // SAFETY: the stream is the peer's own handle (`Conn::stream`), closed only when
            // the `Peer` drops; this thread holds an `Arc` to the peer (in `watched`) until it
            // has deleted the source: `forget`, below, at the end of this function, and
            // `Watched`'s drop if this thread unwinds. Tests: every `peer::tests` pair ends with
            // the thread deleting its peer.
            if let Err(e) = unsafe { io.poller.add(stream, key) } {
                let mut r = peer
                    .rx()
                    .expect("attached")
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                peer.shut(&mut r, format!("cannot watch the connection: {e}"));
                drop(r);
                peer.turn(&mut Reading::new(), false);
                continue;
            }
            // A wake that came before the peer was watched was dropped (below); its first
            // turn, now, serves it, and later wakes must get through.
            peer.io_woken.store(false, Ordering::Release);
            watched.insert(
                key,
                Watched {
                    peer,
                    reading: Reading::new(),
                    timer: None,
                    ready: Some(false),
                },
            );
        }
        for rank in inbox.woken {
            if let Some(w) = watched.get_mut(&rank) {
                w.peer.io_woken.store(false, Ordering::Release);
                w.ready.get_or_insert(false);
            }
        }
        if inbox.stop {
            break;
        }
        let now = Instant::now();
        let mut next_timer: Option<Instant> = None;
        for w in watched.values_mut() {
            match w.timer {
                Some(t) if t <= now => {
                    w.timer = None;
                    w.ready.get_or_insert(false);
                }
                Some(t) => next_timer = Some(next_timer.map_or(t, |n| n.min(t))),
                None => {}
            }
        }
        // One turn for each ready peer, in rank order; those with more to do go again after.
        ready.clear();
        ready.extend(
            watched
                .iter()
                .filter(|(_, w)| w.ready.is_some())
                .map(|(k, _)| *k),
        );
        ready.sort_unstable();
        let mut again = false;
        for key in ready.drain(..) {
            let Some(w) = watched.get_mut(&key) else {
                continue;
            };
            let readable = w.ready.take().unwrap_or(false);
            match w.peer.turn(&mut w.reading, readable) {
                Plan::Again => {
                    w.timer = None;
                    w.ready = Some(readable);
                    again = true;
                }
                Plan::Wait { read, timer } => {
                    w.timer = timer;
                    // Registered unless a receiver waits on the socket itself (`poll_wait.rs`).
                    if !w.peer.io_interest(read) {
                        // Cannot happen while the fd is registered; read on a timer then.
                        w.timer = Some(Instant::now() + HOLD_RECHECK);
                    }
                    if let Some(t) = w.timer {
                        next_timer = Some(next_timer.map_or(t, |n| n.min(t)));
                    }
                }
                Plan::Exit => forget(io, &mut watched, key),
            }
        }
        let timeout = if again {
            Some(Duration::ZERO)
        } else {
            next_timer.map(|t| t.saturating_duration_since(Instant::now()))
        };
        readable.clear();
        if let Err(e) = io.poller.wait(&mut events, &mut readable, timeout) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::warn!(error = %e, "the I/O thread's poll failed");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        for key in readable.drain(..) {
            if let Some(w) = watched.get_mut(&key) {
                // One-shot: the interest is off until registered again.
                w.peer.lock().io_armed = false;
                w.ready = Some(true);
            }
        }
    }
    // Stopping: shut what is still open, so that nothing waits on it, and tell the hooks.
    let keys: Vec<usize> = watched.keys().copied().collect();
    for key in keys {
        if let Some(w) = watched.get(&key) {
            if let Some(rx) = w.peer.rx() {
                let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
                w.peer.shut(&mut r, "the backend closed".into());
            }
            let mut reading = Reading::new();
            w.peer.turn(&mut reading, false);
        }
        forget(io, &mut watched, key);
    }
}

/// Stops watching peer `key` (its connection ended).
fn forget(io: &Io, watched: &mut HashMap<usize, Watched>, key: usize) {
    if let Some(w) = watched.remove(&key)
        && let Some(stream) = w.peer.stream()
    {
        let _ = io.poller.delete(stream);
    }
}

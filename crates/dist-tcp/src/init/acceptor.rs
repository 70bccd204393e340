//! A listener's accept thread and its fixed pool of handshake workers.
//!
//! One thread blocks in `accept` (no polling) and queues each connection, with the time it was
//! accepted, for a pool of at most [`HANDSHAKE_WORKERS`] threads that run the handshakes
//! ([`serve_handshake`]). A worker starts when a connection arrives and no worker is idle, and
//! ends after [`WORKER_IDLE`] with nothing to do, so an idle listener costs one thread. Idle
//! workers sleep on a condition variable (no spinning: on a host with hundreds of ranks a
//! channel's spin-then-yield wait took 3.5 % of the job's CPU). The accept thread is stopped by
//! shutting the listener down, which wakes a blocked `accept` (on Linux); a connection to the
//! listener's own address wakes it where shutting down does not.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dist_core::Result;

use super::handshake::{Rules, io_err, serve_handshake};

/// The most connections one listener holds in its handshake at once, running or queued for a
/// worker. A connection that arrives while this many are held is closed at once, unread: a
/// flood of idle or garbage connections costs at most this many sockets, each for at most the
/// handshake timeout from its accept. A rank turned away this way (closed before any reply)
/// connects again, with backoff, until its deadline.
pub(crate) const MAX_HANDSHAKES: usize = 64;

/// The most threads running handshakes for one listener.
pub(crate) const HANDSHAKE_WORKERS: usize = 4;

/// How long a handshake worker waits for work before it ends.
pub(crate) const WORKER_IDLE: Duration = Duration::from_secs(2);

type Queued = (TcpStream, SocketAddr, Instant);

/// Accepts connections until dropped and runs their handshakes on a bounded pool; where the
/// connections that pass go is the rules' [`Gate`](super::handshake::Gate)'s business.
pub(crate) struct Acceptor {
    stop: Arc<AtomicBool>,
    /// The listening socket (a duplicate of the accept thread's), to shut it down at drop.
    listener: socket2::Socket,
    addr: Option<SocketAddr>,
    thread: Option<JoinHandle<()>>,
    #[cfg(test)]
    pool: Arc<Pool>,
}

struct Pool {
    rules: Arc<Rules>,
    queue: Mutex<Queue>,
    /// Idle workers wait on this for a connection (or the accept thread's end).
    work: Condvar,
    stop: Arc<AtomicBool>,
}

/// The connections waiting for a worker, and the workers. A worker ends only when the queue is
/// empty under this lock, and the accept thread pushes and checks the workers under it, so a
/// queued connection always has a worker.
#[derive(Default)]
struct Queue {
    waiting: VecDeque<Queued>,
    /// Workers alive.
    workers: usize,
    /// Workers waiting for a connection.
    idle: usize,
    /// The accept thread has ended: no more connections come.
    closed: bool,
    /// Workers started so far (tests count them).
    started: usize,
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Acceptor {
    pub(crate) fn start(listener: TcpListener, rules: Rules) -> Result<Acceptor> {
        let me = rules.me;
        let addr = listener.local_addr().ok();
        let dup = socket2::Socket::from(
            listener
                .try_clone()
                .map_err(io_err(me, "duplicate the listener"))?,
        );
        // Blocking accepts (formation used to poll with a read timeout).
        listener
            .set_nonblocking(false)
            .map_err(io_err(me, "make the listener blocking"))?;
        socket2::SockRef::from(&listener)
            .set_read_timeout(None)
            .map_err(io_err(me, "clear the accept timeout"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let pool = Arc::new(Pool {
            rules: Arc::new(rules),
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            stop: stop.clone(),
        });
        let thread = std::thread::Builder::new()
            .name(format!("dist-accept-{me}"))
            .spawn({
                let stop = stop.clone();
                let pool = pool.clone();
                move || {
                    accept_loop(listener, &pool, stop);
                    pool.lock().closed = true;
                    pool.work.notify_all();
                }
            })
            .map_err(io_err(me, "spawn the accept thread"))?;
        Ok(Acceptor {
            stop,
            listener: dup,
            addr,
            thread: Some(thread),
            #[cfg(test)]
            pool,
        })
    }

    /// Handshake workers started so far, those alive now, and those of them idle.
    #[cfg(test)]
    pub(crate) fn workers(&self) -> (usize, usize, usize) {
        let q = self.pool.lock();
        (q.started, q.workers, q.idle)
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the blocked accept with an error on Linux; elsewhere the connection below does.
        let _ = self.listener.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            if !t.is_finished()
                && let Some(addr) = self.addr
            {
                let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(100));
            }
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, pool: &Arc<Pool>, stop: Arc<AtomicBool>) {
    let me = pool.rules.me;
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, from) = match accepted {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of descriptors and the like: say so, and give the host a moment rather
                // than spin on the same error.
                tracing::warn!(rank = me, error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let mut q = pool.lock();
        if q.waiting.len() + q.workers - q.idle >= MAX_HANDSHAKES {
            drop(q);
            tracing::debug!(rank = me, %from, "{MAX_HANDSHAKES} handshakes held; closed at once");
            continue;
        }
        q.waiting.push_back((stream, from, Instant::now()));
        if q.idle >= q.waiting.len() {
            // An idle worker takes it (one per queued connection).
            pool.work.notify_one();
        } else if q.workers < HANDSHAKE_WORKERS {
            let p = pool.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("dist-handshake-{me}"))
                .spawn(move || work(&p));
            match spawned {
                Ok(_) => {
                    q.workers += 1;
                    q.started += 1;
                }
                Err(e) if q.workers == 0 => {
                    // No worker to take it: drop what is queued rather than hold it.
                    tracing::warn!(rank = me, error = %e, "cannot spawn a handshake worker");
                    q.waiting.clear();
                }
                Err(e) => tracing::debug!(rank = me, error = %e, "no extra handshake worker"),
            }
        }
    }
}

/// A worker: runs the queued handshakes, and ends once [`WORKER_IDLE`] passes with none (or
/// the accept thread has ended and none is left).
fn work(pool: &Pool) {
    /// Counts the worker out if its handshake panics, so that the accept thread starts
    /// another for what is queued.
    struct Unwinding<'a>(&'a Pool);
    impl Drop for Unwinding<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.0.lock().workers -= 1;
            }
        }
    }
    let _unwinding = Unwinding(pool);
    let me = pool.rules.me;
    let mut q = pool.lock();
    let mut idle_since = Instant::now();
    loop {
        if let Some((stream, from, at)) = q.waiting.pop_front() {
            drop(q);
            if pool.stop.load(Ordering::SeqCst) {
                // The listener is closing: dropped unserved.
                drop(stream);
            } else {
                match serve_handshake(stream, from, at, &pool.rules) {
                    Ok(()) => tracing::debug!(rank = me, %from, "peer connected"),
                    // Crossing is part of the protocol, not a fault.
                    Err(why) if why.starts_with("crossed") => {
                        tracing::debug!(rank = me, %from, reason = %why, "refused a connection")
                    }
                    Err(why) => {
                        tracing::warn!(rank = me, %from, reason = %why, "refused a connection")
                    }
                }
            }
            q = pool.lock();
            idle_since = Instant::now();
            continue;
        }
        let left = WORKER_IDLE.saturating_sub(idle_since.elapsed());
        if q.closed || left.is_zero() {
            q.workers -= 1;
            return;
        }
        q.idle += 1;
        q = pool
            .work
            .wait_timeout(q, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        q.idle -= 1;
    }
}

//! A listener's accept thread and its fixed pool of handshake workers.
//!
//! One thread blocks in `accept` (no polling) and queues each connection, with the time it was
//! accepted, for a pool of at most [`HANDSHAKE_WORKERS`] threads that run the handshakes
//! ([`serve_handshake`]). Workers start as connections arrive and end after [`WORKER_IDLE`]
//! with nothing to do, so an idle listener costs one thread. The accept thread is stopped by
//! shutting the listener down, which wakes a blocked `accept` (on Linux); a connection to the
//! listener's own address wakes it where shutting down does not.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
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
}

struct Pool {
    rules: Arc<Rules>,
    rx: Receiver<Queued>,
    /// Workers alive. A worker ends only when the queue is empty under this lock, and the
    /// accept thread checks it under the lock after each push, so a queued connection always
    /// has a worker.
    workers: Mutex<usize>,
    stop: Arc<AtomicBool>,
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
        let (tx, rx) = crossbeam_channel::bounded(MAX_HANDSHAKES - HANDSHAKE_WORKERS);
        let pool = Arc::new(Pool {
            rules: Arc::new(rules),
            rx,
            workers: Mutex::new(0),
            stop: stop.clone(),
        });
        let thread = std::thread::Builder::new()
            .name(format!("dist-accept-{me}"))
            .spawn({
                let stop = stop.clone();
                move || accept_loop(listener, pool, tx, stop)
            })
            .map_err(io_err(me, "spawn the accept thread"))?;
        Ok(Acceptor {
            stop,
            listener: dup,
            addr,
            thread: Some(thread),
        })
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

fn accept_loop(listener: TcpListener, pool: Arc<Pool>, tx: Sender<Queued>, stop: Arc<AtomicBool>) {
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
        match tx.try_send((stream, from, Instant::now())) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                tracing::debug!(rank = me, %from, "{MAX_HANDSHAKES} handshakes held; closed at once");
                continue;
            }
        }
        let mut workers = pool.workers.lock().unwrap_or_else(|p| p.into_inner());
        if *workers < HANDSHAKE_WORKERS {
            let p = pool.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("dist-handshake-{me}"))
                .spawn(move || work(&p));
            match spawned {
                Ok(_) => *workers += 1,
                Err(e) if *workers == 0 => {
                    // No worker to take it: drop what is queued rather than hold it.
                    tracing::warn!(rank = me, error = %e, "cannot spawn a handshake worker");
                    while pool.rx.try_recv().is_ok() {}
                }
                Err(e) => tracing::debug!(rank = me, error = %e, "no extra handshake worker"),
            }
        }
    }
}

fn work(pool: &Pool) {
    let me = pool.rules.me;
    loop {
        match pool.rx.recv_timeout(WORKER_IDLE) {
            Ok((stream, from, at)) => {
                if pool.stop.load(Ordering::SeqCst) {
                    continue; // Dropped: the listener is closing.
                }
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
            Err(_) => {
                let mut workers = pool.workers.lock().unwrap_or_else(|p| p.into_inner());
                if pool.rx.is_empty() {
                    *workers -= 1;
                    return;
                }
            }
        }
    }
}

//! A peer created before its connection (groundwork for lazy connections): the
//! connection is attached once, by whoever makes it (an acceptor, or the first use of the peer
//! through the backend's connect hook); receives posted before then wait in the table and are
//! served once it is attached.

use super::*;

/// Makes the connection to a peer (its rank) by a deadline: dials, and does the handshake.
/// `Ok(None)`: the peer's own connection arrived meanwhile and was attached to this peer by
/// whoever accepted it (both ranks dialed at once, and the peer's connection won).
pub(crate) type ConnectHook =
    Arc<dyn Fn(usize, Instant) -> Result<Option<TcpStream>> + Send + Sync>;

/// Who is dialing a peer now.
#[derive(Debug, Default)]
pub(super) struct Dial {
    /// A caller runs the connect hook now; the others wait for it.
    busy: bool,
    /// How the last dial ended in failure, counted so that the waiters of that dial see it.
    failures: u64,
    last_failure: Option<String>,
    /// Callers waiting for another's dial (tests wait for a racer to be here).
    pub(super) waiting: usize,
}

impl Peer {
    /// A peer with no connection yet: its connection is attached later ([`Peer::attach`]), or
    /// made on first use of a send or a posted receive by `connect`, if given.
    pub(crate) fn unconnected(
        me: usize,
        rank: usize,
        timeout: Duration,
        aborts: Arc<Aborts>,
        limits: Limits,
        connect: Option<ConnectHook>,
    ) -> Peer {
        Peer::bare(me, rank, timeout, aborts, limits, connect)
    }

    /// Attaches the connection to this peer (its handshake done), and hands it to the I/O
    /// thread. `Ok(false)`: the peer had a connection already (`stream` is dropped).
    pub(crate) fn attach(&self, stream: TcpStream) -> Result<bool> {
        if self.loopback || self.is_connected() {
            return Ok(false);
        }
        match self.set_conn(stream, crate::shm::Shm::default()) {
            Ok(()) => {}
            Err(_) if self.is_connected() => return Ok(false),
            Err(e) => return Err(e),
        }
        self.io_register();
        // Receivers asleep on this peer were not spinning (there was no socket): the I/O
        // thread now reads for them.
        let st = self.lock();
        self.notify(&st);
        Ok(true)
    }

    /// The connection, made now through the connect hook if there is none yet (one caller dials;
    /// the others wait for it, at most until `deadline`). `Ok(None)`: no connection and no hook
    /// (a receive then waits for one to be attached).
    pub(super) fn connection_by(
        &self,
        deadline: Instant,
        op: &dyn Fn() -> String,
    ) -> Result<Option<&Conn>> {
        if let Some(c) = self.conn.get() {
            return Ok(Some(c));
        }
        let Some(hook) = &self.connect else {
            return Ok(None);
        };
        let started = Instant::now();
        let mut d = self.dial.lock().unwrap_or_else(|p| p.into_inner());
        let failures = d.failures;
        while d.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timeout(format!("{} (waiting for the connection)", op()), started));
            }
            d.waiting += 1;
            d = self
                .dialed
                .wait_timeout(d, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            d.waiting -= 1;
        }
        if let Some(c) = self.conn.get() {
            return Ok(Some(c));
        }
        if d.failures != failures {
            // The dial this caller waited for failed: it fails with the same cause.
            let cause = d.last_failure.clone().unwrap_or_default();
            return Err(self.connect_failed(op(), cause));
        }
        d.busy = true;
        drop(d);
        // The hook may block until `deadline` (and must not go past it); nobody's lock is held.
        let made = hook(self.rank, deadline).and_then(|s| match s {
            Some(s) => self.attach(s).map(drop),
            None if self.is_connected() => Ok(()),
            None => Err(DistError::PeerGone {
                rank: self.me,
                peer: self.rank,
                op: op(),
                cause: "the connection the peer made was not attached".into(),
            }),
        });
        let mut d = self.dial.lock().unwrap_or_else(|p| p.into_inner());
        d.busy = false;
        let r = match made {
            Ok(_) => Ok(self.conn.get().map(|c| &**c)),
            Err(e) => {
                d.failures += 1;
                d.last_failure = Some(e.to_string());
                Err(match e {
                    DistError::Timeout { .. } => {
                        self.timeout(format!("{} (connecting: {e})", op()), started)
                    }
                    e => self.connect_failed(op(), e.to_string()),
                })
            }
        };
        self.dialed.notify_all();
        r
    }

    fn connect_failed(&self, op: String, cause: String) -> DistError {
        DistError::PeerGone {
            rank: self.me,
            peer: self.rank,
            op,
            cause: format!("could not connect: {cause}"),
        }
    }
}

//! Making a peer: the state every peer starts in, a peer over a stream whose handshake is done
//! (with or without shared memory), the loopback peer, and a connection's parts (socket options,
//! the writing half, the read side) set up once from its stream.

use super::*;

impl Peer {
    /// A peer with no connection, nothing posted, queued or heard yet: the state every
    /// peer starts in.
    pub(super) fn bare(
        me: usize,
        rank: usize,
        send_timeout: Duration,
        aborts: Arc<Aborts>,
        limits: Limits,
        connect: Option<ConnectHook>,
    ) -> Peer {
        Peer {
            me,
            rank,
            loopback: false,
            conn: OnceLock::new(),
            send_timeout,
            connect,
            dial: Mutex::new(connect::Dial::default()),
            dialed: Condvar::new(),
            io: OnceLock::new(),
            this: OnceLock::new(),
            io_added: AtomicBool::new(false),
            io_woken: AtomicBool::new(false),
            spinners: AtomicUsize::new(0),
            spin_us: AtomicU64::new(spin_env().unwrap_or(SPIN).as_micros() as u64),
            #[cfg(test)]
            reader_turns: AtomicU64::new(0),
            on_abort: OnceLock::new(),
            on_close: OnceLock::new(),
            heard: AtomicBool::new(false),
            silent_ms: AtomicU64::new(0),
            position: AtomicU64::new(u64::MAX),
            beside: AtomicU64::new(u64::MAX),
            beats: AtomicU64::new(0),
            on_beat: OnceLock::new(),
            leaving: OnceLock::new(),
            state: Mutex::new(State::new()),
            cond: Condvar::new(),
            aborts,
            limits,
        }
    }

    /// A peer over `stream`, whose handshake is done, with no shared memory (and no
    /// negotiation of it on the stream).
    pub(crate) fn connected(
        me: usize,
        rank: usize,
        stream: TcpStream,
        timeout: Duration,
        aborts: Arc<Aborts>,
        limits: Limits,
    ) -> Result<Peer> {
        let p = Peer::bare(me, rank, timeout, aborts, limits, None);
        p.set_conn(stream, crate::shm::Shm::default())?;
        Ok(p)
    }

    /// A peer over `stream`, whose handshake is done, after choosing shared memory for it with
    /// the peer (`crate::shm::negotiate`; both sides must call this at the same point of the
    /// stream, before any frame): `host` is this rank's host identity, `None` to decline;
    /// `arena` the host arena's setup, which learns the peer's part.
    // The connection's parts, and the choice of shared memory with its deadline.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connected_shm(
        me: usize,
        rank: usize,
        stream: TcpStream,
        timeout: Duration,
        aborts: Arc<Aborts>,
        limits: Limits,
        host: Option<[u8; 32]>,
        arena: Option<&crate::shm::ArenaSetup>,
        deadline: Instant,
    ) -> Result<Peer> {
        let shm =
            crate::shm::negotiate(&stream, me, rank, host, arena, deadline).map_err(|cause| {
                DistError::PeerGone {
                    rank: me,
                    peer: rank,
                    op: "choose shared memory for the connection".into(),
                    cause,
                }
            })?;
        let p = Peer::bare(me, rank, timeout, aborts, limits, None);
        p.set_conn(stream, shm)?;
        Ok(p)
    }

    /// The peer that is this rank itself: sends are copied to its own queue.
    pub(crate) fn loopback(me: usize, aborts: Arc<Aborts>) -> Peer {
        // Loopback messages are copies of this rank's own sends: no wire, no budget.
        let limits = Limits {
            max_message: u64::MAX,
            unexpected: usize::MAX,
            sealed: false,
        };
        let mut p = Peer::bare(me, me, Duration::ZERO, aborts, limits, None);
        p.loopback = true;
        p
    }

    /// Makes the connection's parts from `stream` and sets them; an error if the peer already
    /// has a connection.
    pub(super) fn set_conn(&self, stream: TcpStream, shm: crate::shm::Shm) -> Result<()> {
        let (me, rank) = (self.me, self.rank);
        let io = |context: &str, source| DistError::Io {
            rank: me,
            context: format!("{context} for peer {rank}"),
            source,
        };
        stream
            .set_nodelay(true)
            .map_err(|e| io("set TCP_NODELAY", e))?;
        stream
            .set_read_timeout(None)
            .map_err(|e| io("clear read timeout", e))?;
        let w = stream.try_clone().map_err(|e| io("clone socket", e))?;
        let sock = socket2::Socket::from(w);
        sock.set_write_timeout(Some(self.send_timeout))
            .map_err(|e| io("set send timeout", e))?;
        crate::sys::prepare(&sock).map_err(|e| io("prepare socket", e))?;
        let r = socket2::Socket::from(stream.try_clone().map_err(|e| io("clone socket", e))?);
        let shm_ways = (shm.tx.is_some(), shm.rx.is_some());
        // The keys its handshake derived, if it was sealed; a direction through shared memory
        // is not sealed (it never leaves the host).
        let keys = crate::seal::take(&stream);
        if self.limits.sealed && keys.is_none() {
            return Err(DistError::InvalidArgument {
                rank: me,
                op: format!("attach a connection to peer {rank}"),
                reason: "connections must be sealed (DIST_SEAL) and this one's handshake \
                         derived no keys"
                    .into(),
            });
        }
        let (sealer, opener) = match &keys {
            Some(k) => (
                Some(crate::seal::Sealer::new(&k.tx)),
                Some(crate::seal::Opener::new(&k.rx, rank)),
            ),
            None => (None, None),
        };
        let conn = Conn {
            shm: shm_ways,
            pollable: !shm_ways.1,
            writer: WriterLock::new(match shm.tx {
                Some(t) => Writer::new(sock, Some(t.for_rank(me))),
                None => Writer::sealed(sock, sealer),
            }),
            rx: Mutex::new(Rx {
                sock: match (shm.rx, opener) {
                    (Some(ring), _) => Source::Ring {
                        sock: r,
                        ring: ring.for_rank(me),
                        io_turn: false,
                        bells_left: false,
                    },
                    (None, Some(open)) => Source::Sealed {
                        inner: Box::new(Source::Socket(r)),
                        open: Box::new(open),
                    },
                    (None, None) => Source::Socket(r),
                },
                buf: vec![0u8; RX_BUF_MIN].into_boxed_slice(),
                lo: 0,
                hi: 0,
                frame: Frame::Header,
                dead: false,
                stopped_early: false,
                held_unread: 0,
            }),
            stream,
        };
        self.conn
            .set(Box::new(conn))
            .map_err(|_| DistError::InvalidArgument {
                rank: me,
                op: format!("attach a connection to peer {rank}"),
                reason: "the peer already has a connection".into(),
            })
    }
}

//! Forming a backend: the store, the rendezvous through it, the connections, shared memory,
//! liveness and the group over them ([`TcpBackend::build`], for epoch 0 and for the epochs
//! [`TcpBackend::recover`] forms).

#[allow(unused_imports)]
use super::*;

impl TcpBackend {
    /// Forms epoch 0 of the job `cfg` describes, or, with `next`, a later epoch through its
    /// store ([`TcpBackend::recover`]).
    pub(crate) fn build(
        cfg: TcpConfig,
        next: Option<elastic::Next>,
        keeper: Option<usize>,
    ) -> Result<TcpBackend> {
        let parallel = config::parallel_for(&cfg);
        let me = cfg.rank;
        // Connections a peer makes to this rank after formation (lazy formation only).
        let incoming = Arc::new(lazy::Incoming::default());
        let (epoch, members, reuse) = match next {
            Some(n) => (n.epoch, n.members, Some(n.store)),
            None => (0, (0..cfg.world_size).collect(), None),
        };
        let (streams, mesh, store) = match (cfg.formation_mode(), reuse) {
            (Formation::Lazy, None) => {
                let inc = incoming.clone();
                let formed = init::form_lazy(&cfg, Box::new(move |r, s| inc.deliver(r, s)))?;
                (formed.streams, Some(Arc::new(formed.mesh)), formed.store)
            }
            (Formation::Lazy, Some(js)) => {
                let inc = incoming.clone();
                let on_incoming: init::OnIncoming = Box::new(move |r, s| inc.deliver(r, s));
                let (streams, mesh, store) = init::form_in(&cfg, js, Some(on_incoming))?;
                (streams, mesh.map(Arc::new), store)
            }
            (_, None) => {
                let (streams, store) = init::form(&cfg)?;
                (streams, None, store)
            }
            (_, Some(js)) => {
                let (streams, _, store) = init::form_in(&cfg, js, None)?;
                (streams, None, store)
            }
        };
        let aborts = Arc::new(Aborts::default());
        let limits = Limits {
            max_message: cfg.max_message,
            unexpected: cfg.unexpected_limit,
            sealed: cfg.seal,
        };
        // Ranks of this job on this host: those listening on this rank's address (lazy), or
        // the peers whose connection comes from this host's own address (eager), or as the
        // launcher says.
        let same_host = match &mesh {
            Some(m) => m.same_host_ranks().saturating_sub(1),
            None => streams
                .iter()
                .flatten()
                .filter(|s| match (s.local_addr(), s.peer_addr()) {
                    (Ok(l), Ok(p)) => l.ip() == p.ip(),
                    _ => false,
                })
                .count(),
        };
        let local = config::local_ranks(|k| std::env::var(k).ok(), 1 + same_host);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = peer::spin_env().unwrap_or_else(|| config::default_spin(local, cores));
        tracing::debug!(rank = me, local, cores, ?spin, "receive spin");
        let mut peers = Vec::with_capacity(cfg.world_size);
        // One deadline and one host identity for every peer's shared-memory exchange: a
        // deadline per peer would let a slow rank hold formation for (n - 1) init timeouts.
        let (shm_host, shm_by) = (cfg.shm_host(), Instant::now() + cfg.init_timeout);
        // The host arena, on jobs formed at init (a lazily formed job has none: every rank
        // answers alike, as `Link::arena` asks).
        let arena_setup = (mesh.is_none() && cfg!(target_os = "linux"))
            .then(|| shm::ArenaSetup::new(me, cfg.world_size, shm_host));
        for (r, s) in streams.into_iter().enumerate() {
            peers.push(Arc::new(match (s, &mesh) {
                // A lazy job keeps every connection on TCP (`TcpConfig::shm_host`), on every
                // rank alike: no offers to exchange, which rank 0 did with each rank in turn
                // (two round trips each; about 1 s at 1,024 ranks on 2 cores).
                (Some(s), Some(_)) => {
                    Peer::connected(me, r, s, cfg.timeout, aborts.clone(), limits)?
                }
                (Some(s), None) => Peer::connected_shm(
                    me,
                    r,
                    s,
                    cfg.timeout,
                    aborts.clone(),
                    limits,
                    shm_host,
                    arena_setup.as_ref(),
                    shm_by,
                )?,
                (None, Some(m)) if r != me => Peer::unconnected(
                    me,
                    r,
                    cfg.timeout,
                    aborts.clone(),
                    limits,
                    Some(lazy::dialer(me, m)),
                ),
                (None, _) => Peer::loopback(me, aborts.clone()),
            }));
        }
        for p in &peers {
            p.set_spin(spin);
        }
        let direct = config::direct_for(
            &cfg,
            local,
            cores,
            dist_core::transport::read_process_is_fast,
        );
        let threads = config::arena_threads_for(&cfg, local, cores);
        tracing::debug!(
            rank = me,
            ?direct,
            threads,
            "direct reads proposed from (bytes); threads on the arena"
        );
        let small_spin = config::default_small_spin(local, cores);
        let arena = arena_setup.map(|s| {
            s.finish(peers.clone(), spin, direct, threads)
                .with_small_spin(small_spin)
        });
        let (events, inbox) = liveness::channel();
        let shared = Arc::new(Shared {
            rank: me,
            world: cfg.world_size,
            timeout: cfg.timeout,
            linger: cfg.linger,
            peers,
            aborts,
            parallel,
            peer_timeout: cfg.peer_timeout,
            closing: AtomicBool::new(false),
            faults: Default::default(),
            events,
            flight: FlightRecorder::default(),
            trace_dir: cfg.trace_dir.clone(),
            trace_lock: std::sync::Mutex::new(()),
            beside: OnceLock::new(),
            beats: record::BeatWait::default(),
            arena,
            group_claimed: AtomicBool::new(false),
            epoch,
            members,
            elastic: cfg.elastic,
            revoked: OnceLock::new(),
            failed: Default::default(),
            first_failure: OnceLock::new(),
        });
        let io =
            peer::IoThread::spawn(format!("dist-io-{me}")).map_err(|source| DistError::Io {
                rank: me,
                context: "start the I/O thread".into(),
                source,
            })?;
        let mut threads = Threads {
            shared: shared.clone(),
            mesh,
            incoming: incoming.clone(),
            io,
            liveness: None,
            linger_cap: None,
        };
        // One of each hook for every peer (each is told the peer's rank): a thousand ranks'
        // peers share three closures instead of holding three each.
        let weak = Arc::downgrade(&shared);
        let abort_sink: peer::AbortSink = Arc::new(move |mut notice: AbortNotice| {
            if let Some(s) = weak.upgrade() {
                // A peer may name any number as the rank at fault: one that is no rank of
                // the job is no culprit (the failure is then the sender's).
                if notice.culprit.is_some_and(|c| c >= s.world) {
                    notice.culprit = None;
                }
                if notice.first.is_some_and(|c| c >= s.world) {
                    notice.first = None;
                }
                // Noted for a recovery, and an elastic backend revoked, before the waiters
                // are woken.
                s.heard_abort(&notice);
                // The hooks hear of it, and a rank that only hears of a failure writes its
                // record too, once per notice (not per frame: see `liveness::Inbox`).
                s.post_abort(&notice);
                s.note_abort(notice);
            }
        });
        let weak = Arc::downgrade(&shared);
        let beat_sink: peer::BeatSink = Arc::new(move |from, asked| {
            if let Some(s) = weak.upgrade() {
                s.heard_beat(from, asked);
            }
        });
        let weak = Arc::downgrade(&shared);
        // A close after the peer said "closing" is no fault within the excuse its silence has
        // (its linger), and one like any other after: a peer killed long after it said so, or
        // one that said so to hide its end, is reported `Closed`.
        let close_sink: peer::CloseSink = Arc::new(move |from, cause| {
            if let Some(s) = weak.upgrade()
                && !s.peers[from].declared_silent()
                && !s.peers[from].leaving_within(s.closing_excuse(), Instant::now())
            {
                s.post(PeerFault {
                    rank: s.rank,
                    peer: from,
                    cause: FaultCause::Closed(cause),
                });
            }
        });
        for peer in shared.peers.iter().filter(|p| !p.is_loopback()) {
            peer.set_abort_sink(abort_sink.clone());
            peer.set_beat_sink(beat_sink.clone());
            peer.set_close_sink(close_sink.clone());
            // Its connection is watched by the I/O thread from now on (or from its attach).
            threads.io.adopt(peer);
        }
        // Connections peers made before the peers existed are attached now; later ones at once.
        incoming.open(&shared.peers);
        let weak = Arc::downgrade(&shared);
        let (world, interval) = (
            cfg.world_size,
            liveness::heartbeat_interval(cfg.peer_timeout),
        );
        let liveness = std::thread::Builder::new()
            .name(format!("dist-live-{me}"))
            .spawn(move || liveness::run(weak, inbox, world, interval))
            .map_err(|source| DistError::Io {
                rank: me,
                context: "spawn the liveness thread".into(),
                source,
            })?;
        threads.liveness = Some(liveness);
        // The group forms over the mesh: rank 0's tuning goes down a binomial tree (in a lazy
        // job, over connections made on first use). Should it fail, `threads` closes the
        // connections on its way out.
        let link = TcpLink(shared.clone());
        let group = Group::form(
            link,
            config::local_tuning(&cfg, parallel, local, cores),
            cfg.timeout,
        )?;
        Ok(TcpBackend {
            shared,
            group,
            _threads: threads,
            store,
            cfg,
            keeper,
        })
    }
}

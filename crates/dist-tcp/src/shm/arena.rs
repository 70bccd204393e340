//! The host arena of a [`TcpBackend`](crate::TcpBackend) ([`dist_core::transport::HostArena`]): one
//! segment per rank (`arena_map.rs`), made before the connections, whose descriptor travels
//! with the ring's in each same-host pair's exchange (`setup.rs`); each rank maps its own
//! read-write and its host's peers' read-only. [`ArenaSetup`] gathers, while the connections
//! form, each peer's host and mapping; [`ArenaSetup::finish`] makes the arena.
//!
//! Waking: a thread about to sleep on a peer's word adds one to its rank's asleep count, then
//! (after a `SeqCst` fence) looks at the word once more and sleeps on it with a futex, and takes
//! its one off when it wakes; a rank that publishes a word stores it, fences, and wakes the
//! word's sleepers if any peer's asleep count is not zero. One of the two always sees the other (store-fence-load on both sides). A peer's
//! death is its TCP connection closing ([`HostArena::check_peer`]).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dist_core::transport::{ArenaWord, HostArena};
use dist_core::{DistError, Meta, Result};

use super::arena_map::{
    Mapping, OFF_ASLEEP, OFF_CALL, OFF_CALL_SEQ, OFF_META, OFF_PID, OFF_PROBE_ADDR,
    OFF_PROBE_VALUE, OFF_WORDS, Refused, SMALL_DATA,
};
use super::pidfd::{Memory, PeerProcess, Taken, of_this_process};
use crate::peer::Peer;

/// The bytes of each of a rank's two slots: the piece of a large all_reduce (the memory is
/// the kernel's only once touched: a job whose all_reduces on the arena are smaller touches
/// no more). On the 16-core host, the arena at every size split over each rank's threads,
/// all_reduce µs with 4 MiB slots against 1 MiB (`docs/results/README.md`, "2026-12-02, morning
/// (00e12fa)"): 4 ranks 2 MiB 325 against 412, 4 MiB 606 against 778, 16 MiB 2,534 against 3,248; 8
/// ranks 2 MiB 546 against 658, 16 MiB 4,680 against 4,986; 16 ranks on one thread each, within 8 %
/// from 256 KiB to 64 MiB (2–8 % faster up to 16 MiB, 2 % slower at 64 MiB).
pub(crate) const ARENA_SLOT: u64 = 4 << 20;

/// What the setup of the connections learns of one peer, for the arena.
#[derive(Debug, Default)]
struct PeerPart {
    /// Its host identity, if it offered shared memory.
    host: Option<[u8; 32]>,
    /// Its segment, mapped read-only.
    map: Option<Mapping>,
    /// It mapped this rank's segment too.
    mapped_mine: bool,
    /// The process at the other end of the Unix socket its descriptors came through
    /// (`SO_PEERCRED`), held by a pidfd (`SO_PEERPIDFD` where the kernel has it): the only
    /// process this rank reads directly for it.
    process: Option<PeerProcess>,
}

/// The arena's parts, gathered while the connections form.
#[derive(Debug)]
pub(crate) struct ArenaSetup {
    me: usize,
    host: Option<[u8; 32]>,
    own: Option<(OwnedFd, Mapping)>,
    peers: Mutex<Vec<PeerPart>>,
    /// The value peers read directly to learn whether they can read this process's memory;
    /// boxed, so that the address in the header stays its own while the arena lives.
    probe: Box<u64>,
}

impl ArenaSetup {
    /// The setup of rank `me` of `world` on host `host` (`None`: no shared memory): makes this
    /// rank's segment, unless shared memory is off or the segment cannot be made (then every
    /// rank runs its collectives over messages: the group agrees on it).
    pub(crate) fn new(me: usize, world: usize, host: Option<[u8; 32]>) -> ArenaSetup {
        let probe = Box::new(probe_value(me));
        let at = std::ptr::from_ref::<u64>(&probe) as usize as u64;
        let own = host.and_then(|_| {
            Mapping::create(ARENA_SLOT, me, (at, *probe))
                .inspect_err(|e| tracing::warn!(me, "no host arena: {e}"))
                .ok()
        });
        ArenaSetup {
            me,
            host,
            own,
            peers: Mutex::new((0..world).map(|_| PeerPart::default()).collect()),
            probe,
        }
    }

    fn parts(&self) -> std::sync::MutexGuard<'_, Vec<PeerPart>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This rank's segment's descriptor, to pass to its host's peers.
    pub(crate) fn fd(&self) -> Option<&OwnedFd> {
        self.own.as_ref().map(|(fd, _)| fd)
    }

    /// Peer `peer`'s host identity, as its offer said (`None`: it offered no shared memory).
    pub(crate) fn note_host(&self, peer: usize, host: Option<[u8; 32]>) {
        if let Some(p) = self.parts().get_mut(peer) {
            p.host = host;
        }
    }

    /// Maps the segment `peer` passed (checked first); whether it could. `process` is the
    /// process at the other end of the Unix socket the descriptor came through, as the kernel
    /// says (`SO_PEERCRED`), held by a pidfd taken from that socket (`SO_PEERPIDFD`) or, on a
    /// kernel without it, opened by pid right after the exchange; `None` where there is none
    /// (the kernel could not say, the process is gone, a kernel without pidfds): then no direct
    /// reads of the peer. Direct reads read that process only, and only if the header names
    /// it too ([`TcpArena::probe_peers`]).
    pub(crate) fn map_peer(&self, peer: usize, fd: &OwnedFd, process: Option<PeerProcess>) -> bool {
        match &process {
            Some(p) => tracing::debug!(
                me = self.me,
                peer,
                pid = p.pid(),
                taken = ?p.taken(),
                memory = ?p.memory(),
                "peer's process"
            ),
            None => tracing::debug!(
                me = self.me,
                peer,
                "peer's process unknown: no direct reads"
            ),
        }
        match Mapping::open(fd, ARENA_SLOT, peer) {
            Ok(m) => {
                if let Some(p) = self.parts().get_mut(peer) {
                    p.map = Some(m);
                    p.process = process;
                    return true;
                }
                false
            }
            Err(e) => {
                tracing::warn!(me = self.me, peer, "peer's host arena refused: {e}");
                false
            }
        }
    }

    /// `peer` mapped this rank's segment.
    pub(crate) fn note_mapped_mine(&self, peer: usize) {
        if let Some(p) = self.parts().get_mut(peer) {
            p.mapped_mine = true;
        }
    }

    /// The arena, once every connection is made; `peers` are the backend's (for their
    /// liveness), `spin` how long a wait spins before it sleeps, `direct` the size from which
    /// this rank proposes direct reads of its peers' buffers (`None`: it does not), `threads`
    /// the threads it splits its part of an all_reduce over ([`HostArena::threads`]).
    pub(crate) fn finish(
        self,
        peers: Vec<Arc<Peer>>,
        spin: Duration,
        direct: Option<usize>,
        threads: usize,
    ) -> TcpArena {
        let me = self.me;
        let mut parts = self.peers.into_inner().unwrap_or_else(|p| p.into_inner());
        let key = |r: usize| if r == me { self.host } else { parts[r].host };
        let keys: Vec<_> = (0..parts.len()).map(key).collect();
        // A rank's host: the first rank with its identity (a rank without one: its own).
        let hosts: Vec<usize> = (0..keys.len())
            .map(|r| match keys[r] {
                Some(k) => (0..=r).find(|&q| keys[q] == Some(k)).unwrap_or(r),
                None => r,
            })
            .collect();
        let local: Vec<usize> = dist_core::transport::host_ranks(&hosts, me);
        let complete = self.own.is_some()
            && local
                .iter()
                .filter(|&&r| r != me)
                .all(|&r| parts[r].map.is_some() && parts[r].mapped_mine);
        let procs: Vec<Option<PeerProcess>> = parts.iter_mut().map(|p| p.process.take()).collect();
        // Asked once, while each pidfd is held: a process that has not exited keeps its pid,
        // so a peer found here not to be this process stays so for as long as `exited` says
        // it lives (checked before every direct read).
        let of_this = procs
            .iter()
            .map(|p| p.as_ref().is_some_and(|p| of_this_process(p.pid())))
            .collect();
        let maps = parts
            .iter_mut()
            .enumerate()
            .map(|(r, p)| p.map.take().filter(|_| hosts[r] == hosts[me] && r != me))
            .collect();
        TcpArena {
            me,
            hosts,
            local,
            complete,
            own: self.own.map(|(_, m)| m),
            maps,
            procs,
            of_this,
            peers,
            spin,
            small_spin: spin.min(dist_core::collectives::SMALL_SPIN),
            claimed: AtomicBool::new(false),
            probe: self.probe,
            direct,
            threads: threads.max(1),
            direct_probed: OnceLock::new(),
        }
    }
}

/// The host arena of a backend: its own segment, its host's peers' (read-only), their liveness.
pub(crate) struct TcpArena {
    me: usize,
    hosts: Vec<usize>,
    local: Vec<usize>,
    complete: bool,
    own: Option<Mapping>,
    /// Each peer of this host's segment, by rank (`None` elsewhere).
    maps: Vec<Option<Mapping>>,
    /// Each peer's process as the kernel named it (`SO_PEERCRED` of the socket its segment
    /// came through), by rank: what [`HostArena::read_direct`] reads, never the pid a peer's
    /// header says; held by a pidfd.
    procs: Vec<Option<PeerProcess>>,
    /// Whether each peer's process (`procs`) was this process or a thread of it when the
    /// arena was made ([`of_this_process`], a file lookup in `/proc`, asked once rather than on
    /// every direct read).
    of_this: Vec<bool>,
    peers: Vec<Arc<Peer>>,
    spin: Duration,
    /// The small areas' spin ([`HostArena::small_spin`]): the arena's spin or less.
    small_spin: Duration,
    /// A group has claimed the arena ([`HostArena::claim`]).
    claimed: AtomicBool,
    /// What the header says peers find at its probe address (kept alive with the arena).
    probe: Box<u64>,
    /// The size from which this rank proposes direct reads, if it does.
    direct: Option<usize>,
    /// [`HostArena::threads`].
    threads: usize,
    /// [`HostArena::direct_min`], once probed.
    direct_probed: OnceLock<Option<usize>>,
}

impl std::fmt::Debug for TcpArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpArena")
            .field("hosts", &self.hosts)
            .field("complete", &self.complete)
            .finish()
    }
}

impl TcpArena {
    /// The arena with its small areas' spin set to `spin` (at most the arena's own spin; see
    /// `config::default_small_spin`).
    pub(crate) fn with_small_spin(mut self, spin: Duration) -> TcpArena {
        self.small_spin = spin.min(self.spin);
        self
    }

    fn mapping(&self, owner: usize) -> Option<&Mapping> {
        if owner == self.me {
            self.own.as_ref()
        } else {
            self.maps.get(owner)?.as_ref()
        }
    }

    /// The error of a refused slot access (`what` the access, `owner` the slot's rank,
    /// `(slot, offset, len)` the range).
    fn refused(
        &self,
        why: Refused,
        what: &str,
        owner: usize,
        (slot, offset, len): (usize, usize, usize),
    ) -> DistError {
        let reason = match why {
            Refused::OutOfRange => format!(
                "{len} bytes at {offset} of slot {slot} of rank {owner}: not within a mapped \
                 segment's slots of {ARENA_SLOT} bytes"
            ),
            Refused::Busy => format!(
                "{len} bytes at {offset} of slot {slot} of rank {owner}: another thread of this \
                 process is copying overlapping bytes of those slots now (a write beside a copy, \
                 or a read beside a write)"
            ),
        };
        DistError::InvalidArgument {
            rank: self.me,
            op: format!("{what} the host arena"),
            reason,
        }
    }
}

impl TcpArena {
    /// The error of a refused small-area access (`what` the access, `owner` the area's rank,
    /// `(offset, len)` the range of its data).
    fn small_refused(
        &self,
        what: &str,
        owner: usize,
        area: usize,
        (offset, len): (usize, usize),
    ) -> DistError {
        DistError::InvalidArgument {
            rank: self.me,
            op: format!("{what} the host arena's small area"),
            reason: format!(
                "{len} bytes at {offset} of small area {area} of rank {owner}: not within a \
                 mapped segment's small areas of {SMALL_DATA} bytes"
            ),
        }
    }
}

impl TcpArena {
    /// The process to read directly for peer `q`: the one at the other end of the socket its
    /// segment came through (`SO_PEERCRED`), if its header names the same process and it is
    /// not this one; else why not. A peer that published another process's id (this rank's
    /// own, say, to have it read its own memory at addresses the peer chooses into results
    /// the peer reads) is refused here: the kernel, not the peer, says which process it is.
    /// A peer of this process (ranks as threads), or any process that shares this one's
    /// memory (a `CLONE_VM` child, as `kcmp` says), is refused too: a direct read of this
    /// process's memory at an address from a caller of the safe [`HostArena::read_direct`]
    /// could race a write of another thread (the contract of
    /// [`dist_core::transport::read_process`]); such ranks use the slots. So is a process
    /// whose memory `kcmp` could not compare (a kernel without it, a seccomp filter that
    /// refuses it, as Docker's default one does without `CAP_SYS_PTRACE`) when its pidfd was
    /// opened by pid; with the pidfd from the socket it is read ([`memory_verdict`] says why).
    fn direct_pid(&self, q: usize) -> std::result::Result<u32, String> {
        let m = self
            .mapping(q)
            .filter(|_| q != self.me)
            .ok_or_else(|| format!("rank {q} is not a peer on this host"))?;
        let Some(process) = self.procs.get(q).and_then(Option::as_ref) else {
            return Err(format!(
                "the kernel named no process for rank {q}'s socket (SO_PEERCRED), or it has \
                 no pidfd"
            ));
        };
        let pid = process.pid();
        let published = m.load_u32(OFF_PID);
        if published != pid {
            return Err(format!(
                "rank {q}'s arena names process {published}, but the socket its descriptors \
                 came through is process {pid}'s (SO_PEERCRED): no direct reads of it"
            ));
        }
        if self.of_this.get(q).copied().unwrap_or(true) {
            return Err(format!(
                "rank {q} is a rank of this process (process {pid}, or a thread of it): no \
                 direct reads of this process's memory"
            ));
        }
        memory_verdict(process.taken(), process.memory())
            .map(|()| pid)
            .map_err(|why| format!("rank {q}'s process {pid} {why}: no direct reads of it"))
    }

    /// Reads `dst.len()` bytes at `addr` of rank `q`'s process (`pid`, from
    /// [`TcpArena::direct_pid`]), between two checks that it has not exited: refused (kind
    /// `NotFound`, naming the peer) if it has, before or after, since its pid may then name
    /// another process, a thread of this one included. `dst` is zeroed on that refusal.
    fn read_live(&self, q: usize, pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let gone = || {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "rank {}: peer {q}'s process {pid} has exited: no direct reads of it",
                    self.me
                ),
            )
        };
        let process = self
            .procs
            .get(q)
            .and_then(Option::as_ref)
            .ok_or_else(gone)?;
        if process.pid() != pid || process.exited() {
            return Err(gone());
        }
        // SAFETY: `pid` was checked by `direct_pid`: it is the process the kernel named for
        // the peer's socket (its pidfd held by this arena, taken from the socket where the
        // kernel offers it), it was not this process nor a thread of it when the arena was made
        // (`of_this`, asked while the pidfd was held), and it does not share this process's
        // memory (`kcmp`, asked while the pidfd was held). Its process had not exited when
        // checked just now, so it has kept its pid since those checks, at that moment the pid
        // named it and nothing else, and the
        // kernel reads only the peer's memory, wherever `addr` points, and writes only `dst`:
        // `read_process`'s contract asks nothing more. One window remains, so this holds in
        // practice, not in every timing: `process_vm_readv` looks the pid up again inside the
        // call, and if the peer exits, is reaped and its pid is handed out again between the
        // check and that lookup, the kernel reads the new process (this one, if the pid went
        // to a new thread here: the race the contract forbids). That needs the whole pid space
        // to wrap round within the microseconds between the check and the call's lookup. It is
        // accepted because a read by pid cannot close it, and what such a read returns is not
        // used: the check after it sees the exit and zeroes `dst`.
        // (Tests: `arena_tests::direct_reads_are_probed`,
        // `direct_reads_follow_the_socket_not_the_header`,
        // `a_reused_pid_that_names_a_thread_here`, `an_exited_peer_is_not_read`,
        // `a_process_sharing_this_memory_is_not_read`; between processes, the multi-rank
        // `shm_arena` test's `direct` variant.)
        let r = unsafe { dist_core::transport::read_process(pid, addr, dst) };
        if process.exited() {
            dst.fill(0);
            return Err(gone());
        }
        r
    }

    /// Whether this rank can read every local peer's memory: each peer's process is the one
    /// the kernel names ([`TcpArena::direct_pid`]), and its probe value, read at the address
    /// its header gives, is the value it says.
    fn probe_peers(&self) -> bool {
        let _ = &self.probe;
        self.complete
            && self.local.iter().filter(|&&q| q != self.me).all(|&q| {
                let Some(m) = self.mapping(q) else {
                    return false;
                };
                let pid = match self.direct_pid(q) {
                    Ok(pid) => pid,
                    Err(e) => {
                        tracing::warn!(me = self.me, peer = q, "direct reads off: {e}");
                        return false;
                    }
                };
                let (at, want) = (m.load_u64(OFF_PROBE_ADDR), m.load_u64(OFF_PROBE_VALUE));
                let mut got = [0u8; 8];
                match self.read_live(q, pid, at, &mut got) {
                    Ok(()) if u64::from_le_bytes(got) == want && want != 0 => true,
                    Ok(()) => {
                        tracing::debug!(me = self.me, peer = q, "direct reads: probe mismatch");
                        false
                    }
                    Err(e) => {
                        tracing::debug!(me = self.me, peer = q, "direct reads refused: {e}");
                        false
                    }
                }
            })
    }
}

/// Whether a peer's process may be read directly, by what `kcmp` said of its memory
/// ([`Memory`]) and how its pidfd was taken ([`Taken`]); the error says why not.
///
/// A process that shares this one's memory is refused: reading it would read this process,
/// at addresses a peer chose, racing this process's own writes. Where `kcmp` cannot answer,
/// the pidfd decides: taken from the socket, it holds the very process that connected, and a
/// process can share this one's memory only if this process made it (`CLONE_VM`), never by a
/// peer's choice; so such a peer is read. Opened by pid (a kernel without `SO_PEERPIDFD`), the
/// pid could in principle have been handed out again between `SO_PEERCRED` and the open, and
/// without `kcmp`'s word the peer is refused: its ranks use the arena's slots, which are always
/// right, only slower from the direct reads' sizes on.
fn memory_verdict(taken: Taken, memory: &Memory) -> std::result::Result<(), String> {
    match (memory, taken) {
        (Memory::Apart, _) => Ok(()),
        (Memory::Shared, _) => Err("shares this process's memory (kcmp)".into()),
        (Memory::Unknown(_), Taken::FromSocket) => Ok(()),
        (Memory::Unknown(e), Taken::ByPid) => Err(format!(
            "was opened by pid and whether it shares this process's memory is unknown ({e})"
        )),
    }
}

/// A probe value: not zero, and unlikely to be found at an address of another process.
fn probe_value(me: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_usize(me);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() | 1
}

impl HostArena for TcpArena {
    fn hosts(&self) -> &[usize] {
        &self.hosts
    }

    fn local(&self) -> &[usize] {
        &self.local
    }

    fn complete(&self) -> bool {
        self.complete
    }

    fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }

    fn slot_len(&self) -> usize {
        ARENA_SLOT as usize
    }

    fn spin(&self) -> Duration {
        self.spin
    }

    fn small_spin(&self) -> Duration {
        // Zero where the arena does not spin at all (a crowded host), whatever is asked.
        match crate::peer::small_spin_env() {
            Some(s) if !self.spin.is_zero() => s,
            _ => self.small_spin,
        }
    }

    fn write(&self, slot: usize, offset: usize, data: &[u8]) -> Result<()> {
        let done = match &self.own {
            Some(m) => m.write(slot, offset, data),
            None => Err(Refused::OutOfRange),
        };
        done.map_err(|why| self.refused(why, "write to", self.me, (slot, offset, data.len())))
    }

    fn read(&self, owner: usize, slot: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let done = match self.mapping(owner) {
            Some(m) => m.read(slot, offset, dst),
            None => Err(Refused::OutOfRange),
        };
        done.map_err(|why| self.refused(why, "read from", owner, (slot, offset, dst.len())))
    }

    fn direct_min(&self) -> Option<usize> {
        *self
            .direct_probed
            .get_or_init(|| self.direct.filter(|_| self.probe_peers()))
    }

    fn threads(&self) -> usize {
        self.threads
    }

    /// Reads the process the kernel named for `owner` ([`TcpArena::direct_pid`]), never one
    /// the peer's header names alone; refused (kind `PermissionDenied`) for a peer whose header
    /// names another process, or a rank or thread of this process; kind `NotFound` for a peer
    /// whose process has exited.
    fn read_direct(&self, owner: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let pid = self.direct_pid(owner).map_err(|e| {
            let kind = if self.mapping(owner).is_some() && owner != self.me {
                std::io::ErrorKind::PermissionDenied
            } else {
                std::io::ErrorKind::InvalidInput
            };
            std::io::Error::new(kind, e)
        })?;
        self.read_live(owner, pid, addr, dst)
    }

    fn set_meta(&self, slot: usize, meta: Meta) {
        if let Some(m) = &self.own {
            store_meta(m, OFF_META + 16 * (slot % 2), meta);
        }
    }

    fn meta(&self, owner: usize, slot: usize) -> Meta {
        self.mapping(owner)
            .map_or([0; 16], |m| load_meta(m, OFF_META + 16 * (slot % 2)))
    }

    /// Written under a sequence lock: a peer reads it at any time (a descriptor half old and
    /// half new would look like a mismatched call).
    fn set_call(&self, meta: Meta) {
        if let Some(m) = &self.own {
            let s = m.load_u32(OFF_CALL_SEQ);
            m.store_u32(OFF_CALL_SEQ, s.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            store_meta(m, OFF_CALL, meta);
            m.store_u32(OFF_CALL_SEQ, s.wrapping_add(2), Ordering::Release);
        }
    }

    /// Zeros (no descriptor) while the owner is writing it.
    fn call(&self, owner: usize) -> Meta {
        self.mapping(owner).map_or([0; 16], |m| {
            let before = m.load_u32(OFF_CALL_SEQ);
            let meta = load_meta(m, OFF_CALL);
            // (Each load is followed by an acquire fence: the descriptor's words are read
            // before the second look at the sequence.)
            let after = m.load_u32(OFF_CALL_SEQ);
            if before == after && before.is_multiple_of(2) {
                meta
            } else {
                [0; 16]
            }
        })
    }

    fn publish(&self, word: ArenaWord, value: u32) {
        let Some(own) = &self.own else { return };
        let off = OFF_WORDS[word as usize];
        own.store_u32(off, value, Ordering::Release);
        // Store-fence-load against a sleeper's `sleep`.
        fence(Ordering::SeqCst);
        let asleep = self
            .local
            .iter()
            .filter_map(|&r| self.maps.get(r)?.as_ref())
            .any(|m| m.load_u32(OFF_ASLEEP) != 0);
        if asleep {
            own.wake(off);
        }
    }

    fn load(&self, owner: usize, word: ArenaWord) -> u32 {
        self.mapping(owner)
            .map_or(0, |m| m.load_u32(OFF_WORDS[word as usize]))
    }

    fn sleep(&self, owner: usize, word: ArenaWord, seen: u32, limit: Duration) {
        let (Some(own), Some(m)) = (&self.own, self.mapping(owner)) else {
            std::thread::sleep(limit.min(Duration::from_millis(1)));
            return;
        };
        // A count, not a flag: each sleeping thread of this rank is one (one that wakes
        // first must not clear another's).
        own.add_u32(OFF_ASLEEP, 1);
        fence(Ordering::SeqCst);
        let off = OFF_WORDS[word as usize];
        // Should the futex itself fail (not a timeout, an interruption or a changed value: say
        // a seccomp filter refuses it), a 1 ms sleep instead, so that the caller's loop until
        // its deadline does not turn into a busy one.
        if m.load_u32(off) == seen
            && let Err(e) = m.wait(off, seen, limit)
        {
            tracing::debug!(error = %e, "host arena: futex wait failed; sleeping 1 ms instead");
            std::thread::sleep(limit.min(Duration::from_millis(1)));
        }
        own.add_u32(OFF_ASLEEP, u32::MAX);
    }

    fn small_len(&self) -> usize {
        SMALL_DATA
    }

    fn put_small(&self, area: usize, seq: u32, meta: Meta, data: &[u8]) -> Result<()> {
        let done = match &self.own {
            Some(m) => m.small_put(area, seq, meta, data),
            None => Err(Refused::OutOfRange),
        };
        done.map_err(|_| self.small_refused("write to", self.me, area, (0, data.len())))
    }

    fn small_seq(&self, owner: usize, area: usize) -> u32 {
        self.mapping(owner).map_or(0, |m| m.small_seq(area))
    }

    fn small_meta(&self, owner: usize, area: usize) -> Meta {
        self.mapping(owner).map_or([0; 16], |m| m.small_meta(area))
    }

    fn read_small(&self, owner: usize, area: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let done = match self.mapping(owner) {
            Some(m) => m.small_read(area, offset, dst),
            None => Err(Refused::OutOfRange),
        };
        done.map_err(|_| self.small_refused("read from", owner, area, (offset, dst.len())))
    }

    fn check_peer(&self, owner: usize, op: &dyn Fn() -> String) -> Result<()> {
        match self.peers.get(owner) {
            Some(p) if !p.is_open() => {
                Err(p.unresponsive(op()).unwrap_or_else(|| DistError::PeerGone {
                    rank: self.me,
                    peer: owner,
                    op: op(),
                    cause: "its connection closed".into(),
                }))
            }
            _ => Ok(()),
        }
    }
}

fn store_meta(m: &Mapping, off: usize, meta: Meta) {
    let (a, b) = meta.split_at(8);
    let word = |x: &[u8]| u64::from_le_bytes(x.try_into().expect("eight bytes"));
    m.store_u64(off, word(a), Ordering::Relaxed);
    m.store_u64(off + 8, word(b), Ordering::Relaxed);
}

fn load_meta(m: &Mapping, off: usize) -> Meta {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&m.load_u64(off).to_le_bytes());
    out[8..].copy_from_slice(&m.load_u64(off + 8).to_le_bytes());
    out
}

#[cfg(test)]
#[path = "arena_tests.rs"]
mod tests;

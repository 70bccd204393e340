//! A [`HostArena`] in memory for [`MemLink`](super::MemLink)s made by
//! [`MemLink::mesh_on_hosts`](super::MemLink::mesh_on_hosts): every rank's slots and small areas
//! (a quarter of a slot, at most 4 KiB) behind locks,
//! its words atomics, a condition variable to sleep on; direct reads of peers' buffers (the
//! ranks are threads: `process_vm_readv` of this process); with faults to inject (a word set to
//! any value, an arena that is incomplete on one rank, direct reads refused (all, or after the
//! first few), wild, slow, or a hostile buffer address), set through the `MemLink` methods here. A rank killed with
//! [`MemLink::kill`](super::MemLink::kill) is gone for [`HostArena::check_peer`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use crate::arena::{ArenaWord, HostArena};
use crate::backend::Meta;
use crate::error::{DistError, Result};

/// One rank's part of the arenas.
struct Part {
    slots: RwLock<Vec<u8>>,
    words: [AtomicU32; 2],
    meta: Mutex<[Meta; 2]>,
    call: Mutex<Meta>,
    complete: AtomicBool,
    claimed: AtomicBool,
    /// What [`HostArena::direct_min`] says (`u64::MAX`: `None`).
    direct_min: AtomicU64,
    /// The [`DirectFault`] of this rank's direct reads.
    direct_fault: Mutex<DirectFault>,
    /// The direct reads this rank made.
    direct_reads: AtomicUsize,
    /// The bytes those reads asked for.
    direct_read_bytes: AtomicUsize,
    /// What [`HostArena::threads`] says.
    threads: AtomicUsize,
    /// This rank's slot accesses, while traced.
    trace: Mutex<Option<Vec<ArenaAccess>>>,
    /// The value of this rank's `Reduced` word at which it dies instead of publishing (0:
    /// never).
    dies_at_reduced: AtomicU32,
    /// The threads this rank's direct reads ran on.
    read_threads: Mutex<Vec<std::thread::ThreadId>>,
    /// The words of the two small areas.
    small_seq: [AtomicU32; 2],
    /// The descriptor and data bytes of the two small areas.
    small: [Mutex<(Meta, Vec<u8>)>; 2],
    /// How long [`HostArena::put_small`] waits after its word (a rank descheduled before it
    /// publishes its input word).
    small_lag: Mutex<Duration>,
}

/// A fault of a rank's direct reads of its peers' memory ([`HostArena::read_direct`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectFault {
    /// The reads work.
    None,
    /// The system refuses them (as `process_vm_readv` does under a strict ptrace policy).
    Refused,
    /// They go to an address that is not mapped (as if a peer published a wild one).
    WildAddress,
    /// Each read after the first `after` of this rank waits `by` first (a rank descheduled
    /// in the middle of a call).
    Slow {
        /// The reads made at full speed.
        after: usize,
        /// The wait before each later one.
        by: Duration,
    },
    /// The first `n` reads of this rank work, the later ones are refused (one part of a
    /// split call failing while others succeed).
    RefusedAfter(usize),
    /// This rank plays a hostile peer: the buffer address it writes into its slot for a direct
    /// all_reduce is near the top of the address space (its reads are not affected).
    HostileHeader,
}

/// One access of a rank to an arena slot, as traced ([`MemLink::trace_arena`](super::MemLink::trace_arena)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaAccess {
    /// The thread that made it.
    pub thread: std::thread::ThreadId,
    /// Whose slot: this rank's own for a write.
    pub owner: usize,
    /// A write (into this rank's slot), else a read.
    pub write: bool,
    /// The byte offset in the slot.
    pub offset: usize,
    /// The bytes.
    pub len: usize,
}

/// The arenas of every rank of one in-memory link.
pub(super) struct Arenas {
    hosts: Vec<usize>,
    /// Each rank's host's ranks, in rank order.
    locals: Vec<Vec<usize>>,
    slot_len: usize,
    parts: Vec<Part>,
    /// Held to publish and to decide to sleep; sleepers wait on `cond`.
    lock: Mutex<()>,
    cond: Condvar,
}

impl Arenas {
    pub(super) fn new(hosts: &[usize], slot_len: usize) -> Arenas {
        Arenas {
            hosts: hosts.to_vec(),
            locals: (0..hosts.len())
                .map(|r| crate::arena::host_ranks(hosts, r))
                .collect(),
            slot_len,
            parts: (0..hosts.len())
                .map(|_| Part {
                    slots: RwLock::new(vec![0; 2 * slot_len]),
                    words: [AtomicU32::new(0), AtomicU32::new(0)],
                    meta: Mutex::new([[0; 16]; 2]),
                    call: Mutex::new([0; 16]),
                    complete: AtomicBool::new(true),
                    claimed: AtomicBool::new(false),
                    direct_min: AtomicU64::new(u64::MAX),
                    direct_fault: Mutex::new(DirectFault::None),
                    direct_reads: AtomicUsize::new(0),
                    direct_read_bytes: AtomicUsize::new(0),
                    threads: AtomicUsize::new(1),
                    trace: Mutex::new(None),
                    dies_at_reduced: AtomicU32::new(0),
                    read_threads: Mutex::new(Vec::new()),
                    small_seq: [AtomicU32::new(0), AtomicU32::new(0)],
                    small: [(); 2].map(|_| Mutex::new(([0; 16], vec![0; small_len(slot_len)]))),
                    small_lag: Mutex::new(Duration::ZERO),
                })
                .collect(),
            lock: Mutex::new(()),
            cond: Condvar::new(),
        }
    }
}

/// The data bytes of each small area ([`HostArena::small_len`]) of arenas with slots of
/// `slot_len` bytes: a quarter of a slot, at most 4 KiB (so that the tests' small slots still
/// make buffers of several pieces).
pub(super) fn small_len(slot_len: usize) -> usize {
    (slot_len / 4).min(4 << 10)
}

/// Notes the calling thread in `seen` (once).
fn seen_on(seen: &Mutex<Vec<std::thread::ThreadId>>) {
    if let Ok(mut seen) = seen.lock() {
        let id = std::thread::current().id();
        if !seen.contains(&id) {
            seen.push(id);
        }
    }
}

/// One rank's view of the in-memory arenas.
#[derive(Clone)]
pub(super) struct MemArena {
    pub(super) me: usize,
    pub(super) arenas: Arc<Arenas>,
    pub(super) mesh: Arc<super::Mesh>,
}

impl MemArena {
    fn local(&self, owner: usize) -> Option<&Part> {
        let h = &self.arenas.hosts;
        (owner < h.len() && h[owner] == h[self.me]).then(|| &self.arenas.parts[owner])
    }

    fn bounds(&self, owner: usize, slot: usize, offset: usize, len: usize) -> Result<&Part> {
        let part = self.local(owner);
        let end = offset.checked_add(len);
        match (part, end) {
            (Some(p), Some(end)) if slot < 2 && end <= self.arenas.slot_len => Ok(p),
            _ => Err(DistError::InvalidArgument {
                rank: self.me,
                op: "host arena access".into(),
                reason: format!(
                    "{len} bytes at {offset} of slot {slot} of rank {owner}: outside its \
                     slots of {} bytes on this host",
                    self.arenas.slot_len
                ),
            }),
        }
    }

    pub(super) fn scribble(&self, word: ArenaWord, value: u32) {
        self.publish(word, value);
    }

    pub(super) fn set_incomplete(&self) {
        self.arenas.parts[self.me]
            .complete
            .store(false, Ordering::Release);
    }

    pub(super) fn set_direct(&self, min: Option<usize>) {
        let b = min.map_or(u64::MAX, |b| b as u64);
        self.arenas.parts[self.me]
            .direct_min
            .store(b, Ordering::Release);
    }

    pub(super) fn set_direct_fault(&self, fault: DirectFault) {
        *self.fault() = fault;
    }

    fn fault(&self) -> std::sync::MutexGuard<'_, DirectFault> {
        self.arenas.parts[self.me]
            .direct_fault
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn set_threads(&self, threads: usize) {
        self.arenas.parts[self.me]
            .threads
            .store(threads, Ordering::Relaxed);
    }

    pub(super) fn read_threads(&self) -> usize {
        let part = &self.arenas.parts[self.me];
        part.read_threads.lock().map_or(0, |t| t.len())
    }

    fn note(&self, owner: usize, write: bool, offset: usize, len: usize) {
        let mut trace = self.arenas.parts[self.me]
            .trace
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(t) = trace.as_mut() {
            t.push(ArenaAccess {
                thread: std::thread::current().id(),
                owner,
                write,
                offset,
                len,
            });
        }
    }

    pub(super) fn trace(&self, on: bool) -> Vec<ArenaAccess> {
        let mut trace = self.arenas.parts[self.me]
            .trace
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *trace, on.then(Vec::new)).unwrap_or_default()
    }

    pub(super) fn set_dies_at_reduced(&self, value: u32) {
        self.arenas.parts[self.me]
            .dies_at_reduced
            .store(value, Ordering::Relaxed);
    }

    pub(super) fn direct_reads(&self) -> usize {
        self.arenas.parts[self.me]
            .direct_reads
            .load(Ordering::Relaxed)
    }

    pub(super) fn direct_read_bytes(&self) -> usize {
        self.arenas.parts[self.me]
            .direct_read_bytes
            .load(Ordering::Relaxed)
    }

    /// Stores `value` as this rank's small area `area`'s word, its bytes untouched.
    pub(super) fn scribble_small(&self, area: usize, value: u32) {
        self.arenas.parts[self.me].small_seq[area % 2].store(value, Ordering::Release);
    }

    pub(super) fn set_small_lag(&self, lag: Duration) {
        *self.arenas.parts[self.me]
            .small_lag
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = lag;
    }

    fn small_area(&self, owner: usize, area: usize) -> Option<&Mutex<(Meta, Vec<u8>)>> {
        self.local(owner)
            .filter(|_| area < 2)
            .map(|p| &p.small[area])
    }

    fn small_refused(
        &self,
        what: &str,
        owner: usize,
        area: usize,
        at: usize,
        len: usize,
    ) -> DistError {
        DistError::InvalidArgument {
            rank: self.me,
            op: format!("{what} the host arena's small area"),
            reason: format!(
                "{len} bytes at {at} of small area {area} of rank {owner}: outside its {} bytes \
                 on this host",
                small_len(self.arenas.slot_len)
            ),
        }
    }

    /// Wakes every sleeper (after a death, so that it looks at once).
    pub(super) fn wake(&self) {
        let _held = self.arenas.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.arenas.cond.notify_all();
    }
}

impl HostArena for MemArena {
    fn hosts(&self) -> &[usize] {
        &self.arenas.hosts
    }

    fn local(&self) -> &[usize] {
        &self.arenas.locals[self.me]
    }

    fn complete(&self) -> bool {
        self.arenas.parts[self.me].complete.load(Ordering::Acquire)
    }

    fn claim(&self) -> bool {
        !self.arenas.parts[self.me]
            .claimed
            .swap(true, Ordering::AcqRel)
    }

    fn slot_len(&self) -> usize {
        self.arenas.slot_len
    }

    fn spin(&self) -> Duration {
        Duration::ZERO
    }

    fn write(&self, slot: usize, offset: usize, data: &[u8]) -> Result<()> {
        let p = self.bounds(self.me, slot, offset, data.len())?;
        self.note(self.me, true, offset, data.len());
        let at = slot * self.arenas.slot_len + offset;
        let mut s = p.slots.write().unwrap_or_else(|p| p.into_inner());
        s[at..at + data.len()].copy_from_slice(data);
        // A direct all_reduce's header (address, length): a 16-byte write at 0 (so is a
        // 16-byte arena piece, which the tests of this fault do not write).
        if *self.fault() == DirectFault::HostileHeader && offset == 0 && data.len() == 16 {
            s[at..at + 8].copy_from_slice(&(u64::MAX - 100).to_le_bytes());
        }
        Ok(())
    }

    fn read(&self, owner: usize, slot: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let p = self.bounds(owner, slot, offset, dst.len())?;
        self.note(owner, false, offset, dst.len());
        let at = slot * self.arenas.slot_len + offset;
        let s = p.slots.read().unwrap_or_else(|p| p.into_inner());
        dst.copy_from_slice(&s[at..at + dst.len()]);
        Ok(())
    }

    fn direct_min(&self) -> Option<usize> {
        match self.arenas.parts[self.me]
            .direct_min
            .load(Ordering::Acquire)
        {
            u64::MAX => None,
            b => usize::try_from(b).ok(),
        }
    }

    /// The ranks are threads of this process: a read of this process's own memory, through
    /// the same system call as between processes (where it exists); refused unless the test
    /// turned direct reads on ([`crate::testing::MemLink::set_arena_direct`]).
    fn read_direct(&self, owner: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        if self.direct_min().is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "direct reads are off on this test arena",
            ));
        }
        if self.local(owner).is_none() || owner == self.me {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("rank {owner} is not a peer on this host"),
            ));
        }
        let part = &self.arenas.parts[self.me];
        let before = part.direct_reads.fetch_add(1, Ordering::Relaxed);
        part.direct_read_bytes
            .fetch_add(dst.len(), Ordering::Relaxed);
        seen_on(&part.read_threads);
        let fault = *self.fault();
        match fault {
            DirectFault::Refused => Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
            DirectFault::RefusedAfter(n) if before >= n => {
                Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
            }
            // SAFETY: address 16 lies in the null page, never mapped: an error, no read.
            // (Test: `collectives::tests::direct`, the wild-address case.)
            DirectFault::WildAddress => unsafe {
                crate::arena::read_process(std::process::id(), 16, dst)
            },
            DirectFault::Slow { after, by } if before >= after => {
                std::thread::sleep(by);
                // SAFETY: as below.
                unsafe { crate::arena::read_process(std::process::id(), addr, dst) }
            }
            // SAFETY: `read_process` on this process asks that the range be memory the
            // caller may read and that no thread write it meanwhile. That is the contract of
            // `MemLink::set_arena_direct`, whose caller turned direct reads on: every buffer
            // a rank passes to a direct all_reduce stays allocated and unwritten until every
            // rank's call of that all_reduce has returned. The direct all_reduce
            // (`collectives/direct.rs`), the only caller in the tests that turn direct reads
            // on, reads only within the buffer peer thread `owner` announced for the call, and
            // a peer may still be reading it after its owner's call failed and returned: so
            // the tests that make a rank fail pass buffers that are never freed (`kept`) and
            // change one only after a barrier that every rank reaches once its call has
            // returned. This is a test double: safe code cannot turn direct reads on; the
            // `unsafe` of `set_arena_direct` is where its caller takes the contract on.
            // (Tests: `collectives::tests::direct`.)
            _ => unsafe { crate::arena::read_process(std::process::id(), addr, dst) },
        }
    }

    fn threads(&self) -> usize {
        self.arenas.parts[self.me].threads.load(Ordering::Relaxed)
    }

    fn set_meta(&self, slot: usize, meta: Meta) {
        let mut m = self.arenas.parts[self.me]
            .meta
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m[slot % 2] = meta;
    }

    fn meta(&self, owner: usize, slot: usize) -> Meta {
        self.local(owner).map_or([0; 16], |p| {
            p.meta.lock().unwrap_or_else(|p| p.into_inner())[slot % 2]
        })
    }

    fn set_call(&self, meta: Meta) {
        *self.arenas.parts[self.me]
            .call
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = meta;
    }

    fn call(&self, owner: usize) -> Meta {
        self.local(owner).map_or([0; 16], |p| {
            *p.call.lock().unwrap_or_else(|p| p.into_inner())
        })
    }

    fn publish(&self, word: ArenaWord, value: u32) {
        let dies = self.arenas.parts[self.me]
            .dies_at_reduced
            .load(Ordering::Relaxed);
        if word == ArenaWord::Reduced && value == dies && dies != 0 {
            self.mesh.ranks[self.me].dead.store(true, Ordering::Release);
            self.mesh.wake_all();
            self.wake();
            return;
        }
        let _held = self.arenas.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.arenas.parts[self.me].words[word as usize].store(value, Ordering::Release);
        self.arenas.cond.notify_all();
    }

    fn load(&self, owner: usize, word: ArenaWord) -> u32 {
        self.local(owner)
            .map_or(0, |p| p.words[word as usize].load(Ordering::Acquire))
    }

    fn sleep(&self, owner: usize, word: ArenaWord, seen: u32, limit: Duration) {
        let held = self.arenas.lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.load(owner, word) != seen || self.mesh.ranks[owner].dead.load(Ordering::Acquire) {
            return;
        }
        let _ = self.arenas.cond.wait_timeout(held, limit);
    }

    fn small_len(&self) -> usize {
        small_len(self.arenas.slot_len)
    }

    fn put_small(&self, area: usize, seq: u32, meta: Meta, data: &[u8]) -> Result<()> {
        let Some(m) = self
            .small_area(self.me, area)
            .filter(|_| data.len() <= self.small_len())
        else {
            return Err(self.small_refused("write to", self.me, area, 0, data.len()));
        };
        let mut held = m.lock().unwrap_or_else(|p| p.into_inner());
        held.0 = meta;
        held.1[..data.len()].copy_from_slice(data);
        drop(held);
        let part = &self.arenas.parts[self.me];
        part.small_seq[area].store(seq, Ordering::Release);
        let lag = *part.small_lag.lock().unwrap_or_else(|p| p.into_inner());
        if !lag.is_zero() {
            std::thread::sleep(lag);
        }
        Ok(())
    }

    fn small_seq(&self, owner: usize, area: usize) -> u32 {
        self.local(owner)
            .map_or(0, |p| p.small_seq[area % 2].load(Ordering::Acquire))
    }

    fn small_meta(&self, owner: usize, area: usize) -> Meta {
        self.small_area(owner, area)
            .map_or([0; 16], |m| m.lock().unwrap_or_else(|p| p.into_inner()).0)
    }

    fn read_small(&self, owner: usize, area: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len());
        match (self.small_area(owner, area), end) {
            (Some(m), Some(end)) if end <= self.small_len() => {
                let held = m.lock().unwrap_or_else(|p| p.into_inner());
                dst.copy_from_slice(&held.1[offset..end]);
                Ok(())
            }
            _ => Err(self.small_refused("read from", owner, area, offset, dst.len())),
        }
    }

    fn check_peer(&self, owner: usize, op: &dyn Fn() -> String) -> Result<()> {
        if self.mesh.ranks[owner].dead.load(Ordering::Acquire) {
            return Err(DistError::PeerGone {
                rank: self.me,
                peer: owner,
                op: op(),
                cause: "the rank died (in-memory link)".into(),
            });
        }
        Ok(())
    }
}

/// The arena's faults and counters, on the link's ends.
impl super::MemLink {
    /// Plays a hostile peer: this rank publishes `value` as its arena word `word` (no-op
    /// without an arena).
    pub fn scribble_arena(&self, word: crate::arena::ArenaWord, value: u32) {
        if let Some(a) = &self.arena {
            a.scribble(word, value);
        }
    }

    /// Plays a hostile peer: this rank stores `value` as the word of its arena's small area
    /// `area` (0 or 1), its bytes untouched (no-op without an arena).
    pub fn scribble_arena_small(&self, area: usize, value: u32) {
        if let Some(a) = &self.arena {
            a.scribble_small(area, value);
        }
    }

    /// This rank waits `lag` after writing each small area's word, before it publishes its
    /// input word (a rank descheduled between the two; no-op without an arena).
    pub fn set_arena_small_lag(&self, lag: Duration) {
        if let Some(a) = &self.arena {
            a.set_small_lag(lag);
        }
    }

    /// This rank's arena proposes that all_reduces from `min` bytes read its peers' buffers
    /// directly, or (`None`, the default) says it cannot
    /// ([`HostArena::direct_min`]). Set before the group's first
    /// all_reduce, which agrees on it.
    ///
    /// # Safety
    ///
    /// With it on, [`HostArena::read_direct`] on this arena reads *this process's* memory (the
    /// ranks of a `MemLink` job are threads of one process) at whatever address it is given,
    /// through `process_vm_readv`. The caller promises that every read made through this
    /// arena is of memory that stays allocated and that no thread writes during the read.
    /// For the group's direct all_reduce, which reads its ranks' buffers, that means: every
    /// buffer each rank passes to it stays allocated and unwritten until *every* rank's call
    /// of that all_reduce has returned, not only its own. A rank whose call failed (a
    /// deadline, an abort) returns while a peer may still be reading its buffer, so its
    /// caller must not reuse, change or free the buffer before the others are done (a barrier
    /// after the call, say). A test that calls `read_direct` itself must keep the same rule
    /// for the memory it reads. Safe code cannot turn it on:
    ///
    /// ```compile_fail,E0133
    /// # use dist_core::testing::MemLink;
    /// let link = MemLink::mesh(2).remove(0);
    /// link.set_arena_direct(Some(0)); // error: call to unsafe function
    /// ```
    pub unsafe fn set_arena_direct(&self, min: Option<usize>) {
        if let Some(a) = &self.arena {
            a.set_direct(min);
        }
    }

    /// How many direct reads of its peers' memory this rank made (0 without an arena).
    pub fn direct_reads(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.direct_reads())
    }

    /// The bytes this rank's direct reads of its peers' memory asked for (0 without an arena).
    pub fn direct_read_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.direct_read_bytes())
    }

    /// The threads this rank may split its part of an all_reduce on the arena over
    /// ([`HostArena::threads`]; 1 by default).
    pub fn set_arena_threads(&self, threads: usize) {
        if let Some(a) = &self.arena {
            a.set_threads(threads);
        }
    }

    /// Starts (`true`) or stops tracing this rank's arena slot accesses, and returns those
    /// traced so far (none without an arena).
    pub fn trace_arena(&self, on: bool) -> Vec<ArenaAccess> {
        self.arena.as_ref().map_or_else(Vec::new, |a| a.trace(on))
    }

    /// This rank dies (as [`MemLink::kill`](super::MemLink::kill)) when it would publish `value` as its arena
    /// `Reduced` word, instead of publishing it: its peers have its input of that piece but
    /// never its reduced share (0: never; no-op without an arena).
    pub fn set_arena_dies_at_reduced(&self, value: u32) {
        if let Some(a) = &self.arena {
            a.set_dies_at_reduced(value);
        }
    }

    /// On how many threads this rank's direct reads ran (0 without an arena or a read).
    pub fn direct_read_threads(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.read_threads())
    }

    /// Makes this rank's direct reads of its peers' memory fail as `fault` says.
    pub fn set_arena_direct_fault(&self, fault: DirectFault) {
        if let Some(a) = &self.arena {
            a.set_direct_fault(fault);
        }
    }

    /// This rank's arena says it did not map every peer's ([`HostArena::complete`]).
    pub fn set_arena_incomplete(&self) {
        if let Some(a) = &self.arena {
            a.set_incomplete();
        }
    }
}

//! A host arena: memory that the ranks of one host share, which a [`Link`](crate::transport::Link) may
//! offer ([`Link::arena`](crate::transport::Link::arena)) so that the collectives of its group read their
//! peers' buffers in place instead of passing messages (see `collectives/host.rs`).
//!
//! Each rank of the host owns two slots of [`HostArena::slot_len`] bytes, which it alone
//! writes and its host's other ranks read, and a header of sequence words
//! ([`ArenaWord`]) that it alone publishes and the others wait on. Everything a peer
//! published is untrusted input: the words are checked by the collectives against what the
//! protocol allows, and the slot accesses are checked by the arena against its bounds.

use std::time::Duration;

use crate::backend::Meta;
use crate::error::Result;

/// A sequence word in a rank's arena header. Each counts the pieces of collectives the rank has
/// gone through on the arena (wrapping at 2³²).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaWord {
    /// The rank's input for piece k is in its slot `k % 2`: it publishes k + 1.
    Input = 0,
    /// The rank's reduced share of piece k is in its slot `k % 2` (or, for a collective that
    /// reduces the whole piece on every rank, the rank has read every input of piece k): it
    /// publishes k + 1.
    Reduced = 1,
}

impl ArenaWord {
    /// The word's name, for errors.
    pub fn name(self) -> &'static str {
        match self {
            ArenaWord::Input => "input",
            ArenaWord::Reduced => "reduced",
        }
    }
}

/// Memory shared by the ranks of one host, as a link offers it. Ranks are the link's.
///
/// Every method is safe: a slot access out of bounds, or to a rank not on this host, is an
/// error (never an access outside the arena); a value a peer published may be anything, and
/// the caller checks it.
pub trait HostArena: Send + Sync {
    /// The host of every rank of the link, as an index (ranks with the same index share a
    /// host); the same on every rank. A rank that shares no memory has a host of its own.
    fn hosts(&self) -> &[usize];

    /// The ranks of this rank's host, in rank order ([`host_ranks`] of [`HostArena::hosts`]
    /// for this rank), kept so that a call does not work them out again.
    fn local(&self) -> &[usize];

    /// Whether this rank has mapped the arena of every other rank of its host (and they its
    /// own). It may differ between ranks: the group agrees on it before using the arena.
    fn complete(&self) -> bool;

    /// Claims this rank's arena for the group that asks (on its first all_reduce): true the
    /// first time, false ever after. The arena's words count one group's pieces, so a later
    /// group over the same link (formed after the first was dropped: two cannot live at once,
    /// [`Link::claim_group`](crate::transport::Link::claim_group)) must not use it: it runs its
    /// all_reduces over messages.
    fn claim(&self) -> bool;

    /// The bytes of one slot.
    fn slot_len(&self) -> usize;

    /// The arena's spin time: a wait looks at a peer's word for this long and the collectives'
    /// yield time more (`collectives/arena_wait.rs`), giving its core away between looks, before
    /// it sleeps (dist-tcp: its receive spin, 50 µs unless the host is crowded with more than 16
    /// ranks a core, then zero).
    fn spin(&self) -> Duration;

    /// The longest a collective on the small areas spins on its peers' words, in all, before
    /// its waits give the core away (`collectives/small.rs`): by default
    /// [`SMALL_SPIN`](crate::collectives::SMALL_SPIN) or the arena's spin, if less (dist-tcp:
    /// `DIST_SMALL_SPIN_US` where set).
    fn small_spin(&self) -> Duration {
        self.spin().min(crate::collectives::SMALL_SPIN)
    }

    /// Copies `data` into this rank's slot `slot` (0 or 1) at byte `offset`. Any thread may
    /// call it and [`HostArena::read`] at once: an implementation never lets two of this
    /// process's copies of overlapping bytes race, one of them a write (it takes them in turn,
    /// or refuses the later with an error). A peer of another process may read the slot
    /// meanwhile (a write outside the protocol): it then reads wrong bytes, never undefined
    /// behaviour in either process (dist-tcp copies the shared slots with volatile accesses).
    fn write(&self, slot: usize, offset: usize, data: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes of rank `owner`'s slot `slot` at byte `offset` into `dst`
    /// (`owner` may be this rank).
    fn read(&self, owner: usize, slot: usize, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Publishes `meta` (the descriptor of the collective whose first piece uses slot `slot`)
    /// beside that slot, before the input word that announces it.
    fn set_meta(&self, slot: usize, meta: Meta);

    /// The descriptor rank `owner` published beside its slot `slot` (zeros for a rank not on
    /// this host).
    fn meta(&self, owner: usize, slot: usize) -> Meta;

    /// Publishes `meta`, the descriptor of the collective this rank is in now (whatever its
    /// algorithm), so that a peer waiting on the arena can tell a mismatched call from a late
    /// one.
    fn set_call(&self, meta: Meta);

    /// The descriptor rank `owner` last published with [`HostArena::set_call`] (zeros for
    /// none, for a rank not on this host, or while the owner is writing it: never half of one
    /// and half of another).
    fn call(&self, owner: usize) -> Meta;

    /// Stores `value` in this rank's word `word` (a release store: the slot bytes written
    /// before are visible to a peer that loads it), and wakes the peers that sleep on it.
    fn publish(&self, word: ArenaWord, value: u32);

    /// Loads rank `owner`'s word `word` (an acquire load; `owner` may be this rank; 0 for a
    /// rank not on this host).
    fn load(&self, owner: usize, word: ArenaWord) -> u32;

    /// Sleeps while rank `owner`'s word `word` holds `seen`, at most `limit`; a wake-up, a
    /// timeout or a spurious return all return: the caller looks again.
    fn sleep(&self, owner: usize, word: ArenaWord, seen: u32, limit: Duration);

    /// The data bytes of each of this rank's two small areas (0: it has none):
    /// the lines a small all_reduce (`collectives/small.rs`) writes its whole input into, with
    /// the call's descriptor and a sequence word beside it, so that a peer learns that the input
    /// is there, checks the call and reads the first bytes of the input in one cache line.
    /// Like a slot, area `k % 2` is written for piece k; this rank alone writes its areas and
    /// its host's other ranks read them.
    fn small_len(&self) -> usize;

    /// Writes `data` (at most [`HostArena::small_len`] bytes) and `meta` into this rank's
    /// small area `area` (0 or 1), then stores `seq` as the area's word (a release store: a
    /// peer that loads `seq` sees the data and descriptor written before it). Any thread may
    /// call it: the accesses are atomic or volatile, never a data race, whoever reads the
    /// area meanwhile (a read beside it sees old and new bytes mixed, which the word tells
    /// apart). An error where the arena has no small areas or `data` does not fit.
    fn put_small(&self, area: usize, seq: u32, meta: Meta, data: &[u8]) -> Result<()>;

    /// Loads rank `owner`'s small area `area`'s word (an acquire load; 0 for a rank not on
    /// this host, or an arena without small areas).
    fn small_seq(&self, owner: usize, area: usize) -> u32;

    /// The descriptor rank `owner` wrote into its small area `area` (zeros for a rank not on
    /// this host, or an arena without small areas).
    fn small_meta(&self, owner: usize, area: usize) -> Meta;

    /// Copies `dst.len()` bytes of rank `owner`'s small area `area` from byte `offset` of its
    /// data into `dst`; an error if out of [`HostArena::small_len`] or the rank is not on this
    /// host.
    fn read_small(&self, owner: usize, area: usize, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// From which size (bytes) this rank proposes that all_reduces on the arena read their
    /// peers' buffers directly ([`HostArena::read_direct`]), or `None` where it cannot read the
    /// memory of every other rank of its host (probed once: by reading a value each peer
    /// published in its arena and comparing it with what the peer said it holds). It may
    /// differ between ranks: the group agrees on it with the arena (no direct reads if a rank
    /// cannot; else from the largest size proposed).
    fn direct_min(&self) -> Option<usize> {
        None
    }

    /// How many threads, this rank's own among them, may share its part of an all_reduce on
    /// the arena (each copying a range of its input into its slot, reducing a range of its
    /// share, copying a range of the peers' shares out; or, reading directly, reading and
    /// reducing a range of its share, then copying a range of each peer's): the rank's own
    /// choice, not agreed with the group, since every element is still reduced by one rank in
    /// rank order whatever the count. 1 by default. With more than one, the collectives call
    /// [`HostArena::write`] and [`HostArena::read`] from that many threads at once (writes at
    /// disjoint ranges of this rank's slot).
    fn threads(&self) -> usize {
        1
    }

    /// Copies `dst.len()` bytes at address `addr` of rank `owner`'s memory into `dst`, where
    /// [`HostArena::direct_min`] is `Some`. `addr` comes from the peer and is untrusted: an
    /// address that is not mapped there is an error, and a peer whose process is gone one of
    /// kind [`NotFound`](std::io::ErrorKind::NotFound), never an access of this rank's memory
    /// outside `dst`. dist-tcp reads only the process at the other end of the socket the
    /// peer's arena came through, never this one.
    fn read_direct(&self, owner: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
        let _ = (owner, addr, dst);
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this arena cannot read its peers' memory",
        ))
    }

    /// An error if rank `owner` is known to be gone ([`DistError::PeerGone`](crate::DistError::PeerGone)
    /// or [`DistError::PeerUnresponsive`](crate::DistError::PeerUnresponsive), naming it), for
    /// the operation `op`.
    fn check_peer(&self, owner: usize, op: &dyn Fn() -> String) -> Result<()>;
}

/// The ranks of `hosts` on `me`'s host, in rank order.
pub fn host_ranks(hosts: &[usize], me: usize) -> Vec<usize> {
    let h = hosts.get(me).copied();
    (0..hosts.len()).filter(|&r| Some(hosts[r]) == h).collect()
}

/// The most bytes one `process_vm_readv` is asked for: the kernel cuts a call at about 2 GiB.
#[cfg(target_os = "linux")]
const READ_PROCESS_MAX: usize = 1 << 30;

/// Copies `dst.len()` bytes at address `addr` of process `pid` into `dst`, by
/// `process_vm_readv` (Linux; the kernel checks that this process may read that one's memory, as
/// for `ptrace`, and that the range is mapped there), in calls of at most 1 GiB. Fails on a
/// short read. `addr` may be anything: the kernel reads only the other process's memory (or
/// this one's, for `pid` its own) and writes only `dst`. A process that does not exist (it
/// exited) is an error of kind [`NotFound`](std::io::ErrorKind::NotFound).
///
/// # Safety
///
/// Where `pid` is this process (or one that shares its memory), every mapped byte of
/// `addr..addr + dst.len()` must be memory this caller may read as through a raw pointer, and
/// no thread may write it while the call runs (the kernel's copy is a read by this process:
/// beside such a write it is a data race, and it would let the caller see memory it has no
/// right to). Unmapped bytes are an error, not a read. For another process there is no
/// condition: the kernel reads only that process's memory and writes only `dst`; the caller
/// decides whose memory it trusts.
#[cfg(target_os = "linux")]
pub unsafe fn read_process(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "pid out of range"))?;
    let mut done = 0;
    for part in dst.chunks_mut(READ_PROCESS_MAX) {
        let at = addr.checked_add(done as u64).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "address overflows")
        })?;
        read_process_once(pid, at, part)?;
        done += part.len();
    }
    Ok(())
}

/// One `process_vm_readv` of `dst.len()` bytes (at most [`READ_PROCESS_MAX`]).
#[cfg(target_os = "linux")]
fn read_process_once(pid: libc::pid_t, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    // An address past this target's pointer width (a 64-bit one on a 32-bit target) is
    // refused, not truncated into another address than the one checked.
    let base = usize::try_from(addr)
        .ok()
        .filter(|b| b.checked_add(dst.len()).is_some())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "address {addr:#x} + {} bytes does not fit this target's addresses",
                    dst.len()
                ),
            )
        })?;
    let remote = libc::iovec {
        iov_base: base as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: the one local iovec covers exactly `dst`, a `&mut [u8]` borrowed for this call,
    // so the kernel writes only memory this function may write; the remote iovec is only read
    // (in process `pid`, which may be this one) and the kernel checks it (EFAULT for an
    // unmapped range). No pointer outlives the call. Shown by `read_process_reads_and_refuses`
    // (below) and the tests in `collectives/tests/direct.rs`.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    match usize::try_from(n) {
        Err(_) => {
            let e = std::io::Error::last_os_error();
            // No such process: it exited (the caller tells it from a refusal by the kind).
            Err(if e.raw_os_error() == Some(libc::ESRCH) {
                std::io::Error::new(std::io::ErrorKind::NotFound, e)
            } else {
                e
            })
        }
        Ok(n) if n == dst.len() => Ok(()),
        Ok(n) => Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("read {n} of {} bytes", dst.len()),
        )),
    }
}

/// Elsewhere there is no direct read: always an error.
///
/// # Safety
///
/// None needed here (it reads nothing); the contract is the Linux one's.
#[cfg(not(target_os = "linux"))]
pub unsafe fn read_process(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let _ = (pid, addr, dst);
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "direct reads of another process need Linux",
    ))
}

/// The bytes [`read_process_is_fast`] times each way: past a core's first caches, where the
/// machines measured differ most (an in-cache copy is so fast that the ratio falls near the
/// rule's line on a machine where direct reads pay).
const RATE_PROBE: usize = 2 << 20;

/// Whether [`read_process`] copies at least half as fast as a copy within this process
/// ([`direct_reads_pay`] of the two, each the best of five over 2 MiB of this process's own
/// memory, its pages touched first), measured once per process (a few milliseconds, most of
/// it the first touch of 4 MiB) and `false` where the read fails. The ratio varies by machine
/// (`docs/results/README.md`, "2026-12-02, early (75cc19f)", over 2 MiB): 0.2–0.3 on that run's
/// 2-core machine, where direct reads lost to the shared-memory rings, and about 0.7 on the 16-core
/// H200 host, where they won.
pub fn read_process_is_fast() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| {
        let src = vec![0x5au8; RATE_PROBE];
        let mut dst = vec![0u8; RATE_PROBE];
        dst.copy_from_slice(&src);
        let (mut cma, mut copy) = (Duration::MAX, Duration::MAX);
        for _ in 0..5 {
            let t = std::time::Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            copy = copy.min(t.elapsed());
            std::hint::black_box(&mut dst);
            let t = std::time::Instant::now();
            // SAFETY: this process's own `src`, borrowed shared for the call (no thread
            // writes it), read whole. (Test: `direct_reads_pay_at_half_the_copy_rate`.)
            let read = unsafe { read_process(std::process::id(), src.as_ptr() as u64, &mut dst) };
            if read.is_err() {
                return false;
            }
            cma = cma.min(t.elapsed());
            std::hint::black_box(&mut dst);
        }
        direct_reads_pay(cma, copy)
    })
}

/// Whether ranks of one host should read each other's buffers directly, given the time one
/// `process_vm_readv` and one copy within the process take for the same bytes: if the first
/// is at most twice the second. Per rank a direct all_reduce reads about its buffer's size
/// from peers (each peer's bytes of the rank's share, for the reduction) and copies about as
/// much out of their arena slots (the others' reduced shares), where the shared-memory rings
/// copy about twice the buffer in and as much out; where ranks outnumber cores, the cores'
/// copying is the whole cost. (With cores to spare a rank splits its reads over several,
/// which the rule leaves out: it keeps direct reads off where they are slow.) The threshold
/// was set when the reduced shares too were direct reads (`docs/results/README.md`, "2026-12-01,
/// evening (0436ad0)" and "2026-12-02, early (75cc19f)") and has not been measured again since.
pub fn direct_reads_pay(read: Duration, copy: Duration) -> bool {
    read <= copy.saturating_mul(2)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::read_process;

    #[test]
    fn read_process_reads_and_refuses() {
        let src: Vec<u8> = (0..200u8).collect();
        let mut dst = vec![0u8; 150];
        let me = std::process::id();
        // SAFETY: within `src`, which nothing writes; this process.
        unsafe { read_process(me, src.as_ptr() as u64 + 50, &mut dst) }.unwrap();
        assert_eq!(dst[..], src[50..]);
        // An unmapped address (the null page) and an absent process are errors, dst untouched.
        let mut dst = vec![7u8; 16];
        // SAFETY: the null page is never mapped: no read.
        assert!(unsafe { read_process(me, 8, &mut dst) }.is_err());
        // SAFETY: no such process (above the kernel's pid limit): no read.
        let gone = unsafe { read_process(u32::MAX >> 2, src.as_ptr() as u64, &mut dst) };
        let gone = gone.unwrap_err();
        assert_eq!(gone.kind(), std::io::ErrorKind::NotFound, "{gone}");
        // SAFETY: the top of the address space is never mapped for a process: no read.
        assert!(unsafe { read_process(me, u64::MAX - 40, &mut dst) }.is_err());
        // A range past the end of this target's addresses is refused before any read.
        // SAFETY: refused before the kernel is asked: no read.
        let past = unsafe { read_process(me, u64::MAX - 4, &mut dst) }.unwrap_err();
        assert_eq!(past.kind(), std::io::ErrorKind::InvalidInput, "{past}");
        assert_eq!(dst, vec![7u8; 16]);
    }

    /// On a 32-bit target, a 64-bit address is refused, not truncated to its low half.
    #[cfg(target_pointer_width = "32")]
    #[test]
    fn a_64_bit_address_is_refused_on_32_bit_targets() {
        let src = [5u8; 16];
        let mut dst = [0u8; 16];
        let addr = (1u64 << 32) | src.as_ptr() as u64;
        // SAFETY: refused before the kernel is asked: no read.
        let e = unsafe { read_process(std::process::id(), addr, &mut dst) }.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        assert_eq!(dst, [0u8; 16]);
    }

    /// The rate rule: direct reads pay where a read takes at most twice a copy; the probe
    /// gives one answer per process.
    #[test]
    fn direct_reads_pay_at_half_the_copy_rate() {
        use std::time::Duration;
        let us = Duration::from_micros;
        assert!(super::direct_reads_pay(us(20), us(10)));
        assert!(super::direct_reads_pay(us(14), us(10)));
        assert!(!super::direct_reads_pay(us(21), us(10)));
        assert!(!super::direct_reads_pay(Duration::MAX, us(10)));
        let first = super::read_process_is_fast();
        assert_eq!(super::read_process_is_fast(), first);
    }
}

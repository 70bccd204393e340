//! The single-producer single-consumer byte ring of one ordered pair of ranks, in the
//! producer's segment. Each side keeps its own position in private memory (the authoritative
//! copy) and publishes it in the header for the other side; every value read from the header
//! is read once into a local and checked against the ring's capacity (fixed, and kept locally,
//! when the ring was made or mapped) before it is used, so a peer that scribbles on the header
//! gets an error naming it, never an access outside the ring.
//!
//! Memory ordering (the argument in full is in `docs/architecture.md`, "Shared memory"):
//! the producer copies bytes in, then stores its position with `Release`; the consumer loads it
//! with `Acquire`, then copies the bytes out, then stores its own position with `Release`,
//! which the producer loads with `Acquire` before reusing the space. The waits use the
//! store-fence-load pattern on both sides (`SeqCst` fences), so a side about to sleep either
//! sees the other's progress or is seen to be waiting and is woken.

use std::io;
use std::sync::atomic::{Ordering, fence};
use std::time::Duration;

#[cfg(target_os = "linux")]
use rustix::thread::futex;

use super::map::{OFF_HEAD, OFF_RX_WAITING, OFF_SPACE_SEQ, OFF_TAIL, OFF_TX_WAITING, Segment};

/// The error for a position the peer published that this side cannot accept: names this rank
/// (`me`, once known), the peer, the operation (`op`) and what was wrong (`what`).
fn corrupt(me: Option<usize>, peer: usize, op: &str, what: String) -> io::Error {
    let me = me.map_or_else(|| "this rank".to_string(), |r| format!("rank {r}"));
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{me}: corrupt shared-memory ring from peer {peer} while {op}: {what}"),
    )
}

/// How far position `a` is from `b`, in words: "N bytes ahead of" or "N bytes behind".
fn distance(a: u64, b: u64) -> String {
    if a >= b {
        format!("{} bytes ahead of", a - b)
    } else {
        format!("{} bytes behind", b - a)
    }
}

/// The producing end: this rank writes the bytes of its frames to the peer here.
#[derive(Debug)]
pub(crate) struct TxRing {
    seg: Segment,
    cap: u64,
    /// Bytes written so far (the authoritative producer position).
    tail: u64,
    /// The consumer, for errors.
    peer: usize,
    /// This rank, for errors (set by [`TxRing::for_rank`]).
    me: Option<usize>,
}

/// The consuming end: this rank reads the peer's frames from here.
#[derive(Debug)]
pub(crate) struct RxRing {
    seg: Segment,
    cap: u64,
    /// Bytes read so far (the authoritative consumer position).
    head: u64,
    /// The producer, for errors.
    peer: usize,
    /// This rank, for errors (set by [`RxRing::for_rank`]).
    me: Option<usize>,
}

/// Copies `src` into the ring's bytes at position `pos` (wrapping at `cap`).
///
/// # Safety
/// `data` is the start of a live ring of `cap` bytes (a power of two) that this thread may
/// write at positions `pos..pos + src.len()` (the space the consumer has given back), and
/// `src.len() <= cap`.
unsafe fn copy_in(data: *mut u8, cap: u64, pos: u64, src: &[u8]) {
    let at = (pos & (cap - 1)) as usize;
    let first = src.len().min(cap as usize - at);
    // SAFETY: `at + first <= cap` and `src.len() - first <= cap`, within the ring (caller's
    // contract), a shared mapping outside every Rust allocation reached by no reference, as
    // `write_shared` needs; its volatile stores cannot race in Rust's sense with a consumer
    // that breaks the protocol and reads these bytes meanwhile (`copy.rs`). (Tests:
    // `ring_tests`, `copy::tests`.)
    unsafe {
        super::copy::write_shared(data.add(at), &src[..first]);
        super::copy::write_shared(data, &src[first..]);
    }
}

/// Copies the ring's bytes at position `pos` (wrapping at `cap`) into `dst`.
///
/// # Safety
/// As [`copy_in`], for reading `pos..pos + dst.len()` (bytes the producer has published).
unsafe fn copy_out(data: *const u8, cap: u64, pos: u64, dst: &mut [u8]) {
    let at = (pos & (cap - 1)) as usize;
    let first = dst.len().min(cap as usize - at);
    let (a, b) = dst.split_at_mut(first);
    // SAFETY: as in `copy_in`, for reading with `read_shared`: a producer that breaks the
    // protocol and writes these bytes meanwhile makes them wrong, never a data race
    // (`copy.rs`). (Tests: `ring_tests`, `copy::tests`.)
    unsafe {
        super::copy::read_shared(data.add(at), a);
        super::copy::read_shared(data, b);
    }
}

impl TxRing {
    /// The producing end of `seg` (made by [`Segment::create`] with capacity `cap`).
    pub(crate) fn new(seg: Segment, cap: u64, peer: usize) -> TxRing {
        debug_assert_eq!(seg.len() as u64, super::map::HEADER as u64 + cap);
        TxRing {
            seg,
            cap,
            tail: 0,
            peer,
            me: None,
        }
    }

    /// The same ring, naming this rank (`me`) in its errors.
    pub(crate) fn for_rank(self, me: usize) -> TxRing {
        TxRing {
            me: Some(me),
            ..self
        }
    }

    /// The room left, from the consumer's published position (checked); `op` names what this
    /// side is doing, for the error.
    fn room(&self, op: &dyn Fn() -> String) -> io::Result<u64> {
        let head = self.seg.u64_at(OFF_HEAD).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        if used > self.cap {
            return Err(corrupt(
                self.me,
                self.peer,
                &op(),
                format!(
                    "its read position {head} is {} this rank's write position {}, which may be \
                     at most the ring's {} bytes ahead of it",
                    distance(head, self.tail),
                    self.tail,
                    self.cap
                ),
            ));
        }
        Ok(self.cap - used)
    }

    /// Writes as much of `bufs` (in order) as fits now, without blocking. Returns the bytes
    /// written (0 when the ring is full) and whether the consumer asked to be woken (the
    /// caller then rings its doorbell).
    pub(crate) fn write_some(
        &mut self,
        bufs: &[std::io::IoSlice<'_>],
    ) -> io::Result<(usize, bool)> {
        let mut room = self.room(&|| {
            let n: usize = bufs.iter().map(|b| b.len()).sum();
            format!("writing {n} bytes to it")
        })?;
        let start = self.tail;
        for b in bufs {
            if room == 0 {
                break;
            }
            let n = (b.len() as u64).min(room);
            // SAFETY: the consumer has given back `room` bytes from `tail` (checked against
            // `cap` in `room`), and this `&mut self` is the ring's only producer. (Tests:
            // `bytes_wrap_around_the_end_in_order`, `random_header_values_never_fault`.)
            unsafe { copy_in(self.seg.data(), self.cap, self.tail, &b[..n as usize]) };
            self.tail += n;
            room -= n;
        }
        let n = (self.tail - start) as usize;
        if n == 0 {
            return Ok((0, false));
        }
        self.seg
            .u64_at(OFF_TAIL)
            .store(self.tail, Ordering::Release);
        // Store-fence-load against the consumer's `arm`: it either sees this position or we
        // see its flag.
        fence(Ordering::SeqCst);
        let waiting = self.seg.u32_at(OFF_RX_WAITING);
        let bell = waiting.load(Ordering::Relaxed) != 0 && waiting.swap(0, Ordering::Relaxed) != 0;
        Ok((n, bell))
    }

    /// Sleeps until the consumer gives room back, at most `limit`; returns at once if there is
    /// room already. A wake-up is not a promise of room: the caller looks again.
    pub(crate) fn wait_room(&self, limit: Duration) -> io::Result<()> {
        let seq_word = self.seg.u32_at(OFF_SPACE_SEQ);
        let seq = seq_word.load(Ordering::Acquire);
        self.seg.u32_at(OFF_TX_WAITING).store(1, Ordering::Relaxed);
        // Store-fence-load against the consumer's `read`: it either sees our flag (and bumps
        // the sequence, which makes the futex wait return at once) or we see its room.
        fence(Ordering::SeqCst);
        if self.room(&|| "waiting for room in it".into())? > 0 {
            return Ok(());
        }
        wait_on(seq_word.as_ptr().cast_const(), seq, limit)
    }
}

/// Sleeps while `word` holds `seen`, at most `limit` (a wake-up, a timeout or an interruption
/// all return `Ok`: the caller looks again).
/// `word` is meant to be an aligned u32 of a shared mapping that stays mapped for the call,
/// read-only (a peer's arena) or not: the futex takes its address, not a Rust reference, since
/// an atomic reference needs memory valid for writes. Any other address is an error, never
/// undefined behaviour (the kernel reads the word).
#[cfg(target_os = "linux")]
pub(super) fn wait_on(word: *const u32, seen: u32, limit: Duration) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(limit.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: limit.subsec_nanos().into(),
    };
    // SAFETY: sound for any `word`, whatever the callers pass: FUTEX_WAIT reads the u32 at
    // `word` inside the kernel (as a user-memory access, never through a Rust reference; the
    // words waited on are written only by atomic stores, so no write races it: "any `word`"
    // covers a fault, not a word that a thread writes plainly, as `read_process`'s contract
    // has it), and an address
    // that is not mapped readable is `EFAULT`, a misaligned one `EINVAL`, both returned as
    // errors below. It also reads the timespec `ts`, which lives for the call, and writes no
    // memory. The callers pass a live, aligned word of a shared mapping
    // (`SharedMap::u32_ptr`, `AtomicU32::as_ptr`) so that the wait means something, not for
    // soundness. (Tests: `arena_tests::a_second_sleeper_of_one_rank_is_still_woken`,
    // `ring_tests`; `ring_tests::a_bad_futex_address_is_an_error` for the errors.)
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word,
            libc::FUTEX_WAIT,
            seen,
            &raw const ts,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::ETIMEDOUT | libc::EINTR) => Ok(()),
        _ => Err(e),
    }
}

/// Elsewhere there is no futex (and no shared memory: see `setup::abstract_addr`): a short
/// sleep, after which the caller looks again.
#[cfg(not(target_os = "linux"))]
pub(super) fn wait_on(_word: *const u32, _seen: u32, limit: Duration) -> io::Result<()> {
    std::thread::sleep(limit.min(Duration::from_millis(1)));
    Ok(())
}

/// Wakes every waiter on `word` (the producer is in another process: a shared futex).
#[cfg(target_os = "linux")]
pub(super) fn wake_all(word: &std::sync::atomic::AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), u32::MAX >> 1);
}

#[cfg(not(target_os = "linux"))]
pub(super) fn wake_all(_word: &std::sync::atomic::AtomicU32) {}

impl RxRing {
    /// The consuming end of `seg` (checked by [`Segment::open`] for capacity `cap`).
    pub(crate) fn new(seg: Segment, cap: u64, peer: usize) -> RxRing {
        debug_assert_eq!(seg.len() as u64, super::map::HEADER as u64 + cap);
        RxRing {
            seg,
            cap,
            head: 0,
            peer,
            me: None,
        }
    }

    /// The same ring, naming this rank (`me`) in its errors.
    pub(crate) fn for_rank(self, me: usize) -> RxRing {
        RxRing {
            me: Some(me),
            ..self
        }
    }

    /// The bytes published and not yet read (checked); `op` names what this side is doing,
    /// for the error.
    pub(crate) fn available(&self, op: &dyn Fn() -> String) -> io::Result<u64> {
        let tail = self.seg.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let avail = tail.wrapping_sub(self.head);
        if avail > self.cap {
            return Err(corrupt(
                self.me,
                self.peer,
                &op(),
                format!(
                    "its write position {tail} is {} this rank's read position {}; it may be at \
                     most the ring's {} bytes ahead",
                    distance(tail, self.head),
                    self.head,
                    self.cap
                ),
            ));
        }
        Ok(avail)
    }

    /// Reads up to `dst.len()` bytes; `Ok(0)` when the ring is empty. Wakes a producer that
    /// waits for room.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let avail = self.available(&|| format!("reading up to {} bytes from it", dst.len()))?;
        let n = (dst.len() as u64).min(avail) as usize;
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: the producer has published `avail` bytes from `head` (checked against `cap`
        // in `available`), and this `&mut self` is the ring's only consumer. (Tests:
        // `a_corrupt_position_is_an_error_naming_the_peer`, `bytes_wrap_around_the_end_in_order`.)
        unsafe { copy_out(self.seg.data(), self.cap, self.head, &mut dst[..n]) };
        self.head += n as u64;
        self.seg
            .u64_at(OFF_HEAD)
            .store(self.head, Ordering::Release);
        fence(Ordering::SeqCst);
        let waiting = self.seg.u32_at(OFF_TX_WAITING);
        if waiting.load(Ordering::Relaxed) != 0 {
            waiting.store(0, Ordering::Relaxed);
            let seq = self.seg.u32_at(OFF_SPACE_SEQ);
            seq.fetch_add(1, Ordering::Release);
            wake_all(seq);
        }
        Ok(n)
    }

    /// Asks the producer to ring the doorbell when it next writes; true if bytes are waiting
    /// already (then no doorbell may come: the caller reads instead of sleeping).
    pub(crate) fn arm(&self) -> io::Result<bool> {
        self.seg.u32_at(OFF_RX_WAITING).store(1, Ordering::Relaxed);
        // Store-fence-load against the producer's `write_some`.
        fence(Ordering::SeqCst);
        Ok(self.available(&|| "asking it for a doorbell".into())? > 0)
    }
}

#[cfg(test)]
impl RxRing {
    /// Whether the producer waits for room now (its flag is up).
    pub(crate) fn producer_waiting_for_test(&self) -> bool {
        self.seg.u32_at(OFF_TX_WAITING).load(Ordering::SeqCst) != 0
    }

    /// Plays a hostile peer: publishes a write position beyond what the ring can hold.
    pub(crate) fn corrupt_tail_for_test(&self) {
        let bad = self.head + self.cap + 1;
        self.seg.u64_at(OFF_TAIL).store(bad, Ordering::SeqCst);
    }
}

#[cfg(test)]
#[path = "ring_tests.rs"]
mod tests;

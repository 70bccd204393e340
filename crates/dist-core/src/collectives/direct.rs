//! all_reduce among the ranks of one host that read each other's buffers directly
//! ([`HostArena::read_direct`](crate::transport::HostArena::read_direct): `process_vm_readv` on Linux)
//! for the reduction instead of copying them into the arena first, and pass the results
//! through the arena's slots: one copy out of each peer's buffer for the reduction, the
//! reduced share written into the slot, and one copy out of the slots for the others'
//! results, against the arena's three passes. (The results once went from buffer to buffer by
//! direct reads too, every rank's share read by every peer at once. On a 16-core host at 4 and
//! 8 ranks that was 1.25–1.3× slower at 16 MiB, but 2–8 % faster at 64 MiB, where a share
//! takes several rounds here, each a wait for every rank; `docs/results/README.md`,
//! "2026-12-02, afternoon (4249335)".)
//!
//! One call takes the arena's pieces k, k + 1, …, k + R (R rounds, then one to close; their
//! words as in `collectives/host.rs`):
//! 1. Each rank writes the address and byte length of its buffer at the start of its slot
//!    `k % 2`, with the call's descriptor beside it, publishes `Input = k + 1` and waits for
//!    every peer's; it checks their descriptors and lengths.
//! 2. Round r (piece k + r; from the second round on, it starts by publishing `Input` and
//!    waiting for every peer's, which says they copied the round before out of their slots):
//!    rank i reduces the round's part of share i of the buffer (share i is 1/n of it; a round
//!    takes at most a slot's worth, after the header, of each share), reading every peer's
//!    bytes there from the peer's buffer in rank order, in chunks that stay in the cache;
//!    it writes each chunk's result over its own buffer and into its slot after the header,
//!    and publishes `Reduced = k + r + 1`. Nobody else reads share i of rank i's buffer, and
//!    rank i reads share i of the others', which they do not write until step 3.
//! 3. For every peer q, once q's `Reduced` says so, it copies q's part of the round out of q's
//!    slot into its own share q. Peer q read share q of this rank's buffer before it
//!    published, so the write takes nothing from under a reader.
//! 4. After the last round it publishes `Input = k + R + 1` and waits for every peer's, then
//!    publishes `Reduced = k + R + 1` (no wait: it keeps the words a piece apart). A peer
//!    publishes that `Input` only once it has seen, in every round, the `Reduced` of every
//!    rank with a part to reduce, which each publishes after its reads (so every read of the
//!    peer's buffer is done), and copied every result out (the slots are free for the next
//!    call).
//!
//! A rank that fails returns at once, whatever the step, and never publishes the closing
//! `Input`: a peer that read from its buffer after it left (and so perhaps bytes its caller
//! changed) fails in the next `Input` wait, the next round's or the closing one, so nobody
//! returns a result read from a buffer that changed under it. A rank whose closing `Input`
//! is out has nothing of its buffer left to be read, so it may fail after that.
//!
//! Each element is reduced by one rank, in rank order, as on the arena: every rank gets bitwise
//! the same result, and the same as the arena's.
//!
//! A rank may split steps 2 and 3 over several threads
//! ([`HostArena::threads`](crate::transport::HostArena::threads): this one and the group's
//! helper pool), each taking a range of at least [`PART_MIN`] bytes of the share it reduces
//! and of each peer's share it copies. A step ends only once every range is done, failed ones
//! included, so no helper touches the buffer after the call returns; the result is the same
//! whatever the count.

use std::time::{Duration, Instant};

use crate::arena::ArenaWord;
use crate::error::{DistError, Result};
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::arena_wait::wait_word;
use super::call::finish;
use super::host::Host;
use super::scratch::{bytes, bytes_mut, segment};

/// The bytes read from a peer at a time during the reduction (with as many of this rank's
/// own, they stay in the cache).
const DIRECT_CHUNK: usize = 128 << 10;

/// The fewest bytes of a share (or of a peer's share copied) that one thread takes when a
/// rank splits its part of the call over several
/// ([`HostArena::threads`](crate::transport::HostArena::threads)): a smaller one costs
/// more in waking a thread than it saves.
pub(super) const PART_MIN: usize = 256 << 10;

/// How long a failed read waits for the reason its peer left (`explain_failed_read`), and how
/// often it looks.
const EXPLAIN_WAIT: Duration = Duration::from_millis(500);
const EXPLAIN_POLL: Duration = Duration::from_millis(1);

/// The bytes of the buffer's address and length at the start of a slot.
pub(super) const HEADER: usize = 16;

impl<L: Link> Host<'_, '_, L> {
    /// all_reduce of `data` in place among the host's ranks, reading their buffers directly
    /// for the reduction and passing the results through the arena's slots.
    pub(super) fn all_reduce_direct<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let (c, a) = (self.c, self.a);
        let len = std::mem::size_of_val(data);
        let size = std::mem::size_of::<T>();
        // The elements of a share that one round passes through a slot, after the header.
        let per_round = a.slot_len().saturating_sub(HEADER) / size;
        if per_round == 0 {
            return Err(c.invalid(format!(
                "arena slots of {} bytes hold no {}-byte element after the direct reads' header",
                a.slot_len(),
                size
            )));
        }
        let (k0, slot0) = self.next_piece();
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&(data.as_ptr() as usize as u64).to_le_bytes());
        header[8..].copy_from_slice(&(len as u64).to_le_bytes());
        self.announce(Some(&header[..]), k0, slot0, true)?;
        let addrs = self.peer_buffers(slot0, len)?;

        let m = self.local.len();
        let read = |q: usize, off: usize, dst: &mut [u8]| -> Result<()> {
            let addr = addrs[q] + off as u64;
            a.read_direct(q, addr, dst)
                .map_err(|e| self.explain_failed_read(q, addr, dst.len(), e))
        };
        let count = data.len();
        // Round `r`'s part of share `i`: its elements from `r * per_round`, at most `per_round`.
        let part_of = |i: usize, r: usize| {
            let s = segment(count, m, i);
            let from = s
                .start
                .saturating_add(r.saturating_mul(per_round))
                .min(s.end);
            from..from.saturating_add(per_round).min(s.end)
        };
        let longest = (0..m)
            .map(|i| segment(count, m, i).len())
            .max()
            .unwrap_or(0);
        let rounds = longest.div_ceil(per_round).max(1);
        let per_chunk = (DIRECT_CHUNK / size).max(1);
        for r in 0..rounds {
            let (k, slot) = if r == 0 {
                (k0, slot0)
            } else {
                let (k, slot) = self.next_piece();
                self.announce::<T>(None, k, slot, false)?;
                (k, slot)
            };
            let mine = part_of(self.pos, r);
            let base = mine.start;
            // Each chunk of the share is reduced, then written into the slot while it is
            // still in the cache.
            self.in_parts(&mut data[mine], PART_MIN, &|at, part| {
                for (j, chunk) in part.chunks_mut(per_chunk).enumerate() {
                    let from = at + j * per_chunk;
                    self.reduce_from(chunk, base + from, op, DIRECT_CHUNK, &read)?;
                    if self.whole {
                        finish(chunk, op, c.n);
                    }
                    a.write(slot, HEADER + from * size, bytes(chunk))
                        .map_err(|e| e.map_op(|_| c.op_text()))?;
                }
                Ok(())
            })?;
            a.publish(ArenaWord::Reduced, k.wrapping_add(1));

            // The others' results, starting after this rank's so that the owners are read
            // in turn.
            for step in 1..m {
                let i = (self.pos + step) % m;
                let q = self.local[i];
                let theirs = part_of(i, r);
                if theirs.is_empty() {
                    continue;
                }
                wait_word(c, a, q, ArenaWord::Reduced, k.wrapping_add(1))?;
                self.in_parts(&mut data[theirs], PART_MIN, &|at, part| {
                    a.read(q, slot, HEADER + at * size, bytes_mut(part))
                        .map_err(|e| e.map_op(|_| c.op_text()))
                })?;
            }
        }

        // Every peer's `Input` here says that it stayed in the call until every read of its
        // buffer was done, and that it copied every result out of the slots.
        let (k2, slot2) = self.next_piece();
        self.announce::<u8>(None, k2, slot2, false)?;
        a.publish(ArenaWord::Reduced, k2.wrapping_add(1));
        Ok(())
    }

    /// The error for a failed direct read of `len` bytes of rank `q`'s buffer at `addr`. A read
    /// fails most often because `q` left the call (it failed, or its process exited) and its
    /// buffer went with it; then the reason travels as its abort notice or its connection's
    /// end, sent before it left, so this waits up to [`EXPLAIN_WAIT`] for either (the cause
    /// named, say another rank gone, rather than the read). Else: `q`'s process gone (no such
    /// process), or the read's own I/O error naming both ranks and the bytes.
    fn explain_failed_read(&self, q: usize, addr: u64, len: usize, e: std::io::Error) -> DistError {
        let (c, a) = (self.c, self.a);
        let until = Instant::now() + EXPLAIN_WAIT;
        loop {
            if let Some(n) = c.abort_notice() {
                return c.aborted(n);
            }
            if let Err(gone) = a.check_peer(q, &|| c.op_text()) {
                return gone;
            }
            let now = Instant::now();
            if now >= until || now >= c.deadline() {
                break;
            }
            std::thread::sleep(EXPLAIN_POLL);
        }
        if e.kind() == std::io::ErrorKind::NotFound {
            return DistError::PeerGone {
                rank: c.me,
                peer: q,
                op: c.op_text(),
                cause: format!("its process is gone (a direct read of its buffer: {e})"),
            };
        }
        DistError::Io {
            rank: c.me,
            context: format!(
                "{}: direct read of {len} bytes of rank {q}'s buffer at {addr:#x}",
                c.op_text()
            ),
            source: e,
        }
    }

    /// Every local peer's buffer address, indexed by rank, read from its slot `slot`, whose
    /// length must be `len` as this rank's (the descriptors matched, so a different one is a
    /// corrupt arena: an error naming the peer).
    fn peer_buffers(&self, slot: usize, len: usize) -> Result<Vec<u64>> {
        let (c, a) = (self.c, self.a);
        let mut addrs = vec![0u64; c.n];
        for &q in self.local.iter().filter(|&&q| q != c.me) {
            let mut h = [0u8; HEADER];
            a.read(q, slot, 0, &mut h)
                .map_err(|e| e.map_op(|_| c.op_text()))?;
            let word = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or([0; 8]));
            let (addr, theirs) = (word(0), word(8));
            let problem = if theirs != len as u64 {
                Some(format!(
                    "its buffer is {theirs} bytes, this rank's {len}, in a call whose \
                     descriptors match"
                ))
            } else if addr == 0 || addr.checked_add(theirs).is_none() {
                Some(format!("its buffer of {theirs} bytes is at {addr:#x}"))
            } else {
                None
            };
            if let Some(p) = problem {
                return Err(DistError::PeerGone {
                    rank: c.me,
                    peer: q,
                    op: c.op_text(),
                    cause: format!("corrupt host arena: {p}"),
                });
            }
            addrs[q] = addr;
        }
        Ok(addrs)
    }
}

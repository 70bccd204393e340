//! The posted/queued slot table: receives waiting for a message, messages waiting for a
//! receive, and the unexpected-message budget.

use super::*;

/// A message that arrived before anyone asked for it.
pub(super) struct Queued {
    pub(super) data: Vec<u8>,
    pub(super) meta: Meta,
    /// Whether it counts against the peer's unexpected-message budget (it came off the socket).
    pub(super) counted: bool,
}

/// How a posted receive ended.
pub(super) enum Outcome {
    Delivered(Meta),
    /// The message had another length; it stays queued.
    Mismatch(usize),
    Gone(String),
}

pub(super) enum Slot {
    /// Waiting for a message.
    Open,
    /// A payload is being written into the buffer (under the read-side lock).
    Filling,
    Done(Outcome),
}

/// A receive waiting for a message: the caller's buffer, which the reader fills directly.
pub(super) struct Posted {
    pub(super) id: u64,
    pub(super) tag: u64,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) slot: Slot,
}

pub(super) struct State {
    /// Why the connection ended, once it has.
    pub(super) closed: Option<String>,
    pub(super) posted: VecDeque<Posted>,
    pub(super) queued: HashMap<u64, VecDeque<Queued>>,
    pub(super) next_id: u64,
    /// Threads blocked on the condition variable; nobody is notified when there are none.
    pub(super) sleepers: usize,
    /// The reader thread is blocked on `reader_cond`.
    pub(super) reader_sleeping: bool,
    /// ... and it is holding a large message back for a receive to be posted.
    pub(super) reader_holding: bool,
    /// The backend is being dropped and waits for the peer to close its side.
    pub(super) closing: bool,
    /// Bytes (plus [`QUEUED_OVERHEAD`] each) of queued messages that came off the socket.
    pub(super) queued_bytes: usize,
    /// Counts posts and takes from the queue: a reader holding a frame back rechecks when it moves.
    pub(super) events: u64,
}

impl State {
    pub(super) fn new() -> State {
        State {
            closed: None,
            posted: VecDeque::new(),
            queued: HashMap::new(),
            next_id: 0,
            sleepers: 0,
            reader_sleeping: false,
            reader_holding: false,
            closing: false,
            queued_bytes: 0,
            events: 0,
        }
    }
}

impl State {
    /// Takes the next message queued on `tag` into `buf`: `Some(Ok(meta))`; `Some(Err(len))`
    /// if it has another length (it stays queued); `None` if none is queued.
    pub(super) fn take_queued(&mut self, tag: u64, buf: &mut [u8]) -> Option<Result<Meta, usize>> {
        let q = self.queued.get_mut(&tag)?;
        let front = q.front()?;
        if front.data.len() != buf.len() {
            return Some(Err(front.data.len()));
        }
        let m = q.pop_front()?;
        if q.is_empty() {
            // An emptied tag's deque is dropped, or many distinct tags would leak one each.
            self.queued.remove(&tag);
        }
        buf.copy_from_slice(&m.data);
        if m.counted {
            self.queued_bytes -= m.data.len() + QUEUED_OVERHEAD;
            self.events += 1;
        }
        Some(Ok(m.meta))
    }

    /// Posts a receive of `len` bytes at `ptr` on `tag`; returns its id. From here the read
    /// side may write the buffer (under the read-side lock) until the entry leaves `posted`.
    ///
    /// # Safety
    /// `ptr` is valid for writes of `len` bytes, and nothing else reads or writes them, until
    /// the caller has removed the entry (never while it is `Filling`; see the `Send` impl below).
    pub(super) unsafe fn post(&mut self, tag: u64, ptr: *mut u8, len: usize) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.posted.push_back(Posted {
            id,
            tag,
            ptr,
            len,
            slot: Slot::Open,
        });
        self.events += 1;
        id
    }

    /// Removes receive `id` if it is done, with how it ended.
    #[cfg(test)]
    pub(super) fn take_done(&mut self, id: u64) -> Option<Outcome> {
        let i = self.posted.iter().position(|p| p.id == id)?;
        if !matches!(self.posted[i].slot, Slot::Done(_)) {
            return None;
        }
        match self.posted.remove(i)?.slot {
            Slot::Done(o) => Some(o),
            _ => None,
        }
    }
}

// SAFETY: `Posted::ptr` is the only non-`Send` field. It points into a buffer that the receiving
// thread borrows mutably for as long as the entry is in `posted`; that thread removes the entry
// before it returns, and never while it is `Filling` (a fill ends, or the connection is shut and
// the fill dropped, under the read-side lock first). Only the holder of the read-side lock writes
// through the pointer. So moving `State` between threads (inside its mutex) never lets the
// pointer outlive or alias its buffer.
unsafe impl Send for State {}

pub(super) enum Payload<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Payload<'_> {
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            Payload::Borrowed(b) => b,
            Payload::Owned(v) => v,
        }
    }

    pub(super) fn into_vec(self) -> Vec<u8> {
        match self {
            Payload::Borrowed(b) => b.to_vec(),
            Payload::Owned(v) => v,
        }
    }
}

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
    /// The I/O thread waits on this peer for a wake or its timer (not for the socket).
    pub(super) reader_sleeping: bool,
    /// ... and it is holding a large message back for a receive to be posted.
    pub(super) reader_holding: bool,
    /// The backend is being dropped and waits for the peer to close its side.
    pub(super) closing: bool,
    /// Bytes (plus [`QUEUED_OVERHEAD`] each) of queued messages that came off the socket.
    pub(super) queued_bytes: usize,
    /// Counts posts and takes from the queue: a reader holding a frame back rechecks when it moves.
    pub(super) events: u64,
    /// The wake descriptors of receivers waiting in `poll` on this peer's socket themselves
    /// (`poll_wait.rs`); the I/O thread leaves the socket to them meanwhile.
    pub(super) pollers: Vec<Arc<super::poll_wait::WakeFd>>,
    /// The I/O thread's last turn asked to be woken when the socket is readable.
    pub(super) io_read: bool,
    /// ... and that interest is registered with its poller now (see [`Peer::io_interest`]).
    pub(super) io_armed: bool,
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
            pollers: Vec::new(),
            io_read: false,
            io_armed: false,
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
// pointer outlive or alias its buffer. (Tests: `a_receive_whose_wait_unwinds_is_withdrawn`,
// `a_receive_whose_send_unwinds_is_withdrawn`, `fill_tests`.)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(st: &mut State, tag: u64, data: &[u8], counted: bool) {
        if counted {
            st.queued_bytes += data.len() + QUEUED_OVERHEAD;
        }
        st.queued.entry(tag).or_default().push_back(Queued {
            data: data.to_vec(),
            meta: [data.len() as u8; 16],
            counted,
        });
    }

    /// Queued messages are taken in order per tag, never across tags; the budget is given back
    /// and an emptied tag leaves no entry.
    #[test]
    fn queued_messages_are_taken_in_order_per_tag() {
        let mut st = State::new();
        queue(&mut st, 1, &[1, 1], true);
        queue(&mut st, 2, &[2, 2, 2], true);
        queue(&mut st, 1, &[3, 3], false);
        let mut b = [0u8; 2];
        assert_eq!(st.take_queued(1, &mut b), Some(Ok([2; 16])));
        assert_eq!(b, [1, 1]);
        assert_eq!(st.queued_bytes, 3 + QUEUED_OVERHEAD);
        assert_eq!(st.take_queued(1, &mut b), Some(Ok([2; 16])));
        assert_eq!(b, [3, 3]);
        assert!(st.take_queued(1, &mut b).is_none());
        assert!(!st.queued.contains_key(&1));
        assert_eq!(st.queued.len(), 1);
    }

    /// A receive of the wrong size is told the message's size and takes nothing: the message
    /// stays for a receive of the right size.
    #[test]
    fn a_wrong_size_takes_nothing() {
        let mut st = State::new();
        queue(&mut st, 7, &[9; 5], true);
        let mut small = [0u8; 4];
        assert_eq!(st.take_queued(7, &mut small), Some(Err(5)));
        assert_eq!(small, [0; 4]);
        let mut right = [0u8; 5];
        assert_eq!(st.take_queued(7, &mut right), Some(Ok([5; 16])));
        assert_eq!((right, st.queued_bytes), ([9; 5], 0));
    }

    /// Posted receives get increasing ids and are open until something completes them; only a
    /// done one can be taken.
    #[test]
    fn posted_receives_are_open_until_done() {
        let mut st = State::new();
        let mut a = [0u8; 3];
        let mut b = [0u8; 3];
        // SAFETY: both buffers outlive the entries, which are removed before the test ends.
        let (ia, ib) = unsafe {
            (
                st.post(4, a.as_mut_ptr(), a.len()),
                st.post(4, b.as_mut_ptr(), b.len()),
            )
        };
        assert_eq!(ib, ia + 1);
        assert!(st.take_done(ia).is_none());
        st.posted[0].slot = Slot::Done(Outcome::Delivered([1; 16]));
        assert!(matches!(st.take_done(ia), Some(Outcome::Delivered(m)) if m == [1; 16]));
        st.posted[0].slot = Slot::Done(Outcome::Mismatch(8));
        assert!(matches!(st.take_done(ib), Some(Outcome::Mismatch(8))));
        assert!(st.posted.is_empty());
    }
}

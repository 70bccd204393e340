//! Where a data frame's payload goes, decided once its header is read: into the buffer of a
//! posted receive, into the queue within the unexpected-message budget, held in the socket (a
//! grace period for large messages, flow control), or skipped while the backend closes; and the
//! checks a frame header from the peer must pass first.

use super::*;

impl Peer {
    /// Decides where a data frame's payload goes: the first open receive on its tag with a
    /// buffer of its size, else the queue. A large message that nobody waits for yet is held
    /// in the socket for a moment first: streaming receivers post their next buffer just after
    /// the last one filled, and the payload then lands in place instead of in fresh memory.
    ///
    /// Flow control: a message queues only while the peer's queued bytes stay within
    /// [`Limits::unexpected`]; otherwise it stays in the socket (so TCP slows the sender) until
    /// a receive is posted for it or the queue drains. A message larger than the whole budget
    /// is never queued: it waits for its receive and lands straight in the posted buffer.
    /// `held` is `None` for a frame just read; `Some(until)` for one held back already: until
    /// the grace period's end, or `Some(None)` once held for flow control.
    pub(super) fn route(&self, h: FrameHeader, len: usize, held: Option<Option<Instant>>) -> Frame {
        let mut st = self.lock();
        let unexpected = self.limits.unexpected;
        let st = &mut *st;
        let open = st
            .posted
            .iter_mut()
            .find(|p| p.tag == h.tag && matches!(p.slot, Slot::Open));
        let cost = len.saturating_add(QUEUED_OVERHEAD);
        let fits = st
            .queued_bytes
            .checked_add(cost)
            .is_some_and(|b| b <= unexpected);
        match open {
            Some(p) if p.len == len => {
                p.slot = Slot::Filling;
                return Frame::Fill {
                    id: p.id,
                    ptr: p.ptr,
                    len,
                    done: 0,
                    meta: h.meta,
                };
            }
            // A receive of another size is told so: when the message has been queued, or now,
            // if it cannot be queued.
            Some(p) if !fits && !st.closing => {
                p.slot = Slot::Done(Outcome::Mismatch(len));
                self.notify(st);
                return Frame::Held {
                    header: h,
                    until: None,
                    seen: st.events,
                };
            }
            None if st.closing => return Frame::Skip { left: h.len },
            None if len >= GRACE_MIN_LEN => {
                // `Instant + 5 ms` cannot overflow in practice; if it did, the grace is skipped.
                let until = match held {
                    None => Instant::now().checked_add(GRACE),
                    Some(until) => until,
                };
                if let Some(until) = until.filter(|u| Instant::now() < *u) {
                    return Frame::Held {
                        header: h,
                        until: Some(until),
                        seen: st.events,
                    };
                }
            }
            _ => {}
        }
        if !fits {
            if st.closing {
                return Frame::Skip { left: h.len };
            }
            return Frame::Held {
                header: h,
                until: None,
                seen: st.events,
            };
        }
        st.queued_bytes = st.queued_bytes.saturating_add(cost);
        Frame::Queue {
            tag: h.tag,
            data: vec![0u8; len],
            done: 0,
            meta: h.meta,
        }
    }

    /// Decodes and checks a frame header from this peer: a known kind, no reserved flags, and
    /// a length within [`Limits::max_message`] (data) or [`ABORT_MAX`] (abort notices).
    /// Returns it with its length, or the protocol error that ends the connection.
    pub(super) fn check_header(
        &self,
        raw: &[u8; FRAME_HEADER_LEN],
    ) -> std::result::Result<(FrameHeader, usize), String> {
        let h = FrameHeader::decode(raw)
            .map_err(|e| format!("protocol error from peer {}: {e}", self.rank))?;
        let max = match h.kind {
            FrameKind::Data => self.limits.max_message,
            FrameKind::Abort => ABORT_MAX as u64,
            FrameKind::Heartbeat => 0,
        };
        match usize::try_from(h.len) {
            Ok(len) if h.len <= max => Ok((h, len)),
            _ => Err(format!(
                "protocol error from peer {}: {:?} frame of {} bytes on tag {} exceeds the limit of {max} bytes",
                self.rank, h.kind, h.len, h.tag
            )),
        }
    }
}

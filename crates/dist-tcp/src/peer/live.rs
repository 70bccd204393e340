//! A peer's liveness: the heartbeats this rank writes to it (never blocking), what it last said
//! of itself, and declaring it unresponsive once it has been silent past the peer timeout.

use super::*;
use crate::wire::{HEARTBEAT_ASK, HEARTBEAT_CLOSING};
use dist_core::collectives::{position_from_wire, position_to_wire};
use dist_core::flight::{Position, describe_positions};

/// How long a closing backend waits for a send in progress before skipping its goodbye.
const GOODBYE_WAIT: Duration = Duration::from_millis(100);

/// The bits of a packed position that hold the sequence number.
const SEQ_MASK: u64 = (1 << 48) - 1;

/// The bits of the sequence number a heartbeat carries for the calls beside the backend.
const BESIDE_BITS: u32 = 24;
const BESIDE_MASK: u64 = (1 << BESIDE_BITS) - 1;

/// Where this rank is, as its heartbeats say: its latest collective, and its latest call made
/// beside the backend (a hybrid's NCCL calls).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Whereabouts {
    pub(crate) collective: Option<Position>,
    pub(crate) beside: Option<Position>,
}

/// The full sequence number whose low [`BESIDE_BITS`] bits are `low`, nearest to `near` (the
/// asking rank's own: ranks of one job are never 2^23 calls apart).
pub(crate) fn unwrap_beside(low: u64, near: u64) -> u64 {
    let span = 1u64 << BESIDE_BITS;
    let base = near & !BESIDE_MASK;
    let candidates = [base.wrapping_sub(span), base, base.wrapping_add(span)];
    candidates
        .into_iter()
        .map(|b| b.wrapping_add(low & BESIDE_MASK))
        .filter(|c| *c != 0 && *c < (1 << 63))
        .min_by_key(|c| c.abs_diff(near))
        .unwrap_or(low & BESIDE_MASK)
}

/// What one heartbeat attempt found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Beat {
    /// Written (or, in part, left for the next frame to finish).
    Sent,
    /// A send holds the writer: it is on its way, and the heartbeat is not needed.
    Busy,
    /// The connection is broken or this is the loopback peer.
    Off,
}

impl Peer {
    /// Writes a heartbeat carrying `position` (this rank's latest collective), without
    /// blocking: when a send holds the writer, or the socket is full, it is left at that. What
    /// this proves is nothing about the peer; only what we receive from it does.
    pub(crate) fn heartbeat(&self, at: Whereabouts) -> Beat {
        self.heartbeat_flagged(at, 0, false)
    }

    /// A heartbeat that asks the peer for one back at once (see [`HEARTBEAT_ASK`]); like
    /// [`Peer::heartbeat`], it never blocks.
    pub(crate) fn ask(&self, at: Whereabouts) -> Beat {
        self.heartbeat_flagged(at, HEARTBEAT_ASK, false)
    }

    /// The liveness thread's periodic heartbeat: like [`Peer::heartbeat`], except that it is
    /// skipped (`Sent`) when bytes went to the peer since the last heartbeat written: they told
    /// the peer this rank is alive as well. A connection in use then carries no heartbeats; an
    /// idle one carries one an interval, so the peer never goes two intervals without a byte
    /// from a live rank.
    pub(crate) fn heartbeat_if_quiet(&self, at: Whereabouts) -> Beat {
        self.heartbeat_flagged(at, 0, true)
    }

    fn heartbeat_flagged(&self, at: Whereabouts, flags: u8, unless_wrote: bool) -> Beat {
        // A peer not connected (yet) gets no heartbeat: nothing is dialed for one.
        let Some(writer) = self.writer() else {
            return Beat::Off;
        };
        // A deadline already passed: the writer if it is free, at once; else `Busy`.
        let Some(mut w) = writer.lock_by(Instant::now()) else {
            return Beat::Busy;
        };
        if unless_wrote && w.broken.is_none() && w.hb_left == 0 && std::mem::take(&mut w.wrote) {
            return Beat::Sent;
        }
        if flags != 0 && w.hb_left > 0 {
            // A heartbeat is half written: finish it first, so the flag is not lost.
            if w.push_heartbeat().is_err() || w.hb_left > 0 {
                return Beat::Busy;
            }
        }
        self.beat(&mut w, at, flags)
    }

    /// Tells the peer that this rank is closing its backend normally (so that the connection
    /// ending next is no fault), by a heartbeat with [`HEARTBEAT_CLOSING`] set; best effort,
    /// without blocking on the socket.
    pub(crate) fn goodbye(&self, at: Whereabouts) {
        if let Some(writer) = self.writer() {
            let Some(mut w) = writer.lock_by(Instant::now() + GOODBYE_WAIT) else {
                return;
            };
            if w.hb_left > 0 {
                let _ = w.push_heartbeat();
            }
            if w.hb_left == 0 {
                self.beat(&mut w, at, HEARTBEAT_CLOSING);
            }
        }
    }

    fn beat(&self, w: &mut Writer, at: Whereabouts, flags: u8) -> Beat {
        if w.broken.is_some() {
            return Beat::Off;
        }
        if w.hb_left == 0 {
            let (seq, state, kind) = position_to_wire(at.collective);
            let mut meta = [0u8; 16];
            meta[..8].copy_from_slice(&seq.to_le_bytes());
            meta[8] = flags;
            meta[9] = state;
            meta[10] = kind;
            let (seq, state, kind) = position_to_wire(at.beside);
            meta[11..14].copy_from_slice(&(seq & BESIDE_MASK).to_le_bytes()[..3]);
            meta[14] = state;
            meta[15] = kind;
            w.hb = FrameHeader {
                kind: FrameKind::Heartbeat,
                tag: 0,
                len: 0,
                meta,
            }
            .encode();
            w.hb_left = FRAME_HEADER_LEN;
        }
        let pushed = w.push_heartbeat();
        // This heartbeat's own bytes do not count as bytes since the last one.
        w.wrote = false;
        match pushed {
            Ok(()) => Beat::Sent,
            Err(e) => {
                // The connection broke; the reader sees it end and the waits on it fail.
                w.broken = Some(format!("send failed: {e}"));
                Beat::Off
            }
        }
    }

    /// Whether the connection is still open (the loopback peer: always).
    pub(crate) fn is_open(&self) -> bool {
        self.lock().closed.is_none()
    }

    /// Declares the peer unresponsive after `silent` with nothing heard: ends the connection,
    /// and every wait on it (now or later) fails with [`DistError::PeerUnresponsive`].
    pub(crate) fn declare_silent(&self, silent: Duration) {
        let ms = u64::try_from(silent.as_millis()).unwrap_or(u64::MAX).max(1);
        self.silent_ms.store(ms, Ordering::Release);
        let cause = format!(
            "unresponsive: nothing heard from it for {silent:.1?} (stopped, partitioned, or its \
             host down)"
        );
        tracing::warn!(rank = self.me, peer = self.rank, "peer {cause}");
        if let Some(rx) = self.rx() {
            let mut r = rx.lock().unwrap_or_else(|p| p.into_inner());
            self.shut(&mut r, cause);
        }
    }

    /// Whether the peer said it is closing normally (the connection ending after that is no
    /// fault).
    pub(crate) fn leaving(&self) -> bool {
        self.leaving.get().is_some()
    }

    /// Whether the peer said it is closing normally less than `excuse` before `now`: its
    /// silence is excused only that long. A peer that says so and then stays connected and
    /// silent (stopped, or hostile) is judged as any other once the excuse runs out; saying it
    /// again does not extend it.
    pub(crate) fn leaving_within(&self, excuse: Duration, now: Instant) -> bool {
        self.leaving
            .get()
            .is_some_and(|t| now.saturating_duration_since(*t) < excuse)
    }

    /// Whether the peer was declared unresponsive.
    pub(crate) fn declared_silent(&self) -> bool {
        self.silent_ms.load(Ordering::Acquire) > 0
    }

    /// The error a wait on this peer fails with once it was declared unresponsive.
    pub(crate) fn unresponsive(&self, op: String) -> Option<DistError> {
        self.declared_silent().then(|| self.gone(op, String::new()))
    }

    /// Where the peer last said it was, for error texts ("" if it never said).
    pub(crate) fn position_text(&self) -> String {
        match self.remote_position() {
            None => String::new(),
            Some(p) => format!(
                "its last heartbeat said: {}",
                describe_positions(&[(self.rank, Some(p))])
            ),
        }
    }

    /// Takes what a heartbeat's meta says: the peer's position and whether it is leaving.
    pub(super) fn heard_position(&self, meta: &Meta) {
        let seq = u64::from_le_bytes(meta[..8].try_into().expect("eight bytes"));
        // Packed into one word: 48 bits of sequence number, the state, the kind.
        let packed = (seq & SEQ_MASK) | (u64::from(meta[9]) << 48) | (u64::from(meta[10]) << 56);
        self.position.store(packed, Ordering::Relaxed);
        let mut low = [0u8; 8];
        low[..3].copy_from_slice(&meta[11..14]);
        let beside =
            u64::from_le_bytes(low) | (u64::from(meta[14]) << 48) | (u64::from(meta[15]) << 56);
        self.beside.store(beside, Ordering::Relaxed);
        if meta[8] & HEARTBEAT_CLOSING != 0 {
            let _ = self.leaving.set(Instant::now());
        }
        // Counted after the positions are stored: a rank that sees the count move reads them.
        self.beats.fetch_add(1, Ordering::SeqCst);
        if let Some(sink) = self.on_beat.get() {
            sink(self.rank, meta[8] & HEARTBEAT_ASK != 0);
        }
    }

    /// Where the peer's calls beside its backend are, as its last heartbeat said; the sequence
    /// number is completed from its low bits nearest to `near` (this rank's own).
    pub(crate) fn remote_beside(&self, near: u64) -> Option<Position> {
        let packed = self.beside.load(Ordering::Relaxed);
        let low = packed & BESIDE_MASK;
        if low == 0 && (packed >> 48) as u8 == 0 {
            return None;
        }
        position_from_wire(
            unwrap_beside(low, near),
            (packed >> 48) as u8,
            (packed >> 56) as u8,
        )
    }

    /// Sets the hook that hears of heartbeats.
    pub(crate) fn set_beat_sink(&self, sink: BeatSink) {
        let _ = self.on_beat.set(sink);
    }

    /// The peer's latest collective, as its last heartbeat said.
    pub(crate) fn remote_position(&self) -> Option<Position> {
        let packed = self.position.load(Ordering::Relaxed);
        position_from_wire(
            packed & SEQ_MASK,
            (packed >> 48) as u8,
            (packed >> 56) as u8,
        )
    }

    /// Sets the hook that hears that the connection ended.
    pub(crate) fn set_close_sink(&self, sink: CloseSink) {
        let _ = self.on_close.set(sink);
    }
}

#[cfg(test)]
mod beside_tests {
    use super::unwrap_beside;

    #[test]
    fn a_sequence_number_is_completed_from_its_low_bits_nearest_to_ours() {
        let span = 1u64 << 24;
        // Same block, the block before and the block after ours.
        assert_eq!(unwrap_beside(7, 5), 7);
        assert_eq!(unwrap_beside(7, span + 3), span + 7);
        assert_eq!(unwrap_beside(span - 2, span + 3), span - 2);
        assert_eq!(unwrap_beside(2, 2 * span - 3), 2 * span + 2);
        // Before our first call: as carried.
        assert_eq!(unwrap_beside(9, 0), 9);
    }
}

#[cfg(test)]
mod quiet_tests {
    use std::io::Read;
    use std::net::TcpListener;

    use super::*;

    /// Reads what the peer wrote so far without waiting (a write on loopback is in the other
    /// end's buffer when the call that made it returns): the frame kinds, in order.
    fn kinds_written(raw: &mut TcpStream) -> Vec<u32> {
        let mut got = Vec::new();
        raw.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 4096];
        loop {
            match raw.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        // Whole frames only (the peer's writes are whole frames): walk the headers.
        let mut kinds = Vec::new();
        let mut at = 0;
        while at + FRAME_HEADER_LEN <= got.len() {
            let h: &[u8; FRAME_HEADER_LEN] = got[at..at + FRAME_HEADER_LEN].try_into().unwrap();
            let h = FrameHeader::decode(h).unwrap();
            kinds.push(h.kind as u32);
            at += FRAME_HEADER_LEN + h.len as usize;
        }
        assert_eq!(at, got.len(), "whole frames");
        kinds
    }

    /// The periodic heartbeat goes out on a quiet connection, is skipped once after a data
    /// frame (which told the peer this rank is alive), and goes out again after that; an
    /// asked-for heartbeat is never skipped. Fails without the skip: a heartbeat follows the
    /// data frame.
    #[test]
    fn a_periodic_heartbeat_is_skipped_after_other_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let limits = Limits {
            max_message: 1 << 20,
            unexpected: 1 << 20,
            sealed: false,
        };
        let peer =
            Peer::connected(0, 1, s, Duration::from_secs(10), Default::default(), limits).unwrap();
        let at = Whereabouts::default();
        let (data, beat) = (FrameKind::Data as u32, FrameKind::Heartbeat as u32);
        assert_eq!(peer.heartbeat_if_quiet(at), Beat::Sent);
        assert_eq!(kinds_written(&mut raw), [beat], "quiet: a heartbeat");
        let deadline = Instant::now() + Duration::from_secs(10);
        let data_frame = || {
            let op = || "send".to_string();
            peer.send(FrameKind::Data, 7, b"abc", [0; 16], &op, deadline)
                .unwrap()
        };
        data_frame();
        assert_eq!(peer.heartbeat_if_quiet(at), Beat::Sent);
        assert_eq!(kinds_written(&mut raw), [data], "after data: none");
        assert_eq!(peer.heartbeat_if_quiet(at), Beat::Sent);
        assert_eq!(kinds_written(&mut raw), [beat], "quiet again: a heartbeat");
        data_frame();
        assert_eq!(peer.heartbeat(at), Beat::Sent);
        assert_eq!(kinds_written(&mut raw), [data, beat], "asked for: always");
    }
}

//! The `Backend` trait: point-to-point messages and a barrier among `world_size` ranks.

use std::time::{Duration, Instant};

use crate::error::Result;

/// Identifies a stream of messages between two ranks.
///
/// Messages from one rank to another with the same tag arrive in the order they were sent;
/// messages with different tags never take each other's place, so independent operations (one per
/// thread, say) can run at once on one backend by using different tags. Half of the tag space is
/// for the caller ([`Tag::user`]); the other half ([`Tag::system`]) is reserved for dist's own
/// barrier and collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(u64);

impl Tag {
    /// The tag used by the untagged methods ([`Backend::send`], [`Backend::recv`]).
    pub const DEFAULT: Tag = Tag(0);

    const SYSTEM_BIT: u64 = 1 << 63;

    /// A tag for the caller's own messages.
    pub const fn user(tag: u32) -> Tag {
        Tag(tag as u64)
    }

    /// A tag reserved for dist's own protocols (barrier, collectives). Applications should use
    /// [`Tag::user`]: messages on system tags can be consumed by the library.
    pub const fn system(tag: u64) -> Tag {
        Tag(Self::SYSTEM_BIT | (tag & !Self::SYSTEM_BIT))
    }

    /// Whether this tag is in the reserved half.
    pub const fn is_system(self) -> bool {
        self.0 & Self::SYSTEM_BIT != 0
    }

    /// The tag as it travels on the wire.
    pub const fn to_wire(self) -> u64 {
        self.0
    }

    /// A tag read from the wire.
    pub const fn from_wire(raw: u64) -> Tag {
        Tag(raw)
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_system() {
            write!(f, "system:{:#x}", self.0 & !Self::SYSTEM_BIT)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// Point-to-point messaging and a barrier among the ranks of one job.
///
/// Every method that waits has a deadline: the backend's configured default timeout, or the one
/// passed to a `*_timeout` method. A peer that has died is reported as
/// [`DistError::PeerGone`](crate::DistError::PeerGone) as soon as the backend notices, not after
/// the timeout.
///
/// Implementations are `Send + Sync`: several threads may send and receive at once, as long as
/// two of them do not receive on the same `(peer, tag)` concurrently expecting a particular order.
pub trait Backend: Send + Sync {
    /// This process's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the job.
    fn world_size(&self) -> usize;

    /// The deadline used by the methods that take none.
    fn default_timeout(&self) -> Duration;

    /// Sends `data` to `dst` on `tag`. Returns once the data has been handed to the transport (it
    /// may not have arrived yet); the message is delivered in order with the others on that tag.
    fn send_tagged(&self, data: &[u8], dst: usize, tag: Tag) -> Result<()>;

    /// Receives the next message from `src` on `tag` into `buf`, waiting at most `timeout`.
    ///
    /// The message must be exactly `buf.len()` bytes long; otherwise the result is
    /// [`DistError::SizeMismatch`](crate::DistError::SizeMismatch), `buf` is left untouched, and
    /// the message stays queued so that a receive with the right size can still take it.
    fn recv_tagged_timeout(
        &self,
        buf: &mut [u8],
        src: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<()>;

    /// Blocks until every rank has entered the barrier, or `timeout` has passed.
    fn barrier_timeout(&self, timeout: Duration) -> Result<()>;

    /// Sends `data` to `dst` on [`Tag::DEFAULT`].
    fn send(&self, data: &[u8], dst: usize) -> Result<()> {
        self.send_tagged(data, dst, Tag::DEFAULT)
    }

    /// Receives from `src` on [`Tag::DEFAULT`] with the default timeout.
    fn recv(&self, buf: &mut [u8], src: usize) -> Result<()> {
        self.recv_tagged_timeout(buf, src, Tag::DEFAULT, self.default_timeout())
    }

    /// Receives from `src` on [`Tag::DEFAULT`], waiting at most `timeout`.
    fn recv_timeout(&self, buf: &mut [u8], src: usize, timeout: Duration) -> Result<()> {
        self.recv_tagged_timeout(buf, src, Tag::DEFAULT, timeout)
    }

    /// Receives from `src` on `tag` with the default timeout.
    fn recv_tagged(&self, buf: &mut [u8], src: usize, tag: Tag) -> Result<()> {
        self.recv_tagged_timeout(buf, src, tag, self.default_timeout())
    }

    /// Blocks until every rank has entered the barrier, with the default timeout.
    fn barrier(&self) -> Result<()> {
        self.barrier_timeout(self.default_timeout())
    }
}

/// Sixteen bytes a transport carries beside each message for the layer above; the collectives
/// put their call descriptor there.
pub type Meta = [u8; 16];

/// What the collectives need from a backend that moves bytes: messages with a [`Meta`] beside
/// them, a send overlapped with a receive, and a way to tell every rank that an operation
/// failed. Every backend that implements it gets all of [`Collectives`](crate::Collectives).
pub trait Transport: Backend {
    /// Sends `data` to `dst` on `tag`, with `meta` for the receiver.
    fn send_meta(&self, data: &[u8], dst: usize, tag: Tag, meta: Meta) -> Result<()>;

    /// Receives the next message from `src` on `tag` into `buf` by `deadline`; returns its meta.
    /// A message of another length is a `SizeMismatch` and stays queued.
    fn recv_meta(&self, buf: &mut [u8], src: usize, tag: Tag, deadline: Instant) -> Result<Meta>;

    /// Sends `send.0` to rank `send.1` while receiving into `recv.0` from rank `recv.1`, both on
    /// `tag`; the two transfers proceed at once. Returns the received message's meta.
    fn send_recv_meta(
        &self,
        send: (&[u8], usize),
        recv: (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
    ) -> Result<Meta> {
        self.send_recv_meta_while(send, recv, tag, meta, deadline, &mut || Ok(()))
    }

    /// [`Transport::send_recv_meta`], also running `meanwhile` once (unless the call fails
    /// first), while the two transfers are in flight where the transport can (else before or
    /// after them). `meanwhile` must touch neither buffer; its error ends the call. The ring
    /// collectives reduce one piece while the next one travels.
    fn send_recv_meta_while(
        &self,
        send: (&[u8], usize),
        recv: (&mut [u8], usize),
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        meanwhile: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Meta>;

    /// The length and meta of the next message queued from `src` on `tag`, if one is queued.
    fn peek_meta(&self, src: usize, tag: Tag) -> Option<(usize, Meta)>;

    /// Tells every other rank that this rank's operation on `tag` failed with `reason`. From
    /// then on their waits on system tags fail with [`DistError::Aborted`](crate::DistError).
    fn broadcast_abort(&self, tag: Tag, reason: &str);

    /// [`Transport::broadcast_abort`] for a failure caused by rank `culprit` (a peer that died,
    /// went silent, or failed first): the other ranks' errors then name it as the origin,
    /// rather than this rank, which only noticed. The default ignores `culprit`.
    fn broadcast_abort_naming(&self, tag: Tag, reason: &str, culprit: Option<usize>) {
        let _ = culprit;
        self.broadcast_abort(tag, reason);
    }

    /// The transport's flight recorder, if it keeps one: the collectives record themselves in it.
    fn flight(&self) -> Option<&crate::flight::FlightRecorder> {
        None
    }

    /// Where every rank is, in one line ([`crate::flight::describe_positions`]), as far as
    /// this transport knows; for the errors of timed-out collectives.
    fn positions(&self) -> Option<String> {
        None
    }

    /// The first abort notice received, as `(rank, reason)`.
    fn abort_notice(&self) -> Option<(usize, String)>;

    /// A number that increases by one with each collective this rank starts.
    fn next_collective(&self) -> u64;

    /// The largest piece, in bytes, a ring step moves in one message. Small pieces keep the
    /// received data in cache until it is reduced; transports whose sends and receives run on
    /// separate cores may prefer larger ones.
    fn ring_piece(&self) -> usize {
        crate::collectives::RING_PIECE
    }

    /// Runs `first` on this thread and `second` on another at once, and returns once both have
    /// run. This default starts a thread for the call (and, if none can be started, runs the
    /// two one after the other); transports that offer [`Transport::lanes`] keep one ready.
    fn run_beside(&self, first: &mut dyn FnMut(), second: &mut (dyn FnMut() + Send)) {
        run_beside_scoped(first, second);
    }

    /// How many rings (or chains) a large all_reduce, reduce_scatter, all_gather or broadcast
    /// may run at once, each on its own thread (1 or 2).
    /// Every rank of a job must answer the same: it decides how messages are cut.
    fn lanes(&self) -> usize {
        1
    }
}

/// [`Transport::run_beside`] on a thread started for the call.
pub fn run_beside_scoped(first: &mut dyn FnMut(), second: &mut (dyn FnMut() + Send)) {
    // `second` waits in a slot, so that it is still here if its thread cannot start.
    let slot = std::sync::Mutex::new(Some(second));
    let take = || slot.lock().ok().and_then(|mut s| s.take());
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new()
            .name("dist-beside".into())
            .spawn_scoped(s, || {
                if let Some(f) = take() {
                    f();
                }
            });
        first();
        if let Ok(h) = spawned
            && let Err(panic) = h.join()
        {
            std::panic::resume_unwind(panic);
        }
    });
    if let Some(f) = take() {
        f();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_and_system_tags_never_collide() {
        assert!(!Tag::user(u32::MAX).is_system());
        assert!(Tag::system(0).is_system());
        assert_ne!(Tag::user(5).to_wire(), Tag::system(5).to_wire());
        assert_eq!(Tag::from_wire(Tag::system(9).to_wire()), Tag::system(9));
        assert_eq!(Tag::user(3).to_string(), "3");
        assert_eq!(Tag::system(3).to_string(), "system:0x3");
    }

    #[test]
    fn run_beside_runs_both_at_once() {
        // Each side waits for the other to have started: only concurrent runs finish.
        let (a, b) = (
            std::sync::atomic::AtomicBool::new(false),
            std::sync::atomic::AtomicBool::new(false),
        );
        let wait_for = |x: &std::sync::atomic::AtomicBool| {
            let t = std::time::Instant::now();
            while !x.load(std::sync::atomic::Ordering::Acquire) {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the other side never ran"
                );
                std::hint::spin_loop();
            }
        };
        run_beside_scoped(
            &mut || {
                a.store(true, std::sync::atomic::Ordering::Release);
                wait_for(&b);
            },
            &mut || {
                b.store(true, std::sync::atomic::Ordering::Release);
                wait_for(&a);
            },
        );
    }

    #[test]
    fn backend_is_object_safe() {
        fn takes(_: Option<&dyn Backend>) {}
        takes(None);
    }
}

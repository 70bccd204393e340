//! The `Backend` trait: point-to-point messages and a barrier among `world_size` ranks.

use std::time::Duration;

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

/// Sixteen bytes a link carries beside each message for the layer above; the collectives put
/// their call descriptor there.
pub type Meta = [u8; 16];

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
    fn backend_is_object_safe() {
        fn takes(_: Option<&dyn Backend>) {}
        takes(None);
    }
}

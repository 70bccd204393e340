//! The `Link` trait: what a group of ranks needs from a transport to run the collectives. A
//! link only moves bytes (a message with a [`Meta`] beside it, a receive posted ahead of its
//! message, a look at what is queued) and carries abort notices; the collectives' state (their
//! sequence, whether they failed, how they cut messages, their second thread) lives in the
//! [`Group`](crate::Group) that owns the link.

use std::time::Instant;

use crate::arena::HostArena;
use crate::backend::{Meta, Tag};
use crate::error::Result;
use crate::flight::FlightRecorder;

/// Moves bytes between the ranks of one job, for a [`Group`](crate::Group).
///
/// Messages from one rank to another on one tag arrive in the order they were sent; messages
/// on different tags may overtake each other. Every wait ends by its deadline.
pub trait Link: Send + Sync {
    /// A receive posted with [`Link::post`], to wait on.
    type Recv<'a>: PostedRecv
    where
        Self: 'a;

    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// Sends `data` to `dst` on `tag`, with `meta` for the receiver, by `deadline`. `beside` is
    /// a receive this thread posted and will wait on next: a link may move its bytes while the
    /// send waits for room (so that one thread keeps both directions going).
    fn send(
        &self,
        data: &[u8],
        dst: usize,
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        beside: Option<&Self::Recv<'_>>,
    ) -> Result<()>;

    /// Posts a receive of the next message from `src` on `tag` into `buf`; the message may
    /// land in `buf` from then on, while this thread does other work, until the handle is
    /// waited on or dropped (dropping it withdraws the receive). A message of another length
    /// is a [`DistError::SizeMismatch`](crate::DistError::SizeMismatch) when waited on, and
    /// stays queued. Waits on system tags fail with
    /// [`DistError::Aborted`](crate::DistError::Aborted) once an abort notice has come.
    /// Errors at once only for a bad argument (`src` out of range).
    ///
    /// # Safety
    ///
    /// The handle must be waited on or dropped: it must not be leaked (`mem::forget`, a
    /// reference cycle), since the link may write into `buf` for as long as the receive is
    /// posted, and only the handle's end withdraws it.
    unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        src: usize,
        tag: Tag,
        deadline: Instant,
    ) -> Result<Self::Recv<'a>>;

    /// The length and meta of the next message queued from `src` on `tag`, if one has arrived
    /// that no receive has taken (after a size mismatch, the message that did not fit).
    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)>;

    /// Tells every other rank that this rank's operation on `tag` failed with `reason`, caused
    /// by rank `culprit` where one is known (a peer that died, went silent, or failed first),
    /// and remembers it here as well: from then on waits on system tags fail with
    /// [`DistError::Aborted`](crate::DistError::Aborted), here and wherever the notice arrives.
    fn abort(&self, tag: Tag, reason: &str, culprit: Option<usize>);

    /// The first abort notice this rank has (received, or its own), as `(origin, reason)`:
    /// the origin is the culprit the notice names, else the rank that sent it.
    fn abort_notice(&self) -> Option<(usize, String)>;

    /// The link's flight recorder, if it keeps one: the collectives record themselves in it.
    fn flight(&self) -> Option<&FlightRecorder> {
        None
    }

    /// Where every rank is, in one line ([`crate::flight::describe_positions`]), as far as this
    /// link knows; for the errors of timed-out collectives.
    fn positions(&self) -> Option<String> {
        None
    }

    /// The memory this rank shares with the other ranks of its host, if the link offers it
    /// ([`HostArena`]). Every rank of one link must answer alike (all `Some` or all `None`):
    /// the group then agrees, on its first all_reduce, whether to use it.
    fn arena(&self) -> Option<&dyn HostArena> {
        None
    }
}

/// A receive posted with [`Link::post`].
pub trait PostedRecv {
    /// Waits for the message (until the deadline given to [`Link::post`]) and returns its meta.
    fn wait(self) -> Result<Meta>;
}

impl<L: Link + ?Sized> Link for std::sync::Arc<L> {
    type Recv<'a>
        = L::Recv<'a>
    where
        Self: 'a;

    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn send(
        &self,
        data: &[u8],
        dst: usize,
        tag: Tag,
        meta: Meta,
        deadline: Instant,
        beside: Option<&Self::Recv<'_>>,
    ) -> Result<()> {
        (**self).send(data, dst, tag, meta, deadline, beside)
    }

    unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        src: usize,
        tag: Tag,
        deadline: Instant,
    ) -> Result<Self::Recv<'a>> {
        // SAFETY: the caller's obligation (not leaking the handle) is passed on unchanged.
        unsafe { (**self).post(buf, src, tag, deadline) }
    }

    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        (**self).peek(src, tag)
    }

    fn abort(&self, tag: Tag, reason: &str, culprit: Option<usize>) {
        (**self).abort(tag, reason, culprit)
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        (**self).abort_notice()
    }

    fn flight(&self) -> Option<&FlightRecorder> {
        (**self).flight()
    }

    fn positions(&self) -> Option<String> {
        (**self).positions()
    }

    fn arena(&self) -> Option<&dyn HostArena> {
        (**self).arena()
    }
}

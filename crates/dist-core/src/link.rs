//! The `Link` trait: what a group of ranks needs from a transport to run the collectives. A
//! link only moves bytes (a message with a [`Meta`] beside it, a receive posted ahead of its
//! message, a look at what is queued) and carries abort notices; the collectives' state (their
//! sequence, whether they failed, how they cut messages, their second thread) lives in the
//! [`Group`](crate::Group) that owns the link.

use std::time::Instant;

use crate::arena::HostArena;
use crate::backend::{Meta, Tag};
use crate::error::{DistError, Result};
use crate::flight::FlightRecorder;
use crate::subgroup::GROUP_ID_BITS;

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
    /// [`DistError::Aborted`](crate::DistError::Aborted), here and wherever the notice arrives,
    /// except where [`notice_ends`] says the notice names a later call.
    ///
    /// `call` is the number of the collective call of `tag`'s group that failed, given only
    /// when the sender has done its part of every earlier call of that group (its own failure
    /// in that call, or such a notice passed on); a rank still in an earlier call then finishes
    /// it and fails at that one. `None` (a peer died or went silent, which may have left an
    /// earlier call undone) ends every wait.
    fn abort(&self, tag: Tag, call: Option<u64>, reason: &str, culprit: Option<usize>);

    /// [`Link::abort`] passing on an abort heard of whose first failure was rank `origin`'s own
    /// call (a timeout, a mismatch), not a rank known failed: the other ranks' errors name
    /// `origin`, but their notices name no rank at fault. A link that keeps no such
    /// distinction names `origin` at fault (the default).
    fn pass_on_abort(&self, tag: Tag, call: Option<u64>, reason: &str, origin: usize) {
        self.abort(tag, call, reason, Some(origin))
    }

    /// The first abort notice this rank has (received, or its own), as `(origin, reason)`:
    /// the origin is the culprit the notice names, else the rank that sent it.
    fn abort_notice(&self) -> Option<(usize, String)>;

    /// The first abort notice that ends call number `call` of `tag`'s group ([`notice_ends`]),
    /// with the call it names where that is a call of `tag`'s group (a notice of another group
    /// says `None`). A link that keeps no call numbers answers with its first notice, which
    /// ends everything.
    fn abort_notice_for(&self, tag: Tag, call: u64) -> Option<Notice> {
        let _ = (tag, call);
        self.abort_notice().map(|(origin, reason)| Notice {
            origin,
            culprit: None,
            reason,
            call: None,
        })
    }

    /// This rank's collectives of `tag`'s group are in their call number `call` from now on:
    /// the link's waits on that group's system tags fail only for notices that end that call
    /// ([`notice_ends`]). A link that ignores this ends them on any notice.
    fn enter_call(&self, tag: Tag, call: u64) {
        let _ = (tag, call);
    }

    /// Takes the link (and every clone of it: they share its tags) for one
    /// [`Group`](crate::Group): true if no group holds it, false while one does. Released by
    /// [`Link::release_group`] when that group is dropped. A link that keeps no such mark
    /// answers true, and then must not carry two groups at once. A link that wraps another
    /// forwards both methods (or keeps a mark of its own, as a sub-group's link does).
    fn claim_group(&self) -> bool {
        true
    }

    /// Gives back what [`Link::claim_group`] took.
    fn release_group(&self) {}

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

    /// An error of a call of this link's group, said the way the layer above wants it: a
    /// sub-group's link ([`SubLink`](crate::SubLink)) names the group and gives the backend
    /// ranks beside its own. The collectives pass every error they return through it. The same
    /// error by default.
    fn label_error(&self, e: DistError) -> DistError {
        e
    }
}

/// An abort notice as the collectives read it ([`Link::abort_notice_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    /// The rank the failure is due to: the culprit the notice names, else its sender.
    pub origin: usize,
    /// The rank the notice names at fault (known failed: it died, went silent, or was named),
    /// where it names one: then `origin` too.
    pub culprit: Option<usize>,
    /// Its error.
    pub reason: String,
    /// The call it failed, where it names one of the group asked about ([`Link::abort`]).
    pub call: Option<u64>,
}

/// The call a notice sent on `notice_tag` naming `notice_call` names in `tag`'s group: its
/// own where both tags are one group's, else none.
pub fn call_in_group(notice_tag: Tag, notice_call: Option<u64>, tag: Tag) -> Option<u64> {
    notice_call.filter(|_| same_group(notice_tag, tag))
}

/// Whether an abort notice sent on `notice_tag` naming call `notice_call` of that tag's group
/// ends a wait on `tag` while `tag`'s group is in call `current` (where known).
///
/// It does unless both calls are known, the two tags belong to one group (the same sub-group
/// id bits, [`GROUP_ID_BITS`]) and the notice names a later call: its sender has done its part
/// of every earlier call, so the waiting rank can finish the one it is in, and fails at the
/// call the notice names.
pub fn notice_ends(
    notice_tag: Tag,
    notice_call: Option<u64>,
    tag: Tag,
    current: Option<u64>,
) -> bool {
    match (notice_call, current) {
        (Some(failed), Some(now)) if same_group(notice_tag, tag) => failed <= now,
        _ => true,
    }
}

/// Whether two system tags belong to one group (root or sub-group).
fn same_group(a: Tag, b: Tag) -> bool {
    a.is_system() && b.is_system() && a.to_wire() & GROUP_ID_BITS == b.to_wire() & GROUP_ID_BITS
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
        // (Tests: every collective over an `Arc`-held link, `collectives::tests`.)
        unsafe { (**self).post(buf, src, tag, deadline) }
    }

    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        (**self).peek(src, tag)
    }

    fn abort(&self, tag: Tag, call: Option<u64>, reason: &str, culprit: Option<usize>) {
        (**self).abort(tag, call, reason, culprit)
    }

    fn pass_on_abort(&self, tag: Tag, call: Option<u64>, reason: &str, origin: usize) {
        (**self).pass_on_abort(tag, call, reason, origin)
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        (**self).abort_notice()
    }

    fn abort_notice_for(&self, tag: Tag, call: u64) -> Option<Notice> {
        (**self).abort_notice_for(tag, call)
    }

    fn enter_call(&self, tag: Tag, call: u64) {
        (**self).enter_call(tag, call)
    }

    fn claim_group(&self) -> bool {
        (**self).claim_group()
    }

    fn release_group(&self) {
        (**self).release_group()
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

    fn label_error(&self, e: DistError) -> DistError {
        (**self).label_error(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A notice ends a wait unless it names a later call of the same group than the one the
    /// waiting rank is in.
    #[test]
    fn a_notice_ends_its_call_and_later_ones_of_its_group_only() {
        let root = Tag::system(2);
        let second = Tag::system(3);
        let sub = Tag::from_wire(root.to_wire() | (5 << 32));
        // Names call 4: rank in call 3 of that group finishes it (either of its tags).
        assert!(!notice_ends(root, Some(4), root, Some(3)));
        assert!(!notice_ends(root, Some(4), second, Some(3)));
        // Call 4 itself, and later ones, end.
        assert!(notice_ends(root, Some(4), root, Some(4)));
        assert!(notice_ends(root, Some(4), second, Some(9)));
        // No call named, or the wait's call unknown: ends.
        assert!(notice_ends(root, None, root, Some(1)));
        assert!(notice_ends(root, Some(4), root, None));
        // Another group's notice ends every wait here, whatever the numbers.
        assert!(notice_ends(sub, Some(4), root, Some(1)));
        assert!(notice_ends(root, Some(4), sub, Some(1)));
        // A user tag is no group's.
        assert!(notice_ends(Tag::user(2), Some(4), Tag::user(2), Some(1)));
    }
}

//! [`SubLink`]: a sub-group's view of its root link. Ranks are renumbered (group rank `r` is
//! link rank `members[r]`), every tag carries the group's id in bits 32–62, and errors name
//! group ranks.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use crate::backend::{Meta, Tag};
use crate::error::{DistError, Result};
use crate::flight::FlightRecorder;
use crate::link::{Link, PostedRecv};

/// The bits of a tag's wire form that carry a sub-group's id (bits 32–62): user tags
/// ([`Tag::user`]) and dist's own system tags leave them clear.
pub const GROUP_ID_BITS: u64 = ((1 << 31) - 1) << 32;

/// The largest group id (ids are 31 bits; 0 is the root link itself).
pub const MAX_GROUP_ID: u64 = (1 << 31) - 1;

/// How many operations a sub-group's own flight recorder keeps.
const SUB_FLIGHT_CAPACITY: usize = 256;

/// The sub-groups alive in this process: each as its root link (the address of the root's
/// flight recorder, which every clone of one root shares and which lives as long as any clone
/// does, so as long as the group) and its id.
static LIVE: Mutex<BTreeSet<(usize, u32)>> = Mutex::new(BTreeSet::new());

/// A group id marked live over one root link until this is dropped (with its [`SubLink`]).
#[derive(Debug)]
pub(crate) struct LiveId(Option<(usize, u32)>);

impl LiveId {
    /// Marks `id` live over `root`; `None` if a group over `root` has it already. A root link
    /// without a flight recorder cannot be told apart from other roots: nothing is marked for
    /// it, and its groups' ids get only the check that their leader can have minted them.
    pub(crate) fn reserve<R: Link>(root: &R, id: u32) -> Option<LiveId> {
        let Some(f) = root.flight() else {
            return Some(LiveId(None));
        };
        let key = (std::ptr::from_ref(f) as usize, id);
        // Not `then_some`: a `LiveId` made and dropped here would take the lock again.
        let fresh = LIVE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key);
        fresh.then(|| LiveId(Some(key)))
    }
}

impl Drop for LiveId {
    fn drop(&mut self) {
        if let Some(key) = self.0 {
            LIVE.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&key);
        }
    }
}

/// A link whose groups can be split into sub-groups ([`Subgroups`](crate::Subgroups)): a
/// transport's own link (the root), or a [`SubLink`] of one. Every sub-group, however deeply
/// nested, is a [`SubLink`] straight over the root, so they all have one type.
pub trait SplitLink: Link {
    /// The transport's own link, which every sub-group shares (cloning it shares its
    /// connections: no new ones are made).
    type Root: Link + Clone;

    /// The root link under this one (itself, for a root link).
    fn root_link(&self) -> &Self::Root;

    /// The rank of the root link that is this link's rank `r` (`r < world_size()`).
    fn root_rank(&self, r: usize) -> usize;
}

impl<L: Link + ?Sized> SplitLink for std::sync::Arc<L> {
    type Root = std::sync::Arc<L>;

    fn root_link(&self) -> &Self::Root {
        self
    }

    fn root_rank(&self, r: usize) -> usize {
        r
    }
}

impl SplitLink for crate::testing::MemLink {
    type Root = crate::testing::MemLink;

    fn root_link(&self) -> &Self::Root {
        self
    }

    fn root_rank(&self, r: usize) -> usize {
        r
    }
}

/// The link of a sub-group: some ranks of a root link `R`, renumbered from 0, with tags of
/// their own. It shares the root's connections; its group id (equal on every member, distinct
/// among all groups any one rank belongs to) goes into bits 32–62 of every tag
/// ([`GROUP_ID_BITS`]), so messages of two groups that share ranks never meet.
///
/// Errors name group ranks (their `rank`, `peer` and `origin`), and their operation says which
/// group it is (its name, given at [`Subgroups::split_named`](crate::Subgroups::split_named) or
/// [`Subgroups::new_group_named`](crate::Subgroups::new_group_named), else its id) and the
/// backend rank of each group rank it names:
/// `all_reduce(f32 x 4, sum) in group "tensor" (rank 1 of 2 = backend rank 3; peer 0 = backend rank 2)`. An abort notice of the root link (a failure in this
/// group, in another group, or on the root's own collectives) aborts every group over it: see
/// [`SubLink::abort`].
///
/// The sub-group's collectives are recorded in a flight recorder of its own (the root's
/// record, and the positions its heartbeats report, stay the root group's).
pub struct SubLink<R: Link> {
    root: R,
    id: u32,
    /// `members[r]`: the root rank of group rank `r`.
    members: Vec<usize>,
    me: usize,
    /// The name errors give the group, if the caller gave one.
    name: Option<String>,
    flight: FlightRecorder,
    /// A group runs over this link ([`Link::claim_group`]).
    group_claimed: std::sync::atomic::AtomicBool,
    /// Its id, marked live over the root while the link lives.
    _live: LiveId,
}

impl<R: Link> std::fmt::Debug for SubLink<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubLink")
            .field("id", &self.id)
            .field("rank", &self.me)
            .field("members", &self.members)
            .finish()
    }
}

impl<R: Link> SubLink<R> {
    /// The group of the root ranks `members` (group rank `r` is `members[r]`), as rank `me`,
    /// with id `id`. Checked: the members are distinct ranks of the root, `me` is one of them,
    /// the id is in `1..=MAX_GROUP_ID` and no live group over the root has it.
    #[cfg(test)]
    pub(crate) fn new(root: R, id: u32, members: Vec<usize>, me: usize) -> Result<SubLink<R>> {
        let live = LiveId::reserve(&root, id).ok_or_else(|| DistError::InvalidArgument {
            rank: root.rank(),
            op: "form a sub-group".into(),
            reason: format!("group id {id:#x} is in use by a live group over this link"),
        })?;
        SubLink::reserved(root, id, live, members, me)
    }

    /// [`SubLink::new`] with its id already marked live (`live`).
    pub(crate) fn reserved(
        root: R,
        id: u32,
        live: LiveId,
        members: Vec<usize>,
        me: usize,
    ) -> Result<SubLink<R>> {
        let bad = |reason: String| DistError::InvalidArgument {
            rank: root.rank(),
            op: "form a sub-group".into(),
            reason,
        };
        if id == 0 || u64::from(id) > MAX_GROUP_ID {
            return Err(bad(format!("group id {id} is outside 1..={MAX_GROUP_ID}")));
        }
        let mut seen = vec![false; root.world_size()];
        for &m in &members {
            match seen.get_mut(m) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(bad(format!("link rank {m} is in it twice"))),
                None => return Err(bad(format!("link rank {m} is out of range"))),
            }
        }
        if members.get(me) != Some(&root.rank()) {
            return Err(bad(format!(
                "its rank {me} is not this rank ({}) of the link",
                root.rank()
            )));
        }
        Ok(SubLink {
            root,
            id,
            members,
            me,
            name: None,
            flight: FlightRecorder::new(SUB_FLIGHT_CAPACITY),
            group_claimed: std::sync::atomic::AtomicBool::new(false),
            _live: live,
        })
    }

    /// The group's id, as its tags carry it.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The link named `name` in its errors (or by its id, for `None`).
    pub(crate) fn named(mut self, name: Option<&str>) -> SubLink<R> {
        self.name = name.map(str::to_owned);
        self
    }

    /// The name given at [`Subgroups::split_named`](crate::Subgroups::split_named) or
    /// [`Subgroups::new_group_named`](crate::Subgroups::new_group_named), if one was.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The group as its errors name it: its name in quotes (`"tensor"`, escaped as Rust
    /// escapes a string), else its id (`0x9`).
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("{n:?}"),
            None => format!("{:#x}", self.id),
        }
    }

    /// The root ranks of the group's ranks: `members()[r]` is group rank `r`.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The group rank of root rank `p`, if it is a member.
    pub fn group_rank(&self, p: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == p)
    }

    /// `tag` with this group's id in it; an error if the tag already uses those bits.
    fn tag(&self, tag: Tag, op: impl FnOnce() -> String) -> Result<Tag> {
        let raw = tag.to_wire();
        if raw & GROUP_ID_BITS != 0 {
            return Err(self.label_in_group(DistError::InvalidArgument {
                rank: self.me,
                op: op(),
                reason: format!(
                    "tag {tag} uses bits 32-62, which carry sub-group ids: use Tag::user(u32)"
                ),
            }));
        }
        Ok(Tag::from_wire(raw | (u64::from(self.id) << 32)))
    }

    fn check_rank(&self, r: usize, op: impl FnOnce() -> String) -> Result<usize> {
        self.members.get(r).copied().ok_or_else(|| {
            self.label_in_group(DistError::InvalidRank {
                rank: self.me,
                op: op(),
                given: r,
                world_size: self.members.len(),
            })
        })
    }

    /// Which group this is, for the operation of an error: its label, this rank's group and
    /// backend rank, and the backend rank of `other` (a group rank the error names, with the
    /// word the error uses for it: "peer", "rank").
    fn context(&self, other: Option<(&str, usize)>) -> String {
        let mut s = format!(
            "in group {} (rank {} of {} = backend rank {}",
            self.label(),
            self.me,
            self.members.len(),
            self.members[self.me]
        );
        if let Some((word, r)) = other
            && let Some(b) = self.members.get(r)
        {
            s.push_str(&format!("; {word} {r} = backend rank {b}"));
        }
        s.push(')');
        s
    }

    /// A root abort's origin as a group rank, or, for one outside the group, its root rank with
    /// the reason saying so ([`DistError::OUTSIDE_GROUP`]).
    fn origin(&self, origin: usize, reason: String) -> (usize, String) {
        match self.group_rank(origin) {
            Some(r) => (r, reason),
            None if reason.starts_with(DistError::OUTSIDE_GROUP) => (origin, reason),
            None => (origin, format!("{}{reason}", DistError::OUTSIDE_GROUP)),
        }
    }

    /// A failure `e` (in this group's ranks) names in the root's ranks, where it names one: a
    /// peer gone or silent, or an abort's origin and culprit.
    fn in_root_ranks(&self, e: &DistError) -> Option<DistError> {
        let root = |r: usize| self.members.get(r).copied().unwrap_or(r);
        Some(match e {
            DistError::PeerGone {
                rank,
                peer,
                op,
                cause,
            } => DistError::PeerGone {
                rank: root(*rank),
                peer: root(*peer),
                op: op.clone(),
                cause: cause.clone(),
            },
            DistError::PeerUnresponsive {
                rank,
                peer,
                op,
                silent,
                position,
            } => DistError::PeerUnresponsive {
                rank: root(*rank),
                peer: root(*peer),
                op: op.clone(),
                silent: *silent,
                position: position.clone(),
            },
            DistError::Aborted {
                rank,
                op,
                origin,
                culprit,
                reason,
            } => match reason.strip_prefix(DistError::OUTSIDE_GROUP) {
                Some(r) => DistError::Aborted {
                    rank: root(*rank),
                    op: op.clone(),
                    origin: *origin,
                    culprit: *culprit,
                    reason: r.to_string(),
                },
                None => DistError::Aborted {
                    rank: root(*rank),
                    op: op.clone(),
                    origin: root(*origin),
                    culprit: culprit.map(root),
                    reason: reason.clone(),
                },
            },
            _ => return None,
        })
    }

    /// `e`, an error in this group's ranks, with its operation naming the group and the
    /// backend ranks of the group ranks it names (unless it does already).
    fn label_in_group(&self, e: DistError) -> DistError {
        let other = match &e {
            DistError::Timeout { peer, .. }
            | DistError::PeerGone { peer, .. }
            | DistError::PeerUnresponsive { peer, .. }
            | DistError::SizeMismatch { peer, .. }
            | DistError::CollectiveMismatch { peer, .. } => Some(("peer", *peer)),
            DistError::Aborted { origin, reason, .. }
                if !reason.starts_with(DistError::OUTSIDE_GROUP) =>
            {
                Some(("rank", *origin))
            }
            _ => None,
        };
        let context = self.context(other);
        let mark = format!("in group {} (", self.label());
        e.map_op(|op| {
            if op.contains(&mark) {
                op.to_string()
            } else {
                format!("{op} {context}")
            }
        })
    }

    /// An error of the root link, said in this group's ranks, its operation `what` (this
    /// group's call, in group ranks and the caller's tag) and which group.
    fn to_group(&self, e: DistError, what: &str) -> DistError {
        let me = self.me;
        let peer_of = |p: usize| self.group_rank(p).unwrap_or(p);
        let op = |_root_op: String| what.to_string();
        let e = match e {
            DistError::Timeout {
                op: o,
                peer,
                waited,
                ..
            } => DistError::Timeout {
                rank: me,
                op: op(o),
                peer: peer_of(peer),
                waited,
            },
            DistError::PeerGone {
                peer, op: o, cause, ..
            } => DistError::PeerGone {
                rank: me,
                peer: peer_of(peer),
                op: op(o),
                cause,
            },
            DistError::PeerUnresponsive {
                peer,
                op: o,
                silent,
                position,
                ..
            } => DistError::PeerUnresponsive {
                rank: me,
                peer: peer_of(peer),
                op: op(o),
                silent,
                position,
            },
            DistError::SizeMismatch {
                peer,
                op: o,
                expected,
                got,
                ..
            } => DistError::SizeMismatch {
                rank: me,
                peer: peer_of(peer),
                op: op(o),
                expected,
                got,
            },
            DistError::CollectiveMismatch {
                op: o,
                peer,
                detail,
                ..
            } => DistError::CollectiveMismatch {
                rank: me,
                op: op(o),
                peer: peer_of(peer),
                detail,
            },
            DistError::Aborted {
                op: o,
                origin,
                culprit,
                reason,
                ..
            } => {
                let (origin, reason) = self.origin(origin, reason);
                DistError::Aborted {
                    rank: me,
                    op: op(o),
                    origin,
                    culprit: culprit.map(|_| origin),
                    reason,
                }
            }
            DistError::InvalidArgument { op: o, reason, .. } => DistError::InvalidArgument {
                rank: me,
                op: op(o),
                reason,
            },
            other => other.map_op(|o| op(o.to_string())),
        };
        self.label_in_group(e)
    }
}

/// A receive posted on a [`SubLink`]: the root link's, with its errors said in group ranks.
pub struct SubRecv<'a, R: Link> {
    inner: R::Recv<'a>,
    link: &'a SubLink<R>,
    /// The group rank, tag and length posted, for the errors.
    src: usize,
    tag: Tag,
    len: usize,
}

impl<'a, R: Link + 'a> std::fmt::Debug for SubRecv<'a, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubRecv")
            .field("group", &self.link.id)
            .finish_non_exhaustive()
    }
}

impl<'a, R: Link + 'a> PostedRecv for SubRecv<'a, R> {
    fn wait(self) -> Result<Meta> {
        let link = self.link;
        let (src, tag, len) = (self.src, self.tag, self.len);
        self.inner
            .wait()
            .map_err(|e| link.to_group(e, &format!("recv from {src} (tag {tag}, {len} bytes)")))
    }
}

impl<R: Link> Link for SubLink<R> {
    type Recv<'a>
        = SubRecv<'a, R>
    where
        Self: 'a;

    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
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
        let op = || format!("send to {dst} (tag {tag}, {} bytes)", data.len());
        let to = self.check_rank(dst, op)?;
        let wire = self.tag(tag, op)?;
        self.root
            .send(data, to, wire, meta, deadline, beside.map(|b| &b.inner))
            .map_err(|e| self.to_group(e, &op()))
    }

    unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        src: usize,
        tag: Tag,
        deadline: Instant,
    ) -> Result<Self::Recv<'a>> {
        let len = buf.len();
        let op = || format!("recv from {src} (tag {tag}, {len} bytes)");
        let from = self.check_rank(src, op)?;
        let wire = self.tag(tag, op)?;
        // SAFETY: the root's handle lives inside the returned `SubRecv`, which has no other
        // way to end than its wait or its drop (which drops the root's handle); the caller's
        // obligation not to leak the `SubRecv` is the root's, passed on unchanged. (Tests:
        // `subgroup::tests` over `MemLink`, multirank `groups_*` over TCP.)
        let inner = unsafe { self.root.post(buf, from, wire, deadline) }
            .map_err(|e| self.to_group(e, &op()))?;
        Ok(SubRecv {
            inner,
            link: self,
            src,
            tag,
            len,
        })
    }

    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        let from = *self.members.get(src)?;
        let wire = self.tag(tag, String::new).ok()?;
        self.root.peek(from, wire)
    }

    /// Aborts the root link as a whole: every group over it, the root's own collectives
    /// included, fails from then on, on every rank of the link (the rule of the root: after a
    /// failure its collectives stay aborted). An abort the root already has that ends `call`
    /// (any, where `call` is `None`) is passed on as it came: its origin in link ranks, the call
    /// of this group it names, if any. Otherwise the failure is this rank's own: `culprit`, a
    /// group rank, is mapped to its link rank, the reason names this group, and `call` goes
    /// with it.
    fn abort(&self, tag: Tag, call: Option<u64>, reason: &str, culprit: Option<usize>) {
        let wire = self.tag(tag, String::new).unwrap_or(tag);
        let heard = match call {
            Some(c) => self.root.abort_notice_for(wire, c),
            // The first notice (every notice ends a wait in the last call there could be).
            None => self
                .root
                .abort_notice_for(wire, u64::MAX)
                .map(|n| crate::link::Notice { call: None, ..n }),
        };
        match heard {
            // Passed on naming at fault only the rank the first notice did.
            Some(n) => match n.culprit {
                Some(c) => self.root.abort(wire, n.call, &n.reason, Some(c)),
                None => self.root.pass_on_abort(wire, n.call, &n.reason, n.origin),
            },
            None => {
                let culprit = culprit.and_then(|c| self.members.get(c).copied());
                // The reason names this group (the collectives' errors do already).
                let mark = format!("in group {} (", self.label());
                let reason = if reason.contains(&mark) {
                    reason.to_string()
                } else {
                    format!("{} {reason}", self.context(None))
                };
                self.root.abort(wire, call, &reason, culprit)
            }
        }
    }

    fn abort_notice(&self) -> Option<(usize, String)> {
        let (origin, reason) = self.root.abort_notice()?;
        Some(self.origin(origin, reason))
    }

    fn abort_notice_for(&self, tag: Tag, call: u64) -> Option<crate::link::Notice> {
        let wire = self.tag(tag, String::new).ok()?;
        let n = self.root.abort_notice_for(wire, call)?;
        let (origin, reason) = self.origin(n.origin, n.reason);
        Some(crate::link::Notice {
            origin,
            culprit: n.culprit.map(|_| origin),
            reason,
            call: n.call,
        })
    }

    fn enter_call(&self, tag: Tag, call: u64) {
        if let Ok(wire) = self.tag(tag, String::new) {
            self.root.enter_call(wire, call);
        }
    }

    fn claim_group(&self) -> bool {
        !self
            .group_claimed
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    fn release_group(&self) {
        self.group_claimed
            .store(false, std::sync::atomic::Ordering::Release);
    }

    fn flight(&self) -> Option<&FlightRecorder> {
        Some(&self.flight)
    }

    /// The root says it first, in its own ranks (an elastic backend revokes itself on the
    /// failure the error names): where that makes it [`DistError::Revoked`], so is this
    /// group's error (its culprit a backend rank); else the group's own error, named in the
    /// group.
    fn label_error(&self, e: DistError) -> DistError {
        let op = e.op().unwrap_or("an operation").to_string();
        let said = match self.in_root_ranks(&e) {
            Some(root) => match self.root.label_error(root) {
                r @ DistError::Revoked { .. } => r,
                _ => e,
            },
            // An error that names no rank: the root's ranks do not matter.
            None => self.root.label_error(e),
        };
        match said {
            DistError::Revoked {
                epoch,
                culprit,
                reason,
                ..
            } => self.label_in_group(DistError::Revoked {
                rank: self.me,
                op,
                epoch,
                culprit,
                reason,
            }),
            e => self.label_in_group(e),
        }
    }
}

impl<R: Link + Clone> SplitLink for SubLink<R> {
    type Root = R;

    fn root_link(&self) -> &R {
        &self.root
    }

    fn root_rank(&self, r: usize) -> usize {
        self.members[r]
    }
}

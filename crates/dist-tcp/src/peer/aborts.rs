//! Abort notices: what a peer's abort frame says, and the bounded list a backend keeps.

use super::*;
use dist_core::subgroup::GROUP_ID_BITS;

/// An abort notice received from a peer: who sent it, on which tag, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank that aborted (sent the notice).
    pub from: usize,
    /// The rank at fault, where the notice names one (a peer that died or went silent, or the
    /// origin of an abort passed on); else the failure is `from`'s own.
    pub culprit: Option<usize>,
    /// The tag of the operation it aborted.
    pub tag: Tag,
    /// The number of the collective call of `tag`'s group that failed, where the notice names
    /// one ([`dist_core::transport::Link::abort`]): ranks still in an earlier call finish it.
    pub call: Option<u64>,
    /// Its error.
    pub reason: String,
}

impl AbortNotice {
    /// The rank the failure is due to: the culprit it names, else its sender.
    pub fn origin(&self) -> usize {
        self.culprit.unwrap_or(self.from)
    }

    /// Whether it ends a wait on `tag` while `tag`'s group is in call `current` (where known):
    /// see [`dist_core::transport::notice_ends`].
    pub fn ends(&self, tag: Tag, current: Option<u64>) -> bool {
        dist_core::transport::notice_ends(self.tag, self.call, tag, current)
    }
}

/// How many groups' current calls a backend keeps (the most recently started first-time).
const GROUPS_TRACKED: usize = 64;

/// The abort notices of one backend, shared by its peers. Once one has arrived, every wait on a
/// system tag (barrier, collectives) fails with it instead of waiting out its deadline, except
/// a wait of a group still in a call before the one the notice names.
#[derive(Debug, Default)]
pub(crate) struct Aborts {
    raised: AtomicBool,
    notices: Mutex<Vec<AbortNotice>>,
    /// The call the root group (tags' group bits 0) is in, 0 before its first: kept apart from
    /// `calls` so that a collective of the root group sets it with no lock.
    root_call: AtomicU64,
    /// The call each sub-group of this rank is in, by its tags' group bits: one entry per
    /// sub-group that has run a collective.
    calls: Mutex<Vec<(u64, u64)>>,
}

impl Aborts {
    /// Records `n`, unless a notice of its sender for the same tag and call is kept already,
    /// or [`ABORTS_KEPT_PER_PEER`] of its sender's are: a peer flooding abort frames can
    /// neither grow this list past that nor push out the notices of other ranks. Returns
    /// whether `n` was kept: a notice not kept changes no wait's outcome (waits look only at
    /// the kept ones), so only a kept one needs the waiters woken.
    pub(crate) fn raise(&self, n: AbortNotice) -> bool {
        let mut v = self.notices.lock().unwrap_or_else(|p| p.into_inner());
        let mut senders = v.iter().filter(|k| k.from == n.from);
        let kept = senders.clone().count() < ABORTS_KEPT_PER_PEER
            && !senders.any(|k| k.tag == n.tag && k.call == n.call);
        if kept {
            v.push(n);
        }
        drop(v);
        self.raised.store(true, Ordering::Release);
        kept
    }

    pub(crate) fn raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    pub(crate) fn notices(&self) -> Vec<AbortNotice> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `tag`'s group is in call `call` from now on.
    pub(crate) fn enter_call(&self, tag: Tag, call: u64) {
        let group = tag.to_wire() & GROUP_ID_BITS;
        if group == 0 {
            self.root_call.store(call, Ordering::Release);
            return;
        }
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        match calls.iter_mut().find(|(g, _)| *g == group) {
            Some(entry) => entry.1 = call,
            None => {
                // Bounded: a group forgotten here has its waits ended by any notice, as before
                // notices named calls (safe, only less precise).
                if calls.len() >= GROUPS_TRACKED {
                    calls.remove(0);
                }
                calls.push((group, call));
            }
        }
    }

    /// The call `tag`'s group is in, if it has run one.
    fn call_of(&self, tag: Tag) -> Option<u64> {
        let group = tag.to_wire() & GROUP_ID_BITS;
        if group == 0 {
            // Calls are numbered from 1: 0 says the root group has run none.
            return Some(self.root_call.load(Ordering::Acquire)).filter(|&c| c != 0);
        }
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls.iter().find(|(g, _)| *g == group).map(|&(_, c)| c)
    }

    /// The first notice that ends call `call` (where known) of `tag`'s group.
    pub(crate) fn ending(&self, tag: Tag, call: Option<u64>) -> Option<AbortNotice> {
        if !self.raised() {
            return None;
        }
        let notices = self.notices.lock().unwrap_or_else(|p| p.into_inner());
        notices.iter().find(|n| n.ends(tag, call)).cloned()
    }

    /// The first notice that ends a wait on `tag` now (in the call its group is in).
    pub(crate) fn ending_now(&self, tag: Tag) -> Option<AbortNotice> {
        if !self.raised() {
            return None;
        }
        self.ending(tag, self.call_of(tag))
    }

    /// The error of a wait on `tag` ended by an abort: the notice that ends it, else the first.
    pub(super) fn error(&self, me: usize, op: String, tag: Tag) -> DistError {
        let first = self
            .ending_now(tag)
            .or_else(|| self.notices().into_iter().next());
        DistError::Aborted {
            rank: me,
            op,
            origin: first.as_ref().map_or(me, AbortNotice::origin),
            reason: first.map_or_else(|| "aborted".into(), |n| n.reason),
        }
    }
}

/// A hook the owning backend passes to each peer to hear of abort frames.
pub(crate) type AbortSink = Arc<dyn Fn(AbortNotice) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(from: usize, culprit: Option<usize>, reason: &str) -> AbortNotice {
        AbortNotice {
            from,
            culprit,
            tag: Tag::system(2),
            call: None,
            reason: reason.into(),
        }
    }

    /// The first notice is the one every wait reports, naming its culprit (else its sender).
    #[test]
    fn the_first_notice_decides() {
        let a = Aborts::default();
        assert!(!a.raised());
        assert!(a.raise(notice(3, Some(1), "peer 1 gone")));
        assert!(a.raise(notice(2, None, "mine")));
        assert!(a.raised());
        match a.error(0, "all_reduce(f32 x 4, sum)".into(), Tag::system(2)) {
            DistError::Aborted {
                rank: 0,
                op,
                origin: 1,
                reason,
            } => assert_eq!(
                (op.as_str(), reason.as_str()),
                ("all_reduce(f32 x 4, sum)", "peer 1 gone")
            ),
            other => panic!("{other}"),
        }
        assert_eq!(notice(4, None, "x").origin(), 4);
    }

    /// A flood of abort frames from one peer keeps at most [`ABORTS_KEPT_PER_PEER`] of its
    /// notices, a repeated notice (same sender, tag and call) is not kept again, and `raise`
    /// says which were kept (only those wake the waiters); the notices of other ranks, before
    /// and after the flood, are kept. Fails with the list bounded per backend: the flood
    /// pushes out rank 5's later notice, and a repeat or a dropped notice reports as kept.
    #[test]
    fn a_flood_is_bounded_per_peer_and_repeats_are_not_kept() {
        let a = Aborts::default();
        assert!(a.raise(notice(1, None, "first")));
        assert!(!a.raise(notice(1, None, "again")), "a repeat is not kept");
        let on_call = |from, call| AbortNotice {
            call: Some(call),
            ..notice(from, None, "flood")
        };
        let kept = (1..=4 * ABORTS_KEPT_PER_PEER as u64)
            .filter(|&c| a.raise(on_call(2, c)))
            .count();
        assert_eq!(kept, ABORTS_KEPT_PER_PEER, "kept of the flood");
        assert!(!a.raise(on_call(2, 1)), "a repeat is not kept");
        assert!(
            a.raise(on_call(5, 1)),
            "another rank's notice after the flood"
        );
        let from = |r| a.notices().iter().filter(|n| n.from == r).count();
        assert_eq!((from(1), from(2), from(5)), (1, ABORTS_KEPT_PER_PEER, 1));
    }
}

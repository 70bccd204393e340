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
    /// The rank whose own call failed first, where the notice passes on such a failure
    /// ([`dist_core::transport::Link::pass_on_abort`]): the origin of the errors it ends, yet
    /// no rank known failed.
    pub first: Option<usize>,
    /// The tag of the operation it aborted.
    pub tag: Tag,
    /// The number of the collective call of `tag`'s group that failed, where the notice names
    /// one ([`dist_core::transport::Link::abort`]): ranks still in an earlier call finish it.
    pub call: Option<u64>,
    /// Its error.
    pub reason: String,
}

impl AbortNotice {
    /// The rank the failure is due to: the culprit it names, else the rank whose call failed
    /// first that it passes on, else its sender.
    pub fn origin(&self) -> usize {
        self.culprit.or(self.first).unwrap_or(self.from)
    }

    /// Whether it ends a wait on `tag` while `tag`'s group is in call `current` (where known):
    /// see [`dist_core::transport::notice_ends`].
    pub fn ends(&self, tag: Tag, current: Option<u64>) -> bool {
        dist_core::transport::notice_ends(self.tag, self.call, tag, current)
    }
}

/// The waits the notices of one sender end, together ([`AbortNotice::ends`]): a notice that
/// names a call of a group ends every wait but those of that group in an earlier call, any
/// other ends every wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// No notice: no wait.
    Nothing,
    /// Every wait but those of the group with these group bits in a call before `call`.
    AllBut { group: u64, call: u64 },
    /// Every wait.
    All,
}

impl Reach {
    /// The reach of these notices and `n`.
    fn with(self, n: &AbortNotice) -> Reach {
        let spared = match n.call {
            Some(call) if n.tag.is_system() => Some((n.tag.to_wire() & GROUP_ID_BITS, call)),
            _ => None,
        };
        match (self, spared) {
            (Reach::All, _) | (_, None) => Reach::All,
            (Reach::Nothing, Some((group, call))) => Reach::AllBut { group, call },
            (Reach::AllBut { group, call }, Some((g, c))) if g == group => Reach::AllBut {
                group,
                call: call.min(c),
            },
            (Reach::AllBut { .. }, Some(_)) => Reach::All,
        }
    }
}

// A reach is decided by at most two notices: with room for two, a sender at the bound always
// has a notice that can make way for one that grows its reach (`Aborts::raise`).
const _: () = assert!(ABORTS_KEPT_PER_PEER >= 3);

/// How many groups' current calls a backend keeps (the most recently started first-time).
const GROUPS_TRACKED: usize = 64;

/// The abort notices of one backend, shared by its peers. Once one has arrived, every wait on a
/// system tag (barrier, collectives) fails with it instead of waiting out its deadline, except
/// a wait of a group still in a call before the one the notice names.
#[derive(Debug, Default)]
pub(crate) struct Aborts {
    raised: AtomicBool,
    /// The backend's group was revoked: every wait ends, user tags' too.
    revoked: AtomicBool,
    notices: Mutex<Vec<AbortNotice>>,
    /// The call the root group (tags' group bits 0) is in, 0 before its first: kept apart from
    /// `calls` so that a collective of the root group sets it with no lock.
    root_call: AtomicU64,
    /// The call each sub-group of this rank is in, by its tags' group bits: one entry per
    /// sub-group that has run a collective.
    calls: Mutex<Vec<(u64, u64)>>,
}

impl Aborts {
    /// Records `n` and says whether a wait may end because of it (the caller then wakes the
    /// waiters: a notice that ends no wait that its sender's others did not costs no work per
    /// peer).
    ///
    /// A notice its sender sent already (same tag and call) is not kept again. Each sender (this
    /// rank, for its own notices, as any peer) has at most [`ABORTS_KEPT_PER_PEER`] kept: a
    /// peer flooding abort frames can neither grow this list past that nor push out the notices
    /// of other ranks. A sender at that bound still has a new notice kept when it ends a wait
    /// that its kept ones do not (its [`Reach`] grows): it replaces the sender's oldest notice
    /// whose going ends no fewer waits. So every notice of a long job (many groups aborted, by
    /// a peer or by this rank) still ends its waits at once, and a wait that notices ended
    /// stays ended.
    ///
    /// Of the notices that do grow a sender's reach, one ends waits of one group in fewer calls
    /// than before; such a notice wakes the waiters only if it ends the call that group is in
    /// now (a wait that starts later looks for itself): a peer sending notices of ever earlier
    /// calls wakes them at most once per call this rank enters.
    pub(crate) fn raise(&self, n: AbortNotice) -> bool {
        let mut v = self.notices.lock().unwrap_or_else(|p| p.into_inner());
        // Set before the calls are read below (and sequentially consistent with `enter_call`'s
        // store and `raised`'s load), so that a wait entering a call this misses sees the flag,
        // and then (under the lock) the notice.
        self.raised.store(true, Ordering::SeqCst);
        let mine: Vec<usize> = (0..v.len()).filter(|&i| v[i].from == n.from).collect();
        if mine
            .iter()
            .any(|&i| v[i].tag == n.tag && v[i].call == n.call)
        {
            return false;
        }
        let reach = |skip: Option<usize>| {
            mine.iter()
                .filter(|&&i| Some(i) != skip)
                .fold(Reach::Nothing, |r, &i| r.with(&v[i]))
        };
        let before = reach(None);
        let after = before.with(&n);
        if mine.len() >= ABORTS_KEPT_PER_PEER {
            if after == before {
                return false;
            }
            // Some notice can go: a reach is decided by at most one kept notice besides `n`,
            // and the bound is at least 3. The search starts from the newest, so a sender's
            // first notice (often the root cause that `first` reports and a sub-group passes
            // on) is never the one to go.
            let out = mine
                .iter()
                .rev()
                .copied()
                .find(|&i| reach(Some(i)).with(&n) == after)
                .unwrap_or(mine[mine.len() - 1]);
            v.remove(out);
        }
        v.push(n);
        match (before, after) {
            _ if before == after => false,
            (Reach::AllBut { group, call: was }, Reach::AllBut { call: now, .. }) => {
                // Only the waits of `group` in calls `now..was` end newly; an untracked group's
                // waits end on any notice, so did on the sender's earlier ones.
                self.group_call(group)
                    .is_some_and(|c| (now..was).contains(&c))
            }
            _ => true,
        }
    }

    /// Marks the backend revoked: from now on every wait on its peers ends (the caller wakes
    /// them).
    pub(crate) fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Whether the backend was revoked ([`Aborts::revoke`]).
    pub(crate) fn revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    pub(crate) fn raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }

    /// The first notice kept (the one an error that no notice in particular ends reports),
    /// cloned alone: a collective asks each call once a notice has come.
    pub(crate) fn first(&self) -> Option<AbortNotice> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .cloned()
    }

    pub(crate) fn notices(&self) -> Vec<AbortNotice> {
        self.notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `tag`'s group is in call `call` from now on. Returns whether the waiters must be woken:
    /// a group forgotten to make room (past [`GROUPS_TRACKED`]) has its waits ended by any
    /// notice, and where notices have come, a wait of it that sleeps must see that at once.
    #[must_use]
    pub(crate) fn enter_call(&self, tag: Tag, call: u64) -> bool {
        let group = tag.to_wire() & GROUP_ID_BITS;
        if group == 0 {
            // Sequentially consistent: see `raise`.
            self.root_call.store(call, Ordering::SeqCst);
            return false;
        }
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        match calls.iter_mut().find(|(g, _)| *g == group) {
            Some(entry) => entry.1 = call,
            None => {
                // Bounded: a group forgotten here has its waits ended by any notice, as before
                // notices named calls (safe, only less precise).
                let forgot = calls.len() >= GROUPS_TRACKED;
                if forgot {
                    calls.remove(0);
                }
                calls.push((group, call));
                // Rare (a group's first call past the bound), so one wake per such call.
                return forgot && self.raised();
            }
        }
        false
    }

    /// The call `tag`'s group is in, if it has run one.
    fn call_of(&self, tag: Tag) -> Option<u64> {
        self.group_call(tag.to_wire() & GROUP_ID_BITS)
    }

    /// The call group `group` (tags' group bits) is in, if it has run one.
    fn group_call(&self, group: u64) -> Option<u64> {
        if group == 0 {
            // Calls are numbered from 1: 0 says the root group has run none.
            return Some(self.root_call.load(Ordering::SeqCst)).filter(|&c| c != 0);
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
        let first = self.ending_now(tag).or_else(|| self.first());
        DistError::Aborted {
            rank: me,
            op,
            origin: first.as_ref().map_or(me, AbortNotice::origin),
            culprit: first.as_ref().and_then(|n| n.culprit),
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
            first: None,
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
                culprit: Some(1),
                reason,
            } => assert_eq!(
                (op.as_str(), reason.as_str()),
                ("all_reduce(f32 x 4, sum)", "peer 1 gone")
            ),
            other => panic!("{other}"),
        }
        assert_eq!(notice(4, None, "x").origin(), 4);
    }

    /// A notice that passes on another rank's own failure (a timeout) names that rank as the
    /// origin of the errors it ends, and no rank at fault: neither its sender nor the origin.
    #[test]
    fn a_passed_on_failure_names_its_origin_but_no_culprit() {
        let a = Aborts::default();
        assert!(a.raise(AbortNotice {
            first: Some(1),
            ..notice(3, None, "rank 1 timed out")
        }));
        match a.error(0, "barrier".into(), Tag::system(2)) {
            DistError::Aborted {
                origin: 1,
                culprit: None,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }

    /// A notice of `from` naming call `call` of sub-group `group` (its id).
    fn of_group(from: usize, group: u64, call: u64) -> AbortNotice {
        AbortNotice {
            call: Some(call),
            tag: sub_tag(group),
            ..notice(from, None, "sub-group failed")
        }
    }

    /// A system tag of sub-group `id` (0: the root group).
    fn sub_tag(id: u64) -> Tag {
        Tag::from_wire(Tag::system(2).to_wire() | (id << GROUP_ID_BITS.trailing_zeros()))
    }

    /// A flood of abort frames from one peer keeps at most [`ABORTS_KEPT_PER_PEER`] of its
    /// notices, whatever they name (the same group in later calls, earlier calls, which each
    /// end more waits and so replace an older one, or other groups), a repeated notice (same
    /// sender, tag and call) is not kept again, and the notices of other ranks, before and
    /// after the flood, are kept. Only a notice that ends a wait the sender's others did not
    /// asks for the waiters to be woken.
    #[test]
    fn a_flood_is_bounded_per_peer_and_repeats_are_not_kept() {
        let a = Aborts::default();
        assert!(a.raise(notice(1, None, "first")));
        assert!(!a.raise(notice(1, None, "again")), "a repeat is not kept");
        let from = |r| a.notices().iter().filter(|n| n.from == r).count();
        // Later calls of one group end no wait that call 1 does not.
        assert!(a.raise(of_group(2, 7, 1_000_000)));
        let woke = (1_000_001..1_000_100)
            .filter(|&c| a.raise(of_group(2, 7, c)))
            .count();
        assert_eq!((woke, from(2)), (0, ABORTS_KEPT_PER_PEER));
        // Ever earlier calls each end more waits: each is kept, in place of an older one; none
        // wakes the waiters, as group 7 is in no call here.
        let woke = (1..1_000_000)
            .rev()
            .step_by(997)
            .filter(|&c| a.raise(of_group(2, 7, c)))
            .count();
        assert_eq!((woke, from(2)), (0, ABORTS_KEPT_PER_PEER));
        assert!(!a.raise(of_group(2, 7, 1_000_050)), "a repeat is not kept");
        // Other groups: the second ends every wait, the rest none more.
        assert!(a.raise(of_group(2, 8, 5)));
        assert!(!(9..5000).any(|g| a.raise(of_group(2, g, 5))));
        assert_eq!(from(2), ABORTS_KEPT_PER_PEER);
        assert!(
            a.raise(of_group(5, 7, 1)),
            "another rank's notice after the flood"
        );
        assert_eq!((from(1), from(2), from(5)), (1, ABORTS_KEPT_PER_PEER, 1));
    }

    /// Many successive aborts from one sender, each of a call of one group that the kept
    /// notices do not end (a group's calls failing in turn, as where a job forms and aborts
    /// sub-groups whose ids come round again), each end the wait of that call at once and ask
    /// for the waiters to be woken: from a peer and from this rank itself, far past
    /// [`ABORTS_KEPT_PER_PEER`], with the list still bounded. Fails with the first notices kept
    /// and later ones dropped: the 17th wait is not ended.
    #[test]
    fn every_one_of_many_aborts_from_one_sender_ends_its_wait() {
        let a = Aborts::default();
        let tag = sub_tag(3);
        for from in [0, 1] {
            for k in 0..100u64 {
                let call = 10_000 - 100 * from as u64 - k;
                let _ = a.enter_call(tag, call);
                assert_eq!(a.ending_now(tag), None, "call {call} of rank {from}");
                assert!(a.raise(of_group(from, 3, call)), "call {call} woke nobody");
                let n = a.ending_now(tag);
                assert_eq!(n.map(|n| (n.from, n.call)), Some((from, Some(call))));
            }
        }
        assert_eq!(a.notices().len(), 2 * ABORTS_KEPT_PER_PEER);
    }

    /// Once notices end a wait, no later notice of the same sender makes them stop ending it:
    /// a notice that ends every wait stays, though the bound is reached.
    #[test]
    fn a_wait_ended_stays_ended() {
        let a = Aborts::default();
        let tag = sub_tag(3);
        let _ = a.enter_call(tag, 2);
        assert!(a.raise(AbortNotice {
            tag,
            ..notice(1, Some(4), "peer 4 gone")
        }));
        for c in (3..1000).rev() {
            a.raise(of_group(1, 3, c));
        }
        assert_eq!(
            a.ending_now(tag).map(|n| n.reason),
            Some("peer 4 gone".into())
        );
    }

    /// A sender's first notice, the root cause a sub-group reports and passes on, is never the
    /// one that makes room for a later notice of that sender. Fails with the replacement
    /// searching from the oldest notice (the first goes once a later one decides the reach).
    #[test]
    fn a_senders_first_notice_is_not_replaced() {
        let a = Aborts::default();
        let root = AbortNotice {
            reason: "root cause: rank 3 died".into(),
            ..of_group(1, 7, 5)
        };
        assert!(a.raise(root));
        for c in 6..21 {
            let _ = a.raise(of_group(1, 7, c));
        }
        let _ = a.raise(of_group(1, 7, 4));
        let calls: Vec<_> = a.notices().iter().map(|n| n.call).collect();
        assert_eq!(calls.len(), ABORTS_KEPT_PER_PEER);
        assert!(
            calls.contains(&Some(4)),
            "the notice of call 4 was kept: {calls:?}"
        );
        assert_eq!(
            a.first().map(|n| n.reason),
            Some("root cause: rank 3 died".into())
        );
    }

    /// A group forgotten to make room for another's first call (past [`GROUPS_TRACKED`]) has
    /// its waits ended by any notice: once notices have come, that first call asks for the
    /// waiters to be woken, so a wait of the forgotten group that sleeps sees it at once. Before
    /// any notice, and for a group already tracked, it asks for nothing.
    #[test]
    fn forgetting_a_group_after_a_notice_wakes_the_waiters() {
        let a = Aborts::default();
        for g in 1..=GROUPS_TRACKED as u64 {
            assert!(!a.enter_call(sub_tag(g), 1), "group {g}, no notice yet");
        }
        // A notice of group 1's later call: group 1's wait in call 1 goes on.
        let forgotten = sub_tag(1);
        assert!(a.raise(of_group(2, 1, 10)));
        assert_eq!(
            a.ending_now(forgotten),
            None,
            "group 1 in call 1, notice of call 10"
        );
        assert!(!a.enter_call(sub_tag(4), 2), "a tracked group's next call");
        assert!(
            a.enter_call(sub_tag(GROUPS_TRACKED as u64 + 1), 1),
            "a group's first call that forgets group 1, after a notice"
        );
        assert!(a.ending_now(forgotten).is_some(), "group 1 forgotten");
    }

    /// [`Reach`] agrees with [`AbortNotice::ends`] on every wait of a few groups and calls.
    #[test]
    fn a_reach_is_what_its_notices_end() {
        let notices = [
            of_group(1, 3, 5),
            of_group(1, 3, 2),
            of_group(1, 4, 9),
            of_group(1, 0, 3),
            notice(1, None, "any"),
            AbortNotice {
                tag: Tag::user(3),
                ..of_group(1, 3, 5)
            },
        ];
        let waits: Vec<(Tag, Option<u64>)> = [0, 3, 4]
            .into_iter()
            .flat_map(|g| {
                [None, Some(1), Some(2), Some(4), Some(6), Some(10)].map(|c| (sub_tag(g), c))
            })
            .collect();
        // Every ordered pair of notices (and each alone).
        for x in 0..notices.len() {
            for y in 0..=notices.len() {
                let set: Vec<&AbortNotice> = [Some(&notices[x]), notices.get(y)]
                    .into_iter()
                    .flatten()
                    .collect();
                let r = set.iter().fold(Reach::Nothing, |r, n| r.with(n));
                for &(tag, c) in &waits {
                    let by_reach = match r {
                        Reach::Nothing => false,
                        Reach::All => true,
                        Reach::AllBut { group, call } => {
                            !(tag.to_wire() & GROUP_ID_BITS == group && c.is_some_and(|c| c < call))
                        }
                    };
                    let by_ends = set.iter().any(|n| n.ends(tag, c));
                    assert_eq!(by_reach, by_ends, "{set:?} on {tag} in {c:?}");
                }
            }
        }
    }
}

//! A group of ranks over one [`Link`]: the state the collectives keep between calls. Their
//! sequence numbers, whether one has failed (and the abort sent for it), how they cut large
//! messages ([`Tuning`], rank 0's, agreed when the group forms) and the thread a second lane
//! runs on. The algorithms themselves are in [`crate::collectives`].

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::backend::{Meta, Tag};
use crate::collectives::{AllReduceAlgorithm, COLLECTIVE_TAG, HOST_ARENA_MAX};
use crate::error::{DistError, Result};
use crate::link::{Link, PostedRecv};
use crate::work::Occupancy;

/// The ring collectives' default piece: small enough to stay in cache between its arrival and
/// its reduction.
pub const RING_PIECE: usize = 256 << 10;

/// The tag of the message that forms a group (rank 0's tuning, down [`forming_tree`]).
pub const GROUP_TAG: Tag = Tag::system(4);

/// The meta that marks a group's forming message.
const FORMING: Meta = *b"dist-group-tune\0";

/// The bytes of rank 0's tuning in the forming message.
const TUNING_BYTES: usize = 12;

/// How the collectives cut their messages. Every rank of a group must cut the same way, or
/// their message sizes (and tags) would not match: [`Group::form`] makes rank 0's the group's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// The ring collectives' piece size, in KiB (1 to [`Tuning::MAX_PIECE_KB`]).
    pub ring_piece_kb: u32,
    /// How many rings (or chains) a large all_reduce, reduce_scatter, all_gather or broadcast
    /// runs at once, each on its own thread (1 or 2).
    pub lanes: u32,
    /// The largest all_reduce, in KiB, that runs on the link's host arena where the group has
    /// one (0: none does; at most [`Tuning::MAX_ARENA_KB`]); larger ones run the message
    /// algorithms.
    pub arena_max_kb: u32,
}

impl Default for Tuning {
    /// Pieces of [`RING_PIECE`], one lane, the arena up to [`HOST_ARENA_MAX`].
    fn default() -> Tuning {
        Tuning {
            ring_piece_kb: (RING_PIECE >> 10) as u32,
            lanes: 1,
            arena_max_kb: (HOST_ARENA_MAX >> 10) as u32,
        }
    }
}

impl Tuning {
    /// The largest ring piece: 64 MiB.
    pub const MAX_PIECE_KB: u32 = 64 << 10;
    /// The most lanes.
    pub const MAX_LANES: u32 = 2;
    /// The largest arena limit: 1 GiB.
    pub const MAX_ARENA_KB: u32 = 1 << 20;

    /// Why this tuning cannot be used, or `None` when it can.
    pub fn problem(&self) -> Option<String> {
        if !(1..=Self::MAX_PIECE_KB).contains(&self.ring_piece_kb) {
            return Some(format!(
                "a ring piece of {} KiB is outside 1..={} KiB",
                self.ring_piece_kb,
                Self::MAX_PIECE_KB
            ));
        }
        if !(1..=Self::MAX_LANES).contains(&self.lanes) {
            return Some(format!(
                "{} lanes is outside 1..={}",
                self.lanes,
                Self::MAX_LANES
            ));
        }
        if self.arena_max_kb > Self::MAX_ARENA_KB {
            return Some(format!(
                "an arena limit of {} KiB is over {} KiB",
                self.arena_max_kb,
                Self::MAX_ARENA_KB
            ));
        }
        None
    }

    /// The ring piece in bytes.
    pub fn ring_piece(&self) -> usize {
        (self.ring_piece_kb as usize) << 10
    }

    /// The largest all_reduce on the host arena, in bytes.
    pub fn arena_max(&self) -> usize {
        (self.arena_max_kb as usize) << 10
    }

    fn encode(&self) -> [u8; TUNING_BYTES] {
        let mut b = [0u8; TUNING_BYTES];
        b[..4].copy_from_slice(&self.ring_piece_kb.to_le_bytes());
        b[4..8].copy_from_slice(&self.lanes.to_le_bytes());
        b[8..].copy_from_slice(&self.arena_max_kb.to_le_bytes());
        b
    }

    fn decode(b: &[u8; TUNING_BYTES]) -> Tuning {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Tuning {
            ring_piece_kb: word(0),
            lanes: word(4),
            arena_max_kb: word(8),
        }
    }
}

/// The ranks of a [`Link`], as the collectives see them: what users call collectives on (through
/// [`Collectives`](crate::Collectives), which every [`Transport`](crate::Transport) gets; a group
/// is one, and so is a backend that owns one, such as `TcpBackend`).
///
/// A group takes collectives from one thread at a time, and async work
/// ([`Collectives::scope`](crate::Collectives::scope)) from the thread that opened the scope;
/// a call from a second thread while one is inside fails at once with
/// [`DistError::ConcurrentUse`]. The rule in full is on [`Collectives`](crate::Collectives).
pub struct Group<L: Link> {
    /// The state, shared with the owned async work running on it
    /// ([`Collectives::all_reduce_owned`](crate::Collectives::all_reduce_owned)), which keeps
    /// it alive until that work ends.
    state: Arc<State<L>>,
}

/// A group's state: the link and what its collectives keep between calls.
struct State<L: Link> {
    link: L,
    timeout: Duration,
    tuning: Tuning,
    /// The number of the next collective this rank starts.
    seq: AtomicU64,
    /// This rank has sent its abort (one per group).
    abort_sent: AtomicBool,
    /// The thread that runs a second lane, started on first use (`None` inside if it could not
    /// be): starting one per call costs more than a 1 MiB all_reduce saves.
    lane: OnceLock<Option<rayon::ThreadPool>>,
    /// The threads that share one call's copies with the caller ([`Group::helpers`]).
    helpers: OnceLock<Option<rayon::ThreadPool>>,
    /// The all_reduce algorithm forced by [`Group::force_all_reduce`] (its code), 0 for the
    /// choice by size.
    forced_all_reduce: AtomicU8,
    /// Which thread is inside a call, the async work queued, and the threads it runs on.
    occupancy: Occupancy,
    /// Whether the group's all_reduces run on the link's host arena: 0 not agreed yet, 1 no,
    /// 2 yes (see `collectives/host.rs`).
    arena_agreed: AtomicU8,
    /// From which size the arena's all_reduces read peers' buffers directly (`u64::MAX`: they
    /// do not); set before `arena_agreed`.
    arena_direct_min: AtomicU64,
}

/// The link is free for another group once this one is gone (with the owned work that held it).
impl<L: Link> Drop for State<L> {
    fn drop(&mut self) {
        self.link.release_group();
    }
}

impl<L: Link> std::fmt::Debug for Group<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.state.link.rank())
            .field("world_size", &self.state.link.world_size())
            .field("tuning", &self.state.tuning)
            .finish()
    }
}

/// Rank `r`'s parent and children in the tree a group's tuning goes down ([`Group::form`]):
/// the parent is `r` less its highest set bit (none for rank 0), the children are `r + 2^k` for
/// every `2^k > r` below `n`, the largest subtree first. dist-tcp's lazy formation sends its
/// table of listeners down the same tree (it calls this), so that in a lazily connected job the
/// tuning travels over connections formation made. Rank 0 has ⌈log₂ n⌉ children, and every
/// rank is within ⌈log₂ n⌉ hops of it.
pub fn forming_tree(r: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let parent = r.checked_ilog2().map(|b| r - (1 << b));
    let mut children = Vec::new();
    let mut step = (r + 1).next_power_of_two();
    while let Some(c) = r.checked_add(step).filter(|c| *c < n) {
        children.push(c);
        match step.checked_mul(2) {
            Some(next) => step = next,
            None => break,
        }
    }
    (parent, children)
}

impl<L: Link> Group<L> {
    /// Forms the group of every rank of `link`: rank 0's `local` tuning goes to every rank (down
    /// [`forming_tree`]), which makes it the group's (the others' own is ignored), within
    /// `timeout`; `timeout` is
    /// also the collectives' default. Every rank must call it. A rank that hears of an abort
    /// before rank 0's tuning forms its group anyway (with its own tuning): every collective of
    /// that group fails at once with the abort.
    ///
    /// One group per link: a second group over the same link (a clone of it) would use the
    /// same tags as the first, and a message of one could be taken by the other (with equal
    /// descriptors, silently), so forming it is refused with
    /// [`DistError::InvalidArgument`] while the first lives ([`Link::claim_group`]). The
    /// refusal is this rank's alone (it cannot tell the others over a link another group
    /// uses): the ranks below it in [`forming_tree`] wait for the tuning it does not pass on
    /// and fail to form at `timeout` (a [`DistError::Timeout`], which they tell the ranks they
    /// are connected to); the others form and wait for it until their collectives' deadlines.
    /// Sub-groups ([`Subgroups`](crate::Subgroups)) are the way to have several: each has tags
    /// of its own.
    pub fn form(link: L, local: Tuning, timeout: Duration) -> Result<Group<L>> {
        if !link.claim_group() {
            return Err(DistError::InvalidArgument {
                rank: link.rank(),
                op: "form the group".into(),
                reason: "a group already runs over this link (or a clone of it): its messages \
                         would be matched against this one's; form sub-groups instead \
                         (Subgroups::split, Subgroups::new_group)"
                    .into(),
            });
        }
        // Given back if forming fails or unwinds (a link that panics).
        struct Claim<'l, L: Link>(Option<&'l L>);
        impl<L: Link> Drop for Claim<'_, L> {
            fn drop(&mut self) {
                if let Some(l) = self.0 {
                    l.release_group();
                }
            }
        }
        let mut claim = Claim(Some(&link));
        let tuning = Self::agree(&link, local, timeout)?;
        claim.0 = None;
        drop(claim);
        Ok(Group::assemble(link, tuning, timeout))
    }

    /// The group's tuning: rank 0's `local`, sent down [`forming_tree`] (each rank receives it
    /// from its parent and passes it on to its children), so that rank 0 sends ⌈log₂ n⌉
    /// messages rather than n − 1; in a lazily connected dist-tcp job the tree's edges are
    /// connections its formation made. While it forms, a rank counts as in the group's first
    /// call: a notice that ends call 1 (or names none) ends its wait, and it passes that notice
    /// on as it came, for the ranks below it, and forms with its own tuning (the group's first
    /// collective then fails with the notice); a notice naming a later call (a rank that formed,
    /// finished call 1 and failed a later one) does not, and the tuning is waited for. A rank
    /// that fails here tells the ranks it is connected to, its children among them (over an
    /// eager mesh, an in-memory link, and a lazy dist-tcp job's formation connections; a
    /// sub-group's children in a lazy job once they have dialed it).
    fn agree(link: &L, local: Tuning, timeout: Duration) -> Result<Tuning> {
        let (me, n) = (link.rank(), link.world_size());
        let op = || "form the group".to_string();
        let deadline = crate::transport::deadline_after(Instant::now(), timeout, me, op)?;
        let fail = |e: DistError| Self::tell_failure(link, e);
        link.enter_call(COLLECTIVE_TAG, 1);
        let (parent, children) = forming_tree(me, n);
        let tuning = match parent {
            None => {
                if let Some(p) = local.problem() {
                    return Err(fail(DistError::InvalidArgument {
                        rank: me,
                        op: op(),
                        reason: p,
                    }));
                }
                local
            }
            Some(parent) => match Self::tuning_from(link, parent, deadline)? {
                Some(t) => t,
                None => {
                    if let Some(notice) = link.abort_notice_for(COLLECTIVE_TAG, 1) {
                        link.abort(
                            COLLECTIVE_TAG,
                            notice.call,
                            &notice.reason,
                            Some(notice.origin),
                        );
                    }
                    return Ok(local);
                }
            },
        };
        for c in children {
            link.send(&tuning.encode(), c, GROUP_TAG, FORMING, deadline, None)
                .map_err(|e| fail(e.with_op(&op())))?;
        }
        Ok(tuning)
    }

    /// Tells the ranks this one is connected to that forming failed here with `e` (naming the
    /// peer at fault where `e` names one), and returns `e`.
    fn tell_failure(link: &L, e: DistError) -> DistError {
        let culprit = match &e {
            DistError::PeerGone { peer, .. } | DistError::PeerUnresponsive { peer, .. } => {
                Some(*peer)
            }
            _ => None,
        };
        link.abort(COLLECTIVE_TAG, None, &e.to_string(), culprit);
        e
    }

    /// Rank `parent`'s forming message, checked: `None` if a notice that ends call 1 ended the
    /// wait. A failure is told to the ranks this one is connected to.
    fn tuning_from(link: &L, parent: usize, deadline: Instant) -> Result<Option<Tuning>> {
        let me = link.rank();
        let fail = |e: DistError| Self::tell_failure(link, e);
        let mut b = [0u8; TUNING_BYTES];
        // SAFETY: the handle is waited on (or dropped, on an error) in the next statement;
        // it is never leaked. (Tests: every group's formation, `group::tests`.)
        let posted = unsafe { link.post(&mut b, parent, GROUP_TAG, deadline) };
        let meta = match posted.and_then(|h| h.wait()) {
            Ok(meta) => meta,
            // A notice that ends call 1 explains whatever ended the wait (the parent may have
            // aborted and then closed its connections): it is passed on, not this error.
            Err(_) if link.abort_notice_for(COLLECTIVE_TAG, 1).is_some() => return Ok(None),
            Err(e) => {
                return Err(fail(e.with_op(&format!(
                    "form the group (the tuning from rank {parent})"
                ))));
            }
        };
        let t = Tuning::decode(&b);
        let refused = |detail: String| {
            fail(DistError::CollectiveMismatch {
                rank: me,
                op: "form the group".into(),
                peer: parent,
                detail,
            })
        };
        if meta != FORMING {
            return Err(refused(format!(
                "its forming message has meta {meta:?}: not a dist group"
            )));
        }
        if let Some(p) = t.problem() {
            return Err(refused(format!("its tuning: {p}")));
        }
        Ok(Some(t))
    }

    fn assemble(link: L, tuning: Tuning, timeout: Duration) -> Group<L> {
        let state = State {
            link,
            timeout,
            tuning,
            seq: AtomicU64::new(0),
            abort_sent: AtomicBool::new(false),
            lane: OnceLock::new(),
            helpers: OnceLock::new(),
            forced_all_reduce: AtomicU8::new(0),
            occupancy: Occupancy::default(),
            arena_agreed: AtomicU8::new(0),
            arena_direct_min: AtomicU64::new(u64::MAX),
        };
        Group {
            state: Arc::new(state),
        }
    }

    /// Another handle on this group, sharing its state (for owned async work, which must keep
    /// the group alive while it runs, whatever happens to the caller's).
    pub(crate) fn share(&self) -> Group<L> {
        Group {
            state: self.state.clone(),
        }
    }

    /// Makes every later all_reduce of this rank run `algorithm` whatever its size (for tests
    /// and measurements), or, with `None`, chooses by size again
    /// ([`all_reduce_algorithm`](crate::collectives::all_reduce_algorithm)). Every rank must
    /// force the same: ranks running different algorithms disagree about their messages'
    /// sizes, which is reported as a mismatch (or a timeout) like any other disagreement.
    pub fn force_all_reduce(&self, algorithm: Option<AllReduceAlgorithm>) {
        let code = algorithm.map_or(0, AllReduceAlgorithm::code);
        self.state.forced_all_reduce.store(code, Ordering::Relaxed);
    }

    /// The all_reduce algorithm forced by [`Group::force_all_reduce`], if any.
    pub fn forced_all_reduce(&self) -> Option<AllReduceAlgorithm> {
        AllReduceAlgorithm::from_code(self.state.forced_all_reduce.load(Ordering::Relaxed))
    }

    /// Whether this group runs its all_reduces on the link's host arena
    /// ([`Link::arena`]): `None` until its first all_reduce, on which the ranks agree.
    pub fn arena_in_use(&self) -> Option<bool> {
        match self.state.arena_agreed.load(Ordering::Acquire) {
            0 => None,
            x => Some(x == 2),
        }
    }

    /// From which size (bytes) this group's all_reduces on the arena read their peers' buffers
    /// directly ([`HostArena::direct_min`](crate::transport::HostArena::direct_min): every rank could, and
    /// the largest size any proposed); `None` where they do not, or before the ranks agree on
    /// the arena.
    pub fn arena_direct_min(&self) -> Option<usize> {
        if self.arena_in_use() != Some(true) {
            return None;
        }
        match self.state.arena_direct_min.load(Ordering::Relaxed) {
            u64::MAX => None,
            b => usize::try_from(b).ok(),
        }
    }

    pub(crate) fn set_arena_agreed(&self, yes: bool, direct_min: Option<usize>) {
        let b = direct_min.map_or(u64::MAX, |b| b as u64);
        self.state.arena_direct_min.store(b, Ordering::Relaxed);
        // The release publishes `arena_direct_min` with the agreement.
        self.state
            .arena_agreed
            .store(if yes { 2 } else { 1 }, Ordering::Release);
    }

    /// The link the group moves its bytes over.
    pub fn link(&self) -> &L {
        &self.state.link
    }

    /// How the group's collectives cut their messages (rank 0's tuning).
    pub fn tuning(&self) -> Tuning {
        self.state.tuning
    }

    /// The collectives' default timeout.
    pub fn timeout(&self) -> Duration {
        self.state.timeout
    }

    /// Which thread is inside a call on this group, and its async work
    /// ([`crate::work`]).
    pub(crate) fn occupancy(&self) -> &Occupancy {
        &self.state.occupancy
    }

    /// The number of the collective this rank starts now (0 for the first).
    pub(crate) fn next_seq(&self) -> u64 {
        self.state.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// The number (from 1, as abort notices name calls) of the collective this rank would
    /// start next.
    pub(crate) fn next_number(&self) -> u64 {
        self.state.seq.load(Ordering::Relaxed) + 1
    }

    /// Tells every rank that this rank's operation on `tag` failed with `reason` (caused by
    /// `culprit`, where known); see [`Link::abort`]. Only the first call sends anything: a rank
    /// reports its first failure (its own, or one it heard of and passes on, so that ranks that
    /// have not heard yet do before they see this one leave).
    /// The notice names no call: it ends every wait on every rank.
    ///
    /// A `culprit` that is no rank of the group is refused with [`DistError::InvalidRank`]
    /// before anything is recorded or sent.
    pub fn abort(&self, tag: Tag, reason: &str, culprit: Option<usize>) -> Result<()> {
        let size = self.state.link.world_size();
        if let Some(c) = culprit.filter(|&c| c >= size) {
            return Err(DistError::InvalidRank {
                rank: self.state.link.rank(),
                op: format!("abort on tag {tag} naming rank {c} at fault"),
                given: c,
                world_size: size,
            });
        }
        self.abort_call(tag, None, reason, culprit);
        Ok(())
    }

    /// [`Group::abort`] naming the call of this group that failed, where this rank has done its
    /// part of every earlier one ([`Link::abort`]).
    pub(crate) fn abort_call(
        &self,
        tag: Tag,
        call: Option<u64>,
        reason: &str,
        culprit: Option<usize>,
    ) {
        if !self.state.abort_sent.swap(true, Ordering::AcqRel) {
            self.state.link.abort(tag, call, reason, culprit);
        }
    }

    /// [`Group::abort_call`] passing on an abort whose first failure was rank `origin`'s own
    /// call, naming no rank at fault ([`Link::pass_on_abort`]).
    pub(crate) fn pass_on_call(&self, tag: Tag, call: Option<u64>, reason: &str, origin: usize) {
        if !self.state.abort_sent.swap(true, Ordering::AcqRel) {
            self.state.link.pass_on_abort(tag, call, reason, origin);
        }
    }

    /// Runs `first` on this thread and `second` on the group's lane thread at once, and
    /// returns once both have run. The lane thread is a one-thread rayon pool, started on first
    /// use; where it cannot start, or the caller is itself a rayon worker, a thread started for
    /// the call runs `second` instead (a worker of some pool, waiting for the lane, would run
    /// other jobs of its own pool meanwhile, which could be another collective on this thread).
    pub(crate) fn run_beside(&self, first: &mut dyn FnMut(), second: &mut (dyn FnMut() + Send)) {
        if rayon::current_thread_index().is_some() {
            return run_beside_scoped(first, second);
        }
        let me = self.state.link.rank();
        let pool = self.state.lane.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(move |_| format!("dist-lane-{me}"))
                .build()
                .ok()
        });
        match pool {
            Some(pool) => pool.in_place_scope(|s| {
                s.spawn(|_| second());
                first();
            }),
            None => run_beside_scoped(first, second),
        }
    }

    /// The `threads - 1` threads that split one call's copies with the caller, a rayon pool
    /// started on the first call that asks and kept for the group's life (its size is that
    /// call's): `None` for one thread, where the pool cannot start, or where the caller is
    /// itself a rayon worker (which, waiting, would run its own pool's jobs).
    pub(crate) fn helpers(&self, threads: usize) -> Option<&rayon::ThreadPool> {
        if threads <= 1 || rayon::current_thread_index().is_some() {
            return None;
        }
        let me = self.state.link.rank();
        self.state
            .helpers
            .get_or_init(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads - 1)
                    .thread_name(move |i| format!("dist-part-{me}-{i}"))
                    .build()
                    .ok()
            })
            .as_ref()
    }
}

/// Runs `first` on this thread and `second` on a thread started for the call, at once (and, if
/// none can be started, the two one after the other).
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
    use std::sync::atomic::AtomicBool;

    #[test]
    fn run_beside_runs_both_at_once() {
        // Each side waits for the other to have started: only concurrent runs finish.
        let (a, b) = (AtomicBool::new(false), AtomicBool::new(false));
        let wait_for = |x: &AtomicBool| {
            let t = Instant::now();
            while !x.load(Ordering::Acquire) {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the other side never ran"
                );
                std::hint::spin_loop();
            }
        };
        run_beside_scoped(
            &mut || {
                a.store(true, Ordering::Release);
                wait_for(&b);
            },
            &mut || {
                b.store(true, Ordering::Release);
                wait_for(&a);
            },
        );
    }

    #[test]
    fn tunings_out_of_range_are_named() {
        assert_eq!(Tuning::default().problem(), None);
        assert_eq!(Tuning::default().ring_piece(), RING_PIECE);
        let t = Tuning {
            ring_piece_kb: 0,
            lanes: 1,
            ..Tuning::default()
        };
        assert!(t.problem().unwrap().contains("0 KiB"));
        let t = Tuning {
            ring_piece_kb: Tuning::MAX_PIECE_KB + 1,
            lanes: 1,
            ..Tuning::default()
        };
        assert!(t.problem().is_some());
        let t = Tuning {
            ring_piece_kb: 4,
            lanes: 3,
            ..Tuning::default()
        };
        assert!(t.problem().unwrap().contains("3 lanes"));
        let t = Tuning {
            arena_max_kb: Tuning::MAX_ARENA_KB + 1,
            ..Tuning::default()
        };
        assert!(t.problem().unwrap().contains("arena limit"));
        let t = Tuning {
            ring_piece_kb: 4,
            lanes: 2,
            arena_max_kb: 64,
        };
        assert_eq!(Tuning::decode(&t.encode()), t);
    }
}

//! A [`Link`] in memory, for tests: `n` ranks in one process (a thread each), their messages
//! moved through per-rank inboxes, with faults to inject. A rank can die ([`MemLink::kill`], or
//! as it sends a chosen message), and a message can be delivered late or never
//! ([`MemLink::set_faults`]): late messages on
//! one tag still arrive in order, so delaying one tag reorders it against the others, and a
//! message never delivered is a sender that stalled before it left. No socket, no timer
//! thread: waits sleep on a condition variable until their message, its delivery time or their
//! deadline.
//!
//! ```
//! use std::time::Duration;
//! use dist_core::testing::run_group;
//! use dist_core::{Backend, Collectives, ReduceOp, Tuning};
//!
//! let sums = run_group(3, |_| Tuning::default(), Duration::from_secs(10), |g| {
//!     let mut x = [g.rank() as u64 + 1];
//!     g.all_reduce(&mut x, ReduceOp::Sum).map(|_| x[0])
//! });
//! assert!(sums.into_iter().all(|s| s.unwrap() == 6));
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::{Meta, Tag};
use crate::error::{DistError, Result};
use crate::flight::{FlightRecorder, describe_positions};
use crate::group::{Group, Tuning};
use crate::link::{Link, PostedRecv};

/// One message as the fault hook sees it.
#[derive(Clone, Copy, Debug)]
pub struct Envelope {
    /// The sender.
    pub src: usize,
    /// The receiver.
    pub dst: usize,
    /// The tag it travels on.
    pub tag: Tag,
    /// Its length in bytes.
    pub len: usize,
    /// Its meta (a collective's call descriptor).
    pub meta: Meta,
    /// How many messages `src` sent before this one (to anyone, on any tag).
    pub nth: u64,
}

/// What happens to one message ([`MemLink::set_faults`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// It can be received at once.
    Now,
    /// It can be received only this long after it was sent (and so can every later message of
    /// its sender on its tag, which keep their order).
    After(Duration),
    /// It never arrives: its sender stalled before it left (the send itself succeeds).
    Never,
    /// Its sender dies as it sends it ([`MemLink::kill`]): the message is lost and the send
    /// fails.
    Die,
}

type FaultHook = dyn Fn(&Envelope) -> Delivery + Send + Sync;

struct Msg {
    data: Vec<u8>,
    meta: Meta,
    /// When it can be received.
    at: Instant,
}

#[derive(Default)]
struct Inbox {
    /// Messages by `(sender, tag)`, in the order they were sent.
    queues: HashMap<(usize, Tag), VecDeque<Msg>>,
    /// Abort notices, first first.
    aborts: Vec<MemNotice>,
    /// The call each group of this rank is in ([`Link::enter_call`]), by its tag's group bits.
    calls: HashMap<u64, u64>,
}

/// An abort notice as a rank of the mesh keeps it.
struct MemNotice {
    tag: Tag,
    notice: crate::link::Notice,
}

impl Inbox {
    /// The first notice that ends call `call` (where known) of `tag`'s group.
    fn ending(&self, tag: Tag, call: Option<u64>) -> Option<&crate::link::Notice> {
        self.aborts
            .iter()
            .find(|n| crate::link::notice_ends(n.tag, n.notice.call, tag, call))
            .map(|n| &n.notice)
    }

    /// The call `tag`'s group is in, if it has said.
    fn call_of(&self, tag: Tag) -> Option<u64> {
        self.calls
            .get(&(tag.to_wire() & crate::subgroup::GROUP_ID_BITS))
            .copied()
    }
}

struct Rank {
    inbox: Mutex<Inbox>,
    cond: Condvar,
    dead: AtomicBool,
    /// This rank's abort notices reach nobody else ([`MemLink::lose_aborts`]).
    aborts_lost: AtomicBool,
    /// Messages this rank has sent.
    sent: Mutex<u64>,
    flight: FlightRecorder,
    /// A group runs over this rank's end ([`Link::claim_group`]).
    group_claimed: AtomicBool,
}

struct Mesh {
    ranks: Vec<Rank>,
    faults: Mutex<Option<Arc<FaultHook>>>,
}

impl Mesh {
    fn lock(&self, r: usize) -> MutexGuard<'_, Inbox> {
        // A test thread that panicked while holding it left every update whole.
        self.ranks[r]
            .inbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn wake_all(&self) {
        for (i, r) in self.ranks.iter().enumerate() {
            let _held = self.lock(i);
            r.cond.notify_all();
        }
    }
}

/// One rank's end of an in-memory link. See the [module docs](self). A clone is the same end
/// (sub-groups share it: [`SplitLink`](crate::SplitLink)).
#[derive(Clone)]
pub struct MemLink {
    me: usize,
    mesh: Arc<Mesh>,
    /// The host arena, for links made by [`MemLink::mesh_on_hosts`].
    arena: Option<arena::MemArena>,
}

mod arena;
pub use arena::{ArenaAccess, DirectFault};

impl std::fmt::Debug for MemLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemLink")
            .field("rank", &self.me)
            .field("world_size", &self.mesh.ranks.len())
            .finish()
    }
}

impl MemLink {
    /// Puts an abort notice in every live rank's inbox (this one's too): `origin` is whom the
    /// failure is due to, `culprit` the rank named at fault, if any.
    fn notify(
        &self,
        tag: Tag,
        call: Option<u64>,
        reason: &str,
        origin: usize,
        culprit: Option<usize>,
    ) {
        if self.dead(self.me) {
            return;
        }
        let lost = self.mesh.ranks[self.me].aborts_lost.load(Ordering::Acquire);
        for (r, rank) in self.mesh.ranks.iter().enumerate() {
            if self.dead(r) || (lost && r != self.me) {
                continue;
            }
            let mut inbox = self.mesh.lock(r);
            inbox.aborts.push(MemNotice {
                tag,
                notice: crate::link::Notice {
                    origin,
                    culprit,
                    reason: reason.to_string(),
                    call,
                },
            });
            rank.cond.notify_all();
        }
    }

    /// The `n` ends of one new link, rank `r` at index `r`.
    pub fn mesh(n: usize) -> Vec<MemLink> {
        let mesh = Arc::new(Mesh {
            ranks: (0..n)
                .map(|_| Rank {
                    inbox: Mutex::default(),
                    cond: Condvar::new(),
                    dead: AtomicBool::new(false),
                    aborts_lost: AtomicBool::new(false),
                    sent: Mutex::new(0),
                    flight: FlightRecorder::default(),
                    group_claimed: AtomicBool::new(false),
                })
                .collect(),
            faults: Mutex::new(None),
        });
        (0..n)
            .map(|me| MemLink {
                me,
                mesh: mesh.clone(),
                arena: None,
            })
            .collect()
    }

    /// The ends of a new link whose rank `r` sits on host `hosts[r]` and shares a host arena
    /// ([`Link::arena`]) of slots of `slot_len` bytes with the ranks of its host.
    pub fn mesh_on_hosts(hosts: &[usize], slot_len: usize) -> Vec<MemLink> {
        let arenas = Arc::new(arena::Arenas::new(hosts, slot_len));
        MemLink::mesh(hosts.len())
            .into_iter()
            .map(|mut l| {
                l.arena = Some(arena::MemArena {
                    me: l.me,
                    arenas: arenas.clone(),
                    mesh: l.mesh.clone(),
                });
                l
            })
            .collect()
    }

    /// This rank's abort notices reach no other rank (as if they came after every peer's
    /// deadline): its peers learn of its failure only from its words and its messages.
    pub fn lose_aborts(&self) {
        self.mesh.ranks[self.me]
            .aborts_lost
            .store(true, Ordering::Release);
    }

    /// This rank dies: the waits of the others on it fail with
    /// [`DistError::PeerGone`] once what it sent before is taken, their sends to it fail, and so
    /// does every later call of its own.
    pub fn kill(&self) {
        self.mesh.ranks[self.me].dead.store(true, Ordering::Release);
        self.mesh.wake_all();
        if let Some(a) = &self.arena {
            a.wake();
        }
    }

    /// Decides the fate of every message sent from now on, on every rank of the link.
    pub fn set_faults(&self, hook: impl Fn(&Envelope) -> Delivery + Send + Sync + 'static) {
        *self.mesh.faults.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(hook));
    }

    fn dead(&self, r: usize) -> bool {
        self.mesh.ranks[r].dead.load(Ordering::Acquire)
    }

    fn check_rank(&self, r: usize, op: &dyn Fn() -> String) -> Result<()> {
        if r >= self.mesh.ranks.len() {
            return Err(DistError::InvalidRank {
                rank: self.me,
                op: op(),
                given: r,
                world_size: self.mesh.ranks.len(),
            });
        }
        Ok(())
    }

    fn gone(&self, peer: usize, op: String) -> DistError {
        let cause = if self.dead(self.me) {
            "this rank died (in-memory link)"
        } else {
            "the rank died (in-memory link)"
        };
        DistError::PeerGone {
            rank: self.me,
            peer,
            op,
            cause: cause.into(),
        }
    }
}

/// A receive posted on a [`MemLink`]: the message is copied into the buffer when waited on.
pub struct MemRecv<'a> {
    link: &'a MemLink,
    buf: &'a mut [u8],
    src: usize,
    tag: Tag,
    deadline: Instant,
    started: Instant,
}

impl std::fmt::Debug for MemRecv<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRecv")
            .field("src", &self.src)
            .field("tag", &self.tag)
            .field("len", &self.buf.len())
            .finish()
    }
}

impl PostedRecv for MemRecv<'_> {
    fn wait(self) -> Result<Meta> {
        let MemRecv {
            link,
            buf,
            src,
            tag,
            deadline,
            started,
        } = self;
        let (me, mesh) = (link.me, &link.mesh);
        let op = || format!("recv from {src} (tag {tag}, {} bytes)", buf.len());
        let mut st = mesh.lock(me);
        loop {
            if link.dead(me) {
                return Err(link.gone(src, op()));
            }
            let now = Instant::now();
            let mut wake = deadline;
            let front = st.queues.get(&(src, tag)).and_then(|q| q.front());
            match front {
                Some(m) if m.at <= now => {
                    if m.data.len() != buf.len() {
                        return Err(DistError::SizeMismatch {
                            rank: me,
                            peer: src,
                            op: op(),
                            expected: buf.len(),
                            got: m.data.len(),
                        });
                    }
                    buf.copy_from_slice(&m.data);
                    let meta = m.meta;
                    st.queues.get_mut(&(src, tag)).and_then(VecDeque::pop_front);
                    return Ok(meta);
                }
                Some(m) => wake = wake.min(m.at),
                None if link.dead(src) => return Err(link.gone(src, op())),
                None => {}
            }
            if tag.is_system()
                && let Some(n) = st.ending(tag, st.call_of(tag))
            {
                return Err(DistError::Aborted {
                    rank: me,
                    op: op(),
                    origin: n.origin,
                    culprit: n.culprit,
                    reason: n.reason.clone(),
                });
            }
            if now >= deadline {
                return Err(DistError::Timeout {
                    rank: me,
                    op: op(),
                    peer: src,
                    waited: started.elapsed(),
                });
            }
            st = mesh.ranks[me]
                .cond
                .wait_timeout(st, wake.saturating_duration_since(now))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Link for MemLink {
    type Recv<'a> = MemRecv<'a>;

    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.mesh.ranks.len()
    }

    fn send(
        &self,
        data: &[u8],
        dst: usize,
        tag: Tag,
        meta: Meta,
        _deadline: Instant,
        _beside: Option<&MemRecv<'_>>,
    ) -> Result<()> {
        let op = || format!("send to {dst} (tag {tag}, {} bytes)", data.len());
        self.check_rank(dst, &op)?;
        if self.dead(self.me) || self.dead(dst) {
            return Err(self.gone(dst, op()));
        }
        let nth = {
            let mut sent = self.mesh.ranks[self.me]
                .sent
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *sent += 1;
            *sent - 1
        };
        let hook = self
            .mesh
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let envelope = Envelope {
            src: self.me,
            dst,
            tag,
            len: data.len(),
            meta,
            nth,
        };
        let at = match hook.map_or(Delivery::Now, |h| h(&envelope)) {
            Delivery::Now => Instant::now(),
            Delivery::After(d) => Instant::now() + d,
            Delivery::Never => return Ok(()),
            Delivery::Die => {
                self.kill();
                return Err(self.gone(dst, op()));
            }
        };
        if self.dead(dst) {
            // It died while the send was on its way (a hook can kill it, as a peer exiting
            // while a send waits for room).
            return Err(self.gone(dst, op()));
        }
        let mut inbox = self.mesh.lock(dst);
        inbox
            .queues
            .entry((self.me, tag))
            .or_default()
            .push_back(Msg {
                data: data.to_vec(),
                meta,
                at,
            });
        self.mesh.ranks[dst].cond.notify_all();
        Ok(())
    }

    unsafe fn post<'a>(
        &'a self,
        buf: &'a mut [u8],
        src: usize,
        tag: Tag,
        deadline: Instant,
    ) -> Result<MemRecv<'a>> {
        let len = buf.len();
        self.check_rank(src, &|| format!("recv from {src} (tag {tag}, {len} bytes)"))?;
        Ok(MemRecv {
            link: self,
            buf,
            src,
            tag,
            deadline,
            started: Instant::now(),
        })
    }

    fn peek(&self, src: usize, tag: Tag) -> Option<(usize, Meta)> {
        let inbox = self.mesh.lock(self.me);
        let m = inbox.queues.get(&(src, tag))?.front()?;
        Some((m.data.len(), m.meta))
    }

    /// A dead rank's notice reaches nobody, and no notice reaches a dead rank (a process that
    /// died sends and hears nothing).
    fn abort(&self, tag: Tag, call: Option<u64>, reason: &str, culprit: Option<usize>) {
        self.notify(tag, call, reason, culprit.unwrap_or(self.me), culprit);
    }

    fn pass_on_abort(&self, tag: Tag, call: Option<u64>, reason: &str, origin: usize) {
        self.notify(tag, call, reason, origin, None);
    }
    fn abort_notice(&self) -> Option<(usize, String)> {
        let inbox = self.mesh.lock(self.me);
        let n = &inbox.aborts.first()?.notice;
        Some((n.origin, n.reason.clone()))
    }

    fn claim_group(&self) -> bool {
        !self.mesh.ranks[self.me]
            .group_claimed
            .swap(true, Ordering::AcqRel)
    }

    fn release_group(&self) {
        self.mesh.ranks[self.me]
            .group_claimed
            .store(false, Ordering::Release);
    }

    fn abort_notice_for(&self, tag: Tag, call: u64) -> Option<crate::link::Notice> {
        let inbox = self.mesh.lock(self.me);
        let n = inbox
            .aborts
            .iter()
            .find(|n| crate::link::notice_ends(n.tag, n.notice.call, tag, Some(call)))?;
        Some(crate::link::Notice {
            call: crate::link::call_in_group(n.tag, n.notice.call, tag),
            ..n.notice.clone()
        })
    }

    fn enter_call(&self, tag: Tag, call: u64) {
        let mut inbox = self.mesh.lock(self.me);
        inbox
            .calls
            .insert(tag.to_wire() & crate::subgroup::GROUP_ID_BITS, call);
        // Waits of this group that an earlier notice left waiting may end now.
        self.mesh.ranks[self.me].cond.notify_all();
    }

    fn flight(&self) -> Option<&FlightRecorder> {
        Some(&self.mesh.ranks[self.me].flight)
    }

    /// Every rank's position, from its own record (in memory, all are at hand).
    fn positions(&self) -> Option<String> {
        let all: Vec<_> = (self.mesh.ranks.iter().enumerate())
            .map(|(r, rank)| (r, rank.flight.position()))
            .collect();
        Some(describe_positions(&all))
    }

    fn arena(&self) -> Option<&dyn crate::arena::HostArena> {
        self.arena
            .as_ref()
            .map(|a| a as &dyn crate::arena::HostArena)
    }
}

/// Runs `f` on each of `n` ranks of a new in-memory link, each on a thread of its own, with the
/// group formed (rank `r`'s local tuning `tuning(r)`; rank 0's wins) and `timeout` as its
/// collectives' default; returns each rank's result, rank 0's first. A rank whose group does not
/// form gets that error.
pub fn run_group<R: Send>(
    n: usize,
    tuning: impl Fn(usize) -> Tuning + Sync,
    timeout: Duration,
    f: impl Fn(Group<MemLink>) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    run_links(MemLink::mesh(n), |link| {
        let t = tuning(link.rank());
        f(Group::form(link, t, timeout)?)
    })
}

/// Runs `f` on each of `links` (from [`MemLink::mesh`]), each on a thread of its own; returns
/// each one's result in the order given. A thread that panics is resumed here.
pub fn run_links<R: Send>(
    links: Vec<MemLink>,
    f: impl Fn(MemLink) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .map(|link| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("dist-mem-{}", link.rank()))
                    .spawn_scoped(s, move || f(link))
                    .expect("a thread for a test rank starts")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

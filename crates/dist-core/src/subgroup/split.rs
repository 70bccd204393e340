//! [`Subgroups`]: `split` and `new_group`, collective over a parent group. Every rank of the
//! parent sends one record (what it called, its color and key, an id it proposes, a digest of
//! its rank list) in one all_gather; from the records every rank works out its group, or the
//! same error as every other rank. A second all_gather of one byte says on which ranks the
//! proposed id is already live, so every member refuses it alike.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::collectives::{Collectives, Transport};
use crate::error::{DistError, Result};
use crate::group::Group;
use crate::link::Link;

use super::link::{LiveId, MAX_GROUP_ID, SplitLink, SubLink};

/// A sub-group of a transport whose link is `R`: a [`Group`] over a [`SubLink`] of `R`.
pub type SubGroup<R> = Group<SubLink<R>>;

/// The counter group ids are minted from, in this process. A minted id is
/// `count * root_world_size + root_rank + 1`, so no two mints (on any rank, in any process of
/// one job) give the same id; a group takes the id its rank 0 minted for the call that made it,
/// which no other group can take.
static MINTED: AtomicU64 = AtomicU64::new(0);

/// The length of one rank's record.
const RECORD: usize = 32;
/// What a record's call was.
const SPLIT: [u8; 4] = *b"dspl";
const NEW_GROUP: [u8; 4] = *b"dsng";
/// Record flags.
const COLORED: u32 = 1;
const BAD_LIST: u32 = 2;
const NO_ID: u32 = 4;

/// One rank's part in a split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    call: [u8; 4],
    flags: u32,
    color: u32,
    id: u32,
    key: i64,
    digest: u64,
}

impl Record {
    fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..4].copy_from_slice(&self.call);
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.color.to_le_bytes());
        b[12..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.digest.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Record {
        let w4 = |i: usize| [b[i], b[i + 1], b[i + 2], b[i + 3]];
        let w8 = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            x
        };
        Record {
            call: w4(0),
            flags: u32::from_le_bytes(w4(4)),
            color: u32::from_le_bytes(w4(8)),
            id: u32::from_le_bytes(w4(12)),
            key: i64::from_le_bytes(w8(16)),
            digest: u64::from_le_bytes(w8(24)),
        }
    }

    fn color(&self) -> Option<u32> {
        (self.flags & COLORED != 0).then_some(self.color)
    }
}

/// A new id for a group this rank may join, from this process's counter, as root rank `rank`
/// of `world` ranks; `None` once ids of 31 bits run out.
fn mint(rank: usize, world: usize) -> Option<u32> {
    let count = MINTED.fetch_add(1, Ordering::Relaxed);
    let id = count
        .checked_mul(world as u64)?
        .checked_add(rank as u64 + 1)?;
    (id <= MAX_GROUP_ID).then_some(id as u32)
}

/// Whether `id` is one root rank `rank` of `world` ranks can mint (`count * world + rank + 1`).
fn mintable(id: u32, rank: usize, world: usize) -> bool {
    id != 0 && world != 0 && (u64::from(id) - 1) % world as u64 == rank as u64
}

/// FNV-1a over the list's length and ranks (as u64, little-endian): the same on every rank.
fn digest(ranks: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(ranks.len() as u64);
    for &r in ranks {
        eat(r as u64);
    }
    h
}

/// Why `ranks` is no list of distinct ranks of a group of `n`, or `None`.
fn list_problem(ranks: &[usize], n: usize) -> Option<String> {
    if ranks.is_empty() {
        return Some("the list of ranks is empty".into());
    }
    let mut seen = vec![false; n];
    for &r in ranks {
        match seen.get_mut(r) {
            None => return Some(format!("rank {r} is out of range for a group of {n} ranks")),
            Some(true) => return Some(format!("rank {r} is in the list twice")),
            Some(s) => *s = true,
        }
    }
    None
}

/// Sub-groups of a group of ranks: for every [`Transport`] whose link can be split (a
/// `TcpBackend`, a [`Group`] over a root link, a sub-group itself).
///
/// Both calls are collectives over the parent: every rank of the parent must call the same one,
/// in the same order as its other collectives. The group returned has its own ranks numbered
/// from 0, its own sequence numbers and mismatch detection, every point-to-point
/// ([`Backend`](crate::Backend)) and collective ([`Collectives`]) call, the parent's timeout
/// and tuning, and shares the parent's connections (no new ones are made). It holds the root
/// link (a clone: for TCP, a shared handle on the connections), not a borrow of the parent, so
/// it may be moved to another thread and used there at the same time as the parent or other
/// groups. Groups nest: a sub-group's sub-groups are sub-groups of the same root.
///
/// Aborts: a collective that fails in any group aborts the root link, so every group over it
/// (and the parent) fails its later collectives on every rank, as one group does after a
/// failure (see [`SubLink::abort`]).
pub trait Subgroups: Transport<Link: SplitLink> {
    /// MPI_Comm_split: the ranks that pass the same `color` form a group, their ranks in it
    /// ordered by `(key, rank in the parent)`; a rank passing `None` (MPI_UNDEFINED) takes part
    /// and gets `Ok(None)`.
    fn split(
        &self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<SubGroup<<Self::Link as SplitLink>::Root>>> {
        let (flags, color) = match color {
            Some(c) => (COLORED, c),
            None => (0, 0),
        };
        divide(self.group(), SPLIT, flags, color, key, 0, None, None)
    }

    /// [`Subgroups::split`], the group named `name` in its errors
    /// (`all_reduce(f32 x 4, sum) in group "tensor" (rank 1 of 2 = backend rank 3)`) and by
    /// [`SubLink::name`]. The name is this rank's label for the group, not compared between
    /// ranks: give every member the same. Unnamed groups are named by their id (`0x9`).
    fn split_named(
        &self,
        color: Option<u32>,
        key: i64,
        name: &str,
    ) -> Result<Option<SubGroup<<Self::Link as SplitLink>::Root>>> {
        let (flags, color) = match color {
            Some(c) => (COLORED, c),
            None => (0, 0),
        };
        divide(self.group(), SPLIT, flags, color, key, 0, None, Some(name))
    }

    /// PyTorch's `new_group`: every rank of the parent passes the same list of distinct parent
    /// ranks; the listed ranks get `Ok(Some(group))`, with group rank `i` being `ranks[i]`, and
    /// the others `Ok(None)`. A list with a rank out of range or twice, an empty list, or lists
    /// that differ between ranks (compared by a 64-bit digest) is an
    /// [`DistError::InvalidArgument`] on every rank, saying which ranks passed what, and leaves
    /// the parent usable.
    fn new_group(
        &self,
        ranks: &[usize],
    ) -> Result<Option<SubGroup<<Self::Link as SplitLink>::Root>>> {
        new_group(self.group(), ranks, None)
    }

    /// [`Subgroups::new_group`], the group named `name` in its errors, as
    /// [`Subgroups::split_named`] names it.
    fn new_group_named(
        &self,
        ranks: &[usize],
        name: &str,
    ) -> Result<Option<SubGroup<<Self::Link as SplitLink>::Root>>> {
        new_group(self.group(), ranks, Some(name))
    }
}

impl<T: Transport<Link: SplitLink> + ?Sized> Subgroups for T {}

/// [`Subgroups::new_group`] over `g`, the group named `name`.
fn new_group<L: SplitLink>(
    g: &Group<L>,
    ranks: &[usize],
    name: Option<&str>,
) -> Result<Option<SubGroup<L::Root>>> {
    {
        let (me, n) = (g.link().rank(), g.link().world_size());
        let problem = list_problem(ranks, n);
        let position = ranks.iter().position(|&r| r == me);
        let (mut flags, key) = match position {
            Some(i) => (COLORED, i as i64),
            None => (0, 0),
        };
        if problem.is_some() {
            flags |= BAD_LIST;
        }
        divide(g, NEW_GROUP, flags, 0, key, digest(ranks), problem, name)
    }
}

/// The split itself: one all_gather of records over `g`, one of whether each rank's group id is
/// live there already, then every rank's group (named `group_name` in its errors), or the error
/// every rank gives.
#[allow(clippy::too_many_arguments)] // one record's fields, the caller's problem and the name
fn divide<L: SplitLink>(
    g: &Group<L>,
    call: [u8; 4],
    flags: u32,
    color: u32,
    key: i64,
    digest: u64,
    problem: Option<String>,
    group_name: Option<&str>,
) -> Result<Option<SubGroup<L::Root>>> {
    let link = g.link();
    let (me, n) = (link.rank(), link.world_size());
    let root = link.root_link();
    let id = mint(root.rank(), root.world_size());
    let mine = Record {
        call,
        flags: flags | if id.is_none() { NO_ID } else { 0 },
        color,
        id: id.unwrap_or(0),
        key,
        digest,
    };
    let name = if call == SPLIT { "split" } else { "new_group" };
    let mut all = vec![0u8; RECORD * n];
    g.all_gather(&mine.encode(), &mut all)
        .map_err(|e| e.with_op(name))?;
    let records: Vec<Record> = all.chunks_exact(RECORD).map(Record::decode).collect();
    let invalid = |reason: String| DistError::InvalidArgument {
        rank: me,
        op: name.into(),
        reason,
    };
    if let Some((r, other)) = records.iter().enumerate().find(|(_, x)| x.call != call) {
        let theirs = match other.call {
            SPLIT => "split",
            NEW_GROUP => "new_group",
            _ => "another all_gather",
        };
        return Err(invalid(format!(
            "rank {r} called {theirs} where this rank called {name}"
        )));
    }
    if call == NEW_GROUP {
        let bad: Vec<usize> = (0..n)
            .filter(|&r| records[r].flags & BAD_LIST != 0)
            .collect();
        if let Some(p) = problem {
            return Err(invalid(p));
        }
        if !bad.is_empty() {
            return Err(invalid(format!(
                "{} passed an invalid list of ranks",
                crate::flight::rank_list(&bad)
            )));
        }
        let differ: Vec<usize> = (0..n)
            .filter(|&r| records[r].digest != mine.digest)
            .collect();
        if !differ.is_empty() {
            return Err(invalid(format!(
                "{} passed a different list of ranks from this rank's",
                crate::flight::rank_list(&differ)
            )));
        }
    }
    // This rank's group: its members (parent ranks, by key), the id its leader proposed, and
    // why that id cannot be taken, which every member works out alike from the records.
    let plan = mine.color().map(|color| {
        let mut members: Vec<usize> = (0..n)
            .filter(|&r| records[r].color() == Some(color))
            .collect();
        members.sort_by_key(|&r| (records[r].key, r));
        let (leader, id) = (members[0], records[members[0]].id);
        let (w, lr) = (root.world_size(), link.root_rank(leader));
        let problem = if records[leader].flags & NO_ID != 0 {
            Some(format!(
                "rank {leader} (the new group's rank 0) has run out of group ids"
            ))
        } else if !mintable(id, lr, w) {
            Some(format!(
                "rank {leader} (the new group's rank 0) proposed group id {id:#x}, which is not \
                 one it can have made (its ids are k*{w}+{})",
                lr + 1
            ))
        } else {
            None
        };
        (members, id, problem)
    });
    // Whether another group over the root has the id here is known only here: every rank of
    // the parent says, so every member refuses the id alike.
    let live = match &plan {
        Some((_, id, None)) => Some(LiveId::reserve(root, *id)),
        _ => None,
    };
    let clash = u8::from(matches!(live, Some(None)));
    let mut clashes = vec![0u8; n];
    g.all_gather(&[clash], &mut clashes)
        .map_err(|e| e.with_op(name))?;
    let Some((members, id, problem)) = plan else {
        return Ok(None);
    };
    if let Some(p) = problem {
        return Err(invalid(p));
    }
    let live_at: Vec<usize> = members
        .iter()
        .copied()
        .filter(|&r| clashes[r] != 0)
        .collect();
    let Some(Some(live)) = live.filter(|_| live_at.is_empty()) else {
        return Err(invalid(format!(
            "rank {} (the new group's rank 0) proposed group id {id:#x}, which a live group \
             already has on {}",
            members[0],
            crate::flight::rank_list(&live_at)
        )));
    };
    let sub_me = members
        .iter()
        .position(|&r| r == me)
        .expect("this rank has its own color");
    let roots: Vec<usize> = members.iter().map(|&r| link.root_rank(r)).collect();
    let sub = SubLink::reserved(root.clone(), id, live, roots, sub_me)?.named(group_name);
    Group::form(sub, g.tuning(), g.timeout())
        .map(Some)
        .map_err(|e| e.with_op(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let r = Record {
            call: SPLIT,
            flags: COLORED | NO_ID,
            color: 7,
            id: 0x7fff_fffe,
            key: -3,
            digest: 0x0123_4567_89ab_cdef,
        };
        assert_eq!(Record::decode(&r.encode()), r);
        assert_eq!(r.color(), Some(7));
        assert_eq!(Record { flags: 0, ..r }.color(), None);
    }

    #[test]
    fn minted_ids_differ_between_ranks_and_mints() {
        let a = mint(0, 8).unwrap();
        let b = mint(0, 8).unwrap();
        let c = mint(3, 8).unwrap();
        assert_ne!(a, b);
        assert_eq!(a % 8, 1);
        assert_eq!(c % 8, 4);
        assert!(a > 0);
    }

    #[test]
    fn only_a_mintable_id_passes() {
        assert!(mintable(1, 0, 4));
        assert!(mintable(8, 3, 4));
        assert!(mintable(12, 3, 4));
        assert!(!mintable(9, 3, 4));
        assert!(!mintable(0, 3, 4));
    }

    /// Rank 3 of 4 leads a first group; in a split it then takes the leadership with
    /// `i64::MIN` and proposes a forged id: first one it cannot have minted, then the first
    /// group's id. Every other rank refuses both, naming the leader and the id (and, for the
    /// live one, where it is live), and the parent stays usable.
    #[test]
    fn a_leader_cannot_propose_a_foreign_or_live_id() {
        use crate::testing::run_group;
        use crate::{Backend, Collectives, ReduceOp, Tuning};
        use std::time::Duration;
        let out = run_group(
            4,
            |_| Tuning::default(),
            Duration::from_secs(20),
            |g| {
                let first = g.new_group(&[3, 0, 1, 2])?.expect("every rank is listed");
                let live = first.link().id();
                let mut errors = Vec::new();
                for forged in [live + 1, live] {
                    if g.rank() == 3 {
                        let r = Record {
                            call: SPLIT,
                            flags: COLORED,
                            color: 0,
                            id: forged,
                            key: i64::MIN,
                            digest: 0,
                        };
                        let mut all = vec![0u8; RECORD * 4];
                        g.all_gather(&r.encode(), &mut all)?;
                        let mut clashes = [0u8; 4];
                        g.all_gather(&[0u8], &mut clashes)?;
                    } else {
                        let e = g.split(Some(0), 0).expect_err("a forged id is refused");
                        errors.push((forged, e.to_string()));
                    }
                }
                let mut x = [1u64];
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                assert_eq!(x[0], 4);
                first.all_reduce(&mut x, ReduceOp::Sum)?;
                Ok((live, errors))
            },
        );
        for (r, o) in out.into_iter().enumerate() {
            let (live, errors) = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            if r == 3 {
                continue;
            }
            assert_eq!(errors.len(), 2, "rank {r}");
            let (foreign, e) = &errors[0];
            assert_eq!(*foreign, live + 1);
            assert!(
                e.contains("rank 3 (the new group's rank 0)"),
                "rank {r}: {e}"
            );
            assert!(e.contains(&format!("{foreign:#x}")), "rank {r}: {e}");
            assert!(e.contains("not one it can have made"), "rank {r}: {e}");
            let (_, e) = &errors[1];
            assert!(
                e.contains("rank 3 (the new group's rank 0)"),
                "rank {r}: {e}"
            );
            assert!(e.contains(&format!("group id {live:#x}")), "rank {r}: {e}");
            assert!(
                e.contains("a live group already has on ranks 0–2"),
                "rank {r}: {e}"
            );
        }
    }

    #[test]
    fn a_live_id_is_refused_until_its_group_is_dropped() {
        let link = crate::testing::MemLink::mesh(2).remove(0);
        let other = crate::testing::MemLink::mesh(2).remove(0);
        let a = LiveId::reserve(&link, 9).expect("not live yet");
        assert!(LiveId::reserve(&link.clone(), 9).is_none());
        assert!(
            LiveId::reserve(&other, 9).is_some(),
            "another root's ids are its own"
        );
        drop(a);
        assert!(LiveId::reserve(&link, 9).is_some());
    }

    #[test]
    fn list_problems_are_named() {
        assert_eq!(list_problem(&[2, 0], 4), None);
        assert!(list_problem(&[], 4).unwrap().contains("empty"));
        assert!(
            list_problem(&[1, 4], 4)
                .unwrap()
                .contains("rank 4 is out of range")
        );
        assert!(
            list_problem(&[1, 1], 4)
                .unwrap()
                .contains("rank 1 is in the list twice")
        );
        assert_ne!(digest(&[0, 1]), digest(&[1, 0]));
        assert_ne!(digest(&[0]), digest(&[0, 0]));
    }
}

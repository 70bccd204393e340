//! barrier, broadcast, reduce and all_gather on the host arena's small areas, for a group whose
//! ranks all share one host, with at most [`HOST_SMALL_MAX`] bytes a rank gives (and within
//! the areas, [`HostArena::small_len`]): the small all_reduce's areas, piece count, waits and
//! checks (`collectives/small.rs`); what each rank writes, waits for and reads differs:
//!
//! | collective | a rank writes into its area | waits for | then reads |
//! | --- | --- | --- | --- |
//! | barrier | nothing (the word and descriptor) | every peer's word | nothing |
//! | broadcast | the root its buffer, the others nothing | the root: nobody; the others: the root's word | the others the root's area |
//! | reduce | its input | every peer's word | the root every area, reduced in rank order |
//! | all_gather | its input | every peer's word | every peer's area, into that peer's block |
//!
//! A rank writes its area again two pieces later; it may only once every peer is done reading
//! it, which a wait for every peer's word of the piece between says (a peer publishes it once it
//! has finished the piece before). A broadcast does not wait so (its root leaves at once, as a
//! root over messages does, and runs of broadcasts overlap), so the rank's next piece on the
//! arena, whatever its collective, starts by waiting for every peer's `Input` word of the
//! broadcast ([`Host::ready_to_write`]): usually there already. That wait also checks each
//! peer's descriptor of the broadcast, so a broadcast whose ranks disagreed (on the root, say)
//! is an error at the root's next call on the arena, as over messages.
//!
//! A rank with nothing to give still writes its word and descriptor, so that a peer in another
//! collective, or the same with other arguments, finds the mismatch.
//!
//! The small areas are used once the group has agreed on the arena, which it does on its first
//! all_reduce: before it these collectives run over messages (a broadcast's root then only
//! sends, as callers may count on), after it every rank knows the same answer.

use crate::arena::{ArenaWord, HostArena};
use crate::error::Result;
use crate::group::Group;
use crate::link::Link;
use crate::types::{Element, ReduceOp};

use super::call::{Call, finish};
use super::consts::HOST_SMALL_MAX;
use super::desc::Kind;
use super::host::Host;
use super::scratch::{bytes, bytes_mut};
use super::small::Round;

/// The largest a rank's part may be for the small areas, before the arena is known: what every
/// rank can decide alike (the tuning's arena limit, the path's); `None` where the tuning keeps
/// the group off the arena (a limit of 0).
fn small_limit<L: Link>(g: &Group<L>) -> Option<usize> {
    let max = g.tuning().arena_max();
    (max > 0).then(|| HOST_SMALL_MAX.min(max))
}

/// The arena, where a call whose ranks each give `bytes` goes through the small areas: the group
/// has more than one rank, all on one host, has agreed on the arena (on its first all_reduce),
/// and `bytes` fits the areas and the tuning's arena limit (none where that is 0).
fn small_arena<'a, L: Link>(c: &'a Call<'_, L>, bytes: usize) -> Option<&'a dyn HostArena> {
    takes_small(c.g, bytes)
        .then(|| c.g.link().arena())
        .flatten()
}

/// Whether a call of `kind` whose ranks each give `bytes` goes through the small areas on group
/// `g`, as it stands (`false` before the group has agreed on its arena).
pub(super) fn kind_takes_small<L: Link>(g: &Group<L>, kind: Kind, bytes: usize) -> bool {
    let smalls = [
        Kind::AllReduce,
        Kind::Barrier,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
    ];
    smalls.contains(&kind) && takes_small(g, bytes)
}

/// Whether a call whose ranks each give `bytes` takes the small areas on group `g` now.
fn takes_small<L: Link>(g: &Group<L>, bytes: usize) -> bool {
    g.link().world_size() > 1
        && small_limit(g).is_some_and(|max| bytes <= max)
        && g.arena_in_use() == Some(true)
        && g.link()
            .arena()
            .is_some_and(|a| a.local().len() == g.link().world_size() && bytes <= a.small_len())
}

/// The barrier on the small areas, if the call takes them (`Ok(false)`: it does not, and nothing
/// was done).
pub(super) fn barrier<L: Link>(c: &Call<'_, L>) -> Result<bool> {
    let Some(a) = small_arena(c, 0) else {
        return Ok(false);
    };
    let h = Host::new(c, a, a.local())?;
    let target = h.small_round(&[])?.target;
    a.publish(ArenaWord::Reduced, target);
    Ok(true)
}

/// The broadcast of the root's `data` on the small areas, if the call takes them.
pub(super) fn broadcast<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    root: usize,
) -> Result<bool> {
    let Some(a) = small_arena(c, std::mem::size_of_val(data)) else {
        return Ok(false);
    };
    let h = Host::new(c, a, a.local())?;
    // No `Reduced` here: this rank publishes it at the start of its next piece on the arena,
    // once every peer has started this one (`Host::ready_to_write`).
    if c.me == root {
        // Waits for nobody: the next call makes sure every peer is done reading.
        h.small_put(bytes(data))?;
        return Ok(true);
    }
    let round = h.small_put(&[])?;
    h.wait_root(root, round)?;
    a.read_small(root, round.area, 0, bytes_mut(data))
        .map_err(|e| e.map_op(|_| c.op_text()))?;
    Ok(true)
}

/// The reduce of every rank's `data` into the root's on the small areas, if the call takes
/// them: the root reduces every input in rank order (the small all_reduce's reduction, so the
/// result is bitwise the one an all_reduce gives).
pub(super) fn reduce<T: Element, L: Link>(
    c: &Call<'_, L>,
    data: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<bool> {
    let Some(a) = small_arena(c, std::mem::size_of_val(data)) else {
        return Ok(false);
    };
    let h = Host::new(c, a, a.local())?;
    let Round { area, target, .. } = h.small_round(bytes(data))?;
    if c.me == root {
        let len = std::mem::size_of_val(data);
        h.reduce_from(data, 0, op, len.max(1), &|q, off, dst| {
            a.read_small(q, area, off, dst)
                .map_err(|e| e.map_op(|_| c.op_text()))
        })?;
        finish(data, op, c.n);
    }
    a.publish(ArenaWord::Reduced, target);
    Ok(true)
}

/// The all_gather of every rank's `input` into `output` (this rank's block already there) on
/// the small areas, if the call takes them.
pub(super) fn all_gather<T: Element, L: Link>(
    c: &Call<'_, L>,
    input: &[T],
    output: &mut [T],
) -> Result<bool> {
    let Some(a) = small_arena(c, std::mem::size_of_val(input)) else {
        return Ok(false);
    };
    let h = Host::new(c, a, a.local())?;
    let Round { area, target, .. } = h.small_round(bytes(input))?;
    let k = input.len();
    for q in (0..c.n).filter(|&q| q != c.me) {
        a.read_small(q, area, 0, bytes_mut(&mut output[q * k..(q + 1) * k]))
            .map_err(|e| e.map_op(|_| c.op_text()))?;
    }
    a.publish(ArenaWord::Reduced, target);
    Ok(true)
}

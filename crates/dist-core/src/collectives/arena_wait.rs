//! Waiting on a host-arena peer's sequence word ([`wait_word`]): looking at it, giving the core
//! away between looks, for the arena's spin time and [`YIELD`] more, then sleeping on it in
//! slices of [`SLICE`] until the call's deadline, with the checks between slices that find a
//! gone peer, an abort or a mismatched call. A value the protocol does not allow is a corrupt
//! arena: an error naming the peer.

use std::time::{Duration, Instant};

use crate::arena::{ArenaWord, HostArena};
use crate::error::{DistError, Result};
use crate::link::Link;

use super::call::Call;
use super::consts::COLLECTIVE_TAG;
use super::desc::Desc;

/// The longest sleep of an arena wait between checks of the peer, aborts and the deadline.
pub const SLICE: Duration = Duration::from_millis(50);

/// How long a wait yields its core, after its spin, before it sleeps.
const YIELD: Duration = Duration::from_micros(100);

/// Waits until rank `owner`'s `word` reaches `target` (by the call's deadline). The values the
/// protocol allows: `target - 1` (not yet), `target`, and for `Input` `target + 1` (the peer
/// has published the next piece already) and `target - 2` (not yet: after a small piece, which
/// a rank finishes once it read the peer's small area, written before the peer's `Input` word,
/// `collectives/small.rs`). Anything else is a corrupt arena: an error naming `owner`.
pub(super) fn wait_word<L: Link>(
    c: &Call<'_, L>,
    a: &dyn HostArena,
    owner: usize,
    word: ArenaWord,
    target: u32,
) -> Result<()> {
    wait_word_after(c, a, owner, word, target, None)
}

/// [`wait_word`], which also finds a mismatch in this rank's previous call (descriptor
/// `prior`, where given): a peer that says in the arena it is in a call of that number with
/// another descriptor (a broadcast whose root on the small areas waited for nobody, met on
/// this peer by a broadcast over messages, say).
pub(super) fn wait_word_after<L: Link>(
    c: &Call<'_, L>,
    a: &dyn HostArena,
    owner: usize,
    word: ArenaWord,
    target: u32,
    prior: Option<&crate::backend::Meta>,
) -> Result<()> {
    let (behind, ahead) = match word {
        ArenaWord::Input => (2, 1),
        ArenaWord::Reduced => (1, 0),
    };
    let reached = |v: u32| -> Result<bool> {
        word_reached(v, target, behind, ahead)
            .ok_or_else(|| corrupt(c, owner, word, v, target, (behind, ahead)))
    };
    // Spin for the arena's spin time, then some more, giving the core away between looks
    // (with more ranks than cores the peer waited for may need it: a pure busy loop here took
    // 7.6 times the time of an 8 B all_reduce at 4 ranks on 2 cores, 56 against 7.4 us,
    // commit a37476a); then sleep.
    let started = Instant::now();
    let until = a.spin() + YIELD;
    let mut v = a.load(owner, word);
    while !reached(v)? {
        if started.elapsed() >= until {
            return sleep_until(c, a, owner, (word, target), v, (started, prior), &reached);
        }
        std::thread::yield_now();
        v = a.load(owner, word);
    }
    Ok(())
}

/// The sleeping part of [`wait_word`]: slices of [`SLICE`] at most, with the checks between.
fn sleep_until<L: Link>(
    c: &Call<'_, L>,
    a: &dyn HostArena,
    owner: usize,
    (word, target): (ArenaWord, u32),
    mut v: u32,
    (started, prior): (Instant, Option<&crate::backend::Meta>),
    reached: &dyn Fn(u32) -> Result<bool>,
) -> Result<()> {
    let link = c.g.link();
    loop {
        if let Some(n) = c.abort_notice() {
            return Err(c.aborted(n));
        }
        a.check_peer(owner, &|| c.op_text())?;
        if let Some(p) = prior {
            let now = a.call(owner);
            let was = Desc::decode(p);
            if now != [0; 16] && Desc::decode(&now).seq == was.seq && now != *p {
                return Err(DistError::CollectiveMismatch {
                    rank: c.me,
                    op: format!(
                        "{} (found at the next call: {})",
                        was.describe(),
                        c.op_text()
                    ),
                    peer: owner,
                    detail: was.differences(&Desc::decode(&now)),
                });
            }
        }
        // A peer in another collective of the same number (which it says in the arena), or
        // one that sends that collective's messages: a mismatch. A peer still in an earlier
        // collective is late, not mismatched.
        let now = a.call(owner);
        let same_number = now != [0; 16] && Desc::decode(&now).seq == c.desc().seq;
        let sent = link.peek(owner, COLLECTIVE_TAG).map(|(_, m)| m);
        let found = match sent.filter(|m| *m != c.meta()) {
            Some(m) => Some(m),
            None => (same_number && now != c.meta()).then_some(now),
        };
        if let Some(m) = found {
            return Err(DistError::CollectiveMismatch {
                rank: c.me,
                op: c.op_text(),
                peer: owner,
                detail: c.desc().differences(&Desc::decode(&m)),
            });
        }
        let left = c.deadline().saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DistError::Timeout {
                rank: c.me,
                op: format!(
                    "{} (its {} word on the host arena, at {v}, waited for {target})",
                    c.op_text(),
                    word.name()
                ),
                peer: owner,
                waited: started.elapsed(),
            });
        }
        a.sleep(owner, word, v, left.min(SLICE));
        v = a.load(owner, word);
        if reached(v)? {
            return Ok(());
        }
    }
}

/// Whether a peer's word `v` has reached `target`: `Some(false)` from `target - behind` to
/// `target - 1` (not yet), `Some(true)` from `target` to `target + ahead`, `None` for any other
/// value (not one the protocol allows: a corrupt arena). Wrapping at 2³².
pub(super) fn word_reached(v: u32, target: u32, behind: u32, ahead: u32) -> Option<bool> {
    match v.wrapping_sub(target.wrapping_sub(behind)) {
        d if d < behind => Some(false),
        d if d <= behind + ahead => Some(true),
        _ => None,
    }
}

fn corrupt<L: Link>(
    c: &Call<'_, L>,
    owner: usize,
    word: ArenaWord,
    v: u32,
    target: u32,
    (behind, ahead): (u32, u32),
) -> DistError {
    DistError::PeerGone {
        rank: c.me,
        peer: owner,
        op: c.op_text(),
        cause: format!(
            "corrupt host arena: its {} word is {v}, where this rank waits for {target} \
             (possible: {} to {})",
            word.name(),
            target.wrapping_sub(behind),
            target.wrapping_add(ahead)
        ),
    }
}

//! Two lanes: a large collective cut in two halves that go round two rings (or chains) at once,
//! in opposite directions, one on the caller's thread and one on the group's lane thread.

use crate::error::{DistError, Result};
use crate::link::Link;

use super::call::{Call, abort_all};

/// Whether a collective moving `bytes` in all runs two rings (or chains) at once: the group
/// has two lanes, there are three ranks or more (with two, both rings would share the one
/// connection), and `bytes` reaches the collective's threshold `min`
/// ([`TWO_RINGS_MIN`](super::consts::TWO_RINGS_MIN),
/// [`ALL_GATHER_TWO_RINGS_MIN`](super::consts::ALL_GATHER_TWO_RINGS_MIN),
/// [`BROADCAST_TWO_CHAINS_MIN`](super::consts::BROADCAST_TWO_CHAINS_MIN)).
pub(super) fn two_rings<L: Link>(c: &Call<'_, L>, bytes: usize, min: usize) -> bool {
    c.g.tuning().lanes >= 2 && c.n >= 3 && bytes >= min
}

/// Runs the two lanes at once (`Group::run_beside`). The first lane to fail tells every rank at
/// once (so that the other lane, here and elsewhere, stops waiting), and its error is the
/// call's. Where the two run one after the other instead, that is still correct: each lane
/// moves on its own connections and tag, so the other ranks' lanes wait for this one's (within
/// the deadline) but never block it.
pub(super) fn two_lanes<L: Link>(
    c: &Call<'_, L>,
    first: impl FnOnce(&Call<'_, L>) -> Result<()>,
    second: impl FnOnce(&Call<'_, L>) -> Result<()> + Send,
) -> Result<()> {
    let report = |r: Result<()>| {
        if let Err(e) = &r {
            abort_all(c.g, e, Some(c.number()));
        }
        r
    };
    let (mut first, mut second) = (Some(first), Some(second));
    let (mut ra, mut rb) = (None, None);
    c.g.run_beside(&mut || ra = first.take().map(|f| report(f(c))), &mut || {
        rb = second.take().map(|f| report(f(c)))
    });
    let not_run = || Err(c.invalid("a ring lane did not run".into()));
    match (ra.unwrap_or_else(not_run), rb.unwrap_or_else(not_run)) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        // One lane's failure aborts the other: report the cause, not the echo.
        (Err(a), Err(b)) => Err(match a {
            DistError::Aborted { .. } if !matches!(b, DistError::Aborted { .. }) => b,
            a => a,
        }),
    }
}

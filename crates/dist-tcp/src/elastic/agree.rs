//! The agreement on an epoch's members through the job's store (the keys under
//! `<job prefix>/elastic/<epoch>`; see the parent module's text): the survivors of the last
//! epoch, and the joiners the proposer found waiting.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_core::{DistError, Result};
use dist_store::{PrefixStore, Store, StoreError, TcpStore};

use super::joiners::PRESENT;
use super::left;

/// The key of job rank `id`'s check-in.
fn here_key(id: usize) -> String {
    format!("here/{id}")
}

/// The members as the `members` key holds them.
pub(super) fn encode(members: &[usize]) -> String {
    members
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The members a `members` value names: job ranks of `current` or joiners' (from
/// `first_new`), ascending, none twice, at least one; `None` for anything else.
pub(super) fn decode(v: &[u8], current: &[usize], first_new: usize) -> Option<Vec<usize>> {
    let text = std::str::from_utf8(v).ok()?;
    let ids = text
        .split(',')
        .map(|t| t.parse::<usize>().ok())
        .collect::<Option<Vec<usize>>>()?;
    let ascending = ids.windows(2).all(|w| w[0] < w[1]);
    let known = |i: &usize| current.contains(i) || *i >= first_new;
    (!ids.is_empty() && ascending && ids.iter().all(known)).then_some(ids)
}

/// What this rank proposes: itself, and every rank of `current` that checked in (`here`) and
/// that it does not know failed.
fn proposal(
    current: &[usize],
    me: usize,
    failed: &BTreeSet<usize>,
    mut here: impl FnMut(usize) -> bool,
) -> Vec<usize> {
    current
        .iter()
        .copied()
        .filter(|&id| id == me || (!failed.contains(&id) && here(id)))
        .collect()
}

/// The members of epoch `epoch` (job ranks), agreed through `keys` (`<job prefix>/elastic/<epoch>`):
/// see the module's text.
#[allow(clippy::too_many_arguments)]
pub(super) fn agree(
    keys: &PrefixStore<&TcpStore>,
    rank: usize,
    epoch: u64,
    me: usize,
    current: &[usize],
    failed: &BTreeSet<usize>,
    keeper: Option<usize>,
    window: Duration,
    deadline: Instant,
    first_new: usize,
    waiting: &mut dyn FnMut() -> std::result::Result<Vec<usize>, StoreError>,
) -> Result<Vec<usize>> {
    let err = |e: StoreError| DistError::Io {
        rank,
        context: format!("agree on group epoch {epoch} through the job's store"),
        source: std::io::Error::other(crate::init::store_error_text(&e)),
    };
    keys.set(&here_key(me), b"1").map_err(err)?;
    if crate::testing::dies_in_recovery() {
        tracing::warn!(rank, epoch, "exiting after the check-in, as a test asked");
        std::process::exit(0);
    }
    let decided = if keys.check(&["members"]).map_err(err)? {
        keys.get("members", PRESENT).map_err(err)?
    } else {
        let expected: Vec<String> = current
            .iter()
            .filter(|id| **id != me && !failed.contains(id))
            .map(|&id| here_key(id))
            .collect();
        let refs: Vec<&str> = expected.iter().map(String::as_str).collect();
        let until = deadline.min(Instant::now() + window);
        match keys.wait(&refs, left(until)) {
            Ok(()) | Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(err(e)),
        }
        // The rank that serves the store lives while the store answers: its check-in is
        // waited for until the deadline, not the window, so that it is always a member (a
        // survivor left without it would have no store).
        if let Some(k) = keeper.filter(|&k| k != me && current.contains(&k)) {
            match keys.wait(&[&here_key(k)], left(deadline)) {
                Ok(()) | Err(StoreError::Timeout { .. }) => {}
                Err(e) => return Err(err(e)),
            }
        }
        let mut checks = Ok(());
        let mine = proposal(current, me, failed, |id| {
            match keys.check(&[&here_key(id)]) {
                Ok(there) => there,
                Err(e) => {
                    checks = Err(e);
                    false
                }
            }
        });
        checks.map_err(err)?;
        // The joiners waiting, after every survivor: their job ranks are above all others'.
        let mut mine = mine;
        mine.extend(waiting().map_err(err)?);
        mine.sort_unstable();
        mine.dedup();
        tracing::debug!(rank, epoch, ?mine, ?failed, "proposing");
        keys.compare_set("members", b"", encode(&mine).as_bytes())
            .map_err(err)?
    };
    decode(&decided, current, first_new).ok_or_else(|| DistError::InvalidArgument {
        rank,
        op: format!("agree on group epoch {epoch}"),
        reason: format!(
            "the store's members key holds {:?}, not ascending job ranks of the last epoch \
             {current:?} or of joiners (from {first_new})",
            String::from_utf8_lossy(&decided)
        ),
    })
}

/// Runs `f` on the keys of epoch `epoch` (`<base>/elastic/<epoch>`), and on the joiners'
/// (`<base>/elastic`), through a new connection to
/// the store at `server`, its operations bounded by the time left to `deadline`.
pub(super) fn agree_through<T>(
    server: &str,
    base: &str,
    rank: usize,
    epoch: u64,
    deadline: Instant,
    f: impl FnOnce(&PrefixStore<&TcpStore>, &PrefixStore<&TcpStore>) -> Result<T>,
) -> Result<T> {
    let client = TcpStore::connect(server, left(deadline))
        .map_err(|e| DistError::Io {
            rank,
            context: format!(
                "connect to the job's store at {server} to agree on group epoch {epoch}"
            ),
            source: std::io::Error::other(crate::init::store_error_text(&e)),
        })?
        .with_timeout(left(deadline));
    f(
        &PrefixStore::new(format!("{base}/elastic/{epoch}"), &client),
        &PrefixStore::new(format!("{base}/elastic"), &client),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_and_bad_values_are_refused() {
        let current = [0, 2, 3, 5];
        assert_eq!(
            decode(encode(&[0, 3]).as_bytes(), &current, 6),
            Some(vec![0, 3])
        );
        // Joiners' job ranks come from 6 (the job began with 6 ranks), after the others.
        assert_eq!(
            decode(encode(&[0, 3, 6, 7]).as_bytes(), &current, 6),
            Some(vec![0, 3, 6, 7])
        );
        for bad in ["", "3,0", "0,0", "0,1", "x", "0,,3", "-1", "7,6", "0,4"] {
            assert_eq!(decode(bad.as_bytes(), &current, 6), None, "{bad:?}");
        }
    }

    #[test]
    fn a_proposal_keeps_this_rank_and_drops_the_failed_and_the_absent() {
        let failed: BTreeSet<usize> = [3].into();
        // 5 never checked in; 3 checked in but this rank knows it failed; 2 is this rank,
        // counted whether or not its own check-in is seen.
        let here = |id: usize| id == 0 || id == 3;
        assert_eq!(proposal(&[0, 2, 3, 5], 2, &failed, here), vec![0, 2]);
        // A rank others blame still proposes itself.
        let failed: BTreeSet<usize> = [2].into();
        assert_eq!(proposal(&[0, 2], 2, &failed, |_| true), vec![0, 2]);
    }
}

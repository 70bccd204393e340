//! The joiners' keys in the job's store (under `<job prefix>/elastic`): the job's facts a
//! joiner reads, its registration and ticket, the members' look for joiners waiting, and the
//! verdict that settles each one (see the parent module's table).

use dist_core::{DistError, Result};
use dist_store::{PrefixStore, Store, StoreError, TcpStore};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::admission::{Admission, Moment};

/// The key of the job's facts.
pub(super) const JOB: &str = "job";
/// The key counting the joiners that registered.
pub(super) const JOINERS: &str = "joiners";
/// The key of the joiners' low-water mark: every joiner id below the job rank it holds has a
/// verdict (taken in, refused or withdrawn), so that a look for joiners starts there rather
/// than reading again every joiner the job ever settled.
pub(super) const SETTLED: &str = "settled";
/// The most joiner ids one look for joiners reads (from the low-water mark [`SETTLED`]), one
/// or two store round trips each: the count of joiners is a counter anyone who reaches the
/// store can raise, and a look must end within its call's timeout however high it is. Joiners
/// past the bound are looked at once those before them are settled.
pub(super) const SCAN_AT_MOST: usize = 256;
/// The key of the last epoch formed.
pub(super) const EPOCH: &str = "epoch";
/// The verdict of a joiner that gave up waiting.
pub(super) const WITHDRAWN: &str = "withdrawn";
/// The start of a refusal's verdict.
pub(super) const REFUSED: &str = "refused: ";
/// How long a read of a key seen present may wait for it: a get waits for its key first, and
/// that wait, however short the key's presence makes it, takes a round trip to a store that
/// may be busy (a 1 ms bound timed out at 64 ranks on 2 cores).
pub(super) const PRESENT: std::time::Duration = std::time::Duration::from_secs(10);

/// Joiner `id`'s ticket.
pub(super) fn ticket_key(id: usize) -> String {
    format!("join/{id}")
}

/// Joiner `id`'s verdict: the epoch it is admitted at, a refusal, or its withdrawal; set once
/// (`compare_set` from empty), so that the first of them stands.
pub(super) fn verdict_key(id: usize) -> String {
    format!("join/{id}/verdict")
}

/// What a joiner must know of the job, from its `job` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Facts {
    /// The job's size at epoch 0: the k-th joiner takes job rank `first_world + k - 1`.
    pub(super) first_world: usize,
    /// The job rank of the rank that serves the store, where one of the job's does.
    pub(super) keeper: Option<usize>,
}

impl Facts {
    pub(super) fn encode(&self) -> String {
        match self.keeper {
            Some(k) => format!("{} {k}", self.first_world),
            None => format!("{} -", self.first_world),
        }
    }

    pub(super) fn decode(v: &[u8]) -> Option<Facts> {
        let (w, k) = std::str::from_utf8(v).ok()?.split_once(' ')?;
        let keeper = match k {
            "-" => None,
            k => Some(k.parse().ok()?),
        };
        Some(Facts {
            first_world: w.parse().ok()?,
            keeper,
        })
    }

    /// The job's facts, or `None` where no elastic job has put them under `root`.
    pub(super) fn read(
        root: &PrefixStore<&TcpStore>,
    ) -> std::result::Result<Option<Facts>, StoreError> {
        if !root.check(&[JOB])? {
            return Ok(None);
        }
        let v = root.get(JOB, PRESENT)?;
        Ok(Facts::decode(&v))
    }
}

/// The proof joiner `id` gives of the shared secret: HMAC-SHA256 of the job's prefix, its job
/// rank and its nonce (the secret never goes into the store).
fn proof(secret: &[u8], base: &str, id: usize, nonce: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"dist-join\0");
    mac.update(base.as_bytes());
    mac.update(b"\0");
    mac.update(id.to_string().as_bytes());
    mac.update(b"\0");
    mac.update(nonce);
    mac
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 128 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Joiner `id`'s ticket: `open <nonce>` without a secret, `proof <nonce> <hmac>` with one.
pub(super) fn ticket(secret: Option<&[u8]>, base: &str, id: usize, nonce: &[u8]) -> String {
    match secret {
        None => format!("open {}", hex(nonce)),
        Some(s) => format!(
            "proof {} {}",
            hex(nonce),
            hex(&proof(s, base, id, nonce).finalize().into_bytes())
        ),
    }
}

/// Why joiner `id`'s ticket is refused by a member with `secret`, if it is.
pub(super) fn refusal(
    ticket: &[u8],
    secret: Option<&[u8]>,
    base: &str,
    id: usize,
) -> Option<String> {
    let text = String::from_utf8_lossy(ticket);
    let words: Vec<&str> = text.split(' ').collect();
    match (words.as_slice(), secret) {
        (["open", _], None) => None,
        (["open", _], Some(_)) => {
            Some("the job has a shared secret and the joiner proved none (DIST_SECRET)".into())
        }
        (["proof", _, _], None) => {
            Some("the joiner has a shared secret and the job has none (DIST_SECRET)".into())
        }
        (["proof", nonce, mac], Some(s)) => match (unhex(nonce), unhex(mac)) {
            (Some(n), Some(m)) if proof(s, base, id, &n).verify_slice(&m).is_ok() => None,
            (Some(_), Some(_)) => Some(
                "wrong shared secret: the joiner's proof does not match the job's secret \
                 (DIST_SECRET)"
                    .into(),
            ),
            _ => Some(format!("a malformed ticket of {} bytes", ticket.len())),
        },
        _ => Some(format!("a malformed ticket of {} bytes", ticket.len())),
    }
}

/// What the members need to find the joiners waiting.
pub(super) struct Intake<'a> {
    pub(super) root: &'a PrefixStore<&'a TcpStore>,
    /// `<job prefix>`: the proofs are bound to it.
    pub(super) base: &'a str,
    pub(super) secret: Option<&'a [u8]>,
    pub(super) policy: Admission,
    pub(super) moment: Moment,
    /// When the look stops: the joiners found by then are those waiting.
    pub(super) deadline: std::time::Instant,
}

impl Intake<'_> {
    /// The joiners to take in now, by job rank, ascending (none where the policy says to wait):
    /// those registered with a ticket and no verdict, that are not of `current`, among the
    /// [`SCAN_AT_MOST`] ids from the low-water mark ([`SETTLED`]), found before the deadline.
    /// A ticket that fails its check is refused here (its verdict says why) and left out.
    pub(super) fn waiting(&self, current: &[usize]) -> std::result::Result<Vec<usize>, StoreError> {
        let Some(facts) = Facts::read(self.root)? else {
            return Ok(Vec::new());
        };
        let registered = usize::try_from(self.root.add(JOINERS, 0)?).unwrap_or(0);
        let end = facts.first_world.saturating_add(registered);
        let from = if self.root.check(&[SETTLED])? {
            let v = self.root.get(SETTLED, PRESENT)?;
            std::str::from_utf8(&v)
                .ok()
                .and_then(|t| t.parse::<usize>().ok())
                .unwrap_or(0)
                .max(facts.first_world)
        } else {
            facts.first_world
        };
        let to = end.min(from.saturating_add(SCAN_AT_MOST));
        // Every id below `low` is settled.
        let mut low = from;
        let mut out = Vec::new();
        for id in from..to {
            if std::time::Instant::now() >= self.deadline {
                tracing::warn!(
                    looked_at = id - from,
                    registered,
                    "the look for joiners ran out of time; taking those found"
                );
                break;
            }
            let settled = current.contains(&id) || self.root.check(&[&verdict_key(id)])?;
            if settled {
                if low == id {
                    low = id + 1;
                }
                continue;
            }
            if !self.root.check(&[&ticket_key(id)])? {
                continue;
            }
            let t = self.root.get(&ticket_key(id), PRESENT)?;
            match refusal(&t, self.secret, self.base, id) {
                None => out.push(id),
                Some(why) => {
                    tracing::warn!(joiner = id, %why, "joiner refused");
                    self.root.compare_set(
                        &verdict_key(id),
                        b"",
                        format!("{REFUSED}{why}").as_bytes(),
                    )?;
                    if low == id {
                        low = id + 1;
                    }
                }
            }
        }
        // A verdict is never taken back: any mark written here stays true, whichever of two
        // looks writes last.
        if low > from {
            self.root.set(SETTLED, low.to_string().as_bytes())?;
        }
        Ok(if self.policy.takes(out.len(), self.moment) {
            out
        } else {
            Vec::new()
        })
    }
}

/// After the agreement on epoch `epoch`: the verdict of each joiner of `agreed` not in
/// `current` is set to the epoch, unless it is set already. Returns the joiners whose verdict
/// is not this epoch (one withdrew before it was taken in): every rank reads the same verdicts,
/// so every rank leaves them out of the next try.
pub(super) fn settle(
    root: &PrefixStore<&TcpStore>,
    epoch: u64,
    agreed: &[usize],
    current: &[usize],
) -> std::result::Result<Vec<usize>, StoreError> {
    let mine = epoch.to_string();
    let mut gone = Vec::new();
    for &id in agreed.iter().filter(|id| !current.contains(id)) {
        let v = root.compare_set(&verdict_key(id), b"", mine.as_bytes())?;
        if v != mine.as_bytes() {
            gone.push(id);
        }
    }
    Ok(gone)
}

/// A store failure on the joiners' keys as rank `rank`'s error.
pub(super) fn store_err(rank: usize, what: &str) -> impl Fn(StoreError) -> DistError + '_ {
    move |e| DistError::Io {
        rank,
        context: what.to_string(),
        source: std::io::Error::other(crate::init::store_error_text(&e)),
    }
}

/// Puts the facts of an elastic job's epoch 0 in the store, on its rank 0, for joiners.
pub(crate) fn announce(b: &crate::TcpBackend) -> Result<()> {
    use dist_core::Backend;
    if b.rank() != 0 {
        return Ok(());
    }
    let store = b.store_under("elastic");
    let facts = Facts {
        first_world: b.world_size(),
        keeper: b.keeper,
    };
    let err = |e: StoreError| DistError::Io {
        rank: 0,
        context: "put the elastic job's facts in its store, for joiners".into(),
        source: std::io::Error::other(crate::init::store_error_text(&e)),
    };
    store.set(JOB, facts.encode().as_bytes()).map_err(err)?;
    store
        .set(
            EPOCH,
            format!("0 {}", super::agree::encode(b.members())).as_bytes(),
        )
        .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_passes_only_with_the_same_secret_prefix_and_rank() {
        let n = [7u8; 16];
        let t = ticket(Some(b"0123456789abcdef"), "dist/0", 4, &n);
        assert_eq!(
            refusal(t.as_bytes(), Some(b"0123456789abcdef"), "dist/0", 4),
            None
        );
        let wrong = refusal(t.as_bytes(), Some(b"fedcba9876543210"), "dist/0", 4).unwrap();
        assert!(wrong.contains("wrong shared secret"), "{wrong}");
        assert!(refusal(t.as_bytes(), Some(b"0123456789abcdef"), "dist/1", 4).is_some());
        assert!(refusal(t.as_bytes(), Some(b"0123456789abcdef"), "dist/0", 5).is_some());
        assert!(
            refusal(t.as_bytes(), None, "dist/0", 4)
                .unwrap()
                .contains("job has none")
        );
        let open = ticket(None, "dist/0", 4, &n);
        assert_eq!(refusal(open.as_bytes(), None, "dist/0", 4), None);
        assert!(
            refusal(open.as_bytes(), Some(b"0123456789abcdef"), "dist/0", 4)
                .unwrap()
                .contains("proved none")
        );
        for bad in ["", "proof zz 00", "proof 00", "open", "x y z"] {
            assert!(
                refusal(bad.as_bytes(), Some(b"k"), "dist/0", 4).is_some(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn facts_round_trip() {
        for f in [
            Facts {
                first_world: 4,
                keeper: Some(0),
            },
            Facts {
                first_world: 64,
                keeper: None,
            },
        ] {
            assert_eq!(Facts::decode(f.encode().as_bytes()), Some(f));
        }
        assert_eq!(Facts::decode(b"4"), None);
        assert_eq!(Facts::decode(b"x 0"), None);
    }
}

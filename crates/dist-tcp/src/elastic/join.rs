//! Growing: a new process joins a running elastic job through its store
//! ([`TcpBackend::join`]), and the members take it in at the next epoch
//! ([`TcpBackend::admit`] between steps, or [`TcpBackend::recover`]).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dist_core::{Collectives, DistError, Result};
use dist_store::{PrefixStore, Store, StoreError, TcpStore};

use super::admission::Moment;
use super::agree::decode;
use super::joiners::{
    EPOCH, Facts, Intake, JOINERS, PRESENT, REFUSED, WITHDRAWN, store_err, ticket, ticket_key,
    verdict_key,
};
use super::recover::{Mover, deadline_in};
use super::{FORM_AT_LEAST, left};
use crate::{TcpBackend, TcpConfig};

/// The variable a launcher sets (to `1`) in the environment of a process it starts to join a
/// running job rather than form it: `dist-run --replace` does, for a rank's replacement.
pub const JOIN_ENV: &str = "DIST_JOIN";

/// Whether this process was started to join a running job ([`JOIN_ENV`] is `1`).
pub fn joining() -> bool {
    std::env::var(JOIN_ENV).is_ok_and(|v| v.trim() == "1")
}

impl TcpBackend {
    /// Joins a running elastic job ([`TcpConfig::elastic`]) as a new member: through the job's
    /// store at `cfg`'s master address, under its prefix ([`TcpConfig::store_prefix`]); `cfg`'s
    /// rank and world size are not used. The joiner registers (it takes the next job rank
    /// after every rank the job has had, so it comes last in any epoch) with a proof of the
    /// shared secret, then waits: the members take it in at their next
    /// [`TcpBackend::admit`] or [`TcpBackend::recover`], as their policy
    /// ([`TcpConfig::admission`]) says. It returns the backend of the epoch that took it in,
    /// whose rank 0 is a member: receive the job's state from it (a broadcast) before the
    /// first collective of your own.
    ///
    /// A job that is not there (no elastic job under the prefix at that store) is an error at
    /// once; a joiner whose proof fails (another secret, or none where the job has one) is
    /// refused by the first member to look at it, with an error saying why; one that no
    /// member takes in before `timeout` withdraws and gets [`DistError::Timeout`] naming the
    /// last epoch formed. Use the job's own configuration otherwise (its peer timeout,
    /// formation, shared memory and sealing).
    pub fn join(cfg: TcpConfig, timeout: Duration) -> Result<TcpBackend> {
        cfg.validate()?;
        let started = Instant::now();
        let deadline = deadline_in(cfg.rank, "join", timeout)?;
        let mut cfg = cfg;
        cfg.serve_store = false;
        let base = format!("{}/0", cfg.store_prefix);
        let client = TcpStore::connect(cfg.master.as_str(), left(deadline))
            .map_err(|e| DistError::Io {
                rank: cfg.rank,
                context: format!("join: connect to the job's store at {}", cfg.master),
                source: std::io::Error::other(crate::init::store_error_text(&e)),
            })?
            .with_timeout(cfg.timeout.min(timeout));
        let at = client.server().to_string();
        let root = PrefixStore::new(format!("{base}/elastic"), &client);
        let facts = Facts::read(&root)
            .map_err(store_err(cfg.rank, "join: read the job's facts"))?
            .ok_or_else(|| DistError::HandshakeRefused {
                rank: cfg.rank,
                peer: format!("the job's store at {at}"),
                reason: format!(
                    "no elastic job under prefix {base}: key {base}/elastic/job is absent (is \
                     the job running, elastic (TcpConfig::elastic, DIST_ELASTIC=1), with this \
                     MASTER_ADDR, MASTER_PORT and DIST_STORE_PREFIX?)"
                ),
            })?;
        let k = root
            .add(JOINERS, 1)
            .map_err(store_err(cfg.rank, "join: register"))?;
        let id = facts.first_world + usize::try_from(k).unwrap_or(1).saturating_sub(1);
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| DistError::Io {
            rank: id,
            context: "join: draw a random nonce".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        root.set(
            &ticket_key(id),
            ticket(cfg.secret.as_deref(), &base, id, &nonce).as_bytes(),
        )
        .map_err(store_err(id, "join: put the ticket in the store"))?;
        tracing::info!(id, store = %at, "registered to join; waiting to be taken in");
        let job = || format!("the elastic job under {base} at {at}");
        let verdict = wait_for_verdict(&root, id, deadline)?;
        let text = String::from_utf8_lossy(&verdict).into_owned();
        if let Some(why) = text.strip_prefix(REFUSED) {
            return Err(DistError::HandshakeRefused {
                rank: id,
                peer: job(),
                reason: why.to_string(),
            });
        }
        if text == WITHDRAWN {
            let last = root
                .check(&[EPOCH])
                .ok()
                .filter(|&there| there)
                .and_then(|_| root.get(EPOCH, PRESENT).ok())
                .map(|v| String::from_utf8_lossy(&v).into_owned());
            let last = match last.as_deref().and_then(|l| l.split_once(' ')) {
                Some((e, m)) => format!("the last epoch formed is {e}, members {m}"),
                None => "no epoch formed is recorded".into(),
            };
            return Err(DistError::Timeout {
                rank: id,
                op: format!(
                    "join {} as job rank {id}: no member took it in ({last}; the members take \
                     joiners in at admit or recover, as their admission policy says)",
                    job()
                ),
                peer: facts.keeper.unwrap_or(0),
                waited: started.elapsed(),
            });
        }
        let epoch: u64 = text.parse().map_err(|_| DistError::HandshakeRefused {
            rank: id,
            peer: job(),
            reason: format!("its verdict key holds {text:?}, neither an epoch nor a refusal"),
        })?;
        let keys = PrefixStore::new(format!("{base}/elastic/{epoch}"), &client);
        // Present: the verdict is set after the agreement.
        let v = keys
            .get("members", PRESENT)
            .map_err(store_err(id, "join: read the members that took it in"))?;
        // Any job rank: the joiner knows none of the members yet.
        let agreed = decode(&v, &[], 0)
            .filter(|m| m.contains(&id))
            .ok_or_else(|| DistError::HandshakeRefused {
                rank: id,
                peer: job(),
                reason: format!(
                    "its verdict says epoch {epoch}, whose members key holds {:?}, without it",
                    String::from_utf8_lossy(&v)
                ),
            })?;
        tracing::info!(id, epoch, members = ?agreed, "taken in");
        let current: Vec<usize> = agreed.iter().copied().filter(|&m| m != id).collect();
        Mover {
            cfg,
            store_at: at,
            base,
            server: None,
            keeper: facts.keeper,
            my_id: id,
            me: id,
            // Taken in: it forms the epoch with the members, however little was left.
            deadline: deadline.max(Instant::now() + FORM_AT_LEAST),
            moment: Moment::Recovery,
        }
        .advance(epoch, current, BTreeSet::new(), Some(agreed))
    }

    /// Takes in the processes waiting to join ([`TcpBackend::join`]), if the policy
    /// ([`TcpConfig::admission`]) says to now: a collective, called by every member at the
    /// same point between steps (as NCCL's grow and torchft's quorum are). Rank 0 looks in the
    /// store for joiners (one look per call; the members do not look on any other call), and
    /// tells the others by a broadcast. With none to take in, it returns this backend as it
    /// is; otherwise the members move to the next epoch without revoking anything: they agree
    /// (as [`TcpBackend::recover`] does) on the members, every survivor and then the joiners,
    /// and form it, which returns once every member, the joiners too, is ready in it (with
    /// [`Formation::Lazy`](crate::Formation::Lazy), each pair connects on first use). Compare
    /// [`TcpBackend::epoch`] before and after, and when it changed send the job's state to the
    /// joiners (a broadcast from rank 0) before the next step.
    ///
    /// Should the broadcast fail (a member failed), it recovers instead, with `timeout`, as
    /// [`TcpBackend::recover`] does (the joiners waiting are taken in there too).
    pub fn admit(self, timeout: Duration) -> Result<TcpBackend> {
        let me = self.shared.rank;
        let deadline = deadline_in(me, "admit", timeout)?;
        let waiting = if me == 0 {
            self.joiners_waiting(deadline)
        } else {
            0
        };
        let mut word = [waiting as u64];
        match self.broadcast(&mut word, 0) {
            Ok(()) if word[0] == 0 => Ok(self),
            Ok(()) => {
                tracing::info!(
                    rank = me,
                    epoch = self.epoch(),
                    joiners = word[0],
                    "admitting"
                );
                self.move_on(deadline, Moment::Admit)
            }
            Err(e) => {
                tracing::warn!(rank = me, error = %e, "admit: the group failed; recovering");
                self.recover(timeout)
            }
        }
    }

    /// On rank 0 at `admit`: how many joiners the policy takes in now, looked for before
    /// `deadline`. A store that fails the look is logged and counts as none waiting (the next
    /// call looks again).
    ///
    /// Over a connection of its own, as the agreement of [`TcpBackend::recover`]: the
    /// backend's connection is the one [`TcpBackend::store`] hands out, held for the whole of
    /// a user's wait on it, which would hold the look past `deadline`.
    fn joiners_waiting(&self, deadline: Instant) -> usize {
        let base = self.store.prefix.clone();
        let at = self.store.client.server().to_string();
        let client = match TcpStore::connect(at.as_str(), left(deadline)) {
            Ok(c) => c.with_timeout(left(deadline)),
            Err(e) => {
                tracing::warn!(
                    store = %at,
                    error = %crate::init::store_error_text(&e),
                    "admit: could not connect to the store to look for joiners"
                );
                return 0;
            }
        };
        let root = PrefixStore::new(format!("{base}/elastic"), &client);
        let intake = Intake {
            root: &root,
            base: &base,
            secret: self.cfg.secret.as_deref(),
            policy: self.cfg.admission,
            moment: Moment::Admit,
            deadline,
        };
        match intake.waiting(self.members()) {
            Ok(w) => w.len(),
            Err(e) => {
                tracing::warn!(error = %e, "admit: could not look for joiners in the store");
                0
            }
        }
    }
}

/// The joiner's verdict, waited for until `deadline`; then the joiner withdraws, unless a
/// verdict came meanwhile (`compare_set` from empty: the first of the two stands).
fn wait_for_verdict(
    root: &PrefixStore<&TcpStore>,
    id: usize,
    deadline: Instant,
) -> Result<Vec<u8>> {
    let key = verdict_key(id);
    match root.get(&key, left(deadline)) {
        Ok(v) => Ok(v),
        Err(StoreError::Timeout { .. }) => root
            .compare_set(&key, b"", WITHDRAWN.as_bytes())
            .map_err(store_err(id, "join: withdraw")),
        Err(e) => Err(store_err(id, "join: wait to be taken in")(e)),
    }
}

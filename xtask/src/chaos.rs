//! `cargo xtask chaos -n N --minutes M`: a soak of recovery and growth. N ranks of
//! `dist-chaos` (a checked all_reduce loop on an elastic `TcpBackend` that admits joiners
//! between steps, see `tools/src/chaos.rs`) form through a store this driver serves, so that
//! any rank may die; the driver injects a fault every few seconds (SIGKILL of a random member,
//! or SIGSTOP for three peer timeouts then SIGCONT, which the others must judge failed and
//! leave out) while more than `--min-ranks` remain, and prints each one with the time the
//! first survivor reported the failure and the time the last survivor completed a call in the
//! next epoch without the victim. For each fault it starts a replacement (a new `dist-chaos`
//! with `DIST_JOIN=1`) after a random delay of up to `--replace-delay-ms`, which joins the
//! running job and is taken in at the members' next `admit` or recovery, so the group returns
//! to N; it prints the time from the replacement's start to its `join` returning (a member)
//! and the epoch that took it in.
//!
//! It fails on a hang (a running rank with no completed call or event for longer than a
//! failure's detection and recovery, or a join, can take), a wrong sum (of the members' ranks
//! or of the step a joiner received), two ranks that report different members for one epoch
//! (joiners' epochs included), an epoch whose members are not in job-rank order, a job rank
//! claimed by two processes, a victim in an epoch after the one that left it out, a rank that
//! ends other than as its fault says (0 for survivors and replacements, 3 for a rank left
//! out), a replacement that fails to join or is not a member by the end, a rank whose threads,
//! descriptors or shared-memory mappings at the end exceed those of its first epoch of at
//! least as many members (more is a leak), and a soak that injected no fault.
//!
//! Not yet: network cuts between simulated hosts; faults that strike a joiner before it is a
//! member.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use dist_store::StoreServer;

use crate::chaos_launch::{Dice, Launch, parse_members, signal};
use crate::chaos_report::{Fault, Joining, summary};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Ranks at the start.
    #[arg(short = 'n', long, default_value_t = 16)]
    pub ranks: usize,
    /// How long the soak runs.
    #[arg(long, default_value_t = 1.0)]
    pub minutes: f64,
    /// Faults stop once this many ranks are left.
    #[arg(long, default_value_t = 2)]
    pub min_ranks: usize,
    /// Milliseconds between a recovery and the next fault.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// The ranks' peer timeout, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub peer_timeout_ms: u64,
    /// The share of faults that stop a rank (SIGSTOP, then SIGCONT) rather than kill it, in
    /// percent.
    #[arg(long, default_value_t = 30)]
    pub stops: u64,
    /// A replacement starts a random time of up to this many milliseconds after its fault.
    #[arg(long, default_value_t = 1000)]
    pub replace_delay_ms: u64,
    /// Start no replacements: the group only shrinks.
    #[arg(long)]
    pub no_replace: bool,
    /// How often the members call `admit` between steps, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub admit_ms: u64,
    /// The seed of the faults' choices (default: the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// What the driver did to a rank, and so how it must end.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    Survive,
    Killed,
    Stopped,
}

/// One `dist-chaos` process: a rank of the job's start, or a replacement.
struct Rank {
    child: Child,
    fate: Fate,
    exit: Option<std::process::ExitStatus>,
    /// The last line it printed (a beat or an event).
    heard: Instant,
    /// Its job rank, once it reported an epoch (a replacement's is the store's choice).
    job: Option<usize>,
    /// Its member count and resources (threads, descriptors, memfd mappings) in each epoch
    /// it reported, in order.
    seen: Vec<(usize, [u64; 3])>,
    /// Where it is a replacement: its fault and join.
    joining: Option<Joining>,
}

/// The driver's view of the soak.
struct Soak {
    started: Instant,
    ranks: Vec<Rank>,
    problems: Vec<String>,
    /// The members of each epoch, as the first rank to report it said.
    epochs: BTreeMap<u64, Vec<usize>>,
    /// Per epoch, the processes that completed a call in it and when the last did.
    reached: BTreeMap<u64, (Vec<usize>, Instant)>,
    /// Which process holds each job rank.
    jobs: BTreeMap<usize, usize>,
    /// Victims' job ranks, with the first epoch that left them out.
    gone: BTreeMap<usize, u64>,
    faults: Vec<Fault>,
    newest_epoch: u64,
}

impl Soak {
    /// Records that process `r` reports `members` for `epoch`: one list per epoch, in job-rank
    /// order, each job rank of one process, no victim after the epoch that left it out.
    fn members(&mut self, r: usize, epoch: u64, members: &[usize], job: usize) {
        match self.epochs.get(&epoch) {
            Some(m) if m != members => self.problems.push(format!(
                "epoch {epoch}: process {r} reports members {members:?}, another {m:?}"
            )),
            Some(_) => {}
            None => {
                if !members.windows(2).all(|w| w[0] < w[1]) {
                    self.problems.push(format!(
                        "epoch {epoch}: members {members:?} are not in job-rank order"
                    ));
                }
                for (&v, &from) in &self.gone {
                    if epoch >= from && members.contains(&v) {
                        self.problems.push(format!(
                            "epoch {epoch}: members {members:?} hold job rank {v}, left out \
                             from epoch {from} on"
                        ));
                    }
                }
                self.epochs.insert(epoch, members.to_vec());
            }
        }
        if !members.contains(&job) {
            self.problems.push(format!(
                "epoch {epoch}: process {r} is job rank {job}, not among members {members:?}"
            ));
        }
        match (self.ranks[r].job, self.jobs.get(&job)) {
            (Some(j), _) if j != job => self.problems.push(format!(
                "process {r}: job rank {job} in epoch {epoch}, {j} before"
            )),
            (_, Some(&q)) if q != r => self
                .problems
                .push(format!("job rank {job}: claimed by processes {q} and {r}")),
            _ => {
                self.ranks[r].job = Some(job);
                self.jobs.insert(job, r);
            }
        }
        self.newest_epoch = self.newest_epoch.max(epoch);
    }

    /// A fault is recovered when every survivor that was a member at the fault completed a
    /// call in a later epoch without the victim.
    fn check_recovered(&mut self, e: u64, interval: Duration) -> Option<Instant> {
        let count = self.faults.len();
        let fault = self.faults.last_mut()?;
        if fault.recovered.is_some() || e <= fault.epoch_before {
            return None;
        }
        let members = self.epochs.get(&e)?;
        if members.contains(&fault.victim_job) {
            return None;
        }
        let before = self
            .epochs
            .get(&fault.epoch_before)
            .cloned()
            .unwrap_or_default();
        let want: Vec<usize> = (0..self.ranks.len())
            .filter(|&q| {
                self.ranks[q].fate == Fate::Survive
                    && self.ranks[q].job.is_some_and(|j| before.contains(&j))
            })
            .collect();
        let (done, last) = &self.reached[&e];
        if !want.iter().all(|q| done.contains(q)) {
            return None;
        }
        let from = fault.at + fault.detected.unwrap_or_default();
        fault.recovered = Some((last.saturating_duration_since(from), e));
        self.gone.insert(fault.victim_job, e);
        let f = &*fault;
        let detected = match f.detected {
            Some(d) => format!("detected after {:.0} ms", d.as_secs_f64() * 1e3),
            None => "detected at an admit (time not seen)".to_string(),
        };
        println!(
            "fault {count}: {} job rank {} at {:.1} s: {detected}, epoch {e} of {} ranks \
             complete {:.0} ms later",
            f.what,
            f.victim_job,
            (f.at - self.started).as_secs_f64(),
            members.len(),
            f.recovered.map_or(0.0, |(d, _)| d.as_secs_f64() * 1e3)
        );
        Some(Instant::now() + interval)
    }

    /// One line from process `r`, heard at `t`.
    fn line(&mut self, r: usize, t: Instant, line: &str, interval: Duration) -> Option<Instant> {
        self.ranks[r].heard = t;
        let mut f = line.split(' ');
        match f.next() {
            Some("beat") => {}
            Some("joined") => {
                let v: Vec<&str> = f.collect();
                let (Some(Ok(e)), Some(Ok(job)), Some(m)) = (
                    v.first().map(|e| e.parse::<u64>()),
                    v.get(1).map(|j| j.parse::<usize>()),
                    v.get(2),
                ) else {
                    self.problems
                        .push(format!("process {r}: a malformed line {line:?}"));
                    return None;
                };
                let members = parse_members(m);
                self.members(r, e, &members, job);
                let started = self.started;
                match self.ranks[r].joining.as_mut() {
                    Some(j) if j.joined.is_none() => {
                        j.joined = Some((t - j.started, e, job));
                        println!(
                            "replacement for fault {} (job rank {}): a member {:.0} ms after \
                             its start, job rank {job} in epoch {e} of {} ranks, at {:.1} s",
                            j.fault + 1,
                            j.replaces,
                            (t - j.started).as_secs_f64() * 1e3,
                            members.len(),
                            (t - started).as_secs_f64()
                        );
                    }
                    _ => self.problems.push(format!(
                        "process {r}: joined, though no replacement: {line}"
                    )),
                }
            }
            Some("done") => {
                // Resources at the end, when threads and mappings of earlier epochs are gone:
                // no more than in its first epoch of at least as many members.
                let e: Option<u64> = f.next().and_then(|e| e.parse().ok());
                let counts: Vec<u64> = f.skip(1).filter_map(|c| c.parse().ok()).collect();
                let n = e.and_then(|e| self.epochs.get(&e)).map(Vec::len);
                let base = n.and_then(|n| self.ranks[r].seen.iter().find(|(m, _)| *m >= n));
                if let (Ok(end), Some(&(m, first))) =
                    (<[u64; 3]>::try_from(counts.as_slice()), base)
                    && end.iter().zip(first).any(|(n, f)| *n > f)
                {
                    self.problems.push(format!(
                        "process {r}: ends holding threads/fds/memfds {end:?}, more than its \
                         first epoch of {m} members's {first:?} (a leak)"
                    ));
                }
            }
            Some("failed") => {
                // Only a survivor's failure in the epoch the fault struck or later is its
                // detection (a continued victim's late line is not).
                let epoch: Option<u64> = f.next().and_then(|e| e.parse().ok());
                let survivor = self.ranks[r].fate == Fate::Survive;
                if let Some(fault) = self.faults.last_mut()
                    && fault.detected.is_none()
                    && fault.recovered.is_none()
                    && t >= fault.at
                    && survivor
                    && epoch.is_some_and(|e| e >= fault.epoch_before)
                {
                    fault.detected = Some(t - fault.at);
                }
            }
            Some("epoch") => {
                let v: Vec<&str> = f.collect();
                let (Some(Ok(e)), Some(Ok(rank)), Some(m)) = (
                    v.first().map(|e| e.parse::<u64>()),
                    v.get(1).map(|j| j.parse::<usize>()),
                    v.get(2),
                ) else {
                    self.problems
                        .push(format!("process {r}: a malformed line {line:?}"));
                    return None;
                };
                let members = parse_members(m);
                let Some(&job) = members.get(rank) else {
                    self.problems.push(format!(
                        "process {r}: rank {rank} of epoch {e} with members {members:?}"
                    ));
                    return None;
                };
                self.members(r, e, &members, job);
                let entry = self.reached.entry(e).or_insert_with(|| (Vec::new(), t));
                entry.0.push(r);
                entry.1 = t;
                let counts: Vec<u64> = v[4..].iter().filter_map(|c| c.parse().ok()).collect();
                if let Ok(now) = <[u64; 3]>::try_from(counts.as_slice()) {
                    self.ranks[r].seen.push((members.len(), now));
                }
                return self.check_recovered(e, interval);
            }
            Some("excluded") => {
                if self.ranks[r].fate == Fate::Survive {
                    self.problems
                        .push(format!("process {r} was left out though alive: {line}"));
                }
            }
            Some("error") if self.ranks[r].joining.is_some_and(|j| j.joined.is_none()) => {
                let j = self.ranks[r].joining.expect("checked");
                self.problems.push(format!(
                    "the replacement for fault {} (job rank {}, process {r}) failed to join: {}",
                    j.fault + 1,
                    j.replaces,
                    &line["error ".len().min(line.len())..]
                ));
            }
            _ => self.problems.push(format!("process {r}: {line}")),
        }
        None
    }
}

pub fn run(a: &Args) -> Result<()> {
    if a.ranks < 2 || a.min_ranks < 1 || a.min_ranks >= a.ranks {
        bail!("want 2 or more ranks and 1 <= --min-ranks < -n");
    }
    let program = crate::bundled_or_built(
        "dist-chaos",
        &["-p", "dist-tools", "--bin", "dist-chaos"],
        || crate::release_dir().join("dist-chaos"),
    )?;
    let seed = a.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut dice = Dice(seed);
    let store =
        StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0))).context("serve a store")?;
    let port = store.local_addr().port();
    let soak = Duration::from_secs_f64(a.minutes * 60.0);
    let until = SystemTime::now() + soak;
    let until_s = until.duration_since(UNIX_EPOCH)?.as_secs() + 1;
    let peer_timeout = Duration::from_millis(a.peer_timeout_ms);
    // The longest a running rank may go without a line: a beat comes every 100 ms of calls; a
    // failure takes the peer timeout to detect, and a recovery (or a join) at most its 30 s.
    let hang = peer_timeout * 3 + Duration::from_secs(35);
    let logs = std::env::temp_dir().join(format!("dist-chaos-{seed}"));
    std::fs::create_dir_all(&logs)?;
    println!(
        "chaos: {} ranks, {:.1} min, seed {seed}, store on port {port}, replacements {}, ranks' \
         logs in {}",
        a.ranks,
        a.minutes,
        if a.no_replace { "none" } else { "on" },
        logs.display()
    );

    let (tx, rx) = mpsc::channel::<(usize, Instant, String)>();
    let launch = Launch {
        program,
        logs: logs.clone(),
        world: a.ranks,
        port,
        seed,
        until_s,
        peer_timeout_ms: a.peer_timeout_ms,
        admit_ms: a.admit_ms,
        tx,
    };
    let mut s = Soak {
        started: Instant::now(),
        ranks: Vec::with_capacity(a.ranks * 2),
        problems: Vec::new(),
        epochs: BTreeMap::new(),
        reached: BTreeMap::new(),
        jobs: BTreeMap::new(),
        gone: BTreeMap::new(),
        faults: Vec::new(),
        newest_epoch: 0,
    };
    for r in 0..a.ranks {
        s.ranks.push(Rank {
            child: launch.start(r, r, false)?,
            fate: Fate::Survive,
            exit: None,
            heard: Instant::now(),
            job: None,
            seen: Vec::new(),
            joining: None,
        });
    }

    let started = s.started;
    let interval = Duration::from_millis(a.interval_ms);
    let mut next_fault = started + Duration::from_millis(a.interval_ms.max(500));
    let mut continue_at: Option<(usize, Instant)> = None;
    // Replacements to start: when, for which fault.
    let mut pending: Vec<(Instant, usize)> = Vec::new();
    let end_by = started + soak + Duration::from_secs(60);
    // No fault this close to the end: its replacement must have time to join.
    let last_fault = Duration::from_secs(10);

    loop {
        // Events: what came, or one wait of 20 ms when nothing did.
        let mut batch: Vec<(usize, Instant, String)> = rx.try_iter().collect();
        if batch.is_empty()
            && let Ok(one) = rx.recv_timeout(Duration::from_millis(20))
        {
            batch.push(one);
        }
        for (r, t, line) in batch {
            if let Some(next) = s.line(r, t, &line, interval) {
                next_fault = next;
            }
        }
        // Exits.
        for (r, rank) in s.ranks.iter_mut().enumerate() {
            if rank.exit.is_none()
                && let Ok(Some(st)) = rank.child.try_wait()
            {
                rank.exit = Some(st);
                let ok = match rank.fate {
                    Fate::Survive => st.success(),
                    Fate::Killed => std::os::unix::process::ExitStatusExt::signal(&st) == Some(9),
                    Fate::Stopped => st.code() == Some(3),
                };
                if !ok {
                    s.problems.push(match rank.joining {
                        Some(j) if j.joined.is_none() => format!(
                            "the replacement for fault {} (job rank {}, process {r}) ended \
                             with {st} before it joined",
                            j.fault + 1,
                            j.replaces
                        ),
                        _ => format!("process {r} ({:?}) ended with {st}", rank.fate),
                    });
                }
            }
        }
        let now = Instant::now();
        if let Some((r, at)) = continue_at
            && now >= at
        {
            signal(s.ranks[r].child.id(), "-CONT");
            continue_at = None;
        }
        // Replacements due.
        while let Some(i) = pending.iter().position(|&(at, _)| now >= at) {
            let (_, fault) = pending.swap_remove(i);
            let index = s.ranks.len();
            let replaces = s.faults[fault].victim_job;
            s.ranks.push(Rank {
                child: launch.start(index, replaces, true)?,
                fate: Fate::Survive,
                exit: None,
                heard: Instant::now(),
                job: None,
                seen: Vec::new(),
                joining: Some(Joining {
                    fault,
                    replaces,
                    started: Instant::now(),
                    joined: None,
                }),
            });
        }
        // Hangs.
        for (r, rank) in s.ranks.iter().enumerate() {
            if rank.exit.is_none()
                && rank.fate != Fate::Killed
                && continue_at.is_none_or(|(q, _)| q != r)
                && now.duration_since(rank.heard) > hang
            {
                s.problems.push(format!(
                    "process {r}: no call completed and nothing said for {hang:?} (a hang)"
                ));
            }
        }
        // Members that may be struck: alive, not struck yet, a member of some epoch.
        let live: Vec<usize> = (0..s.ranks.len())
            .filter(|&r| {
                let q = &s.ranks[r];
                q.exit.is_none() && q.fate == Fate::Survive && q.job.is_some()
            })
            .collect();
        // The next fault waits for the last one's recovery and for a stopped rank's SIGCONT.
        let settled =
            s.faults.last().is_none_or(|f| f.recovered.is_some()) && continue_at.is_none();
        let running = s.ranks.iter().any(|r| r.exit.is_none());
        if !s.problems.is_empty() || (!running && pending.is_empty()) || now > end_by {
            break;
        }
        if settled
            && now >= next_fault
            && now + last_fault < started + soak
            && live.len() > a.min_ranks
        {
            let victim = live[dice.below(live.len())];
            let stop = (dice.below(100) as u64) < a.stops;
            let pid = s.ranks[victim].child.id();
            let victim_job = s.ranks[victim].job.expect("a member");
            s.faults.push(Fault {
                what: if stop { "stop" } else { "kill" },
                victim_job,
                at: Instant::now(),
                epoch_before: s.newest_epoch,
                detected: None,
                recovered: None,
            });
            if stop {
                s.ranks[victim].fate = Fate::Stopped;
                signal(pid, "-STOP");
                continue_at = Some((victim, Instant::now() + peer_timeout * 3));
            } else {
                s.ranks[victim].fate = Fate::Killed;
                signal(pid, "-KILL");
            }
            if !a.no_replace {
                let delay = dice.below(a.replace_delay_ms.max(1) as usize) as u64;
                pending.push((
                    Instant::now() + Duration::from_millis(delay),
                    s.faults.len() - 1,
                ));
            }
        }
    }
    if Instant::now() > end_by {
        s.problems.push(format!(
            "processes still running {:?} past the soak's end",
            end_by - started
        ));
    }
    // A replacement not a member when the soak ends: at its end, a failure to join; where
    // another problem stopped the soak, only how far it got.
    let when = if s.problems.is_empty() {
        "by the end"
    } else {
        "when the soak stopped"
    };
    for (r, rank) in s.ranks.iter_mut().enumerate() {
        if rank.exit.is_none() {
            let _ = rank.child.kill();
            let _ = rank.child.wait();
        }
        if let Some(j) = rank.joining
            && j.joined.is_none()
            && !s
                .problems
                .iter()
                .any(|p| p.contains(&format!("process {r})")))
        {
            s.problems.push(format!(
                "the replacement for fault {} (job rank {}, process {r}) was not a member \
                 {when}",
                j.fault + 1,
                j.replaces
            ));
        }
    }
    drop(store);
    let joins: Vec<Joining> = s.ranks.iter().filter_map(|r| r.joining).collect();
    summary(&s.faults, &joins, &s.epochs, started.elapsed());
    if !s.problems.is_empty() {
        for p in &s.problems {
            eprintln!("chaos: {p}");
        }
        bail!(
            "{} problem(s); the ranks' logs are in {}",
            s.problems.len(),
            logs.display()
        );
    }
    if s.faults.iter().any(|f| f.recovered.is_none()) {
        bail!("a fault was never recovered from");
    }
    if s.faults.is_empty() {
        bail!("no fault was injected: give the soak more --minutes");
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}

//! `cargo xtask chaos -n N --minutes M`: a soak of recovery. N ranks of `dist-chaos` (a checked
//! all_reduce loop on an elastic `TcpBackend`, see `tools/src/chaos.rs`) form through a store
//! this driver serves, so that any rank may die; the driver injects a fault every few seconds
//! (SIGKILL of a random rank, or SIGSTOP for three peer timeouts then SIGCONT, which the others
//! must judge failed and leave out) while more than `--min-ranks` remain, and prints each one
//! with the time the first survivor reported the failure and the time the last survivor
//! completed a call in the next epoch.
//!
//! It fails on a hang (a running rank with no completed call or event for longer than a
//! failure's detection and recovery can take), a wrong sum, two ranks that report different
//! members for one epoch, a rank that ends other than as its fault says (0 for survivors, 3
//! for a rank left out), a survivor whose threads, descriptors or shared-memory mappings at
//! the end exceed its first epoch's (the group only shrinks, so more is a leak), and a soak
//! that injected no fault.
//!
//! Not yet: replacements (a rank joining a running job is not built), so a soak ends its
//! faults once `--min-ranks` remain; network cuts between simulated hosts.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use dist_store::StoreServer;

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

struct Rank {
    child: Child,
    fate: Fate,
    exit: Option<std::process::ExitStatus>,
    /// The last line it printed (a beat or an event).
    heard: Instant,
    /// Its resources in the first epoch it reported: threads, descriptors, memfd mappings.
    first: Option<[u64; 3]>,
}

struct Fault {
    what: &'static str,
    victim: usize,
    at: Instant,
    epoch_before: u64,
    detected: Option<Duration>,
    recovered: Option<(Duration, u64)>,
}

/// A small deterministic generator for the faults' choices.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
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
    // failure takes the peer timeout to detect, and a recovery at most its 30 s.
    let hang = peer_timeout * 3 + Duration::from_secs(35);
    let logs = std::env::temp_dir().join(format!("dist-chaos-{seed}"));
    std::fs::create_dir_all(&logs)?;
    println!(
        "chaos: {} ranks, {:.1} min, seed {seed}, store on port {port}, ranks' logs in {}",
        a.ranks,
        a.minutes,
        logs.display()
    );

    let (tx, rx) = mpsc::channel::<(usize, Instant, String)>();
    let mut ranks = Vec::with_capacity(a.ranks);
    for r in 0..a.ranks {
        let mut child = Command::new(&program)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", a.ranks.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", a.ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("DIST_SERVE_STORE", "0")
            .env("DIST_STORE_PREFIX", format!("chaos/{seed}"))
            .env("CHAOS_UNTIL", until_s.to_string())
            .env("CHAOS_PEER_TIMEOUT_MS", a.peer_timeout_ms.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(logs.join(format!("rank{r}.err")))?)
            .spawn()
            .with_context(|| format!("start {}", program.display()))?;
        let out = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(std::io::Result::ok) {
                if tx.send((r, Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        ranks.push(Rank {
            child,
            fate: Fate::Survive,
            exit: None,
            heard: Instant::now(),
            first: None,
        });
    }
    drop(tx);

    let started = Instant::now();
    let mut problems: Vec<String> = Vec::new();
    let mut epochs: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    // Per epoch, the ranks that completed a call in it and when the last did.
    let mut reached: BTreeMap<u64, (Vec<usize>, Instant)> = BTreeMap::new();
    let mut faults: Vec<Fault> = Vec::new();
    let mut newest_epoch = 0u64;
    let mut next_fault = started + Duration::from_millis(a.interval_ms.max(500));
    let mut continue_at: Option<(usize, Instant)> = None;
    let end_by = started + soak + Duration::from_secs(60);

    loop {
        // Events: what came, or one wait of 20 ms when nothing did.
        let mut batch: Vec<(usize, Instant, String)> = rx.try_iter().collect();
        if batch.is_empty()
            && let Ok(one) = rx.recv_timeout(Duration::from_millis(20))
        {
            batch.push(one);
        }
        for (r, t, line) in batch {
            ranks[r].heard = t;
            let mut f = line.split(' ');
            match f.next() {
                Some("beat") => {}
                Some("done") => {
                    // Resources at the end, when threads and mappings of earlier epochs are
                    // gone: no more than in the rank's first epoch (the group only shrank).
                    let counts: Vec<u64> = f.skip(2).filter_map(|c| c.parse().ok()).collect();
                    if let (Ok(end), Some(first)) =
                        (<[u64; 3]>::try_from(counts.as_slice()), ranks[r].first)
                        && end.iter().zip(first).any(|(n, f)| *n > f)
                    {
                        problems.push(format!(
                            "rank {r}: ends holding threads/fds/memfds {end:?}, more than its \
                             first epoch's {first:?} (a leak)"
                        ));
                    }
                }
                Some("failed") => {
                    // Only a survivor's failure in the epoch the fault struck is its detection
                    // (a continued victim's late line is not).
                    let epoch: Option<u64> = f.next().and_then(|e| e.parse().ok());
                    if let Some(fault) = faults.last_mut()
                        && fault.detected.is_none()
                        && t >= fault.at
                        && ranks[r].fate == Fate::Survive
                        && epoch == Some(fault.epoch_before)
                    {
                        fault.detected = Some(t - fault.at);
                    }
                }
                Some("epoch") => {
                    let v: Vec<&str> = f.collect();
                    let (Some(e), Some(members)) = (v.first(), v.get(2)) else {
                        problems.push(format!("rank {r}: a malformed line {line:?}"));
                        continue;
                    };
                    let e: u64 = e.parse().unwrap_or(u64::MAX);
                    let members: Vec<usize> =
                        members.split(',').filter_map(|m| m.parse().ok()).collect();
                    match epochs.get(&e) {
                        Some(m) if *m != members => problems.push(format!(
                            "epoch {e}: rank {r} reports members {members:?}, another {m:?}"
                        )),
                        Some(_) => {}
                        None => {
                            epochs.insert(e, members.clone());
                        }
                    }
                    newest_epoch = newest_epoch.max(e);
                    let entry = reached.entry(e).or_insert_with(|| (Vec::new(), t));
                    entry.0.push(r);
                    entry.1 = t;
                    let counts: Vec<u64> = v[4..].iter().filter_map(|c| c.parse().ok()).collect();
                    if ranks[r].first.is_none()
                        && let Ok(now) = <[u64; 3]>::try_from(counts.as_slice())
                    {
                        ranks[r].first = Some(now);
                    }
                    // A fault is recovered when every survivor completed a call in an epoch
                    // after it.
                    let count = faults.len();
                    if let Some(fault) = faults.last_mut()
                        && fault.recovered.is_none()
                        && e > fault.epoch_before
                    {
                        let want: Vec<usize> = (0..ranks.len())
                            .filter(|&q| ranks[q].fate == Fate::Survive)
                            .collect();
                        let (done, last) = &reached[&e];
                        if want.iter().all(|q| done.contains(q)) {
                            let from = fault.at + fault.detected.unwrap_or_default();
                            fault.recovered = Some((last.saturating_duration_since(from), e));
                            let f = &*fault;
                            println!(
                                "fault {}: {} rank {} at {:.1} s: detected after {:.0} ms, \
                                 epoch {e} of {} ranks complete {:.0} ms later",
                                count,
                                f.what,
                                f.victim,
                                (f.at - started).as_secs_f64(),
                                f.detected.unwrap_or_default().as_secs_f64() * 1e3,
                                epochs[&e].len(),
                                f.recovered.map_or(0.0, |(d, _)| d.as_secs_f64() * 1e3)
                            );
                            next_fault = Instant::now() + Duration::from_millis(a.interval_ms);
                        }
                    }
                }
                Some("excluded") => {
                    if ranks[r].fate == Fate::Survive {
                        problems.push(format!("rank {r} was left out though alive: {line}"));
                    }
                }
                _ => problems.push(format!("rank {r}: {line}")),
            }
        }
        // Exits.
        for (r, rank) in ranks.iter_mut().enumerate() {
            if rank.exit.is_none()
                && let Ok(Some(s)) = rank.child.try_wait()
            {
                rank.exit = Some(s);
                let ok = match rank.fate {
                    Fate::Survive => s.success(),
                    Fate::Killed => std::os::unix::process::ExitStatusExt::signal(&s) == Some(9),
                    Fate::Stopped => s.code() == Some(3),
                };
                if !ok {
                    problems.push(format!("rank {r} ({:?}) ended with {s}", rank.fate));
                }
            }
        }
        let now = Instant::now();
        if let Some((r, at)) = continue_at
            && now >= at
        {
            signal(ranks[r].child.id(), "-CONT");
            continue_at = None;
        }
        // Hangs.
        for (r, rank) in ranks.iter().enumerate() {
            if rank.exit.is_none()
                && rank.fate != Fate::Killed
                && continue_at.is_none_or(|(s, _)| s != r)
                && now.duration_since(rank.heard) > hang
            {
                problems.push(format!(
                    "rank {r}: no call completed and nothing said for {hang:?} (a hang)"
                ));
            }
        }
        let live: Vec<usize> = (0..ranks.len())
            .filter(|&r| ranks[r].exit.is_none() && ranks[r].fate == Fate::Survive)
            .collect();
        // The next fault waits for the last one's recovery and for a stopped rank's SIGCONT.
        let settled = faults.last().is_none_or(|f| f.recovered.is_some()) && continue_at.is_none();
        if !problems.is_empty() || live.is_empty() || now > end_by {
            break;
        }
        if settled
            && now >= next_fault
            && now + Duration::from_secs(5) < started + soak
            && live.len() > a.min_ranks
        {
            let victim = live[dice.below(live.len())];
            let stop = (dice.below(100) as u64) < a.stops;
            let pid = ranks[victim].child.id();
            faults.push(Fault {
                what: if stop { "stop" } else { "kill" },
                victim,
                at: Instant::now(),
                epoch_before: newest_epoch,
                detected: None,
                recovered: None,
            });
            if stop {
                ranks[victim].fate = Fate::Stopped;
                signal(pid, "-STOP");
                continue_at = Some((victim, Instant::now() + peer_timeout * 3));
            } else {
                ranks[victim].fate = Fate::Killed;
                signal(pid, "-KILL");
            }
        }
        if ranks.iter().all(|r| r.exit.is_some()) {
            break;
        }
    }
    if Instant::now() > end_by {
        problems.push(format!(
            "ranks still running {:?} past the soak's end",
            end_by - started
        ));
    }
    for rank in &mut ranks {
        if rank.exit.is_none() {
            let _ = rank.child.kill();
            let _ = rank.child.wait();
        }
    }
    drop(store);
    summary(&faults, &epochs, started.elapsed());
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("chaos: {p}");
        }
        bail!(
            "{} problem(s); the ranks' logs are in {}",
            problems.len(),
            logs.display()
        );
    }
    if faults.iter().any(|f| f.recovered.is_none()) {
        bail!("a fault was never recovered from");
    }
    if faults.is_empty() {
        bail!("no fault was injected: give the soak more --minutes");
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}

fn summary(faults: &[Fault], epochs: &BTreeMap<u64, Vec<usize>>, took: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut detect: Vec<f64> = faults.iter().filter_map(|f| f.detected.map(ms)).collect();
    let mut recover: Vec<f64> = faults
        .iter()
        .filter_map(|f| f.recovered.map(|r| ms(r.0)))
        .collect();
    let stat = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            "none".to_string()
        } else {
            format!(
                "median {:.0} ms, max {:.0} ms",
                v[v.len() / 2],
                v[v.len() - 1]
            )
        }
    };
    println!(
        "chaos: {} faults in {:.1} s ({} kills, {} stops); detection {}; recovery {}; last \
         epoch {:?}",
        faults.len(),
        took.as_secs_f64(),
        faults.iter().filter(|f| f.what == "kill").count(),
        faults.iter().filter(|f| f.what == "stop").count(),
        stat(&mut detect),
        stat(&mut recover),
        epochs.iter().next_back()
    );
}

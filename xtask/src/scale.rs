//! `cargo xtask scale -n N`: builds dist-tcp's `scale` example in release mode and starts N
//! ranks of it on this host; each forms the job, runs a barrier, an 8 B and a 1 MiB all_reduce
//! (checked) and exits. Prints the wall time of each phase of the whole job and, per rank, the
//! peak resident memory and the most threads seen, as max and median over the ranks. A rank
//! that fails, or a run past the timeout, kills every rank and fails with the ranks' last lines.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Number of ranks.
    #[arg(short = 'n', long = "ranks", default_value_t = 64)]
    pub ranks: usize,
    /// Seconds the whole run may take before every rank is killed.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Milliseconds every rank stays idle after forming, measuring the CPU time it uses
    /// meanwhile (the barrier's time then includes this idle time).
    #[arg(long, default_value_t = 0)]
    pub idle_ms: u64,
    /// Only form the job, with no backend on top (the later phases then take no time);
    /// `DIST_FORMATION=lazy` in the environment forms it lazily.
    #[arg(long)]
    pub form_only: bool,
    /// Run this build of the `scale` example instead of building one (to compare two builds
    /// side by side, alternating).
    #[arg(long)]
    pub program: Option<PathBuf>,
}

/// How often the supervisor looks at its children (exits, thread counts).
const POLL: Duration = Duration::from_millis(20);
/// How many running ranks' thread counts the supervisor reads per look, in turn: reading
/// `/proc/PID/status` of 1,024 ranks every 20 ms would take one of this machine's two cores
/// away from the job it measures.
const THREAD_SAMPLES: usize = 32;
/// How long the other ranks may run on after a rank fails, before every one is killed.
const FAIL_GRACE: Duration = Duration::from_secs(2);

/// What one rank printed: the end of each phase (ns since the epoch) and its own figures.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct RankResult {
    formed: u128,
    barrier: u128,
    small: u128,
    large: u128,
    hwm_kib: u64,
    threads: u64,
    idle_cpu_ms: u64,
}

/// Parses the example's `scale-result k=v …` line.
fn parse_result(out: &str) -> Option<RankResult> {
    let line = out.lines().find(|l| l.starts_with("scale-result "))?;
    let mut r = RankResult::default();
    for word in line.split_whitespace().skip(1) {
        let (k, v) = word.split_once('=')?;
        match k {
            "formed" => r.formed = v.parse().ok()?,
            "barrier" => r.barrier = v.parse().ok()?,
            "small" => r.small = v.parse().ok()?,
            "large" => r.large = v.parse().ok()?,
            "hwm_kib" => r.hwm_kib = v.parse().ok()?,
            "threads" => r.threads = v.parse().ok()?,
            "idle_cpu_ms" => r.idle_cpu_ms = v.parse().ok()?,
            _ => {}
        }
    }
    Some(r)
}

/// The `Threads:` count of a running process, if it can be read.
fn threads_of(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

fn epoch_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// The median of `v` (sorted in place; the upper middle for an even length).
fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The last `n` lines of a rank's output file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Makes the folder for the ranks' output files: in `/dev/shm` (memory) where it can, else in
/// the temporary folder. Two files a rank: at 1,024 ranks, creating them on this machine's ext4
/// `/tmp` took about 5 % of the run's CPU time (perf), on the 2 cores the ranks start on.
fn output_dir() -> Result<PathBuf> {
    let name = format!("dist-scale-{}", std::process::id());
    let shm = Path::new("/dev/shm").join(&name);
    if std::fs::create_dir_all(&shm).is_ok() {
        return Ok(shm);
    }
    let dir = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

struct Ranks {
    children: Vec<Option<Child>>,
    dir: PathBuf,
}

impl Ranks {
    fn out(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.out"))
    }
    fn err(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.err"))
    }
    /// The last phase `rank` said it ended, if any.
    fn phase(&self, rank: usize) -> Option<String> {
        let out = std::fs::read_to_string(self.out(rank)).unwrap_or_default();
        let last = out
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("scale-phase "))?;
        Some(last.trim().to_string())
    }

    /// Where `ranks` are, grouped: `forming: 0-3, 9; past barrier: 4-8`.
    fn where_(&self, ranks: &[usize]) -> String {
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for &r in ranks {
            let at = self
                .phase(r)
                .map_or_else(|| "forming".to_string(), |p| format!("past {p}"));
            match groups.iter_mut().find(|(g, _)| *g == at) {
                Some((_, v)) => v.push(r),
                None => groups.push((at, vec![r])),
            }
        }
        let parts: Vec<String> = groups
            .iter()
            .map(|(g, v)| format!("{g}: {}", ranges(v)))
            .collect();
        parts.join("; ")
    }

    /// The last lines of the error output of the first few of `ranks` (in their order) that
    /// wrote any, for a failure report, and which ones wrote none.
    fn report(&self, ranks: &[usize]) -> String {
        let mut s = String::new();
        let (mut shown, mut quiet) = (0, Vec::new());
        for &r in ranks {
            let t = tail(&self.err(r), 8);
            if t.trim().is_empty() {
                quiet.push(r);
            } else if shown < 4 {
                shown += 1;
                s.push_str(&format!("\n--- rank {r}, last lines of stderr:\n{t}"));
            }
        }
        if !quiet.is_empty() {
            quiet.sort_unstable();
            s.push_str(&format!(
                "\n(nothing on stderr from ranks {})",
                ranges(&quiet)
            ));
        }
        s
    }
}

impl Drop for Ranks {
    /// Kills (by pid) and reaps every rank still running; removes the output folder.
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
        }
        for c in self.children.iter_mut().flatten() {
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Ranks listed as `0-3, 7` style ranges, for short messages at large world sizes.
/// Which ranks one look reads the thread count of: `count` ranks from `first`, wrapping around
/// the `n` ranks (all of them when `count >= n`).
fn sample_window(first: usize, count: usize, n: usize) -> impl Fn(usize) -> bool {
    move |rank| count >= n || (rank + n - first) % n < count
}

fn ranges(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

pub fn run(args: &Args) -> Result<()> {
    if args.ranks < 2 {
        bail!("scale needs at least 2 ranks (got {})", args.ranks);
    }
    let program = match &args.program {
        Some(p) => p.clone(),
        None => {
            crate::cargo(&[
                "build",
                "--release",
                "--quiet",
                "-p",
                "dist-tcp",
                "--example",
                "scale",
            ])?;
            crate::release_dir().join("examples").join("scale")
        }
    };
    let n = args.ranks;
    let timeout = Duration::from_secs(args.timeout);
    let dir = output_dir()?;
    let mut ranks = Ranks {
        children: Vec::with_capacity(n),
        dir,
    };
    let port = dist_launch::free_port().context("find a free port")?;
    let cores = std::thread::available_parallelism().map_or(0, |c| c.get());
    println!(
        "scale: {n} ranks of {} on this host ({cores} cores), timeout {}s",
        program.display(),
        args.timeout
    );

    let start_ns = epoch_ns();
    let start = Instant::now();
    for rank in 0..n {
        let out = File::create(ranks.out(rank)).context("create a rank's output file")?;
        let err = File::create(ranks.err(rank)).context("create a rank's output file")?;
        let mut cmd = Command::new(&program);
        if args.form_only {
            cmd.arg("--form-only");
        }
        let child = cmd
            .args(["--idle-ms", &args.idle_ms.to_string()])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn();
        match child {
            Ok(c) => ranks.children.push(Some(c)),
            Err(e) => bail!("start rank {rank} of {n}: {e} (every started rank killed)"),
        }
    }
    let spawned = start.elapsed();

    // Supervise: exits, and each rank's thread count while it runs.
    let mut seen_threads = vec![0u64; n];
    let mut next_sample = 0usize;
    let mut last_exit = start;
    let (mut failed, mut first_failure) = (Vec::new(), None);
    loop {
        let mut running = Vec::new();
        let sampled = sample_window(next_sample, THREAD_SAMPLES, n);
        for (rank, (slot, seen)) in ranks
            .children
            .iter_mut()
            .zip(seen_threads.iter_mut())
            .enumerate()
        {
            let Some(child) = slot.as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    *slot = None;
                    last_exit = Instant::now();
                }
                Ok(Some(status)) => {
                    *slot = None;
                    failed.push((rank, status));
                    first_failure.get_or_insert_with(Instant::now);
                }
                Ok(None) => {
                    running.push(rank);
                    if !sampled(rank) {
                        continue;
                    }
                    if let Some(t) = threads_of(child.id()) {
                        *seen = (*seen).max(t);
                    }
                }
                Err(e) => bail!("rank {rank}: cannot wait for it: {e}; every rank killed"),
            }
        }
        // After a failure the others get a moment to fail on their own, so that the report
        // holds the rank whose error came first (a rank that fails tears its connections down
        // before it exits, and its peers may exit before it).
        if first_failure.is_some_and(|t| running.is_empty() || t.elapsed() > FAIL_GRACE) {
            // Reported in the order they were seen to fail, those killed by a signal first
            // (likely the cause); listed grouped by how they ended.
            failed.sort_by_key(|&(_, st): &(usize, std::process::ExitStatus)| st.code().is_some());
            let which: Vec<usize> = failed.iter().map(|&(r, _)| r).collect();
            let mut by_rank = failed.clone();
            by_rank.sort_by_key(|&(r, _)| r);
            let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
            for (r, st) in &by_rank {
                let how = st.to_string();
                match groups.iter_mut().find(|(g, _)| *g == how) {
                    Some((_, v)) => v.push(*r),
                    None => groups.push((how, vec![*r])),
                }
            }
            let each: Vec<String> = groups
                .iter()
                .map(|(g, v)| format!("{g}: ranks {}", ranges(v)))
                .collect();
            bail!(
                "ranks failed after {:.1?} ({}); {} ranks still running killed{}",
                start.elapsed(),
                each.join("; "),
                running.len(),
                ranks.report(&which)
            );
        }
        if running.is_empty() {
            break;
        }
        if start.elapsed() > timeout {
            bail!(
                "timed out after {timeout:?}: {} of {n} ranks still running ({}); every rank \
                 killed{}",
                running.len(),
                ranks.where_(&running),
                ranks.report(&running)
            );
        }
        next_sample = (next_sample + THREAD_SAMPLES) % n.max(1);
        std::thread::sleep(POLL);
    }
    let total = last_exit - start;

    let mut results = Vec::with_capacity(n);
    for rank in 0..n {
        let out = std::fs::read_to_string(ranks.out(rank)).unwrap_or_default();
        match parse_result(&out) {
            Some(r) => results.push(r),
            None => bail!(
                "rank {rank} exited 0 without its result line{}",
                ranks.report(&[rank])
            ),
        }
    }
    print_table(n, spawned, total, start_ns, &results, &seen_threads);
    if args.form_only {
        println!("(--form-only: the phases after formation were not run)");
    }
    if args.idle_ms > 0 {
        let mut cpu: Vec<u64> = results.iter().map(|r| r.idle_cpu_ms).collect();
        let max = cpu.iter().copied().max().unwrap_or(0);
        let per_s = |ms: u64| ms as f64 * 1000.0 / args.idle_ms as f64;
        println!(
            "CPU while idle for {} ms, ms per second per rank: max {:.1}, median {:.1}, all \
             ranks {:.0}",
            args.idle_ms,
            per_s(max),
            per_s(median(&mut cpu)),
            per_s(cpu.iter().sum())
        );
    }
    Ok(())
}

fn print_table(
    n: usize,
    spawned: Duration,
    total: Duration,
    start_ns: u128,
    results: &[RankResult],
    seen_threads: &[u64],
) {
    // A phase of the job ends when its last rank ends it.
    let last = |f: fn(&RankResult) -> u128| results.iter().map(f).max().unwrap_or(0);
    let ends = [
        start_ns,
        last(|r| r.formed),
        last(|r| r.barrier),
        last(|r| r.small),
        last(|r| r.large),
    ];
    let ms = |ns: u128| ns as f64 / 1e6;
    println!("\n{:<28} {:>10}", "phase (whole job)", "wall ms");
    println!(
        "{:<28} {:>10.1}",
        "start the processes",
        spawned.as_secs_f64() * 1e3
    );
    let names = [
        "formation (from the start)",
        "barrier",
        "all_reduce 8 B",
        "all_reduce 1 MiB",
    ];
    for (i, name) in names.iter().enumerate() {
        println!(
            "{name:<28} {:>10.1}",
            ms(ends[i + 1].saturating_sub(ends[i]))
        );
    }
    let exit_ns = start_ns + total.as_nanos();
    println!(
        "{:<28} {:>10.1}",
        "exit",
        ms(exit_ns.saturating_sub(ends[4]))
    );
    println!("{:<28} {:>10.1}", "total", total.as_secs_f64() * 1e3);

    let mut rss: Vec<u64> = results.iter().map(|r| r.hwm_kib).collect();
    let mut threads: Vec<u64> = results
        .iter()
        .zip(seen_threads)
        .map(|(r, &s)| r.threads.max(s))
        .collect();
    let rss_max = rss.iter().copied().max().unwrap_or(0);
    let thr_max = threads.iter().copied().max().unwrap_or(0);
    println!("\n{:<28} {:>10} {:>10}", "per rank", "max", "median");
    println!(
        "{:<28} {:>10.1} {:>10.1}",
        "peak RSS (VmHWM, MiB)",
        rss_max as f64 / 1024.0,
        median(&mut rss) as f64 / 1024.0
    );
    println!(
        "{:<28} {:>10} {:>10}",
        "threads (most seen)",
        thr_max,
        median(&mut threads)
    );
    println!("\n{n} ranks: formed, barrier, 8 B and 1 MiB all_reduce checked on every rank");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_window_covers_every_rank_in_turn() {
        let n = 100;
        let mut seen = vec![0; n];
        let mut first = 0;
        for _ in 0..n.div_ceil(32) {
            let w = sample_window(first, 32, n);
            for (r, c) in seen.iter_mut().enumerate() {
                *c += usize::from(w(r));
            }
            first = (first + 32) % n;
        }
        assert!(
            seen.iter().all(|&c| c >= 1),
            "a rank never sampled: {seen:?}"
        );
        assert_eq!(seen.iter().sum::<usize>(), 32 * 4);
        let all = sample_window(5, 32, 8);
        assert!((0..8).all(&all));
        let some = sample_window(90, 32, 100);
        assert!(some(95) && some(0) && some(21) && !some(22) && !some(89));
    }

    #[test]
    fn parses_a_result_line() {
        let r = parse_result(
            "noise\nscale-result rank=3 formed=10 barrier=20 small=30 large=40 hwm_kib=5000 \
             threads=9 idle_cpu_ms=7\n",
        );
        assert_eq!(
            r,
            Some(RankResult {
                formed: 10,
                barrier: 20,
                small: 30,
                large: 40,
                hwm_kib: 5000,
                threads: 9,
                idle_cpu_ms: 7,
            })
        );
        assert_eq!(parse_result("scale-result formed=x"), None);
        assert_eq!(parse_result(""), None);
    }

    #[test]
    fn ranges_and_median() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(ranges(&[]), "");
        assert_eq!(median(&mut [5, 1, 3]), 3);
        assert_eq!(median(&mut []), 0);
    }
}

//! What `cargo xtask chaos` records of each fault and replacement, and its closing summary:
//! counts, faults a minute, and the median, 95th percentile and maximum of the detection,
//! recovery and replacement-to-member times.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One injected fault.
pub(crate) struct Fault {
    /// `kill` or `stop`.
    pub(crate) what: &'static str,
    /// The victim's job rank.
    pub(crate) victim_job: usize,
    pub(crate) at: Instant,
    /// The newest epoch the driver had heard of when it struck.
    pub(crate) epoch_before: u64,
    /// From the fault to the first survivor's failed call (none where every survivor met the
    /// failure inside `admit`, which recovers without a line).
    pub(crate) detected: Option<Duration>,
    /// From detection (or the fault, where none was seen) to the last survivor's completed
    /// call in the epoch without the victim, and that epoch.
    pub(crate) recovered: Option<(Duration, u64)>,
}

/// A replacement started for a fault.
#[derive(Clone, Copy)]
pub(crate) struct Joining {
    /// The fault's index.
    pub(crate) fault: usize,
    /// The job rank it replaces.
    pub(crate) replaces: usize,
    pub(crate) started: Instant,
    /// From its start to its `join` returning, the epoch that took it in, its job rank.
    pub(crate) joined: Option<(Duration, u64, usize)>,
}

/// Median, 95th percentile and maximum of `v`, in ms.
fn stat(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    format!(
        "median {:.0}, p95 {:.0}, max {:.0} ms (n={})",
        at(0.5),
        at(0.95),
        v[v.len() - 1],
        v.len()
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn summary(
    faults: &[Fault],
    joins: &[Joining],
    epochs: &BTreeMap<u64, Vec<usize>>,
    took: Duration,
) {
    let minutes = took.as_secs_f64() / 60.0;
    println!(
        "chaos: {} faults in {:.1} s, {:.1} a minute ({} kills, {} stops); last epoch {:?}",
        faults.len(),
        took.as_secs_f64(),
        faults.len() as f64 / minutes.max(1e-9),
        faults.iter().filter(|f| f.what == "kill").count(),
        faults.iter().filter(|f| f.what == "stop").count(),
        epochs.iter().next_back()
    );
    for kind in [None, Some("kill"), Some("stop")] {
        let of: Vec<&Fault> = faults
            .iter()
            .filter(|f| kind.is_none_or(|k| f.what == k))
            .collect();
        let detect = of.iter().filter_map(|f| f.detected.map(ms)).collect();
        let recover = of
            .iter()
            .filter_map(|f| f.recovered.map(|r| ms(r.0)))
            .collect();
        let unseen = of
            .iter()
            .filter(|f| f.recovered.is_some() && f.detected.is_none())
            .count();
        println!(
            "chaos: {}: detection {}; recovery {}; detected inside admit {unseen}",
            kind.unwrap_or("all faults"),
            stat(detect),
            stat(recover)
        );
    }
    let joined: Vec<f64> = joins
        .iter()
        .filter_map(|j| j.joined.map(|(d, _, _)| ms(d)))
        .collect();
    println!(
        "chaos: replacements: {} started, {} members; start to member {}",
        joins.len(),
        joined.len(),
        stat(joined.clone())
    );
}

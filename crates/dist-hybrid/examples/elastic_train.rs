//! Data-parallel training that survives the loss of a rank: linear regression on a fixed data
//! set, each sample owned by one member of the current group, the gradient summed with one
//! all_reduce per step. One rank (chosen at random, never rank 0, which serves the job's
//! store) kills itself with SIGKILL at a random step. The survivors' all_reduce fails with
//! the revocation naming it; they `recover` (agree on the new members through the store and
//! form the next epoch), take the new rank 0's step and weights (a survivor may have finished
//! the failed step where another had not), re-shard the samples over the new group, and redo
//! the step.
//!
//! The gradient is a sum over every sample, whichever member owns it, so the run computes what
//! an undisturbed one does, up to the order of floating-point additions. At the end every rank
//! checks that all ranks hold bit-identical weights, that the weights and the final loss match
//! a serial run of the same data on this rank (relative error below 1e-9), that the loss fell,
//! and, when a rank was killed, that the job went on without it; it fails otherwise.
//!
//!     cargo xtask run -n 4 --tolerate 1 --example elastic_train
//!     dist-run -n 4 --tolerate 1 target/release/examples/elastic_train
//!
//! `ELASTIC_KILL=R:S` kills rank R at step S instead of the random choice (which follows
//! `MASTER_PORT`, so every rank computes the same); `ELASTIC_KILL=none` kills no one. TCP and
//! shared memory only: `HybridBackend::recover` recovers an NCCL side too, but this example
//! does not use it yet.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use dist_core::{Backend, Collectives, DistError, ReduceOp};
use dist_tcp::{TcpBackend, TcpConfig};

const FEATURES: usize = 128;
const SAMPLES: usize = 4096;
const STEPS: usize = 60;
/// The step size: the data are scaled so that XᵀX/N is close to the identity.
const LR: f64 = 0.5;
/// How long one recovery may take.
const RECOVER: Duration = Duration::from_secs(30);
/// How long a rank may go silent before the others judge it failed.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest relative difference from the serial run that is floating-point reordering.
const TOLERANCE: f64 = 1e-9;

/// A deterministic pseudo-random number in [-1, 1).
fn noise(seed: u64) -> f64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// The whole data set (every rank makes the same one): row-major SAMPLES × FEATURES, targets
/// from a true weight vector plus a little noise (so the loss does not fall to zero).
struct Data {
    x: Vec<f64>,
    y: Vec<f64>,
}

impl Data {
    fn new() -> Data {
        let scale = (3.0 / FEATURES as f64).sqrt();
        let mut x = vec![0f64; SAMPLES * FEATURES];
        let mut y = vec![0f64; SAMPLES];
        for i in 0..SAMPLES {
            let row = &mut x[i * FEATURES..(i + 1) * FEATURES];
            let mut dot = 0.0;
            for (j, v) in row.iter_mut().enumerate() {
                *v = noise((i * FEATURES + j) as u64 + 1_000_003) * scale;
                dot += *v * noise(j as u64 + 7);
            }
            y[i] = dot + 0.05 * noise(i as u64 + 99);
        }
        Data { x, y }
    }

    /// The gradient and loss sums (FEATURES + 1 values: Σ xᵢ rᵢ, then Σ rᵢ²/2) over the
    /// samples `i` with `i % members == member`.
    fn sums(&self, w: &[f64], member: usize, members: usize) -> Vec<f64> {
        let mut out = vec![0f64; FEATURES + 1];
        for i in (member..SAMPLES).step_by(members) {
            let row = &self.x[i * FEATURES..(i + 1) * FEATURES];
            let r = row.iter().zip(w).map(|(a, b)| a * b).sum::<f64>() - self.y[i];
            for (g, a) in out.iter_mut().zip(row) {
                *g += a * r;
            }
            out[FEATURES] += r * r / 2.0;
        }
        out
    }
}

/// One step from the summed gradient: w -= LR · g / N.
fn update(w: &mut [f64], sums: &[f64]) {
    for (wi, g) in w.iter_mut().zip(sums) {
        *wi -= LR * g / SAMPLES as f64;
    }
}

/// The undisturbed run, serially on this rank: its final weights and loss.
fn serial(data: &Data) -> (Vec<f64>, f64) {
    let mut w = vec![0f64; FEATURES];
    for _ in 0..STEPS {
        let sums = data.sums(&w, 0, 1);
        update(&mut w, &sums);
    }
    let loss = data.sums(&w, 0, 1)[FEATURES] / SAMPLES as f64;
    (w, loss)
}

/// Which job rank dies at which step, if any.
fn victim(world: usize) -> Result<Option<(usize, usize)>, String> {
    match std::env::var("ELASTIC_KILL").ok().as_deref() {
        Some("none") => Ok(None),
        Some(spec) => {
            let parsed = spec
                .split_once(':')
                .and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?)));
            match parsed {
                Some((0, _)) => Err("ELASTIC_KILL: rank 0 serves the store; kill another".into()),
                Some((r, s)) if r < world && s < STEPS => Ok(Some((r, s))),
                _ => Err(format!(
                    "ELASTIC_KILL={spec:?}: want RANK:STEP, 0 < RANK < {world}, STEP < {STEPS}"
                )),
            }
        }
        None if world < 2 => Ok(None),
        None => {
            let seed = std::env::var("MASTER_PORT")
                .ok()
                .and_then(|p| p.parse::<u64>().ok())
                .unwrap_or(1);
            let r = 1 + (noise(seed).abs() * (world - 1) as f64) as usize % (world - 1);
            let s = 5 + (noise(seed + 1).abs() * (STEPS - 10) as f64) as usize;
            Ok(Some((r, s.min(STEPS - 1))))
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("elastic_train: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let cfg = TcpConfig::from_env()
        .map_err(|e| e.to_string())?
        .peer_timeout(PEER_TIMEOUT)
        .elastic(true);
    let mut b = TcpBackend::with_config(cfg).map_err(|e| format!("init: {e}"))?;
    let (me, world) = (b.rank(), b.world_size());
    let kill = victim(world)?;
    if me == 0 {
        match kill {
            Some((r, s)) => println!("{world} ranks, {STEPS} steps; rank {r} dies at step {s}"),
            None => println!("{world} ranks, {STEPS} steps; no rank dies"),
        }
    }
    let data = Data::new();
    let mut w = vec![0f64; FEATURES];
    let mut first_loss = None;
    let mut step = 0;
    while step < STEPS {
        if kill == Some((me, step)) {
            println!("rank {me}: SIGKILL at step {step}");
            let pid = std::process::id().to_string();
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            // Without a `kill` program: die by a signal all the same (SIGABRT).
            std::process::abort();
        }
        let mut sums = data.sums(&w, b.rank(), b.world_size());
        match b.all_reduce(&mut sums, ReduceOp::Sum) {
            Ok(()) => {
                first_loss.get_or_insert(sums[FEATURES] / SAMPLES as f64);
                update(&mut w, &sums);
                step += 1;
            }
            Err(e) => {
                println!("rank {me}: step {step}: {e}");
                let t = Instant::now();
                b = match b.recover(RECOVER) {
                    Ok(next) => next,
                    Err(e @ DistError::Excluded { .. }) => {
                        return Err(format!("rank {me} was left out: {e}"));
                    }
                    Err(e) => return Err(format!("rank {me}: recover: {e}")),
                };
                println!(
                    "rank {me}: recovered in {:.2?}: epoch {}, rank {} of members {:?}",
                    t.elapsed(),
                    b.epoch(),
                    b.rank(),
                    b.members()
                );
                // One state for all: the new rank 0's step and weights.
                let mut state = Vec::with_capacity(FEATURES + 1);
                state.push(step as f64);
                state.extend_from_slice(&w);
                b.broadcast(&mut state, 0)
                    .map_err(|e| format!("rank {me}: the state's broadcast: {e}"))?;
                step = state[0] as usize;
                w.copy_from_slice(&state[1..]);
            }
        }
    }
    check(&b, &data, &w, first_loss, kill.map(|(r, _)| (r, world)))
}

/// The end state: identical weights everywhere, the serial run's result, a falling loss, and
/// the job one rank smaller when one died (`killed`: the victim and the job's first size).
fn check(
    b: &TcpBackend,
    data: &Data,
    w: &[f64],
    first_loss: Option<f64>,
    killed: Option<(usize, usize)>,
) -> Result<(), String> {
    let me = b.members()[b.rank()];
    let e = |what: &'static str| move |err: DistError| format!("rank {me}: {what}: {err}");
    let (mut hi, mut lo) = (w.to_vec(), w.to_vec());
    b.all_reduce(&mut hi, ReduceOp::Max).map_err(e("max"))?;
    b.all_reduce(&mut lo, ReduceOp::Min).map_err(e("min"))?;
    if hi != w || lo != w {
        return Err(format!("rank {me}: the ranks' weights differ"));
    }
    let mut loss = data.sums(w, b.rank(), b.world_size());
    b.all_reduce(&mut loss, ReduceOp::Sum).map_err(e("loss"))?;
    let loss = loss[FEATURES] / SAMPLES as f64;
    let (w_ref, loss_ref) = serial(data);
    let w_err = w
        .iter()
        .zip(&w_ref)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
        / w_ref.iter().map(|v| v.abs()).fold(0.0, f64::max);
    let loss_err = (loss - loss_ref).abs() / loss_ref;
    if w_err > TOLERANCE || loss_err > TOLERANCE {
        return Err(format!(
            "rank {me}: final loss {loss:.12} against {loss_ref:.12} undisturbed (relative \
             {loss_err:.1e}), weights {w_err:.1e} apart"
        ));
    }
    let first = first_loss.ok_or("no step completed")?;
    if loss >= first {
        return Err(format!(
            "rank {me}: the loss did not fall ({first} -> {loss})"
        ));
    }
    if let Some((victim, world)) = killed
        && (b.epoch() == 0 || b.members().contains(&victim) || b.world_size() + 1 != world)
    {
        return Err(format!(
            "rank {me}: rank {victim} was to die, but the job ends at epoch {} with members {:?}",
            b.epoch(),
            b.members()
        ));
    }
    if b.rank() == 0 {
        println!(
            "elastic_train: {STEPS} steps, epoch {}, members {:?}, loss {first:.6} -> {loss:.9} \
             (undisturbed {loss_ref:.9}, relative {loss_err:.1e}; weights {w_err:.1e})",
            b.epoch(),
            b.members()
        );
    }
    Ok(())
}

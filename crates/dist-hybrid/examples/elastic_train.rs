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
//! Between steps every member calls `admit`, which takes in a process waiting to join: a
//! replacement the launcher starts for the killed rank (`dist-run --replace 1`, which starts
//! it with `DIST_JOIN=1`). The replacement joins through the store (`TcpBackend::join`),
//! receives the step and the weights from rank 0 by the same broadcast a recovery ends with,
//! and trains on; it may come in at the survivors' recovery itself, or at a later step. With
//! `ELASTIC_REPLACED=1` the members wait for it after the last step (at most 30 s), and every
//! rank checks that the job ends as large as it began, the killed rank replaced.
//!
//!     cargo xtask run -n 4 --tolerate 1 --example elastic_train
//!     dist-run -n 4 --tolerate 1 target/release/examples/elastic_train
//!     cargo xtask run -n 4 --replace 1 --example elastic_train
//!     ELASTIC_REPLACED=1 dist-run -n 4 --replace 1 target/release/examples/elastic_train
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
/// How long one recovery, one admission or one join may take.
const RECOVER: Duration = Duration::from_secs(30);
/// How long the members wait for an expected replacement after the last step.
const AWAIT_REPLACEMENT: Duration = Duration::from_secs(30);
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
    let started = Instant::now();
    let cfg = TcpConfig::from_env()
        .map_err(|e| e.to_string())?
        .peer_timeout(PEER_TIMEOUT)
        .elastic(true);
    let expect_replacement = std::env::var("ELASTIC_REPLACED").is_ok_and(|v| v == "1");
    let data = Data::new();
    let mut w = vec![0f64; FEATURES];
    let mut step = 0;
    let joiner = dist_tcp::joining();
    let mut b = if joiner {
        let b = TcpBackend::join(cfg, RECOVER).map_err(|e| format!("join: {e}"))?;
        println!(
            "joiner: taken in {:.2?} after it started: epoch {}, rank {} of {}, members {:?}",
            started.elapsed(),
            b.epoch(),
            b.rank(),
            b.world_size(),
            b.members()
        );
        // Its first collective: the members' state, as after every change of epoch.
        sync_state(&b, &mut step, &mut w)?;
        b
    } else {
        TcpBackend::with_config(cfg).map_err(|e| format!("init: {e}"))?
    };
    // The job rank: the rank it had at epoch 0 (a joiner's comes after all of those).
    let me = b.members()[b.rank()];
    let world = if joiner { 0 } else { b.world_size() };
    let kill = if joiner { None } else { victim(world)? };
    if me == 0 {
        match kill {
            Some((r, s)) => println!("{world} ranks, {STEPS} steps; rank {r} dies at step {s}"),
            None => println!("{world} ranks, {STEPS} steps; no rank dies"),
        }
    }
    let mut first_loss = None;
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
                // Between steps: take in whoever waits to join.
                let epoch = b.epoch();
                b = b
                    .admit(RECOVER)
                    .map_err(|e| format!("rank {me}: admit: {e}"))?;
                if b.epoch() != epoch {
                    println!(
                        "rank {me}: epoch {} after step {step}: members {:?}",
                        b.epoch(),
                        b.members()
                    );
                    sync_state(&b, &mut step, &mut w)?;
                }
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
                sync_state(&b, &mut step, &mut w)?;
            }
        }
    }
    if expect_replacement && !joiner && kill.is_some() {
        b = await_replacement(b, world, &mut step, &mut w)?;
    }
    check(
        &b,
        &data,
        &w,
        first_loss,
        kill.map(|(r, _)| (r, world)),
        expect_replacement,
    )
}

/// One state for all, after a change of epoch: the new rank 0's step and weights (a survivor
/// may have finished the failed step where another had not; a joiner has neither).
fn sync_state(b: &TcpBackend, step: &mut usize, w: &mut [f64]) -> Result<(), String> {
    let mut state = Vec::with_capacity(FEATURES + 1);
    state.push(*step as f64);
    state.extend_from_slice(w);
    b.broadcast(&mut state, 0)
        .map_err(|e| format!("rank {}: the state's broadcast: {e}", b.rank()))?;
    *step = state[0] as usize;
    w.copy_from_slice(&state[1..]);
    Ok(())
}

/// After the last step, on the members: `admit` until the group is back at `world` ranks (a
/// replacement the launcher started has been taken in), at most [`AWAIT_REPLACEMENT`].
fn await_replacement(
    mut b: TcpBackend,
    world: usize,
    step: &mut usize,
    w: &mut [f64],
) -> Result<TcpBackend, String> {
    let until = Instant::now() + AWAIT_REPLACEMENT;
    while b.world_size() < world {
        if Instant::now() > until {
            return Err(format!(
                "no replacement taken in within {AWAIT_REPLACEMENT:?} of the last step: \
                 epoch {}, members {:?}",
                b.epoch(),
                b.members()
            ));
        }
        let epoch = b.epoch();
        b = b.admit(RECOVER).map_err(|e| format!("admit: {e}"))?;
        if b.epoch() == epoch {
            // Nobody waiting yet: look again shortly (the look is a broadcast and one store
            // read on rank 0).
            std::thread::sleep(Duration::from_millis(20));
        } else {
            sync_state(&b, step, w)?;
        }
    }
    Ok(b)
}

/// The end state: identical weights everywhere, the serial run's result, a falling loss, and
/// the job one rank smaller when one died (`killed`: the victim and the job's first size), or
/// as large as it began with the victim replaced (`replaced`).
fn check(
    b: &TcpBackend,
    data: &Data,
    w: &[f64],
    first_loss: Option<f64>,
    killed: Option<(usize, usize)>,
    replaced: bool,
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
    // A joiner taken in after the last step completed none: the first loss is the members'.
    let mut first = [first_loss.unwrap_or(f64::MIN)];
    b.all_reduce(&mut first, ReduceOp::Max)
        .map_err(e("first loss"))?;
    let first = first[0];
    if first == f64::MIN {
        return Err(format!("rank {me}: no step completed"));
    }
    if loss >= first {
        return Err(format!(
            "rank {me}: the loss did not fall ({first} -> {loss})"
        ));
    }
    let size = if replaced {
        world_of(killed)
    } else {
        world_of(killed).saturating_sub(1)
    };
    if let Some((victim, _)) = killed
        && (b.epoch() == 0 || b.members().contains(&victim) || b.world_size() != size)
    {
        return Err(format!(
            "rank {me}: rank {victim} was to die{}, but the job ends at epoch {} with members {:?}",
            if replaced { " and be replaced" } else { "" },
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

/// The job's first size, from the members' `killed` (the joiner's is 0: it checks nothing of
/// it, the members do).
fn world_of(killed: Option<(usize, usize)>) -> usize {
    killed.map_or(0, |(_, w)| w)
}

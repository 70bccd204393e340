//! Launching N local ranks of a program: a free port, the torchrun environment, each output
//! line prefixed with its rank, every rank killed on the first failure or on the deadline.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// One launch of `world` ranks of a program.
#[derive(Debug, Clone)]
pub struct Job {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub world: usize,
    pub timeout: Duration,
    /// Put in front of every output line, before the rank.
    pub label: String,
    pub env: Vec<(String, String)>,
    /// Print rank 0's stdout without a prefix (for tables) and others' prefixed.
    pub plain_rank0: bool,
}

/// How a launch ended.
#[derive(Debug)]
pub enum Outcome {
    Passed,
    /// Some rank said it cannot run here (exit status 77), none failed.
    Skipped,
    Failed(String),
}

/// The exit status with which a test program says "skipped" (automake's convention).
pub const SKIP_STATUS: i32 = 77;

/// A port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .context("bind an ephemeral port")?
        .local_addr()?
        .port())
}

fn forward(
    pipe: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    log: Arc<Mutex<Vec<String>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            let text = format!("{prefix}{line}");
            if to_stderr {
                eprintln!("{text}");
            } else {
                println!("{text}");
            }
            if let Ok(mut l) = log.lock() {
                l.push(text);
                let n = l.len();
                if n > 200 {
                    l.drain(..n - 200);
                }
            }
        }
    })
}

/// Runs the job to completion, failure or deadline.
pub fn run(job: &Job) -> Result<Outcome> {
    let port = free_port()?;
    let mut children: Vec<Option<Child>> = Vec::with_capacity(job.world);
    let mut pipes = Vec::new();
    let log = Arc::new(Mutex::new(Vec::new()));
    for rank in 0..job.world {
        let mut cmd = Command::new(&job.program);
        cmd.args(&job.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", job.world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", job.world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            // NVLink SHARP (NVLS) stays off in every process we start, as in every GPU run that
            // docs/benchmarks.md records.
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &job.env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(e).with_context(|| format!("start {}", job.program.display()));
            }
        };
        let prefix = format!("[{}r{rank}] ", job.label);
        let out_prefix = if job.plain_rank0 && rank == 0 {
            String::new()
        } else {
            prefix.clone()
        };
        pipes.push(forward(
            child.stdout.take().expect("piped"),
            out_prefix,
            false,
            log.clone(),
        ));
        pipes.push(forward(
            child.stderr.take().expect("piped"),
            prefix,
            true,
            log.clone(),
        ));
        children.push(Some(child));
    }
    let started = Instant::now();
    let mut skipped = false;
    let outcome = loop {
        let mut running = Vec::new();
        let mut failure = None;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) if status.success() => *slot = None,
                Ok(Some(status)) if status.code() == Some(SKIP_STATUS) => {
                    skipped = true;
                    *slot = None;
                }
                Ok(Some(status)) => {
                    failure = Some(format!("rank {rank} failed ({status})"));
                    *slot = None;
                    break;
                }
                Ok(None) => running.push(rank),
                Err(e) => {
                    failure = Some(format!("rank {rank}: cannot wait: {e}"));
                    break;
                }
            }
        }
        if let Some(f) = failure {
            break Outcome::Failed(f);
        }
        if running.is_empty() {
            break if skipped {
                Outcome::Skipped
            } else {
                Outcome::Passed
            };
        }
        if started.elapsed() > job.timeout {
            break Outcome::Failed(format!(
                "timed out after {:?}; ranks {running:?} still running",
                job.timeout
            ));
        }
        // A supervisor's poll: children are checked every few milliseconds.
        std::thread::sleep(Duration::from_millis(5));
    };
    kill_all(&mut children);
    for p in pipes {
        let _ = p.join();
    }
    Ok(outcome)
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
    }
    for c in children.iter_mut().flatten() {
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of two ranks of `sh -c SCRIPT` (RANK tells them apart).
    fn job(script: &str) -> Job {
        Job {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            world: 2,
            timeout: Duration::from_secs(20),
            label: "t ".into(),
            env: Vec::new(),
            plain_rank0: false,
        }
    }

    /// A rank that exits 77 makes the case skipped, never passed; a failure still wins.
    #[test]
    fn exit_77_counts_as_skipped_never_passed() {
        let outcome = |script: &str| run(&job(script)).unwrap();
        assert!(matches!(outcome("exit 0"), Outcome::Passed));
        assert!(matches!(outcome("exit 77"), Outcome::Skipped));
        let one_skips = r#"[ "$RANK" = 0 ] && exit 77; exit 0"#;
        assert!(matches!(outcome(one_skips), Outcome::Skipped));
        let skip_and_fail = r#"[ "$RANK" = 0 ] && exit 77; exit 3"#;
        assert!(
            matches!(outcome(skip_and_fail), Outcome::Failed(ref w) if w.contains("rank 1")),
            "a failure beside a skip must fail the case"
        );
    }
}

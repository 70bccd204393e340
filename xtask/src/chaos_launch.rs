//! How `cargo xtask chaos` starts its ranks and replacements (the environment of each, its
//! lines forwarded to the driver), signals them, and draws its faults' choices.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, Result};

/// A small deterministic generator for the faults' choices.
pub(crate) struct Dice(pub(crate) u64);

impl Dice {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

pub(crate) fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// What every rank's process is started with.
pub(crate) struct Launch {
    pub(crate) program: PathBuf,
    pub(crate) logs: PathBuf,
    pub(crate) world: usize,
    pub(crate) port: u16,
    pub(crate) seed: u64,
    pub(crate) until_s: u64,
    pub(crate) peer_timeout_ms: u64,
    pub(crate) admit_ms: u64,
    pub(crate) tx: mpsc::Sender<(usize, Instant, String)>,
}

impl Launch {
    /// Starts process `index` as job rank `rank` (a replacement: `DIST_JOIN=1`, the rank it
    /// replaces, whose `RANK` is only checked against `WORLD_SIZE`: `join` takes the store's
    /// next job rank), its lines sent to the driver.
    pub(crate) fn start(&self, index: usize, rank: usize, join: bool) -> Result<Child> {
        let rank = rank % self.world;
        let mut cmd = Command::new(&self.program);
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", self.world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string())
            .env("DIST_SERVE_STORE", "0")
            .env("DIST_STORE_PREFIX", format!("chaos/{}", self.seed))
            .env("CHAOS_UNTIL", self.until_s.to_string())
            .env("CHAOS_PEER_TIMEOUT_MS", self.peer_timeout_ms.to_string())
            .env("CHAOS_ADMIT_MS", self.admit_ms.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log_path(&self.logs, index))?);
        if join {
            cmd.env("DIST_JOIN", "1");
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {}", self.program.display()))?;
        let out = child.stdout.take().expect("piped");
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(std::io::Result::ok) {
                if tx.send((index, Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Ok(child)
    }
}

fn log_path(logs: &Path, index: usize) -> PathBuf {
    logs.join(format!("proc{index}.err"))
}

/// Job ranks from a line's comma-separated list.
pub(crate) fn parse_members(text: &str) -> Vec<usize> {
    text.split(',').filter_map(|m| m.parse().ok()).collect()
}

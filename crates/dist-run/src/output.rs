//! The ranks' output: a thread per pipe reads lines, puts the rank's prefix in front, prints them
//! (whole lines, so ranks never interleave within one) and keeps the last [`KEPT_LINES`] for the
//! report. Bytes that are not UTF-8 pass through as they are; a line longer than [`LINE_MAX`] is
//! cut into pieces of that size, each prefixed.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The output lines a run keeps for its report.
pub const KEPT_LINES: usize = 200;
/// The longest piece printed as one line.
pub const LINE_MAX: usize = 64 << 10;

/// Where a pipe's lines go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Out,
    Err,
}

/// The pipe readers of one run.
#[derive(Debug)]
pub(crate) struct Pipes {
    kept: Arc<Mutex<Vec<String>>>,
    done_tx: Sender<()>,
    done_rx: Receiver<()>,
    started: usize,
}

impl Pipes {
    pub(crate) fn new() -> Pipes {
        let (done_tx, done_rx) = channel();
        Pipes {
            kept: Arc::default(),
            done_tx,
            done_rx,
            started: 0,
        }
    }

    /// Reads `pipe` to its end on a thread of its own: each line with `prefix`, printed to `to`
    /// if given, and kept.
    pub(crate) fn forward(
        &mut self,
        pipe: impl Read + Send + 'static,
        prefix: String,
        to: Option<Stream>,
    ) {
        let kept = self.kept.clone();
        let done = self.done_tx.clone();
        self.started += 1;
        std::thread::spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match (&mut reader)
                    .take(LINE_MAX as u64)
                    .read_until(b'\n', &mut line)
                {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if line.last() == Some(&b'\n') {
                    line.pop();
                }
                emit(&prefix, &line, to);
                if let Ok(mut k) = kept.lock() {
                    k.push(format!("{prefix}{}", String::from_utf8_lossy(&line)));
                    let n = k.len();
                    if n > KEPT_LINES {
                        k.drain(..n - KEPT_LINES);
                    }
                }
            }
            let _ = done.send(());
        });
    }

    /// Waits until every pipe has ended, or `within` has passed (a process the rank started may
    /// still hold its pipe open; its reader is then left behind), and returns the kept lines.
    pub(crate) fn finish(self, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        for _ in 0..self.started {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *kept)
    }
}

/// Prints one line; a closed stdout or stderr is ignored, so the pipes keep draining.
fn emit(prefix: &str, line: &[u8], to: Option<Stream>) {
    fn write(mut w: impl Write, prefix: &str, line: &[u8]) {
        let _ = w
            .write_all(prefix.as_bytes())
            .and_then(|()| w.write_all(line))
            .and_then(|()| w.write_all(b"\n"))
            .and_then(|()| w.flush());
    }
    match to {
        Some(Stream::Out) => write(std::io::stdout().lock(), prefix, line),
        Some(Stream::Err) => write(std::io::stderr().lock(), prefix, line),
        None => {}
    }
}

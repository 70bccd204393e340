//! Flow control: a rank that posts no receive for a while is not made to hold everything its
//! peer sends. The heavy part runs between ranks 0 and 1 only; the other
//! ranks just take part in the barrier at the end.

use std::time::{Duration, Instant};

use dist_core::{Backend, Tag};
use dist_tcp::DEFAULT_UNEXPECTED_LIMIT;

use dist_multirank::{fill, first_difference, join, seed};

const MSG: usize = 1 << 20;
const COUNT: u64 = 2048;
/// One message larger than the whole unexpected-message budget.
const BIG: usize = 256 << 20;
/// What the receiver may grow by beyond the budget (and, in the second part, its own buffer):
/// the reader's buffers, thread stacks, the allocator's slack.
const SLACK: u64 = 32 << 20;

/// This process's peak resident set (VmHWM), in bytes.
pub fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in kB");
    kb << 10
}

/// Rank 0 sends 2 GiB in 1 MiB messages to rank 1, which posts no receive for 10 s, then
/// receives them all in order, every byte checked; its peak RSS must stay under the budget plus
/// [`SLACK`]. Then rank 0 sends one 256 MiB message (larger than the budget) that rank 1
/// receives after a second: it lands in place, never queued. Fails before the fix: rank 1's
/// reader queued all 2 GiB (peak RSS about 2 GiB above the start).
pub fn unexpected() -> Result<(), String> {
    let b = join();
    let me = b.rank();
    let tag = Tag::user(7);
    if me == 0 {
        let mut out = vec![0u8; MSG];
        for k in 0..COUNT {
            fill(&mut out, seed(0, 1, k));
            b.send_tagged(&out, 1, tag)
                .unwrap_or_else(|e| panic!("message {k}: {e}"));
        }
        let mut big = vec![0u8; BIG];
        fill(&mut big, seed(0, 1, COUNT));
        b.send_tagged(&big, 1, tag)
            .unwrap_or_else(|e| panic!("{e}"));
    } else if me == 1 {
        let start = peak_rss();
        // The scenario: nobody receives for 10 s while rank 0 sends.
        std::thread::sleep(Duration::from_secs(10));
        let t = Instant::now();
        let mut buf = vec![0u8; MSG];
        for k in 0..COUNT {
            buf.fill(0xAA);
            b.recv_tagged(&mut buf, 0, tag)
                .unwrap_or_else(|e| panic!("message {k}: {e}"));
            if let Some(at) = first_difference(&buf, seed(0, 1, k)) {
                panic!("message {k}: wrong byte at offset {at}");
            }
        }
        let peak = peak_rss();
        let grown = peak.saturating_sub(start);
        println!(
            "2 GiB received in {:.1?} after 10 s unposted; peak RSS grew by {} MiB (budget {} MiB)",
            t.elapsed(),
            grown >> 20,
            DEFAULT_UNEXPECTED_LIMIT >> 20
        );
        assert!(
            grown <= DEFAULT_UNEXPECTED_LIMIT as u64 + SLACK,
            "peak RSS grew by {grown} bytes with a budget of {DEFAULT_UNEXPECTED_LIMIT}"
        );
        drop(buf);
        // The scenario's second half: the message larger than the whole budget arrives before
        // its receive is posted (rank 0 sends it right after the 2 GiB), so the reader must hold
        // it in the socket and then read it straight into the buffer posted late. Posting at
        // once would test only the ordinary path.
        std::thread::sleep(Duration::from_secs(1));
        let mut big = vec![0u8; BIG];
        b.recv_tagged(&mut big, 0, tag)
            .unwrap_or_else(|e| panic!("{e}"));
        if let Some(at) = first_difference(&big, seed(0, 1, COUNT)) {
            panic!("the {BIG}-byte message: wrong byte at offset {at}");
        }
        let grown = peak_rss().saturating_sub(start);
        assert!(
            grown <= BIG as u64 + DEFAULT_UNEXPECTED_LIMIT as u64 + SLACK,
            "peak RSS grew by {grown} bytes receiving one {BIG}-byte message"
        );
    }
    b.barrier_timeout(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{e}"));
    Ok(())
}

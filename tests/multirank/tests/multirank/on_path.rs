//! Someone on the path between two simulated hosts changes a sealed connection while it runs:
//! the hosts are joined by the launcher's hub ([`dist_launch::Hosts::with_path`]), which hands
//! every Ethernet frame to [`Attacker`] before passing it on. The attacker follows the TCP
//! segments that host 0 sends host 1 and, once the job's all_reduces are well under way, forges
//! one (a byte of its data flipped), replays one (an earlier segment's data in its place),
//! reorders two (their data swapped) or cuts the stream short (a FIN in the middle of a
//! segment, everything after it dropped), each with the TCP checksum made right again, so the
//! receiving kernel takes the segment as its own and hands it to dist. The ranks run
//! `hosts2_sealed_path` (sealed all_reduces, every result checked): rank 1 must end with an error
//! naming rank 0 and the sealed record, and no rank may report a wrong result (with sealing off,
//! the forged, replayed and reordered data is delivered and the ranks say so).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dist_launch::{Hosts, Job, Outcome};
use libtest_mimic::Failed;

/// What a rank of `hosts2_sealed_path` says when it was handed a wrong result (its `FORGED`).
const FORGED: &str = "forged data delivered";
/// The segments of a full payload from host 0 to host 1 let through before the attack: past
/// formation and the first all_reduce (each moves about 1 MiB, some 720 segments, that way).
const AFTER: usize = 1000;
/// A segment at least this long is one of a bulk transfer.
const BULK: usize = 1000;
/// Host 0's and host 1's addresses (`dist_launch::hosts::SUBNET`).
const FROM: [u8; 4] = [10, 213, 0, 1];
const TO: [u8; 4] = [10, 213, 0, 2];

/// What the attacker does to the connection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Attack {
    /// One byte of a segment's data flipped.
    Forge,
    /// A segment's data replaced by the data of the segment before it.
    Replay,
    /// Two segments' data swapped.
    Reorder,
    /// The stream ended (FIN) halfway through a segment's data, nothing after it passed on.
    Truncate,
}

/// Where the parts of an IPv4 TCP frame lie.
struct Segment {
    /// The IP header's start.
    ip: usize,
    /// The TCP header's start.
    tcp: usize,
    /// The data: `data..end`.
    data: usize,
    end: usize,
}

impl Segment {
    /// The TCP segment in `f` from host 0 to host 1, if it is one.
    fn parse(f: &[u8]) -> Option<Segment> {
        let ip = 14;
        if f.len() < ip + 20 || f[12..14] != [0x08, 0x00] || f[ip] >> 4 != 4 || f[ip + 9] != 6 {
            return None;
        }
        if f[ip + 12..ip + 16] != FROM || f[ip + 16..ip + 20] != TO {
            return None;
        }
        let tcp = ip + usize::from(f[ip] & 0x0f) * 4;
        let end = ip + usize::from(u16::from_be_bytes([f[ip + 2], f[ip + 3]]));
        if end > f.len() || tcp + 20 > end {
            return None;
        }
        let data = tcp + usize::from(f[tcp + 12] >> 4) * 4;
        (data <= end).then_some(Segment { ip, tcp, data, end })
    }

    /// The connection it belongs to: its source and destination ports.
    fn ports(&self, f: &[u8]) -> [u8; 4] {
        f[self.tcp..self.tcp + 4].try_into().expect("4 bytes")
    }

    fn len(&self) -> usize {
        self.end - self.data
    }

    /// The IP header's and the TCP checksums made right for the frame as it now is.
    fn seal_sums(&self, f: &mut [u8]) {
        f[self.ip + 10..self.ip + 12].fill(0);
        let s = !fold(sum(&f[self.ip..self.tcp], 0));
        f[self.ip + 10..self.ip + 12].copy_from_slice(&s.to_be_bytes());
        f[self.tcp + 16..self.tcp + 18].fill(0);
        let mut pseudo = [0u8; 12];
        pseudo[..8].copy_from_slice(&f[self.ip + 12..self.ip + 20]);
        pseudo[9] = 6;
        pseudo[10..].copy_from_slice(&((self.end - self.tcp) as u16).to_be_bytes());
        let s = !fold(sum(&f[self.tcp..self.end], sum(&pseudo, 0)));
        f[self.tcp + 16..self.tcp + 18].copy_from_slice(&s.to_be_bytes());
    }
}

/// The ones' complement sum of `b` as 16-bit words, added to `acc`, not yet folded.
fn sum(b: &[u8], mut acc: u64) -> u64 {
    for w in b.chunks(2) {
        acc += u64::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut s: u64) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The thing on the path: counts the bulk segments from host 0 to host 1 and attacks once.
struct Attacker {
    attack: Attack,
    /// Bulk segments seen so far.
    seen: usize,
    /// The last bulk segment's connection and data (for a replay).
    last: Option<([u8; 4], Vec<u8>)>,
    /// A segment held back to be swapped with the next of its connection (for a reorder).
    held: Option<Vec<u8>>,
    /// The connection cut short: its later segments are dropped.
    cut: Option<[u8; 4]>,
    /// Attacks made, for the trial to check.
    done: Arc<AtomicUsize>,
}

impl Attacker {
    fn on_frame(&mut self, from: usize, mut f: Vec<u8>) -> Vec<Vec<u8>> {
        let Some(seg) = (from == 0).then(|| Segment::parse(&f)).flatten() else {
            return vec![f];
        };
        let ports = seg.ports(&f);
        if self.cut == Some(ports) {
            return Vec::new();
        }
        if seg.len() < BULK || self.done.load(Ordering::Relaxed) > 0 {
            return vec![f];
        }
        self.seen += 1;
        if self.seen <= AFTER {
            self.last = Some((ports, f[seg.data..seg.end].to_vec()));
            return vec![f];
        }
        match self.attack {
            Attack::Forge => {
                f[seg.data + seg.len() / 2] ^= 0x40;
            }
            Attack::Replay => match &self.last {
                Some((p, d)) if *p == ports && d.len() == seg.len() => {
                    f[seg.data..seg.end].copy_from_slice(d);
                }
                _ => {
                    self.last = Some((ports, f[seg.data..seg.end].to_vec()));
                    return vec![f];
                }
            },
            Attack::Reorder => {
                let Some(mut first) = self.held.take() else {
                    self.held = Some(f);
                    return Vec::new();
                };
                let a = Segment::parse(&first).expect("held because it parsed");
                if a.ports(&first) != ports || a.len() != seg.len() {
                    // Not two of one connection alike: the first goes on as it was.
                    self.held = Some(f);
                    return vec![first];
                }
                let mine = f[seg.data..seg.end].to_vec();
                f[seg.data..seg.end].copy_from_slice(&first[a.data..a.end]);
                first[a.data..a.end].copy_from_slice(&mine);
                a.seal_sums(&mut first);
                seg.seal_sums(&mut f);
                self.done.fetch_add(1, Ordering::Relaxed);
                return vec![first, f];
            }
            Attack::Truncate => {
                // Half the data, then FIN: the receiver sees the stream end there.
                let keep = seg.data + seg.len() / 2;
                f.truncate(keep);
                let total = (keep - seg.ip) as u16;
                f[seg.ip + 2..seg.ip + 4].copy_from_slice(&total.to_be_bytes());
                f[seg.tcp + 13] |= 0x01;
                self.cut = Some(ports);
                let seg = Segment { end: keep, ..seg };
                seg.seal_sums(&mut f);
                self.done.fetch_add(1, Ordering::Relaxed);
                return vec![f];
            }
        }
        seg.seal_sums(&mut f);
        self.done.fetch_add(1, Ordering::Relaxed);
        vec![f]
    }
}

/// Runs `hosts2_sealed_path` on 2 hosts with `attack` on the path between them and checks that
/// it was refused: rank 1 names rank 0 and the sealed record, nothing forged was delivered.
fn refused(attack: Attack) -> Result<(), Failed> {
    let done = Arc::new(AtomicUsize::new(0));
    let mut attacker = Attacker {
        attack,
        seen: 0,
        last: None,
        held: None,
        cut: None,
        done: done.clone(),
    };
    let hosts = Hosts::with_path(
        2,
        Duration::ZERO,
        Box::new(move |from, f| attacker.on_frame(from, f)),
    )?;
    let env = dist_launch::test_env();
    let job = Job {
        program: env!("CARGO_BIN_EXE_dist-multirank").into(),
        args: vec!["hosts2_sealed_path".into()],
        world: 2,
        timeout: Duration::from_secs(120),
        label: format!("sealed path {attack:?} "),
        env,
        plain_rank0: false,
        echo: false,
        tolerate: 0,
        replace: 0,
    };
    let outcome = dist_launch::run_on(&job, Some(&hosts))?;
    drop(hosts);
    let made = done.load(Ordering::Relaxed);
    if made != 1 {
        return Err(format!("the attacker made {made} attacks, not 1: {outcome:?}").into());
    }
    let why = match outcome {
        Outcome::Failed(why) => why,
        other => return Err(format!("the job went on after the {attack:?}: {other:?}").into()),
    };
    if why.contains(FORGED) {
        return Err(format!("{attack:?}: a rank was handed forged data:\n{why}").into());
    }
    // A cut is told by the sealing layer when it reads the stream's end inside a record, or
    // before that by the check of a message held back, which sees the connection closed
    // before the message's end; either names the peer.
    let named = why.lines().find(|l| {
        l.contains("rank 1: all_reduce")
            && l.contains("peer 0 gone")
            && match attack {
                Attack::Truncate => {
                    l.contains("from rank 0 ended inside sealed record")
                        || l.contains("connection closed mid-message")
                }
                _ => {
                    l.contains("sealed record")
                        && l.contains("from rank 0 ")
                        && l.contains("failed its check")
                }
            }
    });
    let Some(line) = named else {
        return Err(format!(
            "{attack:?}: rank 1's error does not name rank 0 and the record:\n{why}"
        )
        .into());
    };
    println!("{attack:?} refused: {line}");
    Ok(())
}

pub(crate) fn a_forged_segment_is_refused() -> Result<(), Failed> {
    refused(Attack::Forge)
}

pub(crate) fn a_replayed_segment_is_refused() -> Result<(), Failed> {
    refused(Attack::Replay)
}

pub(crate) fn reordered_segments_are_refused() -> Result<(), Failed> {
    refused(Attack::Reorder)
}

pub(crate) fn a_truncated_stream_is_refused() -> Result<(), Failed> {
    refused(Attack::Truncate)
}

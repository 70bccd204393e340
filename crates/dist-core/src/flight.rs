//! The flight recorder: a bounded record of a backend's last operations (sequence number, op,
//! element type, count, peer or root, state and times), always on. When an operation times out
//! or aborts, the ranks' positions in it say who is behind ("rank 3 finished #41 all_reduce;
//! ranks 0–2 wait in #42 barrier"), and `DIST_TRACE_DIR` makes a rank write its record as JSON.
//!
//! Recording costs one uncontended lock and a store into a preallocated ring: no allocation
//! per operation (an error's text is kept only for failed ones).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How many operations a recorder keeps by default.
pub const DEFAULT_CAPACITY: usize = 2000;

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpState {
    /// Accepted, not yet started (e.g. enqueued on a GPU stream).
    Queued,
    /// Running on this rank.
    Started,
    /// Finished without error on this rank.
    Done,
    /// Failed on this rank.
    Failed,
}

impl OpState {
    /// The state's name, as the JSON record writes it.
    pub const fn name(self) -> &'static str {
        match self {
            OpState::Queued => "queued",
            OpState::Started => "started",
            OpState::Done => "done",
            OpState::Failed => "failed",
        }
    }

    fn is_open(self) -> bool {
        matches!(self, OpState::Queued | OpState::Started)
    }
}

/// What an operation was, as given to [`FlightRecorder::begin`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpInfo {
    /// The collective's sequence number on its communicator (0 for point-to-point).
    pub seq: u64,
    /// The operation, e.g. `"all_reduce"`, `"barrier"`, `"send"`.
    pub op: &'static str,
    /// The element type's name, `""` where there is none.
    pub dtype: &'static str,
    /// Elements (or bytes, for untyped messages).
    pub count: usize,
    /// The peer of a point-to-point operation, or the root of a rooted collective.
    pub peer: Option<usize>,
}

/// One operation in the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// What it was.
    pub info: OpInfo,
    /// Where it is.
    pub state: OpState,
    /// When it was recorded, since the recorder was made.
    pub began: Duration,
    /// When it finished or failed, since the recorder was made.
    pub ended: Option<Duration>,
    /// Why it failed.
    pub error: Option<String>,
}

/// A handle to an operation in the record, to move it on with [`FlightRecorder::finish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry(u64);

/// Where one rank is, for [`describe_positions`]: its latest collective and that one's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The latest collective's sequence number.
    pub seq: u64,
    /// Its name.
    pub op: &'static str,
    /// Its state on that rank.
    pub state: OpState,
}

struct Ring {
    records: VecDeque<OpRecord>,
    /// The id of `records[0]`.
    first: u64,
}

/// A bounded record of the last operations. See the module documentation.
pub struct FlightRecorder {
    capacity: usize,
    made: Instant,
    made_unix: SystemTime,
    ring: Mutex<Ring>,
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder")
            .field("capacity", &self.capacity)
            .field("len", &self.lock().records.len())
            .finish()
    }
}

impl Default for FlightRecorder {
    fn default() -> FlightRecorder {
        FlightRecorder::new(DEFAULT_CAPACITY)
    }
}

impl FlightRecorder {
    /// A recorder that keeps the last `capacity` operations (at least one).
    pub fn new(capacity: usize) -> FlightRecorder {
        let capacity = capacity.max(1);
        FlightRecorder {
            capacity,
            made: Instant::now(),
            made_unix: SystemTime::now(),
            ring: Mutex::new(Ring {
                records: VecDeque::with_capacity(capacity),
                first: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        // A panic while the lock was held left at worst one record half-updated; the record is
        // diagnostics, so keep using it.
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an operation in `state` (usually [`OpState::Started`], or [`OpState::Queued`]
    /// for work handed to a device), evicting the oldest when full.
    pub fn begin(&self, info: OpInfo, state: OpState) -> Entry {
        self.begin_at(info, state, Instant::now())
    }

    /// [`FlightRecorder::begin`] with the time it began, read by the caller (which reads the
    /// clock once for this and its own use: a read costs tens of ns, a call on the host arena
    /// a few hundred).
    pub fn begin_at(&self, info: OpInfo, state: OpState, at: Instant) -> Entry {
        let now = at.saturating_duration_since(self.made);
        let mut r = self.lock();
        if r.records.len() == self.capacity {
            r.records.pop_front();
            r.first += 1;
        }
        r.records.push_back(OpRecord {
            info,
            state,
            began: now,
            ended: None,
            error: None,
        });
        Entry(r.first + r.records.len() as u64 - 1)
    }

    /// Moves an operation to `state`; a no-op when it has been evicted meanwhile.
    pub fn set_state(&self, e: Entry, state: OpState) {
        let mut r = self.lock();
        if let Some(rec) = Self::slot(&mut r, e) {
            rec.state = state;
        }
    }

    /// Ends an operation: done, or failed with the error's text.
    pub fn finish(&self, e: Entry, outcome: Result<(), &dyn std::fmt::Display>) {
        let now = self.made.elapsed();
        let mut r = self.lock();
        if let Some(rec) = Self::slot(&mut r, e) {
            rec.ended = Some(now);
            match outcome {
                Ok(()) => rec.state = OpState::Done,
                Err(why) => {
                    rec.state = OpState::Failed;
                    rec.error = Some(why.to_string());
                }
            }
        }
    }

    fn slot(r: &mut Ring, e: Entry) -> Option<&mut OpRecord> {
        let i = e.0.checked_sub(r.first)?;
        r.records.get_mut(usize::try_from(i).ok()?)
    }

    /// Every operation still in the record, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        self.lock().records.iter().cloned().collect()
    }

    /// Where this rank is: its latest collective (an operation with a sequence number), or
    /// `None` before the first.
    pub fn position(&self) -> Option<Position> {
        let r = self.lock();
        r.records
            .iter()
            .rev()
            .find(|rec| rec.info.seq != 0)
            .map(|rec| Position {
                seq: rec.info.seq,
                op: rec.info.op,
                state: rec.state,
            })
    }

    /// The record as one JSON object: the rank, the world size, when the recorder was made
    /// (Unix milliseconds) and each operation with its times in microseconds since then.
    pub fn to_json(&self, rank: usize, world_size: usize) -> String {
        let made_ms = self
            .made_unix
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut s = format!(
            "{{\"rank\":{rank},\"world_size\":{world_size},\"made_unix_ms\":{made_ms},\"ops\":["
        );
        for (i, rec) in self.lock().records.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(
                s,
                "{{\"seq\":{},\"op\":{},\"dtype\":{},\"count\":{},\"peer\":{},\"state\":\"{}\",\
                 \"began_us\":{},\"ended_us\":{},\"error\":{}}}",
                rec.info.seq,
                json_str(rec.info.op),
                json_str(rec.info.dtype),
                rec.info.count,
                rec.info.peer.map_or("null".into(), |p| p.to_string()),
                rec.state.name(),
                rec.began.as_micros(),
                rec.ended
                    .map_or("null".into(), |d| d.as_micros().to_string()),
                rec.error.as_deref().map_or("null".into(), json_str),
            );
        }
        s.push_str("]}\n");
        s
    }

    /// Writes [`FlightRecorder::to_json`] to `dir/rank-R.json` (creating `dir`), returning the
    /// path.
    pub fn write_json(
        &self,
        dir: &Path,
        rank: usize,
        world_size: usize,
    ) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("rank-{rank}.json"));
        std::fs::write(&path, self.to_json(rank, world_size))?;
        Ok(path)
    }
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `[0, 1, 2, 5]` as "ranks 0–2, 5"; one rank as "rank 3".
pub fn rank_list(ranks: &[usize]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(match j - i {
            0 => sorted[i].to_string(),
            1 => format!("{}, {}", sorted[i], sorted[j]),
            _ => format!("{}–{}", sorted[i], sorted[j]),
        });
        i = j + 1;
    }
    let word = if sorted.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", parts.join(", "))
}

/// Where the ranks are, in one line: ranks grouped by their latest collective and its state,
/// the ones furthest behind first, e.g. "rank 3 finished #41 all_reduce; ranks 0–2 wait in #42
/// barrier". `None` stands for a rank that could not be asked (dead or silent) or has run no
/// collective yet.
pub fn describe_positions(positions: &[(usize, Option<Position>)]) -> String {
    let mut groups: Vec<(Option<Position>, Vec<usize>)> = Vec::new();
    for &(rank, pos) in positions {
        match groups.iter_mut().find(|(p, _)| *p == pos) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((pos, vec![rank])),
        }
    }
    groups.sort_by_key(|(p, ranks)| (p.map(|p| (p.seq, !p.state.is_open())), ranks[0]));
    let parts: Vec<String> = groups
        .iter()
        .map(|(p, ranks)| {
            let who = rank_list(ranks);
            let verb = |one: &'static str, many: &'static str| {
                if ranks.len() == 1 { one } else { many }
            };
            match p {
                None => format!("{who}: no answer or no collective yet"),
                Some(p) => match p.state {
                    OpState::Queued | OpState::Started => {
                        format!("{who} {} in #{} {}", verb("waits", "wait"), p.seq, p.op)
                    }
                    OpState::Done => format!("{who} finished #{} {}", p.seq, p.op),
                    OpState::Failed => {
                        format!("{who} failed in #{} {}", p.seq, p.op)
                    }
                },
            }
        })
        .collect();
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(seq: u64, op: &'static str) -> OpInfo {
        OpInfo {
            seq,
            op,
            dtype: "f32",
            count: 8,
            peer: None,
        }
    }

    #[test]
    fn keeps_the_last_operations_and_moves_them_on() {
        let f = FlightRecorder::new(3);
        let first = f.begin(info(1, "all_reduce"), OpState::Started);
        let entries: Vec<Entry> = (2..=4)
            .map(|s| f.begin(info(s, "barrier"), OpState::Started))
            .collect();
        // The first was evicted: finishing it changes nothing.
        f.finish(first, Ok(()));
        f.finish(entries[1], Err(&"peer 2 closed"));
        f.set_state(entries[2], OpState::Queued);
        let snap = f.snapshot();
        let seqs: Vec<u64> = snap.iter().map(|r| r.info.seq).collect();
        assert_eq!(seqs, [2, 3, 4]);
        let states: Vec<OpState> = snap.iter().map(|r| r.state).collect();
        assert_eq!(states, [OpState::Started, OpState::Failed, OpState::Queued]);
        assert_eq!(snap[1].error.as_deref(), Some("peer 2 closed"));
        assert!(snap[1].ended.is_some() && snap[0].ended.is_none());
        assert_eq!(
            f.position(),
            Some(Position {
                seq: 4,
                op: "barrier",
                state: OpState::Queued
            })
        );
    }

    #[test]
    fn point_to_point_records_do_not_move_the_position() {
        let f = FlightRecorder::new(10);
        assert_eq!(f.position(), None);
        let e = f.begin(info(5, "all_gather"), OpState::Started);
        f.finish(e, Ok(()));
        f.begin(
            OpInfo {
                seq: 0,
                op: "send",
                dtype: "",
                count: 64,
                peer: Some(1),
            },
            OpState::Started,
        );
        assert_eq!(
            f.position().map(|p| (p.seq, p.state)),
            Some((5, OpState::Done))
        );
    }

    #[test]
    fn json_escapes_and_names_every_field() {
        let f = FlightRecorder::new(4);
        let e = f.begin(info(7, "all_reduce"), OpState::Started);
        f.finish(e, Err(&"a \"quoted\"\nline\u{1}"));
        let j = f.to_json(2, 4);
        assert!(
            j.starts_with("{\"rank\":2,\"world_size\":4,\"made_unix_ms\":"),
            "{j}"
        );
        assert!(
            j.contains(
                "\"seq\":7,\"op\":\"all_reduce\",\"dtype\":\"f32\",\"count\":8,\"peer\":null,\
                 \"state\":\"failed\""
            ),
            "{j}"
        );
        assert!(j.contains(r#""error":"a \"quoted\"\nline\u0001""#), "{j}");
    }

    #[test]
    fn positions_name_who_is_behind() {
        let wait = |seq, op| {
            Some(Position {
                seq,
                op,
                state: OpState::Started,
            })
        };
        let done = Some(Position {
            seq: 41,
            op: "all_reduce",
            state: OpState::Done,
        });
        let got = describe_positions(&[
            (0, wait(42, "barrier")),
            (1, wait(42, "barrier")),
            (2, wait(42, "barrier")),
            (3, done),
        ]);
        assert_eq!(
            got,
            "rank 3 finished #41 all_reduce; ranks 0–2 wait in #42 barrier"
        );
        let got = describe_positions(&[
            (0, wait(9, "all_reduce")),
            (1, None),
            (2, wait(9, "all_reduce")),
        ]);
        assert_eq!(
            got,
            "rank 1: no answer or no collective yet; ranks 0, 2 wait in #9 all_reduce"
        );
    }

    #[test]
    fn rank_lists_collapse_runs() {
        assert_eq!(rank_list(&[3]), "rank 3");
        assert_eq!(rank_list(&[5, 0, 1, 2, 7, 8]), "ranks 0–2, 5, 7, 8");
    }
}

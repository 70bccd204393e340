//! `cargo xtask trace DIR`: reads the flight records that ranks wrote on failure
//! (`DIST_TRACE_DIR`, one `rank-R.json` each) and prints where each rank was, who is behind, and
//! each rank's last operations.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The folder the ranks wrote (`DIST_TRACE_DIR`).
    pub dir: PathBuf,
    /// How many of each rank's last operations to list.
    #[arg(long, default_value_t = 5)]
    pub last: usize,
}

#[derive(Deserialize, Debug)]
pub struct Record {
    pub rank: usize,
    pub world_size: usize,
    pub ops: Vec<Op>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Op {
    pub seq: u64,
    pub op: String,
    pub dtype: String,
    pub count: u64,
    pub peer: Option<usize>,
    pub state: String,
    pub began_us: u64,
    pub ended_us: Option<u64>,
    pub error: Option<String>,
}

/// The rank's latest collective (an op with a sequence number).
fn position(r: &Record) -> Option<&Op> {
    r.ops.iter().rev().find(|o| o.seq != 0)
}

pub fn read_dir(dir: &Path) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        let is_record = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("rank-") && n.ends_with(".json"));
        if !is_record {
            continue;
        }
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let r: Record =
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        records.push(r);
    }
    records.sort_by_key(|r| r.rank);
    Ok(records)
}

/// The summary `cargo xtask trace` prints.
pub fn summary(records: &[Record], last: usize) -> Result<String> {
    let Some(world) = records.first().map(|r| r.world_size) else {
        bail!("no rank-R.json files");
    };
    let mut out = String::new();
    let missing: Vec<usize> = (0..world)
        .filter(|r| !records.iter().any(|x| x.rank == *r))
        .collect();
    out.push_str(&format!(
        "{} of {world} ranks wrote a record",
        records.len()
    ));
    if !missing.is_empty() {
        out.push_str(&format!(
            " (none from {missing:?}: dead, stopped or never failed)"
        ));
    }
    out.push('\n');
    let furthest = records
        .iter()
        .filter_map(position)
        .map(|o| o.seq)
        .max()
        .unwrap_or(0);
    for r in records {
        match position(r) {
            Some(o) => {
                let behind = if o.seq < furthest { "  <- behind" } else { "" };
                out.push_str(&format!(
                    "rank {}: #{} {} {}{behind}\n",
                    r.rank, o.seq, o.op, o.state
                ));
            }
            None => out.push_str(&format!("rank {}: no collective yet\n", r.rank)),
        }
    }
    for r in records {
        out.push_str(&format!("rank {} last operations:\n", r.rank));
        for o in r
            .ops
            .iter()
            .rev()
            .take(last)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            let took = o.ended_us.map_or("still running".to_string(), |e| {
                format!("{} µs", e.saturating_sub(o.began_us))
            });
            let with = o.peer.map_or(String::new(), |p| format!(" peer/root {p}"));
            out.push_str(&format!(
                "  #{} {} {}×{}{with} {} ({took}){}\n",
                o.seq,
                o.op,
                o.count,
                if o.dtype.is_empty() { "byte" } else { &o.dtype },
                o.state,
                o.error
                    .as_deref()
                    .map_or(String::new(), |e| format!(": {e}")),
            ));
        }
    }
    Ok(out)
}

pub fn run(args: &Args) -> Result<()> {
    let records = read_dir(&args.dir)?;
    print!("{}", summary(&records, args.last)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_rank_behind_and_the_missing_one() {
        let rec = |rank: usize, seq: u64, op: &str, state: &str| Record {
            rank,
            world_size: 4,
            ops: vec![Op {
                seq,
                op: op.into(),
                dtype: "f32".into(),
                count: 8,
                peer: None,
                state: state.into(),
                began_us: 10,
                ended_us: (state == "done").then_some(30),
                error: None,
            }],
        };
        let s = summary(
            &[
                rec(0, 42, "barrier", "started"),
                rec(1, 42, "barrier", "started"),
                rec(3, 41, "all_reduce", "done"),
            ],
            5,
        )
        .unwrap();
        assert!(
            s.starts_with("3 of 4 ranks wrote a record (none from [2]"),
            "{s}"
        );
        assert!(
            s.contains("rank 3: #41 all_reduce done  <- behind\n"),
            "{s}"
        );
        assert!(s.contains("rank 0: #42 barrier started\n"), "{s}");
        assert!(s.contains("  #41 all_reduce 8×f32 done (20 µs)\n"), "{s}");
    }

    #[test]
    fn reads_what_the_flight_recorder_writes() {
        use dist_core::flight::{FlightRecorder, OpInfo, OpState};
        let f = FlightRecorder::new(8);
        let e = f.begin(
            OpInfo {
                seq: 3,
                op: "broadcast",
                dtype: "u8",
                count: 128,
                peer: Some(0),
            },
            OpState::Started,
        );
        f.finish(e, Err(&"peer 1 \"closed\""));
        let r: Record = serde_json::from_str(&f.to_json(1, 2)).unwrap();
        assert_eq!((r.rank, r.world_size, r.ops.len()), (1, 2, 1));
        let o = &r.ops[0];
        assert_eq!(
            (o.seq, o.op.as_str(), o.count, o.peer),
            (3, "broadcast", 128, Some(0))
        );
        assert_eq!(o.state, "failed");
        assert_eq!(o.error.as_deref(), Some("peer 1 \"closed\""));
    }
}

//! The perf tools' shared part (`dist-perf` over TCP, `dist-nccl-perf` over NCCL): the op
//! timed, the command line, the inputs and the expected results, and nccl-tests' table.

use dist_core::ReduceOp;
use dist_core::collectives::Kind;
use dist_tcp::TcpBackend;

/// The operations the perf tools time, as `--op` names them: a collective, named as
/// [`Kind`] names it, or `sendrecv`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PerfOp {
    /// One of [`PerfOp::COLLECTIVES`]: all_reduce (sum), broadcast from rank 0, reduce (sum) to
    /// rank 0, all_gather (the size is the output's), reduce_scatter (sum; the size is the
    /// input's), all_to_all.
    Collective(Kind),
    /// Each rank sends to the next and receives from the previous at once.
    SendRecv,
}

impl PerfOp {
    /// The collectives the perf tools time.
    pub const COLLECTIVES: [Kind; 6] = [
        Kind::AllReduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::AllToAll,
    ];

    /// The op named `s`: a name of one of [`PerfOp::COLLECTIVES`] ([`Kind::parse`]) or
    /// `sendrecv`.
    pub fn parse(s: &str) -> Option<PerfOp> {
        if s == PerfOp::SendRecv.name() {
            return Some(PerfOp::SendRecv);
        }
        Kind::parse(s)
            .filter(|k| PerfOp::COLLECTIVES.contains(k))
            .map(PerfOp::Collective)
    }

    /// The op's `--op` name.
    pub fn name(self) -> &'static str {
        match self {
            PerfOp::Collective(k) => k.name(),
            PerfOp::SendRecv => "sendrecv",
        }
    }

    /// Every op [`PerfOp::parse`] takes, by name, for a usage message.
    pub fn names() -> String {
        let mut names: Vec<&str> = PerfOp::COLLECTIVES.iter().map(|k| k.name()).collect();
        names.push(PerfOp::SendRecv.name());
        names.join(", ")
    }

    /// busbw / algbw, as nccl-tests defines it for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            PerfOp::Collective(Kind::AllReduce) => 2.0 * (n - 1.0) / n,
            PerfOp::Collective(_) if self.blocked() => (n - 1.0) / n,
            _ => 1.0,
        }
    }

    /// Whether the op reduces ([`Kind::has_op`]).
    pub fn reduces(self) -> bool {
        matches!(self, PerfOp::Collective(k) if k.has_op())
    }

    /// Whether the op has a root, rank 0 here ([`Kind::has_root`]).
    pub fn has_root(self) -> bool {
        matches!(self, PerfOp::Collective(k) if k.has_root())
    }

    /// Whether the buffers are cut into one block per rank.
    pub fn blocked(self) -> bool {
        matches!(
            self,
            PerfOp::Collective(
                Kind::AllGather
                    | Kind::ReduceScatter
                    | Kind::AllToAll
                    | Kind::Gather
                    | Kind::Scatter
                    | Kind::AllToAllV
            )
        )
    }
}

impl std::fmt::Display for PerfOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The perf tools' command line (`--op OP -b MIN -e MAX -f FACTOR [--dtype T] [--check]
/// [--iters N] [--warmup N] [--bare]`), parsed and checked once for both of them.
#[derive(Clone, Debug)]
pub struct PerfOpts {
    /// The collective timed.
    pub op: PerfOp,
    /// The smallest size, in bytes.
    pub min: usize,
    /// The largest size, in bytes.
    pub max: usize,
    /// The factor between sizes (at least 2).
    pub factor: usize,
    /// The element type.
    pub dtype: dist_core::DType,
    /// Whether to verify one call per size.
    pub check: bool,
    /// Timed calls per size (default: by size).
    pub iters: Option<usize>,
    /// Untimed calls before them (default: a tenth of them, at least 2).
    pub warmup: Option<usize>,
    /// The NCCL tool's floor: bare NCCL loops of the op timed beside dist-nccl's, 3 rounds.
    pub bare: bool,
}

impl PerfOpts {
    /// Parses `args` (without the program name), with `max` as the default largest size.
    pub fn parse(args: &[String], max: usize) -> Result<PerfOpts, String> {
        let mut o = PerfOpts {
            op: PerfOp::Collective(Kind::AllReduce),
            min: 8,
            max,
            factor: 4,
            dtype: dist_core::DType::F32,
            check: false,
            iters: None,
            warmup: None,
            bare: false,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut val = || {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            let count = |v: String| v.parse::<usize>().map_err(|_| format!("{flag} {v:?}"));
            match flag.as_str() {
                "--op" => {
                    let v = val()?;
                    o.op = PerfOp::parse(&v)
                        .ok_or_else(|| format!("unknown op {v:?} (one of {})", PerfOp::names()))?;
                }
                "-b" => o.min = parse_size(&val()?)?,
                "-e" => o.max = parse_size(&val()?)?,
                "-f" => o.factor = count(val()?)?,
                "--dtype" => {
                    let v = val()?;
                    o.dtype = dist_core::DType::parse(&v)
                        .ok_or_else(|| format!("unknown dtype {v:?}"))?;
                }
                "--iters" => o.iters = Some(count(val()?)?),
                "--warmup" => o.warmup = Some(count(val()?)?),
                "--check" => o.check = true,
                "--bare" => o.bare = true,
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        if o.factor < 2 || o.min < 1 || o.max < o.min {
            return Err(format!(
                "bad size range: -b {} -e {} -f {} (need 1 <= b <= e, f >= 2)",
                o.min, o.max, o.factor
            ));
        }
        Ok(o)
    }

    /// The sizes, in bytes: min, min × factor, ... up to max.
    pub fn sizes(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(self.min), |s| s.checked_mul(self.factor))
            .take_while(|s| *s <= self.max)
    }
}

/// Rank `r`'s input element `i` in the perf tools (small integers: exact in every type).
pub fn perf_input(r: usize, i: usize) -> f64 {
    ((r * 3 + i) % 7) as f64
}

/// The elements a perf call on `size` bytes of `elt`-byte elements moves: whole blocks of one
/// per rank for the blocked ops.
pub fn perf_count(op: PerfOp, size: usize, elt: usize, n: usize) -> usize {
    let count = (size / elt).max(1);
    if op.blocked() {
        (count / n).max(1) * n
    } else {
        count
    }
}

/// What element `i` of the result holds on rank `me` of `n` after `op` (sums at rank 0 for
/// reduce), with blocks of `k`, given every rank's [`perf_input`]; NaN, which matches nothing,
/// for a collective the tools do not time.
pub fn perf_want(op: PerfOp, me: usize, n: usize, k: usize, i: usize) -> f64 {
    let sum = |i: usize| (0..n).map(|r| perf_input(r, i)).sum::<f64>();
    match op {
        PerfOp::Collective(Kind::AllReduce | Kind::Reduce) => sum(i),
        PerfOp::Collective(Kind::Broadcast) => perf_input(0, i),
        PerfOp::Collective(Kind::ReduceScatter) => sum(me * k + i),
        PerfOp::Collective(Kind::AllGather) => perf_input(i / k, i % k),
        PerfOp::Collective(Kind::AllToAll) => perf_input(i / k, me * k + i % k),
        PerfOp::SendRecv => perf_input((me + n - 1) % n, i),
        PerfOp::Collective(_) => f64::NAN,
    }
}

/// Prints the nccl-tests header under `title`.
pub fn perf_header(title: &str) {
    println!("# {title}");
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>4} {:>10} {:>8} {:>8} {:>6}",
        "size", "count", "type", "redop", "root", "time(us)", "algbw", "busbw", "#wrong"
    );
    println!(
        "# {:>10} {:>12} {:>8} {:>6} {:>4} {:>10} {:>8} {:>8} {:>6}",
        "(B)", "(elements)", "", "", "", "", "(GB/s)", "(GB/s)", ""
    );
}

/// One row of the table: the slowest rank's `secs` per call and every rank's `wrong` elements
/// (`None`: not checked), gathered over `tcp` and printed by rank 0, with `algorithm` after
/// them where given.
pub fn perf_row(
    tcp: &TcpBackend,
    op: PerfOp,
    dtype: dist_core::DType,
    (bytes, count): (usize, usize),
    secs: f64,
    wrong: Option<u64>,
    algorithm: Option<&str>,
) {
    use dist_core::{Backend, Collectives};
    let mut t = [secs];
    tcp.all_reduce(&mut t, ReduceOp::Max)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut w = [wrong.unwrap_or(0)];
    tcp.all_reduce(&mut w, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{e}"));
    if tcp.rank() == 0 {
        let algbw = bytes as f64 / t[0] / 1e9;
        println!(
            "{bytes:>12} {count:>12} {:>8} {:>6} {:>4} {:>10.2} {algbw:>8.3} {:>8.3} {:>6}{}",
            dtype.name(),
            if op.reduces() { "sum" } else { "none" },
            if op.has_root() { "0" } else { "-1" },
            t[0] * 1e6,
            algbw * op.bus_factor(tcp.world_size()),
            wrong.map_or("N/A".to_string(), |_| w[0].to_string()),
            algorithm.map_or(String::new(), |a| format!(" {a}")),
        );
    }
}

/// A size with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?} (a count of bytes, optionally with K, M or G)"))
}

/// The options of the perf tool `tool` from its command line, checked by `ok` (what the tool
/// does not take); `--help` (or `-h`) prints the usage and exits with 0, a bad argument prints
/// the error and the usage and exits with 2 (no panic: a user's typo is not a bug).
pub fn perf_opts_or_exit(
    tool: &str,
    max: usize,
    ok: impl Fn(&PerfOpts) -> Result<(), String>,
) -> PerfOpts {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{tool} {PERF_USAGE}");
        std::process::exit(0);
    }
    match PerfOpts::parse(&args, max).and_then(|o| ok(&o).map(|()| o)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{tool}: {e}\n{tool} {PERF_USAGE}");
            std::process::exit(2);
        }
    }
}

/// The perf tools' usage, for `--help` and after a bad argument.
pub const PERF_USAGE: &str = "options: --op OP -b MIN -e MAX -f FACTOR [--dtype T] [--check] \
[--iters N] [--warmup N] [--bare]; sizes in bytes, optionally with K, M or G";

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn perf_options_parse_and_refuse_what_would_never_end() {
        let o = PerfOpts::parse(
            &args("--op reduce_scatter -b 1K -e 16K -f 4 --check"),
            1 << 20,
        )
        .unwrap();
        assert_eq!(
            (o.op, o.min, o.max, o.check),
            (PerfOp::Collective(Kind::ReduceScatter), 1024, 16384, true)
        );
        assert_eq!(o.sizes().collect::<Vec<_>>(), vec![1024, 4096, 16384]);
        // A factor of 1 (or 0), or a size of 0, would loop for ever.
        for bad in [
            "-f 1",
            "-f 0",
            "-b 0",
            "-b 2M -e 1M",
            "-f",
            "--op nope",
            "--op gather",
            "--op barrier",
            "--what",
            "-b 1Q",
            "-e 99999999999999999999G",
            "-e 17179869184G",
        ] {
            assert!(PerfOpts::parse(&args(bad), 1 << 20).is_err(), "{bad}");
        }
        let top = PerfOpts::parse(&args("-b 1 -e 18446744073709551615 -f 2"), 0).unwrap();
        assert_eq!(top.sizes().count(), 64, "stops before overflowing");
    }

    #[test]
    fn perf_expectations_match_the_ops() {
        // 3 ranks, blocks of 2: rank 1's block of a reduce_scatter is elements 2 and 3.
        let sum = |i| (0..3).map(|r| perf_input(r, i)).sum::<f64>();
        let c = PerfOp::Collective;
        assert_eq!(perf_want(c(Kind::ReduceScatter), 1, 3, 2, 0), sum(2));
        assert_eq!(perf_want(c(Kind::AllGather), 1, 3, 2, 5), perf_input(2, 1));
        assert_eq!(perf_want(c(Kind::AllToAll), 1, 3, 2, 5), perf_input(2, 3));
        assert_eq!(perf_want(PerfOp::SendRecv, 0, 3, 2, 4), perf_input(2, 4));
        assert_eq!(perf_count(c(Kind::AllGather), 100, 4, 3), 24);
        assert_eq!(perf_count(c(Kind::AllReduce), 2, 4, 3), 1);
        assert!(perf_want(c(Kind::Gather), 0, 3, 2, 0).is_nan());
    }

    #[test]
    fn perf_ops_are_named_as_the_kinds_are() {
        for k in PerfOp::COLLECTIVES {
            let op = PerfOp::Collective(k);
            assert_eq!(op.name(), k.name());
            assert_eq!(PerfOp::parse(k.name()), Some(op));
            assert_eq!(op.reduces(), k.has_op());
            assert_eq!(op.has_root(), k.has_root());
        }
        assert_eq!(PerfOp::parse("sendrecv"), Some(PerfOp::SendRecv));
        assert_eq!(PerfOp::SendRecv.to_string(), "sendrecv");
        for k in Kind::ALL
            .into_iter()
            .filter(|k| !PerfOp::COLLECTIVES.contains(k))
        {
            assert_eq!(PerfOp::parse(k.name()), None, "{k:?} is not timed");
        }
        assert_eq!(
            PerfOp::names(),
            "all_reduce, broadcast, reduce, all_gather, reduce_scatter, all_to_all, sendrecv"
        );
    }
}

//! Helpers shared by the multi-rank programs (tests, demo, benchmarks): environment, patterns,
//! logging.

use std::time::Duration;

use dist_core::{Element, ReduceOp};
use dist_tcp::{TcpBackend, TcpConfig};
use half::{bf16, f16};

/// Logs to stderr when `RUST_LOG` asks for it; quiet otherwise.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// The configuration the launcher describes, with timeouts suited to tests.
pub fn config() -> TcpConfig {
    TcpConfig::from_env()
        .unwrap_or_else(|e| panic!("{e}"))
        .init_timeout(Duration::from_secs(60))
        .timeout(Duration::from_secs(60))
        .linger(Duration::from_secs(10))
}

/// Joins the job the launcher describes.
pub fn join() -> TcpBackend {
    TcpBackend::with_config(config()).unwrap_or_else(|e| panic!("init failed: {e}"))
}

/// One multi-rank test case and what it declares beside it: the world sizes it runs at, the
/// variants it runs in, what it needs. `Err` from `run` means "skipped", with the reason; a
/// failure panics. The test program lists these (`--list`); the `multirank` test target and
/// `cargo xtask test-multirank` make one trial of each case × world size.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// The name the program takes.
    pub name: &'static str,
    /// The case, run on every rank.
    pub run: fn() -> Result<(), String>,
    /// The world sizes it runs at.
    pub sizes: &'static [usize],
    /// Whether it works only at [`Case::sizes`]; otherwise at any world size (`cargo xtask
    /// test-multirank -n N` runs it at others).
    pub fixed: bool,
    /// The same case again with more environment, at sizes of their own.
    pub variants: &'static [Variant],
    /// It needs a CUDA device for every rank on this host.
    pub gpu_per_rank: bool,
    /// It needs to run as root.
    pub root: bool,
}

/// A case run again with more environment for every rank.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    /// The variant's part of the trial's name (`CASE::VARIANT::nN`).
    pub name: &'static str,
    /// The world sizes it runs at.
    pub sizes: &'static [usize],
    /// The environment it adds.
    pub env: &'static [(&'static str, &'static str)],
}

/// The world sizes most cases run at.
pub const SIZES: &[usize] = &[2, 3, 4, 5, 8];

/// The collectives as a machine with cores to spare runs them: sends and receives on separate
/// threads, and large all_reduces as two rings at once (the defaults from 8 cores).
pub const TWO_LANES: Variant = Variant {
    name: "lanes2",
    sizes: &[3, 4, 5],
    env: &[("DIST_TCP_PARALLEL", "1"), ("DIST_TCP_LANES", "2")],
};

impl Case {
    /// `run`, at [`SIZES`], needing nothing more.
    pub const fn new(name: &'static str, run: fn() -> Result<(), String>) -> Case {
        Case {
            name,
            run,
            sizes: SIZES,
            fixed: false,
            variants: &[],
            gpu_per_rank: false,
            root: false,
        }
    }

    /// Runs at `sizes` instead (and at any other a user asks for).
    pub const fn sizes(mut self, sizes: &'static [usize]) -> Case {
        self.sizes = sizes;
        self
    }

    /// Runs at `sizes` only: the case does not work at others.
    pub const fn only_at(mut self, sizes: &'static [usize]) -> Case {
        self.sizes = sizes;
        self.fixed = true;
        self
    }

    /// Runs in `variants` too.
    pub const fn variants(mut self, variants: &'static [Variant]) -> Case {
        self.variants = variants;
        self
    }

    /// Needs a CUDA device for every rank on the host.
    pub const fn gpu_per_rank(mut self) -> Case {
        self.gpu_per_rank = true;
        self
    }

    /// Needs root.
    pub const fn root(mut self) -> Case {
        self.root = true;
        self
    }

    /// The `--list` lines of the case and its variants (`dist_launch::Listed` reads them).
    pub fn listing(&self) -> Vec<String> {
        let sizes = |s: &[usize]| s.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let mut needs = Vec::new();
        if self.gpu_per_rank {
            needs.push("gpu-per-rank");
        }
        if self.root {
            needs.push("root");
        }
        let tail = format!(
            "{}{}",
            if needs.is_empty() {
                String::new()
            } else {
                format!(" needs={}", needs.join(","))
            },
            if self.fixed { " fixed" } else { "" }
        );
        let mut lines = vec![format!("{} sizes={}{tail}", self.name, sizes(self.sizes))];
        for v in self.variants {
            let env: Vec<String> = v.env.iter().map(|(k, val)| format!("{k}={val}")).collect();
            lines.push(format!(
                "{} variant={} sizes={} env={}{tail}",
                self.name,
                v.name,
                sizes(v.sizes),
                env.join(",")
            ));
        }
        lines
    }

    /// Why the case cannot run here, if it cannot: a world size it does not work at, too few
    /// CUDA devices, not root.
    pub fn unmet(&self) -> Option<String> {
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        let world = var("WORLD_SIZE").unwrap_or(1);
        if self.fixed && !self.sizes.contains(&world) {
            return Some(format!(
                "works only at world sizes {:?}, not {world}",
                self.sizes
            ));
        }
        if self.root && !is_root() {
            return Some("needs root".into());
        }
        if self.gpu_per_rank {
            let local = var("LOCAL_WORLD_SIZE").unwrap_or(world);
            let devices = dist_nccl::cuda_device_count();
            if devices < local {
                return Some(format!(
                    "needs a CUDA device per rank: {local} ranks on this host, {devices} devices"
                ));
            }
        }
        None
    }
}

/// Whether this process runs as root.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The exit status with which a case says it was skipped (xtask counts it so).
pub const SKIP_STATUS: u8 = 77;

/// The `main` of a multi-rank test program: `--list` prints the cases, `CASE` runs one as the
/// rank the environment describes (skipped, saying why, where its needs are not met).
pub fn run_cases(program: &str, cases: &[Case]) -> std::process::ExitCode {
    use std::process::ExitCode;
    init_logging();
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "--list" {
        for case in cases {
            for line in case.listing() {
                println!("{line}");
            }
        }
        return ExitCode::SUCCESS;
    }
    let Some(case) = cases.iter().find(|c| c.name == arg) else {
        eprintln!("usage: {program} --list | CASE (unknown case {arg:?})");
        return ExitCode::from(2);
    };
    let outcome = match case.unmet() {
        Some(why) => Err(format!("skipped: {why}")),
        None => (case.run)(),
    };
    match outcome {
        Ok(()) => {
            println!("{}: ok", case.name);
            ExitCode::SUCCESS
        }
        // Only an error that says it is a skip is one: any other is a failure.
        Err(skip) if skip.starts_with("skipped: ") => {
            println!("{}: {skip}", case.name);
            ExitCode::from(SKIP_STATUS)
        }
        Err(e) => {
            eprintln!("{}: FAILED: {e}", case.name);
            ExitCode::FAILURE
        }
    }
}

fn word(i: u64, seed: u64) -> u64 {
    (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i >> 7)
}

/// Fills `buf` with a pattern determined by `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let (words, tail) = buf.split_at_mut(buf.len() / 8 * 8);
    for (i, w) in words.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(i as u64, seed).to_le_bytes());
    }
    let last = word(u64::MAX, seed).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The first byte offset where `buf` differs from [`fill`]'s pattern for `seed`.
pub fn first_difference(buf: &[u8], seed: u64) -> Option<usize> {
    let (words, tail) = buf.split_at(buf.len() / 8 * 8);
    let bad = words
        .chunks_exact(8)
        .enumerate()
        .position(|(i, w)| w != word(i as u64, seed).to_le_bytes());
    if let Some(i) = bad {
        return Some(i * 8);
    }
    let last = word(u64::MAX, seed).to_le_bytes();
    (tail != &last[..tail.len()]).then_some(words.len())
}

/// A seed naming a message by sender, receiver and a third number.
pub fn seed(src: usize, dst: usize, k: u64) -> u64 {
    ((src as u64) << 40) ^ ((dst as u64) << 20) ^ k
}

/// A test element: deterministic inputs, its valid ops, and an independent reference.
pub trait TestElem: Element + Copy {
    /// The input of rank `r` at index `i`; NaN where `nan` asks and the type has one.
    fn val(r: usize, i: usize, nan: bool) -> Self;
    /// The reduce ops valid for the type.
    fn ops() -> Vec<ReduceOp>;
    /// Whether `got` matches the reduction of every rank's input at `i`.
    fn matches(op: ReduceOp, n: usize, i: usize, nan: bool, got: Self) -> bool;
}

macro_rules! int_elem {
    ($t:ty, $signed:expr) => {
        impl TestElem for $t {
            fn val(r: usize, i: usize, _nan: bool) -> Self {
                let x = (r * 37 + i * 11 + 5) % 97;
                if $signed {
                    (x as i64 - 48) as $t
                } else {
                    x as $t
                }
            }

            fn ops() -> Vec<ReduceOp> {
                vec![
                    ReduceOp::Sum,
                    ReduceOp::Prod,
                    ReduceOp::Min,
                    ReduceOp::Max,
                    ReduceOp::Avg,
                    ReduceOp::PreMulSum(3.0),
                    ReduceOp::BitAnd,
                    ReduceOp::BitOr,
                    ReduceOp::BitXor,
                ]
            }

            fn matches(op: ReduceOp, n: usize, i: usize, _nan: bool, got: Self) -> bool {
                let v = |r| <$t>::val(r, i, false);
                let mut acc = match op {
                    ReduceOp::PreMulSum(s) => v(0).wrapping_mul(s as $t),
                    _ => v(0),
                };
                for r in 1..n {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v(r)),
                        ReduceOp::PreMulSum(s) => acc.wrapping_add(v(r).wrapping_mul(s as $t)),
                        ReduceOp::Prod => acc.wrapping_mul(v(r)),
                        ReduceOp::Min => acc.min(v(r)),
                        ReduceOp::Max => acc.max(v(r)),
                        ReduceOp::BitAnd => acc & v(r),
                        ReduceOp::BitOr => acc | v(r),
                        ReduceOp::BitXor => acc ^ v(r),
                        _ => unreachable!("no other ops are tested"),
                    };
                }
                if matches!(op, ReduceOp::Avg) {
                    acc /= n as $t;
                }
                acc == got
            }
        }
    };
}

int_elem!(i8, true);
int_elem!(u8, false);
int_elem!(i32, true);
int_elem!(u32, false);
int_elem!(i64, true);
int_elem!(u64, false);

/// Float inputs are in {-2, -1, 0.5, 1, 2}: sums and products of up to 8 of them are exact in
/// every float type, so only `Avg` needs the tolerance.
pub fn float_val(r: usize, i: usize, nan: bool) -> f64 {
    if nan && r == 1 && i % 5 == 3 {
        return f64::NAN;
    }
    [-2.0, -1.0, 0.5, 1.0, 2.0][(r * 7 + i * 3) % 5]
}

pub fn float_ref(op: ReduceOp, n: usize, i: usize, nan: bool) -> f64 {
    let v = |r| float_val(r, i, nan);
    let mut acc = match op {
        ReduceOp::PreMulSum(s) => v(0) * s,
        _ => v(0),
    };
    for r in 1..n {
        let x = v(r);
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::PreMulSum(s) => acc + x * s,
            ReduceOp::Prod => acc * x,
            ReduceOp::Min if acc.is_nan() || x.is_nan() => f64::NAN,
            ReduceOp::Max if acc.is_nan() || x.is_nan() => f64::NAN,
            ReduceOp::Min => acc.min(x),
            ReduceOp::Max => acc.max(x),
            _ => unreachable!("no other ops are tested"),
        };
    }
    if matches!(op, ReduceOp::Avg) {
        acc /= n as f64;
    }
    acc
}

macro_rules! float_elem {
    ($t:ty, $tol:expr) => {
        impl TestElem for $t {
            fn val(r: usize, i: usize, nan: bool) -> Self {
                <$t as Element>::from_f64(float_val(r, i, nan))
            }

            fn ops() -> Vec<ReduceOp> {
                vec![
                    ReduceOp::Sum,
                    ReduceOp::Prod,
                    ReduceOp::Min,
                    ReduceOp::Max,
                    ReduceOp::Avg,
                    ReduceOp::PreMulSum(0.5),
                ]
            }

            /// Exact but for `Avg`, which may round once more: within `$tol` relative.
            fn matches(op: ReduceOp, n: usize, i: usize, nan: bool, got: Self) -> bool {
                let want = float_ref(op, n, i, nan);
                let got = Element::to_f64(got);
                if want.is_nan() || got.is_nan() {
                    return want.is_nan() && got.is_nan();
                }
                (got - want).abs() <= $tol * want.abs().max(1.0)
            }
        }
    };
}

float_elem!(f32, 1e-6);
float_elem!(f64, 1e-12);
float_elem!(f16, 2e-3);
float_elem!(bf16, 1e-2);

/// The operations the perf tools time, as `--op` names them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PerfOp {
    /// all_reduce, sum.
    AllReduce,
    /// broadcast from rank 0.
    Broadcast,
    /// reduce (sum) to rank 0.
    Reduce,
    /// all_gather; the size is the output's.
    AllGather,
    /// reduce_scatter (sum); the size is the input's.
    ReduceScatter,
    /// all_to_all.
    AllToAll,
    /// each rank sends to the next and receives from the previous at once.
    SendRecv,
}

impl PerfOp {
    /// The op named `s` (`all_reduce`, `broadcast`, ...).
    pub fn parse(s: &str) -> Option<PerfOp> {
        Some(match s {
            "all_reduce" => PerfOp::AllReduce,
            "broadcast" => PerfOp::Broadcast,
            "reduce" => PerfOp::Reduce,
            "all_gather" => PerfOp::AllGather,
            "reduce_scatter" => PerfOp::ReduceScatter,
            "all_to_all" => PerfOp::AllToAll,
            "sendrecv" => PerfOp::SendRecv,
            _ => return None,
        })
    }

    /// busbw / algbw, as nccl-tests defines it for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            PerfOp::AllReduce => 2.0 * (n - 1.0) / n,
            PerfOp::AllGather | PerfOp::ReduceScatter | PerfOp::AllToAll => (n - 1.0) / n,
            PerfOp::Broadcast | PerfOp::Reduce | PerfOp::SendRecv => 1.0,
        }
    }

    /// Whether the op reduces.
    pub fn reduces(self) -> bool {
        matches!(
            self,
            PerfOp::AllReduce | PerfOp::Reduce | PerfOp::ReduceScatter
        )
    }

    /// Whether the buffers are cut into one block per rank.
    pub fn blocked(self) -> bool {
        matches!(
            self,
            PerfOp::AllGather | PerfOp::ReduceScatter | PerfOp::AllToAll
        )
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
            op: PerfOp::AllReduce,
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
                    o.op = PerfOp::parse(&v).ok_or_else(|| format!("unknown op {v:?}"))?;
                }
                "-b" => o.min = parse_size(&val()?),
                "-e" => o.max = parse_size(&val()?),
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
/// reduce), with blocks of `k`, given every rank's [`perf_input`].
pub fn perf_want(op: PerfOp, me: usize, n: usize, k: usize, i: usize) -> f64 {
    let sum = |i: usize| (0..n).map(|r| perf_input(r, i)).sum::<f64>();
    match op {
        PerfOp::AllReduce | PerfOp::Reduce => sum(i),
        PerfOp::Broadcast => perf_input(0, i),
        PerfOp::ReduceScatter => sum(me * k + i),
        PerfOp::AllGather => perf_input(i / k, i % k),
        PerfOp::AllToAll => perf_input(i / k, me * k + i % k),
        PerfOp::SendRecv => perf_input((me + n - 1) % n, i),
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
/// (`None`: not checked), gathered over `tcp` and printed by rank 0.
pub fn perf_row(
    tcp: &TcpBackend,
    op: PerfOp,
    dtype: dist_core::DType,
    (bytes, count): (usize, usize),
    secs: f64,
    wrong: Option<u64>,
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
            "{bytes:>12} {count:>12} {:>8} {:>6} {:>4} {:>10.2} {algbw:>8.3} {:>8.3} {:>6}",
            dtype.name(),
            if op.reduces() { "sum" } else { "none" },
            if matches!(op, PerfOp::Broadcast | PerfOp::Reduce) {
                "0"
            } else {
                "-1"
            },
            t[0] * 1e6,
            algbw * op.bus_factor(tcp.world_size()),
            wrong.map_or("N/A".to_string(), |_| w[0].to_string()),
        );
    }
}

/// A size with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(s: &str) -> usize {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .unwrap_or_else(|_| panic!("bad size {s:?}"))
        * mult
}

#[cfg(test)]
mod perf_tests {
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
            (PerfOp::ReduceScatter, 1024, 16384, true)
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
            "--what",
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
        assert_eq!(perf_want(PerfOp::ReduceScatter, 1, 3, 2, 0), sum(2));
        assert_eq!(perf_want(PerfOp::AllGather, 1, 3, 2, 5), perf_input(2, 1));
        assert_eq!(perf_want(PerfOp::AllToAll, 1, 3, 2, 5), perf_input(2, 3));
        assert_eq!(perf_want(PerfOp::SendRecv, 0, 3, 2, 4), perf_input(2, 4));
        assert_eq!(perf_count(PerfOp::AllGather, 100, 4, 3), 24);
        assert_eq!(perf_count(PerfOp::AllReduce, 2, 4, 3), 1);
    }
}

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

/// One test case: `Err` means "skipped", with the reason; a failure panics.
pub type Case = (&'static str, fn() -> Result<(), String>);

/// The exit status with which a case says it was skipped (xtask counts it so).
pub const SKIP_STATUS: u8 = 77;

/// The `main` of a multi-rank test program: `--list` prints the cases, `CASE` runs one as the
/// rank the environment describes.
pub fn run_cases(program: &str, cases: &[Case]) -> std::process::ExitCode {
    use std::process::ExitCode;
    init_logging();
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "--list" {
        for (name, _) in cases {
            println!("{name}");
        }
        return ExitCode::SUCCESS;
    }
    match cases.iter().find(|(name, _)| *name == arg) {
        Some((name, run)) => match run() {
            Ok(()) => {
                println!("{name}: ok");
                ExitCode::SUCCESS
            }
            Err(skip) => {
                println!("{name}: {skip}");
                ExitCode::from(SKIP_STATUS)
            }
        },
        None => {
            eprintln!("usage: {program} --list | CASE (unknown case {arg:?})");
            ExitCode::from(2)
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

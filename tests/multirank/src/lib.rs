//! Helpers shared by the multi-rank programs (tests, demo, benchmarks): environment, patterns,
//! logging, test cases and elements; the perf tools' part in [`perf`].

use std::time::Duration;

use dist_core::{Element, ReduceOp};
use dist_tcp::{TcpBackend, TcpConfig};
use half::{bf16, f16};

pub mod perf;

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

/// Rank 0's listener, as rank 0 publishes it in the job's store before the others have
/// joined (the key `<prefix>/0/init/addr/0`, whose value is the world size and the address:
/// dist-tcp's `init/store.rs`), waiting up to 30 s.
pub fn rank0_listener() -> std::net::SocketAddr {
    use dist_tcp::dist_store::{Store, TcpStore};
    let master = format!(
        "{}:{}",
        std::env::var("MASTER_ADDR").unwrap(),
        std::env::var("MASTER_PORT").unwrap()
    );
    let prefix = std::env::var("DIST_STORE_PREFIX")
        .unwrap_or_else(|_| dist_tcp::DEFAULT_STORE_PREFIX.into());
    let store = TcpStore::connect(master.as_str(), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    let key = format!("{prefix}/0/init/addr/0");
    let v = store
        .get(&key, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    // `<world size> <ip:port>`.
    let text = String::from_utf8_lossy(&v);
    text.rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("key {key} holds {text:?}"))
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
    /// It runs on this many simulated hosts (network namespaces, see `dist_launch::hosts`;
    /// needs root), its ranks spread over them; 0: on this host's loopback.
    pub hosts: usize,
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

/// Ranks of one host that read each other's buffers directly whatever the host's default
/// (`process_vm_readv`: the default only where it is fast), from 32 KiB, each rank's part split
/// over two threads.
pub const DIRECT: Variant = Variant {
    name: "direct",
    sizes: &[3, 4],
    env: &[
        ("DIST_DIRECT", "1"),
        ("DIST_DIRECT_MIN_KB", "32"),
        ("DIST_ARENA_THREADS", "2"),
    ],
};

/// Every TCP connection sealed (encrypted and authenticated per frame), shared memory off so
/// that every frame between the ranks goes over a sealed connection.
pub const SEALED: Variant = Variant {
    name: "sealed",
    sizes: &[2, 3, 5],
    env: &[
        ("DIST_SEAL", "1"),
        ("DIST_SECRET", "multirank-sealed-variant-secret"),
        ("DIST_SHM", "0"),
    ],
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
            hosts: 0,
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

    /// Runs on `hosts` simulated hosts (network namespaces; needs root and iproute2).
    pub const fn hosts(mut self, hosts: usize) -> Case {
        self.hosts = hosts;
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
        if self.hosts > 0 {
            needs.push("netns");
        }
        let tail = format!(
            "{}{}{}",
            if needs.is_empty() {
                String::new()
            } else {
                format!(" needs={}", needs.join(","))
            },
            if self.hosts > 0 {
                format!(" hosts={}", self.hosts)
            } else {
                String::new()
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
        if self.hosts > 0 && std::env::var_os("DIST_TEST_NETNS").is_none() {
            return Some(format!(
                "runs only on {} simulated hosts, which its launcher makes",
                self.hosts
            ));
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

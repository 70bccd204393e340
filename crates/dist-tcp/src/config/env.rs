//! A rank's configuration from its environment: the launcher's variables (torchrun, Slurm, Open
//! MPI, through [`LaunchEnv`]) and dist's own `DIST_*` variables, each checked.

use std::time::Duration;

use dist_core::{DistError, Result, Tuning};

use super::{ARENA_THREADS_LIMIT, Formation, MIN_TIMEOUT, TcpConfig};
use crate::launch::LaunchEnv;

impl TcpConfig {
    /// Reads the launcher's variables (torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `LOCAL_RANK`; Slurm's; Open MPI's: see [`LaunchEnv`]) and dist's own
    /// `DIST_TIMEOUT`, `DIST_INIT_TIMEOUT` (seconds), `DIST_SECRET`, and the tuning variables
    /// `DIST_TCP_PARALLEL` (0 or 1), `DIST_RING_PIECE_KB`, `DIST_TCP_LANES` (1 or 2) and
    /// `DIST_ARENA_MAX_KB`, `DIST_DIRECT` (0 or 1), `DIST_DIRECT_MIN_KB` and `DIST_ARENA_THREADS`, and
    /// `DIST_FORMATION` (`eager` or `lazy`) when present. The job's store: under torchrun with
    /// its agent's store (`TORCHELASTIC_USE_AGENT_STORE=True`), the store torchrun already
    /// serves at `MASTER_ADDR:MASTER_PORT`, and the keys under
    /// `dist/<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>`; `DIST_SERVE_STORE`
    /// (0 or 1) and `DIST_STORE_PREFIX` say otherwise.
    pub fn from_env() -> Result<TcpConfig> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`TcpConfig::from_env`] over any lookup function (for tests and embedding).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
        let env = LaunchEnv::detect(&get)?;
        Self::from_launch(&env, get)
    }

    /// A configuration for the rank `env` describes, with dist's own variables from `get`.
    pub fn from_launch(env: &LaunchEnv, get: impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
        let seconds = |k: &str| -> Result<Option<Duration>> {
            get(k)
                .map(|v| {
                    match v.trim().parse::<f64>().ok().filter(|s| *s > 0.0).map(|s| {
                        // Refuses NaN, infinities and what a Duration cannot hold (1e20).
                        Duration::try_from_secs_f64(s).ok().filter(|d| {
                            *d >= MIN_TIMEOUT && dist_core::transport::timeout_problem(*d).is_none()
                        })
                    }) {
                        Some(Some(d)) => Ok(d),
                        _ => Err(DistError::Config {
                            what: k.into(),
                            reason: format!(
                                "{v:?} is not a number of seconds from 0.001 up to {}",
                                dist_core::MAX_TIMEOUT.as_secs()
                            ),
                        }),
                    }
                })
                .transpose()
        };
        let mut cfg = TcpConfig::new(env.rank, env.world_size, env.master());
        cfg.local_rank = env.local_rank;
        if let Some(t) = seconds("DIST_TIMEOUT")? {
            cfg.timeout = t;
        }
        if let Some(t) = seconds("DIST_PEER_TIMEOUT")? {
            cfg.peer_timeout = t;
        }
        if let Some(t) = seconds("DIST_INIT_TIMEOUT")? {
            cfg.init_timeout = t;
        }
        if let Some(d) = get("DIST_TRACE_DIR").filter(|d| !d.is_empty()) {
            cfg.trace_dir = Some(d.into());
        }
        if let Some(v) = get("DIST_SEAL") {
            cfg.seal = match v.trim() {
                "0" => false,
                "1" => true,
                _ => {
                    return Err(DistError::Config {
                        what: "DIST_SEAL".into(),
                        reason: format!("{v:?} is neither 0 nor 1"),
                    });
                }
            };
        }
        if let Some(v) = get("DIST_SHM") {
            cfg.shm = match v.trim() {
                "0" => false,
                "1" => true,
                _ => {
                    return Err(DistError::Config {
                        what: "DIST_SHM".into(),
                        reason: format!("{v:?} is neither 0 nor 1"),
                    });
                }
            };
        }
        cfg.host_id = get("DIST_HOST_ID").filter(|h| !h.is_empty());
        // torchrun's agent serves a store at MASTER_ADDR:MASTER_PORT and says so; PyTorch's
        // own process groups then use it instead of serving one, and so does dist.
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim() == "True");
        cfg.serve_store = !agent_store;
        if let Some(run) = get("TORCHELASTIC_RUN_ID").filter(|r| !r.trim().is_empty()) {
            let attempt = get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
            cfg.store_prefix = format!("dist/{}/attempt_{}", run.trim(), attempt.trim());
        }
        if let Some(v) = get("DIST_SERVE_STORE") {
            cfg.serve_store = match v.trim() {
                "0" => false,
                "1" => true,
                _ => {
                    return Err(DistError::Config {
                        what: "DIST_SERVE_STORE".into(),
                        reason: format!("{v:?} is neither 0 nor 1"),
                    });
                }
            };
        }
        if let Some(v) = get("DIST_ELASTIC") {
            cfg.elastic = match v.trim() {
                "0" => false,
                "1" => true,
                _ => {
                    return Err(DistError::Config {
                        what: "DIST_ELASTIC".into(),
                        reason: format!("{v:?} is neither 0 nor 1"),
                    });
                }
            };
        }
        if let Some(v) = get("DIST_ADMIT") {
            cfg.admission = crate::Admission::parse(&v)?;
        }
        if let Some(p) = get("DIST_STORE_PREFIX") {
            cfg.store_prefix = p;
        }
        if let Some(s) = get("DIST_SECRET") {
            cfg.secret = Some(s.into_bytes());
        }
        if let Some(f) = get("DIST_FORMATION") {
            cfg.formation = match f.trim() {
                "auto" => Formation::Auto,
                "eager" => Formation::Eager,
                "lazy" => Formation::Lazy,
                _ => {
                    return Err(DistError::Config {
                        what: "DIST_FORMATION".into(),
                        reason: format!("{f:?} is none of \"auto\", \"eager\" and \"lazy\""),
                    });
                }
            };
        }
        let number = |k: &str, range: std::ops::RangeInclusive<u32>| -> Result<Option<u32>> {
            get(k)
                .map(|v| match v.trim().parse::<u32>() {
                    Ok(x) if range.contains(&x) => Ok(x),
                    _ => Err(DistError::Config {
                        what: k.into(),
                        reason: format!(
                            "{v:?} is not a whole number from {} to {}",
                            range.start(),
                            range.end()
                        ),
                    }),
                })
                .transpose()
        };
        cfg.parallel = number("DIST_TCP_PARALLEL", 0..=1)?.map(|x| x == 1);
        cfg.ring_piece_kb = number("DIST_RING_PIECE_KB", 1..=Tuning::MAX_PIECE_KB)?;
        cfg.lanes = number("DIST_TCP_LANES", 1..=Tuning::MAX_LANES)?;
        cfg.arena_max_kb = number("DIST_ARENA_MAX_KB", 0..=Tuning::MAX_ARENA_KB)?;
        if let Some(d) = number("DIST_DIRECT", 0..=1)? {
            cfg.direct = Some(d == 1);
        }
        cfg.direct_min_kb = number("DIST_DIRECT_MIN_KB", 0..=Tuning::MAX_ARENA_KB)?;
        cfg.arena_threads = number("DIST_ARENA_THREADS", 1..=ARENA_THREADS_LIMIT)?;
        // Read by the backend itself (`peer::spin_env`); checked here so that a value
        // that would spin a core for long is an error at init, not a silent busy loop.
        number("DIST_SPIN_US", 0..=crate::peer::SPIN_MAX_US)?;
        number("DIST_SMALL_SPIN_US", 0..=crate::peer::SPIN_MAX_US)?;
        cfg = crate::limits_from_env(cfg, &get)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

//! Where a rank learns who it is: the variables of the launchers users already run. torchrun
//! (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Slurm
//! (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the first host of SLURM_JOB_NODELIST when
//! MASTER_ADDR is unset) and Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE).
//! Explicit (torchrun-style) values win; two launchers that disagree, or a value that is
//! missing or malformed, is an error naming the variables.

use dist_core::{DistError, Result};

/// The launcher whose variables described this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// RANK / WORLD_SIZE were set (torchrun, `cargo xtask`, or by hand).
    Explicit,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
}

/// One rank's place in the job, as the environment describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The rank on this host, if known.
    pub local_rank: Option<usize>,
    /// The number of ranks on this host, if known.
    pub local_world_size: Option<usize>,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
    /// Which launcher's variables gave the rank.
    pub launcher: Launcher,
}

fn parse_num(name: &str, v: &str) -> Result<usize> {
    v.trim().parse::<usize>().map_err(|_| DistError::Config {
        what: name.into(),
        reason: format!("{v:?} is not a non-negative integer"),
    })
}

/// The first value among `names` (explicit first), checking that the launchers' values agree.
fn pick(
    get: &dyn Fn(&str) -> Option<String>,
    names: &[&str],
) -> Result<Option<(usize, &'static str)>> {
    let mut found: Vec<(String, usize)> = Vec::new();
    for n in names {
        if let Some(v) = get(n) {
            found.push((n.to_string(), parse_num(n, &v)?));
        }
    }
    let Some((first, value)) = found.first().cloned() else {
        return Ok(None);
    };
    // The explicit variable (first in `names`) wins over the launchers; launchers must agree.
    if first != names[0]
        && let Some((other, v2)) = found.iter().skip(1).find(|(_, v)| *v != value)
    {
        return Err(DistError::Config {
            what: format!("{first} and {other}"),
            reason: format!(
                "contradict each other ({value} vs {v2}); set {} to say which is meant",
                names[0]
            ),
        });
    }
    let source = match first.as_str() {
        s if s.starts_with("SLURM") => "slurm",
        s if s.starts_with("OMPI") => "ompi",
        _ => "explicit",
    };
    Ok(Some((value, source)))
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` gives `node01`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let mut depth = 0;
    let first = list
        .split(|c: char| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .next()?
        .trim();
    if first.is_empty() {
        return None;
    }
    match (first.find('['), first.find(']')) {
        (Some(a), Some(b)) if a < b => {
            let range = &first[a + 1..b];
            let lo = range.split([',', '-']).next()?.trim();
            Some(format!("{}{}{}", &first[..a], lo, &first[b + 1..]))
        }
        (None, None) => Some(first.to_string()),
        _ => None,
    }
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<LaunchEnv> {
        Self::detect(&|k| std::env::var(k).ok())
    }

    /// Reads any lookup function (tests, embedding).
    pub fn detect(get: &dyn Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let missing = |what: &str| DistError::Config {
            what: what.into(),
            reason: "not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; srun \
                     SLURM_PROCID and SLURM_NTASKS; mpirun OMPI_COMM_WORLD_RANK and _SIZE)"
                .into(),
        };
        let (rank, source) = pick(get, &["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"])?
            .ok_or_else(|| missing("RANK"))?;
        let (world_size, _) = pick(get, &["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"])?
            .ok_or_else(|| missing("WORLD_SIZE"))?;
        let local_rank = pick(
            get,
            &["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"],
        )?
        .map(|(v, _)| v);
        let local_world_size =
            pick(get, &["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])?.map(|(v, _)| v);
        if rank >= world_size {
            return Err(DistError::Config {
                what: "RANK".into(),
                reason: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
        if let (Some(l), Some(lw)) = (local_rank, local_world_size)
            && l >= lw
        {
            return Err(DistError::Config {
                what: "LOCAL_RANK".into(),
                reason: format!("local rank {l} is not below the local world size {lw}"),
            });
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            Some(_) => {
                return Err(DistError::Config {
                    what: "MASTER_ADDR".into(),
                    reason: "is empty".into(),
                });
            }
            None => match get("SLURM_JOB_NODELIST") {
                Some(list) => first_slurm_host(&list).ok_or_else(|| DistError::Config {
                    what: "SLURM_JOB_NODELIST".into(),
                    reason: format!("cannot read a host from {list:?}"),
                })?,
                None => return Err(missing("MASTER_ADDR")),
            },
        };
        // DIST_MASTER_PORT, if set, is the port; otherwise MASTER_PORT. Under torchrun the
        // job's store is the one torchrun's agent serves there (`TcpConfig::from_launch`).
        let (port_var, port_text) = match get("DIST_MASTER_PORT") {
            Some(p) => ("DIST_MASTER_PORT", p),
            None => (
                "MASTER_PORT",
                get("MASTER_PORT").ok_or_else(|| missing("MASTER_PORT"))?,
            ),
        };
        let master_port: u16 = port_text.trim().parse().map_err(|_| DistError::Config {
            what: port_var.into(),
            reason: format!("{port_text:?} is not a port number (0-65535)"),
        })?;
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            launcher: match source {
                "slurm" => Launcher::Slurm,
                "ompi" => Launcher::OpenMpi,
                _ => Launcher::Explicit,
            },
        })
    }

    /// `host:port` of rank 0, bracketing IPv6 addresses.
    pub fn master(&self) -> String {
        let h = &self.master_addr;
        if h.contains(':') && !h.starts_with('[') {
            format!("[{h}]:{}", self.master_port)
        } else {
            format!("{h}:{}", self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::env;

    #[test]
    fn torchrun() {
        let e = LaunchEnv::detect(&env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 8, Some(1), Some(2))
        );
        assert_eq!(
            (e.master(), e.launcher),
            ("10.0.0.1:29500".to_string(), Launcher::Explicit)
        );
    }

    /// Under torchrun the port is MASTER_PORT itself, where torchrun's agent serves the store
    /// the job forms through; DIST_MASTER_PORT wins over it.
    #[test]
    fn under_torchrun_the_port_of_its_store() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ];
        assert_eq!(LaunchEnv::detect(&env(&base)).unwrap().master_port, 29500);
        let mut v = base.to_vec();
        v.push(("DIST_MASTER_PORT", "4000"));
        assert_eq!(LaunchEnv::detect(&env(&v)).unwrap().master_port, 4000);
    }

    #[test]
    fn slurm_with_the_first_host_of_the_node_list() {
        let e = LaunchEnv::detect(&env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-10,12],login1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (5, 16, Some(1)));
        assert_eq!(
            (e.master_addr.as_str(), e.launcher),
            ("gpu07", Launcher::Slurm)
        );
        assert_eq!(first_slurm_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(first_slurm_host("n[1-3]-ib").as_deref(), Some("n1-ib"));
        assert_eq!(first_slurm_host(""), None);
        assert_eq!(first_slurm_host("broken[1-2"), None);
    }

    #[test]
    fn open_mpi() {
        let e = LaunchEnv::detect(&env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.launcher),
            (2, 4, Some(0), Launcher::OpenMpi)
        );
    }

    #[test]
    fn explicit_values_win_over_launchers() {
        let e = LaunchEnv::detect(&env(&[
            ("RANK", "1"),
            ("SLURM_PROCID", "7"),
            ("WORLD_SIZE", "2"),
            ("SLURM_NTASKS", "8"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.launcher),
            (1, 2, Launcher::Explicit)
        );
    }

    #[test]
    fn missing_and_contradictory_variables_are_named() {
        let e = LaunchEnv::detect(&env(&[("MASTER_ADDR", "x"), ("MASTER_PORT", "1")])).unwrap_err();
        assert!(e.to_string().contains("RANK: not set"), "{e}");
        let e = LaunchEnv::detect(&env(&[
            ("SLURM_PROCID", "1"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("SLURM_NTASKS", "4"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("SLURM_PROCID and OMPI_COMM_WORLD_RANK") && s.contains("contradict"),
            "{s}"
        );
        let e = LaunchEnv::detect(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR: not set"), "{e}");
        let e = LaunchEnv::detect(&env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "n1"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT: not set"), "{e}");
        let e = LaunchEnv::detect(&env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("LOCAL_RANK"), "{e}");
        let e = LaunchEnv::detect(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(
            e.to_string().contains("RANK") && e.to_string().contains("\"x\""),
            "{e}"
        );
    }
}

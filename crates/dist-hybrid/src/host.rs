//! Which ranks share a host: each rank's local rank, found by exchanging a host identity over
//! TCP, so that a rank picks the GPU of its place on its own host, not of its global rank.

use dist_core::{Backend, Collectives, DistError};
use dist_tcp::TcpBackend;

/// What makes two ranks "on one host": by default the kernel's boot id and the host name (two
/// containers of one machine with separate network namespaces still see each other's GPUs, and
/// share the boot id). `DIST_HOST_ID` overrides it, to simulate several hosts on one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostId(pub u64);

impl HostId {
    /// This process's host: `DIST_HOST_ID` if set, else the boot id and host name.
    pub fn here() -> HostId {
        if let Ok(v) = std::env::var("DIST_HOST_ID") {
            return HostId::of(&["DIST_HOST_ID", &v]);
        }
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let boot = read("/proc/sys/kernel/random/boot_id");
        let mut name = read("/proc/sys/kernel/hostname");
        if name.trim().is_empty() {
            name = std::env::var("HOSTNAME").unwrap_or_default();
        }
        HostId::of(&[boot.trim(), name.trim()])
    }

    /// The identity of the given parts (FNV-1a over each part and a separator): the same on
    /// every rank whatever its build, unlike std's hasher.
    pub fn of(parts: &[&str]) -> HostId {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for part in parts {
            for b in part.bytes().chain([0xff]) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        HostId(h)
    }
}

/// A rank's place among the ranks of its host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalRanks {
    /// How many lower ranks share this rank's host.
    pub local_rank: usize,
    /// How many ranks share this rank's host, this one included.
    pub local_size: usize,
}

/// This rank's local rank and local size, from every rank's host identity. Collective over the
/// TCP job: every rank must call it.
pub fn local_ranks(tcp: &TcpBackend, here: HostId) -> Result<LocalRanks, DistError> {
    let mut all = vec![0u64; tcp.world_size()];
    tcp.all_gather(&[here.0], &mut all)?;
    Ok(place(&all, tcp.rank()))
}

fn place(hosts: &[u64], me: usize) -> LocalRanks {
    let mine = hosts[me];
    LocalRanks {
        local_rank: hosts[..me].iter().filter(|&&h| h == mine).count(),
        local_size: hosts.iter().filter(|&&h| h == mine).count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_rank_counts_lower_ranks_of_the_same_host() {
        // Two hosts, ranks interleaved as a round-robin launcher places them.
        let (a, b) = (HostId::of(&["a"]).0, HostId::of(&["b"]).0);
        let hosts = [a, b, a, b, a];
        let got: Vec<(usize, usize)> = (0..5)
            .map(|r| {
                let p = place(&hosts, r);
                (p.local_rank, p.local_size)
            })
            .collect();
        assert_eq!(got, [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]);
    }

    #[test]
    fn host_identity_separates_its_parts() {
        assert_ne!(HostId::of(&["ab", "c"]), HostId::of(&["a", "bc"]));
        assert_eq!(HostId::of(&["x"]), HostId::of(&["x"]));
    }
}

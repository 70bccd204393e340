//! Simulated hosts: H network namespaces on this machine, each with its own address, joined by a
//! bridge, so that ranks on different "hosts" talk over a real (virtual) link that a test can cut
//! or slow down (a delay, a rate cap), while ranks on one host talk over its loopback.
//!
//! Layout, for a run whose names start with `dist-PID-K-` (`PID` this process, `K` a counter, so
//! concurrent runs and successive trials never collide):
//!
//! - namespace `dist-PID-K-br` holds the bridge `br0`;
//! - namespace `dist-PID-K-hI` (host I, 0-based) holds loopback (up) and `eth0`, the end of a veth
//!   pair whose other end (`hI`) is a port of the bridge; `eth0` has address
//!   `10.213.0.(I+1)/24`.
//!
//! With a delay ([`Hosts::with_delay`]) there is no bridge: each host's `eth0` is a TAP device
//! whose frames a hub in this process passes on to the other hosts after the delay.
//!
//! With a rate ([`Link::rate`], [`Hosts::with_link`]) each host's `eth0`, veth or TAP, sends
//! through a token bucket filter at that rate (`tc tbf`, see [`crate::rate`]).
//!
//! Nothing is made in the root namespace: deleting the namespaces deletes the bridge and every
//! veth with them (the TAP devices go with the hub's descriptors). [`Hosts`] deletes them when
//! dropped (after a failed run too), on SIGINT, SIGTERM or SIGHUP (the run loop notices
//! [`interrupted`] and stops the ranks, the guard deletes the namespaces and the process exits
//! with 128 + the signal's number, 130 for SIGINT), and [`Hosts::create`] first deletes those of
//! earlier runs whose process is gone (a run killed by SIGKILL). Needs root and iproute2 (`ip`).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use crate::delay::OnPath;

/// The first three octets of every simulated host's address.
pub const SUBNET: &str = "10.213.0";
/// The interface that links a simulated host to the bridge, inside its namespace.
pub const IFACE: &str = "eth0";
/// The most simulated hosts one run makes (addresses .1 to .250).
pub const MAX_HOSTS: usize = 250;
/// The prefix of every namespace name this module makes.
const PREFIX: &str = "dist-";

/// Makes each [`Hosts`] of this process a name of its own.
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Whether SIGINT, SIGTERM or SIGHUP arrived while simulated hosts existed: the launch loop then
/// stops its ranks, and dropping the [`Hosts`] deletes them and exits.
pub fn interrupted() -> bool {
    crate::signals::received() > 0
}

/// How the simulated hosts are joined: by a bridge, or with a delay by the hub; and each host's
/// link capped at a rate or not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Link {
    /// Added to every frame between two hosts (the hub instead of the bridge).
    pub delay: Option<Duration>,
    /// What each host may send, in bits per second (`tc tbf` on its `eth0`).
    pub rate: Option<crate::rate::Rate>,
}

/// H simulated hosts; dropping it deletes them.
#[derive(Debug)]
pub struct Hosts {
    prefix: String,
    count: usize,
    /// The namespaces made so far (all of them once [`Hosts::create`] returns).
    made: Vec<String>,
    /// SIGINT, SIGTERM and SIGHUP caught while the hosts exist; the dispositions it replaced
    /// come back when it drops.
    caught: Option<crate::signals::Caught>,
    /// How many signals this process had caught before the hosts were made: a run on them
    /// stops for any that came after, even before the run began.
    signals_before: usize,
    /// With a delay: the hub that links the hosts' TAP devices instead of the bridge.
    hub: Option<crate::delay::Hub>,
    /// How the hosts are joined.
    link: Link,
}

/// Runs `ip ARGS` (or `tc`), failing with its stderr.
fn tool(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("run {program}: {e} (is iproute2 installed?)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    tool("ip", args)
}

/// The names `ip netns list` shows.
pub fn namespaces() -> Result<Vec<String>, String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map_err(|e| format!("run ip: {e} (is iproute2 installed?)"))?;
    if !out.status.success() {
        return Err(format!(
            "ip netns list failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // Lines are `NAME` or `NAME (id: N)`.
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

/// Why simulated hosts cannot be made here, if they cannot: not root, no `ip`, or the kernel or
/// a container refusing a namespace (tried once: a namespace made and deleted).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions, touches no memory of ours and cannot fail (the
    // integration test `simulated_hosts_place_ranks_in_blocks` calls it first).
    if unsafe { libc::geteuid() } != 0 {
        return Some("simulated hosts need root (network namespaces)".into());
    }
    let probe = format!("{PREFIX}{}-probe", std::process::id());
    if let Err(e) = ip(&["netns", "add", &probe]) {
        return Some(format!("cannot make a network namespace: {e}"));
    }
    ip(&["netns", "del", &probe])
        .err()
        .map(|e| format!("cannot delete a network namespace: {e}"))
}

/// The pid in a name this module made (`dist-PID-…`), if it is one.
fn owner(name: &str) -> Option<u32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Deletes the namespaces of earlier runs whose process no longer exists.
fn sweep_stale() {
    for name in namespaces().unwrap_or_default() {
        if let Some(pid) = owner(&name)
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

impl Hosts {
    /// Makes `count` simulated hosts (see the module docs). On failure, whatever was made is
    /// deleted before the error returns.
    pub fn create(count: usize) -> Result<Hosts, String> {
        Hosts::with_link(count, Link::default())
    }

    /// [`Hosts::create`], with `delay` added to every frame between two hosts: each host's
    /// `eth0` is then a TAP device, and a hub in this process passes each frame on after
    /// `delay` (a round trip between hosts gains 2 × `delay`; loopback nothing). Not `tc
    /// netem`, which kernels without `CONFIG_NET_SCH_NETEM` (this project's) lack.
    pub fn with_delay(count: usize, delay: Duration) -> Result<Hosts, String> {
        Hosts::with_link(
            count,
            Link {
                delay: Some(delay),
                rate: None,
            },
        )
    }

    /// [`Hosts::create`] with the delay and the rate cap `link` asks for. A rate needs `tc` and
    /// a kernel with the token bucket filter; without them this fails, saying so.
    pub fn with_link(count: usize, link: Link) -> Result<Hosts, String> {
        Hosts::make(count, link, None)
    }

    /// [`Hosts::with_delay`] with `on_path` on the hub: something on the path between the
    /// hosts that sees every frame and may change, drop or add frames (see [`OnPath`]), for
    /// tests of what such a thing can do to the hosts' connections.
    pub fn with_path(count: usize, delay: Duration, on_path: OnPath) -> Result<Hosts, String> {
        let link = Link {
            delay: Some(delay),
            rate: None,
        };
        Hosts::make(count, link, Some(on_path))
    }

    fn make(count: usize, link: Link, on_path: Option<OnPath>) -> Result<Hosts, String> {
        if !(1..=MAX_HOSTS).contains(&count) {
            return Err(format!(
                "{count} simulated hosts: from 1 to {MAX_HOSTS} are possible"
            ));
        }
        sweep_stale();
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let mut hosts = Hosts {
            prefix: format!("{PREFIX}{}-{k}-", std::process::id()),
            count,
            made: Vec::new(),
            signals_before: crate::signals::received(),
            caught: Some(crate::signals::catch()),
            hub: None,
            link,
        };
        if let Some(delay) = link.delay {
            let mut taps = Vec::new();
            for h in 0..count {
                let ns = hosts.netns(h);
                hosts.add_namespace(&ns)?;
                taps.push(crate::delay::tap_in(&ns, IFACE)?);
                hosts.address(h)?;
                hosts.shape(h)?;
            }
            hosts.hub = Some(crate::delay::Hub::start(taps, delay, on_path));
            return Ok(hosts);
        }
        // `hosts` is dropped (and what it made deleted) if any step fails.
        let br = hosts.bridge_ns();
        hosts.add_namespace(&br)?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for h in 0..count {
            let ns = hosts.netns(h).to_string();
            hosts.add_namespace(&ns)?;
            let port = format!("h{h}");
            ip(&[
                "-n", &br, "link", "add", &port, "type", "veth", "peer", "name", IFACE, "netns",
                &ns,
            ])?;
            ip(&["-n", &br, "link", "set", &port, "master", "br0", "up"])?;
            hosts.address(h)?;
            hosts.shape(h)?;
        }
        if interrupted() {
            return Err("interrupted".into());
        }
        Ok(hosts)
    }

    /// Host `h`'s address on its `eth0`, which goes up, and its loopback up.
    fn address(&self, h: usize) -> Result<(), String> {
        let ns = self.netns(h);
        let cidr = format!("{}/24", self.addr(h));
        ip(&["-n", &ns, "addr", "add", &cidr, "dev", IFACE])?;
        ip(&["-n", &ns, "link", "set", IFACE, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])
    }

    /// Host `h`'s `eth0` capped at the link's rate, if it has one.
    fn shape(&self, h: usize) -> Result<(), String> {
        match self.link.rate {
            Some(rate) => crate::rate::shape(&self.netns(h), IFACE, rate),
            None => Ok(()),
        }
    }

    /// How the hosts are joined.
    pub fn link(&self) -> Link {
        self.link
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), String> {
        ip(&["netns", "add", name])?;
        self.made.push(name.to_string());
        Ok(())
    }

    /// How many signals this process had caught before the hosts were made.
    pub(crate) fn signals_before(&self) -> usize {
        self.signals_before
    }

    /// The number of hosts.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The prefix of every namespace name of this run.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn bridge_ns(&self) -> String {
        format!("{}br", self.prefix)
    }

    /// The namespace of host `h`.
    pub fn netns(&self, h: usize) -> String {
        format!("{}h{h}", self.prefix)
    }

    /// The address of host `h`.
    pub fn addr(&self, h: usize) -> String {
        format!("{SUBNET}.{}", h + 1)
    }

    /// The host of `rank` in a job of `world` ranks: blocks of consecutive ranks, as even as
    /// possible, rank 0 on host 0 (4 ranks on 2 hosts: 0 and 1 on host 0, 2 and 3 on host 1).
    pub fn host_of(&self, rank: usize, world: usize) -> usize {
        rank * self.count / world.max(1)
    }

    /// The ranks of `world` on host `h`.
    pub fn ranks_of(&self, h: usize, world: usize) -> std::ops::Range<usize> {
        let first = (0..world).find(|r| self.host_of(*r, world) >= h);
        let first = first.unwrap_or(world);
        let end = (first..world)
            .find(|r| self.host_of(*r, world) > h)
            .unwrap_or(world);
        first..end
    }

    /// Deletes every namespace of this run; the names it could not delete, with why.
    fn delete(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        // Hosts first, then the bridge: each veth goes with its host's namespace.
        for name in self.made.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &name]) {
                left.push(e);
            }
        }
        // Anything of this run's prefix that a failed step left unrecorded.
        for name in namespaces().unwrap_or_default() {
            if name.starts_with(&self.prefix)
                && let Err(e) = ip(&["netns", "del", &name])
            {
                left.push(e);
            }
        }
        left
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // The hub's descriptors hold the TAP devices: stop it first.
        drop(self.hub.take());
        for e in self.delete() {
            eprintln!("warning: simulated hosts: {e}");
        }
        drop(self.caught.take());
        if interrupted() {
            eprintln!("interrupted: simulated hosts {}* deleted", self.prefix);
            let sig = crate::signals::last().unwrap_or(libc::SIGINT);
            std::process::exit(128 + sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Placement by blocks without making any namespace.
    fn placement(count: usize) -> Hosts {
        Hosts {
            prefix: "dist-0-0-".into(),
            count,
            made: Vec::new(),
            signals_before: 0,
            caught: None,
            hub: None,
            link: Link::default(),
        }
    }

    #[test]
    fn ranks_go_to_hosts_in_blocks() {
        let h = placement(2);
        let of = |w: usize| (0..w).map(|r| h.host_of(r, w)).collect::<Vec<_>>();
        assert_eq!(of(4), [0, 0, 1, 1]);
        assert_eq!(of(5), [0, 0, 0, 1, 1]);
        assert_eq!(h.ranks_of(1, 5), 3..5);
        let h3 = placement(3);
        assert_eq!(
            (0..5).map(|r| h3.host_of(r, 5)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2]
        );
        assert_eq!(h3.ranks_of(0, 5), 0..2);
        assert_eq!(h3.ranks_of(2, 5), 4..5);
        assert_eq!(h.netns(1), "dist-0-0-h1");
        assert_eq!(h.addr(1), "10.213.0.2");
        assert_eq!(owner("dist-1234-7-h1"), Some(1234));
        assert_eq!(owner("other-1234"), None);
    }
}

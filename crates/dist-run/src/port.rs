//! Rank 0's port: one that is free now and outside the kernel's ephemeral range where the range
//! leaves room, so that no outgoing connection or `bind(0)` of another program takes it between
//! the launcher's check and rank 0's bind. A port the caller names is checked the same way.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::{Ipv4Addr, TcpListener};
use std::ops::RangeInclusive;

use crate::Error;

/// Where the kernel reads its ephemeral range.
const EPHEMERAL: &str = "/proc/sys/net/ipv4/ip_local_port_range";
/// Linux's default ephemeral range, where the file cannot be read.
const DEFAULT_EPHEMERAL: RangeInclusive<u16> = 32768..=60999;
/// The lowest port picked (below are well-known services and those many programs default to).
const LOWEST: u16 = 20000;
/// Ports tried outside the ephemeral range before falling back to one the kernel gives.
const TRIES: usize = 64;

/// The kernel's ephemeral range, `lo..=hi`.
pub fn ephemeral_range() -> RangeInclusive<u16> {
    std::fs::read_to_string(EPHEMERAL)
        .ok()
        .and_then(|s| parse_range(&s))
        .unwrap_or(DEFAULT_EPHEMERAL)
}

fn parse_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut it = text.split_whitespace().map(|w| w.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some(lo..=hi)
}

/// The ports outside `ephemeral`, from [`LOWEST`] up: `(first, count)` of the run below it and
/// of the run above it.
fn candidates(ephemeral: &RangeInclusive<u16>) -> [(u16, u32); 2] {
    let below = (*ephemeral.start()).saturating_sub(LOWEST) as u32;
    let above_first = ephemeral.end().saturating_add(1).max(LOWEST);
    let above = if *ephemeral.end() == u16::MAX {
        0
    } else {
        u16::MAX as u32 - above_first as u32 + 1
    };
    [(LOWEST, below), (above_first, above)]
}

/// Whether nothing is bound to `port` on any address (a listener on one address, or a socket
/// bound to it, makes the bind fail).
fn free(port: u16) -> std::io::Result<()> {
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).map(drop)
}

/// A port free a moment ago, outside the ephemeral range where the range leaves room, else one
/// the kernel gives.
pub fn free_port() -> Result<u16, Error> {
    let [(a, na), (b, nb)] = candidates(&ephemeral_range());
    let total = na + nb;
    if total > 0 {
        let random = RandomState::new();
        for i in 0..TRIES {
            let k = (random.hash_one(i) % total as u64) as u32;
            let port = if k < na {
                a as u32 + k
            } else {
                b as u32 + k - na
            };
            let port = port as u16;
            if free(port).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(Error::NoPort)?;
    Ok(l.local_addr().map_err(Error::NoPort)?.port())
}

/// `port` if it is free now; otherwise why not, naming it.
pub fn check(port: u16) -> Result<u16, Error> {
    free(port).map_err(|source| Error::PortTaken { port, source })?;
    Ok(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_candidates_avoid_them() {
        assert_eq!(parse_range("32768\t60999\n"), Some(32768..=60999));
        assert_eq!(parse_range("9 1"), None);
        assert_eq!(parse_range("x"), None);
        let [(a, na), (b, nb)] = candidates(&(32768..=60999));
        assert_eq!((a, na), (20000, 12768));
        assert_eq!((b, nb), (61000, 4536));
        // A range that covers everything from LOWEST leaves nothing to pick.
        assert_eq!(candidates(&(1024..=65535)), [(20000, 0), (65535, 0)]);
    }

    #[test]
    fn a_picked_port_is_outside_the_ephemeral_range_and_free() {
        let eph = ephemeral_range();
        let mut taken = Vec::new();
        for _ in 0..5 {
            let p = free_port().unwrap();
            if *eph.start() > LOWEST || *eph.end() < u16::MAX {
                assert!(!eph.contains(&p), "{p} is inside {eph:?}");
            }
            // Another program on this machine may take it in between, rarely.
            if let Err(e) = check(p) {
                taken.push(e.to_string());
            }
        }
        assert!(taken.len() <= 1, "picked ports taken at once: {taken:?}");
    }

    #[test]
    fn a_taken_port_is_named() {
        let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let e = check(port).unwrap_err().to_string();
        assert!(e.contains(&format!("port {port}")), "{e}");
    }
}

//! A rate cap on each simulated host's link: the kernel's token bucket filter (`tc qdisc ...
//! tbf`) as the root qdisc of the host's `eth0` (the veth end with the bridge, the TAP device
//! with the delay hub), inside the host's namespace. It shapes what the host sends; what it
//! receives is bounded by its senders' caps (every host has one), not shaped a second time.
//!
//! The bucket holds [`Rate::burst`] bytes (1 ms at the rate, at least 128 KiB, so that a 64 KiB
//! segmentation-offload packet of the veth passes whole instead of being cut up in software),
//! and a packet may wait [`LATENCY`] in its queue before it is dropped. A transfer of N bytes
//! from one host therefore takes at least (N − burst) · 8 / rate seconds.

use std::fmt;
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

/// How long a packet may wait in a host's shaping queue (tbf's `latency`) before it is dropped.
pub const LATENCY: Duration = Duration::from_millis(50);
/// The least bucket, in bytes: room for a whole 64 KiB offload packet, twice.
pub const MIN_BURST: u64 = 128 << 10;

/// A link rate, in bits per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    bits_per_second: u64,
}

impl Rate {
    /// A rate of `bits_per_second` (at least 8 bit/s, a byte a second).
    pub fn new(bits_per_second: u64) -> Result<Rate, String> {
        if bits_per_second < 8 {
            return Err(format!(
                "a rate of {bits_per_second} bit/s: at least 8 bit/s is possible"
            ));
        }
        Ok(Rate { bits_per_second })
    }

    /// Bits per second.
    pub fn bits_per_second(self) -> u64 {
        self.bits_per_second
    }

    /// Bytes per second.
    pub fn bytes_per_second(self) -> f64 {
        self.bits_per_second as f64 / 8.0
    }

    /// The token bucket's size in bytes: 1 ms at this rate, at least [`MIN_BURST`].
    pub fn burst(self) -> u64 {
        (self.bits_per_second / 8 / 1000).max(MIN_BURST)
    }

    /// The least time `bytes` sent by one host take through this cap (the bucket starts full).
    pub fn least_time(self, bytes: u64) -> Duration {
        let shaped = bytes.saturating_sub(self.burst());
        Duration::from_secs_f64(shaped as f64 / self.bytes_per_second())
    }
}

impl FromStr for Rate {
    type Err = String;

    /// `N`, `Nbit`, `Nkbit`, `Nmbit` or `Ngbit` (powers of 1000, as `tc` reads them; N may have
    /// a fraction): `1gbit`, `100mbit`, `2.5gbit`. Bytes (`tc`'s `bps`) are refused, as too easy
    /// to misread.
    fn from_str(text: &str) -> Result<Rate, String> {
        let t = text.trim().to_ascii_lowercase();
        let digits = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(digits);
        let scale = match unit {
            "" | "bit" => 1.0,
            "kbit" => 1e3,
            "mbit" => 1e6,
            "gbit" => 1e9,
            _ => {
                return Err(format!(
                    "{text:?} is not a rate: a number of bit/s with bit, kbit, mbit or gbit \
                     (1gbit, 100mbit)"
                ));
            }
        };
        let n: f64 = number
            .parse()
            .map_err(|_| format!("{text:?} is not a rate: no number before {unit:?}"))?;
        let bits = n * scale;
        if !bits.is_finite() || bits > u64::MAX as f64 / 2.0 {
            return Err(format!("{text:?} is not a rate: too large"));
        }
        Rate::new(bits.round() as u64)
    }
}

impl fmt::Display for Rate {
    /// The shortest of `Ngbit`, `Nmbit`, `Nkbit`, `Nbit` that is exact.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_second;
        for (scale, unit) in [
            (1_000_000_000, "gbit"),
            (1_000_000, "mbit"),
            (1_000, "kbit"),
        ] {
            if b.is_multiple_of(scale) {
                return write!(f, "{}{unit}", b / scale);
            }
        }
        write!(f, "{b}bit")
    }
}

/// The `tc` arguments that cap `iface` in namespace `netns` at `rate`.
pub(crate) fn tbf_args(netns: &str, iface: &str, rate: Rate) -> Vec<String> {
    [
        "-n",
        netns,
        "qdisc",
        "replace",
        "dev",
        iface,
        "root",
        "tbf",
        "rate",
        &format!("{}bit", rate.bits_per_second()),
        "burst",
        &rate.burst().to_string(),
        "latency",
        &format!("{}ms", LATENCY.as_millis()),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Caps `iface` of namespace `netns` at `rate` (see the module docs).
pub(crate) fn shape(netns: &str, iface: &str, rate: Rate) -> Result<(), String> {
    let args = tbf_args(netns, iface, rate);
    let out = Command::new("tc").args(&args).output().map_err(|e| {
        format!("cannot cap a link at {rate}: run tc: {e} (is iproute2 installed?)")
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "cannot cap {iface} of {netns} at {rate}: tc {} failed ({}): {} (the kernel needs the \
         token bucket filter, CONFIG_NET_SCH_TBF)",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

/// Why simulated hosts with a rate cannot be made here, if they cannot: those of
/// [`crate::hosts::unavailable`], or no `tc`, or a kernel without tbf (tried once, on the
/// loopback of a namespace made and deleted).
pub fn unavailable() -> Option<String> {
    if let Some(why) = crate::hosts::unavailable() {
        return Some(why);
    }
    let probe = format!("dist-{}-rate-probe", std::process::id());
    let add = Command::new("ip").args(["netns", "add", &probe]).status();
    if !add.is_ok_and(|s| s.success()) {
        return Some(format!("cannot make the network namespace {probe}"));
    }
    let why = shape(
        &probe,
        "lo",
        Rate::new(1_000_000).expect("1 Mbit/s is a rate"),
    )
    .err();
    let _ = Command::new("ip").args(["netns", "del", &probe]).status();
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_tc_reads_them() {
        let r = |t: &str| t.parse::<Rate>().map(Rate::bits_per_second);
        assert_eq!(r("1gbit"), Ok(1_000_000_000));
        assert_eq!(r("100Mbit"), Ok(100_000_000));
        assert_eq!(r("2.5gbit"), Ok(2_500_000_000));
        assert_eq!(r("64kbit"), Ok(64_000));
        assert_eq!(r("12345"), Ok(12_345));
        assert_eq!(r("800bit"), Ok(800));
        for (bad, says) in [
            ("1gbps", "not a rate"),
            ("fast", "not a rate"),
            ("mbit", "no number"),
            ("1.2.3mbit", "no number"),
            ("4", "at least 8 bit/s"),
            ("1e30gbit", "not a rate"),
        ] {
            let e = bad.parse::<Rate>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let shown = |t: &str| t.parse::<Rate>().unwrap().to_string();
        assert_eq!(shown("1000mbit"), "1gbit");
        assert_eq!(shown("2.5gbit"), "2500mbit");
        assert_eq!(shown("12345"), "12345bit");
    }

    #[test]
    fn the_bucket_is_a_millisecond_or_two_offload_packets() {
        let r = |t: &str| t.parse::<Rate>().unwrap();
        assert_eq!(r("100mbit").burst(), MIN_BURST);
        assert_eq!(r("10gbit").burst(), 1_250_000);
        // 16 MiB at 100 Mbit/s: (16 MiB − 128 KiB) · 8 / 1e8 s.
        let t = r("100mbit").least_time(16 << 20);
        let want = ((16u64 << 20) - MIN_BURST) * 8 / 100;
        assert!(t.as_micros().abs_diff(u128::from(want)) <= 1, "{t:?}");
        assert_eq!(r("1gbit").least_time(1000), Duration::ZERO);
        let args = tbf_args("ns", "eth0", r("1gbit")).join(" ");
        assert_eq!(
            args,
            "-n ns qdisc replace dev eth0 root tbf rate 1000000000bit burst 131072 latency 50ms"
        );
    }
}

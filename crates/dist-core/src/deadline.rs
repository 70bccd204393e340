//! Deadlines from caller- or environment-supplied timeouts, without overflowing the clock.

use std::time::{Duration, Instant};

use crate::{DistError, Result};

/// The longest timeout dist accepts: 100 years (365-day years). Anything longer is an error
/// that names it, not a panic inside `Instant + Duration`; a caller that means "forever" can
/// pass this.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Why a timeout cannot be used, or `None` when it can: the text for an error that names it.
pub fn timeout_problem(timeout: Duration) -> Option<String> {
    (timeout > MAX_TIMEOUT).then(|| {
        format!(
            "a timeout of {timeout:?} is longer than the longest supported, {} s (100 years)",
            MAX_TIMEOUT.as_secs()
        )
    })
}

/// The instant `timeout` after `start`. A timeout over [`MAX_TIMEOUT`], or one the clock
/// cannot add, is [`DistError::InvalidArgument`] naming `rank`, the operation (`op` is only
/// called then) and the timeout.
pub fn deadline_after(
    start: Instant,
    timeout: Duration,
    rank: usize,
    op: impl FnOnce() -> String,
) -> Result<Instant> {
    match timeout_problem(timeout) {
        None => start.checked_add(timeout).ok_or_else(|| {
            format!("a timeout of {timeout:?} puts the deadline past what the clock can represent")
        }),
        Some(p) => Err(p),
    }
    .map_err(|reason| DistError::InvalidArgument {
        rank,
        op: op(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_are_errors_naming_them() {
        let now = Instant::now();
        let ten = Duration::from_secs(10);
        assert_eq!(
            deadline_after(now, ten, 0, || "x".into()).unwrap(),
            now + ten
        );
        assert!(deadline_after(now, MAX_TIMEOUT, 0, || "x".into()).is_ok());
        for t in [
            MAX_TIMEOUT + Duration::from_nanos(1),
            Duration::from_secs(u64::MAX),
            Duration::MAX,
        ] {
            let e = deadline_after(now, t, 3, || "recv(tag 1)".into()).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(e, DistError::InvalidArgument { rank: 3, .. }),
                "{text}"
            );
            assert!(
                text.contains("recv(tag 1)") && text.contains(&format!("{t:?}")),
                "{text}"
            );
        }
    }
}

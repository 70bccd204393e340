//! The policy that says when the members of an elastic job take in the processes waiting to
//! join it ([`TcpConfig::admission`](crate::TcpConfig::admission)).

use dist_core::{DistError, Result};

/// When the members take in joiners ([`TcpBackend::join`](crate::TcpBackend::join)). The
/// members never look for joiners on their own: they do at the calls that move the group to a
/// new epoch, [`TcpBackend::admit`](crate::TcpBackend::admit) (between steps, on every member)
/// and [`TcpBackend::recover`](crate::TcpBackend::recover). A joiner waits, registered in the
/// store, until one of them takes it in or its own deadline passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Admission {
    /// At the first `admit` (or `recover`) after it registered: the default (`DIST_ADMIT=admit`).
    AtAdmit,
    /// Only at the next recovery's agreement: `admit` takes none in (`DIST_ADMIT=recovery`).
    AtRecovery,
    /// Once at least this many joiners wait, all of them together, at `admit` or `recover`
    /// (`DIST_ADMIT=at-least:N`, N at least 1).
    AtLeast(usize),
}

/// The call at which the members look for joiners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moment {
    /// [`TcpBackend::admit`](crate::TcpBackend::admit).
    Admit,
    /// [`TcpBackend::recover`](crate::TcpBackend::recover), or a later agreement of one.
    Recovery,
    /// [`TcpBackend::recover_members`](crate::TcpBackend::recover_members): no joiner is
    /// taken in, whatever the policy.
    MembersOnly,
}

impl Admission {
    /// The policy `DIST_ADMIT` names.
    pub(crate) fn parse(v: &str) -> Result<Admission> {
        let bad = || DistError::Config {
            what: "DIST_ADMIT".into(),
            reason: format!("{v:?} is none of \"admit\", \"recovery\" and \"at-least:N\" (N >= 1)"),
        };
        match v.trim() {
            "admit" => Ok(Admission::AtAdmit),
            "recovery" => Ok(Admission::AtRecovery),
            other => match other.strip_prefix("at-least:").map(str::parse::<usize>) {
                Some(Ok(n)) if n >= 1 => Ok(Admission::AtLeast(n)),
                _ => Err(bad()),
            },
        }
    }

    /// Whether `waiting` joiners are taken in at `moment`.
    pub(crate) fn takes(self, waiting: usize, moment: Moment) -> bool {
        waiting > 0
            && moment != Moment::MembersOnly
            && match self {
                Admission::AtAdmit => true,
                Admission::AtRecovery => moment == Moment::Recovery,
                Admission::AtLeast(n) => waiting >= n,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policies_parse_and_say_when_joiners_come_in() {
        assert_eq!(Admission::parse("admit").unwrap(), Admission::AtAdmit);
        assert_eq!(
            Admission::parse(" recovery").unwrap(),
            Admission::AtRecovery
        );
        assert_eq!(
            Admission::parse("at-least:2").unwrap(),
            Admission::AtLeast(2)
        );
        for bad in ["", "at-least:0", "at-least:x", "soon"] {
            let e = Admission::parse(bad).unwrap_err().to_string();
            assert!(e.contains("DIST_ADMIT"), "{bad:?}: {e}");
        }
        use Moment::{Admit, Recovery};
        assert!(Admission::AtAdmit.takes(1, Admit));
        assert!(!Admission::AtAdmit.takes(0, Recovery));
        assert!(!Admission::AtRecovery.takes(3, Admit));
        assert!(Admission::AtRecovery.takes(1, Recovery));
        assert!(!Admission::AtLeast(2).takes(1, Recovery));
        assert!(Admission::AtLeast(2).takes(2, Admit));
        for p in [
            Admission::AtAdmit,
            Admission::AtRecovery,
            Admission::AtLeast(1),
        ] {
            assert!(!p.takes(5, Moment::MembersOnly), "{p:?}");
        }
    }
}
